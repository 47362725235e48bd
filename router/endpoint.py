"""One engine as the router sees it: address, roles, pooled channel and stubs, health, the
engine's last reported status and the router's own in-flight counts per stage."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from grpc import aio
from grpc_health.v1 import health_pb2_grpc

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2

ROLE_NAMES: dict[str, int] = {
    "prefill": common_pb2.ENGINE_ROLE_PREFILL,
    "decode": common_pb2.ENGINE_ROLE_DECODE,
    "both": common_pb2.ENGINE_ROLE_BOTH,
}
PREFILL: int = common_pb2.ENGINE_ROLE_PREFILL
DECODE: int = common_pb2.ENGINE_ROLE_DECODE

# Stages the router counts per engine.
STAGE_PREP_RECV = "prep_recv"
STAGE_RESERVED = "reserved"  # a PrepRecv reservation waiting for its StartGenerate
STAGE_REMOTE_SEND = "remote_send"
STAGE_DECODE = "decode"
PREFILL_STAGES = (STAGE_PREP_RECV, STAGE_RESERVED, STAGE_REMOTE_SEND)


def expand_roles(roles: set[int] | frozenset[int]) -> frozenset[int]:
    """BOTH / UNSPECIFIED mean prefill and decode."""
    out: set[int] = set()
    for role in roles or {common_pb2.ENGINE_ROLE_BOTH}:
        if role in (common_pb2.ENGINE_ROLE_BOTH, common_pb2.ENGINE_ROLE_UNSPECIFIED):
            out |= {PREFILL, DECODE}
        else:
            out.add(role)
    return frozenset(out)


@dataclass
class Endpoint:
    address: str
    configured_roles: frozenset[int] | None  # None: use the roles the engine reports
    num_gpus: int = 1
    source: str = "static"
    channel: aio.Channel | None = None
    health: int = router_pb2.ENGINE_HEALTH_UNSPECIFIED
    status: engine_pb2.GetStatusResponse | None = None
    previous_status: engine_pb2.GetStatusResponse | None = None  # the poll before `status`
    external_load: float = 0.0
    is_removed: bool = False
    inflight: dict[str, int] = field(default_factory=dict)

    def connect(self, transport: TransportSettings) -> None:
        self.channel = create_channel(self.address, transport)
        self.stub = engine_pb2_grpc.EngineStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    @property
    def roles(self) -> frozenset[int]:
        if self.configured_roles is not None:
            return expand_roles(self.configured_roles)
        reported = {int(r) for r in self.status.roles} if self.status is not None else set()
        return expand_roles(reported)

    @property
    def is_available(self) -> bool:
        return self.health == router_pb2.ENGINE_HEALTH_SERVING and not self.is_removed

    @property
    def num_inflight(self) -> int:
        return sum(self.inflight.values())

    @property
    def num_inflight_prefill(self) -> int:
        return sum(self.inflight.get(stage, 0) for stage in PREFILL_STAGES)

    @property
    def load(self) -> float:
        """The router's own in-flight requests plus work the engine reports from elsewhere."""
        return self.num_inflight + self.external_load

    @property
    def page_size(self) -> int | None:
        if self.status is None or not self.status.kv_layout.page_size:
            return None
        return self.status.kv_layout.page_size

    def update_status(self, status: engine_pb2.GetStatusResponse) -> None:
        self.previous_status, self.status = self.status, status
        reported = (
            status.num_running_requests + status.num_waiting_requests + status.num_reserved_requests
        )
        self.external_load = max(0.0, float(reported - self.num_inflight))

    @contextlib.contextmanager
    def track(self, stage: str) -> Iterator[None]:
        self.inflight[stage] = self.inflight.get(stage, 0) + 1
        try:
            yield
        finally:
            self.release(stage)

    def acquire(self, stage: str) -> None:
        self.inflight[stage] = self.inflight.get(stage, 0) + 1

    def release(self, stage: str) -> None:
        self.inflight[stage] = max(0, self.inflight.get(stage, 0) - 1)

    def to_info(self) -> router_pb2.EngineInfo:
        status = self.status
        return router_pb2.EngineInfo(
            address=self.address,
            roles=sorted(self.roles),  # type: ignore[arg-type]
            health=self.health,  # type: ignore[arg-type]
            model_id=status.model_id if status else "",
            num_inflight_prefill=self.num_inflight_prefill,
            num_inflight_decode=self.inflight.get(STAGE_DECODE, 0),
            num_running_requests=status.num_running_requests if status else 0,
            num_waiting_requests=status.num_waiting_requests if status else 0,
            num_free_kv_pages=status.num_free_kv_pages if status else 0,
            num_total_kv_pages=status.num_total_kv_pages if status else 0,
        )

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
