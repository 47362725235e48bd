"""The walls between the rooms, checked on the source (ast, nothing imported): the gateway,
router and engine shim never import each other, the shared `microserving` package imports
none of them, only `colocated` (`microserving serve`) puts the gateway and the router
together and nothing imports it, the embedded engine imports no gRPC (not even through another module), and no
package has an import cycle."""

from __future__ import annotations

from pathlib import Path

import pytest
from import_graph import cycles, external_imports, find_modules, import_graph, reachable

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("gateway", "router", "engine_shim")
PACKAGES = ("microserving", *SERVICES, "colocated")
MODULES = find_modules(ROOT, PACKAGES)
GRAPH = import_graph(MODULES)

def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _crossings(source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in GRAPH.items() if _in(module, source)
        for target in targets if any(_in(target, f) for f in forbidden)
    )


def test_the_graph_sees_every_service_and_the_engine() -> None:
    # Guards the checks below against passing on an empty graph.
    for package in (*PACKAGES, "engine_shim.engine"):
        assert any(_in(m, package) for m in MODULES), package
    assert "engine_shim.engine.scheduler" in GRAPH["engine_shim.engine.llm_engine"]


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service(service: str) -> None:
    others = tuple(s for s in SERVICES if s != service)
    assert _crossings(service, others) == []


def test_the_shared_package_imports_no_service() -> None:
    assert _crossings("microserving", SERVICES) == []


@pytest.mark.parametrize("package", ["microserving", *SERVICES])
def test_nothing_imports_the_package_that_joins_gateway_and_router(package: str) -> None:
    assert _crossings(package, ("colocated",)) == []


def test_the_joining_package_joins_only_gateway_and_router() -> None:
    assert _crossings("colocated", ("engine_shim",)) == []
    assert _crossings("colocated", ("gateway",)) and _crossings("colocated", ("router",))


def test_the_embedded_engine_imports_no_grpc_even_indirectly() -> None:
    engine = [m for m in MODULES if _in(m, "engine_shim.engine")]
    external = external_imports(MODULES)
    offenders = sorted(
        f"{module} imports {name}"
        for module in reachable(GRAPH, engine)
        for name in external[module] if name == "grpc" or name.startswith("grpc_")
    )
    assert offenders == []
    generated_stubs = [m for m in reachable(GRAPH, engine) if m.endswith("_pb2_grpc")]
    assert generated_stubs == []


def test_the_scheduler_and_page_pool_are_plain_python() -> None:
    # Their unit tests (tests/engine/test_scheduler.py, test_block_manager.py) need no model.
    pure = [f"engine_shim.engine.{name}" for name in ("scheduler", "block_manager", "prefix_cache", "sequence")]
    external = external_imports(MODULES)
    heavy = sorted(f"{m} imports {n}" for m in reachable(GRAPH, pure) for n in external[m] if n in {"torch", "triton"})
    assert heavy == []


@pytest.mark.parametrize("package", ["microserving", "gateway", "router", "engine_shim", "colocated"])
def test_no_import_cycle_inside(package: str) -> None:
    assert [sorted(c) for c in cycles(GRAPH, package)] == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_cycle_hidden_under_type_checking(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n",
        "pkg/c.py": "def f():\n    from .a import x\n",
        "pkg/d.py": "import pkg.a\n",
    })
    graph = import_graph(find_modules(tmp_path, ["pkg"]))
    assert cycles(graph, "pkg") == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_the_checker_follows_imports_through_other_modules(tmp_path: Path) -> None:
    _write(tmp_path, {
        "svc/__init__.py": "",
        "svc/core/__init__.py": "",
        "svc/core/engine.py": "from ..util import helper\n",
        "svc/util.py": "import grpc.aio\n",
    })
    modules = find_modules(tmp_path, ["svc"])
    graph = import_graph(modules)
    assert reachable(graph, ["svc.core.engine"]) == {"svc.core.engine", "svc.util"}
    assert external_imports(modules)["svc.util"] == {"grpc"}
