"""The CPU wake-up latency bound a service holds (microserving/cpu_latency.py): held while the
process runs, let go when it ends, read back from the kernel (/dev/cpu_dma_latency answers
the bound in force); each service's setting and flag; a bound that cannot be held fails the
start with the reason. The kernel's bound is the least of all held: each test holds a value
of its own below the host's, so what it reads back is its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine_shim.settings import ShimSettings
from gateway.settings import GatewaySettings
from microserving import cpu_latency
from router.settings import RouterSettings
from tests.reliability.stack_procs import REPO, clean_env, launch, start_gateway, stop_all, until

_CAN_HOLD = os.access(cpu_latency.PATH, os.W_OK) and cpu_latency.idle_driver() != "none"
needs_qos = pytest.mark.skipif(
    not _CAN_HOLD, reason=f"{cpu_latency.PATH} is not writable here (root on Linux holds it), or "
                          "no cpuidle driver reads it")


def _host_bound() -> int:
    bound = cpu_latency.current()
    if bound <= 10:
        pytest.skip(f"another process holds a CPU latency bound of {bound} us on this host")
    return bound


@needs_qos
def test_a_hold_is_the_kernels_bound_until_closed() -> None:
    before = _host_bound()
    with cpu_latency.CpuLatencyHold(3) as held:
        assert held.us == 3
        assert cpu_latency.current() == 3
        with cpu_latency.CpuLatencyHold(5):  # the least of all held is the one in force
            assert cpu_latency.current() == 3
    assert cpu_latency.current() == before


def _pollers_gone(pids: list[int]) -> bool:
    """Every poller ended (reaped, or a zombie its holder has not reaped yet)."""
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z":
                return False
        except OSError:
            continue
    return True


@pytest.fixture()
def no_idle_driver(tmp_path: Path) -> Path:
    """A `current_driver` file that says the kernel runs no cpuidle driver."""
    driver = tmp_path / "current_driver"
    driver.write_text("none\n")
    return driver


@pytest.fixture()
def without_idle_driver(no_idle_driver: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process reads `no_idle_driver` as the kernel's (the GPU hosts here)."""
    monkeypatch.setattr(cpu_latency, "IDLE_DRIVER", str(no_idle_driver))


@pytest.mark.usefixtures("without_idle_driver")
def test_without_a_cpuidle_driver_idle_pollers_keep_0(tmp_path: Path) -> None:
    """No cpuidle driver (the GPU hosts here): nothing reads the bound, so 0 is kept by one
    idle-priority spinning process a CPU, and any other bound is refused."""
    with pytest.raises(cpu_latency.CpuLatencyError, match="no cpuidle driver"):
        cpu_latency.CpuLatencyHold(20)
    cpus = sorted(os.sched_getaffinity(0))
    held = cpu_latency.CpuLatencyHold(0, str(tmp_path / "never-opened"))
    pids = held.poller_pids
    try:
        assert len(pids) == len(cpus)
        assert until(lambda: all(os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in pids), 30)
        assert sorted(min(os.sched_getaffinity(pid)) for pid in pids) == cpus  # one a CPU
        assert all(len(os.sched_getaffinity(pid)) == 1 for pid in pids)
        # named for ps, and not in this process's group (whose CPU is the service's)
        assert all(Path(f"/proc/{pid}/comm").read_text().strip() == "ms-idle-poll" for pid in pids)
        assert all(os.getpgid(pid) != os.getpgid(0) for pid in pids)
    finally:
        held.close()
    assert _pollers_gone(pids)


