"""Classification metrics against independent implementations (torchmetrics, scikit-learn, scipy)
and hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy as scipy_entropy
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


@pytest.mark.parametrize("aggregation", M.AGGREGATIONS)
def test_mi_is_a_mutual_information_under_every_aggregation(aggregation):
    # 1,000 random draws of M members over C classes: the MI is the members' mutual
    # information, H(mixture) − mean H(p_m), computed here with scipy, and never negative
    # (concavity of H), whatever the aggregation the other scores use.
    rng = np.random.default_rng(7)
    probs = rng.dirichlet(np.full(5, 0.3), size=(4, 1000))  # (M, N, C), many near one-hot
    mi = M.ood_scores(torch.from_numpy(probs), aggregation)["mi"].numpy()
    expected = scipy_entropy(probs.mean(0), axis=-1) - scipy_entropy(probs, axis=-1).mean(0)
    np.testing.assert_allclose(mi, expected, rtol=1e-9, atol=1e-12)
    assert mi.min() >= -1e-12


def test_mi_of_members_whose_geometric_mean_misleads():
    # (0.5, 0.5, ε) and (0.5, ε, 0.5): the entropy of their normalised geometric mean minus
    # the mean member entropy is negative (≈ −0.67 nats); the mutual information is
    # H((0.5, 0.25, 0.25)) − log 2 = 0.5 log 2 ≥ 0, under either aggregation.
    eps = 1e-12
    members = torch.tensor([[[0.5, 0.5, eps]], [[0.5, eps, 0.5]]], dtype=torch.float64)
    for aggregation in M.AGGREGATIONS:
        mi = M.ood_scores(members, aggregation)["mi"].item()
        assert mi == pytest.approx(0.5 * math.log(2), abs=1e-9)


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
    np.testing.assert_allclose(preds["mean_logits"], logits.mean(0).numpy(), atol=1e-6)
    metrics = task.metrics("test", preds)
    assert set(metrics) == {f"test/{k}" for k in (
        "acc", "nll", "brier", "ece", "ece_adaptive", "ece_classwise", "aurc", "risk_cov80",
        "risk_cov90")}
    assert task.val_loss(preds) == pytest.approx(metrics["test/nll"])
    # OOD: flatter member predictions (logits / 10) → higher entropy → AUROC near 1.
    ood = {"member_probs": torch.softmax(logits / 10, -1).numpy(), "labels": preds["labels"]}
    out = task.ood_metrics("ood", preds, ood)  # no mean_logits on one side: no logit scores
    assert set(out) == {f"ood/{k}_{s}" for k in ("auroc", "aupr_in", "aupr_out", "fpr95")
                        for s in ("msp", "entropy", "mi")}
    assert out["ood/auroc_entropy"] > 0.9 and out["ood/auroc_msp"] > 0.9
    ood["mean_logits"] = (logits / 10).mean(0).numpy()
    out = task.ood_metrics("ood", preds, ood)
    assert {"ood/auroc_energy", "ood/fpr95_max_logit"} <= set(out)
    # the energy score by hand (scipy), its AUROC by scikit-learn
    from scipy.special import logsumexp
    from sklearn.metrics import roc_auc_score
    energy = -logsumexp(np.concatenate([preds["mean_logits"], ood["mean_logits"]]), axis=-1)
    is_ood = np.r_[np.zeros(300), np.ones(300)]
    assert out["ood/auroc_energy"] == pytest.approx(roc_auc_score(is_ood, energy), abs=1e-9)


def test_single_member_reports_no_mutual_information(ensemble):
    logits, probs, y = ensemble
    one = {"member_probs": probs[:1].numpy(), "labels": y.numpy()}
    flat = {"member_probs": torch.softmax(logits[:1] / 10, -1).numpy(), "labels": y.numpy()}
    out = ClassificationTask().ood_metrics("ood", one, flat)
    assert out and not any(k.endswith("_mi") for k in out)


def naive_adaptive_ece(probs: np.ndarray, y: np.ndarray, bins: int) -> float:
    """Equal-mass bins with numpy's array_split over a stable argsort, one bin at a time."""
    conf, pred = probs.max(-1), probs.argmax(-1)
    total = 0.0
    for part in np.array_split(np.argsort(conf, kind="stable"), bins):
        total += len(part) * abs((pred[part] == y[part]).mean() - conf[part].mean())
    return total / len(y)


