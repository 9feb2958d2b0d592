"""Run identity: every override that changes a result changes the run folder."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.helpers import ROOT, run_cli
from uqbench.configs import group_options, identity_overrides
from uqbench.identity import ADDED_KEYS, differences, identity, speed_options


def test_identity_keeps_result_changing_overrides_only(compose_cfg):
    root = compose_cfg(["method.variance=learned"])  # name: bnn_${method.variance}
    overrides = ["trainer.optimizer.lr=0.01", "seed=3", "skip_existing=true", "device=cpu",
                 "paths.runs_dir=/tmp/x", "logger=wandb", "logger.mode=offline",
                 "trainer.progress=false", "hydra/launcher=joblib", "method.variance=learned",
                 "backbone.width=8", "dataset.n_train=100", "torch_threads=1", "run_name=x"]
    # backbone.width and method.variance are shown by the names mlp_w8 and bnn_learned
    assert identity_overrides(overrides, root) == ["dataset.n_train=100",
                                                   "trainer.optimizer.lr=0.01"]


@pytest.mark.slow
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


def _resolved(compose_cfg, overrides: list[str]) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_cfg(overrides), resolve=True)


def test_the_engine_layout_is_no_part_of_the_identity_nor_of_the_path(compose_cfg):
    stored = {"trainer": {"epochs": 3, "optimizer": {"lr": 0.1}}}  # stored before precision
    requested = {"trainer": {"epochs": 3, "optimizer": {"lr": 0.1}, "precision": "32",
                             "devices": 4, "strategy": "ddp", "accumulate": 2}}
    assert differences(stored, requested) == []
    requested["trainer"]["precision"] = "bf16-mixed"
    assert differences(stored, requested) == [
        "trainer.precision: '<absent>' (stored) → 'bf16-mixed' (requested)"]
    overrides = ["trainer.devices=4", "trainer.accumulate=2", "trainer.epochs=2"]
    assert identity_overrides(overrides, compose_cfg(overrides)) == ["trainer.epochs=2"]


def test_methods_declare_their_own_speed_only_options():
    from uqbench.methods.bnn import BayesianMLP
    from uqbench.methods.mc_dropout import MCDropout
    from uqbench.methods.sve import SVE

    assert speed_options({"method": {"_target_": "uqbench.methods.bnn.BayesianMLP"}}) \
        == BayesianMLP.speed_options == ("fused", "compile")
    assert speed_options({"method": {"_target_": "uqbench.methods.sve.SVE"}}) \
        == SVE.speed_options == ("cache_weights",)
    assert not hasattr(MCDropout, "speed_options")
    assert speed_options({"method": {"_target_": "uqbench.methods.mc_dropout.MCDropout"}}) == ()
    # a class gone from the code (a run stored by another version) declares nothing
    assert speed_options({"method": {"_target_": "uqbench.methods.gone.Gone"}}) == ()
    assert speed_options({"seed": 0}) == ()


def test_a_speed_option_is_identity_for_a_method_that_does_not_declare_it():
    bnn = {"method": {"_target_": "uqbench.methods.bnn.BayesianMLP", "fused": True}}
    other = {"method": {"_target_": "uqbench.methods.single.Single", "fused": True}}
    assert "method.fused" not in identity(bnn)
    assert identity(other)["method.fused"] is True


def test_speed_options_are_no_part_of_the_identity_nor_of_the_path(compose_cfg):
    bnn = "uqbench.methods.bnn.BayesianMLP"
    stored = {"method": {"_target_": bnn, "variance": "embedded"}}  # before the fast paths
    requested = {"method": {"_target_": bnn, "variance": "embedded", "fused": False,
                            "compile": True}}
    assert differences(stored, requested) == []
    # a stored config without the class name still matches: the requested one names it
    assert differences({"method": {"variance": "embedded", "fused": True}}, requested) == []
    overrides = ["method.fused=false", "method.compile=true", "trainer.optimizer.lr=0.01"]
    assert identity_overrides(overrides, compose_cfg(overrides)) == ["trainer.optimizer.lr=0.01"]
    sve = ["method=sve", "backbone=tiny_vit", "dataset=fake_images", "method.cache_weights=false",
           "method.members=2"]
    assert identity_overrides(sve, compose_cfg(sve)) == []  # members: in the name sve_m2


@pytest.mark.parametrize("method", group_options("method"))
def test_stored_runs_of_every_method_stay_reusable(compose_cfg, method):
    """A run stored before its method's speed-only options existed, or with other values of
    them, is the same run; any other option changed is not."""
    cfg = _resolved(compose_cfg, [f"method={method}"])
    declared = speed_options(cfg)
    older = copy.deepcopy(cfg)
    for key in declared:
        older["method"].pop(key, None)
    assert differences(older, cfg) == []
    flipped = copy.deepcopy(cfg)
    for key in declared:
        flipped["method"][key] = not cfg["method"].get(key)
    assert differences(flipped, cfg) == []
    assert identity(cfg) == identity(older)
    changed = copy.deepcopy(cfg)
    changed["method"]["name"] = "another"
    assert differences(changed, cfg) == ["method.name: 'another' (stored) → "
                                         f"{cfg['method']['name']!r} (requested)"]


def test_the_identity_is_defined_once():
    """configs and the run folder read the one definition; neither holds a copy."""
    from uqbench import configs
    from uqbench.records import runfolder

    for module in (configs, runfolder):
        for name in ("BOOKKEEPING", "ENGINE_LAYOUT", "SPEED_OPTIONS", "ADDED_KEYS", "identity"):
            assert not hasattr(module, name), f"{module.__name__}.{name}"
    assert runfolder.differences is differences


def test_a_lookup_table_is_no_part_of_the_identity(compose_cfg):
    """p1_digits reads its learning rates from lookup.digits_recipe: another entry edited
    leaves a run reusable, the entry the run read is in its resolved lr."""
    overrides = ["experiment=p1_digits_first", "backbone=digits_vit_other", "method=single"]
    cfg = _resolved(compose_cfg, overrides)
    recipe = yaml.safe_load((ROOT / "conf" / "recipe" / "p1_digits_first.yaml").read_text())
    lr = recipe["choices"]["digits_vit_other"]["single"]["lr"]  # the file's entry for the run
    assert cfg["trainer"]["optimizer"]["lr"] == lr
    assert not any(k.startswith("lookup") for k in identity(cfg))
    edited = _resolved(compose_cfg, [*overrides,
                                     "lookup.digits_recipe.choices.digits_vit_other.svf.lr=0.5"])
    assert differences(cfg, edited) == []
    used = _resolved(compose_cfg, [*overrides,
                                   "lookup.digits_recipe.choices.digits_vit_other.single.lr=0.5"])
    assert differences(cfg, used) == [f"trainer.optimizer.lr: {lr} (stored) → 0.5 (requested)"]
    # a lookup override may change what the run reads: it names its own folder
    assert identity_overrides(["lookup.digits_recipe.choices.digits_vit_other.single.lr=0.5"],
                              compose_cfg(overrides)) == [
        "lookup.digits_recipe.choices.digits_vit_other.single.lr=0.5"]


def test_runs_stored_before_the_lookup_rule_stay_reusable(compose_cfg):
    """Runs of p1_digits and p1_digits_rank stored their lookup table at the top level: the
    same run as today's config, even with an entry since edited."""
    for experiment in ("p1_digits_first", "p1_digits_rank"):
        cfg = _resolved(compose_cfg, [f"experiment={experiment}"])
        stored = copy.deepcopy(cfg)
        table = "digits_recipe"
        stored[table] = copy.deepcopy(stored.pop("lookup")[table])
        stored[table]["digits_vit_other"] = {"an": "older entry"}
        assert "lookup" not in stored and differences(stored, cfg) == []


