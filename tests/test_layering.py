"""The package import graph of src/tailserve: which layer may import which, no cycles, and the
torch-free modules stay torch-free. Read from the source with ``ast``; nothing is imported.

Nodes are the subpackages (``engine``, ``kv``, ``model`` ...) and the top-level modules
(``request``, ``config`` ...); ``tailserve`` itself is the package ``__init__`` (the public
facade). Every import statement counts for the graph, wherever it is: at module level, inside
a function (a lazy import is still a dependency) and under ``if TYPE_CHECKING:`` (a type-only
edge couples the layers as much, and turns into a runtime one with the next refactor).

The torch check follows what importing a module really runs: the module-level imports outside
``TYPE_CHECKING`` of it, of every tailserve module they reach and of those modules' parent
``__init__``. A torch-free module may not import torch in any form itself, lazily included.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tailserve"

# Who may import whom (package level, edges inside one package not listed). The test asserts
# the graph equals this table exactly: a new edge, or one that is gone, must be written here.
ALLOWED: dict[str, set[str]] = {
    # the bottom layer: plain values and user-input checks
    "errors": set(),
    "kv_groups": set(),  # how a sliding-window model's layers share the KV pool, and its counts
    "sampling_params": {"errors"},
    "request": {"errors", "kv_groups", "sampling_params"},
    "outputs": {"request"},
    "data": {"request", "sampling_params"},
    "envs": set(),
    "glibc": set(),  # malloc_trim / mallopt through ctypes, for the engine and the server
    "platforms": {"errors"},
    "model_features": {"errors"},  # which config.json fields are served, which refused
    "families": set(),  # what differs between model families, as data
    "config": {"errors", "families", "kv_groups", "model_features", "platforms", "request"},
    "stepcost": set(),  # the step-time model: the scheduler budgets with it, diagnose fits it
    # torch-free engine parts and the edge renderers
    "kv": {"data", "kv_groups", "request"},
    "obs": {"data", "envs", "errors"},
    "kernels": {"envs"},
    # the model side: reads configs and step data, never the engine
    # (envs: the Triton kernels ask whether Triton's interpreter runs them)
    "model": {
        "config", "data", "envs", "errors", "families", "kernels", "obs", "platforms",
        "sampling_params",
    },
    # (platforms: the builder resolves the arguments against the host once, engine/build.py)
    "engine": {
        "config", "data", "envs", "errors", "glibc", "kv", "kv_groups", "model", "obs", "outputs",
        "platforms", "request", "sampling_params", "stepcost",
    },
    # the edge: server talks to the engine through engine.client and data records; kv only
    # for the pure ``usage_band_sizes`` the dashboard needs to draw the band heatmap
    "server": {
        "config", "data", "engine", "errors", "glibc", "kv", "model", "obs", "outputs", "request",
        "sampling_params", "tailserve",
    },
    "tailserve": {"config", "engine", "envs", "outputs", "sampling_params"},
    # tools
    "bench": {"errors", "model", "tailserve"},
    "analyze": {"bench", "config", "data", "errors", "kv_groups", "model", "stepcost"},
    "cli_flags": set(),  # argparse flags from dataclass fields; knows no tailserve type
    # (errors: the SLO flags' check, errors.check_slo_ms, that diagnose, compare and watch share)
    "cli": {
        "analyze", "bench", "cli_flags", "config", "engine", "envs", "errors", "sampling_params",
        "server",
    },
    # docs/configuration.md's generator (`make docs`): reads the flags' dataclasses and envs
    "configdoc": {"cli_flags", "config", "envs", "server"},
}

# Modules that must never load torch (the scheduler and block manager are tested on CPU with
# exact block ids; the API process's engine handle must not pay for torch).
TORCH_FREE_PREFIXES = ("tailserve.kv", "tailserve.data", "tailserve.stepcost")
TORCH_FREE_MODULES = (
    "tailserve.engine.scheduler",
    "tailserve.engine.latency",
    "tailserve.engine.waiting_queue",
    "tailserve.engine.step_budget",
    "tailserve.engine.step_phases",
    "tailserve.engine.step_time",
    "tailserve.engine.tenant_share",
    "tailserve.engine.admission",
    "tailserve.engine.messages",
    "tailserve.engine.client",
    "tailserve.engine.mp_client",
    "tailserve.engine.inproc_client",
    "tailserve.engine.input_processor",
    "tailserve.engine.structured_output",
)
TORCH_NAMES = {"torch", "triton"}

# Start-up exists once: the model is built in model/build.py (for the runner), an engine in
# engine/build.py (for the engine process, every tensor-parallel worker and the offline LLM).
# Who may import each, anywhere in src/tailserve (type-only imports included): a second
# start-up path would have to import one of them and lands here first.
BUILD_MODULES: dict[str, set[str]] = {
    "tailserve.model.build": {"tailserve.model.runner"},
    "tailserve.model.runner": {"tailserve.engine.build", "tailserve.engine.core",
                               "tailserve.model.runner_setup"},
    "tailserve.engine.build": {"tailserve.engine.core", "tailserve.engine.tensor_parallel"},
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. tailserve.engine.core
    target: str  # what it imports, e.g. tailserve.model.runner or torch
    line: int
    runtime: bool  # at module level and not under TYPE_CHECKING

    def where(self) -> str:
        path = _module_files()[self.module].relative_to(SRC.parent.parent)
        return f"{path}:{self.line} imports {self.target}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_files() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, False)
                for stmt in child.orelse:
                    visit_stmt(stmt, runtime)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(module, alias.name, child.lineno, runtime))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this module's package
                    pkg = module.split(".")
                    pkg = pkg if is_package else pkg[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    # ``from pkg import mod`` imports the submodule; otherwise a name of ``pkg``.
                    target = sub if sub in known else base
                    found.append(Import(module, target, child.lineno, runtime))
            else:
                visit(child, runtime)

    def visit_stmt(stmt: ast.stmt, runtime: bool) -> None:
        wrapper = ast.Module(body=[stmt], type_ignores=[])
        visit(wrapper, runtime)

    visit(ast.parse(path.read_text(), str(path)), True)
    return found


def _all_imports() -> list[Import]:
    files = _module_files()
    known = set(files)
    return [imp for mod, path in files.items() for imp in _imports_of(mod, path, known)]


def _node(module: str) -> str:
    """The package-level node of a tailserve module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tailserve"


