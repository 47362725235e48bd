"""Property-based fuzzing of the live gateway from its own OpenAPI schema (schemathesis): for
every operation, valid and invalid inputs generated from the schema never get a 5xx, and the
engines behind it stay up. Bounded (MAX_EXAMPLES per operation and mode) to run in well under
a minute on a shared CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all

pytestmark = pytest.mark.e2e

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("fuzz")
    (shim,) = start_shims(logs, ["both"])
    router = start_router(logs, [shim.address], "--pattern", "round-robin")
    gateway = start_gateway(logs, router.address)
    services = {"shim": shim, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


def _operations(base_url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid schema fails here


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str,
          statuses: list[int], server_errors: list[str]) -> None:
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        if isinstance(case.body, dict) and case.body.get("max_tokens") is None:
            case.body["max_tokens"] = 4  # the default (16) costs time and proves nothing more
        response = case.call(base_url=base_url, timeout=60)
        statuses.append(response.status_code)
        if response.status_code >= 500:
            server_errors.append(f"{operation.label}: {response.status_code} {case.body!r:.300} -> {response.text[:200]}")

    try:
        check()
    except Unsatisfiable:  # no invalid input exists for an operation without parameters
        assert mode is GenerationMode.NEGATIVE


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_schema_driven_requests_never_get_a_server_error(stack, mode: GenerationMode) -> None:
    base_url = f"http://{stack['gateway'].address}"
    server_errors: list[str] = []
    statuses: list[int] = []
    for operation in _operations(base_url):
        _fuzz(operation, mode, base_url, statuses, server_errors)
    assert not server_errors, "\n".join(server_errors)
    assert statuses
    for name, service in stack.items():
        assert service.is_alive(), name
    print(f"\nfuzz ({mode.value}): {len(statuses)} requests, statuses {sorted(set(statuses))}")
