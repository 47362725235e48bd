"""Project-wide test configuration: default marker, GPU skipping, and a clean environment."""

from __future__ import annotations

import os

import pytest

# One torch thread per engine, here and in every process the tests start: the suite runs up to
# six engine processes on two cores, and torch's default (a thread per core each) makes their
# OpenMP threads spin against each other (a three-shim stack stepped 30x slower). `microserving
# up` shares the cores the same way (--cpu-threads). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_LEVELS = ("unit", "integration", "e2e", "gpu")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests without a level marker are unit tests; gpu tests are skipped without CUDA."""
    skip_gpu = None if _has_cuda() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if not any(item.get_closest_marker(level) for level in _LEVELS):
            item.add_marker(pytest.mark.unit)
        if skip_gpu is not None and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)
