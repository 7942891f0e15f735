"""The package's import graph, every import counted (also those inside functions): no cycles, and the
lower layers never import the upper ones."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# layer -> the hybrid packages/modules it may import (besides itself)
ALLOWED = {
    "hybrid.parallel": {"hybrid.errors"},
    "hybrid.model": {"hybrid.errors", "hybrid.parallel", "hybrid.pipeline_plan", "hybrid.capabilities"},
    "hybrid.data": {"hybrid.errors"},
    "hybrid.capabilities": {"hybrid.errors"},
    "hybrid.pipeline_plan": {"hybrid.errors", "hybrid.capabilities"},
}


def _modules() -> dict:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "hybrid")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def _graph() -> dict:
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybrid"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    graph[module].add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[module].update(a.name for a in node.names if a.name in modules)
        graph[module] -= {module, "hybrid"}
    return graph


def _cycles(graph) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _layer(module: str):
    return next((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), None)


def test_lower_layers_do_not_import_upper_ones():
    upward = []
    for module, targets in _graph().items():
        layer = _layer(module)
        if layer is None:
            continue
        for target in targets:
            if _layer(target) == layer:
                continue
            if not any(target == a or target.startswith(a + ".") for a in ALLOWED[layer]):
                upward.append(f"{module} -> {target}")
    assert upward == []
