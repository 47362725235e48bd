"""The NIXL KV path across "hosts": P and D run in two network namespaces of their own, each
with one veth link to a bridge (the "switch"), addresses of their own, and UCX limited to
TCP, so the KV crosses the veth links as it would cross a network between two machines.
PD through it matches P alone, and D's link counts at least the KV's bytes. The namespaces,
links and bridge are made for the test and removed after it; without root or `ip netns`
the test is skipped with the reason."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from shim_helpers import ShimProcess, generate_alone, logged_path, pd_flow

from engine_shim.backends.embedded.kv_plane.nixl import load_nixl

NIXL, WHY_NOT = load_nixl()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NIXL is None, reason=WHY_NOT)]

_SUBNET = "10.213.77"  # a /24 made up for the test; the bridge takes .254


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Host:
    namespace: str
    address: str
    link: str  # the veth end inside the namespace

    def link_rx_bytes(self) -> int:
        out = subprocess.run(
            ["ip", "netns", "exec", self.namespace, "cat", f"/sys/class/net/{self.link}/statistics/rx_bytes"],
            check=True, capture_output=True, text=True, timeout=30,
        )
        return int(out.stdout)


class Network:
    """A bridge in this namespace and a namespace per host, each linked to it by a veth."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"msbr{self.tag}"
        self.hosts: list[Host] = []
        self._links: list[str] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{_SUBNET}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, index: int) -> Host:
        namespace, outer, inner = f"ms{self.tag}h{index}", f"msv{self.tag}{index}", "eth0"
        _ip("netns", "add", namespace)
        self.hosts.append(Host(namespace, f"{_SUBNET}.{index}", inner))
        _ip("link", "add", outer, "type", "veth", "peer", "name", f"msp{self.tag}{index}")
        self._links.append(outer)
        _ip("link", "set", f"msp{self.tag}{index}", "netns", namespace, "name", inner)
        _ip("link", "set", outer, "master", self.bridge, "up")
        for args in (
            ("addr", "add", f"{_SUBNET}.{index}/24", "dev", inner),
            ("link", "set", inner, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip("-n", namespace, *args)
        return self.hosts[-1]

    def remove(self) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)
        for link in [*self._links, self.bridge]:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


def _why_no_namespaces() -> str:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return ""


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    reason = _why_no_namespaces()
    if reason:
        pytest.skip(reason)
    try:
        net = Network()
    except (subprocess.CalledProcessError, OSError) as error:
        detail = getattr(error, "stderr", b"") or b""
        pytest.skip(f"cannot make a bridge here: {error} {detail.decode(errors='replace')}")
    try:
        yield net
    finally:
        net.remove()


def _shim_on(host: Host, tmp: Path, name: str) -> ShimProcess:
    args = [
        "shim", "--backend", "embedded", "--model", "tiny", "--host", host.address,
        "--port", "0", "--kv-transport", "nixl",
    ]
    # UCX limited to TCP: its shared-memory transports would otherwise still find the other
    # process on this one kernel, and the KV would not cross the link.
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.link}
    prefix = ("ip", "netns", "exec", host.namespace)
    return ShimProcess(args, tmp / f"{name}.log", prefix=prefix, env=env)


async def test_pd_across_two_network_namespaces_matches_one_shim(
    network: Network, tmp_path: Path
):
    p_host, d_host = network.add_host(1), network.add_host(2)
    p = _shim_on(p_host, tmp_path, "p")
    try:
        d = _shim_on(d_host, tmp_path, "d")
        try:
            tokens = [10 + (i * 11) % 240 for i in range(200)]
            expected = await generate_alone(p.address, "netns-alone", tokens)
            received_before = d_host.link_rx_bytes()
            ids, prep, sent = await pd_flow(p.address, d.address, "netns-pd", tokens)
            received = d_host.link_rx_bytes() - received_before
            path = await logged_path(p, "netns-pd")
        finally:
            d.stop()
    finally:
        p.stop()
    info = json.loads(prep.kv_addr_info)
    assert p.address.startswith(f"{p_host.address}:") and info["address"].startswith(d_host.address)
    assert path == "nixl" and sent is not None and sent.num_bytes_sent > 0
    assert received >= sent.num_bytes_sent  # the KV crossed D's link
    assert len(expected) == 16 and ids == expected
