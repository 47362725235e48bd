"""Every service of a real stack answers a Prometheus scrape: two shims (prefill, decode) and
a disagg router with --metrics-port, and the gateway on its HTTP port, as processes on
loopback, driven with the official `openai` client. Each scrape parses with
prometheus-client's parser (and passes `promtool check metrics` where promtool is installed),
and the values agree with the requests that were sent."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import (  # noqa: E402
    Service,
    start_gateway,
    start_router,
    start_shims,
    stop_all,
)

pytestmark = pytest.mark.e2e
NUM_REQUESTS = 2
MAX_TOKENS = 8
PROMPT = "Metrics are read when Prometheus scrapes, never per token."
_METRICS_URL = re.compile(r"metrics on (http://\S+/metrics)")


def metrics_url(service: Service) -> str:
    match = _METRICS_URL.search(service.log())
    assert match, f"{service.name} printed no metrics address:\n{service.log()[-2000:]}"
    return match.group(1)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample (name, sorted labels) -> value, after checking the exposition format."""
    text = httpx.get(url, timeout=10).text
    promtool = shutil.which("promtool")
    if promtool is not None:  # Debian's prometheus package
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                               text=True, timeout=30)
        assert check.returncode == 0, f"promtool on {url}:\n{check.stdout}{check.stderr}"
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {key}; have {sorted(k for k in samples if k[0] == name)}"
    return float(samples[key])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    log_dir = tmp_path_factory.mktemp("metrics-stack")
    services: list[Service] = []
    try:
        # A reservation TTL far beyond the test's waits: a receive ticket left open after
        # its request is seen as open, not reclaimed by its TTL meanwhile.
        prefill, decode = start_shims(log_dir, ["prefill", "decode"], "--metrics-port", "0",
                                      "--reservation-ttl-s", "900")
        services += [prefill, decode]
        router = start_router(log_dir, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                              "--pattern", "disagg", "--metrics-port", "0")
        services.append(router)
        gateway = start_gateway(log_dir, router.address)
        services.append(gateway)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", timeout=120)
        for _ in range(NUM_REQUESTS):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        yield {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway}
    finally:
        stop_all(services)


def test_router_metrics_count_each_request_per_engine_and_pd_stage(stack: dict[str, Service]) -> None:
    samples = scrape(metrics_url(stack["router"]))
    prefill, decode = stack["prefill"].address, stack["decode"].address
    prefix = "microserving_router_"
    assert value(samples, prefix + "requests_total", pattern="disagg", outcome="done") == NUM_REQUESTS
    assert value(samples, prefix + "e2e_request_latency_seconds_count", pattern="disagg") == NUM_REQUESTS
    assert value(samples, prefix + "time_to_first_token_seconds_count", pattern="disagg",
                 engine=decode) == NUM_REQUESTS
    assert value(samples, prefix + "inter_token_latency_seconds_count", pattern="disagg",
                 engine=decode) == NUM_REQUESTS
    assert value(samples, prefix + "engine_call_seconds_count", engine=decode, call="prep_recv") >= 1
    assert value(samples, prefix + "engine_call_seconds_count", engine=prefill, call="remote_send") >= 1
    # the default: P sampled the first token of the requests it computed
    assert value(samples, prefix + "first_tokens_from_prefill_total", engine=prefill) >= 1
    moved_tokens = value(samples, prefix + "kv_transfer_tokens_total", engine=prefill)
    moved_bytes = value(samples, prefix + "kv_transfer_bytes_total", engine=prefill)
    assert moved_tokens > 0 and moved_bytes > 0
    assert moved_bytes % moved_tokens == 0  # whole tokens of KV, at the engine's bytes per token
    for engine in (prefill, decode):
        assert value(samples, prefix + "engine_health_state", engine=engine, state="serving") == 1
        assert value(samples, prefix + "engine_health_state", engine=engine, state="unreachable") == 0
        assert value(samples, prefix + "engine_inflight_requests", engine=engine, stage="decode") == 0
    assert value(samples, prefix + "inflight_requests") == 0


