"""The HTTP routes: thin functions that hand each request to its serving object."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from grpc import aio

from gateway.errors import NOT_FOUND, UNAVAILABLE, GatewayError, from_rpc_error
from gateway.protocol.base import dump
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completion import CompletionRequest
from gateway.protocol.models import ModelCard, ModelList
from gateway.state import GatewayState


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def _authorized(request: Request) -> None:
    _state(request).api_keys.check(request.headers.get("authorization"))


api = APIRouter(prefix="/v1", dependencies=[Depends(_authorized)])
ops = APIRouter()


@api.post("/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _state(request).completions.handle(body, request)


@api.post("/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _state(request).chat.handle(body, request)


async def _model_cards(request: Request) -> list[ModelCard]:
    state = _state(request)
    try:
        reply = await state.router.list_models()
    except aio.AioRpcError as error:
        raise from_rpc_error(error) from None
    return [ModelCard(id=m.id, created=m.created, owned_by=m.owned_by or "microserving",
                      max_model_len=m.max_context_length or None) for m in reply.models]


@api.get("/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(dump(ModelList(data=await _model_cards(request))))


@api.get("/models/{model_id:path}")  # :path: Hugging Face ids hold a slash ("org/name")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    for card in await _model_cards(request):
        if card.id == model_id:
            return JSONResponse(dump(card))
    raise GatewayError(NOT_FOUND, f"the model {model_id!r} does not exist", "model")


@ops.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    if not await state.router.is_serving(state.settings.health_timeout_s):
        raise GatewayError(UNAVAILABLE, f"router {state.router.address} is not serving")
    return JSONResponse({"status": "ok", "router": state.router.address})


@ops.get("/metrics")
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
