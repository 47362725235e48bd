"""freeze_startup_heap: what startup made leaves the collector's walks, and what comes after
is still collected; the gateway's app freezes its process's heap only when the CLI (or a
worker) serves it, not where another process embeds it. In child interpreters, so this test
process's heap stays as it is."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = """
import gc, json, weakref
import grpc, fastapi  # a service's startup: large libraries, all imported for good
from microserving.gc_tuning import freeze_startup_heap

tracked_before = len(gc.get_objects())
frozen = freeze_startup_heap()
tracked_after = len(gc.get_objects())

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made while serving
gone = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({"before": tracked_before, "frozen": frozen, "after": tracked_after,
                  "cycle_collected": gone() is None}))
"""


def test_startup_objects_are_frozen_and_later_garbage_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=120, check=True)
    facts = json.loads(done.stdout)
    assert facts["frozen"] > 10_000  # grpc and FastAPI alone are tens of thousands of objects
    assert facts["after"] < facts["before"] // 10  # collections no longer walk them
    assert facts["cycle_collected"]


_GATEWAY_CHILD = """
import gc, json
from fastapi.testclient import TestClient
from gateway.app import create_app
from gateway.settings import GatewaySettings

frozen = {}
for freeze in (False, True):
    with TestClient(create_app(GatewaySettings(router="127.0.0.1:1"), freeze_heap=freeze)):
        frozen[str(freeze)] = gc.get_freeze_count()
print(json.dumps(frozen))
"""


def test_the_gateway_app_freezes_only_a_process_it_owns() -> None:
    done = subprocess.run([sys.executable, "-c", _GATEWAY_CHILD], capture_output=True,
                          text=True, timeout=120, check=True)
    frozen = json.loads(done.stdout)
    assert frozen["False"] == 0  # embedded (tests, another ASGI server): left alone
    assert frozen["True"] > 10_000
