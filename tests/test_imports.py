"""No import cycle among the project's packages: every `import` and `from
... import` statement, at module level or inside a function (a deferred
import is still an edge: it only moves the cycle to run time), between
modules of the repository's packages (generated stubs aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmsplit", "mmsplit_server", "mmsplit_cli", "tokenizer_svc", "scheduler_svc")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def resolve(name: str) -> str | None:
        while name:
            if name in mods:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                found = resolve(target)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the packages were not found"
    assert "scheduler_svc.collective" in graph["scheduler_svc.engine"]  # the graph sees real edges
    assert cycles(graph) == []


def test_the_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


TRANSPORTS = ("inline", "segment", "slab", "cuda_ipc")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_transport_of_the_hand_off_imports_another() -> None:
    """One interface over four transports (`mmsplit_server.handoff`): each
    transport builds on the shared machinery only, never on another
    transport, directly or through something else; the interface knows them
    all."""
    graph = import_graph()
    names = {t: f"mmsplit_server.handoff.{t}" for t in TRANSPORTS}
    for transport, module in names.items():
        others = {m for t, m in names.items() if t != transport}
        assert not reachable(graph, module) & others, f"{module} reaches {sorted(reachable(graph, module) & others)}"
    assert set(names.values()) <= graph["mmsplit_server.handoff.reference"]
    assert graph["mmsplit_server.handoff"] == set(), "the package module imports nothing"
