"""The table specs of conf/experiment/*.yaml: each validates, each experiment that trains draws
its figure, and every key a figure reads is one a real run writes (tiny runs of both tasks)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from uqbench.configs import group_options
from uqbench.report.building import has_path
from uqbench.report.validation import check_results, with_defaults
from uqbench.runner.cli import run

EXPERIMENTS = group_options("experiment")


@pytest.fixture(scope="module")
def specs(cfg) -> dict[str, tuple[dict, str | None]]:
    """{experiment: (its composed table spec, its job)} for every experiment with a table."""
    out = {}
    for exp in EXPERIMENTS:
        c = cfg(f"experiment={exp}")
        if c.get("table"):
            out[exp] = (OmegaConf.to_container(c.table, resolve=True), c.get("job"))
    return out


def _figures(spec: dict) -> dict[str, dict]:
    return ({"": spec["figure"]} if spec.get("figure") else {}) | (spec.get("figures") or {})


def test_every_table_spec_validates(specs):
    assert len(specs) >= 18
    for exp, (spec, _) in specs.items():
        check_results({"experiment": exp, "seed": 0, "metrics": {}, "table": spec})


def test_every_experiment_that_trains_draws_the_figure_its_paper_shows(specs):
    """P1: accuracy and ECE against trainable parameters; P2: NLL against them; CIFAR-100-C
    and digits also accuracy against corruption severity (the parameter job has no metrics)."""
    for exp, (spec, job) in specs.items():
        if job == "params":
            assert not _figures(spec), exp
            continue
        figure = spec.get("figure") or {}
        assert figure.get("x") == "params.trainable" and figure.get("xscale") == "log", exp
        wanted = ({"metrics.test/acc", "metrics.test/ece"} if exp.startswith("p1_")
                  else {"metrics.test/nll"} if exp != "p2_calibration" else {"metrics.val/nll"})
        assert wanted <= set(figure["y"]), exp
    for exp in ("p1_cifar100_c", "p1_digits"):
        series = specs[exp][0]["figures"]["severity"]["series"]
        assert series == ["metrics.test/acc"] + [f"metrics.test_c/mean/{s}/acc"
                                                 for s in range(1, 6)], exp


@pytest.fixture(scope="module")
def tiny_results(cfg, tmp_path_factory, one_thread) -> dict[str, dict]:
    """results.json of one tiny run per task: SVE on digits (five corruption severities) and
    the BNN on the polynomial."""
    root = tmp_path_factory.mktemp("runs")
    common = [f"paths.runs_dir={root}", f"paths.cache_dir={root}/cache", "torch_threads=1",
              "plot=false", "logger=none", "trainer.epochs=1", "trainer.progress=false"]
    out = {}
    for task, overrides in {
        "classification": ["dataset=digits", "backbone=digits_vit_random", "method=sve",
                           "method.members=2", "trainer=p1", "dataset.max_per_split=15",
                           "dataset.corruptions=[contrast]", "dataset.severities=[1,2,3,4,5]"],
        "regression": ["dataset=polynomial", "backbone.width=4", "dataset.n_train=100",
                       "dataset.n_val=50", "dataset.n_test=50", "dataset.n_ood=50"],
    }.items():
        c = cfg(*overrides, *common)
        run(c)
        out[task] = json.loads((root / c.run_subdir / "results.json").read_text())
    return out


def test_every_figure_key_is_one_a_real_run_writes(specs, tiny_results):
    """... or a row key with a ``default``, which the tables fill in as they read the run
    (``job``: a training run's results have none)."""
    for exp, (spec, _) in specs.items():
        results = with_defaults(
            tiny_results["classification" if exp.startswith("p1_") else "regression"], spec)
        for name, figure in _figures(spec).items():
            keys = [figure.get("x"), *(figure.get("y") or []), *(figure.get("series") or [])]
            for group in ("hue", "facet"):
                value = figure.get(group)
                keys += value if isinstance(value, list) else [value]
            for key in filter(None, keys):
                assert has_path(results, key), f"{exp} figure '{name}' reads {key}, which a run " \
                                           f"does not write"
