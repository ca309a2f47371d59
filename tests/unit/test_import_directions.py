"""Which parts of the package may import which, read from the sources' import statements
(every one: at module level, in functions and under TYPE_CHECKING):

- no import circles between llmhost's modules;
- the gateway and the backend never import each other (the gateway runs on hosts
  without vLLM or Triton; the backend inside Triton's Python stub);
- the installed package imports nothing from the repository's tests, scripts, lab
  or monitoring folders (they are not installed);
- one package per concern: few modules loose in src/llmhost.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness.paths import ROOT

SRC = ROOT / "src"
NOT_INSTALLED = ("tests", "scripts", "lab", "monitoring")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, name: str) -> set[str]:
    """Every module name PATH imports (absolute; relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(llmhost module -> the llmhost modules it imports, llmhost module -> everything it imports)."""
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    everything = {name: _imported(path, name) for name, path in paths.items()}
    own = {name: {m for m in imported if m in paths and m != name} for name, imported in everything.items()}
    return own, everything


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of GRAPH with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_imports_it_judges():
    graph, _ = _graph()
    assert "llmhost.gateway.doors.native" in graph["llmhost.gateway.app"]
    assert "llmhost.backend.config" in graph["llmhost.backend.lora"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph, _ = _graph()
    assert _circles(graph) == []


def _part(module: str) -> str:
    """llmhost.gateway.app -> gateway; llmhost.cli -> cli."""
    return module.split(".")[1] if "." in module else ""


def test_the_gateway_and_the_backend_never_import_each_other():
    graph, _ = _graph()
    crossing = sorted((a, b) for a, targets in graph.items() for b in targets
                      if {_part(a), _part(b)} == {"gateway", "backend"})
    assert crossing == []


def test_the_package_imports_nothing_that_is_not_installed():
    _, everything = _graph()
    wrong = sorted((name, m) for name, imported in everything.items() for m in imported
                   if m.split(".")[0] in NOT_INSTALLED)
    assert wrong == []


def test_one_package_per_concern_and_few_loose_modules():
    """src/llmhost: at most 6 modules at the top, the rest in packages (each with an
    __init__.py, or setuptools would leave it out of the wheel)."""
    loose = sorted(p.name for p in (SRC / "llmhost").glob("*.py"))
    assert len(loose) <= 6, loose
    folders = {p.parent for p in (SRC / "llmhost").rglob("*.py")}
    assert sorted(str(f.relative_to(SRC)) for f in folders if not (f / "__init__.py").is_file()) == []
