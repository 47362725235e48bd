"""The embedded backend: the in-process AsyncEngine behind the shim, plus this shim's side of
the KV data plane (reservations described by kv_addr_info, pushes to peer shims). Every call
into engine_shim.engine goes through this file."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import ipaddress
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import TYPE_CHECKING, Any

from engine_shim.backend import (
    BackendInfo,
    FirstDelivery,
    HoldListener,
    Reservation,
    SendResult,
    SendTarget,
)
from engine_shim.backends.embedded.kv_plane.addr import KVAddrInfo, NixlOffer
from engine_shim.backends.embedded.kv_plane.codec import bytes_per_token, check_layout
from engine_shim.backends.embedded.kv_plane.nixl import KVWritePlane, NixlPlane, start_agent
from engine_shim.backends.embedded.kv_plane.nixl_core import CoreNixlPlane, nixl_side
from engine_shim.backends.embedded.kv_plane.nixl_sender import WriteTimes, write_kv
from engine_shim.backends.embedded.kv_plane.peers import PeerAllowList
from engine_shim.backends.embedded.kv_plane.receiver import KVTransferServicer
from engine_shim.backends.embedded.kv_plane.reservations import ReceiveTable
from engine_shim.backends.embedded.kv_plane.sender import PeerChannels, push_kv
from engine_shim.backends.embedded.kv_plane.shm import (
    SegmentMaps,
    StageWindow,
    StagingPool,
    host_identity,
)
from engine_shim.backends.embedded.send_ahead import ChunksAhead, EnteredAhead
from engine_shim.engine.api import (
    Continuation,
    EngineError,
    EngineStatus,
    FailedPreconditionError,
    GenerateOutput,
    InvalidRequestError,
    KVChunk,
    KVLayout,
    OnFirst,
    SamplingParams,
    UnavailableError,
)
from engine_shim.engine.block_manager import Slots
from engine_shim.engine.config import EngineConfig
from engine_shim.engine.validation import TokenIds
from engine_shim.settings import ShimSettings, core_in_own_process

if TYPE_CHECKING:
    import torch

    from engine_shim.engine.async_engine import AsyncEngine
    from engine_shim.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Printed once the engine loop runs, for tools that tell the engine's own CPU time apart from
# the shim's serving work in /proc (`microserving bench capacity`): the loop's thread id, in
# this process or in the engine core's (/proc/TID/task/TID finds it in either).
ENGINE_THREAD_LINE = "microserving shim engine thread native id {tid}"


def engine_config(settings: ShimSettings) -> EngineConfig:
    return EngineConfig(
        model=settings.model,
        device=settings.device,
        cpu_threads=settings.cpu_threads,
        dtype=settings.engine_dtype,
        page_size=settings.page_size,
        num_pages=settings.num_pages,
        kv_cache_memory_mb=settings.kv_cache_memory_mb,
        reservation_ttl_s=settings.reservation_ttl_s,
        max_num_seqs=settings.max_num_seqs,
        prefill_chunk_size=settings.engine_prefill_chunk,
        prefill_hold_ms=settings.prefill_hold_ms,
        enable_prefix_cache=settings.enable_prefix_cache,
        cuda_graphs=settings.cuda_graphs,
        mixed_cuda_graphs=settings.mixed_cuda_graphs,
        paged_prefill=settings.paged_prefill,
        kv_export_chunk_bytes=settings.kv_push_chunk_bytes,  # one export = one PushKV message
    )


# The longest interval between sweeps of expired reservations (a quarter of the TTL if less).
_SWEEP_S = 1.0


class EmbeddedBackend:
    def __init__(
        self,
        settings: ShimSettings,
        core_factory: Callable[[EngineConfig], LLMEngine] | None = None,
        name: str = "embedded",
    ) -> None:
        """`core_factory`/`name`: only the benchmark-only synthetic backend passes them."""
        self._settings = settings
        self._core_factory = core_factory
        self._name = name
        self._engine: AsyncEngine | None = None
        self._info: BackendInfo | None = None
        # Shared memory only where a host identity exists (Linux) and the settings allow.
        use_shm = settings.kv_shm and settings.kv_transport in ("auto", "shm")
        self._host = host_identity() if use_shm else None
        self._nixl: KVWritePlane | None = None  # the NIXL agent (here or in the core), made at start
        self._staging = StagingPool(settings.kv_shm_max_mb << 20) if self._host else None
        self._segments = SegmentMaps(self._host) if self._host else None
        self._table = ReceiveTable(settings.reservation_ttl_s, self._staging, self._expire)
        self._sweeper: asyncio.Task[None] | None = None
        self._peers = PeerChannels(settings.transport())
        self.kv_peers = PeerAllowList(settings.kv_peers, settings.kv_peer_ttl_s)
        self._address = ""
        self._sends: collections.Counter[str] = collections.Counter()  # by path, for metrics

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("embedded backend not started")
        return self._engine

    @property
    def info(self) -> BackendInfo:
        if self._info is None:
            raise RuntimeError("embedded backend not started")
        return self._info

    async def start(self, advertise_address: str) -> None:
        from engine_shim.engine.async_engine import AsyncEngine  # torch loads here

        self._address = advertise_address
        config = engine_config(self._settings)
        own_process = core_in_own_process(self._settings)
        # A core in its own process keeps the NIXL agent beside its pool (nixl_core.py).
        side = (functools.partial(nixl_side, loopback=_is_loopback(self._settings.host),
                                  local_copy=self._settings.kv_nixl_local_copy)
                if own_process and self._core_factory is None
                and self._settings.kv_transport in ("auto", "nixl") else None)
        engine = AsyncEngine(config, self._core_factory, own_process=own_process, side_factory=side)
        await engine.start()
        self._engine = engine
        if side is not None:
            self._nixl = _core_nixl(self._settings.kv_transport, engine)
        elif not own_process:
            self._nixl = _start_nixl(self._settings.kv_transport, engine.kv_pool, self._settings.host)
        self._info = BackendInfo(
            name=self._name,
            model_id=engine.model_id,
            device=self._settings.device,
            vocab_size=engine.vocab_size,
            max_context_length=engine.max_context_length,
            kv_layout=engine.kv_layout,
            starts_after_kv=True,
            takes_kv_addr_later=True,
            samples_first_token=True,
        )  # AsyncEngine.start() has loaded the model and run a warm-up pass
        if self._nixl is not None:
            self._sweeper = asyncio.ensure_future(self._sweep_reservations())
        # stderr: stdout carries only the `listening on` line that launchers wait for.
        print(ENGINE_THREAD_LINE.format(tid=engine.engine_tid), file=sys.stderr, flush=True)

    async def _sweep_reservations(self) -> None:
        """Where NIXL writes may come, the engine's reservations have no TTL of their own
        (prep_recv): expired tickets end them from here, within this interval of their TTL."""
        interval_s = min(_SWEEP_S, self._table.ttl_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self._table.close_expired()

    def _consume(self, request_id: str) -> None:
        """The reservation is consumed from here on (start_generate takes it in the engine).
        One with no TTL in the engine gets it back first, in the engine's order: should the
        start fail there (a bad prompt or sampling), its TTL still reclaims the pages."""
        ticket = self._table.close(request_id)
        if ticket is not None and ticket.engine_held:
            self.engine.submit_hold_reservation(request_id, False)

    def _expire(self, request_id: str) -> None:
        if self._engine is not None:
            self._engine.submit_expire_reservation(request_id)

    def _expire_made(self, request_id: str, call: asyncio.Future[Any]) -> None:
        """End the held reservation a cancelled PrepRecv's engine call made, if it made one."""
        if not call.cancelled() and call.exception() is None:
            self._expire(request_id)

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        try:
            await self._peers.close()
            if self._engine is not None:
                await self._engine.shutdown()
        finally:
            if self._nixl is not None:
                self._nixl.close()
            self._table.close_all()
            if self._staging is not None:
                self._staging.close()  # unlinks every segment, leased or free
            if self._segments is not None:
                self._segments.close()

    @property
    def kv_layout(self) -> KVLayout:
        if self._engine is None:
            raise UnavailableError("engine is still loading")
        return self._engine.kv_layout

    def kv_transfer_servicer(self, on_hold: HoldListener | None = None) -> KVTransferServicer:
        # The plane is made at start, after the servicer: looked up at each call.
        return KVTransferServicer(self._table, self, lambda: self._nixl, on_hold)

    async def prep_recv(
        self, request_id: str, token_ids: TokenIds, end: int, sampling: SamplingParams,
        whole_prompt: bool = False,
    ) -> Reservation:
        # Where a NIXL write may come, the ticket's TTL is the reservation's only one (the
        # engine's has none): a claim then begins the write without the engine's round trip.
        held = self._nixl is not None
        call = asyncio.ensure_future(
            self.engine.prep_recv(request_id, token_ids, end, sampling, held, whole_prompt)
        )
        try:
            result = await asyncio.shield(call)
        except asyncio.CancelledError:
            if held:  # a reservation the engine still makes would be nobody's to end
                call.add_done_callback(functools.partial(self._expire_made, request_id))
            raise
        layout = self.engine.kv_layout
        num_kv_bytes = (result.end - result.prefix_matched_length) * bytes_per_token(layout)
        try:
            # With a NIXL write offered, the stage serves only a sender without NIXL: unbacked.
            ticket = self._table.open(
                request_id, result.prefix_matched_length, result.end, num_kv_bytes,
                stage_backed=self._nixl is None, engine_held=held,
            )
        except BaseException:
            if held:  # nobody else would end it
                self._expire(request_id)
            raise
        addr = KVAddrInfo(
            address=self._address,
            request_id=request_id,
            reservation_token=ticket.token,
            begin=result.prefix_matched_length,
            end=result.end,
            kv_segments=tuple(result.kv_segments),
            layout=layout,
            shm=ticket.staging.offer(self._host) if ticket.staging and self._host else None,
            nixl=self._nixl.offer() if self._nixl is not None and num_kv_bytes else None,
            push_stream=self._settings.kv_push_stream,
        )
        if addr.nixl is not None:
            ticket.write_digest = addr.write_digest()
        return Reservation(request_id, result.end, result.prefix_matched_length, addr.encode())

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
        addr = self._checked_addr(request_id, begin, end, kv_addr_info)
        if addr.begin >= end:  # the receiver already holds the whole window
            return SendResult(0, 0, 0)
        if await self._can_write_nixl(addr):
            times, started = WriteTimes(), time.perf_counter()
            held = self._held_send(request_id, token_ids, begin, end, sampling, times, started)
            return await self._write_nixl(request_id, begin, addr, held, times, started)
        return await self._push(request_id, token_ids, addr, sampling)

    async def remote_send_later(
        self,
        request_id: str,
        token_ids: TokenIds,
        begin: int,
        end: int,
        sampling: SamplingParams,
        target: Awaitable[SendTarget],
    ) -> SendResult:
        """The send's job goes to the engine now and computes while the caller makes the
        receiver's PrepRecv. With a NIXL agent here the send is held from the start, for the
        write that reads its pages in place (a receiver that turns out to take no NIXL write
        gets a push: the held pages go to the prefix cache and the push computes from
        there); without one its chunks' export waits for the receiver's window."""
        started = time.perf_counter()
        if self._nixl is not None:
            times = WriteTimes()
            held = EnteredAhead(self._held_send(request_id, token_ids, begin, end, sampling, times, started))
            try:
                addr = await self._target_addr(request_id, end, target)
                use_nixl = addr.begin < end and await self._can_write_nixl(addr)
            except BaseException:
                await held.discard()
                raise
            if use_nixl:
                try:
                    return await self._write_nixl(request_id, begin, addr, held, times, started)
                finally:
                    await held.discard()  # when the write failed before it took the send
            await held.discard(keep=True)
            if addr.begin >= end:
                return SendResult(0, 0, 0)
            return await self._push(request_id, token_ids, addr, sampling)
        window: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()
        ahead = ChunksAhead(
            self.engine.remote_send(request_id, token_ids, begin, end,
                                    cache_salt=sampling.cache_salt, window=window),
            window,
        )
        try:
            addr = await self._target_addr(request_id, end, target)
        except BaseException:
            await ahead.discard()
            raise
        if addr.begin >= end:
            await ahead.discard()
            return SendResult(0, 0, 0)
        stage = self._stage(addr)
        ahead.set_window(addr.begin, self._export_into(addr, stage))
        return await self._push_chunks(request_id, addr, ahead.chunks(), stage, started)

    async def _target_addr(self, request_id: str, end: int, target: Awaitable[SendTarget]) -> KVAddrInfo:
        where = await target
        return self._checked_addr(request_id, where.begin, end, where.kv_addr_info)

    def _checked_addr(self, request_id: str, begin: int, end: int, kv_addr_info: bytes) -> KVAddrInfo:
        addr = KVAddrInfo.decode(kv_addr_info)
        self.kv_peers.check(addr.address)
        _check_window_fits(request_id, begin, end, addr)
        check_layout(addr.layout, self.engine.kv_layout)
        return addr

    async def _push(
        self, request_id: str, token_ids: TokenIds, addr: KVAddrInfo, sampling: SamplingParams
    ) -> SendResult:
        """The shared-memory stage or the gRPC push, for [addr.begin, addr.end)."""
        stage = self._stage(addr)
        started = time.perf_counter()
        chunks: AsyncIterator[KVChunk] = self.engine.remote_send(
            request_id, token_ids, addr.begin, addr.end, self._export_into(addr, stage),
            sampling.cache_salt,
        )
        return await self._push_chunks(request_id, addr, chunks, stage, started)

    def _export_into(self, addr: KVAddrInfo, stage: torch.Tensor | None) -> StageWindow | None:
        """With a stage, the engine exports each chunk straight into its window of it."""
        if stage is None or addr.shm is None:
            return None
        return StageWindow(addr.shm, (addr.end - addr.begin) * bytes_per_token(addr.layout),
                           addr.begin, addr.layout, stage)

    async def _push_chunks(
        self, request_id: str, addr: KVAddrInfo, chunks: AsyncIterator[KVChunk],
        stage: torch.Tensor | None, started: float,
    ) -> SendResult:
        streamed = stage is not None and addr.push_stream and self._settings.kv_push_stream
        num_tokens, num_bytes = await push_kv(
            self._peers,
            addr,
            chunks,
            max_payload_bytes=self._settings.kv_push_chunk_bytes,
            is_staged=stage is not None,
            timeout_s=self._settings.kv_push_timeout_s,
            stall_timeout_s=self._settings.kv_push_stall_timeout_s,
            streamed=streamed,
        )
        path = "shm-stream" if streamed else "shm" if stage is not None else "grpc"
        self._sends[path] += 1
        logger.info(
            "RemoteSend %s: %d tokens, %d bytes to %s in %.1f ms, path=%s",
            request_id, num_tokens, num_bytes, addr.address, (time.perf_counter() - started) * 1e3,
            path,
        )
        return SendResult(num_tokens, num_bytes, 0)

    async def _can_write_nixl(self, addr: KVAddrInfo) -> bool:
        """NIXL when both sides have an agent and this one can reach the offered one."""
        if addr.nixl is None or self._nixl is None:
            return False
        try:
            await self._nixl.load_peer(addr.nixl)
        except UnavailableError as error:
            logger.warning("NIXL to %s unusable (%s); falling back", addr.address, error)
            return False
        return True

    def _held_send(
        self, request_id: str, token_ids: TokenIds, begin: int, end: int,
        sampling: SamplingParams, times: WriteTimes, started: float,
    ) -> AbstractAsyncContextManager[Slots | None]:
        """The engine's send of [begin, end), held for a NIXL write (AsyncEngine.held_send)."""
        assert self._nixl is not None  # only where NIXL writes

        def accepted() -> None:
            times.accept_ms = (time.perf_counter() - started) * 1e3

        return self.engine.held_send(
            request_id, token_ids, begin, end, sampling.cache_salt,
            fetch_slots=not self._nixl.reads_held_slots, on_accepted=accepted,
        )

    async def _write_nixl(
        self,
        request_id: str,
        begin: int,
        addr: KVAddrInfo,
        held: AbstractAsyncContextManager[Slots | None],
        times: WriteTimes,
        started: float,
    ) -> SendResult:
        """Write the held send of [begin, end) into the receiver's [addr.begin, end)."""
        assert self._nixl is not None  # checked by _can_write_nixl
        num_tokens, num_bytes = await write_kv(
            self._peers, self._nixl, addr, held,
            send_id=request_id, window_begin=begin, write_timeout_s=self._settings.kv_write_timeout_s,
            hold_timeout_s=self._settings.kv_push_timeout_s, times=times,
        )
        logger.info(
            "RemoteSend %s: %d tokens, %d bytes to %s (%d runs of slots) in %.1f ms (%s), path=nixl",
            request_id, num_tokens, num_bytes, addr.address, addr.kv_segments[0] if addr.kv_segments else 0,
            (time.perf_counter() - started) * 1e3, times,
        )
        self._sends["nixl"] += 1
        return SendResult(num_tokens, num_bytes, 0)

    def _stage(self, addr: KVAddrInfo) -> torch.Tensor | None:
        """The receiver's shared-memory stage when this shim can write it, else None (gRPC)."""
        if addr.shm is None or self._segments is None:
            return None
        num_kv_bytes = (addr.end - addr.begin) * bytes_per_token(addr.layout)
        return self._segments.open(addr.shm, num_kv_bytes)

    def sampling_first(
        self, request_id: str, sampling: SamplingParams, on_first: OnFirst
    ) -> AbstractContextManager[FirstDelivery]:
        return self.engine.sampling_first(request_id, sampling, on_first)

    async def generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        after_kv: bool = False, continuations: Sequence[Continuation] = (),
    ) -> AsyncIterator[GenerateOutput]:
        async with self._starting(request_id, after_kv) as in_engine:
            outputs = self.engine.generate(request_id, token_ids, begin, sampling, in_engine, continuations)
            try:
                async for output in outputs:
                    yield output
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]  # AsyncEngine aborts on close

    async def run_generate(
        self, request_id: str, token_ids: TokenIds, begin: int, sampling: SamplingParams,
        on_output: Callable[[GenerateOutput], None], after_kv: bool = False,
        continuations: Sequence[Continuation] = (),
    ) -> None:
        async with self._starting(request_id, after_kv) as in_engine:
            await self.engine.run_generate(request_id, token_ids, begin, sampling, on_output, in_engine,
                                           continuations)

    @contextlib.asynccontextmanager
    async def _starting(self, request_id: str, after_kv: bool) -> AsyncIterator[bool]:
        """The reservation's ticket around a start made in the body; yields whether the start
        is to wait for its KV in the engine. A start that does not takes the reservation
        (`_consume`); with start_after_kv_in_engine off, one after the KV first waits here
        (FailedPreconditionError when the reservation ends without it). One that waits in
        the engine leaves the ticket open for the transfer (`_close_when_filled`) and, having run
        to its end, retires it (ReceiveTable.retire: a short request may end first)."""
        if after_kv and not self._settings.start_after_kv_in_engine:
            await self._table.wait_filled(request_id)
            after_kv = False
        if not after_kv:
            self._consume(request_id)
            yield False
            return
        ticket = self._table.get(request_id)
        closing = asyncio.ensure_future(self._close_when_filled(request_id))
        try:
            yield True
        finally:
            closing.cancel()
        # Ran to its end, so its KV arrived; the push may still be finishing (retire).
        if ticket is not None:
            self._table.retire(request_id, ticket)

    async def _close_when_filled(self, request_id: str) -> None:
        """Beside a start that waits for its KV in the engine (after_kv, made first: its op
        is submitted before this runs): the reservation's ticket stays open for the
        transfer and closes once filled (the engine has started the request by then: every
        way in ends in the table's finish after the engine's own). A ticket that ends
        without its KV (an abort, the sender's failure, its TTL) or was never there ends the
        engine's side now, not at the engine's own TTL: the abort fails the waiting start
        FAILED_PRECONDITION."""
        try:
            await self._table.wait_filled(request_id)
        except FailedPreconditionError:
            with contextlib.suppress(EngineError):
                await self.engine.abort(request_id)
            return
        self._table.close(request_id)

    async def import_kv(self, request_id: str, chunk: KVChunk) -> None:
        await self.engine.import_kv(request_id, chunk)

    async def hold_reservation(self, request_id: str, is_held: bool) -> None:
        await self.engine.hold_reservation(request_id, is_held)

    async def abort(self, request_id: str) -> bool:
        self._table.close(request_id)
        return bool(await self.engine.abort(request_id))

    async def begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        await self.engine.begin_kv_write(request_id, write_ends_at)

    def submit_begin_kv_write(self, request_id: str, write_ends_at: float) -> None:
        self.engine.submit_begin_kv_write(request_id, write_ends_at)

    async def finish_kv_write(self, request_id: str) -> None:
        await self.engine.finish_kv_write(request_id)

    async def cancel_kv_write(self, request_id: str, is_held: bool) -> None:
        await self.engine.cancel_kv_write(request_id, is_held)

    async def status(self) -> EngineStatus:
        return self.engine.status()

    def num_receive_tickets(self) -> int | None:
        return len(self._table)

    def kv_sends(self) -> Mapping[str, int] | None:
        return dict(self._sends)

    def tell_peers(self, addresses: Sequence[str]) -> None:
        self.kv_peers.tell(addresses)

    async def wait_lost(self) -> str:
        return await self.engine.wait_lost()


