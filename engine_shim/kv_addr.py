"""The embedded backend's `kv_addr_info`: self-describing JSON bytes that tell a sender where
to push KV (the receiver's data-plane address), which reservation it fills (request id and a
random token), which slots (MLC-style segments), what KV layout the receiver expects and,
when it can take the KV through shared memory, which segment (engine_shim/kv_shm.py). Opaque
to the router, which passes it through unchanged."""

from __future__ import annotations

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

    def encode(self) -> bytes:
        body: dict[str, Any] = {"version": FORMAT_VERSION, **asdict(self)}
        body["kv_segments"] = list(self.kv_segments)
        if self.shm is None:
            del body["shm"]
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

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
            )
        except InvalidRequestError:
            raise
        except RecursionError:  # JSON nested past the parser's depth
            raise InvalidRequestError("malformed kv_addr_info: nested too deeply") from None
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise InvalidRequestError(f"malformed kv_addr_info: {error}") from None
