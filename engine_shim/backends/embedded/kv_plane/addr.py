"""The embedded backend's `kv_addr_info`: self-describing JSON bytes that tell a sender where
to push KV (the receiver's data-plane address), which reservation it fills (request id and a
random token), which slots (MLC-style segments), what KV layout the receiver expects and,
when it can take the KV through shared memory, which segment (shm.py) and whether such a
push may come on a long-lived stream (push_stream.py), and
when a transfer engine may write its pool directly, the agent and pool regions to write
(nixl.py) and, for a sender on the same GPU, the pool's CUDA IPC mapping (pool_ipc.py).
Opaque to the router, which passes it through unchanged."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from engine_shim.engine.api import InvalidRequestError, KVLayout

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShmOffer:
    """The receiver's offer of a shared-memory stage for this reservation."""

    host: str  # the receiver's host identity (boot id and hostname)
    pid: int  # the receiver's process id and the descriptor of the segment (a memfd) in it:
    fd: int  # a sender opens /proc/<pid>/fd/<fd>
    nonce: str  # written at the start of the segment: proves a sender mapped this one
    size: int  # bytes of the segment, header included

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ShmOffer:
        return cls(
            str(body["host"]), int(body["pid"]), int(body["fd"]), str(body["nonce"]),
            int(body["size"]),
        )


@dataclass(frozen=True)
class PoolMapping:
    """What another process on this host needs to map a CUDA pool (torch's IPC handles of
    the pool's storage, base64) and where the pool lies in that storage."""

    host: str  # host_identity(): boot id and hostname
    pid: int  # the owning process: a sender in the same process never maps its own pool
    device_uuid: str
    handle: str
    storage_bytes: int
    storage_offset: int  # of the storage in the allocation the handle names (bytes)
    ref_counter_handle: str
    ref_counter_offset: int
    event_handle: str
    event_sync_required: bool
    pool_offset: int  # of the pool in its storage (bytes)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PoolMapping:
        return cls(
            str(body["host"]), int(body["pid"]), str(body["device_uuid"]), str(body["handle"]),
            int(body["storage_bytes"]), int(body["storage_offset"]),
            str(body["ref_counter_handle"]), int(body["ref_counter_offset"]),
            str(body["event_handle"]), bool(body["event_sync_required"]), int(body["pool_offset"]),
        )


@dataclass(frozen=True)
class NixlOffer:
    """The receiver's NIXL agent and where its KV pool lies: the slot `s` of plane `p`
    (p = 2 * layer + (0 key, 1 value)) starts at `base + p * plane_bytes + s * slot_bytes`."""

    agent: str  # the receiver's agent name (also inside `metadata`)
    metadata: str  # the agent's metadata (base64), which a sender loads to reach it
    mem_type: str  # "DRAM" (host memory) or "VRAM" (device memory)
    device_id: int
    base: int
    num_planes: int
    plane_bytes: int
    slot_bytes: int
    # Set where a sender on the same GPU may copy into the pool itself (pool_ipc.py).
    mapping: PoolMapping | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> NixlOffer:
        mapping = body.get("mapping")
        return cls(
            str(body["agent"]), str(body["metadata"]), str(body["mem_type"]),
            int(body["device_id"]), int(body["base"]), int(body["num_planes"]),
            int(body["plane_bytes"]), int(body["slot_bytes"]),
            PoolMapping.from_json(mapping) if mapping is not None else None,
        )


@dataclass(frozen=True)
class KVAddrInfo:
    address: str  # host:port of the receiving shim's KVTransfer service
    request_id: str
    reservation_token: str
    begin: int  # first position the receiver expects (its prefix_matched_length)
    end: int  # exclusive end of the reserved window
    kv_segments: tuple[int, ...]  # MLC's [n, begin_1, len_1, ...] absolute slot list
    layout: KVLayout
    # Set when the receiver can also take the KV through shared memory (same host only).
    shm: ShmOffer | None = None
    # Set when a sender may write the reserved slots itself through NIXL.
    nixl: NixlOffer | None = None
    # The receiver takes a push through its stage on a PushKVStream (push_stream.py).
    push_stream: bool = False

    def encode(self) -> bytes:
        body: dict[str, Any] = {"version": FORMAT_VERSION, **asdict(self)}
        body["kv_segments"] = list(self.kv_segments)
        for optional in ("shm", "nixl"):
            if body[optional] is None:
                del body[optional]
        if not self.push_stream:  # what a receiver without the stream wrote
            del body["push_stream"]
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def write_digest(self) -> str:
        """SHA-256 of everything that decides where a NIXL write lands (agent, regions, slots,
        window, reservation): the receiver keeps it, a sender quotes it in WriteKV."""
        body = {
            "nixl": None if self.nixl is None else asdict(self.nixl),
            "kv_segments": list(self.kv_segments),
            "window": [self.begin, self.end],
            "reservation": [self.request_id, self.reservation_token],
        }
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()

    @classmethod
    def decode(cls, raw: bytes) -> KVAddrInfo:
        try:
            body = json.loads(raw.decode("utf-8"))
            if body.get("version") != FORMAT_VERSION:
                raise InvalidRequestError(f"kv_addr_info version {body.get('version')!r} unknown")
            return cls(
                address=str(body["address"]),
                request_id=str(body["request_id"]),
                reservation_token=str(body["reservation_token"]),
                begin=int(body["begin"]),
                end=int(body["end"]),
                kv_segments=tuple(int(x) for x in body["kv_segments"]),
                layout=KVLayout(**body["layout"]),
                shm=ShmOffer.from_json(body["shm"]) if body.get("shm") is not None else None,
                nixl=NixlOffer.from_json(body["nixl"]) if body.get("nixl") is not None else None,
                push_stream=body.get("push_stream") is True,
            )
        except InvalidRequestError:
            raise
        except RecursionError:  # JSON nested past the parser's depth
            raise InvalidRequestError("malformed kv_addr_info: nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise InvalidRequestError(f"malformed kv_addr_info: {error}") from None
