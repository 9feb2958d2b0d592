"""Run identity: every override that changes a result changes the run folder."""

from __future__ import annotations

from tests.helpers import run_cli
from uqbench.configs import identity_overrides


def test_identity_keeps_result_changing_overrides_only(compose_cfg):
    root = compose_cfg(["method.variance=learned"])  # name: bnn_${method.variance}
    overrides = ["trainer.optimizer.lr=0.01", "seed=3", "skip_existing=true", "device=cpu",
                 "paths.runs_dir=/tmp/x", "logger=wandb", "logger.mode=offline",
                 "trainer.progress=false", "hydra/launcher=joblib", "method.variance=learned",
                 "backbone.width=8", "dataset.n_train=100", "torch_threads=1", "run_name=x"]
    # backbone.width and method.variance are shown by the names mlp_w8 and bnn_learned
    assert identity_overrides(overrides, root) == ["dataset.n_train=100",
                                                   "trainer.optimizer.lr=0.01"]


def test_a_learning_rate_sweep_gives_one_folder_per_value(tmp_path):
    run_cli("-m", "trainer.optimizer.lr=0.01,0.001", "trainer.epochs=1", "trainer.progress=false",
            "dataset.n_train=100", "dataset.n_val=20", "dataset.n_test=20", "dataset.n_ood=20",
            f"paths.runs_dir={tmp_path}")
    base = tmp_path / "default/polynomial/bnn_embedded/mlp_w16"
    sizes = "dataset.n_ood=20,dataset.n_test=20,dataset.n_train=100,dataset.n_val=20"
    found = sorted(p.parent.parent.name for p in base.rglob("results.json"))
    assert found == [f"{sizes},trainer.epochs=1,trainer.optimizer.lr=0.001",
                     f"{sizes},trainer.epochs=1,trainer.optimizer.lr=0.01"]
    # each sweep keeps its own record: a second sweep does not overwrite the first one's
    run_cli("-m", "trainer.optimizer.lr=0.01,0.001", "trainer.epochs=1", "trainer.progress=false",
            "dataset.n_train=100", "dataset.n_val=20", "dataset.n_test=20", "dataset.n_ood=20",
            "skip_existing=true", f"paths.runs_dir={tmp_path}")
    records = sorted((tmp_path / ".sweeps").glob("default-*/multirun.yaml"))
    assert len(records) == 2 and not (tmp_path / "multirun.yaml").exists()
    assert "skip_existing=true" not in records[0].read_text()
    assert "skip_existing=true" in records[1].read_text()


def test_the_engine_layout_is_bookkeeping_for_both_the_folder_and_the_identity():
    from uqbench import configs
    from uqbench.records import runfolder

    assert configs.ENGINE_LAYOUT == runfolder.ENGINE_LAYOUT
    stored = {"trainer": {"epochs": 3, "optimizer": {"lr": 0.1}}}  # stored before precision
    requested = {"trainer": {"epochs": 3, "optimizer": {"lr": 0.1}, "precision": "32",
                             "devices": 4, "strategy": "ddp", "accumulate": 2}}
    assert runfolder.differences(stored, requested) == []
    requested["trainer"]["precision"] = "bf16-mixed"
    assert runfolder.differences(stored, requested) == [
        "trainer.precision: '<absent>' (stored) → 'bf16-mixed' (requested)"]


def test_speed_options_are_bookkeeping_for_both_the_folder_and_the_identity(compose_cfg):
    from uqbench import configs
    from uqbench.records import runfolder

    assert configs.SPEED_OPTIONS == runfolder.SPEED_OPTIONS
    stored = {"method": {"variance": "embedded"}}  # a BNN run stored before the fast paths
    requested = {"method": {"variance": "embedded", "fused": False, "compile": True}}
    assert runfolder.differences(stored, requested) == []
    overrides = ["method.fused=false", "method.compile=true", "trainer.optimizer.lr=0.01"]
    assert identity_overrides(overrides, compose_cfg(overrides)) == ["trainer.optimizer.lr=0.01"]


def test_mc_dropout_runs_stored_before_the_mask_option_drew_torch_masks():
    from uqbench.records import runfolder

    stored = {"method": {"samples": 4, "p": 0.1}}
    old = {"method": {"samples": 4, "p": 0.1, "masks": "torch"}}
    new = {"method": {"samples": 4, "p": 0.1, "masks": "fast"}}
    assert runfolder.differences(stored, old) == []
    assert runfolder.differences(stored, new) == [
        "method.masks: '<absent>' (stored) → 'fast' (requested)"]
