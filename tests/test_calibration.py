"""Post-hoc temperature scaling, checked against a brute-force search written with numpy/scipy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import log_softmax, logsumexp

from uqbench import metrics as M
from uqbench.runner.engine.evaluation import split_group_means
from uqbench.tasks.classification import ClassificationTask


def _miscalibrated(members: int, sharpen: float, n: int = 3000, classes: int = 5, seed: int = 0):
    """Labels drawn from softmax(z); members predict softmax(sharpen·(z + noise_m))."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 1.5, (n, classes))
    p_true = np.exp(log_softmax(z, axis=-1))
    y = np.array([rng.choice(classes, p=row) for row in p_true])
    logits = sharpen * (z[None] + rng.normal(0, 0.3, (members, n, classes)))
    return np.exp(log_softmax(logits, axis=-1)).astype(np.float32), y


def _nll_numpy(member_probs: np.ndarray, y: np.ndarray, t: float) -> float:
    """NLL of the mixture of softmax(log p_m / T), computed independently in numpy."""
    log_p = log_softmax(np.log(np.maximum(member_probs.astype(np.float64), 1e-38)) / t, axis=-1)
    log_py = log_p[:, np.arange(len(y)), y]                                   # (M, N)
    return float(-(logsumexp(log_py, axis=0) - np.log(len(member_probs))).mean())


@pytest.mark.parametrize("members,sharpen", [(1, 3.0), (4, 2.5), (3, 0.5)])
def test_fitted_temperature_is_the_nll_minimiser(members, sharpen):
    probs, y = _miscalibrated(members, sharpen)
    t = M.fit_temperature(torch.from_numpy(probs), torch.from_numpy(y))
    grid = np.exp(np.linspace(np.log(0.2), np.log(10), 2001))
    nlls = np.array([_nll_numpy(probs, y, g) for g in grid])
    best = grid[nlls.argmin()]
    assert t == pytest.approx(best, rel=5e-3)               # grid step is 0.2 % in T
    assert _nll_numpy(probs, y, t) <= nlls.min() + 1e-9
    assert _nll_numpy(probs, y, t) < _nll_numpy(probs, y, 1.0) - 1e-3   # it was miscalibrated
    assert (t > 1) == (sharpen > 1)                          # overconfident → T > 1


def test_temper_is_softmax_of_log_probs_over_t():
    probs, _ = _miscalibrated(2, 1.0, n=10)
    expected = np.exp(log_softmax(np.log(probs.astype(np.float64)) / 2.0, axis=-1))
    np.testing.assert_allclose(M.temper(torch.from_numpy(probs), 2.0).numpy(), expected,
                               rtol=1e-9)


def test_task_reports_temperature_scaled_metrics_that_lower_val_nll():
    probs, y = _miscalibrated(4, 3.0)
    preds = {"member_probs": probs, "labels": y}
    task = ClassificationTask()
    calibration = task.calibrate(preds)
    metrics = task.metrics("val", preds, calibration)
    assert {f"val/{k}" for k in ("acc", "nll", "brier", "ece")} | {
        f"val/ts/{k}" for k in ("acc", "nll", "brier", "ece")} <= set(metrics)
    raw = {k for k in metrics if "/ts/" not in k}
    assert set(metrics) == raw | {k.replace("val/", "val/ts/") for k in raw}  # all tempered
    assert metrics["val/ts/nll"] < metrics["val/nll"]
    assert metrics["val/ts/ece"] < metrics["val/ece"]
    # T is shared by the members, so the argmax of a single member cannot change; the mixture's
    # accuracy may move slightly, no more
    assert abs(metrics["val/ts/acc"] - metrics["val/acc"]) < 0.02
    ood = task.ood_metrics("ood", preds, {"member_probs": probs[:, :500], "labels": y[:500]},
                           calibration)
    assert "ood/ts/auroc_mi" in ood and "ood/auroc_mi" in ood


def test_split_group_means_average_declared_groups_only():
    metrics = {"test/nll": 1.0, "test/ts/nll": 0.5,
               "test_c/fog/1/nll": 2.0, "test_c/fog/2/nll": 4.0,
               "test_c/fog/1/ts/nll": 1.0, "test_c/fog/2/ts/nll": 3.0}
    metrics |= {"test_c/snow/1/nll": 6.0, "test_c/snow/2/nll": 8.0}
    means = split_group_means(metrics, ["test", "test_c/fog/1", "test_c/fog/2",
                                        "test_c/snow/1", "test_c/snow/2"])
    assert means == {"test_c/mean/nll": 5.0, "test_c/mean/ts/nll": 2.0,
                     "test_c/fog/mean/nll": 3.0, "test_c/snow/mean/nll": 7.0,   # per corruption
                     "test_c/mean/1/nll": 4.0, "test_c/mean/2/nll": 6.0,        # per severity
                     "test_c/fog/mean/ts/nll": 2.0,
                     "test_c/mean/1/ts/nll": 1.0, "test_c/mean/2/ts/nll": 3.0}
