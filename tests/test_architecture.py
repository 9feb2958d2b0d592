"""The import graph keeps uqbench's layers apart (imports inside functions included).

The package's folders are its layers::

    runner/   the CLI and its jobs: builds backbone, method and dataset, trains, scores
    records/  what a job leaves: the run folder transaction, results.json, the trackers
    report/   results files → tables, claims, sweeps' progress, selection
    methods/ backbones/ data/ tasks/   the parts a run composes
    metrics/  every metric, pure functions of predictions and targets
    bench/    speed and memory beside the anchors

``runner → records``, ``runner → methods / backbones / data → tasks → metrics``; reports read
results files only, never the runner or the parts; the leaves (``contracts``, ``identity``,
``errors``, and the ``metrics`` package, whose modules lean only on each other) import nothing
of ours, so every layer can lean on them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "uqbench"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    """Every uqbench module ``path`` imports, at any depth of the file (functions included);
    ``runtime_only`` leaves out the type-only imports under ``if TYPE_CHECKING:``."""
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if runtime_only and _is_type_checking(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from uqbench import metrics` imports the submodule uqbench.metrics
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                     else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "uqbench" or n.startswith("uqbench."))
    return found - {"uqbench"}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}
RUNTIME = {name: _imports(path, runtime_only=True) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


TOP_LEVEL = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
LAYERS = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} - {"conf"}


def _importers(forbidden: set[str], of: set[str]) -> list[str]:
    """'a → b' for every module of layers ``of`` importing a module of layers ``forbidden``."""
    return [f"{m} → {i}" for m, imports in GRAPH.items() if _layer(m) in of
            for i in sorted(imports) if _layer(i) in forbidden]


def test_the_walk_sees_the_package():
    assert {"uqbench.runner.cli", "uqbench.contracts", "uqbench.methods.sve", "uqbench.data.cifar",
            "uqbench.tasks.classification", "uqbench.metrics"} <= set(MODULES)
    assert "uqbench.contracts" in GRAPH["uqbench.methods.base"]  # a known edge is found
    assert "uqbench.metrics" in GRAPH["uqbench.tasks.classification"]  # `from uqbench import`


def test_the_tree_shows_the_layers():
    """A handful of shared leaves at the top level; everything else lives in its layer."""
    assert TOP_LEVEL == {"contracts", "configs", "errors", "identity"}
    assert LAYERS == {"runner", "records", "report", "methods", "backbones", "data", "tasks",
                      "metrics", "bench"}


LONG_FILE = 350


def test_long_files_say_why_at_their_top():
    """A module past ~350 lines states at its top why it is one file (the word "Longer")."""
    unexplained = [name for name, path in MODULES.items()
                   if len(path.read_text().splitlines()) > LONG_FILE
                   and "Longer" not in (ast.get_docstring(ast.parse(path.read_text())) or "")]
    assert unexplained == []


@pytest.mark.parametrize("module", ["contracts", "errors", "identity",
                                    "runner.engine.checkpoints", "runner.engine.fsdp",
                                    "records.loggers", "report.claims"])
def test_leaf_modules_import_nothing_of_the_project(module):
    assert GRAPH[f"uqbench.{module}"] == set()


def test_the_metrics_are_one_package_that_leans_on_nothing_else():
    """Every metric lives in uqbench/metrics/ (none in the tasks, which choose and call them),
    and its modules import only each other."""
    metrics = {m for m in MODULES if _layer(m) == "metrics"}
    assert {"uqbench.metrics.conformal", "uqbench.metrics.calibration"} <= metrics
    assert [f"{m} → {i}" for m in metrics for i in sorted(GRAPH[m])
            if _layer(i) != "metrics"] == []
    assert not [m for m in MODULES if _layer(m) == "tasks" and "conformal" in m]


def test_configs_lean_only_on_the_identity_and_the_error_kinds():
    assert GRAPH["uqbench.configs"] <= {"uqbench.identity", "uqbench.errors"}


def test_records_lean_only_on_records_and_the_identity():
    assert _importers(LAYERS - {"records"} | {"configs", "contracts", "metrics"},
                      of={"records"}) == []


def test_reports_read_results_files_not_the_runner_or_the_parts():
    """Tables read results files of any version and any user: reports lean on each other, the
    records (the tracker they can publish to) and the config store (what a sweep asks for)."""
    assert _importers(LAYERS - {"report", "records"} | {"contracts", "metrics"},
                      of={"report"}) == []


def test_nothing_outside_the_runner_imports_it():
    assert [f"{m} → {i}" for m, imports in GRAPH.items() if _layer(m) != "runner"
            for i in sorted(imports) if _layer(i) == "runner"] == []


def test_the_parts_never_import_the_runner_records_reports_or_bench():
    assert _importers({"runner", "records", "report", "bench"},
                      of={"methods", "backbones", "data", "tasks"}) == []


def test_data_never_imports_methods_or_backbones():
    assert _importers({"methods", "backbones"}, of={"data"}) == []


def test_methods_never_import_data_or_tasks():
    assert _importers({"data", "tasks"}, of={"methods"}) == []


def test_tasks_build_only_on_contracts_and_metrics():
    allowed = {"tasks", "contracts", "metrics"}
    assert [f"{m} → {i}" for m in GRAPH if _layer(m) == "tasks"
            for i in GRAPH[m] if _layer(i) not in allowed] == []


GROUPS = ("backbone", "method", "dataset")


def test_only_the_runner_composes_backbone_method_and_dataset():
    """Only the runner's jobs import both methods and data at run time (the training loop
    names their types under TYPE_CHECKING), and only the runner's jobs and the benchmark
    (which builds methods exactly as a run does) build the backbone, method and dataset
    configs."""
    composers = {m for m, imports in RUNTIME.items()
                 if {"methods", "data"} <= {_layer(i) for i in imports}}
    assert {_layer(m) for m in composers} <= {"runner"}
    builders = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            by_config = (func in ("build", "instantiate") and node.args
                         and any(f"cfg.{g}" in ast.unparse(node.args[0]) for g in GROUPS))
            by_spec = any(func.endswith(f".{g}.build") for g in GROUPS)  # spec.method.build()
            if by_config or by_spec:
                builders.add(name)
    assert {_layer(m) for m in builders} == {"runner", "bench"}
    assert builders & {"uqbench.runner.jobs.params", "uqbench.bench.ensembles"}


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for nxt in sorted(GRAPH.get(module, ())):
            if state.get(nxt) == 1:
                return path + [module, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [module])):
                return cycle
        state[module] = 2
        return None

    for module in GRAPH:
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_engine_builds_on_nothing_but_its_fsdp_strategy():
    assert GRAPH["uqbench.runner.engine.fabric"] <= {"uqbench.runner.engine.fsdp"}


def test_the_engine_knows_no_job_and_one_table_says_what_job_runs():
    """uqbench/runner/engine/ (loop, precision, FSDP, checkpoints) imports no job; the jobs,
    one module each, sit apart in uqbench/runner/jobs/, and ``job=`` is read only through its
    one dispatch table (uqbench.runner.jobs.job_of)."""
    engine = {m for m in GRAPH if m.startswith("uqbench.runner.engine.")}
    assert engine and all(not any(d.startswith("uqbench.runner.jobs") for d in GRAPH[m])
                          for m in engine)
    jobs = {m for m in GRAPH if m.startswith("uqbench.runner.jobs.")}
    assert {"uqbench.runner.jobs.train", "uqbench.runner.jobs.score",
            "uqbench.runner.jobs.params"} <= jobs
    root = Path(__file__).resolve().parents[1] / "uqbench"
    reads = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if re.search(r"""cfg\.get\(["']job["']|cfg\.job\b""", p.read_text()))
    assert reads == ["runner/jobs/__init__.py"], reads


def test_no_two_modules_share_a_name_but_the_packages_base_classes():
    """A module's name says what it does: none repeats across packages, but each package's
    ``base.py`` (its base classes) and ``__init__.py``."""
    root = Path(__file__).resolve().parents[1] / "uqbench"
    names: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(root)))
    repeated = {n: p for n, p in names.items() if len(p) > 1 and n not in ("__init__.py",
                                                                           "base.py")}
    assert repeated == {}


def test_below_the_entry_point_the_runner_takes_its_spec_not_the_config():
    """The Hydra main makes the config a RunSpec once (uqbench.runner.spec); no function of a
    job, of what the jobs share or of the engine takes a DictConfig. The two that do read one
    before any spec exists: the dispatch table's ``job_of`` (the spec's ``job`` is its
    answer) and the resolver Hydra calls for a scoring's log folder, which makes a spec."""
    allowed = {("uqbench.runner.jobs", "job_of"), ("uqbench.runner.jobs.score", "_log_dir")}
    takers = set()
    for name, path in MODULES.items():
        if not name.startswith(("uqbench.runner.jobs", "uqbench.runner.engine",
                                "uqbench.runner.parts", "uqbench.runner.objective")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.annotation is not None and "DictConfig" in ast.unparse(a.annotation)
                       for a in args):
                    takers.add((name, node.name))
    assert takers == allowed, sorted(takers - allowed)
