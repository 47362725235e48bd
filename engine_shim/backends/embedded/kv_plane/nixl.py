"""This shim's NIXL agent (UCX underneath: shared memory or CUDA IPC on one host, TCP or RDMA
across hosts): it registers the engine's KV pool, so a peer can write reserved slots
straight into it (host memory on the CPU, device memory on CUDA), and it writes a held
send's slots straight into a peer's pool. KV never passes through a stage or a message.

The receiver describes its pool in kv_addr_info (NixlOffer); the sender loads the agent's
metadata from there, but writes only after the receiver, over the authenticated KVTransfer
channel, has confirmed that offer for this reservation (WriteKV, nixl_sender.py). A
write carries the reservation token as its notification; the receiver completes the
reservation only on that token from the agent that claimed it.

The agent (NixlAgent) lives in the process that holds the pool: the shim's for a core in a
thread (NixlPlane, here), the engine core's for a core in a process of its own (nixl_core.py;
UCX could not write a CUDA IPC mapping of another process's pool).
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engine_shim.backends.embedded.kv_plane.addr import NixlOffer
from engine_shim.backends.embedded.kv_plane.nixl_descs import PoolRegion, descriptors, paired_runs
from engine_shim.backends.embedded.kv_plane.pool_ipc import (
    copy_runs,
    export_pool,
    open_pool,
    slot_view,
)
from engine_shim.engine.api import InvalidRequestError, UnavailableError

logger = logging.getLogger(__name__)

# The wheels install the module under their CUDA variant's name; the `nixl` meta package
# re-exports whichever is there.
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_SPIN_S = 0.0005  # poll by yielding this long, then sleep
# A notification sent on its own (after a copy into a mapped pool) leaves only once this
# agent's worker progresses: it is progressed at every poll of the core's side until the
# receiver has confirmed the write, or for this long at most.
NOTIFY_PROGRESS_S = 5.0
# A peer's pool mapped here and not written for this long is unmapped (a receiver that went
# away leaves no mapping of its memory behind for good); a later write maps it again.
MAPPING_IDLE_S = 60.0
_MAX_POLL_S = 0.0005  # a wait's polling adds at most this to a transfer's latency


def load_nixl() -> tuple[Any, str]:
    """(the NIXL module, "") or (None, why it cannot be used)."""
    reasons = []
    for name in _MODULES:
        raise_exceptions = logging.raiseExceptions  # NIXL's logging setup changes it
        try:
            module = importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - an ImportError or a broken native library
            reasons.append(f"{name}: {error}")
            continue
        finally:
            logging.raiseExceptions = raise_exceptions
        if hasattr(module, "nixl_agent"):
            _adopt_nixl_logger()
            return module, ""
        reasons.append(f"{name}: no nixl_agent")
    return None, "NIXL is not installed (pip install 'microserving-grpc[nixl]'): " + "; ".join(
        reasons
    )


def _adopt_nixl_logger() -> None:
    """NIXL logs to stdout, where a shim prints only its `listening on` line: send its
    records through this process's logging (stderr) instead, warnings and worse unless
    NIXL_LOG_LEVEL asks for more."""
    nixl_logger = logging.getLogger("nixl")
    nixl_logger.handlers.clear()
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def start_agent(pool: torch.Tensor, loopback: bool, local_copy: bool = True) -> tuple[NixlAgent | None, str]:
    """An agent over `pool` in this process, or None and why not (NIXL missing or failing to
    start). `loopback`: the shim is bound to loopback, and UCX is kept there too.
    `local_copy`: a CUDA pool is offered for mapping, and a peer's mapped pool is written by
    copying into it (pool_ipc.py)."""
    if loopback:
        # UCX listens on every network device it finds; a shim bound to loopback keeps its
        # KV data plane there too (shared memory and CUDA IPC are not network devices).
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    module, reason = load_nixl()
    if module is None:
        return None, reason
    try:
        return NixlAgent(module, pool, local_copy), ""
    except Exception as error:  # noqa: BLE001 - NIXL/UCX raise assorted errors
        return None, f"NIXL agent failed to start: {error}"


def offer_region(offer: NixlOffer) -> PoolRegion:
    """Where the offering peer's pool lies, in its own address space."""
    return PoolRegion(offer.base, offer.num_planes, offer.plane_bytes, offer.slot_bytes, offer.device_id)


