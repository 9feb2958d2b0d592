"""task.aggregation (mean_probs | mean_logits) decides every prediction the classification task
forms: its metrics, the validation loss the trainer selects by, the temperature it fits and the
tempered metrics, and the OOD scores. Each is checked against closed forms of a two-class
ensemble whose member logits are (a, 0): p_m(class 0) = σ(a_m), so that

    mean_probs:  p̄₀ = (1/M) Σ_m σ(a_m / T)        mean_logits: p̄₀ = σ(ā / T), ā = (1/M) Σ_m a_m

(T = 1 untempered); the end-to-end run checks that results.json records the choice, and
experiment=p1_digits_conventions that it runs P1's conventions on p1_digits's recipe."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from sklearn.metrics import average_precision_score, roc_auc_score
from torchmetrics.classification import MulticlassCalibrationError

from tests.helpers import run_cli
from uqbench.metrics import T_RANGE
from uqbench.tasks.classification import ClassificationTask

# member logit a of class 0 (members × examples); every label is class 0
ID = np.array([[2.4, 1.2, -0.4],
               [-1.0, 0.8, -0.6],
               [-1.0, 1.0, -0.5]])
# example 0 of ID: mean_probs p̄₀ = (σ(2.4) + 2σ(−1))/3 = 0.485 (wrong), mean_logits σ(0.4/3) =
# 0.533 (right): the two aggregations disagree on its class. The members differ everywhere, so
# that no two OOD scores tie (a tie's share of the AUROC would hang on rounding).
OOD = np.array([[0.2, 3.0],
                [0.0, -3.0],
                [0.1, 0.0]])


def sigma(a: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-a))


def p0(a: np.ndarray, aggregation: str, t: float = 1.0) -> np.ndarray:
    """The predictive p(class 0) of each example by the closed forms above."""
    return sigma(a / t).mean(0) if aggregation == "mean_probs" else sigma(a.mean(0) / t)


def h(p: np.ndarray) -> np.ndarray:
    """Entropy (nats) of the two-class distribution (p, 1 − p)."""
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def predictions(a: np.ndarray) -> dict[str, np.ndarray]:
    logits = torch.from_numpy(np.stack([a, np.zeros_like(a)], -1))           # (M, N, 2)
    return {"member_probs": torch.softmax(logits, -1).numpy().astype(np.float32),
            "labels": np.zeros(a.shape[1], dtype=np.int64)}


AGGREGATIONS = ["mean_probs", "mean_logits"]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_metrics_and_the_validation_loss_by_hand(aggregation):
    task = ClassificationTask(aggregation=aggregation)
    p = p0(ID, aggregation)
    out = task.metrics("val", predictions(ID))
    assert out["val/acc"] == pytest.approx(np.mean(p > 0.5), abs=1e-12)
    assert out["val/acc"] == {"mean_probs": 1 / 3, "mean_logits": 2 / 3}[aggregation]
    assert out["val/nll"] == pytest.approx(-np.log(p).mean(), rel=1e-6)
    assert out["val/brier"] == pytest.approx((2 * (1 - p) ** 2).mean(), rel=1e-6)
    probs = torch.from_numpy(np.stack([p, 1 - p], -1))
    ece = MulticlassCalibrationError(num_classes=2, n_bins=15, norm="l1")
    assert out["val/ece"] == pytest.approx(ece(probs, torch.zeros(3, dtype=torch.long)).item(),
                                           abs=1e-6)
    assert task.val_loss(predictions(ID)) == pytest.approx(-np.log(p).mean(), rel=1e-6)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_temperature_scaling_tempers_the_aggregated_prediction(aggregation):
    """The fitted T minimises the closed-form NLL(T) (scipy, independently), and the tempered
    metrics are those of the closed form at that T."""
    task = ClassificationTask(aggregation=aggregation)

    def nll(log_t: float) -> float:
        return float(-np.log(p0(ID, aggregation, math.exp(log_t))).mean())

    best = minimize_scalar(nll, bounds=tuple(math.log(t) for t in T_RANGE), method="bounded",
                           options={"xatol": 1e-10})
    t = task.calibrate(predictions(ID))["temperature"]
    assert t == pytest.approx(math.exp(best.x), rel=1e-3)
    out = task.metrics("val", predictions(ID), {"temperature": t})
    p = p0(ID, aggregation, t)
    assert out["val/ts/nll"] == pytest.approx(-np.log(p).mean(), rel=1e-5)
    assert out["val/ts/brier"] == pytest.approx((2 * (1 - p) ** 2).mean(), rel=1e-5)
    assert out["val/ts/nll"] < out["val/nll"]


def test_the_two_aggregations_fit_different_temperatures():
    temperatures = [ClassificationTask(aggregation=a).calibrate(predictions(ID))["temperature"]
                    for a in AGGREGATIONS]
    assert abs(temperatures[0] - temperatures[1]) > 0.05


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ood_scores_of_the_aggregated_prediction(aggregation):
    """msp = −max(p̄₀, 1 − p̄₀), entropy = H(p̄), mi = H(p̄) − mean_m H(p_m), by hand; AUROC and
    AUPR from scikit-learn with OOD (AUPR-In: in-distribution) as the positive class."""
    task = ClassificationTask(aggregation=aggregation)
    out = task.ood_metrics("ood", predictions(ID), predictions(OOD))
    scores = {}
    for name in ("msp", "entropy", "mi"):
        per_split = []
        for a in (ID, OOD):
            p = p0(a, aggregation)
            per_split.append({"msp": -np.maximum(p, 1 - p), "entropy": h(p),
                              "mi": h(p) - h(sigma(a)).mean(0)}[name])
        scores[name] = np.concatenate(per_split)
    is_ood = np.r_[np.zeros(ID.shape[1]), np.ones(OOD.shape[1])]
    for name, score in scores.items():
        assert out[f"ood/auroc_{name}"] == pytest.approx(roc_auc_score(is_ood, score), abs=1e-9)
        assert out[f"ood/aupr_out_{name}"] == pytest.approx(
            average_precision_score(is_ood, score), abs=1e-9)
        assert out[f"ood/aupr_in_{name}"] == pytest.approx(
            average_precision_score(1 - is_ood, -score), abs=1e-9)


def test_the_two_aggregations_rank_ood_examples_differently():
    """MSP scores −max(p̄₀, 1 − p̄₀): ID examples −0.515, −0.73, −0.62 under mean_probs but
    −0.533, −0.73, −0.62 under mean_logits, OOD examples −0.525 and −0.5 under both; ID example
    0 outranks OOD example 0 only under mean_probs: 5 of the 6 (OOD, ID) pairs ranked right
    against all 6."""
    auroc = {a: ClassificationTask(aggregation=a).ood_metrics(
        "ood", predictions(ID), predictions(OOD))["ood/auroc_msp"] for a in AGGREGATIONS}
    assert auroc == {"mean_probs": pytest.approx(5 / 6), "mean_logits": pytest.approx(1.0)}


@pytest.mark.parametrize("aggregation,metric,variant", [
    ("mean_probs", "nll", "ours"), ("mean_logits", "nll", "mean_logits"),
    ("mean_probs", "acc", "select_acc"), ("mean_logits", "acc", "p1_code")])
def test_the_conventions_experiment_labels_each_setting_and_keeps_p1_digits(
        compose_cfg, aggregation, metric, variant):
    """experiment=p1_digits_conventions: each of its sweep's settings is its variant, and a
    run reads the same recipe as experiment=p1_digits (the same job with the same seed)."""
    overrides = ["backbone=digits_vit_foundation", "method=lora_ensemble", "seed=2"]
    ours = compose_cfg(["experiment=p1_digits_conventions", *overrides,
                        f"task.aggregation={aggregation}", f"trainer.select_metric={metric}"])
    theirs = compose_cfg(["experiment=p1_digits_first", *overrides])
    assert ours.variant == variant
    assert (ours.task.aggregation, ours.trainer.select_metric) == (aggregation, metric)
    assert ours.trainer.select == "best"
    assert ours.trainer.optimizer.lr == theirs.trainer.optimizer.lr
    assert ours.trainer.decay_to == theirs.trainer.decay_to
    sweep = compose_cfg(["experiment=p1_digits_conventions"], return_hydra_config=True)
    params = sweep.hydra.sweeper.params
    digits = compose_cfg(["experiment=p1_digits_first"],
                         return_hydra_config=True).hydra.sweeper.params
    assert params["method"] == "single,sve,deep_ensemble,lora_ensemble"
    # P1's regime only: the foundation-grade level, which p1_digits sweeps too, same seeds
    assert params["backbone"] == "digits_vit_foundation"
    assert params["backbone"] in digits["backbone"].split(",")
    assert params["seed"] == digits["seed"]


@pytest.mark.slow
def test_a_run_records_and_uses_its_aggregation_and_selection(tmp_path):
    """Through the CLI: results.json records task.aggregation and trainer.select_metric, the
    epoch kept and its validation accuracy (which the final validation pass reproduces), and
    the test metrics are those of softmax(mean member log-probabilities)."""
    run_cli("backbone=tiny_vit", "dataset=fake_images", "method=sve",
            "task.aggregation=mean_logits", "trainer.select=best", "trainer.select_metric=acc",
            "trainer.epochs=2", "trainer.val_every=1", "trainer.progress=false", "logger=none",
            "plot=false", "torch_threads=1", f"paths.runs_dir={tmp_path}")
    [path] = tmp_path.rglob("results.json")
    res = json.loads(path.read_text())
    assert res["settings"]["task"]["aggregation"] == "mean_logits"
    assert res["settings"]["trainer"]["select_metric"] == "acc"
    assert res["train"]["selected_by"] == "val/acc"
    assert res["train"]["selected_epoch"] in (1, 2)
    assert res["train"]["selected_value"] == pytest.approx(res["metrics"]["val/acc"], abs=1e-12)
    test = np.load(path.parent / "predictions/test.npz")
    log_p = np.log(test["member_probs"].astype(np.float64)).mean(0)
    p = np.exp(log_p - log_p.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    labels = test["labels"]
    assert res["metrics"]["test/acc"] == pytest.approx(np.mean(p.argmax(-1) == labels), abs=1e-9)
    assert res["metrics"]["test/nll"] == pytest.approx(
        -np.log(p[np.arange(len(labels)), labels]).mean(), rel=1e-5)


def test_scoring_a_run_on_another_dataset_keeps_its_own_scoring_options():
    """job=eval dataset=<other>: a run trained with mean_logits is scored with mean_logits
    (and its ECE bins), not the command's task defaults; another kind of task is the
    command's."""
    from omegaconf import OmegaConf

    from uqbench.runner.jobs.score import _eval_spec
    from uqbench.runner.spec import RunSpec

    target = "uqbench.tasks.classification.ClassificationTask"
    stored = {"task": {"_target_": target, "ece_bins": 10, "aggregation": "mean_logits"},
              "dataset": {"name": "digits"}, "device": "cpu"}
    cfg = OmegaConf.create({"task": {"_target_": target, "ece_bins": 15,
                                     "aggregation": "mean_probs"},
                            "dataset": {"name": "fake_images"}, "device": "cpu",
                            "save_predictions": False, "eval_splits": None,
                            "torch_threads": None})
    run = _eval_spec(RunSpec.of(cfg, check=False), stored, chosen=True, changed=[])
    assert run.dataset.name == "fake_images"
    assert (run.task.get("aggregation"), run.task.get("ece_bins")) == ("mean_logits", 10)
    other = OmegaConf.merge(cfg, {"task": {"_target_": "some.other.Task"}})
    assert _eval_spec(RunSpec.of(other, check=False), stored, chosen=True,
                      changed=[]).task.get("aggregation") == "mean_probs"
