"""The three MicroServing calls as request models, with MLC-LLM's field names (its
`microserving_entrypoints` module): each is a CompletionRequest plus its window fields.

`kv_addr_info` is the receiver's opaque PrepRecv answer, carried here as base64 text (MLC
carries its base64 `kv_append_metadata` string the same way).
"""

from __future__ import annotations

from router.openai_protocol import CompletionRequest


class PrepRecvRequest(CompletionRequest):
    """prep_recv on the receiving engine: reserve KV slots for prompt[matched:end]."""

    end: int = -1


class RemoteSendRequest(CompletionRequest):
    """remote_send on the sending engine: compute KV of prompt[begin:end] and write it into
    the receiver's slots described by kv_addr_info."""

    begin: int = 0
    end: int = -1
    kv_addr_info: str = ""
    recv_rank: int = 0


class StartGenerateRequest(CompletionRequest):
    """start_generate on the receiving engine: prefill prompt[begin:] and stream tokens."""

    begin: int = 0
