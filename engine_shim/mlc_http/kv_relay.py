"""KV between MLC-compatible servers. Real MLC writes KV into the receiver's slots through
NVSHMEM, addressed by `recv_rank` and the base64 `kv_append_metadata` slot list. Here the
sender looks `recv_rank` up in its peer table (--peer RANK=URL) and POSTs each chunk to the
receiver's internal route, naming the request (`user`) and the metadata it was given, so
kv_append_metadata itself stays exactly MLC-shaped."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass

import httpx

from engine_shim.backends.embedded.kv_plane.codec import chunk_from_bytes, split_chunk
from engine_shim.engine.api import (
    FailedPreconditionError,
    InvalidRequestError,
    KVChunk,
    KVLayout,
    NotFoundError,
    UnavailableError,
)

PUSH_KV_PATH = "/microserving/_internal/push_kv"
H_REQUEST_ID = "x-microserving-request-id"
H_METADATA = "x-microserving-kv-append-metadata"
H_BEGIN = "x-microserving-begin"
H_NUM_TOKENS = "x-microserving-num-tokens"
H_LAYOUT = "x-microserving-layout"

_PEER_STATUS = {404: NotFoundError, 409: FailedPreconditionError, 400: InvalidRequestError}


def encode_kv_append_metadata(segments: Sequence[int]) -> str:
    """MLC's format: base64 of a JSON int list [n_segments, begin_1, len_1, ...]."""
    return base64.b64encode(json.dumps(list(segments)).encode()).decode()


def decode_kv_append_metadata(text: str) -> list[int]:
    try:
        values = json.loads(base64.b64decode(text, validate=True))
    except ValueError:
        raise InvalidRequestError("kv_addr_info is not base64 JSON") from None
    if not isinstance(values, list) or not values or not all(isinstance(v, int) for v in values):
        raise InvalidRequestError("kv_addr_info must encode a JSON int list")
    if len(values) != 1 + 2 * values[0]:
        raise InvalidRequestError("kv_addr_info segment count does not match its length")
    return values


def segments_length(values: Sequence[int]) -> int:
    return sum(values[2::2])


@dataclass
class Incoming:
    """A prep_recv reservation waiting for KV from a peer."""

    metadata: str
    begin: int
    end: int
    position: int
    expires_at_s: float


class IncomingTable:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._entries: dict[str, Incoming] = {}

    def open(self, request_id: str, metadata: str, begin: int, end: int) -> None:
        self._entries[request_id] = Incoming(
            metadata, begin, end, begin, time.monotonic() + self._ttl_s
        )

    def get(self, request_id: str, metadata: str) -> Incoming:
        entry = self._entries.get(request_id)
        if entry is None or entry.expires_at_s <= time.monotonic() or entry.metadata != metadata:
            raise NotFoundError(f"no reservation for {request_id!r} with that kv_append_metadata")
        return entry

    def close(self, request_id: str) -> None:
        self._entries.pop(request_id, None)


def layout_header(layout: KVLayout) -> str:
    return json.dumps(asdict(layout), sort_keys=True)


def parse_chunk(headers: dict[str, str], body: bytes, layout: KVLayout) -> tuple[str, str, KVChunk]:
    """(request id, metadata, chunk) of one internal push; FAILED_PRECONDITION on a layout
    that is not ours."""
    try:
        theirs = KVLayout(**json.loads(headers[H_LAYOUT]))
        begin, num_tokens = int(headers[H_BEGIN]), int(headers[H_NUM_TOKENS])
        request_id, metadata = headers[H_REQUEST_ID], headers[H_METADATA]
    except (KeyError, ValueError, TypeError):
        raise InvalidRequestError("malformed KV push headers") from None
    if theirs != layout:
        raise FailedPreconditionError(f"incompatible KV layout {theirs} (ours {layout})")
    return request_id, metadata, chunk_from_bytes(begin, num_tokens, body, layout)


class KVRelay:
    """The sending side: one pooled HTTP client to every peer."""

    def __init__(self, peers: dict[int, str], layout: KVLayout, max_chunk_bytes: int) -> None:
        self._peers = peers
        self._layout = layout
        self._max_chunk_bytes = max_chunk_bytes
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))

    async def close(self) -> None:
        await self._client.aclose()

    async def send(
        self, recv_rank: int, request_id: str, metadata: str, chunks: AsyncIterator[KVChunk]
    ) -> int:
        url = self._peers.get(recv_rank)
        if url is None:
            raise InvalidRequestError(f"recv_rank {recv_rank} is not a known peer")
        num_bytes = 0
        try:
            async for chunk in chunks:
                for begin, num_tokens, raw in split_chunk(chunk, self._max_chunk_bytes):
                    # httpx sends bytes, not memoryviews: this path copies once more.
                    await self._post(url, request_id, metadata, begin, num_tokens, bytes(raw))
                    num_bytes += len(raw)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        return num_bytes

    async def _post(
        self, url: str, request_id: str, metadata: str, begin: int, num_tokens: int, raw: bytes
    ) -> None:
        headers = {
            H_REQUEST_ID: request_id,
            H_METADATA: metadata,
            H_BEGIN: str(begin),
            H_NUM_TOKENS: str(num_tokens),
            H_LAYOUT: layout_header(self._layout),
        }
        try:
            response = await self._client.post(url + PUSH_KV_PATH, content=raw, headers=headers)
        except httpx.HTTPError as error:
            raise UnavailableError(f"KV push to {url} failed: {error}") from None
        if response.status_code >= 400:
            error_type = _PEER_STATUS.get(response.status_code, UnavailableError)
            raise error_type(f"KV push to {url} refused: {response.text[:300]}")
