"""This shim's NIXL agent (UCX underneath: shared memory or CUDA IPC on one host, TCP or RDMA
across hosts): it registers the engine's KV pool, so a peer can write reserved slots
straight into it (host memory on the CPU, device memory on CUDA), and it writes a held
send's slots straight into a peer's pool. KV never passes through a stage or a message.

The receiver describes its pool in kv_addr_info (NixlOffer); the sender loads the agent's
metadata from there, but writes only after the receiver, over the authenticated KVTransfer
channel, has confirmed that offer for this reservation (WriteKV, nixl_sender.py). A
write carries the reservation token as its notification; the receiver completes the
reservation only on that token from the agent that claimed it.

Every agent call runs on the event loop's thread (the agent is not thread-safe in the mode
used here, and has no progress thread: see NixlPlane). Transfers and notifications are polled:
briefly by yielding, then with sleeps that grow to `_MAX_POLL_S`, so an idle shim spends
nothing and a short transfer is seen within microseconds.
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
from typing import Any

import numpy as np
import torch

from engine_shim.backends.embedded.kv_plane.addr import NixlOffer
from engine_shim.backends.embedded.kv_plane.nixl_descs import PoolRegion, descriptors, paired_runs
from engine_shim.engine.api import UnavailableError

logger = logging.getLogger(__name__)

# The wheels install the module under their CUDA variant's name; the `nixl` meta package
# re-exports whichever is there.
_MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
_SPIN_S = 0.0005  # poll by yielding this long, then sleep
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


class NixlPlane:
    """One agent per shim process, with the pool registered."""

    def __init__(self, module: Any, pool: torch.Tensor) -> None:
        self._module = module
        self.name = f"microserving-{os.getpid()}-{secrets.token_hex(4)}"
        # No progress thread: NIXL runs it with no delay between polls, a core spinning per
        # shim once a peer is connected (it starved the engine threads of a 2-core box). UCX
        # progresses instead in the polls below, which run exactly while a write is pending:
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
        self._waiting: dict[bytes, tuple[str, asyncio.Future[None]]] = {}
        self._listener: asyncio.Task[None] | None = None

    def offer(self) -> NixlOffer:
        r = self.region
        return NixlOffer(
            agent=self.name, metadata=self._metadata, mem_type=self.mem_type,
            device_id=r.device_id, base=r.base, num_planes=r.num_planes,
            plane_bytes=r.plane_bytes, slot_bytes=r.slot_bytes,
        )

    # ---- receiving side: notifications ----
    def expect(self, sender_agent: str, tag: bytes) -> asyncio.Future[None]:
        """A future set when `sender_agent` notifies `tag` (a write of it has landed)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[tag] = (sender_agent, future)
        if self._listener is None or self._listener.done():
            self._listener = asyncio.ensure_future(self._listen())
        return future

    def forget(self, tag: bytes) -> None:
        entry = self._waiting.pop(tag, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()

    async def _listen(self) -> None:
        poller = _Poller()
        try:
            while self._waiting:
                for sender, tags in self._agent.get_new_notifs().items():
                    for tag in tags:
                        self._deliver(sender, bytes(tag))
                    poller = _Poller()
                await poller.wait()
        except Exception:
            # The waiting writes then end at their deadlines (UNAVAILABLE), pages fenced.
            logger.exception("reading NIXL notifications failed")

    def _deliver(self, sender: str, tag: bytes) -> None:
        entry = self._waiting.get(tag)
        if entry is None or entry[0] != sender:
            # A late or foreign notification: it completes nothing.
            logger.warning("ignoring a KV notification from agent %s", sender)
            return
        del self._waiting[tag]
        if not entry[1].done():
            entry[1].set_result(None)

    # ---- sending side ----
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
        """Disconnect from a peer that failed (it is reloaded from its next offer)."""
        if self._peers.pop(agent, None) is not None:
            try:
                self._agent.remove_remote_agent(agent)
            except Exception:  # noqa: BLE001 - already gone is fine
                logger.debug("removing NIXL agent %s failed", agent, exc_info=True)

    async def write(
        self,
        offer: NixlOffer,
        local_slots: np.ndarray,
        remote_slots: np.ndarray,
        tag: bytes,
        *,
        deadline: float,
        should_stop: Callable[[], bool],
    ) -> int:
        """Write `local_slots` of this pool into `remote_slots` of the offering peer's and
        notify `tag` once it landed; bytes written. Cancelled (its transfer with it) past
        `deadline` (monotonic) or once `should_stop()` is true."""
        local_starts, remote_starts, lengths = paired_runs(local_slots, remote_slots)
        remote = PoolRegion(
            offer.base, offer.num_planes, offer.plane_bytes, offer.slot_bytes, offer.device_id
        )
        agent = self._agent
        local_descs = agent.get_xfer_descs(descriptors(self.region, local_starts, lengths), self.mem_type)
        remote_descs = agent.get_xfer_descs(descriptors(remote, remote_starts, lengths), offer.mem_type)
        try:
            handle = agent.initialize_xfer("WRITE", local_descs, remote_descs, offer.agent, tag)
        except Exception as error:  # noqa: BLE001 - NIXL raises its own error types
            raise UnavailableError(f"NIXL could not set up a write to agent {offer.agent}: {error}") from None
        try:
            state = agent.transfer(handle)
            poller = _Poller()
            while state == "PROC":
                if should_stop() or time.monotonic() > deadline:
                    raise UnavailableError(f"KV write to agent {offer.agent} did not complete")
                await poller.wait()
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise UnavailableError(f"KV write to agent {offer.agent} failed ({state})")
        finally:
            self._release(handle)
        return int(lengths.sum()) * self.region.slot_bytes * self.region.num_planes

    def _release(self, handle: Any) -> None:
        """Release a transfer, cancelling it if it still runs."""
        try:
            handle.release()
        except Exception:  # noqa: BLE001 - logged; nothing else can be done with it
            logger.exception("could not release (cancel) a NIXL transfer")

    def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        for tag in list(self._waiting):
            self.forget(tag)
        for agent in list(self._peers):
            self.drop_peer(agent)
        try:
            self._agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - shutting down
            logger.debug("deregistering the KV pool failed", exc_info=True)
