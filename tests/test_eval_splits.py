"""``eval_splits``: a run scores (and predicts) only the splits it lists, checked against the
dataset before training, recorded in results.json and part of the run's identity; a training
job and a scoring job (``job=eval``) alike."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tests.helpers import run_cli
from uqbench.configs import identity_overrides
from uqbench.identity import differences
from uqbench.runner.engine.evaluation import chosen_splits
from uqbench.runner.spec import check_eval_splits

FAST = ["backbone=tiny_vit", "dataset=fake_images", "method=single", "trainer.epochs=1",
        "trainer.progress=false", "logger=none", "plot=false", "torch_threads=1"]


def _data(task: str = "classification", val: bool = True) -> SimpleNamespace:
    return SimpleNamespace(name="toy", task=task, has_val=val, eval_splits=("test", "test_c/a/1"),
                           ood_splits=("ood",))


def test_null_keeps_every_split_and_a_list_keeps_those_listed_in_the_data_order():
    every = chosen_splits(_data(), None)
    assert every.predicted == ["test", "test_c/a/1", "ood", "val"] and every.every
    some = chosen_splits(_data(), ["val", "test_c/a/1"])
    assert (some.eval, some.ood, some.val, some.every) == (("test_c/a/1",), (), True, False)
    assert some.predicted == ["test_c/a/1", "val"] and some.cost_split == "test_c/a/1"
    assert chosen_splits(_data(), ["val"]).cost_split == "val"  # no test input is read


def test_a_name_the_dataset_lacks_is_refused_with_the_valid_choices():
    with pytest.raises(ValueError, match=r"'tset' is not a split of dataset 'toy'; choose "
                                         r"from: val, test, test_c/a/1, ood"):
        chosen_splits(_data(), ["val", "tset"])
    with pytest.raises(ValueError, match=r"'val' is not a split of dataset 'toy'; choose "
                                         r"from: test, test_c/a/1, ood"):
        chosen_splits(_data(val=False), ["val"])


def test_classification_ood_needs_its_test_split_and_regression_ood_does_not():
    with pytest.raises(ValueError, match="'test', which the list leaves out; add test"):
        chosen_splits(_data(), ["ood", "val"])
    assert chosen_splits(_data("regression"), ["ood"]).ood == ("ood",)


@pytest.mark.parametrize("value", ["val", [], ["val", 3], [""]])
def test_eval_splits_must_be_null_or_a_list_of_names(value):
    with pytest.raises(ValueError, match="eval_splits must be null .* or a non-empty list"):
        check_eval_splits(OmegaConf.create({"v": value}).v)
    check_eval_splits(None)
    check_eval_splits(OmegaConf.create({"v": ["val"]}).v)


def test_a_bad_name_is_refused_by_the_cli_before_anything_is_written(tmp_path):
    proc = run_cli(*FAST, "eval_splits=[val,tset]", f"paths.runs_dir={tmp_path}", check=False)
    assert proc.returncode == 1
    assert ("error: eval_splits=['val', 'tset']: 'tset' is not a split of dataset "
            "'fake_images'; choose from: val, test, ood") in proc.stderr
    assert not list(tmp_path.rglob("results.json")) and not list(tmp_path.rglob("*.ckpt"))


def test_the_names_are_checked_once_the_data_is_set_up_before_the_model_is_built(
        compose_cfg, monkeypatch):
    import torch

    from uqbench.methods.single import Single
    from uqbench.runner.parts import build_parts
    from uqbench.runner.spec import RunSpec

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    bad, good = (RunSpec.of(compose_cfg([*FAST, f"eval_splits=[{s}]"])) for s in ("tset", "val"))
    monkeypatch.setattr(Single, "__init__", built)
    with pytest.raises(ValueError, match="'tset' is not a split of dataset 'fake_images'"):
        build_parts(bad, torch.device("cpu"))
    with pytest.raises(AssertionError, match="the model was built"):  # a good name gets there
        build_parts(good, torch.device("cpu"))


def _resolved(compose_cfg, overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose_cfg(overrides), resolve=True)


def test_runs_differing_only_in_eval_splits_are_not_the_same_run(compose_cfg):
    every = _resolved(compose_cfg, [])
    val_only = _resolved(compose_cfg, ["eval_splits=[val]"])
    assert differences(every, val_only) == ["eval_splits: None (stored) → ['val'] (requested)"]
    older = {k: v for k, v in every.items() if k != "eval_splits"}  # stored before the key
    assert differences(older, every) == []
    assert identity_overrides(["eval_splits=[val]"], compose_cfg(["eval_splits=[val]"])) == [
        "eval_splits=[val]"]  # its own run folder


@pytest.mark.slow
def test_a_training_run_and_a_scoring_of_it_keep_to_their_splits(tmp_path):
    """A run restricted to test and val (no OOD), then scored again on val alone (job=eval):
    each holds the metrics and predictions of its own splits only, and records the list."""
    run = tmp_path / "run"
    run_cli(*FAST, "eval_splits=[test,val]", f"run_name={run.name}", f"paths.runs_dir={tmp_path}")
    res = json.loads((run / "results.json").read_text())
    assert res["eval_splits"] == ["test", "val"]
    assert {k.split("/")[0] for k in res["metrics"]} == {"test", "val"}
    assert sorted(p.name for p in (run / "predictions").iterdir()) == ["test.npz", "val.npz"]
    run_cli("job=eval", f"eval_run={run}", "eval_splits=[val]", "logger=none", "torch_threads=1",
            f"paths.runs_dir={tmp_path}")
    scored = run / "eval" / "fake_images,eval_splits=[val]"
    res = json.loads((scored / "results.json").read_text())
    assert res["eval_splits"] == ["val"] and res["metrics"]
    assert all(k.startswith("val/") for k in res["metrics"])
    assert sorted(p.name for p in (scored / "predictions").iterdir()) == ["val.npz"]


def test_a_scoring_jobs_hydra_folder_is_its_own_eval_folder(compose_cfg, tmp_path):
    """Hydra's job folder (its log's) for job=eval, in a single run and in a sweep: the
    scoring's own folder under the scored run, named like its results (the dataset and the
    scoring options the command set), not the run folder the default config names; a training
    job's is its run folder, and a scoring of no finished run falls back to it (the job then
    refuses with its own message)."""
    import os
    from pathlib import Path

    import yaml
    from hydra.core.hydra_config import HydraConfig

    run = tmp_path / "scored"
    run.mkdir()
    stored = compose_cfg(["method=bnn", "dataset=polynomial", f"paths.runs_dir={tmp_path}"])
    (run / "config.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(stored, resolve=True)))
    (run / "results.json").write_text("{}")

    def folders(*overrides: str) -> tuple[Path, Path, Path]:
        cfg = compose_cfg([*overrides, f"paths.runs_dir={tmp_path / 'runs'}"],
                          return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            return (Path(str(cfg.hydra.run.dir)),
                    Path(os.path.normpath(Path(str(cfg.hydra.sweep.dir))
                                          / str(cfg.hydra.sweep.subdir))),
                    Path(str(cfg.run_dir)))
        finally:
            HydraConfig.instance().cfg = None

    single, swept, _ = folders("job=eval", f"eval_run={run}", "method.covariance=full",
                               "eval_splits=[test]")
    expected = run / "eval" / "polynomial,method.covariance=full,eval_splits=[test]"
    assert single == swept == expected
    single, swept, run_dir = folders("job=eval", f"eval_run={tmp_path / 'missing'}")
    assert single == swept == Path(os.path.normpath(run_dir))
    single, swept, run_dir = folders("method=bnn")
    assert single == swept == Path(os.path.normpath(run_dir))