def test_adaptive_ece_by_hand_and_against_numpy(ensemble):
    # 4 examples, 2 bins of 2: confidences (0.6, 0.7 | 0.8, 0.9), correct (1, 0 | 1, 1):
    # |0.5 − 0.65|·2/4 + |1 − 0.85|·2/4 = 0.075 + 0.075 = 0.15
    probs = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.8, 0.2], [0.1, 0.9]], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1])
    assert M.adaptive_ece(probs, y, 2).item() == pytest.approx(0.15)
    _, p, y = ensemble
    mean = p.mean(0).double()
    for bins in (1, 7, 15):
        assert M.adaptive_ece(mean, y, bins).item() == pytest.approx(
            naive_adaptive_ece(mean.numpy(), y.numpy(), bins), abs=1e-12)
    # one bin: |accuracy − mean confidence| of the whole split
    acc = (mean.argmax(-1) == y).double().mean()
    assert M.adaptive_ece(mean, y, 1).item() == pytest.approx(
        abs(acc - mean.max(-1).values.mean()).item())


def test_classwise_ece_by_hand_and_against_a_loop(ensemble):
    # 2 classes, 2 bins (0, .5], (.5, 1]. Class 0 probabilities (0.8, 0.3): bin 2 holds example 1
    # (label 0: frequency 1, mean p 0.8), bin 1 example 2 (label 1: frequency 0, p 0.3) →
    # (0.2 + 0.3)/2. Class 1 probabilities (0.2, 0.7): the same gaps → 0.25. Mean 0.25.
    probs = torch.tensor([[0.8, 0.2], [0.3, 0.7]], dtype=torch.float64)
    assert M.classwise_ece(probs, torch.tensor([0, 1]), 2).item() == pytest.approx(0.25)
    _, p, y = ensemble
    mean = p.mean(0).double().numpy()
    bins, expected = 10, 0.0
    for c in range(C):
        k = np.clip(np.ceil(mean[:, c] * bins).astype(int) - 1, 0, bins - 1)  # (lo, hi]
        for b in range(bins):
            inside = k == b
            expected += abs(((y.numpy() == c) & inside).sum() - mean[inside, c].sum())
    expected /= len(y) * C
    assert M.classwise_ece(torch.from_numpy(mean), y, bins).item() == pytest.approx(
        expected, abs=1e-12)


def test_aurc_and_risk_by_hand_and_over_every_order_of_ties():
    from itertools import permutations

    # confidences 0.9, 0.8, 0.7, 0.6 with errors at the 2nd and 4th: risks 0, 1/2, 1/3, 2/4
    probs = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3], [0.4, 0.6]], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 0])
    assert M.aurc(probs, y).item() == pytest.approx((0 + 1 / 2 + 1 / 3 + 2 / 4) / 4)
    assert M.risk_at_coverage(probs, y, 0.5).item() == pytest.approx(0.5)
    assert M.risk_at_coverage(probs, y, 0.75).item() == pytest.approx(1 / 3)
    # ties: the expected AURC over every order of the tied examples
    conf = [0.9, 0.7, 0.7, 0.7, 0.6, 0.6]
    wrong = [0, 1, 0, 1, 1, 0]
    probs = torch.tensor([[c, 1 - c] for c in conf], dtype=torch.float64)
    y = torch.tensor([1 if w else 0 for w in wrong])
    orders = [(0, *a, *b) for a in permutations([1, 2, 3]) for b in permutations([4, 5])]
    curves = np.array([[sum(wrong[i] for i in o[:k]) / k for k in range(1, 7)] for o in orders])
    assert M.aurc(probs, y).item() == pytest.approx(curves.mean(1).mean(), abs=1e-12)
    assert M.risk_at_coverage(probs, y, 0.5).item() == pytest.approx(curves[:, 2].mean())
    with pytest.raises(ValueError, match="1.5"):
        M.risk_at_coverage(probs, y, 1.5)


def test_fpr95_against_scikit_learn_roc_curve():
    from sklearn.metrics import roc_curve

    g = torch.Generator().manual_seed(1)
    for n_id, n_ood in ((300, 200), (101, 57)):
        id_score = torch.randn(n_id, generator=g, dtype=torch.float64)
        ood_score = torch.randn(n_ood, generator=g, dtype=torch.float64) + 1.5
        is_ood = np.r_[np.zeros(n_id), np.ones(n_ood)]
        fpr, tpr, _ = roc_curve(is_ood, torch.cat([id_score, ood_score]).numpy(),
                                drop_intermediate=False)
        expected = fpr[np.argmax(tpr >= 0.95)]
        assert M.fpr_at_tpr(id_score, ood_score, 0.95) == pytest.approx(expected, abs=1e-12)
        assert M.ood_detection(id_score, ood_score)["fpr95"] == pytest.approx(expected)


def test_task_rejects_bad_options():
    with pytest.raises(ValueError, match="ece_bins"):
        ClassificationTask(ece_bins=0)
    with pytest.raises(ValueError, match="mean_probs"):
        ClassificationTask(aggregation="vote")
