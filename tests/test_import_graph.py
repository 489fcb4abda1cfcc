"""veragged's modules import each other without a cycle, counting every import.

The graph has an edge M -> T for every `import`/`from ... import` in module M that names veragged
module T, wherever it stands (module level or inside a function: a function-local import that
closes a loop is still a loop, only deferred), and M -> each package above T that is not above M
(importing `veragged.a.b` first runs `veragged/a/__init__.py`). Imports under
`if TYPE_CHECKING:` never run and are left out. The test fails on every strongly connected
component of more than one module, printing the imports that close it. How placement/ stays
acyclic: [Note: placement layers] (veragged/placement/tensor.py).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "veragged"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def _targets(node, module: str, is_package: bool, modules) -> list[str]:
    """The veragged modules an import statement names (a `from X import y` names X.y where
    that is a module, else X)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                 for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:  # `import veragged.x.y` of a non-module name
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first import that makes the edge}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        is_package = path.name == "__init__.py"
        own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
                continue
            for target in _targets(node, module, is_package, modules):
                chain = target.split(".")
                for k in range(1, len(chain) + 1):
                    name = ".".join(chain[:k])
                    if name in modules and name not in own:
                        graph[module].setdefault(name, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_veragged_has_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component))
        for m in component:
            for t, line in sorted(graph[m].items()):
                if t in members:
                    lines.append(f"    {m}:{line} imports {t}")
    assert not found, "import cycles in veragged:\n" + "\n".join(lines)


def test_the_checker_finds_a_cycle():
    """The checker itself: a two-module loop closed by a function-local import is found."""
    graph = {"a": {"b": 1}, "b": {"a": 9}, "c": {"a": 2}}
    assert cycles(graph) == [["a", "b"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


@pytest.mark.parametrize("module, target", [
    ("veragged.placement.ops", "veragged.placement.tensor"),
    ("veragged.placement.fastpath", "veragged.placement.tensor"),
    ("veragged.placement.ragged_dim_reduce", "veragged.placement.boxes"),
])
def test_graph_sees_the_layers(module, target):
    """The graph is read from the sources: edges the layering relies on are there."""
    assert target in import_graph()[module]
