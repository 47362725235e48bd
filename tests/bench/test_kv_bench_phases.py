"""kv_bench's split of NIXL sends into phases reads the line P's backend logs for each send
(engine_shim/backends/embedded/backend.py, WriteTimes): the format is taken from WriteTimes
itself, so a change to it fails here rather than silently dropping the split."""

from __future__ import annotations

from bench.kv_bench import nixl_phases, with_outside
from engine_shim.backends.embedded.kv_plane.nixl_sender import WriteTimes


def _line(request_id: str, num_bytes: int, hold: float, claim: float, transfer: float,
          confirm: float, total: float = 9.0) -> str:
    times = WriteTimes(hold_ms=hold, accept_ms=0.2, claim_ms=claim, transfer_ms=transfer,
                       confirm_ms=confirm)
    return (f"2026-12-05 10:00:00,000 INFO engine_shim.backends.embedded.backend [trace=-]: "
            f"RemoteSend {request_id}: 1024 tokens, {num_bytes} bytes to 127.0.0.1:1 in {total} ms "
            f"({times}), path=nixl")


def test_medians_per_size_and_the_write_rate_over_the_transfer_phase() -> None:
    log = "\n".join([
        _line("warm-nixl-1024-0", 32_000_000, 1.0, 2.0, 1.0, 0.5, total=5.0),
        _line("warm-nixl-1024-1", 32_000_000, 3.0, 4.0, 2.0, 0.7, total=9.5),
        _line("warm-nixl-1024-2", 32_000_000, 2.0, 3.0, 4.0, 0.6, total=8.0),
        _line("warm-nixl-8176-0", 256_000_000, 5.0, 1.0, 2.0, 1.0),
        # neither timed nor NIXL: left out
        _line("warmup-nixl-1024-0", 32_000_000, 9.0, 9.0, 9.0, 9.0),
        "RemoteSend warm-shm-1024-0: 1024 tokens, 32000000 bytes to 127.0.0.1:1 in 7.0 ms, path=shm",
    ])
    phases = nixl_phases(log)
    assert set(phases) == {1024, 8176}
    assert phases[1024] == {"send_ms": 8.0, "hold_ms": 2.0, "claim_ms": 3.0, "transfer_ms": 2.0,
                            "confirm_ms": 0.6, "write_gbps": 16.0, "sends": 3}
    assert phases[8176]["write_gbps"] == 128.0
    assert phases[8176]["sends"] == 1


def test_no_nixl_sends_no_split() -> None:
    assert nixl_phases("RemoteSend warm-grpc-256-0: 256 tokens, 1 bytes to x in 1.0 ms, path=grpc") == {}


def test_outside_is_the_clients_median_less_ps_send() -> None:
    """What the call costs around P's send: the client's median RemoteSend (s) less P's."""
    split = {"send_ms": 8.0, "hold_ms": 2.0}
    assert with_outside(split, 0.0105) == {"send_ms": 8.0, "hold_ms": 2.0, "outside_ms": 2.5}
    assert with_outside({"hold_ms": 2.0}, 0.0105) == {"hold_ms": 2.0}  # no total logged
    assert with_outside(split, None) == split
