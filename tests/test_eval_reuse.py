"""A scoring job (``job=eval``) keeps a stored scoring only where it is the same configuration.

The eval folder's name shows only the options the command named, so a scoring stored before a
scoring option's default changed would sit in the folder today's command writes; skip_existing
must not pass it off as today's, and nothing stored may be lost without overwrite=true."""

from __future__ import annotations

import json

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import run_cli
from uqbench.records.runfolder import ConfigMismatchError, RunExistsError
from uqbench.runner.jobs.score import _kept

CONFIG = {"job": "eval", "seed": 0, "eval_splits": ["test"],
          "method": {"variance": "learned", "covariance": "mixture", "mixture_modes": 2,
                     "mixture_nodes": 8, "mixture_link_nodes": 8}}


def _stored(out, config) -> dict:
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    results = {"job": "eval", "metrics": {"test/nll": 0.5}}
    (out / "results.json").write_text(json.dumps(results))
    return results


def _flags(overwrite=False, skip_existing=False):
    return OmegaConf.create({"overwrite": overwrite, "skip_existing": skip_existing})


def test_the_same_configuration_is_kept_or_refused_as_before(tmp_path):
    out = tmp_path / "eval" / "polynomial"
    assert _kept(_flags(skip_existing=True), out, CONFIG) is None  # nothing stored: score
    results = _stored(out, CONFIG)
    assert _kept(_flags(skip_existing=True), out, CONFIG) == results
    with pytest.raises(RunExistsError, match="overwrite=true replaces it"):
        _kept(_flags(), out, CONFIG)
    assert _kept(_flags(overwrite=True), out, CONFIG) is None  # score again, replace


def test_a_scoring_from_before_a_default_changed_is_refused_naming_the_difference(tmp_path):
    out = tmp_path / "eval" / "polynomial"
    old = {**CONFIG, "method": {k: v for k, v in CONFIG["method"].items()
                                if k != "mixture_link_nodes"}}  # stored before the split
    _stored(out, old)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for flags in (_flags(skip_existing=True), _flags()):
        with pytest.raises(ConfigMismatchError) as refused:
            _kept(flags, out, CONFIG)
        message = str(refused.value)
        assert "method.mixture_link_nodes: '<absent>' (stored) → 8 (requested)" in message
        assert "overwrite=true" in message and str(out) in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    assert _kept(_flags(overwrite=True, skip_existing=True), out, CONFIG) is None
    # the same old scoring is today's with the split off: kept
    today_off = {**CONFIG, "method": {**CONFIG["method"], "mixture_link_nodes": 0}}
    assert _kept(_flags(skip_existing=True), out, today_off)["metrics"] == {"test/nll": 0.5}


def test_an_unreadable_stored_config_is_refused_not_kept(tmp_path):
    out = tmp_path / "eval" / "polynomial"
    _stored(out, CONFIG)
    (out / "config.yaml").write_text("{not yaml")
    with pytest.raises(ConfigMismatchError, match="config.yaml is missing or unreadable"):
        _kept(_flags(skip_existing=True), out, CONFIG)


@pytest.mark.slow  # four CLI runs
def test_a_stale_mixture_scoring_is_refused_by_the_cli_and_overwrite_scores_it_again(tmp_path):
    """End to end on a real scoring: the command that wrote it keeps it with skip_existing
    (no spurious difference), the same folder with the older config is refused before any work
    and left as it was, and overwrite=true scores it again with today's split."""
    tiny = ["trainer.progress=false", "dataset.n_train=200", "dataset.n_val=50",
            "dataset.n_test=100", "dataset.n_ood=100", "plot=false", "device=cpu",
            "logger=none", f"paths.runs_dir={tmp_path}"]
    run_cli(*tiny, "trainer.epochs=1", "backbone.depth=2", "backbone.width=4",
            "method.variance=learned", "run_name=lrn")
    run = tmp_path / "lrn"
    score = ["job=eval", f"eval_run={run}", *tiny, "method.covariance=mixture",
             "method.check_samples=200", "eval_splits=[test]"]
    run_cli(*score)
    # named by the scoring options the command changed
    [out] = [p.parent for p in (run / "eval").glob("*/results.json")]
    assert "method.covariance=mixture" in out.name
    first = (out / "results.json").read_bytes()
    assert json.loads(first)["settings"]["method"]["mixture_link_nodes"] == 8
    kept = run_cli(*score, "skip_existing=true")
    assert "another configuration" not in kept.stderr
    assert (out / "results.json").read_bytes() == first

    config = yaml.safe_load((out / "config.yaml").read_text())
    del config["method"]["mixture_link_nodes"]  # as a scoring stored before the split
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    def kept_files():  # the job's log is appended to, as every job's (the refusal is in it)
        return {p.name: p.read_bytes() for p in out.iterdir()
                if p.is_file() and p.name != "uqbench.log"}

    stale = kept_files()
    refused = run_cli(*score, "skip_existing=true", check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "method.mixture_link_nodes: '<absent>' (stored) → 8 (requested)" in refused.stderr
    assert kept_files() == stale and {"results.json", "config.yaml"} <= set(stale)

    run_cli(*score, "overwrite=true")
    again = yaml.safe_load((out / "config.yaml").read_text())
    assert again["method"]["mixture_link_nodes"] == 8
