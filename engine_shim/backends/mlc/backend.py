"""The MLC backend: speaks a running MLC-LLM server's /microserving/* HTTP routes through one
pooled aiohttp session (KV then moves engine to engine by MLC's own NVSHMEM path).

aiohttp rather than httpx: every running request holds one streamed HTTP response, and each
engine step sends a chunk on each; with httpx + h11 reading them the shim spent ~60 ms of CPU
per 1,000 relayed tokens, with aiohttp's C parser ~35 (`microserving bench mlc-relay`,
docs/benchmarks.md). The pool has no connection limit: a limit below the number of running
requests would queue requests here while the engine has room (httpx's default of 100 did,
at 128 streams)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import aiohttp

from engine_shim.backend import (
    BackendInfo,
    FirstDelivery,
    HoldListener,
    KVTransferService,
    Reservation,
    SendResult,
    SendTarget,
)
from engine_shim.backends.mlc import protocol
from engine_shim.backends.mlc.launcher import MLCProcess
from engine_shim.backends.mlc.sse import sse_json
from engine_shim.engine.api import (
    Continuation,
    EngineStatus,
    GenerateOutput,
    InvalidRequestError,
    KVLayout,
    OnFirst,
    PrefixCacheStats,
    SamplingParams,
    UnavailableError,
    Usage,
)
from engine_shim.engine.validation import TokenIds
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
        self._session: aiohttp.ClientSession | None = None
        self._process: MLCProcess | None = None
        self._info: BackendInfo | None = None
        self._tokenizer = Tokenizer.from_model(settings.model)
        self._token_bytes = TokenBytes(settings.model)
        self._model_name = settings.model
        self._streams: dict[str, aiohttp.ClientResponse] = {}
        # A streamed generation lasts as long as it needs; each read waits mlc_timeout_s at most.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, connect=10.0, sock_read=settings.mlc_timeout_s
        )

    @property
    def info(self) -> BackendInfo:
        if self._info is None:
            raise RuntimeError("mlc backend not started")
        return self._info

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise UnavailableError("mlc backend not started")
        return self._session

    async def start(self, advertise_address: str) -> None:
        url = self._settings.mlc_url
        if url is None:
            self._process = MLCProcess(
                self._settings.model, self._settings.mlc_model_lib,
                enable_prefix_cache=self._settings.enable_prefix_cache,
            )
            url = await self._process.start()
        self._session = aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=0),  # one connection per running request
            timeout=aiohttp.ClientTimeout(total=self._settings.mlc_timeout_s, connect=10.0),
            trust_env=False,
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
        if self._session is not None:
            await self._session.close()
        if self._process is not None:
            await self._process.stop()

    async def _get(self, path: str) -> Any:
        try:
            async with self.session.get(path) as response:
                await _raise_for_status(response)
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UnavailableError(f"MLC server unreachable: {error!r}") from None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            async with self.session.post(path, json=body) as response:
                await _raise_for_status(response)
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UnavailableError(f"MLC call {path} failed: {error!r}") from None

    def _base(
        self, request_id: str, token_ids: TokenIds, sampling: SamplingParams
    ) -> dict[str, Any]:
        if sampling.cache_salt and self._settings.enable_prefix_cache:
            # MLC's prefix cache has one scope for everyone: a salted (tenant's) request
            # served from it could reveal another tenant's prompts through its usage.
            raise InvalidRequestError(
                "the mlc backend cannot scope its prefix cache per tenant (cache_salt): "
                "serve tenants from an MLC engine without a prefix cache (shim "
                "--enable-prefix-cache false, which starts it with prefix_cache_mode=disable; "
                "with --mlc-url, only when that server runs so)"
            )
        return protocol.completion_body(self._model_name, request_id, token_ids, sampling)

    async def prep_recv(
        self, request_id: str, token_ids: TokenIds, end: int, sampling: SamplingParams,
        whole_prompt: bool = False,
    ) -> Reservation:
        if whole_prompt:  # the servicer refuses it first (info.samples_first_token is off)
            raise InvalidRequestError("whole_prompt: an MLC engine receives at most len(prompt) - 1 positions")
        body = protocol.prep_recv_body(self._base(request_id, token_ids, sampling), end)
        reply = await self._post("/microserving/prep_recv", body)
        metadata = str(reply["kv_append_metadata"])
        return Reservation(request_id, end, int(reply["prefix_matched_length"]), metadata.encode())

    async def remote_send(
        self,
        request_id: str,
        token_ids: TokenIds,
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

    @contextlib.asynccontextmanager
    async def _start_generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The start_generate response, open while the caller reads it."""
        body = protocol.start_generate_body(self._base(request_id, token_ids, sampling), begin)
        try:
            response = await self.session.post(
                "/microserving/start_generate", json=body, timeout=self._stream_timeout
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            raise UnavailableError(f"MLC start_generate failed: {error!r}") from None
        self._streams[request_id] = response
        try:
            await _raise_for_status(response)
            yield response
        finally:
            if self._streams.pop(request_id, None) is not None and not response.content.at_eof():
                response.close()  # unfinished: dropping the connection makes MLC abort it
            response.release()  # finished: the connection goes back to the pool

    def sampling_first(
        self, request_id: str, sampling: SamplingParams, on_first: OnFirst
    ) -> AbstractContextManager[FirstDelivery]:
        raise InvalidRequestError("sample_first_token: an MLC engine samples only on the receiving side")

    async def generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: Sequence[Continuation] = (),
    ) -> AsyncIterator[GenerateOutput]:
        _refuse_after_kv(after_kv)
        _refuse_continuations(continuations)
        async with self._start_generate(request_id, token_ids, begin, sampling) as response:
            async for output in self._outputs(request_id, response, begin, sampling):
                yield output

    async def remote_send_later(
        self, request_id: str, token_ids: TokenIds, begin: int, end: int,
        sampling: SamplingParams, target: Awaitable[SendTarget],
    ) -> SendResult:
        # MLC's remote_send is one HTTP call that takes the receiver's address up front.
        raise InvalidRequestError("kv_addr_follows: an MLC engine needs the receiver's address with the send")

    async def run_generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None], after_kv: bool = False,
        continuations: Sequence[Continuation] = (),
    ) -> None:
        # MLC streams each request over an HTTP response of its own: nothing to batch here,
        # but two generator hops per chunk fewer than draining `generate`.
        _refuse_after_kv(after_kv)
        _refuse_continuations(continuations)
        async with self._start_generate(request_id, token_ids, begin, sampling) as response:
            async for output in self._outputs(request_id, response, begin, sampling):
                on_output(output)

    async def _outputs(
        self, request_id: str, response: aiohttp.ClientResponse, begin: int, sampling: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        num_generated = 0
        usage_seen = False
        try:
            async for chunk in sse_json(response.content.iter_any()):
                deltas = tuple(
                    protocol.parse_choice(c, self._token_bytes, self._encode, sampling.logprobs)
                    for c in chunk.get("choices") or ()
                )
                num_generated += sum(len(d.token_ids) for d in deltas)
                usage = chunk.get("usage")
                parsed = protocol.parse_usage(usage, begin) if usage else None
                if deltas or parsed:
                    yield GenerateOutput(request_id, deltas, parsed)
                usage_seen = usage_seen or parsed is not None
        except (aiohttp.ClientError, TimeoutError):
            if request_id in self._streams:
                raise UnavailableError("MLC closed the stream") from None
        if not usage_seen:  # older MLC, or aborted: still end the stream with usage
            usage = Usage(prompt_tokens=0, completion_tokens=num_generated, cached_tokens=begin)
            yield GenerateOutput(request_id, (), usage)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    async def abort(self, request_id: str) -> bool:
        response = self._streams.pop(request_id, None)
        if response is None:
            return False  # MLC has no abort route for a parked prep_recv
        response.close()  # drops the connection: MLC aborts the request
        return True

    async def wait_lost(self) -> str:
        """MLC's server is checked call by call (its errors map to UNAVAILABLE)."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    def kv_transfer_servicer(self, on_hold: HoldListener | None = None) -> KVTransferService | None:
        """None: MLC's engines move KV between themselves; no KV reaches this shim."""
        del on_hold
        return None

    def tell_peers(self, addresses: Sequence[str]) -> None:
        """MLC moves KV itself (NVSHMEM, within its own deployment): nothing to keep."""
        del addresses

    def num_receive_tickets(self) -> int | None:
        return None  # no KV plane here (kv_transfer_servicer)

    def kv_sends(self) -> Mapping[str, int] | None:
        return None  # MLC's engines move KV themselves

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


def _refuse_continuations(continuations: Sequence[Continuation]) -> None:
    if continuations:
        raise InvalidRequestError("continuations: an MLC engine cannot continue another engine's choices")


def _refuse_after_kv(after_kv: bool) -> None:
    # MLC's engines move KV themselves and do not tell the shim when it has landed (the
    # servicer refuses such a start first: the backend's info does not offer it).
    if after_kv:
        raise InvalidRequestError("after_kv_transfer: an MLC engine cannot start after a KV transfer")


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


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status < 400:
        return
    detail = (await response.text(errors="replace"))[:500]
    if response.status < 500:
        raise InvalidRequestError(f"MLC rejected the call ({response.status}): {detail}")
    raise UnavailableError(f"MLC failed ({response.status}): {detail}")