def _package_graph(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    graph: dict[str, dict[str, list[Import]]] = {_node(m): {} for m in _module_files()}
    for imp in imports:
        if imp.target.split(".")[0] != "tailserve":
            continue
        a, b = _node(imp.module), _node(imp.target)
        if a != b:
            graph[a].setdefault(b, []).append(imp)
    return graph


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (cycle := dfs(m)) is not None:
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (cycle := dfs(n)) is not None:
            return cycle
    return None


def layering_violations(imports: list[Import]) -> list[str]:
    """Readable lines, one per difference between the import graph and ``ALLOWED``."""
    graph = _package_graph(imports)
    problems = []
    for pkg in sorted(set(graph) - set(ALLOWED)):
        problems.append(f"package {pkg!r} is not in ALLOWED: give it a row")
    for pkg, targets in sorted(graph.items()):
        allowed = ALLOWED.get(pkg, set())
        for target in sorted(set(targets) - allowed):
            first = targets[target][0]
            problems.append(
                f"{pkg} may not import {target}: {first.where()}"
                + (f" (and {len(targets[target]) - 1} more)" if len(targets[target]) > 1 else "")
            )
        for target in sorted(allowed - set(targets)):
            problems.append(f"ALLOWED lets {pkg} import {target} but nothing does: drop it")
    cycle = _find_cycle({a: set(t) for a, t in graph.items()})
    if cycle is not None:
        problems.append("import cycle between packages: " + " -> ".join(cycle))
    return problems


def torch_violations(imports: list[Import]) -> list[str]:
    files = _module_files()
    runtime: dict[str, list[Import]] = {}
    anywhere: dict[str, list[Import]] = {}
    for imp in imports:
        anywhere.setdefault(imp.module, []).append(imp)
        if imp.runtime:
            runtime.setdefault(imp.module, []).append(imp)

    def loaded_by(module: str) -> dict[str, list[str]]:
        """Every tailserve module importing ``module`` runs, with the chain that gets there."""
        chains: dict[str, list[str]] = {}
        todo = deque([(module, [module])])  # breadth first: the shortest chain is reported
        while todo:
            mod, chain = todo.popleft()
            if mod in chains or mod not in files:
                continue
            chains[mod] = chain
            parts = mod.split(".")
            parents = [".".join(parts[:i]) for i in range(1, len(parts))]
            for nxt in parents + [i.target for i in runtime.get(mod, ())]:
                if nxt.split(".")[0] == "tailserve":
                    todo.append((nxt, [*chain, nxt]))
        return chains

    checked = [m for m in files if m.startswith(TORCH_FREE_PREFIXES) or m in TORCH_FREE_MODULES]
    problems = []
    for module in sorted(checked):
        for imp in anywhere.get(module, ()):
            if imp.target.split(".")[0] in TORCH_NAMES:
                problems.append(f"{module} must stay torch-free: {imp.where()}")
        for mod, chain in sorted(loaded_by(module).items()):
            if mod == module:
                continue
            for imp in runtime.get(mod, ()):
                if imp.target.split(".")[0] in TORCH_NAMES:
                    problems.append(
                        f"{module} must stay torch-free, but loads torch through "
                        f"{' -> '.join(chain)}: {imp.where()}"
                    )
    return problems


def build_importers(imports: list[Import]) -> dict[str, set[str]]:
    return {target: {i.module for i in imports if i.target == target and i.module != target}
            for target in BUILD_MODULES}


def test_start_up_is_built_in_one_place() -> None:
    assert build_importers(_all_imports()) == BUILD_MODULES
    # A planted second path is seen.
    planted = [*_all_imports(), _planted("tailserve.engine.llm", "tailserve.model.runner")]
    assert build_importers(planted)["tailserve.model.runner"] == {
        "tailserve.engine.build", "tailserve.engine.core", "tailserve.engine.llm",
        "tailserve.model.runner_setup"}


def test_allowed_table_has_no_cycle() -> None:
    assert _find_cycle(ALLOWED) is None


def test_package_imports_follow_the_allowed_table() -> None:
    problems = layering_violations(_all_imports())
    assert not problems, "\n".join(problems)


def test_torch_free_modules_load_no_torch() -> None:
    problems = torch_violations(_all_imports())
    assert not problems, "\n".join(problems)
    checked = {m for m in _module_files() if m.startswith(TORCH_FREE_PREFIXES)}
    assert {"tailserve.kv.manager", "tailserve.kv.block_pool", "tailserve.data.records"} <= checked


# The checks themselves must fail on a bad import: plant a few and read the messages.
def _planted(module: str, target: str, line: int = 7, runtime: bool = True) -> Import:
    return Import(module, target, line, runtime)


def test_a_model_import_of_engine_is_named() -> None:
    bad = [*_all_imports(), _planted("tailserve.model.runner", "tailserve.engine.core")]
    problems = layering_violations(bad)
    assert problems == [
        "model may not import engine: src/tailserve/model/runner.py:7 imports "
        "tailserve.engine.core",
        "import cycle between packages: model -> engine -> model",
    ]


def test_a_lazy_or_type_only_import_counts_for_the_graph() -> None:
    lazy = _planted("tailserve.obs.metrics", "tailserve.engine.client", line=40, runtime=False)
    bad = [*_all_imports(), lazy]
    assert layering_violations(bad)[0] == (
        "obs may not import engine: src/tailserve/obs/metrics.py:40 imports "
        "tailserve.engine.client"
    )


def test_an_edge_no_longer_used_must_leave_the_table() -> None:
    kept = [i for i in _all_imports()
            if not (_node(i.module) == "obs" and i.target.startswith("tailserve.errors"))]
    assert layering_violations(kept) == [
        "ALLOWED lets obs import errors but nothing does: drop it"
    ]


def test_torch_reached_through_another_module_is_named() -> None:
    bad = [*_all_imports(), _planted("tailserve.request", "tailserve.model.runner", line=3)]
    problems = torch_violations(bad)
    assert problems
    assert all("must stay torch-free, but loads torch through" in p for p in problems)
    first_kv = next(p for p in problems if p.startswith("tailserve.kv.manager "))
    assert ("tailserve.kv.manager -> tailserve.request -> tailserve.model.runner"
            in first_kv)


def test_a_lazy_torch_import_in_the_scheduler_is_named() -> None:
    bad = [*_all_imports(), _planted("tailserve.engine.scheduler", "torch", 99, runtime=False)]
    assert torch_violations(bad) == [
        "tailserve.engine.scheduler must stay torch-free: src/tailserve/engine/scheduler.py:99 "
        "imports torch"
    ]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\n", [("torch", True)]),
        ("def f():\n    import torch\n", [("torch", False)]),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
         [("typing", True), ("torch", False)]),
        ("from . import errors\n", [("tailserve.errors", True)]),
        ("from .. import request\n", [("tailserve.request", True)]),
    ],
)
def test_import_reader(tmp_path: Path, source: str, expected: list[tuple[str, bool]]) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    known = set(_module_files())
    module = "tailserve.kv.m" if "from .." in source else "tailserve.m"
    got = [(i.target, i.runtime) for i in _imports_of(module, path, known)]
    assert got == expected
