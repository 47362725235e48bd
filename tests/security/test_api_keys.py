"""Gateway API keys: `Authorization: Bearer <key>` against keys from the environment
(MICROSERVING_GATEWAY_API_KEYS) and from a key file; missing, malformed or wrong keys get a
401 OpenAI error; /health stays open for probes; every key is compared in constant time
(no early exit) and no key (good or bad) is ever written to a service's log."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import httpx
import pytest
from stack_procs import Service, start_gateway, start_router, start_shims, stop_all

from gateway.auth import ApiKeyChecker

ENV_KEY, FILE_KEY, WRONG_KEY = "sk-env-0b1c2d3e", "sk-file-4f5a6b7c", "sk-wrong-8d9e0f1a"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("api-keys")
    key_file = logs / "keys.txt"
    key_file.write_text(f"# one key per line\n{FILE_KEY}\n")
    (shim,) = start_shims(logs, ["both"])
    router = start_router(logs, [shim.address], "--pattern", "round-robin")
    gateway = start_gateway(logs, router.address, "--api-key-file", str(key_file), "--log-level", "debug",
                            env={"MICROSERVING_GATEWAY_API_KEYS": ENV_KEY})
    services = {"shim": shim, "router": router, "gateway": gateway}
    yield services
    stop_all(services.values())


@pytest.mark.e2e
async def test_only_configured_bearer_keys_are_served_and_none_is_logged(stack) -> None:
    body = {"prompt": "hello", "max_tokens": 2}
    refused = {"no header": {}, "wrong key": {"Authorization": f"Bearer {WRONG_KEY}"},
               "basic scheme": {"Authorization": f"Basic {ENV_KEY}"}, "empty bearer": {"Authorization": "Bearer"},
               "key without scheme": {"Authorization": ENV_KEY}}
    async with httpx.AsyncClient(base_url=f"http://{stack['gateway'].address}", timeout=30) as client:
        for name, headers in refused.items():
            reply = await client.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 401, name
            assert reply.json()["error"]["type"] == "authentication_error"
            assert ENV_KEY not in reply.text and WRONG_KEY not in reply.text
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        for key in (ENV_KEY, FILE_KEY):
            reply = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
        assert (await client.get("/health")).status_code == 200
    for name, service in stack.items():
        log = service.log()
        for key in (ENV_KEY, FILE_KEY, WRONG_KEY):
            assert key not in log, (name, key)


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append((given, expected))
        return compare_digest(given, expected)

    monkeypatch.setattr("gateway.auth.hmac.compare_digest", spy)
    checker = ApiKeyChecker(["first-key", "second-key", "third-key"])
    assert checker.is_valid("first-key")  # a match on the first key still compares the others
    assert [expected for _, expected in compared] == [b"first-key", b"second-key", b"third-key"]
    compared.clear()
    assert not checker.is_valid("nope")
    assert len(compared) == 3
