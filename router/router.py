"""The programmable Router: MLC-LLM's router API (server_urls, device_id_starts,
num_running_requests, router_mode, pd_balance_factor, tokenizer; send_prepare_receive /
send_remote_send / send_start_generate; translate_request) over pooled gRPC channels.

The built-in patterns (patterns.py) run on the wire-level engine calls of engine_calls.py,
which the MLC-named helpers wrap, so a subclass and the built-in patterns share every piece of
bookkeeping. When a subclass overrides none of the programmable methods
(`uses_builtin_patterns`), the runner takes the patterns' engine messages directly (no
CompletionResponse per token); otherwise it drives translate_request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

import grpc

from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2, engine_pb2, router_pb2
from router import engine_calls, kv_room, patterns
from router.context import RequestContext
from router.conversions import engine_to_completion, request_to_sampling
from router.discovery import DnsWatcher, parse_engine_spec
from router.endpoint import DECODE, PREFILL, STAGE_RESERVED, Endpoint
from router.engine_calls import EngineJob
from router.engine_stream import EngineStream, StreamedDecode
from router.errors import EngineCallError, InvalidRequestError, NoEngineError
from router.metrics import RouterMetrics
from router.microserving_protocol import PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from router.openai_protocol import CompletionRequest, CompletionResponse
from router.policies import AdaptivePolicy, pick_cache_aware, pick_least_loaded
from router.prefix_index import PrefixIndex
from router.registry import EngineRegistry
from router.settings import RouterSettings

logger = logging.getLogger(__name__)

# What a custom router may override; overriding any of them turns the fast path off.
# The tenant scope (cache salt) of the request whose translate_request runs in this task (set
# by the runner for each attempt): the helpers apply it to engine calls under ids of the custom
# code's own making too, and tasks it starts inherit it.
ATTEMPT_CACHE_SALT: ContextVar[str] = ContextVar("attempt_cache_salt", default="")

_PROGRAMMABLE = ("translate_request", "send_prepare_receive", "send_remote_send", "send_start_generate")


def settings_from_mlc_args(
    model: str, hosts: Sequence[str], ports: Sequence[int], num_gpus: Sequence[int],
    router_mode: str, pd_balance_factor: float,
) -> RouterSettings:
    """MLC's constructor arguments as settings: in disagg mode engine 0 is the prefill engine
    and the others decode (MLC's layout); in round-robin every engine does both."""
    engines = []
    for i, (host, port) in enumerate(zip(hosts, ports, strict=True)):
        role = "both" if router_mode != "disagg" else ("prefill" if i == 0 else "decode")
        engines.append(f"{host}:{port}={role}")
    return RouterSettings.model_validate(
        {"model": model, "engines": engines, "engine_num_gpus": list(num_gpus) or [1] * len(engines),
         "pattern": router_mode, "pd_balance_factor": pd_balance_factor}
    )


def _strip_scheme(server_url: str) -> str:
    for scheme in ("http://", "https://"):
        if server_url.startswith(scheme):
            return server_url[len(scheme):].rstrip("/")
    return server_url


class Router:
    def __init__(
        self,
        model: str = "tiny",
        model_lib: str | None = None,
        hosts: Sequence[str] = (),
        ports: Sequence[int] = (),
        num_gpus: Sequence[int] = (),
        enable_prefix_cache: bool = False,
        router_mode: str = "disagg",
        pd_balance_factor: float = 0.0,
        *,
        settings: RouterSettings | None = None,
    ) -> None:
        del model_lib, enable_prefix_cache  # engines own these; kept for MLC's signature
        if settings is None:
            settings = settings_from_mlc_args(model, hosts, ports, num_gpus, router_mode, pd_balance_factor)
        self.settings = settings
        self.router_mode: str = settings.pattern
        self.pd_balance_factor: float = settings.pd_balance_factor
        self.cache_aware: bool = settings.cache_aware
        self.model_id = settings.served_model_id
        self.created = int(time.time())
        self.tokenizer = Tokenizer.from_model(settings.model)
        self.registry = EngineRegistry(
            settings.transport,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
        )
        for i, spec in enumerate(settings.engines):
            parsed = parse_engine_spec(spec)
            gpus = settings.engine_num_gpus[i] if i < len(settings.engine_num_gpus) else 1
            self.registry.add(parsed.address, parsed.roles, num_gpus=gpus)
        self.registry.add_listener(self._on_health_change)
        self.metrics = RouterMetrics(lambda: self.registry.endpoints)
        self.prefix_index = PrefixIndex(settings.cache_page_size, settings.cache_max_pages_per_engine)
        self.adaptive_policy = AdaptivePolicy(
            min_remote_tokens=settings.adaptive_min_remote_tokens,
            max_prefill_load_ratio=settings.adaptive_max_prefill_load_ratio,
            max_factor=settings.adaptive_max_factor,
        )
        self._dns = [DnsWatcher(self.registry, s, settings.dns_interval_s) for s in settings.engine_dns]
        self._background: list[asyncio.Task[None]] = []
        self._contexts: dict[str, RequestContext] = {}
        self._engine_streams: dict[str, EngineStream] = {}
        self._turn = itertools.count()

    # ---- lifecycle ----
    async def start(self) -> None:
        for watcher in self._dns:
            await watcher.refresh()
        await self.registry.start()
        self._background = [asyncio.get_running_loop().create_task(w.run()) for w in self._dns]

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*(s.close() for s in self._engine_streams.values()))
        self._engine_streams.clear()
        await self.registry.stop()

    def _on_health_change(self, endpoint: Endpoint, previous: int) -> None:
        if previous == router_pb2.ENGINE_HEALTH_SERVING and not endpoint.is_available:
            self.metrics.failovers.labels(engine=endpoint.address).inc()
        if not endpoint.is_available:
            self.prefix_index.forget(endpoint.address)  # it may come back with an empty cache

    # ---- MLC's engine tables ----
    @property
    def server_urls(self) -> list[str]:
        return [e.address for e in self.registry.endpoints]

    @property
    def device_id_starts(self) -> list[int]:
        starts, total = [], 0
        for endpoint in self.registry.endpoints:
            starts.append(total)
            total += endpoint.num_gpus
        return starts

    @property
    def num_running_requests(self) -> list[int]:
        return [e.num_inflight for e in self.registry.endpoints]

    def device_id_start(self, address: str) -> int:
        urls = self.server_urls
        return self.device_id_starts[urls.index(address)] if address in urls else 0

    # ---- per-request context ----
    def open_context(self, engine_request_id: str, ctx: RequestContext | None = None) -> RequestContext:
        ctx = ctx or RequestContext(engine_request_id)
        self._contexts[engine_request_id] = ctx
        return ctx

    def close_context(self, ctx: RequestContext) -> None:
        self._contexts.pop(ctx.engine_request_id, None)
        for address in ctx.reservations:
            endpoint = self.registry.get(address)
            if endpoint is not None:  # else it left the registry meanwhile
                endpoint.release(STAGE_RESERVED)
        ctx.reservations.clear()

    def context(self, request_id: str) -> RequestContext:
        return self._contexts.get(request_id) or RequestContext(request_id)

    async def abort_touched(self, ctx: RequestContext) -> None:
        """Abort the request on every engine it touched (frees reservations and KV)."""
        request = engine_pb2.AbortRequest(request_id=ctx.engine_request_id)

        async def abort(address: str) -> None:
            endpoint = self.registry.get(address)
            if endpoint is None:
                return  # it left the registry meanwhile
            try:
                await endpoint.stub.Abort(request, timeout=self.settings.abort_timeout_s)
            except grpc.aio.AioRpcError as exc:
                logger.info("abort of %s on %s failed: %s", ctx.engine_request_id, address, exc.code())

        await asyncio.gather(*(abort(a) for a in ctx.touched))

    # ---- engine choice ----
    def select_engine(
        self, role: int, token_ids: Sequence[int], ctx: RequestContext, avoid: Sequence[str] = ()
    ) -> Endpoint:
        """The engine for `role` (NoEngineError when none is healthy)."""
        chosen = self.try_select_engine(role, token_ids, ctx, avoid)
        if chosen is None:
            name = {PREFILL: "prefill", DECODE: "decode"}.get(role, str(role))
            raise NoEngineError(f"no healthy {name} engine is available")
        return chosen

    def try_select_engine(
        self, role: int, token_ids: Sequence[int], ctx: RequestContext, avoid: Sequence[str] = ()
    ) -> Endpoint | None:
        """Longest cached prefix when cache-aware, else least loaded; None when none is up."""
        candidates = self.registry.candidates(role, exclude=ctx.excluded | set(avoid))
        turn = next(self._turn)
        if self.is_cache_aware(ctx) and candidates:
            matched = self.prefix_index.match_all([c.address for c in candidates], token_ids, ctx.cache_salt)
            chosen = pick_cache_aware(
                candidates, matched, turn,
                min_match_tokens=self.settings.cache_min_match_tokens,
                max_extra_load=self.settings.cache_max_extra_load,
            )
        else:
            chosen = pick_least_loaded(candidates, turn)
        return chosen if isinstance(chosen, Endpoint) else None

    def is_cache_aware(self, ctx: RequestContext) -> bool:
        return ctx.hints.cache_aware if ctx.hints.HasField("cache_aware") else self.cache_aware

    def endpoint(self, server_url: str) -> Endpoint:
        """A registered engine. Nothing else is ever dialled: the router's calls carry the
        shared token, and an address from a request (MigrateContext.source, a custom
        router's server_url) must not receive it."""
        address = _strip_scheme(server_url)
        endpoint = self.registry.get(address)
        if endpoint is None:
            raise InvalidRequestError(f"{address!r} is not an engine registered with this router",
                                      param="engine")
        return endpoint

    def engine_stream(self, endpoint: Endpoint) -> EngineStream:
        """The engine's multiplexed Generate stream (the object lives as long as the router;
        its call is opened on first use and again after it breaks)."""
        stream = self._engine_streams.get(endpoint.address)
        if stream is None or stream.endpoint is not endpoint:
            stream = self._engine_streams[endpoint.address] = EngineStream(endpoint)
        return stream

    def call_failed(self, exc: grpc.aio.AioRpcError | TimeoutError, address: str, stage: str) -> EngineCallError:
        if isinstance(exc, grpc.aio.AioRpcError):
            return self.call_failed_with(exc.code(), exc.details() or "", address, stage)
        return self.call_failed_with(grpc.StatusCode.DEADLINE_EXCEEDED, "stage deadline passed", address, stage)

    def call_failed_with(self, code: grpc.StatusCode, detail: str, address: str, stage: str) -> EngineCallError:
        """An engine call (or one request on an engine stream) failed with `code`: the error
        the runner handles; an engine at fault leaves rotation."""
        error = EngineCallError(f"{stage} on {address} failed: {code.name}", code=code, address=address, stage=stage,
                                detail=detail)
        self.metrics.engine_call_failures.labels(engine=address, call=stage, code=code.name).inc()
        if error.is_engine_fault:
            self.registry.mark_failed(address)
        logger.info("%s on %s failed: %s %s", stage, address, code.name, detail)
        return error

    # ---- the three MicroServing calls (MLC's helpers) ----
    async def send_prepare_receive(
        self, session: Any, request: PrepRecvRequest, server_url: str
    ) -> tuple[str, int]:
        """prep_recv on the receiver -> (kv_addr_info, prefix_matched_length)."""
        del session  # accepted for MLC's signature; calls use the pooled gRPC channel
        kv_addr_info, matched = await engine_calls.prep_recv(
            self, self.endpoint(server_url), self._scoped_job(request), request.end
        )
        return base64.b64encode(kv_addr_info).decode("ascii"), matched

    async def send_remote_send(self, session: Any, request: RemoteSendRequest, server_url: str) -> None:
        """remote_send on the sender; returns once the KV reached the receiver."""
        del session
        await engine_calls.remote_send(
            self, self.endpoint(server_url), self._scoped_job(request), begin=request.begin, end=request.end,
            kv_addr_info=base64.b64decode(request.kv_addr_info), recv_rank=request.recv_rank,
        )

    async def send_start_generate(
        self, session: Any, request: StartGenerateRequest, server_url: str
    ) -> AsyncIterator[CompletionResponse]:
        """start_generate on the receiver: its stream as CompletionResponse chunks."""
        del session
        job = self._scoped_job(request)
        stream = engine_calls.start_generate(self, self.endpoint(server_url), job, request.begin)
        async with contextlib.aclosing(stream):
            async for reply in stream:
                yield engine_to_completion(reply, job.request_id, request.model)

    def _scoped_job(self, request: CompletionRequest) -> EngineJob:
        """The engine-level job of a helper call, in its request's tenant scope: a custom
        translate_request that builds its own requests (or drops cache_salt) cannot move a
        tenant's request into another prefix-cache scope."""
        job = _job(request)
        ctx = self._contexts.get(job.request_id)
        salt = ctx.cache_salt if ctx is not None else ATTEMPT_CACHE_SALT.get()
        if salt:
            job.sampling.cache_salt = salt
        return job

    # ---- the extension point ----
    async def translate_request(
        self, request: CompletionRequest, request_id: str
    ) -> AsyncGenerator[CompletionResponse | None, None]:
        """Run one request; yield its CompletionResponse chunks, or None when preempted."""
        _, token_ids = _id_and_prompt(request)
        job = EngineJob(request_id, token_ids, request_to_sampling(request))
        stream = await self.generate(job, self.context(request_id))
        assert not isinstance(stream, StreamedDecode)  # only the runner's fast path streams
        async with contextlib.aclosing(stream):
            async for message in stream:
                if any(delta.finish_reason == common_pb2.FINISH_REASON_PREEMPT for delta in message.choices):
                    yield None  # MLC's way to say "preempted: run me again"
                    return
                yield engine_to_completion(message, request_id, request.model)

    @property
    def uses_builtin_patterns(self) -> bool:
        """True unless a subclass overrides a programmable method (then it must be driven
        through translate_request and the CompletionResponse models)."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(Router, name) for name in _PROGRAMMABLE)

    async def generate(self, job: EngineJob, ctx: RequestContext) -> patterns.Decode:
        """Run the built-in pattern's calls before decoding; -> the decode engine's stream."""
        await kv_room.wait_for_room(
            lambda: self.registry.candidates(DECODE, exclude=ctx.excluded), len(job.token_ids),
            self.settings.kv_full_wait_s, waiting=self.metrics.queued)
        return await patterns.pattern_for(self, ctx)(self, job, ctx)

    # ---- context migration ----
    async def migrate_context(self, token_ids: Sequence[int], source: str, target: str) -> tuple[int, int, str]:
        """Move the KV of `token_ids` into `target`'s prefix cache ->
        (prefix_matched_length, num_tokens_moved, source)."""
        if len(token_ids) < 2:
            raise InvalidRequestError("a context needs at least 2 tokens", param="token_ids")
        return await patterns.migrate(self, list(token_ids), source, target)


def _job(request: CompletionRequest) -> EngineJob:
    request_id, token_ids = _id_and_prompt(request)
    return EngineJob(request_id, token_ids, request_to_sampling(request))


def _id_and_prompt(request: CompletionRequest) -> tuple[str, list[int]]:
    if not isinstance(request.prompt, list):
        raise InvalidRequestError("engine calls need the prompt as token ids", param="prompt")
    if not request.user:
        raise InvalidRequestError("engine calls need the request id in `user`", param="user")
    return request.user, request.prompt
