"""Fixtures of the shim tests live in shim_helpers.py (a name of its own, so test modules can
import its helpers whatever other conftest modules pytest has loaded)."""

from shim_helpers import decode_shim, prefill_shim, process_core_shims  # noqa: F401 - pytest fixtures
