"""Every config in conf/ composes, resolves and builds (Hydra instantiation is lazy and cheap)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from uqbench.backbones.base import Backbone
from uqbench.configs import build, group_options, options_where, options_with
from uqbench.data.base import DataModule
from uqbench.methods.base import Method
from uqbench.records.loggers import Logger
from uqbench.runner.engine.loop import Trainer
from uqbench.tasks.base import Task

CONF = Path(__file__).resolve().parents[1] / "conf"
BUILT = {"backbone": Backbone, "dataset": DataModule, "trainer": Trainer, "logger": Logger,
         "task": Task}
GROUPS = sorted([*BUILT, "method", "paths"])


def test_group_options_are_the_yaml_files():
    for group in GROUPS:
        assert group_options(group) == sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert {"sve", "svf", "bnn", "lora_ensemble"} <= set(group_options("method"))


def test_options_are_found_by_key_and_by_class_attribute():
    assert options_where("method", "task", "regression") == ["bnn"]
    assert "svf" in options_where("method", "task", "classification")  # through its defaults
    assert options_where("backbone", "modality", "text") == ["bert_base", "llama2_7b", "minilm",
                                                             "tiny_bert", "tiny_llama"]
    assert "mlp" not in options_with("backbone", "targets")
    assert {"tiny_vit", "bert_base", "llama2_7b"} <= set(options_with("backbone", "targets"))


def _check_built(group: str, node) -> None:
    obj = build(node)
    if group == "method":  # methods are partials, completed with (backbone, info) by the runner
        assert isinstance(obj, functools.partial) and issubclass(obj.func, Method)
    else:
        assert isinstance(obj, BUILT[group]), f"{group} built a {type(obj).__name__}"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in group_options(g)])
def test_every_group_option_composes_and_builds(compose_cfg, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved[group] is not None
    if group == "paths":  # plain values, nothing to build
        assert all(isinstance(v, str) and v for v in resolved[group].values())
    elif group == "dataset" and option == "none":  # job=params reads no data
        assert "_target_" not in resolved[group]
    else:
        _check_built(group, cfg[group])


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_every_experiment_composes_and_builds(compose_cfg, experiment):
    cfg = compose_cfg([f"experiment={experiment}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    name = resolved["experiment_name"]
    # its own folder, or (experiment <name>_<part>) the folder and table of experiment <name>
    assert name == experiment or (experiment.startswith(f"{name}_") and name in
                                  group_options("experiment")), (experiment, name)
    assert f"/{name}/" in resolved["run_dir"]
    for group in ("backbone", "method", "trainer", "task", "logger"):
        _check_built(group, cfg[group])
    if "_target_" in cfg.dataset:
        _check_built("dataset", cfg.dataset)


def test_each_dataset_selects_the_task_its_data_declares(compose_cfg):
    for option in group_options("dataset"):
        cfg = compose_cfg([f"dataset={option}"])
        if "_target_" in cfg.dataset:
            assert build(cfg.task).name == build(cfg.dataset).task, option


def test_svf_is_sve_with_one_member(compose_cfg):
    sve, svf = (compose_cfg([f"method={m}"]).method for m in ("sve", "svf"))
    assert svf._target_ == sve._target_ and svf.members == 1 and svf.sigma_init == 0
    assert set(svf) == set(sve)


def test_p1_overhead_uses_p1s_ensemble_size_per_backbone(compose_cfg):
    sizes = {"dino_vits16": 4, "dinov2_vits14": 4, "bert_base": 8, "llama2_7b": 16}
    for backbone, members in sizes.items():  # P1: 4 for ViTs, 8 for BERT-base, 16 for LLaMA
        cfg = compose_cfg(["experiment=p1_overhead", f"backbone={backbone}"])
        assert cfg.method.members == members


def test_method_options_that_differ_have_their_own_run_folders(compose_cfg):
    """Two method configs with different settings never name the same run folder: a sweep over
    both (method=deep_ensemble,deep_ensemble_independent) would otherwise refuse the second as a
    resumed run of the first."""
    seen: dict[str, tuple[str, dict]] = {}
    for option in group_options("method"):
        cfg = compose_cfg([f"method={option}"])
        folder = cfg.run_dir
        settings = OmegaConf.to_container(cfg.method, resolve=True)
        if folder in seen:
            other, other_settings = seen[folder]
            assert settings == other_settings, (
                f"method={option} and method={other} share {folder}")
        seen[folder] = (option, settings)
    assert len(seen) == len(group_options("method"))


def test_run_dir_is_deterministic_and_run_name_replaces_it(compose_cfg):
    cfg = compose_cfg(["backbone.width=8", "method.variance=learned", "seed=2"])
    assert cfg.run_dir == "runs/default/polynomial/bnn_learned/mlp_w8/seed2"
    cfg = compose_cfg(["run_name=my_run"])
    assert cfg.run_dir == "runs/my_run"


@pytest.mark.parametrize("method,lr,weight_decay,batch,epochs", [
    ("sve", 1e-3, 0.05, 16, 10),            # P1's public release
    ("svf", 1e-3, 0.05, 16, 10),
    ("lora_ensemble", 1e-4, 0.0, 32, 10),   # LoRA-Ensemble's official settings
    ("batch_ensemble", 1e-3, 0.05, 16, 10),  # P1's, as SVE (ours)
    ("laplace_lora", 1e-4, 0.0, 32, 10),    # a one-member LoRA-Ensemble's (ours)
    ("map_lora", 1e-4, 0.0, 32, 10),
    ("blob", 1e-4, 0.0, 32, 10),            # LoRA-Ensemble's (ours)
    ("last_layer_laplace", 1e-4, 0.0, 32, 16),  # the single model's
    ("deep_ensemble", 1e-4, 0.0, 32, 16),   # full fine-tuning (LoRA-Ensemble's baselines)
    ("single", 1e-4, 0.0, 32, 16),
    ("mc_dropout", 1e-4, 0.0, 32, 16),
])
def test_p1_experiments_train_each_method_by_its_own_recipe(compose_cfg, method, lr,
                                                            weight_decay, batch, epochs):
    for experiment in ("p1_flowers102", "p1_sst2", "p1_cifar100"):
        trainer = compose_cfg([f"experiment={experiment}", f"method={method}"]).trainer
        assert (trainer.optimizer.lr, trainer.optimizer.weight_decay) == (lr, weight_decay)
        assert (trainer.batch_size, trainer.epochs) == (batch, epochs)
    # an explicit trainer on the command line still wins
    cfg = compose_cfg(["experiment=p1_flowers102", f"method={method}", "trainer=default"])
    assert cfg.trainer.optimizer.lr == 1e-2


def test_the_recipes_batch_size_replaces_the_datasets(compose_cfg, tmp_path):
    from uqbench.runner.cli import run

    cfg = compose_cfg(["backbone=tiny_vit", "dataset=fake_images", "method=single",
                       "trainer=lora_ensemble", "trainer.epochs=0", "plot=false",
                       "device=cpu", f"paths.runs_dir={tmp_path}"])
    assert cfg.dataset.batch_size == 16
    results = run(cfg)
    assert results["settings"]["dataset"]["batch_size"] == 32
    assert "batch_size: 32" in (tmp_path / results["run"] / "config.yaml").read_text()


@pytest.mark.parametrize("method", options_where("method", "task", "classification"))
def test_every_classification_method_has_a_p1_recipe(compose_cfg, method):
    """P1 experiments select trainer=${method}: every ensemble method needs its recipe file."""
    cfg = compose_cfg(["experiment=p1_flowers102", f"method={method}"])
    _check_built("trainer", cfg.trainer)


@pytest.mark.parametrize("setup", group_options("p2_setup"))
def test_every_p2_setup_changes_the_width_sweep_recipe_and_labels_it(compose_cfg, setup):
    cfg = compose_cfg(["experiment=p2_claims", f"+p2_setup={setup}"])
    base = compose_cfg(["experiment=p2_claims", "+p2_setup=default"])
    assert cfg.variant == setup and cfg.experiment_name == "p2_claims"
    assert OmegaConf.select(cfg, "method.name").endswith(f"_{setup}")  # its own run folders
    changed = [k for k in ("method", "dataset", "trainer")
               if OmegaConf.to_container(cfg[k]) != OmegaConf.to_container(base[k])]
    assert bool(changed) == (setup != "default"), changed


def test_the_calibrated_setup_is_the_methods_default(compose_cfg):
    # conf/p2_setup/calibrated.yaml restates the BNN default that p2_calibration chose: the two
    # must not drift apart
    default = compose_cfg(["method=bnn"]).method
    calibrated = compose_cfg(["experiment=p2_width_sweep", "+p2_setup=calibrated"]).method
    for key in ("prior", "prior_std", "kl_scale", "kl_weight", "rho_init"):
        assert calibrated[key] == default[key], key
    full = compose_cfg(["experiment=p2_width_sweep"]).method  # the paper's full ELBO
    assert (full.prior, full.prior_std, full.kl_scale) == ("fixed", 1.0, 1.0)