def test_the_table_layout_is_no_part_of_the_identity_nor_of_the_path(compose_cfg):
    cfg = _resolved(compose_cfg, ["experiment=p1_digits_first"])
    edited = copy.deepcopy(cfg)
    edited["table"]["title"] = "another title"
    assert differences(cfg, edited) == []
    overrides = ["experiment=p1_digits_first", "table.title=another"]
    assert identity_overrides(["table.title=another"], compose_cfg(overrides)) == []


def test_added_keys_take_the_value_older_runs_used():
    fixed = {k: v for k, v in ADDED_KEYS.items() if not callable(v)}
    assert fixed == {"trainer.precision": "32", "method.rank": None,
                     "method.masks": "torch", "trainer.select_metric": "nll",
                     "task.conformal_alpha": 0.1, "task.conformal": ["thr", "aps"],
                     "task.conformal_score": "normalized", "method.covariance": "diagonal",
                     "method.mixture_modes": 2, "method.mixture_nodes": 8,
                     "method.data_order": "shared", "dataset.ood_classes": None,
                     "backbone.ood_classes": None, "backbone.kind_targets": "labels"}
    assert set(ADDED_KEYS) - set(fixed) == {"method.mixture_link_nodes"}
    assert differences({"trainer": {}}, {"trainer": {"precision": "32"}}) == []
    # a BNN run stored before method.covariance existed propagated the diagonal moments
    assert differences({"method": {}}, {"method": {"covariance": "diagonal"}}) == []
    assert differences({"method": {}}, {"method": {"covariance": "full"}}) != []
    assert differences({"trainer": {}}, {"trainer": {"precision": "16-mixed"}}) != []
    # a run stored before the conformal sets is today's default run without their metrics
    task = {"_target_": "uqbench.tasks.classification.ClassificationTask", "ece_bins": 15}
    today = dict(task, conformal_alpha=0.1, conformal=["thr", "aps"])
    assert differences({"task": task}, {"task": today}) == []
    assert differences({"task": task}, {"task": dict(today, conformal_alpha=0.2)}) != []
    assert differences({"trainer": {}}, {"trainer": {"select_metric": "nll"}}) == []
    assert differences({"trainer": {}}, {"trainer": {"select_metric": "acc"}}) != []
    # a LoRA-Ensemble or Deep Ensemble run stored before data_order trained on shared batches
    assert differences({"method": {}}, {"method": {"data_order": "shared"}}) == []
    assert differences({"method": {}}, {"method": {"data_order": "independent"}}) != []


