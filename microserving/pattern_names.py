"""The orchestration patterns by the names users write (a request's `microserving.pattern`
hint, `--pattern` flags) and their `microserving.v1.Pattern` values: one table for every
service."""

from __future__ import annotations

from typing import Literal, get_args

from microserving.v1 import router_pb2

PatternName = Literal["round-robin", "disagg", "adaptive-disagg"]
PATTERN_NAMES: tuple[PatternName, ...] = get_args(PatternName)
PATTERN_BY_NAME: dict[PatternName, router_pb2.Pattern.ValueType] = {
    "round-robin": router_pb2.PATTERN_ROUND_ROBIN,
    "disagg": router_pb2.PATTERN_DISAGG,
    "adaptive-disagg": router_pb2.PATTERN_ADAPTIVE_DISAGG,
}
