"""The engine's torch threads on the CPU (EngineConfig.cpu_threads), checked in a fresh
interpreter: the setting is process-wide, and this one may have set it already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (
    "import sys, torch\n"
    "from engine_shim.engine.config import EngineConfig\n"
    "from engine_shim.engine.llm_engine import LLMEngine\n"
    "before = torch.get_num_threads()\n"
    "LLMEngine(EngineConfig(cpu_threads=int(sys.argv[1]), num_pages=8))\n"
    "print(before, torch.get_num_threads())\n"
)


@pytest.mark.parametrize("cpu_threads", [0, 1, 3])
def test_engine_runs_torch_on_the_threads_it_is_given(cpu_threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cpu_threads)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after == (cpu_threads or before)


def test_negative_cpu_threads_are_refused() -> None:
    from engine_shim.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)
