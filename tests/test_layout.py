"""The package's layers: folders in the direction of the dependencies, and no import cycle.

Every import in ``ddp/`` is read from the source (function-level imports included) and resolved to
the module it names; the graph must have no cycle, and each layer may import only the layers
before it: strategies and the model, then the launcher, then the benchmark core, then analysis,
then the GPU acceptance stages, then the command line. Inside the benchmark core the folders are layers too: the configuration,
then the results' schema and arithmetic, then memory, then collectives, then the rounds that run
them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "ddp"
# layer of each top-level part; a module may import its own layer and those below it
LAYERS = {"importing": 0, "strategies": 0, "model": 0, "launcher": 1, "bench": 2, "analysis": 3, "acceptance": 4, "cli": 5,
          "__main__": 6}
# the benchmark core's folders, each importing only its own and those before it (type hints under
# TYPE_CHECKING are read too: an annotation is a dependency a reader follows)
BENCH_LAYERS = {"config": 0, "results": 1, "memory": 2, "collectives": 3, "rounds": 4}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The ddp modules that ``path`` imports anywhere in its body."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ddp"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "ddp":
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return {module for module in found if module in known and module != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_each_layer_imports_only_the_layers_before_it():
    wrong = [
        f"{source} imports {target}"
        for source, targets in graph().items()
        for target in targets
        if layer(source) is not None and layer(target) is not None and layer(target) > layer(source)
    ]
    assert not wrong, "imports against the direction of the layers: " + "; ".join(sorted(wrong))


def bench_layer(module: str) -> int | None:
    parts = module.split(".")
    return BENCH_LAYERS.get(parts[2]) if len(parts) > 3 and parts[1] == "bench" else None


def test_the_benchmark_core_folders_import_only_those_before_them():
    edges = graph()
    bench = {m for m in edges if m.startswith("ddp.bench.") and m.count(".") >= 3}
    assert {m.split(".")[2] for m in bench} == set(BENCH_LAYERS), "a folder of ddp/bench is not in BENCH_LAYERS"
    assert not [m for m in edges if m.startswith("ddp.bench.") and m.count(".") == 2 and not m.endswith("__init__")
                and m.split(".")[2] not in BENCH_LAYERS], "a module stands loose in ddp/bench: give it a folder by its job"
    wrong = sorted(f"{source} imports {target}" for source in bench for target in edges[source]
                   if bench_layer(target) is not None and bench_layer(target) > bench_layer(source))
    assert not wrong, "imports against the benchmark core's folders: " + "; ".join(wrong)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ddp.bench.rounds import trainer\n    import ddp.cli\n    from ..analysis import figures\n")
    known = {"ddp.bench.rounds.trainer", "ddp.cli", "ddp.bench", "ddp.analysis.figures"}
    assert imports_of("ddp.strategies.x", source, known) == {"ddp.bench.rounds.trainer", "ddp.cli", "ddp.analysis.figures"}


# What starts ranks or runs on them: the launcher, and the benchmark modules that drive a rank group.
RANK_MODULES = {
    "ddp.launcher", "ddp.bench.rounds.loop", "ddp.bench.rounds.spread", "ddp.bench.rounds.traced",
    "ddp.bench.rounds.in_process", "ddp.bench.rounds.grid_measurer", "ddp.bench.rounds.blocks",
    "ddp.bench.rounds.trainer", "ddp.bench.rounds.race", "ddp.bench.rounds.buckets",
    "ddp.bench.rounds.allreduce", "ddp.bench.rounds.profiling", "ddp.bench.rounds.grid", "ddp.bench.collectives.recording", "ddp.bench.rounds.rank_state",
}


def reachable(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_analysis_only_reads_saved_data():
    """analysis/ computes and renders from saved runs: nothing it imports, directly or through
    another module, starts ranks or runs on them (that is bench/'s, driven from cli/)."""
    edges = graph()
    wrong = {
        source: sorted(reachable(edges, source) & RANK_MODULES)
        for source in edges
        if source.startswith("ddp.analysis") and reachable(edges, source) & RANK_MODULES
    }
    assert not wrong, f"analysis modules that reach code that starts or runs on ranks: {wrong}"
    assert RANK_MODULES <= set(edges), "a module named in RANK_MODULES no longer exists: update the list"


def test_no_test_module_imports_another():
    """What tests share lives in modules that are not tests (``tests/synthetic.py``,
    ``correctness_tests/training.py``, ...): importing a test module runs its collection-time code
    and couples two suites' cases."""
    root = PACKAGE.parent
    wrong = []
    for folder in ("tests", "correctness_tests", "perf_tests"):
        for path in sorted((root / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                    if isinstance(node, ast.ImportFrom) else [])
                wrong += [f"{path.relative_to(root)} imports {name}" for name in names
                          if name.split(".")[-1].startswith("test_")]
    assert not wrong, "; ".join(wrong)