def test_shim_metrics_come_from_the_engine_status(stack: dict[str, Service]) -> None:
    decode = scrape(metrics_url(stack["decode"]))
    prefill = scrape(metrics_url(stack["prefill"]))
    for samples in (decode, prefill):
        assert value(samples, "microserving_shim_engine_up") == 1
        assert value(samples, "microserving_shim_running_requests") == 0
        total = value(samples, "microserving_shim_kv_total_pages")
        assert total > 0
        assert value(samples, "microserving_shim_kv_free_pages") + \
            value(samples, "microserving_shim_kv_used_pages") == total
        assert value(samples, "microserving_shim_kv_reserved_pages") == 0  # every reservation claimed
        assert value(samples, "microserving_shim_engine_step_seconds_count") > 0
        assert value(samples, "microserving_shim_engine_step_seconds_sum") > 0
    # D samples every token but the first, which P samples (first_token_on_prefill)
    assert value(decode, "microserving_shim_generated_tokens_total") + \
        value(prefill, "microserving_shim_generated_tokens_total") >= NUM_REQUESTS * MAX_TOKENS
    # The second request's prompt is the first's: the decode engine's prefix cache hit it.
    assert value(decode, "microserving_shim_prefix_cache_hit_tokens_total") > 0
    assert 0 < value(decode, "microserving_shim_prefix_cache_hit_ratio") <= 1
    assert value(decode, "microserving_shim_engine_info", backend="embedded", model="tiny",
                 device="cpu", role="decode") == 1


def test_gateway_metrics_count_finish_reasons(stack: dict[str, Service]) -> None:
    samples = scrape(f"http://{stack['gateway'].address}/metrics")
    assert value(samples, "microserving_gateway_finish_reasons_total", reason="length") == NUM_REQUESTS
    assert value(samples, "microserving_gateway_completion_tokens_total") == NUM_REQUESTS * MAX_TOKENS



def test_grafana_dashboard_queries_only_metrics_the_stack_exports(stack: dict[str, Service]) -> None:
    """deploy/grafana/microserving.json: every metric its queries name is in a live scrape."""
    exported: set[str] = set()
    for url in (metrics_url(stack["router"]), metrics_url(stack["decode"]),
                f"http://{stack['gateway'].address}/metrics"):
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            # A labelled counter nothing incremented yet has no samples, only its family.
            exported |= {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
            exported |= {sample.name for sample in family.samples}
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "microserving.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"microserving_[a-z_]+", target["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)


def test_receive_tickets_close_when_their_requests_end(stack: dict[str, Service]) -> None:
    """D's receive tickets (one per PrepRecv) all close once the requests have ended, short
    ones included: a two-token request can end before the push into its reservation has
    finished its own bookkeeping, and a ticket left open would stay until its TTL (here 900 s),
    scanned by every later PrepRecv. 64 at once make that order likely enough that the test
    failed in 4 of 4 runs without ReceiveTable.retire (2-19 tickets left open); with it, it
    takes under a second. Last in the module: it sends requests of its own."""
    async def send_all() -> None:  # at once: the engine steps them together
        async with openai.AsyncOpenAI(base_url=f"http://{stack['gateway'].address}/v1", api_key="unused",
                                      timeout=120) as client:
            await asyncio.gather(*(
                client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=2,
                                          temperature=0, extra_body={"ignore_eos": True})
                for i in range(64)))

    def sends() -> dict[str, float]:
        samples = scrape(metrics_url(stack["prefill"]))
        return {dict(labels)["path"]: count for (name, labels), count in samples.items()
                if name == "microserving_shim_kv_sends_total"}

    sent_before = sends()
    asyncio.run(send_all())
    sent = {path: count - sent_before.get(path, 0.0) for path, count in sends().items()}
    # P counts its sends by the path their KV took (this stack's: NIXL where it loads, else the
    # stage on D's stream); a request whose window D's prefix cache already holds sends none.
    assert set(sent) <= {"nixl", "shm-stream", "shm", "grpc"}, sent
    assert 0 < sum(sent.values()) <= 64, sent
    url = metrics_url(stack["decode"])
    deadline = time.monotonic() + 30  # the pushes' last steps trail the answers; generous under load
    while (open_tickets := value(scrape(url), "microserving_shim_kv_receive_tickets")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_tickets == 0
    # the prefill shim receives nothing, yet reports its (empty) table
    assert value(scrape(metrics_url(stack["prefill"])), "microserving_shim_kv_receive_tickets") == 0
