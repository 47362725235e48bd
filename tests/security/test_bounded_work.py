"""Work is bounded before it is validated: a body over the gateway's limit is answered 413
without being read or parsed, and never reaches the router; a side request running meanwhile
keeps its latency and the router's memory stays flat; a huge prompt that gets past a gateway
(or comes straight over gRPC) is refused by the router from its size, before tokenizing;
connections that never complete their headers, or never finish their body, are closed
(408 for the body). Figures are printed; the bounds asserted are loose on purpose."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all

from microserving.transport import TransportSettings, create_channel
from microserving.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.e2e

MAX_BODY_BYTES = 1024 * 1024
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
SMALL = {"prompt": "a side request", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
MB = 1024 * 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("bounded")
    (shim,) = start_shims(logs, ["both"])
    router = start_router(logs, [shim.address])
    gateway = start_gateway(logs, router.address, "--max-body-bytes", str(MAX_BODY_BYTES),
                            "--header-timeout-s", str(HEADER_TIMEOUT_S),
                            "--body-timeout-s", str(BODY_TIMEOUT_S))
    services = {"shim": shim, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


def _url(gateway: Service) -> str:
    return f"http://{gateway.address}/v1/completions"


def _huge_body(num_bytes: int) -> bytes:
    head, tail = b'{"max_tokens": 4, "prompt": "', b'"}'
    return head + b"a" * (num_bytes - len(head) - len(tail)) + tail


async def _side_latencies_s(url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=120) as client:
        while not stop.is_set():
            started = time.perf_counter()
            reply = await client.post(url, json=SMALL)
            assert reply.status_code == 200, reply.text
            latencies.append(time.perf_counter() - started)
    return latencies


async def _median_side_latency_s(url: str, num: int = 5) -> float:
    async with httpx.AsyncClient(timeout=120) as client:
        latencies = []
        for _ in range(num):
            started = time.perf_counter()
            assert (await client.post(url, json=SMALL)).status_code == 200
            latencies.append(time.perf_counter() - started)
    return sorted(latencies)[num // 2]


def _post_raw(address: str, body: bytes) -> tuple[bytes, float]:
    """POST `body` on a raw socket: headers first, then the body from a thread while the
    answer is read. -> (the answer's first bytes, seconds from the headers to the answer)."""
    sock = _connect(address)
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    started = time.perf_counter()
    sock.sendall(head)

    def send_body() -> None:
        with contextlib.suppress(OSError):  # the server may close once it has answered
            sock.sendall(body)

    sender = threading.Thread(target=send_body, daemon=True)
    sender.start()
    answer = sock.recv(65536)
    answered_s = time.perf_counter() - started
    # The body may come in a later segment than the headers: read on until content-length.
    head_end = answer.find(b"\r\n\r\n")
    length = re.search(rb"content-length: *(\d+)", answer[:head_end], re.IGNORECASE)
    while length is not None and len(answer) < head_end + 4 + int(length.group(1)):
        more = sock.recv(65536)
        if not more:
            break
        answer += more
    sender.join(timeout=60)
    sock.close()
    return answer, answered_s


@pytest.mark.parametrize("size_mb", [5, 20, 50])
async def test_huge_body_is_refused_413_unread_while_a_side_request_keeps_its_latency(
    stack: dict[str, Service], size_mb: int
) -> None:
    url = _url(stack["gateway"])
    baseline_s = await _median_side_latency_s(url)
    router_rss = stack["router"].rss_bytes()
    stop = asyncio.Event()
    side = asyncio.ensure_future(_side_latencies_s(url, stop))
    await asyncio.sleep(0.2)
    answer, refused_s = await asyncio.to_thread(_post_raw, stack["gateway"].address,
                                                _huge_body(size_mb * MB))
    await asyncio.sleep(0.2)
    stop.set()
    side_latencies = await side
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"request_too_large" in answer and str(MAX_BODY_BYTES).encode() in answer
    worst_side_s = max(side_latencies)
    growth_mb = (stack["router"].rss_bytes() - router_rss) / MB
    print(f"\n{size_mb} MB body: 413 after {refused_s * 1e3:.0f} ms; side request median "
          f"{baseline_s * 1e3:.0f} ms alone, worst {worst_side_s * 1e3:.0f} ms meanwhile "
          f"({len(side_latencies)} sent); router RSS growth {growth_mb:.1f} MB")
    assert refused_s < 10  # before the bound: minutes, and the router past 6 GB
    assert growth_mb < 50  # the router never saw the body
    assert worst_side_s < baseline_s + 10


async def test_openai_style_client_sending_a_huge_body_reads_the_413(stack: dict[str, Service]) -> None:
    """httpx (the openai SDK's transport) writes the whole body before it reads: the gateway
    discards the rest of the body after answering, so the client still gets the 413."""
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(_url(stack["gateway"]), content=_huge_body(50 * MB),
                                  headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


async def test_huge_chunked_body_is_refused_413_once_past_the_limit(stack: dict[str, Service]) -> None:
    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(64):  # 64 MiB, no Content-Length
            yield b" " * MB

    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(_url(stack["gateway"]), content=chunks(),
                                  headers={"content-type": "application/json"})
    assert reply.status_code == 413
    assert reply.json()["error"]["code"] == "request_too_large"


async def test_router_refuses_a_prompt_larger_than_any_context_before_tokenizing(
    stack: dict[str, Service]
) -> None:
    """Straight over gRPC (a gateway's limit may be higher than the context): refused from the
    prompt's size, quickly, and the router's memory does not follow the prompt."""
    router = stack["router"]
    rss = router.rss_bytes()
    new = router_pb2.NewRequest(request_id="huge", text="a" * (50 * MB))
    transport = TransportSettings(max_message_bytes=128 * MB)
    async with create_channel(router.address, transport) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        started = time.perf_counter()
        replies = [m async for m in stub.Generate(iter([router_pb2.GenerateRequest(generate=new)]),
                                                  timeout=60)]
        refused_s = time.perf_counter() - started
    errors = [m.error for m in replies if m.WhichOneof("event") == "error"]
    assert len(errors) == 1 and errors[0].code == grpc.StatusCode.OUT_OF_RANGE.value[0], replies
    growth_mb = (router.rss_bytes() - rss) / MB
    print(f"\n50 MB prompt over gRPC: refused after {refused_s * 1e3:.0f} ms; router RSS growth "
          f"{growth_mb:.0f} MB")
    assert growth_mb < 400  # the message itself (50 MB) is held briefly; no tokens are made


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _closes_within_s(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed `sock` (reading to EOF), None if it did not."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_connections_that_never_finish_their_headers_are_closed(stack: dict[str, Service]) -> None:
    address = stack["gateway"].address
    silent = _connect(address)
    trickling = _connect(address)
    trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    for sock in (silent, trickling):
        with sock:
            closed_after_s = _closes_within_s(sock, HEADER_TIMEOUT_S + 20)
            assert closed_after_s is not None, "a connection without headers stayed open"


@pytest.fixture(scope="module")
def workers_gateway(stack: dict[str, Service], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A second gateway on the same router, as uvicorn's supervisor with 2 worker processes."""
    gateway = start_gateway(tmp_path_factory.mktemp("bounded-workers"), stack["router"].address,
                            "--workers", "2", "--header-timeout-s", str(HEADER_TIMEOUT_S),
                            name="gateway-workers")
    yield gateway
    gateway.stop()  # SIGTERM: the supervisor stops its workers


def test_half_open_connections_are_closed_by_every_worker(workers_gateway: Service) -> None:
    """With --workers 2 the kernel spreads connections over both processes: every silent or
    trickling one is closed, whichever worker holds it; the gateway still serves after."""
    socks = [_connect(workers_gateway.address) for _ in range(8)]
    for sock in socks[::2]:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
    for sock in socks:
        with sock:
            closed_after_s = _closes_within_s(sock, HEADER_TIMEOUT_S + 20)
            assert closed_after_s is not None, "a connection without headers stayed open"
    reply = httpx.post(f"http://{workers_gateway.address}/v1/completions", json=SMALL, timeout=60)
    assert reply.status_code == 200, reply.text


def test_a_body_that_never_arrives_is_answered_408(stack: dict[str, Service]) -> None:
    with _connect(stack["gateway"].address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100\r\n\r\n{\"prompt\": ")
        sock.settimeout(BODY_TIMEOUT_S + 20)
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
