"""KV tensors <-> the bytes of KVChunkData. A chunk's tensor has shape
[num_layers, 2, num_tokens, num_kv_heads, head_dim] (2 = key, value); messages split it along
the token axis so none exceeds the configured payload size."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator

import torch

from engine_shim.engine.api import FailedPreconditionError, InvalidRequestError, KVChunk, KVLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return _DTYPES[layout.dtype]


def check_layout(theirs: KVLayout, ours: KVLayout) -> None:
    if theirs != ours:
        fields = [name for name in vars(ours) if getattr(theirs, name) != getattr(ours, name)]
        raise FailedPreconditionError(f"incompatible KV layout: {', '.join(fields)} differ")


@functools.lru_cache(maxsize=64)
def bytes_per_token(layout: KVLayout) -> int:
    # Cached: a transfer asks once per chunk, and the torch call below costs more than the
    # rest of a shared-memory chunk's bookkeeping.
    element_size = torch.empty((), dtype=torch_dtype(layout)).element_size()
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * element_size


def split_chunk(chunk: KVChunk, max_payload_bytes: int) -> Iterator[tuple[int, int, memoryview]]:
    """(begin, num_tokens, raw bytes) pieces of `chunk`, each at most max_payload_bytes
    (one token at least). The bytes are a view of the tensor (no copy); a piece is copied only
    when the chunk must be split along its token axis."""
    data = chunk.data
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"KVChunk.data must be a torch.Tensor, got {type(data).__name__}")
    data = data.detach().to("cpu")
    per_token = data[:, :, :1].numel() * data.element_size()
    step = max(1, max_payload_bytes // max(1, per_token))
    for offset in range(0, chunk.num_tokens, step):
        count = min(step, chunk.num_tokens - offset)
        piece = data[:, :, offset : offset + count].contiguous()
        array = piece.view(torch.uint8).numpy()
        yield chunk.begin + offset, count, array.data.cast("B")


def chunk_from_bytes(
    begin: int, num_tokens: int, raw: bytes | memoryview, layout: KVLayout
) -> KVChunk:
    expected = num_tokens * bytes_per_token(layout)
    if num_tokens < 1 or len(raw) != expected:
        raise InvalidRequestError(
            f"KV chunk of {num_tokens} tokens must carry {expected} bytes, got {len(raw)}"
        )
    with warnings.catch_warnings():
        # frombuffer warns that bytes are read-only; the engine copies them into its pool.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=torch_dtype(layout))
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    return KVChunk(begin=begin, num_tokens=num_tokens, data=flat.view(shape))


def staged_chunk(
    stage: torch.Tensor, window_begin: int, begin: int, num_tokens: int, layout: KVLayout
) -> torch.Tensor:
    """The [num_layers, 2, num_tokens, num_kv_heads, head_dim] view of positions
    [begin, begin + num_tokens) in a shared-memory stage (uint8) that holds a window from
    `window_begin`: chunks lie back to back in position order, each laid out as on the wire.
    Sender and receiver both address the stage through this one function."""
    per_token = bytes_per_token(layout)
    start = (begin - window_begin) * per_token
    stop = start + num_tokens * per_token
    if begin < window_begin or num_tokens < 1 or stop > stage.numel():
        raise InvalidRequestError(
            f"KV chunk [{begin}, {begin + num_tokens}) lies outside the shared-memory stage"
        )
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    return stage[start:stop].view(torch_dtype(layout)).view(shape)


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (the runtime keeps its encoder in the
    private google.protobuf.internal module, so it is not imported)."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk_request(begin: int, num_tokens: int, raw: bytes | memoryview) -> bytes:
    """The wire bytes of `PushKVRequest(chunk=KVChunkData(begin, num_tokens, data=raw))`.

    Written by hand because building and serialising that message through the protobuf
    runtime copies the payload slowly (about 23 ms per 8 MiB here), which capped the data
    plane near 0.4 GB/s; this copies the payload once, straight from the tensor's memory.
    The bytes are exactly protobuf's encoding (fields 1-3 of KVChunkData inside field 2 of
    PushKVRequest, default values left out as proto3 does), so any peer parses them with its
    generated code; tests/shim/test_shim_units.py checks the equality.
    """
    if begin < 0 or num_tokens < 0:
        raise ValueError("begin and num_tokens must be >= 0")
    fields: list[bytes | memoryview] = []
    if begin:
        fields += (b"\x08", _varint(begin))  # KVChunkData.begin = 1, varint
    if num_tokens:
        fields += (b"\x10", _varint(num_tokens))  # KVChunkData.num_tokens = 2, varint
    if len(raw):
        fields += (b"\x1a", _varint(len(raw)), raw)  # KVChunkData.data = 3, bytes
    inner_length = sum(len(f) for f in fields)
    return b"".join((b"\x12", _varint(inner_length), *fields))  # PushKVRequest.chunk = 2


_INT32_MAX = 2**31 - 1


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at `pos`; IndexError past the end."""
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def decode_chunk_request(raw: bytes) -> tuple[int, int, memoryview] | None:
    """(begin, num_tokens, data) of a serialised `PushKVRequest` holding a chunk, with `data`
    a view into `raw` (no copy); None for anything else — a header, other or unknown fields,
    negative or oversized numbers, malformed bytes — which the caller hands to the protobuf
    runtime instead, so it decides exactly as generated code would.

    The inverse of `encode_chunk_request`, also hand-written for speed: the runtime's parse
    copies the payload into its arena and `.data` copies it again into a new bytes object
    (two 16 MiB copies per message, most of the receiver's time); this reads the framing
    and returns a view. Fields may come in any order and repeat (last wins), as protobuf
    allows.
    """
    view = memoryview(raw)
    try:
        if len(view) < 2 or view[0] != 0x12:  # PushKVRequest.chunk = 2, length-delimited
            return None
        inner_length, pos = _read_varint(view, 1)
        if pos + inner_length != len(view):
            return None
        begin, num_tokens, data = 0, 0, view[0:0]
        while pos < len(view):
            tag = view[pos]
            pos += 1
            if tag in (0x08, 0x10):  # begin = 1, num_tokens = 2 (varints)
                value, pos = _read_varint(view, pos)
                if value > _INT32_MAX:
                    return None
                if tag == 0x08:
                    begin = value
                else:
                    num_tokens = value
            elif tag == 0x1A:  # data = 3, bytes
                length, pos = _read_varint(view, pos)
                if pos + length > len(view):
                    return None
                data, pos = view[pos : pos + length], pos + length
            else:
                return None
    except (IndexError, ValueError):
        return None
    return begin, num_tokens, data
