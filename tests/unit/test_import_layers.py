"""The core's import graph has no cycle, and the tree's modules form strict layers.

The graph is read from the source with `ast`, not from `sys.modules`, so imports under `if
TYPE_CHECKING:` and imports inside functions count as edges too: a cycle hidden behind either still
couples the modules. An edge goes to the module an import statement names; the implicit import of a
package's `__init__` that any submodule import triggers is left out (otherwise every package that
imports its own submodules would count as a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "sgl_multilora"

TREE_LAYERS = ["keys", "tree_nodes", "tree_ops", "tree_check", "tree"]
"""Bottom to top: each tree module imports only modules below it in this list (and none above)."""


def core_modules(root: Path = CORE) -> dict[str, tuple[str, bool]]:
    """Dotted name -> (source text, is a package `__init__`) for every module under `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = (path.read_text(), is_package)
    return modules


def imported_modules(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules in `known` that `source` (module `name`) imports anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)  # `from pkg import mod` names pkg.mod
    return {m for m in found if m in known and m != name}


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: imported_modules(name, src, is_pkg, known)
            for name, (src, is_pkg) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_parser_sees_type_checking_and_function_level_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from sgl_multilora.tree import LoraRadixTree\n"
        "def f():\n"
        "    from sgl_multilora import keys\n"
        "from . import tree_nodes\n"
    )
    known = {f"sgl_multilora.{m}" for m in ("tree", "keys", "tree_nodes", "x")}
    found = imported_modules("sgl_multilora.x", source, False, known)
    assert found == {"sgl_multilora.tree", "sgl_multilora.keys", "sgl_multilora.tree_nodes"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_core_import_graph_has_no_cycle():
    graph = import_graph(core_modules())
    assert "sgl_multilora.tree" in graph and "sgl_multilora.policy.lru" in graph
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle among core modules: {' -> '.join(cycle)}"


def test_tree_modules_import_only_lower_layers():
    graph = import_graph(core_modules())
    layers = [f"sgl_multilora.{name}" for name in TREE_LAYERS]
    for i, module in enumerate(layers):
        upward = graph[module] & set(layers[i:])
        assert not upward, f"{module} imports {sorted(upward)}, at or above its own layer"
