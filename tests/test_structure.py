"""The package's import graph, every import counted (also those inside functions): no cycles, every
module on a floor, no import from a lower floor to a higher one, and imports at the top of modules
unless a comment on the line says why; and no line of the project's Python longer than 120 characters."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# lowest first: a module may import its own floor (without cycles) and the floors below it
FLOORS = [
    # 0, the ground: what everything may use
    ("hybrid.errors", "hybrid.torch_fixes", "hybrid.safe_loading", "hybrid.capabilities"),
    # 1: parallel primitives and the layout, data, flags and plans that need no model
    ("hybrid.distributed", "hybrid.parallel", "hybrid.data", "hybrid.flags", "hybrid.megatron_compat",
     "hybrid.pipeline_plan", "hybrid.run_length"),
    # 2: the model in every form it runs in
    ("hybrid.model",),
    # 3: the checkpoint format
    ("hybrid.checkpoint",),
    # 4: conversion to and from other formats and layouts; the memory estimate
    ("hybrid.conversion", "hybrid.memory"),
    # 5: a run's configuration, and where it starts (decided before the config is built; no DeepSpeed, no model)
    ("hybrid.architecture", "hybrid.ds_config", "hybrid.objective_flags", "hybrid.config", "hybrid.dry_run",
     "hybrid.training.start"),
    # 6: what runs a model: evaluation and training (neither imports the other)
    ("hybrid.evaluation", "hybrid.generation", "hybrid.serving", "hybrid.training"),
    # 7: entry points
    ("hybrid.cli",),
]
# same floor, no import between them
SIBLINGS_APART = [("hybrid.evaluation", "hybrid.training"), ("hybrid.generation", "hybrid.training")]


def _modules() -> dict:
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "hybrid")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module[: -len(".__init__")] if module.endswith(".__init__") else module] = path
    return found


def _targets(node, modules) -> set:
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybrid"):
        out = set()
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            out.add(full if full in modules else node.module)
        return out
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    return set()


def _graph() -> dict:
    modules = _modules()
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            graph[module] |= _targets(node, modules)
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


def _floor(module: str):
    for number, names in enumerate(FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return number
    return None


def _upward(graph) -> list:
    return [f"{m} (floor {_floor(m)}) -> {t} (floor {_floor(t)})" for m, targets in graph.items()
            for t in targets if _floor(t) is not None and _floor(m) is not None and _floor(t) > _floor(m)]


def test_every_module_has_a_floor():
    assert [m for m in _modules() if m != "hybrid" and _floor(m) is None] == []


def test_no_import_runs_from_a_lower_floor_to_a_higher_one():
    graph = _graph()
    assert _upward(graph) == []
    between = [f"{m} -> {t}" for a, b in SIBLINGS_APART for m, targets in graph.items() for t in targets
               if (m.startswith(a) and t.startswith(b)) or (m.startswith(b) and t.startswith(a))]
    assert between == []


def test_the_floor_check_finds_an_upward_import():
    assert _upward({"hybrid.parallel.layers": {"hybrid.training.engine"}}) == [
        "hybrid.parallel.layers (floor 1) -> hybrid.training.engine (floor 6)"]


def _explained(lines: list, number: int) -> bool:
    """The import on line `number` (1-based) carries a comment, or the block of imports it belongs to
    follows a comment line."""
    if "#" in lines[number - 1]:
        return True
    above = number - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def _late_imports(path: str) -> list[str]:
    """Imports inside functions or classes with no comment saying why."""
    source = open(path).read()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and not _explained(lines, inner.lineno):
                    found.append(f"{os.path.relpath(path, ROOT)}:{inner.lineno}")
    return sorted(set(found))


def test_imports_sit_at_the_top_of_modules_unless_a_comment_says_why():
    late = [use for path in _modules().values() for use in _late_imports(path)]
    assert late == [], "imports inside functions without a comment saying why:\n" + "\n".join(late)


MAX_LINE = 120  # characters; every Python file of the project


def _long_lines(paths) -> list:
    return [f"{os.path.relpath(path, ROOT)}:{number}: {len(line)} characters"
            for path in paths for number, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1)
            if len(line) > MAX_LINE]


def _python_files() -> list:
    out = []
    for top in ("hybrid", "launch", "conversion", "checks", "tests", "benchmarks"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".py")]
    return out


def test_no_line_is_longer_than_120_characters():
    assert _long_lines(_python_files()) == []


def test_the_line_check_finds_a_long_line(tmp_path):
    path = tmp_path / "long.py"
    path.write_text("x = 1\n" + "y = '" + "a" * MAX_LINE + "'\n")
    assert _long_lines([str(path)]) == [f"{os.path.relpath(str(path), ROOT)}:2: {MAX_LINE + 6} characters"]


MAX_MODULE_LINES = 800  # a module past this holds more than one job: split it along its jobs


def _long_modules(paths) -> list:
    counts = {path: len(open(path, encoding="utf-8").read().splitlines()) for path in paths}
    return [f"{os.path.relpath(path, ROOT)}: {n} lines" for path, n in counts.items() if n > MAX_MODULE_LINES]


def test_no_module_of_the_library_is_over_800_lines():
    assert _long_modules(list(_modules().values())) == []


def test_the_module_length_check_finds_a_long_module(tmp_path):
    path = tmp_path / "big.py"
    path.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _long_modules([str(path)]) == [f"{os.path.relpath(str(path), ROOT)}: {MAX_MODULE_LINES + 1} lines"]


def test_the_engine_and_the_loop_call_features_and_name_none_of_them():
    """MoE, FP8 and profiling reach the engine and the training loop only through hybrid.training.features."""
    for module in ("engine", "loop"):
        text = open(os.path.join(ROOT, "hybrid", "training", f"{module}.py"), encoding="utf-8").read()
        named = [name for name in ("moe_hooks", "MoEStepHooks", "keep_fp32_buffers", "from hybrid.parallel import fp8",
                                   "StepProfiler", "end_iteration", "keep_fp32_histories") if name in text]
        assert named == [], (module, named)
        called = {"engine": ("features.before_build(", "features.after_engine("), "loop": ("loop_features(",)}[module]
        assert all(call in text for call in called), module


def _named_modules(doc: str) -> set:
    """The module names a package docstring's "Modules:" section lists: lines indented two spaces that start with
    one name or several separated by commas (a deeper-indented line continues the one above)."""
    names, listing = set(), False
    for line in doc.splitlines():
        if line.rstrip().endswith("Modules:") or line.startswith("Modules ("):
            listing = True
            continue
        match = re.match(r"^  ([a-z_0-9]+(?:, [a-z_0-9]+)*)(?:\s{2,}|$)", line) if listing else None
        if match:
            names.update(name.strip() for name in match.group(1).split(","))
        elif listing and line.strip() and not line.startswith("   "):
            listing = False
    return names


def _package_maps() -> dict:
    """Each package of hybrid/ -> (the modules and subpackages it holds, those its docstring names)."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "hybrid")):
        if "__init__.py" not in files:
            continue
        held = {name[:-3] for name in files if name.endswith(".py") and name != "__init__.py"}
        held |= {d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py"))}
        doc = ast.get_docstring(ast.parse(open(os.path.join(folder, "__init__.py")).read())) or ""
        out[os.path.relpath(folder, ROOT)] = (held, _named_modules(doc))
    return out


def test_every_package_docstring_names_each_of_its_modules_and_no_other():
    """A package's docstring is its map: a module it does not name, or a name with no module, fails."""
    wrong = {package: {"unnamed": sorted(held - named), "gone": sorted(named - held)}
             for package, (held, named) in _package_maps().items() if held != named}
    assert wrong == {}


def test_the_map_check_finds_an_unnamed_and_a_gone_module():
    doc = "A package.\n\nModules:\n  alpha  the first\n  beta, gamma  two more\n      (continued)\n  delta\n\nAfter."
    assert _named_modules(doc) == {"alpha", "beta", "gamma", "delta"}
    assert _named_modules("No map here.\n  alpha  not a listing") == set()
