"""The processes of `microserving bench mlc-relay`, started from their entry points by
bench/procs.py: `mlc-compat --synthetic` engines (BENCHMARK-ONLY core), a `shim --backend mlc`
in front of each, and the router over the shims. The direct client sees only the engines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import cast

from bench.capacity.stack import Stack, StackProcess, engine_tid
from bench.control_plane_run import wait_grpc_serving, wait_http_ready
from bench.mlc_relay_load import DisaggEngines
from bench.procs import ServiceGroup
from microserving.pattern_names import PatternName
from microserving.stack.process import ServiceProcess

# Engines in --engine order, so the decode engine's device id start (recv_rank) is 1 in disagg.
# The patterns MLC's own router has too, each with its engines' roles.
ROLES: dict[PatternName, tuple[str, ...]] = {"round-robin": ("both",), "disagg": ("prefill", "decode")}
_STARTUP_TIMEOUT_S = 120.0


@dataclass
class RelayStack:
    pattern: str
    engines: dict[str, StackProcess]  # role -> mlc-compat process
    shims: list[StackProcess]
    router: StackProcess
    engine_urls: dict[str, str]  # role -> http://host:port

    @property
    def router_address(self) -> str:
        return self.router.service.address

    @property
    def engine_addresses(self) -> list[str]:
        """The shims as a router's `engines` setting: HOST:PORT=ROLE."""
        return [f"{shim.service.address}={role}"
                for shim, role in zip(self.shims, ROLES[cast(PatternName, self.pattern)], strict=True)]

    @property
    def engine_url(self) -> str:
        """The engine that streams tokens (the one engine, or the decode engine)."""
        return self.engine_urls.get("decode", self.engine_urls.get("both", ""))

    @property
    def direct_base_url(self) -> str:
        return f"{self.engine_url}/v1"

    @property
    def disagg(self) -> DisaggEngines | None:
        if self.pattern != "disagg":
            return None
        return DisaggEngines(self.engine_urls["prefill"], self.engine_urls["decode"], decode_rank=1)

    def direct_view(self) -> Stack:
        """The processes the direct client's tokens pass: the engines."""
        return Stack(self.pattern, self.direct_base_url, list(self.engines.values()))

    def relay_view(self) -> Stack:
        return Stack(self.pattern, self.direct_base_url,
                     [*self.engines.values(), *self.shims, self.router])


def _engine_args(step_ms: str, prefill_tok_s: float, max_num_seqs: int,
                 peer: str | None) -> list[str]:
    args = ["mlc-compat", "--synthetic", "--synthetic-step-ms", step_ms,
            "--synthetic-prefill-tok-s", str(prefill_tok_s), "--max-num-seqs", str(max_num_seqs),
            "--model", "tiny", "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING"]
    return args + ([] if peer is None else ["--peer", peer])


async def _start_engine(group: ServiceGroup, name: str, args: list[str]) -> tuple[ServiceProcess, str]:
    service = await asyncio.to_thread(group.start, name, args)
    url = f"http://{service.address}"
    await wait_http_ready(f"{url}/v1/models", _STARTUP_TIMEOUT_S)
    return service, url


async def start_relay_stack(group: ServiceGroup, pattern: PatternName, step_ms: str, prefill_tok_s: float,
                            max_num_seqs: int, shim_args: tuple[str, ...]) -> RelayStack:
    engines: dict[str, StackProcess] = {}
    urls: dict[str, str] = {}
    # The decode engine first: the prefill engine needs its URL as the peer of rank 1.
    for role in sorted(ROLES[pattern], key=lambda r: r != "decode"):
        peer = f"1={urls['decode']}" if role == "prefill" else None
        service, urls[role] = await _start_engine(
            group, f"{pattern}-engine-{role}", _engine_args(step_ms, prefill_tok_s, max_num_seqs, peer))
        engines[f"engine-{role}"] = StackProcess(f"engine-{role}", service, engine_tid(service))
    shims = []
    for role in ROLES[pattern]:
        service = await asyncio.to_thread(group.start, f"{pattern}-shim-{role}", [
            "shim", "--backend", "mlc", "--mlc-url", urls[role], "--model", "tiny", "--role", role,
            "--host", "127.0.0.1", "--port", "0", "--log-level", "WARNING", *shim_args])
        await wait_grpc_serving(service.address, _STARTUP_TIMEOUT_S)
        shims.append(StackProcess(f"shim-{role}", service))
    router = await asyncio.to_thread(group.start, f"{pattern}-router", [
        "router", *(f"--engine={s.service.address}={r}" for s, r in zip(shims, ROLES[pattern], strict=True)),
        "--pattern", pattern, "--model", "tiny", "--host", "127.0.0.1", "--port", "0",
        "--log-level", "WARNING"])
    await wait_grpc_serving(router.address, _STARTUP_TIMEOUT_S)
    ordered = {f"engine-{r}": engines[f"engine-{r}"] for r in ROLES[pattern]}
    return RelayStack(pattern, ordered, shims, StackProcess("router", router), urls)
