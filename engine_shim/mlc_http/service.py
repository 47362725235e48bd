"""What the MLC-compatible server does with each call, on the embedded AsyncEngine: checks
first (MLC's window rules, `user` as the request id), then prep_recv / remote_send / generate,
and the receiving end of the KV relay."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from engine_shim import validation
from engine_shim.engine.api import (
    GenerateOutput,
    InvalidRequestError,
    KVLayout,
    SamplingParams,
)
from engine_shim.engine.config import EngineConfig
from engine_shim.mlc_http import kv_relay
from engine_shim.mlc_http.protocol import (
    CompletionRequest,
    PrepRecvRequest,
    RemoteSendRequest,
)
from engine_shim.mlc_http.settings import MLCCompatSettings
from engine_shim.token_bytes import TokenBytes

if TYPE_CHECKING:
    from engine_shim.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

# Printed once the engine thread runs (stderr), for tools that tell the engine's own CPU time
# apart from the HTTP serving work in /proc (`microserving bench mlc-relay`).
ENGINE_THREAD_LINE = "microserving mlc-compat engine thread native id {tid}"


class CompatService:
    def __init__(self, settings: MLCCompatSettings) -> None:
        self.settings = settings
        self._engine: AsyncEngine | None = None
        self._relay: kv_relay.KVRelay | None = None
        self.incoming = kv_relay.IncomingTable(settings.reservation_ttl_s)
        self.token_bytes = TokenBytes(settings.model)

    async def start(self) -> None:
        from engine_shim.engine.async_engine import AsyncEngine  # torch loads here

        s = self.settings
        config = EngineConfig(
            model=s.model,
            device=s.device,
            dtype=s.dtype,
            page_size=s.page_size,
            num_pages=s.num_pages,
            kv_cache_memory_mb=s.kv_cache_memory_mb,
            reservation_ttl_s=s.reservation_ttl_s,
            max_num_seqs=s.max_num_seqs,
            enable_prefix_cache=s.enable_prefix_cache,
        )
        if s.synthetic:
            from engine_shim.mlc_http.synthetic import synthetic_factory

            logger.warning("mlc-compat runs the synthetic engine core (BENCHMARK ONLY)")
            engine = AsyncEngine(config, synthetic_factory(s))
        else:
            engine = AsyncEngine(config)
        await engine.start()
        print(ENGINE_THREAD_LINE.format(tid=engine.engine_tid), file=sys.stderr, flush=True)
        self._engine = engine
        self._relay = kv_relay.KVRelay(s.peers, engine.kv_layout, s.kv_chunk_bytes)

    async def stop(self) -> None:
        if self._relay is not None:
            await self._relay.close()
        if self._engine is not None:
            await self._engine.shutdown()

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("engine not started")
        return self._engine

    @property
    def model_id(self) -> str:
        return str(self.engine.model_id)

    @property
    def layout(self) -> KVLayout:
        return self.engine.kv_layout

    def checked(
        self, request: CompletionRequest, *, needs_user: bool
    ) -> tuple[str, list[int], SamplingParams]:
        """(request id, prompt ids, sampling) after every check the engine must not face."""
        if needs_user and not request.user:
            raise InvalidRequestError("microserving calls carry the request id in `user`")
        request_id = request.user or f"cmpl-{uuid.uuid4().hex}"
        validation.check_request_id(request_id)
        request.check_supported()
        if isinstance(request.prompt, str):
            tokens = self.engine.tokenizer.encode(request.prompt)
        else:
            tokens = list(request.prompt)
        validation.check_token_ids(
            validation.token_ids(tokens), self.engine.vocab_size, self.engine.max_context_length)
        sampling = request.sampling()
        validation.check_sampling(sampling, self.engine.vocab_size)
        validation.check_context(len(tokens), sampling, self.engine.max_context_length)
        return request_id, tokens, sampling

    async def prep_recv(self, request: PrepRecvRequest) -> dict[str, object]:
        request_id, tokens, _ = self.checked(request, needs_user=True)
        end = validation.prep_recv_end(request.end, len(tokens))
        result = await self.engine.prep_recv(request_id, tokens, end)
        metadata = kv_relay.encode_kv_append_metadata(result.kv_segments)
        self.incoming.open(request_id, metadata, result.prefix_matched_length, result.end)
        return {
            "kv_append_metadata": metadata,
            "prefix_matched_length": result.prefix_matched_length,
        }

    async def remote_send(self, request: RemoteSendRequest) -> dict[str, object]:
        request_id, tokens, _ = self.checked(request, needs_user=True)
        begin, end = validation.remote_send_window(request.begin, request.end, len(tokens))
        segments = kv_relay.decode_kv_append_metadata(request.kv_addr_info)
        if kv_relay.segments_length(segments) != end - begin:
            raise InvalidRequestError(
                f"kv_addr_info holds {kv_relay.segments_length(segments)} slots, window has {end - begin}"
            )
        if self._relay is None:
            raise RuntimeError("relay not started")
        chunks = self.engine.remote_send(request_id, tokens, begin, end)
        await self._relay.send(request.recv_rank, request_id, request.kv_addr_info, chunks)
        return {}

    async def receive_kv(self, headers: dict[str, str], body: bytes) -> dict[str, object]:
        request_id, metadata, chunk = kv_relay.parse_chunk(headers, body, self.layout)
        entry = self.incoming.get(request_id, metadata)
        try:
            if chunk.begin != entry.position or chunk.begin + chunk.num_tokens > entry.end:
                raise InvalidRequestError(
                    f"KV chunk at {chunk.begin} does not continue the window at {entry.position}"
                )
            await self.engine.import_kv(request_id, chunk)
        except Exception:
            self.incoming.close(request_id)
            await self.engine.abort(request_id)
            raise
        entry.position += chunk.num_tokens
        return {"num_tokens_written": chunk.num_tokens}

    async def generate(
        self, request_id: str, tokens: list[int], begin: int, sampling: SamplingParams
    ) -> AsyncIterator[GenerateOutput]:
        """Engine outputs; leaving early (client gone) aborts the request."""
        self.incoming.close(request_id)
        outputs = self.engine.generate(request_id, tokens, begin, sampling)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]  # AsyncEngine aborts on close
