"""The core's import graph has no cycle, the tree's modules form strict layers, no core module imports SGLang or the
seam, the pure placement core never imports the live gateway, and eval/ and sgl_multilora/ together have no cycle.

The graph is read from the source with `ast`, not from `sys.modules`, so imports under `if
TYPE_CHECKING:` and imports inside functions count as edges too: a cycle hidden behind either still
couples the modules. An edge goes to the module an import statement names; the implicit import of a
package's `__init__` that any submodule import triggers is left out (otherwise every package that
imports its own submodules would count as a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "sgl_multilora"
EVAL = ROOT / "eval"
SEAM = ("sglang", "sgl_kernel", "sgl_multilora.patches")
"""What the core never imports: SGLang (and its kernel package) and the seam that translates to it. The seam itself
(`patches/`, installed as sgl_multilora.patches) lies outside CORE, so it is not scanned; sgl_multilora.triton_kernels
lies inside and is held to the same rule."""

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


def absolute_imports(source: str) -> set[str]:
    """Every module an absolute import statement anywhere in `source` names (`from a.b import c` names a.b and
    a.b.c: c may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


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
    assert strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"d"}}) == [["a", "b"]]
    assert absolute_imports("import sglang.srt.x as y\ndef f():\n    from sglang import lang\nfrom . import z\n") \
        == {"sglang.srt.x", "sglang", "sglang.lang"}


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


def test_no_core_module_imports_sglang_or_the_seam():
    """At module level or inside a function: the core runs, and is tested and simulated, without SGLang."""
    offenders = {}
    for name, (source, _) in core_modules().items():
        bad = sorted(m for m in absolute_imports(source) if within(m, SEAM))
        if bad:
            offenders[name] = bad
    assert not offenders, f"core modules importing SGLang or the seam (move them behind patches/): {offenders}"


def test_placement_core_never_imports_the_live_gateway():
    """sgl_multilora/cluster/ is pure; the gateway imports it, never the reverse. `cluster.__main__` is only the
    `python -m sgl_multilora.cluster` command, which starts the live cluster."""
    modules = core_modules()
    for name, (source, _) in modules.items():
        if within(name, ("sgl_multilora.cluster",)) and name != "sgl_multilora.cluster.__main__":
            bad = sorted(m for m in absolute_imports(source) if within(m, ("sgl_multilora.gateway", "aiohttp")))
            assert not bad, f"{name} imports {bad}: the placement core stays plain Python"


def test_eval_and_core_have_no_import_cycle():
    """No strongly connected component of more than one module across eval/ and sgl_multilora/ (imports under
    TYPE_CHECKING and inside functions count: they couple the modules as much)."""
    modules = {**core_modules(), **core_modules(EVAL)}
    assert "eval.sim.engine" in modules and "eval.sim.admission.base" in modules
    components = strongly_connected(import_graph(modules))
    assert not components, f"import cycles: {components}"
