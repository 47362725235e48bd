"""Runs tests/engine/interpreted/ (the CUDA path's Triton kernels against the reference ops)
under Triton's CPU interpreter, in a subprocess: TRITON_INTERPRET must be set before the
kernels are defined, and setting it in this process would switch every CPU engine of the
suite onto the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

FOLDER = Path(__file__).parent / "interpreted"


def test_triton_kernels_match_the_reference_ops_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(FOLDER)],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-3000:]
