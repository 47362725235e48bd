"""Per-attempt bookkeeping of one request inside the router: the pattern hints, the engines
the attempt touched (for the Abort fan-out), engines to avoid, and KV reservations held."""

from __future__ import annotations

from dataclasses import dataclass, field

from microserving.v1 import router_pb2


@dataclass
class RequestContext:
    engine_request_id: str
    hints: router_pb2.PatternHints = field(default_factory=router_pb2.PatternHints)
    excluded: set[str] = field(default_factory=set)
    touched: dict[str, None] = field(default_factory=dict)  # ordered set of addresses
    reservations: set[str] = field(default_factory=set)  # engines holding our PrepRecv
    used: list[str] = field(default_factory=list)  # engines in the order the pattern used them
    # Decode on the engine's multiplexed Generate stream (the runner's fast path) instead of
    # a StartGenerate call.
    use_engine_stream: bool = False
    cache_salt: str = ""  # the request's prefix-cache scope (SamplingParams.cache_salt)
    traceparent: str = ""  # W3C trace context the attempt's engine calls carry

    def touch(self, address: str) -> None:
        self.touched[address] = None
        if address not in self.used:
            self.used.append(address)
