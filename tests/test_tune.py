"""The Optuna sweeper preset (hydra/sweeper=tune) and the validation objective the runner
returns to it (uqbench.runner.objective)."""

from __future__ import annotations

import json

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers import run_cli
from uqbench.runner import objective
from uqbench.runner.spec import check_config
from uqbench.tasks.classification import ClassificationTask
from uqbench.tasks.regression import RegressionTask

# two tiny BNN trials on the polynomial data (a few seconds each)
TINY = ("-m", "hydra/sweeper=tune", "hydra.sweeper.n_trials=2", "trainer.epochs=2",
        "trainer.progress=false", "dataset.n_train=64", "dataset.n_val=32", "dataset.n_test=32",
        "dataset.n_ood=32", "backbone.width=4", "method.check_samples=0", "plot=false",
        "save_predictions=false", "torch_threads=1")


@pytest.mark.parametrize(("method", "knob"), [("bnn", "method.rho_init"),
                                              ("sve_split", "method.sigma_init"),
                                              ("mc_dropout_t4", "method.p"),
                                              ("deep_ensemble", None)])
def test_the_search_space_is_the_lr_and_the_methods_own_knob(compose_cfg, method, knob):
    cfg = compose_cfg(["hydra/sweeper=tune", f"method={method}", "seed=7"],
                      return_hydra_config=True)
    params = dict(cfg.hydra.sweeper.params)
    assert params.pop("eval_splits") == "[val]"  # fixed: a trial scores validation only
    assert set(params) == {"trainer.optimizer.lr", *([knob] if knob else [])}
    assert params["trainer.optimizer.lr"] == "tag(log, interval(1e-4, 1e-1))"
    for key in params:  # every tuned key is an option of the composed run config
        assert isinstance(OmegaConf.select(cfg, key), float), key
    sweeper = instantiate(cfg.hydra.sweeper)
    assert type(sweeper).__name__ == "OptunaSweeper"
    assert (cfg.hydra.sweeper.direction, cfg.hydra.sweeper.sampler.seed) == ("minimize", 7)


@pytest.mark.slow
def test_two_trials_write_their_runs_and_the_best_is_the_lowest_val_nll(tmp_path):
    run_cli(*TINY, f"paths.runs_dir={tmp_path}")
    runs = sorted(tmp_path.glob("default/polynomial/**/results.json"))
    assert len(runs) == 2, runs
    found = [json.loads(p.read_text()) for p in runs]
    sweep, = (tmp_path / ".sweeps").iterdir()
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    lowest = min(found, key=lambda r: r["metrics"]["val/nll"])
    assert best["best_value"] == lowest["metrics"]["val/nll"]
    # the best parameters are that run's settings
    assert best["best_params"]["method.rho_init"] == lowest["settings"]["method"]["rho_init"]
    assert best["best_params"]["trainer.optimizer.lr"] == pytest.approx(
        lowest["settings"]["trainer"]["optimizer"]["lr"])
    assert len({r["settings"]["method"]["rho_init"] for r in found}) == 2  # two trials, not one
    for r in found:  # selection runs: validation scored, test never
        assert r["eval_splits"] == ["val"]
        assert not [k for k in r["metrics"] if not k.startswith("val/")], r["metrics"]

    # again with skip_existing: the seeded sampler proposes the same two trials, whose runs
    # answer from their results.json without training (the files stay as they were)
    before = {p: p.read_bytes() for p in runs}
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "skip_existing=true")
    assert sorted(tmp_path.glob("default/polynomial/**/results.json")) == runs
    assert all(p.read_bytes() == b for p, b in before.items())
    again = [p for p in (tmp_path / ".sweeps").iterdir() if p != sweep]
    assert yaml.safe_load((again[0] / "optimization_results.yaml").read_text()) == best


# --- the objective: checked before training, read after --------------------------------------

@pytest.fixture
def in_sweep(compose_cfg):
    """``in_sweep(direction)`` makes this process a job of a hydra/sweeper=tune sweep that
    minimises or maximises (call it after composing: composing clears Hydra's job config)."""
    cfg = compose_cfg(["hydra/sweeper=tune"], return_hydra_config=True)

    def enter(direction: str = "minimize") -> None:
        OmegaConf.set_readonly(cfg.hydra, False)  # set_config makes it read-only
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.sweeper.direction = direction
        HydraConfig.instance().set_config(cfg)

    yield enter
    HydraConfig.instance().cfg = None