@pytest.mark.usefixtures("without_idle_driver")
def test_idle_pollers_are_refused_under_a_cpu_quota(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Their time would count against the quota and throttle the service: refused, with the
    quota named; a cgroup without one (v2 `max`, v1 -1) starts them."""
    proc_cgroup = tmp_path / "cgroup"
    monkeypatch.setattr(cpu_latency, "PROC_CGROUP", str(proc_cgroup))
    monkeypatch.setattr(cpu_latency, "CGROUP_ROOT", str(tmp_path / "fs"))
    v2 = tmp_path / "fs" / "pod" / "gateway"
    v2.mkdir(parents=True)
    proc_cgroup.write_text("0::/pod/gateway\n")
    (v2 / "cpu.max").write_text("200000 100000\n")
    with pytest.raises(cpu_latency.CpuLatencyError, match=r"CPU quota \(cpu.max 200000 100000\)"):
        cpu_latency.CpuLatencyHold(0)
    v1 = tmp_path / "fs" / "cpu,cpuacct" / "box"
    v1.mkdir(parents=True)
    proc_cgroup.write_text("4:memory:/box\n3:cpu,cpuacct:/box\n0::/\n")
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    with pytest.raises(cpu_latency.CpuLatencyError, match="cpu.cfs_quota_us 50000 per 100000"):
        cpu_latency.CpuLatencyHold(0)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpu_latency.cpu_quota() is None
    with cpu_latency.CpuLatencyHold(0) as held:
        assert held.poller_pids


_HOLDER = """
import sys, time
from microserving import cpu_latency
cpu_latency.IDLE_DRIVER = sys.argv[1]
held = cpu_latency.CpuLatencyHold(0)
print(" ".join(map(str, held.poller_pids)), flush=True)
time.sleep(120)
"""


def test_idle_pollers_end_with_the_process_that_holds_them(no_idle_driver: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(no_idle_driver)], stdout=subprocess.PIPE,
                              text=True, env=clean_env(), cwd=REPO)
    try:
        assert holder.stdout is not None
        pids = [int(pid) for pid in holder.stdout.readline().split()]
        assert pids and all(Path(f"/proc/{pid}").exists() for pid in pids)
    finally:
        holder.kill()  # no cleanup runs: the kernel's parent-death signal ends them
        holder.wait()
    assert until(lambda: _pollers_gone(pids), 30)


def test_no_setting_holds_nothing() -> None:
    assert cpu_latency.hold(None) is None


def test_a_bound_that_cannot_be_held_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(cpu_latency.CpuLatencyError, match="needs root") as raised:
        cpu_latency.CpuLatencyHold(0, str(tmp_path))  # a directory: never writable as a file
    assert str(tmp_path) in str(raised.value)
    with pytest.raises(cpu_latency.CpuLatencyError, match="must be in"):
        cpu_latency.CpuLatencyHold(-1, str(tmp_path))


@pytest.mark.parametrize("settings_type", [GatewaySettings, RouterSettings, ShimSettings])
def test_each_service_reads_the_setting(settings_type: type, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("MICROSERVING_")]:
        monkeypatch.delenv(name)
    assert settings_type().cpu_latency_us is None
    assert settings_type(cpu_latency_us="0").cpu_latency_us == 0
    assert settings_type(cpu_latency_us="off").cpu_latency_us is None
    assert settings_type(cpu_latency_us=" None ").cpu_latency_us is None
    for bad in (-1, cpu_latency.MAX_US + 1, "soon"):
        with pytest.raises(ValidationError):
            settings_type(cpu_latency_us=bad)


@needs_qos
@pytest.mark.e2e
def test_the_gateway_holds_the_bound_while_it_runs(tmp_path: Path) -> None:
    before = _host_bound()
    # Nothing listens at the router's address: the gateway starts and serves its own routes.
    gateway = start_gateway(tmp_path, "127.0.0.1:9", "--cpu-latency-us", "4")
    try:
        assert cpu_latency.current() == 4
    finally:
        stop_all([gateway])
    assert until(lambda: cpu_latency.current() == before, 30)  # the kernel let it go with the process


@needs_qos
@pytest.mark.e2e
def test_the_router_and_the_shim_hold_it_from_the_environment(tmp_path: Path) -> None:
    before = _host_bound()
    shim = launch("shim", ["shim", "--backend", "synthetic", "--model", "tiny", "--port", "0"],
                  tmp_path, {"MICROSERVING_SHIM_CPU_LATENCY_US": "6"})
    router = launch("router", ["router", "--model", "tiny", "--port", "0",
                               "--engine", "127.0.0.1:9=both"],
                    tmp_path, {"MICROSERVING_ROUTER_CPU_LATENCY_US": "7"})
    try:
        shim.wait_listening(120)
        assert cpu_latency.current() == 6
        router.wait_listening(120)
        assert cpu_latency.current() == 6  # both held: the least is in force
        stop_all([shim])
        assert until(lambda: cpu_latency.current() == 7, 30)
    finally:
        stop_all([shim, router])
    assert until(lambda: cpu_latency.current() == before, 30)


_CANNOT_HOLD = """
import sys
from microserving import cpu_latency
cpu_latency.PATH = sys.argv[1]  # a directory: what a service that may not write the device meets
if sys.argv[2] == "gateway":
    from gateway.cli import main
elif sys.argv[2] == "router":
    from router.cli import main
else:
    from engine_shim.cli import main
raise SystemExit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("service, args", [
    ("gateway", ["--port", "0", "--router", "127.0.0.1:9"]),
    ("router", ["--port", "0", "--model", "tiny", "--engine", "127.0.0.1:9=both"]),
    ("shim", ["--port", "0", "--backend", "synthetic", "--model", "tiny"]),
])
def test_a_service_that_cannot_hold_the_bound_says_why_and_does_not_start(
    tmp_path: Path, service: str, args: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CANNOT_HOLD, str(tmp_path), service, *args, "--cpu-latency-us", "0"],
        capture_output=True, text=True, timeout=120, env=clean_env(), cwd=REPO)
    assert done.returncode == 1, done.stderr
    assert f"microserving {service}: cannot hold a CPU latency bound of 0 us: {tmp_path}" in done.stderr
    assert "listening" not in done.stdout


def test_a_bound_out_of_range_is_refused_before_start() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "microserving.cli", "gateway", "--port", "0", "--cpu-latency-us", "-3"],
        capture_output=True, text=True, timeout=120, env=clean_env(), cwd=REPO)
    assert done.returncode == 2
    assert "cpu_latency_us" in done.stderr and "listening" not in done.stdout