def pool_region(pool: torch.Tensor) -> PoolRegion:
    """The planes of a contiguous [num_layers, 2, num_slots, ...] pool."""
    if not pool.is_contiguous():
        raise ValueError("the KV pool must be contiguous")
    plane_bytes = pool[0, 0].numel() * pool.element_size()
    slot_bytes = pool[0, 0, 0].numel() * pool.element_size()
    device_id = pool.get_device() if pool.is_cuda else 0
    return PoolRegion(pool.data_ptr(), pool.shape[0] * pool.shape[1], plane_bytes, slot_bytes, device_id)


class _Poller:
    """Spin briefly, then back off: the delay before the next poll."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self._sleep_s = 0.0

    async def wait(self) -> None:
        if time.perf_counter() - self._started < _SPIN_S:
            await asyncio.sleep(0)
            return
        self._sleep_s = min(_MAX_POLL_S, max(5e-5, self._sleep_s * 2))
        await asyncio.sleep(self._sleep_s)


class WriteNotStarted(UnavailableError):
    """A write was given up before anything of it was posted: nothing can land, so the
    receiver need not fence the pages (the sender abandons its claim)."""


@dataclass(eq=False)
class _Copy:
    """A write made as copies into the receiver's pool mapped here (pool_ipc.py): done on
    the device once `copied` has, landed once the notification has gone out."""

    copied: torch.cuda.Event | None  # None: copied when the copies returned (a CPU pool)
    agent: str
    tag: bytes
    target: torch.Tensor  # the mapped pool, kept mapped while the copies may run
    is_notified: bool = False


@dataclass(frozen=True)
class HeldSlots:
    """The local side of a write as a reference: the slots of the engine's held send
    `request_id`, from its `offset`-th on, read where the agent runs (the core's process)
    when the write starts, instead of fetched into the shim first (a round trip)."""

    request_id: str
    offset: int


class KVWritePlane(Protocol):
    """What the two sides of a NIXL write (nixl_sender.py, nixl_receiver.py) use of an agent:
    NixlPlane (the agent in this process) or nixl_core.CoreNixlPlane (in the core's)."""

    name: str
    region: PoolRegion
    mem_type: str
    # write() takes HeldSlots for its local side (the agent sits beside the engine core),
    # also before the send is computed: the agent's side posts the write once the KV is
    # written, so the sender claims while the engine computes (nixl_sender._write_early)
    reads_held_slots: bool
    # a notification completes its write in the engine itself (finish_kv_write), before the
    # future of expect() is set (or set with the error that completion raised)
    finishes_writes: bool

    def offer(self) -> NixlOffer: ...

    def expect(self, sender_agent: str, tag: bytes, request_id: str) -> asyncio.Future[None]: ...

    def forget(self, tag: bytes) -> None: ...

    async def load_peer(self, offer: NixlOffer) -> str: ...

    def drop_peer(self, agent: str) -> None: ...

    async def write(
        self, offer: NixlOffer, local_slots: np.ndarray | HeldSlots, remote_slots: np.ndarray,
        tag: bytes, *, deadline: float, peer: asyncio.Future[Any],
        peer_landed: Callable[[], bool], stop: asyncio.Future[None] | None = None,
    ) -> int:
        """Write `local_slots` of this pool into `remote_slots` of the offering peer's and
        notify `tag` once it landed; bytes written. The write has ended once this side's
        agent says so or once `peer` (the receiver's next event) completes with
        `peer_landed()` true; UnavailableError (the transfer cancelled) when `peer` completes
        otherwise, the write fails, `deadline` (monotonic) passes or `stop` is set, and
        WriteNotStarted when it ended so before anything of it was posted."""
        ...

    def landed(self, offer: NixlOffer, tag: bytes) -> None:
        """The receiver confirmed the write notified by `tag` (its notification has left)."""
        ...

    def close(self) -> None: ...


class NixlAgent:
    """A NIXL agent with the pool registered: plain calls, no event loop, used from the one
    thread that owns it (the agent is not thread-safe in the mode used here). It lives where
    the pool does: in the shim's process for a thread core (NixlPlane), in the engine core's
    process for a process core (nixl_core.py)."""

    def __init__(self, module: Any, pool: torch.Tensor, local_copy: bool = True) -> None:
        self.name = f"microserving-{os.getpid()}-{secrets.token_hex(4)}"
        # No progress thread: NIXL runs it with no delay between polls, a core spinning per
        # shim once a peer is connected (it starved the engine threads of a 2-core box). UCX
        # progresses instead in the owner's polls, which run exactly while a write is pending:
        # the sender's on its transfer, the receiver's on its notifications.
        config = module.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = module.nixl_agent(self.name, config)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL's UCX backend did not load")
        self._pool = pool  # kept alive while registered
        self.region = pool_region(pool)
        self.mem_type = "VRAM" if pool.is_cuda else "DRAM"
        self._registered = self._agent.register_memory(pool)
        self._metadata = base64.b64encode(self._agent.get_agent_metadata()).decode()
        self._peers: dict[str, str] = {}  # agent name -> metadata loaded for it
        # The peer of every transfer not yet released, and peers to drop once theirs are:
        # removing a peer fails every transfer to it still in flight (NIXL_ERR_NOT_FOUND), so
        # one failed write would fail all the others, each failure dropping the peer again.
        self._handle_peers: dict[int, str] = {}  # id(handle) -> peer
        self._drop_later: set[str] = set()
        # A CUDA pool is offered for mapping by a sender on the same GPU, and a peer's pool
        # offered so is copied into from here, on a stream of its own beside the engine's.
        self._local_copy = local_copy
        self._notifying: dict[bytes, float] = {}  # tag -> progressed for until (monotonic)
        self._arrived: list[tuple[str, bytes]] = []  # read while progressing
        self._mapping = None
        self._copy_stream: torch.cuda.Stream | None = None
        # peer agent -> (its pool mapped here or None: it cannot be, last used, monotonic)
        self._mapped: dict[str, tuple[torch.Tensor | None, float]] = {}
        self._slots = slot_view(pool, self.region)
        if local_copy and pool.is_cuda:
            try:
                self._mapping = export_pool(pool)
            except Exception:  # noqa: BLE001 - then every write goes through NIXL
                logger.warning("cannot offer the KV pool for mapping; NIXL writes it", exc_info=True)
            self._copy_stream = torch.cuda.Stream(device=pool.device)

    def offer(self) -> NixlOffer:
        r = self.region
        return NixlOffer(
            agent=self.name, metadata=self._metadata, mem_type=self.mem_type,
            device_id=r.device_id, base=r.base, num_planes=r.num_planes,
            plane_bytes=r.plane_bytes, slot_bytes=r.slot_bytes, mapping=self._mapping,
        )

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent, tag) of every notification that arrived since the last call."""
        got, self._arrived = self._arrived, []
        return got + self._read_notifications()

    def _read_notifications(self) -> list[tuple[str, bytes]]:
        """What the agent has received since it was last asked (progressing its worker)."""
        return [(sender, bytes(tag)) for sender, tags in self._agent.get_new_notifs().items()
                for tag in tags]

    @property
    def is_notifying(self) -> bool:
        """A notification sent on its own may not have left yet: progress() it."""
        return bool(self._notifying)

    def progress(self) -> None:
        """Progress this agent's worker for the notifications sent on their own (what comes
        in meanwhile is kept for notifications()); one unconfirmed for NOTIFY_PROGRESS_S is
        no longer progressed for."""
        now = time.monotonic()
        self._notifying = {tag: until for tag, until in self._notifying.items() if until > now}
        self._arrived += self._read_notifications()

    def confirmed(self, tag: bytes) -> None:
        """The receiver has the write notified by `tag`: its notification has left."""
        self._notifying.pop(tag, None)

    def load_peer(self, offer: NixlOffer) -> str:
        """Load (once per metadata) the offering agent; its name, checked against the offer."""
        if self._peers.get(offer.agent) == offer.metadata:
            return offer.agent
        try:
            name = self._agent.add_remote_agent(base64.b64decode(offer.metadata))
        except Exception as error:  # noqa: BLE001 - NIXL raises its own error types
            raise UnavailableError(f"cannot load NIXL agent {offer.agent}: {error}") from None
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name != offer.agent:
            self._agent.remove_remote_agent(name)
            raise UnavailableError(f"NIXL metadata names agent {name}, the offer {offer.agent}")
        self._peers[name] = offer.metadata
        return name

    def drop_peer(self, agent: str) -> None:
        """Disconnect from a peer that failed (it is reloaded from its next offer, or by the
        next write to it): at once, or once the transfers to it still open are released."""
        if agent in self._handle_peers.values():
            self._drop_later.add(agent)
            return
        self._drop_later.discard(agent)
        self._mapped.pop(agent, None)
        if self._peers.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except Exception:  # noqa: BLE001 - already gone is fine
                logger.debug("removing NIXL agent %s failed", agent, exc_info=True)

    def start_write(
        self, offer: NixlOffer, local_slots: np.ndarray, remote_slots: np.ndarray, tag: bytes
    ) -> tuple[Any, str, int]:
        """Start writing `local_slots` of this pool into `remote_slots` of the offering peer's,
        notifying `tag` once it landed: (transfer handle, its state, bytes it writes). The
        offering agent is loaded first if it is not (a peer dropped after a failure). Into
        a pool mapped here (the same GPU), the write is copies and the notification."""
        self.load_peer(offer)
        mapped = self._peer_pool(offer)
        if mapped is not None:
            return self._copy(mapped, offer, local_slots, remote_slots, tag)
        local_starts, remote_starts, lengths = paired_runs(local_slots, remote_slots)
        remote = offer_region(offer)
        agent = self._agent
        local_descs = agent.get_xfer_descs(descriptors(self.region, local_starts, lengths), self.mem_type)
        remote_descs = agent.get_xfer_descs(descriptors(remote, remote_starts, lengths), offer.mem_type)
        try:
            handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, offer.agent, tag)
        except Exception as error:  # noqa: BLE001 - NIXL raises its own error types
            raise UnavailableError(f"NIXL could not set up a write to agent {offer.agent}: {error}") from None
        self._handle_peers[id(handle)] = offer.agent
        try:
            state = agent.transfer(handle)
        except BaseException:
            self.release(handle)
            raise
        return handle, state, self.region.bytes_of(int(lengths.sum()))

    def _peer_pool(self, offer: NixlOffer) -> torch.Tensor | None:
        """The offering peer's pool mapped here, where its offer allows and it can be (once
        per peer); None: write through NIXL."""
        if offer.mapping is None or not self._local_copy:
            return None
        now = time.monotonic()
        for agent, (_, used) in list(self._mapped.items()):
            if now - used > MAPPING_IDLE_S:
                del self._mapped[agent]
        if offer.agent in self._mapped:
            mapped = self._mapped[offer.agent][0]
        else:
            try:
                mapped = open_pool(offer.mapping, offer_region(offer), self._pool)
            except InvalidRequestError:
                raise
            except Exception as error:  # noqa: BLE001 - CUDA's errors: NIXL writes instead
                logger.warning("cannot map the KV pool of agent %s (%s); NIXL writes to it",
                               offer.agent, error)
                mapped = None
            else:
                if mapped is not None:
                    logger.info("KV writes to agent %s: copies into its pool, mapped here by CUDA IPC",
                                offer.agent)
        self._mapped[offer.agent] = (mapped, now)
        return mapped

    def _copy(self, mapped: torch.Tensor, offer: NixlOffer, local_slots: np.ndarray,
              remote_slots: np.ndarray, tag: bytes) -> tuple[Any, str, int]:
        stream = self._copy_stream
        copied = None
        if stream is None:  # host memory: copied once the copies return
            num_bytes = copy_runs(mapped, self._slots, local_slots, remote_slots)
        else:
            with torch.cuda.stream(stream):
                num_bytes = copy_runs(mapped, self._slots, local_slots, remote_slots)
                copied = torch.cuda.Event()
                copied.record(stream)
        handle = _Copy(copied, offer.agent, tag, mapped)
        self._handle_peers[id(handle)] = offer.agent
        return handle, "PROC", num_bytes

    def state(self, handle: Any) -> str:
        if isinstance(handle, _Copy):
            # Landed once copied on the device: then the receiver hears of it.
            if not handle.is_notified:
                if handle.copied is not None and not handle.copied.query():
                    return "PROC"
                self._agent.send_notif(handle.agent, handle.tag)
                handle.is_notified = True
                self._notifying[handle.tag] = time.monotonic() + NOTIFY_PROGRESS_S
                self.progress()
            return "DONE"
        return str(self._agent.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        """Release a transfer, cancelling it if it still runs; a drop of its peer waiting
        for it follows. Copies cannot be cancelled: one released unfinished lands without
        a notification (its receiver fences the slots, as for a cancelled transfer)."""
        try:
            if not isinstance(handle, _Copy):
                handle.release()
        except Exception:  # noqa: BLE001 - logged; nothing else can be done with it
            logger.exception("could not release (cancel) a NIXL transfer")
        peer = self._handle_peers.pop(id(handle), None)
        if peer is not None and peer in self._drop_later:
            self.drop_peer(peer)  # or later still, while other transfers to it are open

    def close(self) -> None:
        for agent in list(self._peers):
            self.drop_peer(agent)
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - shutting down
            logger.debug("deregistering the KV pool failed", exc_info=True)


class NotificationWaits:
    """Writes a receiver waits for, by tag: each completes only on its tag from the agent
    that claimed it (a late or foreign notification completes nothing)."""

    def __init__(self) -> None:
        self._waiting: dict[bytes, tuple[str, asyncio.Future[None]]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, sender_agent: str, tag: bytes) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[tag] = (sender_agent, future)
        return future

    def forget(self, tag: bytes) -> bool:
        """True if `tag` was still awaited."""
        entry = self._waiting.pop(tag, None)
        if entry is None:
            return False
        if not entry[1].done():
            entry[1].cancel()
        return True

    def deliver(self, sender: str, tag: bytes, error: BaseException | None = None) -> bool:
        """True if this completed an awaited write (with `error`, if completing it failed)."""
        entry = self._waiting.get(tag)
        if entry is None or entry[0] != sender:
            logger.warning("ignoring a KV notification from agent %s", sender)
            return False
        del self._waiting[tag]
        if not entry[1].done():
            if error is None:
                entry[1].set_result(None)
            else:
                entry[1].set_exception(error)
        return True

    def close(self) -> None:
        for tag in list(self._waiting):
            self.forget(tag)


class NixlPlane:
    """The shim's own agent (a core in a thread of this process, the pool this process's):
    every agent call on the event loop's thread. Transfers and notifications are polled:
    briefly by yielding, then with sleeps that grow to `_MAX_POLL_S`, so an idle shim spends
    nothing and a short transfer is seen within microseconds."""

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self.name = self._agent.name
        self.region = self._agent.region
        self.mem_type = self._agent.mem_type
        self.reads_held_slots = False  # the engine thread's slots come to the loop first
        self.finishes_writes = False  # the receiving shim calls finish_kv_write
        self._waits = NotificationWaits()
        self._listener: asyncio.Task[None] | None = None

    def offer(self) -> NixlOffer:
        return self._agent.offer()

    # ---- receiving side: notifications ----
    def expect(self, sender_agent: str, tag: bytes, request_id: str) -> asyncio.Future[None]:
        """A future set when `sender_agent` notifies `tag` (a write of it has landed)."""
        future = self._waits.add(sender_agent, tag)
        if self._listener is None or self._listener.done():
            self._listener = asyncio.ensure_future(self._listen())
        return future

    def forget(self, tag: bytes) -> None:
        self._waits.forget(tag)

    async def _listen(self) -> None:
        poller = _Poller()
        try:
            while self._waits:
                for sender, tag in self._agent.notifications():
                    self._waits.deliver(sender, tag)
                    poller = _Poller()
                await poller.wait()
        except Exception:
            # The waiting writes then end at their deadlines (UNAVAILABLE), pages fenced.
            logger.exception("reading NIXL notifications failed")

    # ---- sending side ----
    async def load_peer(self, offer: NixlOffer) -> str:
        return self._agent.load_peer(offer)

    def drop_peer(self, agent: str) -> None:
        self._agent.drop_peer(agent)

    async def write(
        self,
        offer: NixlOffer,
        local_slots: np.ndarray | HeldSlots,
        remote_slots: np.ndarray,
        tag: bytes,
        *,
        deadline: float,
        peer: asyncio.Future[Any],
        peer_landed: Callable[[], bool],
        stop: asyncio.Future[None] | None = None,
    ) -> int:
        """KVWritePlane.write. Once the peer confirmed, this side's transfer is still polled
        to its end (releasing it earlier would cancel it), within the deadline."""
        if isinstance(local_slots, HeldSlots):
            raise TypeError("this plane writes slots fetched from the engine, not references")
        handle, state, num_bytes = self._agent.start_write(offer, local_slots, remote_slots, tag)
        try:
            poller = _Poller()
            while state == "PROC":
                if (peer.done() and not peer_landed() or time.monotonic() > deadline
                        or stop is not None and stop.done()):
                    raise UnavailableError(f"KV write to agent {offer.agent} did not complete")
                await poller.wait()
                state = self._agent.state(handle)
            if state != "DONE" and not peer_landed():
                raise UnavailableError(f"KV write to agent {offer.agent} failed ({state})")
        finally:
            self._agent.release(handle)
        return num_bytes

    def landed(self, offer: NixlOffer, tag: bytes) -> None:
        """KVWritePlane.landed: nothing to do (this plane's agent copies into no mapped pool:
        its notifications would need progress that nothing here makes)."""

    def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        self._waits.close()
        self._agent.close()
