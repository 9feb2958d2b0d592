"""The runs an experiment's sweep asks for, which have finished, and the command for the rest.

``python -m uqbench.report.sweeps p1_flowers102 p1_sst2 …`` (``make p1-tables``) expands each
experiment's ``hydra.sweeper.params`` exactly as Hydra's basic sweeper does, composes every job's
config to find its run folder, reports done/missing, and builds the tables of the experiments
that have results. Reading a run's results never goes beyond its results.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from uqbench.configs import group_options
from uqbench.errors import user_errors

P1_EXPERIMENTS = ("p1_overhead", "p1_flowers102", "p1_oxford_pets", "p1_dtd", "p1_sst2",
                  "p1_arc_easy", "p1_cifar100", "p1_cifar100_c", "p1_backbone_ablation",
                  "p1_ensemble_size")


def _compose(overrides: list[str], *keys: str) -> list:
    """The values of ``keys`` in the job config as the CLI would resolve them: with Hydra's
    node set, since the run folder's name depends on the job's overrides."""
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        return [OmegaConf.select(cfg, key) for key in keys]
    finally:
        HydraConfig.instance().cfg = None  # leave no job behind for later composes


def sweep_jobs(experiment: str) -> list[list[str]]:
    """The override list of every job of the experiment's sweep (one [] when it sweeps none)."""
    params = _compose([f"experiment={experiment}"], "hydra.sweeper.params")[0] or {}
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    axes = [[f"{o.key_or_group}={v}" for v in (o.sweep_string_iterator()
                                               if o.is_sweep_override() else [o.value()])]
            for o in parsed]
    return [list(job) for job in itertools.product(*axes)]


def expected_runs(experiment: str, runs_dir: Path) -> list[tuple[list[str], Path]]:
    """(overrides, run folder) of every job the experiment's sweep would run."""
    jobs = []
    for job in sweep_jobs(experiment):
        run_dir = _compose([f"experiment={experiment}", *job, f"paths.runs_dir={runs_dir}"],
                           "run_dir")[0]
        jobs.append((job, Path(run_dir)))
    return jobs


def report(experiment: str, runs_dir: Path) -> tuple[int, int]:
    """Print done/expected and the missing runs with the command that makes one; return both."""
    jobs = expected_runs(experiment, runs_dir)
    missing = [(job, path) for job, path in jobs if not (path / "results.json").is_file()]
    print(f"{experiment}: {len(jobs) - len(missing)}/{len(jobs)} runs done")
    for job, path in missing[:3]:
        print(f"  missing {path}\n    ← uqbench experiment={experiment} {' '.join(job)}")
    if len(missing) > 3:
        print(f"  … and {len(missing) - 3} more; `uqbench experiment={experiment} "
              f"skip_existing=true` runs the sweep and keeps the finished runs")
    return len(jobs) - len(missing), len(jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="uqbench-sweeps",
        description="Which runs of an experiment's sweep exist; build the tables of those that "
                    "have results.")
    parser.add_argument("experiments", nargs="*", default=list(P1_EXPERIMENTS),
                        help="experiments (default: every P1 table)")
    parser.add_argument("--runs", type=Path,
                        default=Path(os.environ.get("UQBENCH_RUNS") or "runs"))
    parser.add_argument("--tables", type=Path, default=None,
                        help="also build the tables of experiments with results into this folder")
    args = parser.parse_args(argv)
    with user_errors():
        unknown = [e for e in args.experiments if e not in group_options("experiment")]
        if unknown:
            raise ValueError(f"unknown experiment(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(group_options('experiment'))}")
        with_results = [e for e in args.experiments if report(e, args.runs)[0] > 0]
        if args.tables is not None and with_results:
            from uqbench.report.tables import write_tables

            for path in write_tables(args.runs, args.tables, with_results).values():
                print(f"→ {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