def test_a_learned_mixture_scoring_stored_before_the_noise_split_closed_a2_as_one_gaussian():
    # the split acts only in a learned-variance mixture scoring: one stored without the key
    # is link_nodes 0 (a₂ one Gaussian per component), anything else is today's default
    old = {"method": {"variance": "learned", "covariance": "mixture"}}
    today = {"method": {"variance": "learned", "covariance": "mixture", "mixture_link_nodes": 8}}
    assert differences(old, today) == [
        "method.mixture_link_nodes: '<absent>' (stored) → 8 (requested)"]
    assert differences(old, {"method": dict(today["method"], mixture_link_nodes=0)}) == []
    for method in ({"variance": "embedded", "covariance": "mixture"},
                   {"variance": "learned", "covariance": "full"}, {"variance": "learned"}):
        assert differences({"method": method},
                           {"method": dict(method, mixture_link_nodes=8)}) == [], method


def test_mc_dropout_runs_stored_before_the_mask_option_drew_torch_masks():
    stored = {"method": {"samples": 4, "p": 0.1}}
    old = {"method": {"samples": 4, "p": 0.1, "masks": "torch"}}
    new = {"method": {"samples": 4, "p": 0.1, "masks": "fast"}}
    assert differences(stored, old) == []
    assert differences(stored, new) == [
        "method.masks: '<absent>' (stored) → 'fast' (requested)"]


def test_the_default_job_names_no_folder_level(compose_cfg):
    """job=train is the default job, and job=eval scores the run it names: neither is part of
    the run folder's path, so `-m job=train,eval` scores the runs it trains."""
    from uqbench.configs import identity_overrides

    cfg = compose_cfg([])
    assert identity_overrides(["job=train", "seed=1", "trainer.epochs=3"], cfg) == [
        "trainer.epochs=3"]
    assert identity_overrides(["job=eval", "trainer.epochs=3"], cfg) == ["trainer.epochs=3"]
    assert identity_overrides(["job=params"], cfg) == ["job=params"]  # a record of its own