def test_only_a_sweeper_that_reads_the_objective_has_a_direction(compose_cfg, in_sweep):
    in_sweep("maximize")
    assert objective.sweeper_direction() == "maximize"
    basic = compose_cfg([], return_hydra_config=True)  # hydra's basic (grid) sweeper
    basic.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(basic)
    assert objective.sweeper_direction() is None
    HydraConfig.instance().cfg = None
    assert objective.sweeper_direction() is None  # no Hydra at all


def test_an_objective_the_task_does_not_compute_is_refused_naming_the_valid_ones(compose_cfg):
    cfg = compose_cfg(["objective=val/accuracy"])
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    message = str(err.value)
    assert "'val/accuracy'" in message and "regression" in message
    for valid in ("val/nll", "val/rmse", "val/coverage_2sigma"):
        assert valid in message
    check_config(compose_cfg(["objective=null"]))  # none: nothing to check
    check_config(compose_cfg(["objective=val/rmse"]))


def test_a_direction_against_the_metric_is_refused_before_training(compose_cfg, in_sweep):
    accuracy = compose_cfg(["dataset=fake_images", "backbone=tiny_vit", "method=single",
                            "objective=val/ts/acc", "eval_splits=[val]"])
    nll = compose_cfg(["objective=val/nll", "eval_splits=[val]"])
    in_sweep("minimize")
    with pytest.raises(ValueError, match="hydra.sweeper.direction=maximize"):
        check_config(accuracy)
    check_config(nll)
    in_sweep("maximize")
    check_config(accuracy)
    with pytest.raises(ValueError, match="hydra.sweeper.direction=minimize"):
        check_config(nll)


@pytest.mark.parametrize("splits", [None, ["val", "test"], ["test"]])
def test_a_trial_that_would_score_test_is_refused_before_training(compose_cfg, in_sweep,
                                                                   splits):
    override = "eval_splits=null" if splits is None else f"eval_splits=[{','.join(splits)}]"
    cfg = compose_cfg(["objective=val/nll", override])
    in_sweep()
    with pytest.raises(ValueError, match=r"eval_splits=.*validation split only"):
        check_config(cfg)
    HydraConfig.instance().cfg = None
    check_config(cfg)  # a single run scores what it is told


def test_a_sweep_needs_a_validation_split(in_sweep):
    class NoVal:
        has_val = False

    in_sweep()
    with pytest.raises(ValueError, match="dataset 'sst2' has no validation split"):
        objective.check_split("val/nll", NoVal(), "sst2")
    objective.check_split(None, NoVal(), "sst2")
    HydraConfig.instance().cfg = None
    objective.check_split("val/nll", NoVal(), "sst2")  # a single run simply has none


def test_the_value_is_read_from_the_metrics_and_a_missing_one_lists_the_runs(in_sweep):
    in_sweep()
    results = {"run": "a/b/seed0", "metrics": {"val/nll": 0.25, "val/rmse": 0.5,
                                               "test/nll": 0.1}}
    assert objective.value("val/nll", results) == 0.25
    assert objective.value(None, results) is None
    with pytest.raises(ValueError) as err:
        objective.value("val/ece", results)
    assert "val/nll, val/rmse" in str(err.value) and "test/nll" not in str(err.value)
    HydraConfig.instance().cfg = None
    assert objective.value("val/ece", results) is None  # a single run returns nothing


def test_the_declared_metric_names_are_the_ones_the_tasks_compute():
    import numpy as np

    rng = np.random.default_rng(0)
    y = rng.normal(size=(20, 1)).astype(np.float32)
    preds = {"y": y, "mean": y + 0.1, "var": np.ones_like(y),
             "noise_std": np.full_like(y, 0.3)}
    task = RegressionTask()
    assert sorted(task.metrics("val", preds)) == sorted(task.metric_names("val"))
    probs = rng.dirichlet(np.ones(3), size=(2, 20)).astype(np.float32)  # (M, N, C)
    task = ClassificationTask()
    cls = {"member_probs": probs, "labels": rng.integers(0, 3, 20)}
    assert sorted(task.metrics("val", cls, {"temperature": 1.5})) == sorted(
        task.metric_names("val"))


def test_the_objective_is_not_part_of_a_runs_identity(compose_cfg):
    """Choosing what a sweeper reads changes no result: same folder, same stored run."""
    from uqbench.configs import identity_overrides
    from uqbench.identity import differences

    a = compose_cfg(["objective=val/nll"])
    b = compose_cfg(["objective=val/rmse"])
    assert differences(OmegaConf.to_container(a, resolve=True),
                       OmegaConf.to_container(b, resolve=True)) == []
    assert identity_overrides(["objective=val/rmse", "seed=1", "trainer.epochs=3"], b) == [
        "trainer.epochs=3"]
