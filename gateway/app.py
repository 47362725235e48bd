"""The FastAPI application: routes, the error boundary, request metrics and the router channel's
lifetime (opened when the app starts, closed when it stops)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.body_limit import BodyLimitMiddleware
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.request_id import RequestIdMiddleware
from gateway.router_client import RouterLink
from gateway.routes import api, ops
from gateway.settings import GatewaySettings, settings_from_worker_env
from gateway.state import GatewayState
from microserving import tracing
from microserving.gc_tuning import freeze_startup_heap


class RequestMetricsMiddleware:
    """Counts every HTTP request by route and status (a pure ASGI middleware: it neither buffers
    streamed bodies nor hides client disconnects)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 499}  # stays 499 when the client leaves before any response

        async def record_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", "unmatched")
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


def create_app(settings: GatewaySettings, freeze_heap: bool = False,
               router: Callable[[], RouterLink] | None = None) -> FastAPI:
    """`freeze_heap`: the process serves only this app (the CLI's, each worker's), so its
    startup heap is frozen once the app is built (microserving/gc_tuning.py); an app embedded
    in another process leaves that process's collector alone. `router`: makes the router link
    in the serving loop (`microserving serve`: a router in this process), in place of a gRPC
    client of `settings.router`; started before the app serves, closed after."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = GatewayState.create(settings, metrics, None if router is None else router())
        app.state.gateway = state
        if state.router.metrics_registry is not None:
            metrics.also_render(state.router.metrics_registry)
        await state.router.start()
        if freeze_heap:
            freeze_startup_heap()
        try:
            yield
        finally:
            await state.router.close()

    app = FastAPI(title="microserving gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.include_router(api)
    app.include_router(ops)
    install_error_handlers(app, on_error=metrics.count_error)
    # Added last = outermost: the metrics middleware also counts the 413s and 408s.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)
    tracing.configure("gateway")
    return app


def app_from_worker_env() -> FastAPI:
    """The app of one worker process of `microserving gateway --workers N` (uvicorn's factory:
    each worker builds its own app, router channels and streams)."""
    return create_app(settings_from_worker_env(), freeze_heap=True)
