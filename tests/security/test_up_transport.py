"""`microserving up` passes TLS and the internal token to every service: with --tls-cert /
--tls-key / --tls-ca and --internal-token (the token read from MICROSERVING_INTERNAL_TOKEN,
handed to the children through their environment, never on a command line) the one-command
stack comes up with mutual TLS and the token on every gRPC hop and serves with an API key."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from stack_procs import REPO, clean_env
from tls_certs import make_node

pytestmark = pytest.mark.e2e

TOKEN, API_KEY = "up-internal-token-51e2", "sk-up-key-93a1"


def test_up_with_tls_and_internal_token_serves(tmp_path: Path) -> None:
    node = make_node(tmp_path, "up")
    log = tmp_path / "up.log"
    env = clean_env({"MICROSERVING_INTERNAL_TOKEN": TOKEN})
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "microserving.cli", "up", "--engines", "1", "--port", "0", "--router-port", "0",
             "--tls-cert", node.cert, "--tls-key", node.key, "--tls-ca", node.ca, "--internal-token",
             "--api-key", API_KEY, "--startup-timeout-s", "120"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"ready at (http://\S+)", line)
        assert match, log.read_text()[-3000:]
        reply = httpx.post(f"{match.group(1)}/completions", json={"prompt": "hi", "max_tokens": 3},
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    time.sleep(0.1)
    output = log.read_text()
    assert "ready on" in output and "router" in output
    assert TOKEN not in output  # neither in the argv lines nor in any child's log
