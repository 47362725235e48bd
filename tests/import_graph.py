"""The repository's import graph, read with `ast` from the source files (nothing is imported):
which in-repo module imports which, every import counted (inside functions and under
TYPE_CHECKING too, since a cycle hidden there is still a cycle a reader walks)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> file, for every .py file under the given top-level packages."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            modules[module_name(root, path)] = path
    return modules


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Dotted names this file imports: `import a.b` gives a.b; `from a import b` gives a.b
    (a module or a name in a; resolve_module decides which)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if _is_package(path) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(package, node)
            yield base
            yield from (f"{base}.{alias.name}" if base else alias.name for alias in node.names)


def _absolute_base(package: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    anchor = parts[: len(parts) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def resolve_module(name: str, modules: dict[str, Path]) -> str | None:
    """The in-repo module `name` refers to (itself, or the module that holds the name)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the in-repo modules it imports (no self edges)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve_module(name, modules) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def external_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the top-level names of what it imports from outside the repository."""
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        names = {n for n in imported_names(module, path) if n and resolve_module(n, modules) is None}
        found[module] = {n.split(".")[0] for n in names}
    return found


def cycles(graph: dict[str, set[str]], within: str) -> list[frozenset[str]]:
    """Strongly connected components of more than one module among the modules of package
    `within` (edges leaving the package ignored): each is an import cycle."""
    inside = {m: {t for t in targets if _is_in(t, within)} for m, targets in graph.items() if _is_in(m, within)}
    return [c for c in _strongly_connected(inside) if len(c) > 1]


def _is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative (no recursion limit on long chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(frozenset(component))
    return components


def reachable(graph: dict[str, set[str]], starts: Iterable[str]) -> set[str]:
    """Every module the starts import, directly or through other in-repo modules."""
    seen = set(starts)
    todo = list(seen)
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen
