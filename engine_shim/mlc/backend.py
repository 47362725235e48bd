"""The MLC backend: speaks a running MLC-LLM server's /microserving/* HTTP routes through one
pooled httpx client (KV then moves engine to engine by MLC's own NVSHMEM path)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from engine_shim.backend import BackendInfo, Reservation, SendResult, drain_generate
from engine_shim.engine.api import (
    EngineStatus,
    GenerateOutput,
    InvalidRequestError,
    KVLayout,
    PrefixCacheStats,
    SamplingParams,
    UnavailableError,
    Usage,
)
from engine_shim.mlc import protocol
from engine_shim.mlc.launcher import MLCProcess
from engine_shim.mlc.sse import sse_json
from engine_shim.settings import ShimSettings
from engine_shim.token_bytes import TokenBytes
from microserving.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _max_context_length(model: str) -> int:
    """From mlc-chat-config.json / config.json, or the preset of the same name."""
    for name, key in (
        ("mlc-chat-config.json", "context_window_size"),
        ("config.json", "max_position_embeddings"),
    ):
        path = Path(model) / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get(key)
            if isinstance(value, int) and value > 0:
                return value
    from engine_shim.engine.config import resolve_model_config

    return resolve_model_config(model).max_position_embeddings


class MLCBackend:
    def __init__(self, settings: ShimSettings) -> None:
        self._settings = settings
        self._client: httpx.AsyncClient | None = None
        self._process: MLCProcess | None = None
        self._info: BackendInfo | None = None
        self._tokenizer = Tokenizer.from_model(settings.model)
        self._token_bytes = TokenBytes(settings.model)
        self._model_name = settings.model
        self._streams: dict[str, httpx.Response] = {}

    @property
    def info(self) -> BackendInfo:
        if self._info is None:
            raise RuntimeError("mlc backend not started")
        return self._info

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise UnavailableError("mlc backend not started")
        return self._client

    async def start(self, advertise_address: str) -> None:
        url = self._settings.mlc_url
        if url is None:
            self._process = MLCProcess(self._settings.model, self._settings.mlc_model_lib)
            url = await self._process.start()
        self._client = httpx.AsyncClient(
            base_url=url, timeout=httpx.Timeout(self._settings.mlc_timeout_s, connect=10.0)
        )
        models = (await self._get("/v1/models"))["data"]
        self._model_name = str(models[0]["id"]) if models else self._settings.model
        self._info = BackendInfo(
            name="mlc",
            model_id=self._model_name,
            device=self._settings.device,
            vocab_size=self._tokenizer.vocab_size,
            max_context_length=_max_context_length(self._settings.model),
            kv_layout=None,
        )

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()
        if self._process is not None:
            await self._process.stop()

    async def _get(self, path: str) -> Any:
        try:
            response = await self.client.get(path)
        except httpx.HTTPError as error:
            raise UnavailableError(f"MLC server unreachable: {error}") from None
        _raise_for_status(response)
        return response.json()

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self.client.post(path, json=body)
        except httpx.HTTPError as error:
            raise UnavailableError(f"MLC call {path} failed: {error}") from None
        _raise_for_status(response)
        return response.json()

    def _base(
        self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams
    ) -> dict[str, Any]:
        return protocol.completion_body(self._model_name, request_id, token_ids, sampling)

    async def prep_recv(
        self, request_id: str, token_ids: Sequence[int], end: int, sampling: SamplingParams
    ) -> Reservation:
        body = protocol.prep_recv_body(self._base(request_id, token_ids, sampling), end)
        reply = await self._post("/microserving/prep_recv", body)
        metadata = str(reply["kv_append_metadata"])
        return Reservation(request_id, end, int(reply["prefix_matched_length"]), metadata.encode())

    async def remote_send(
        self,
        request_id: str,
        token_ids: Sequence[int],
        begin: int,
        end: int,
        kv_addr_info: bytes,
        recv_rank: int,
        sampling: SamplingParams,
    ) -> SendResult:
        metadata = _check_kv_append_metadata(kv_addr_info)
        body = protocol.remote_send_body(
            self._base(request_id, token_ids, sampling), begin, end, metadata, recv_rank
        )
        await self._post("/microserving/remote_send", body)
        return SendResult(num_tokens_sent=end - begin, num_bytes_sent=0, num_cached_tokens=0)

    async def generate(
        self, request_id: str, token_ids: Sequence[int], begin: int, sampling: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        body = protocol.start_generate_body(self._base(request_id, token_ids, sampling), begin)
        request = self.client.build_request("POST", "/microserving/start_generate", json=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise UnavailableError(f"MLC start_generate failed: {error}") from None
        self._streams[request_id] = response
        try:  # closing the response (finish, cancel, Abort) makes MLC abort the request
            if response.status_code >= 400:
                await response.aread()
                _raise_for_status(response)
            async for output in self._outputs(request_id, response, begin, sampling):
                yield output
        finally:
            self._streams.pop(request_id, None)
            await response.aclose()

    async def run_generate(
        self, request_id: str, token_ids: Sequence[int], begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None],
    ) -> None:
        # MLC streams each request over an HTTP response of its own: nothing to batch here.
        await drain_generate(self.generate(request_id, token_ids, begin, sampling), on_output)

    async def _outputs(
        self, request_id: str, response: httpx.Response, begin: int, sampling: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        num_generated = 0
        try:
            async for chunk in sse_json(response.aiter_lines()):
                deltas = tuple(
                    protocol.parse_choice(c, self._token_bytes, self._encode, sampling.logprobs)
                    for c in chunk.get("choices") or ()
                )
                num_generated += sum(len(d.token_ids) for d in deltas)
                usage = chunk.get("usage")
                parsed = protocol.parse_usage(usage, begin) if usage else None
                if deltas or parsed:
                    yield GenerateOutput(request_id, deltas, parsed)
                if parsed:
                    return
        except (httpx.StreamClosed, httpx.ReadError):
            if request_id in self._streams:
                raise UnavailableError("MLC closed the stream") from None
        # No usage chunk (older MLC, or aborted): still end the stream with usage.
        usage = Usage(prompt_tokens=0, completion_tokens=num_generated, cached_tokens=begin)
        yield GenerateOutput(request_id, (), usage)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    async def abort(self, request_id: str) -> bool:
        response = self._streams.pop(request_id, None)
        if response is None:
            return False  # MLC has no abort route for a parked prep_recv
        await response.aclose()
        return True

    def tell_peers(self, addresses: Sequence[str]) -> None:
        """MLC moves KV itself (NVSHMEM, within its own deployment): nothing to keep."""
        del addresses

    async def status(self) -> EngineStatus:
        info = self.info
        return EngineStatus(
            model_id=info.model_id,
            model_fingerprint=info.model_id,
            kv_layout=KVLayout(info.model_id, "", 0, 0, 0, 0),
            num_running_requests=len(self._streams),
            num_waiting_requests=0,
            num_free_pages=0,
            num_total_pages=0,
            num_reserved_requests=0,
            max_context_length=info.max_context_length,
            prefix_cache=PrefixCacheStats(0, 0, 0, 0, 0),
        )


def _check_kv_append_metadata(kv_addr_info: bytes) -> str:
    """MLC dies on malformed metadata: check it is base64 of a JSON int list first."""
    try:
        text = kv_addr_info.decode("ascii")
        values = json.loads(base64.b64decode(text, validate=True))
    except (ValueError, UnicodeDecodeError):
        raise InvalidRequestError("kv_addr_info is not MLC kv_append_metadata") from None
    if not isinstance(values, list) or not values or not all(isinstance(v, int) for v in values):
        raise InvalidRequestError("kv_append_metadata must be a JSON int list")
    return text


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    detail = response.text[:500]
    if response.status_code < 500:
        raise InvalidRequestError(f"MLC rejected the call ({response.status_code}): {detail}")
    raise UnavailableError(f"MLC failed ({response.status_code}): {detail}")