def _start_nixl(transport: str, pool: torch.Tensor | None, host: str) -> NixlPlane | None:
    """The shim's own NIXL agent (a core in a thread) with the pool registered, where the
    transport setting wants one and NIXL loads; `nixl` insists (a clear start-up error),
    `auto` falls back with a log."""
    if transport not in ("auto", "nixl") or pool is None:
        return None
    # No copies into mapped pools (kv_nixl_local_copy): a copy's notification leaves only as
    # the agent progresses, which the core's side does between steps and nothing does here.
    agent, reason = start_agent(pool, _is_loopback(host), local_copy=False)
    if agent is None:
        _no_nixl(transport, reason)
        return None
    plane = NixlPlane(agent)
    logger.info("KV transport: NIXL agent %s, pool in %s", plane.name, plane.mem_type)
    return plane


def _core_nixl(transport: str, engine: AsyncEngine) -> CoreNixlPlane | None:
    """The NIXL agent the engine core's process started beside its pool, driven from here."""
    facts: tuple[NixlOffer | None, str] = engine.facts.side  # type: ignore[assignment]  # NixlSide.facts
    offer, reason = facts
    if offer is None:
        _no_nixl(transport, reason)
        return None
    logger.info("KV transport: NIXL agent %s in the engine core process, pool in %s",
                offer.agent, offer.mem_type)
    return CoreNixlPlane(engine, offer)


def _no_nixl(transport: str, reason: str) -> None:
    if transport == "nixl":
        raise RuntimeError(f"--kv-transport nixl: {reason}")
    logger.info("KV transport: no NIXL (%s); shared memory or gRPC", reason)
    return None


def _check_window_fits(request_id: str, begin: int, end: int, addr: KVAddrInfo) -> None:
    """The sender's window must cover exactly the receiver's reserved slots (MLC checks this
    fatally inside its engine; here it is a clean INVALID_ARGUMENT)."""
    if addr.request_id != request_id:
        raise InvalidRequestError(
            f"kv_addr_info belongs to request {addr.request_id!r}, not {request_id!r}"
        )
    if end != addr.end:
        raise InvalidRequestError(f"end={end} differs from the receiver's reserved end {addr.end}")
    if begin > addr.begin:
        raise InvalidRequestError(
            f"begin={begin} is past the receiver's prefix_matched_length {addr.begin}"
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
