"""Peers, not arbitrary addresses: a shim pushes KV only to engines it was configured with or
that a router registered (told in its status polls), and the router migrates only between
registered engines. A RemoteSend or MigrateContext naming a foreign address is refused, and a
listener at that address receives nothing (not a connection, so neither KV nor the shared
token). The peer lists and channel maps are bounded."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from stack_procs import Service, greedy, start_router, start_shims, stop_all

from engine_shim.backends.embedded.kv_plane.peers import PeerAllowList
from engine_shim.backends.embedded.kv_plane.sender import PeerChannels
from engine_shim.engine.api import PermissionDeniedError
from microserving.transport import TransportSettings, create_channel
from microserving.v1 import engine_pb2, engine_pb2_grpc, router_pb2, router_pb2_grpc

TOKEN = "peers-test-token-0123456789"
AUTH = TransportSettings(token=TOKEN)


class Listener:
    """A TCP listener at a foreign address that records every connection it is offered."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("peers")
    prefill, decode = start_shims(logs, ["prefill", "decode"], env={"MICROSERVING_SHIM_TOKEN": TOKEN})
    router = start_router(logs, [f"{prefill.address}=prefill", f"{decode.address}=decode"],
                          "--pattern", "disagg", env={"MICROSERVING_ROUTER_TOKEN": TOKEN})
    services = {"prefill": prefill, "decode": decode, "router": router}
    yield services
    stop_all(services.values())


@pytest.fixture
def listener() -> Iterator[Listener]:
    foreign = Listener()
    yield foreign
    foreign.close()


async def _prep_recv(address: str, request_id: str, prompt: list[int]) -> bytes:
    async with create_channel(address, AUTH) as channel:
        reply = await engine_pb2_grpc.EngineStub(channel).PrepRecv(
            engine_pb2.PrepRecvRequest(request_id=request_id, token_ids=prompt, end=-1, sampling=greedy(4)),
            timeout=30)
        return reply.kv_addr_info


@pytest.mark.e2e
async def test_remote_send_to_a_foreign_address_is_refused_and_the_listener_gets_nothing(
    stack: dict[str, Service], listener: Listener
) -> None:
    prompt = list(range(10, 60))
    addr = json.loads(await _prep_recv(stack["decode"].address, "foreign-push", prompt))
    addr["address"] = listener.address  # a caller rewrites where the KV (and token) would go
    request = engine_pb2.RemoteSendRequest(request_id="foreign-push", token_ids=prompt, begin=0, end=-1,
                                           kv_addr_info=json.dumps(addr).encode(), sampling=greedy(4))
    async with create_channel(stack["prefill"].address, AUTH) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RemoteSend(request, timeout=30)
        await stub.Abort(engine_pb2.AbortRequest(request_id="foreign-push"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not a known peer" in (caught.value.details() or "")
    assert listener.received == []


@pytest.mark.e2e
async def test_migrate_context_from_a_foreign_source_is_refused_and_the_listener_gets_nothing(
    stack: dict[str, Service], listener: Listener
) -> None:
    request = router_pb2.MigrateContextRequest(token_ids=router_pb2.TokenIds(ids=list(range(10, 60))),
                                               source=listener.address, target=stack["decode"].address)
    async with create_channel(stack["router"].address, AUTH) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await router_pb2_grpc.RouterStub(channel).MigrateContext(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not an engine registered" in (caught.value.details() or "")
    assert listener.received == []


@pytest.mark.e2e
async def test_pd_between_registered_engines_still_moves_kv(stack: dict[str, Service]) -> None:
    """The router tells each shim its peers, so the ordinary PD path is allowed."""
    new = router_pb2.NewRequest(request_id="pd-ok", token_ids=router_pb2.TokenIds(ids=list(range(20, 90))),
                                sampling=greedy(4))
    async with create_channel(stack["router"].address, AUTH) as channel:
        replies = [m async for m in router_pb2_grpc.RouterStub(channel).Generate(
            iter([router_pb2.GenerateRequest(generate=new)]), timeout=60)]
    done = [m.done for m in replies if m.WhichOneof("event") == "done"]
    assert done and set(done[0].engines) == {stack["prefill"].address, stack["decode"].address}, replies


def test_peer_allow_list_is_bounded_and_forgets_engines_no_longer_reported() -> None:
    now = [0.0]
    peers = PeerAllowList(["static:1"], told_ttl_s=10.0, max_told=3, clock=lambda: now[0])
    peers.tell(["a:1", "b:1"])
    peers.check("a:1")
    peers.check("static:1")
    with pytest.raises(PermissionDeniedError):
        peers.check("evil:1")
    peers.tell(["c:1", "d:1"])  # four told, three kept: the stalest goes
    assert peers.num_told == 3
    with pytest.raises(PermissionDeniedError):
        peers.check("a:1")
    now[0] = 11.0  # nobody re-told them
    with pytest.raises(PermissionDeniedError):
        peers.check("c:1")
    assert peers.num_told == 0
    peers.check("static:1")  # configured peers do not expire


async def test_peer_channels_are_bounded() -> None:
    channels = PeerChannels(TransportSettings(), max_channels=2)
    for port in range(3):
        channels.stub(f"127.0.0.1:{40000 + port}")
    channels.stub("127.0.0.1:40001")
    assert channels.num_channels == 2
    await channels.close()
    assert channels.num_channels == 0
