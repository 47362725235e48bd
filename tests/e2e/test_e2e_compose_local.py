"""docker-compose.yml without Docker: every service's command and environment run as local
processes on loopback (service hostnames -> 127.0.0.1, one port each), started in
depends_on order once each dependency's own healthcheck passes; then a request goes through."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from microserving.stack.process import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gateway"))  # deploy_render lives there
from deploy_render import interpolate  # noqa: E402


def container_port(service: dict[str, Any]) -> str:
    return next(v for k, v in service["environment"].items()
                if k.endswith("_PORT") and not k.endswith("_METRICS_PORT"))


def localize(value: str, ports: dict[str, int], services: dict[str, Any]) -> str:
    for name, service in services.items():
        value = re.sub(rf"\b{re.escape(name)}:{container_port(service)}\b",
                       f"127.0.0.1:{ports[name]}", value)
    return value


def start_order(services: dict[str, Any]) -> list[str]:
    order: list[str] = []
    while len(order) < len(services):
        ready = [n for n, s in services.items() if n not in order
                 and all(d in order for d in s.get("depends_on", {}))]
        assert ready, "depends_on has a cycle"
        order += ready
    return order


def service_env(name: str, services: dict[str, Any], ports: dict[str, int],
                metrics_ports: dict[str, int]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROSERVING_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    for key, value in services[name]["environment"].items():
        if key.endswith("_HOST"):
            value = "127.0.0.1"
        elif key.endswith("_METRICS_PORT"):
            value = str(metrics_ports[name])
        elif key.endswith("_PORT"):
            value = str(ports[name])
        env[key] = localize(str(value), ports, services)
    return env


def healthcheck(name: str, services: dict[str, Any], ports: dict[str, int]) -> list[str]:
    test = services[name]["healthcheck"]["test"]
    assert test[0] == "CMD"
    own = f"127.0.0.1:{container_port(services[name])}"
    argv = [part.replace(own, f"127.0.0.1:{ports[name]}") for part in test[1:]]
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def wait_healthy(name: str, process: subprocess.Popen[bytes], probe: list[str], env: dict[str, str],
                 timeout_s: float = 240.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        assert process.poll() is None, f"{name} exited with {process.returncode}"
        if subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail(f"{name} not healthy after {timeout_s} s")


@dataclass
class ComposeStack:
    base_url: str
    processes: dict[str, subprocess.Popen[bytes]]
    metrics_urls: dict[str, str]


@pytest.fixture(scope="module")
def compose_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    services: dict[str, Any] = interpolate(
        yaml.safe_load((ROOT / "docker-compose.yml").read_text()), {})["services"]
    # All at once, so all different (one by one, a port released may come back as the next).
    chosen = iter(free_ports(2 * len(services)))
    ports = {name: next(chosen) for name in services}
    metrics_ports = {name: next(chosen) for name in services}
    logs = tmp_path_factory.mktemp("compose")
    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in start_order(services):
            env = service_env(name, services, ports, metrics_ports)
            argv = [sys.executable, "-m", "microserving.cli", *services[name]["command"]]
            started[name] = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True,
                                             stdout=(logs / f"{name}.log").open("wb"),
                                             stderr=subprocess.STDOUT)
            wait_healthy(name, started[name], healthcheck(name, services, ports), env)
        metrics_urls = {name: f"http://127.0.0.1:{metrics_ports[name]}/metrics" for name, s in services.items()
                        if any(k.endswith("_METRICS_PORT") for k in s["environment"])}
        metrics_urls["gateway"] = f"http://127.0.0.1:{ports['gateway']}/metrics"
        yield ComposeStack(f"http://127.0.0.1:{ports['gateway']}/v1", started, metrics_urls)
    finally:
        processes = list(started.values())
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def test_compose_services_serve_a_completion_through_the_gateway(
        compose_stack: ComposeStack) -> None:
    client = openai.OpenAI(base_url=compose_stack.base_url, api_key="unused", max_retries=0,
                           timeout=120)
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    chat = client.chat.completions.create(model="tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage is not None and chat.usage.completion_tokens > 0


def test_every_compose_service_serves_prometheus_metrics(compose_stack: ComposeStack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    assert set(compose_stack.metrics_urls) == {"prefill", "decode", "router", "gateway"}
    for name, url in compose_stack.metrics_urls.items():
        text = httpx.get(url, timeout=30).text
        service = "shim" if name in ("prefill", "decode") else name
        names = {family.name for family in text_string_to_metric_families(text)}
        assert any(n.startswith(f"microserving_{service}_") for n in names), (name, sorted(names)[:10])


def test_losing_the_only_decode_engine_makes_health_and_requests_503(
        compose_stack: ComposeStack) -> None:
    decode = compose_stack.processes["decode"]
    os.killpg(decode.pid, signal.SIGKILL)
    decode.wait(timeout=30)
    health_url = compose_stack.base_url.removesuffix("/v1") + "/health"
    deadline_s = time.monotonic() + 30
    with httpx.Client(timeout=30) as http:
        while http.get(health_url).status_code != 503:
            assert time.monotonic() < deadline_s, "gateway /health stayed 200"
            time.sleep(0.2)
        reply = http.post(f"{compose_stack.base_url}/completions",
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert reply.status_code == 503, reply.text
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
