"""`microserving serve`: the gateway with the router in its own process, in front of two real
embedded shims (prefill + decode, disagg), beside the same engines behind a router process
and a gateway process. Both stacks must answer every request the same, token for token; a
client that hangs up leaves nothing behind; health, models and metrics answer as the split
stack's do; bad router settings stop it before it serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from stack_procs import (  # noqa: E402
    REPO,
    Service,
    clean_env,
    engine_status,
    hang_up_mid_stream,
    launch,
    pages_at_baseline,
    start_gateway,
    start_router,
    start_shims,
    stop_all,
    wait_listening,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
FREED_WITHIN_S = 10.0  # an abort waits its turn like everything else on a loaded machine


def _router_config(path: Path, engines: list[str], **extra: Any) -> Path:
    path.write_text(json.dumps({"engines": engines, "pattern": "disagg", "model": "tiny", **extra}))
    return path


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("serve")
    prefill, decode = start_shims(logs, ["prefill", "decode"])
    engines = [f"{prefill.address}=prefill", f"{decode.address}=decode"]
    router = start_router(logs, engines, "--pattern", "disagg")
    gateway = start_gateway(logs, router.address)
    config = _router_config(logs / "router.json", engines, metrics_port=0)
    serve = launch("serve", ["serve", "--router-config", str(config), "--port", "0"], logs)
    services = {"prefill": prefill, "decode": decode, "router": router, "gateway": gateway,
                "serve": serve}
    try:
        wait_listening([serve])
        yield services
    finally:
        stop_all(services.values())


def _client(service: Service, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{service.address}/v1", api_key="unused",
                         max_retries=max_retries, timeout=120)


def _wait_serving(service: Service, within_s: float = 60.0) -> None:
    # The router's first health checks of its engines come just after it starts (generous:
    # a loaded machine runs them late, and only a stack that never gets healthy is a fault).
    deadline = time.monotonic() + within_s
    with httpx.Client(base_url=f"http://{service.address}", timeout=10) as http:
        while time.monotonic() < deadline:
            if http.get("/health").status_code == 200:
                return
            time.sleep(0.05)
    raise AssertionError(f"{service.name} not healthy within {within_s} s")


def test_serve_answers_as_the_split_stack_token_for_token(stacks: dict[str, Service]) -> None:
    _wait_serving(stacks["serve"])
    answers: dict[str, list[Any]] = {}
    for name in ("gateway", "serve"):
        client = _client(stacks[name])
        greedy = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 24,
                  "temperature": 0}
        whole = client.completions.create(**greedy)  # type: ignore[call-overload]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            stream=True, **greedy) if c.choices)  # type: ignore[call-overload]
        sampled = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                            n=2, temperature=0.8, seed=7)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=10,
            temperature=0, logprobs=True, top_logprobs=2)
        answers[name] = [
            # The second stack finds the prompt in the engines' prefix cache: the cached
            # token counts differ, the tokens may not.
            whole.choices[0].text, (whole.usage.prompt_tokens, whole.usage.completion_tokens)
            if whole.usage else None, streamed,
            sorted((c.index, c.text, c.finish_reason) for c in sampled.choices),
            chat.choices[0].message.content,
            [(t.token, round(t.logprob, 4)) for t in chat.choices[0].logprobs.content or []]
            if chat.choices[0].logprobs else None,
        ]
    assert answers["serve"] == answers["gateway"]
    assert answers["serve"][0] == answers["serve"][2] and answers["serve"][1][1] > 0


def test_health_models_and_the_routers_metrics(stacks: dict[str, Service]) -> None:
    _wait_serving(stacks["serve"])
    with httpx.Client(base_url=f"http://{stacks['serve'].address}", timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["router"] == "in-process"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        reply = http.post("/v1/completions", json={"prompt": "count me", "max_tokens": 3})
        assert reply.status_code == 200
        # The gateway's and the router's metrics on one /metrics: the request counted by both
        # (the router counts it as its task ends, just after the response's last byte).
        gateway_count = re.compile(
            r'^microserving_gateway_requests_total\{endpoint="/v1/completions",status="200"\} [1-9]', re.M)
        router_count = re.compile(
            r'^microserving_router_requests_total\{outcome="done",pattern="disagg"\} [1-9]', re.M)
        deadline = time.monotonic() + 10
        while True:
            metrics = http.get("/metrics").text
            if (gateway_count.search(metrics) and router_count.search(metrics)) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert gateway_count.search(metrics) and router_count.search(metrics), metrics[-3000:]
    # The router's own endpoint too (metrics_port 0 in its settings: a port of its own).
    port = re.search(r"microserving router metrics on http://[\d.]+:(\d+)/metrics",
                     stacks["serve"].log())
    assert port is not None
    own = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=10).text
    assert "microserving_router_engine_inflight_requests" in own


async def test_a_client_that_hangs_up_leaves_nothing_behind(stacks: dict[str, Service]) -> None:
    _wait_serving(stacks["serve"])
    shims = [stacks["prefill"].address, stacks["decode"].address]
    baseline = [(await engine_status(a)).num_free_kv_pages for a in shims]
    await hang_up_mid_stream(stacks["serve"].address, "stream a while")
    seen = await pages_at_baseline(shims, baseline, within_s=FREED_WITHIN_S)
    assert seen == baseline
    assert (await engine_status(stacks["decode"].address)).num_reserved_requests == 0
    # The router's request ends once its engines answered the aborts, just after the pages.
    idle = re.compile(r"^microserving_router_inflight_requests 0\.0$", re.M)
    async with httpx.AsyncClient(base_url=f"http://{stacks['serve'].address}", timeout=30) as http:

        async def router_idle() -> bool:
            return bool(idle.search((await http.get("/metrics")).text))

        assert await wait_until(router_idle, FREED_WITHIN_S) is not None


def test_two_workers_each_with_a_router(stacks: dict[str, Service], tmp_path: Path) -> None:
    engines = [f"{stacks['prefill'].address}=prefill", f"{stacks['decode'].address}=decode"]
    config = _router_config(tmp_path / "router.json", engines)
    serve = launch("serve-workers", ["serve", "--router-config", str(config), "--port", "0",
                                     "--workers", "2"], tmp_path)
    try:
        wait_listening([serve])
        _wait_serving(serve)
        # Each worker checks the engines before it serves; one whose check ran late on a
        # loaded machine answers 503 until its next, which the client retries.
        texts = {_client(serve, max_retries=3).completions.create(
            model="tiny", prompt=f"worker check {i}", max_tokens=8, temperature=0).choices[0].text
                 for i in range(4)}
        alone = {_client(stacks["gateway"]).completions.create(
            model="tiny", prompt=f"worker check {i}", max_tokens=8, temperature=0).choices[0].text
                 for i in range(4)}
        assert texts == alone
    finally:
        stop_all([serve])


@pytest.mark.parametrize(("content", "expected"), [
    ('{"engines": ["127.0.0.1:1"], "pattern": "no-such-pattern"}', "router settings from"),
    ('{"engines": ["127.0.0.1:1"], "router_class": "no_such_module:Router"}', "router settings from"),
    (None, "router settings from"),  # no such file
])
def test_bad_router_settings_stop_it_before_it_serves(tmp_path: Path, content: str | None,
                                                      expected: str) -> None:
    config = tmp_path / "router.json"
    if content is not None:
        config.write_text(content)
    done = subprocess.run([sys.executable, "-m", "microserving.cli", "serve", "--router-config",
                           str(config), "--port", "0"], capture_output=True, text=True,
                          timeout=120, env=clean_env(), cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "listening" not in done.stdout


def test_serve_refuses_a_router_address(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "microserving.cli", "serve", "--router-config",
                           str(tmp_path / "x.json"), "--router", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120, env=clean_env(), cwd=REPO)
    assert done.returncode == 2 and "--router names a router process" in done.stderr


def test_up_with_the_router_in_the_gateway(tmp_path: Path) -> None:
    """`microserving up --router-in-gateway`: shims and one gateway process (serve), no router
    process; it answers like any OpenAI server and stops cleanly."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_up import start_up

    stack = start_up("--router-in-gateway", "--api-key", "k")
    try:
        assert sorted(stack.pids) == ["decode-1", "gateway", "prefill-0"]
        assert "serve --router-config" in stack.log()
        client = openai.OpenAI(base_url=stack.base_url, api_key="k", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=5,
                                          temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0).models.list()
    finally:
        assert stack.stop() == 0
