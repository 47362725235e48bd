"""With worker processes (PROMETHEUS_MULTIPROC_DIR), /metrics sums every worker's value files.
A worker creates each file empty and sizes it just after (prometheus-client's MmapedDict), so
a scrape on another worker while one starts or is replaced can find an empty file: it must
still answer, with what the other files hold, not fail whole (it did: struct.error, a 500)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.unit


def _samples(text: bytes) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_a_scrape_while_a_worker_creates_its_files_sums_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # A started worker's file, as prometheus-client writes it in a worker process.
    name = "microserving_gateway_prompt_tokens"
    started = MmapedDict(str(tmp_path / "counter_1001.db"))
    started.write_value(mmap_key(name, name + "_total", [], [], "Prompt tokens."), 7.0, 0.0)
    started.close()
    # Another worker, caught between creating its files and sizing them.
    (tmp_path / "counter_999999.db").touch()
    (tmp_path / "histogram_999999.db").write_bytes(b"\x08\x00")
    samples = _samples(GatewayMetrics().render())
    assert samples["microserving_gateway_prompt_tokens_total"] == 7
