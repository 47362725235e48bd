"""The programmable MicroServing router (gRPC). `from router import Router, serve` gives
MLC-LLM's router API; `router.openai_protocol` and `router.microserving_protocol` hold its
request/response models."""

from router.mlc_launcher import serve
from router.router import Router

__all__ = ["Router", "serve"]
