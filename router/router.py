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
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

from microserving.pattern_names import PatternName
from microserving.tokenizer import Tokenizer
from microserving.v1 import common_pb2
from router.attempt import Attempt, EngineJob
from router.discovery import DnsWatcher
from router.endpoint import DECODE
from router.engine_calls import Decode, prep_recv, remote_send, start_generate
from router.engines import Engines
from router.errors import InvalidRequestError
from router.kv_room import wait_for_room
from router.metrics import RouterMetrics
from router.microserving_protocol import PrepRecvRequest, RemoteSendRequest, StartGenerateRequest
from router.openai_proto import engine_to_completion, request_to_sampling
from router.openai_protocol import CompletionRequest, CompletionResponse
from router.patterns import migrate, pattern_for
from router.placement import Placement
from router.registry import EngineRegistry
from router.settings import RouterSettings
from router.streamed_decode import StreamedDecode

# The tenant scope (cache salt) of the request whose translate_request runs in this task (set
# by the runner for each attempt): the helpers apply it to engine calls under ids of the custom
# code's own making too, and tasks it starts inherit it.
ATTEMPT_CACHE_SALT: ContextVar[str] = ContextVar("attempt_cache_salt", default="")

# What a custom router may override; overriding any of them turns the fast path off.
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


class Router:
    """MLC's router: subclass it and override translate_request (the built-in patterns run
    when nothing is overridden). Composes the engines (engines.py) and the placement
    (placement.py); the patterns and engine calls get those, never the Router."""

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
        self.model_id = settings.served_model_id
        self.created = int(time.time())
        self.tokenizer = Tokenizer.from_model(settings.model)
        self.metrics = RouterMetrics(lambda: self.registry.endpoints)
        self.engines = Engines(settings, self.metrics)
        self.placement = Placement(settings, self.engines.registry)
        self._dns = [DnsWatcher(self.registry, s, settings.dns_interval_s) for s in settings.engine_dns]
        self._background: list[asyncio.Task[None]] = []
        # The attempts in flight by engine request id, for the MLC-named helpers only: a
        # custom translate_request passes nothing but the request (its `user` is the id).
        self._helper_attempts: dict[str, Attempt] = {}

    # ---- lifecycle ----
    async def start(self) -> None:
        for watcher in self._dns:
            await watcher.refresh()
        await self.registry.start()
        self._background = [asyncio.get_running_loop().create_task(w.run()) for w in self._dns]

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await self.engines.stop()

    # ---- MLC's fields and engine tables ----
    @property
    def registry(self) -> EngineRegistry:
        return self.engines.registry

    @property
    def router_mode(self) -> PatternName:
        return self.placement.default_pattern

    @property
    def pd_balance_factor(self) -> float:
        return self.placement.pd_balance_factor

    @pd_balance_factor.setter
    def pd_balance_factor(self, value: float) -> None:  # MLC's is a plain attribute
        self.placement.pd_balance_factor = value

    @property
    def cache_aware(self) -> bool:
        return self.placement.cache_aware

    @property
    def server_urls(self) -> list[str]:
        return [e.address for e in self.registry.endpoints]

    @property
    def device_id_starts(self) -> list[int]:
        return self.engines.device_id_starts()

    @property
    def num_running_requests(self) -> list[int]:
        return [e.num_inflight for e in self.registry.endpoints]

    def device_id_start(self, address: str) -> int:
        return self.engines.device_id_start(address)

    # ---- attempts the helpers can find ----
    def open_attempt(self, attempt: Attempt) -> None:
        """Lets the MLC-named helpers of a custom translate_request find `attempt`."""
        self._helper_attempts[attempt.engine_request_id] = attempt

    def close_attempt(self, attempt: Attempt) -> None:
        self._helper_attempts.pop(attempt.engine_request_id, None)
        attempt.release_reservations()

    def _helper_call(self, request: CompletionRequest) -> tuple[EngineJob, Attempt]:
        """A helper's engine-level job and its attempt, in the request's tenant scope: a custom
        translate_request that builds its own requests (or drops cache_salt) cannot move a
        tenant's request into another prefix-cache scope. A helper called outside any
        attempt gets a throwaway one."""
        job = _job(request)
        attempt = self._helper_attempts.get(job.request_id)
        if attempt is None:  # an id of the custom code's own making: the running attempt's scope
            attempt = Attempt(job.request_id, cache_salt=ATTEMPT_CACHE_SALT.get())
        if attempt.cache_salt:
            job.sampling.cache_salt = attempt.cache_salt
        return job, attempt

    # ---- the three MicroServing calls (MLC's helpers) ----
    async def send_prepare_receive(
        self, session: Any, request: PrepRecvRequest, server_url: str
    ) -> tuple[str, int]:
        """prep_recv on the receiver -> (kv_addr_info, prefix_matched_length)."""
        del session  # accepted for MLC's signature; calls use the pooled gRPC channel
        job, attempt = self._helper_call(request)
        kv_addr_info, matched = await prep_recv(self.engines, self.engines.endpoint(server_url), job, attempt,
                                                request.end)
        return base64.b64encode(kv_addr_info).decode("ascii"), matched

    async def send_remote_send(self, session: Any, request: RemoteSendRequest, server_url: str) -> None:
        """remote_send on the sender; returns once the KV reached the receiver."""
        del session
        job, attempt = self._helper_call(request)
        await remote_send(
            self.engines, self.engines.endpoint(server_url), job, attempt, begin=request.begin, end=request.end,
            kv_addr_info=base64.b64decode(request.kv_addr_info), recv_rank=request.recv_rank,
        )

    async def send_start_generate(
        self, session: Any, request: StartGenerateRequest, server_url: str
    ) -> AsyncIterator[CompletionResponse]:
        """start_generate on the receiver: its stream as CompletionResponse chunks."""
        del session
        job, attempt = self._helper_call(request)
        stream = start_generate(self.engines, self.engines.endpoint(server_url), job, attempt, request.begin)
        async with contextlib.aclosing(stream):
            async for reply in stream:
                yield engine_to_completion(reply, job.request_id, request.model)

    # ---- the extension point ----
    async def translate_request(
        self, request: CompletionRequest, request_id: str
    ) -> AsyncGenerator[CompletionResponse | None, None]:
        """Run one request; yield its CompletionResponse chunks, or None when preempted."""
        _, token_ids = _id_and_prompt(request)
        job = EngineJob(request_id, token_ids, request_to_sampling(request))
        attempt = self._helper_attempts.get(request_id) or Attempt(request_id)
        stream = await self.generate(job, attempt)
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

    async def generate(self, job: EngineJob, attempt: Attempt) -> Decode:
        """Run the built-in pattern's calls before decoding; -> the decode engine's stream."""
        await wait_for_room(
            lambda: self.registry.candidates(DECODE, exclude=attempt.excluded), len(job.token_ids),
            self.settings.kv_full_wait_s, waiting=self.metrics.queued)
        return await pattern_for(self.placement, attempt)(self.engines, self.placement, job, attempt)

    # ---- context migration ----
    async def migrate_context(self, token_ids: Sequence[int], source: str, target: str) -> tuple[int, int, str]:
        """Move the KV of `token_ids` into `target`'s prefix cache ->
        (prefix_matched_length, num_tokens_moved, source)."""
        if len(token_ids) < 2:
            raise InvalidRequestError("a context needs at least 2 tokens", param="token_ids")
        return await migrate(self.engines, self.placement, list(token_ids), source, target)


def _job(request: CompletionRequest) -> EngineJob:
    request_id, token_ids = _id_and_prompt(request)
    return EngineJob(request_id, token_ids, request_to_sampling(request))


def _id_and_prompt(request: CompletionRequest) -> tuple[str, list[int]]:
    if not isinstance(request.prompt, list):
        raise InvalidRequestError("engine calls need the prompt as token ids", param="prompt")
    if not request.user:
        raise InvalidRequestError("engine calls need the request id in `user`", param="user")
    return request.user, request.prompt
