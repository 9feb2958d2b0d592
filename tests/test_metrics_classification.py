"""Classification metrics against independent implementations (torchmetrics, scikit-learn, scipy)
and hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu
from sklearn.metrics import brier_score_loss, log_loss
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import (
    BinaryAveragePrecision,
    MulticlassAccuracy,
    MulticlassCalibrationError,
)

from uqbench import metrics as M
from uqbench.tasks.classification import ClassificationTask

C = 5


def f64(p: torch.Tensor) -> np.ndarray:
    """float64 probabilities renormalised (scikit-learn checks rows sum to 1 at 1e-8)."""
    p = p.double().numpy()
    return p / p.sum(-1, keepdims=True)


@pytest.fixture
def ensemble():
    """Random member logits (M=4, N=300, C=5) of varying sharpness, their softmax, labels."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, C, generator=g) * torch.linspace(0.2, 4, 300)[None, :, None]
    y = torch.randint(C, (300,), generator=g)
    return logits, torch.softmax(logits, -1), y


def test_accuracy_brier_nll_match_torchmetrics_and_sklearn(ensemble):
    _, probs, y = ensemble
    mean = probs.mean(0)
    out = M.classification_metrics(probs, y)
    acc = MulticlassAccuracy(num_classes=C, average="micro")(mean, y).item()
    assert out["acc"] == pytest.approx(acc, abs=1e-6)
    assert out["brier"] == pytest.approx(
        brier_score_loss(y.numpy(), f64(mean), labels=list(range(C)),
                         scale_by_half=False), rel=1e-6)
    assert out["nll"] == pytest.approx(
        log_loss(y.numpy(), f64(mean), labels=list(range(C))), rel=1e-6)


def test_mixture_nll_is_not_the_mean_of_member_nlls(ensemble):
    _, probs, y = ensemble
    member_nlls = [log_loss(y.numpy(), f64(p), labels=list(range(C))) for p in probs]
    mixture = M.mixture_nll(probs, y).item()
    # Jensen: −log mean_m p_m ≤ mean_m −log p_m, strictly for disagreeing members.
    assert mixture < np.mean(member_nlls) - 0.1


@pytest.mark.parametrize("bins", [15, 10])
def test_ece_matches_torchmetrics(ensemble, bins):
    _, probs, y = ensemble
    mean = probs.mean(0)
    ref = MulticlassCalibrationError(num_classes=C, n_bins=bins, norm="l1")(mean, y).item()
    assert M.ece(mean, y, bins).item() == pytest.approx(ref, abs=1e-6)
    assert M.classification_metrics(probs, y, ece_bins=bins)["ece"] == pytest.approx(ref,
                                                                                      abs=1e-6)


def test_ece_bins_are_closed_on_the_right():
    # 4 bins with exact edges 0.25, 0.5, 0.75: conf 0.5 (correct) lies in (0.25, 0.5],
    # conf 0.6 (wrong) in (0.5, 0.75] → ECE = (|1 − 0.5| + |0 − 0.6|) / 2 = 0.55.
    # ([lo, hi) bins would pool both: |0.5 − 0.55| = 0.05.)
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.2, 0.2]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    assert M.ece(probs, y, bins=4).item() == pytest.approx(0.55, abs=1e-12)


def test_mean_logits_aggregation_is_softmax_of_mean_logits(ensemble):
    logits, probs, y = ensemble
    expected = torch.softmax(logits.mean(0), -1)
    assert torch.allclose(M.aggregate(probs, "mean_logits"), expected, atol=1e-5)
    out = M.classification_metrics(probs, y, aggregation="mean_logits")
    assert out["nll"] == pytest.approx(
        log_loss(y.numpy(), f64(expected), labels=list(range(C))), rel=1e-5)
    with pytest.raises(ValueError, match="mean_probs"):
        M.aggregate(probs, "median")


def test_ood_scores_by_hand():
    # Two members, confident on different classes: p̄ = (.5, .5, 0) → H = log 2, member
    # entropies 0 → MI = log 2, msp score = −0.5. Identical members → MI = 0.
    disagree = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])
    s = M.ood_scores(disagree)
    assert s["entropy"].item() == pytest.approx(math.log(2))
    assert s["mi"].item() == pytest.approx(math.log(2))
    assert s["msp"].item() == pytest.approx(-0.5)
    agree = torch.full((3, 1, 4), 0.25)
    s = M.ood_scores(agree)
    assert s["mi"].item() == pytest.approx(0.0, abs=1e-12)
    assert s["entropy"].item() == pytest.approx(math.log(4))


def test_auroc_and_aupr_against_scipy_and_torchmetrics():
    g = torch.Generator().manual_seed(1)
    id_score, ood_score = torch.randn(200, generator=g), torch.randn(150, generator=g) + 0.7
    out = M.ood_detection(id_score, ood_score)
    u = mannwhitneyu(ood_score.numpy(), id_score.numpy()).statistic  # OOD positive
    assert out["auroc"] == pytest.approx(u / (200 * 150), abs=1e-9)
    is_ood = torch.cat([torch.zeros(200), torch.ones(150)]).long()
    score = torch.cat([id_score, ood_score])
    ap = BinaryAveragePrecision()
    assert out["aupr_out"] == pytest.approx(ap(score, is_ood).item(), abs=1e-5)
    assert out["aupr_in"] == pytest.approx(BinaryAveragePrecision()(-score, 1 - is_ood).item(),
                                           abs=1e-5)
    assert 0.6 < out["auroc"] < 0.9


class FixedLogits(torch.nn.Module):
    """A stand-in method: logits (M, B, C) read from a table by example index."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits[:, idx]


def test_task_predict_metrics_and_ood_keys(ensemble):
    logits, probs, y = ensemble
    task = ClassificationTask(ece_bins=15)
    loader = DataLoader(TensorDataset(torch.arange(300), y), batch_size=64)
    preds = task.predict(FixedLogits(logits), loader, torch.device("cpu"))
    assert preds["member_probs"].shape == (4, 300, C)
    assert preds["member_probs"].dtype == np.float32 and preds["labels"].dtype == np.int64
    np.testing.assert_allclose(preds["member_probs"], probs.numpy(), atol=1e-6)
    metrics = task.metrics("test", preds)
    assert set(metrics) == {"test/acc", "test/nll", "test/brier", "test/ece"}
    assert task.val_loss(preds) == pytest.approx(metrics["test/nll"])
    # OOD: flatter member predictions (logits / 10) → higher entropy → AUROC near 1.
    ood = {"member_probs": torch.softmax(logits / 10, -1).numpy(), "labels": preds["labels"]}
    out = task.ood_metrics("ood", preds, ood)
    assert set(out) == {f"ood/{k}_{s}" for k in ("auroc", "aupr_in", "aupr_out")
                        for s in ("msp", "entropy", "mi")}
    assert out["ood/auroc_entropy"] > 0.9 and out["ood/auroc_msp"] > 0.9


def test_task_rejects_bad_options():
    with pytest.raises(ValueError, match="ece_bins"):
        ClassificationTask(ece_bins=0)
    with pytest.raises(ValueError, match="mean_probs"):
        ClassificationTask(aggregation="vote")
