"""Split conformal prediction (uqbench.metrics.conformal) against MAPIE, hand computations and the
finite-sample coverage guarantee."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mapie.classification import SplitConformalClassifier
from mapie.conformity_scores import APSConformityScore
from mapie.regression import SplitConformalRegressor
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin

from uqbench.metrics.conformal import (
    class_scores,
    classification_conformal,
    conformal_quantile,
    prediction_sets,
    regression_conformal,
    regression_intervals,
)

N_VAL, N_TEST, N_CLASSES = 500, 500, 10


class _LookupClassifier(ClassifierMixin, BaseEstimator):
    """A prefit classifier whose predict_proba returns stored rows: X[:, 0] is the row index."""

    def __init__(self, probs: np.ndarray) -> None:
        self.probs = probs
        # already "fitted": the attributes MAPIE checks for a prefit classifier
        self.classes_ = np.arange(probs.shape[1])
        self.n_features_in_ = 1

    def fit(self, X: np.ndarray, y: np.ndarray) -> _LookupClassifier:
        return self

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        return self.probs[np.asarray(X)[:, 0].astype(int)]

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.predict_proba(X).argmax(axis=1)


class _LookupRegressor(RegressorMixin, BaseEstimator):
    """A prefit regressor whose predict returns stored means: X[:, 0] is the row index."""

    def __init__(self, means: np.ndarray) -> None:
        self.means = means
        self.n_features_in_ = 1  # already "fitted", as MAPIE checks for a prefit regressor

    def fit(self, X: np.ndarray, y: np.ndarray) -> _LookupRegressor:
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.means[np.asarray(X)[:, 0].astype(int)]


class _APSWithoutRandomisation(APSConformityScore):
    """MAPIE's "aps" score always subtracts u * p_y (u uniform); this keeps the plain cumulative
    probability of the true label, the non-randomised score uqbench uses."""

    def get_conformity_scores(
        self, y: np.ndarray, y_pred: np.ndarray, y_enc: np.ndarray | None = None, **kwargs: object
    ) -> np.ndarray:
        scores, self.cutoff = self.get_true_label_cumsum_proba(y, y_pred, self.classes)
        return scores


def _random_classification(seed: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax probabilities of random logits, with labels drawn from those probabilities."""
    gen = torch.Generator().manual_seed(seed)
    n = N_VAL + N_TEST
    logits = scale * torch.randn(n, N_CLASSES, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, dim=1)
    labels = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return probs, labels


def _mapie_sets(
    probs: torch.Tensor, val_y: torch.Tensor, alpha: float, method: str
) -> tuple[SplitConformalClassifier, np.ndarray]:
    """MAPIE calibrated on the first N_VAL rows; its sets (N_TEST, C) for the other rows."""
    score = "lac" if method == "thr" else _APSWithoutRandomisation()
    mapie = SplitConformalClassifier(
        estimator=_LookupClassifier(probs.numpy()),
        confidence_level=1 - alpha,
        conformity_score=score,
        prefit=True,
        random_state=0,
    )
    X = np.arange(N_VAL + N_TEST)[:, None]
    mapie.conformalize(X[:N_VAL], val_y.numpy())
    _, sets = mapie.predict_set(X[N_VAL:], conformity_score_params={"include_last_label": False})
    return mapie, sets[:, :, 0]


@pytest.mark.parametrize("alpha", [0.1, 0.2])
@pytest.mark.parametrize("method", ["thr", "aps"])
def test_classification_matches_mapie(method: str, alpha: float) -> None:
    probs, labels = _random_classification(seed=int(alpha * 100) + len(method))
    val_p, test_p = probs[:N_VAL], probs[N_VAL:]
    val_y, test_y = labels[:N_VAL], labels[N_VAL:]

    ours = classification_conformal(val_p, val_y, test_p, test_y, alpha=alpha, method=method)
    our_sets = prediction_sets(test_p, ours["qhat"], method).numpy()

    # MAPIE: "lac" is our "thr"; for "aps" the score is taken without its random term and the
    # sets with include_last_label=False, which leaves out the class at which the cumulative
    # probability first goes above qhat, as ours does. MAPIE then also keeps the top class when
    # no class qualifies; ours would give an empty set there, so the data must have none.
    mapie, mapie_sets = _mapie_sets(probs, val_y, alpha, method)
    assert our_sets.sum(axis=1).min() >= 1

    # MAPIE's qhat is only kept on its private backend object (quantiles_, one per alpha)
    assert ours["qhat"] == pytest.approx(float(mapie._mapie_classifier.quantiles_[0]), abs=1e-12)
    np.testing.assert_allclose(
        class_scores(val_p, val_y, method).numpy(), mapie.conformity_scores.ravel(), atol=1e-12
    )
    np.testing.assert_array_equal(our_sets, mapie_sets)
    covered = mapie_sets[np.arange(N_TEST), test_y.numpy()]
    assert ours["coverage"] == pytest.approx(covered.mean(), abs=1e-12)
    assert ours["set_size"] == pytest.approx(mapie_sets.sum(axis=1).mean(), abs=1e-12)
    # sets of several sizes, so the comparison is not a trivial one
    assert 1.0 < ours["set_size"] < N_CLASSES - 1


def test_aps_empty_sets_where_mapie_keeps_the_top_class() -> None:
    # Sharper probabilities: some test points have a top class above qhat, so no class has a
    # score at most qhat and our set is empty; MAPIE (include_last_label=False) keeps the top
    # class there. Everywhere else the sets are the same.
    probs, labels = _random_classification(seed=7, scale=3.0)
    alpha = 0.2
    ours = classification_conformal(probs[:N_VAL], labels[:N_VAL], probs[N_VAL:],
                                    labels[N_VAL:], alpha=alpha, method="aps")
    our_sets = prediction_sets(probs[N_VAL:], ours["qhat"], "aps").numpy()
    _, mapie_sets = _mapie_sets(probs, labels[:N_VAL], alpha, "aps")

    empty = our_sets.sum(axis=1) == 0
    assert empty.sum() >= 5
    top = probs[N_VAL:].numpy().argmax(axis=1)
    assert (probs[N_VAL:].numpy().max(axis=1)[empty] > ours["qhat"]).all()
    np.testing.assert_array_equal(our_sets[~empty], mapie_sets[~empty])
    np.testing.assert_array_equal(mapie_sets[empty], np.eye(N_CLASSES, dtype=bool)[top[empty]])


def test_raps_by_hand() -> None:
    probs = torch.tensor(
        [
            [0.5, 0.25, 0.125, 0.125],
            [0.125, 0.125, 0.25, 0.5],
            [0.0625, 0.75, 0.125, 0.0625],
        ]
    )
    y = torch.tensor([2, 1, 1])
    # lam = 0.25, k_reg = 2; ranks count from 1, equal probabilities ranked by class index.
    # row 0: order 0, 1, 2, 3 (2 before 3 on the tie); y = 2 has rank 3,
    #        cumulative 0.5 + 0.25 + 0.125 = 0.875, penalty 0.25 * (3 - 2) = 0.25 -> 1.125
    # row 1: order 3, 2, 0, 1 (0 before 1 on the tie); y = 1 has rank 4,
    #        cumulative 1.0, penalty 0.25 * (4 - 2) = 0.5 -> 1.5
    # row 2: order 1, 2, 0, 3; y = 1 has rank 1, cumulative 0.75, no penalty -> 0.75
    scores = class_scores(probs, y, "raps", lam=0.25, k_reg=2)
    assert scores.dtype == torch.float64
    assert scores.tolist() == [1.125, 1.5, 0.75]
    # our defaults lam = 0.01, k_reg = 1: row 0 is 0.875 + 0.01 * (3 - 1) = 0.895
    assert class_scores(probs, y, "raps")[0].item() == pytest.approx(0.895, abs=1e-15)

    # n = 3, alpha = 0.5: k = ceil(4 * 0.5) = 2, the 2nd smallest of {0.75, 1.125, 1.5}
    qhat = conformal_quantile(scores, 0.5)
    assert qhat == 1.125
    # every class's score in each row (lam = 0.25, k_reg = 2):
    # row 0: classes 0..3 -> 0.5, 0.75, 0.875 + 0.25 = 1.125, 1.0 + 0.5 = 1.5  -> {0, 1, 2}
    # row 1: classes 0..3 -> 0.875 + 0.25 = 1.125, 1.0 + 0.5 = 1.5, 0.75, 0.5  -> {0, 2, 3}
    # row 2: classes 0..3 -> 0.9375 + 0.25 = 1.1875, 0.75, 0.875, 1.0 + 0.5    -> {1, 2}
    # (in row 2 class 0 is where the cumulative score first goes above qhat: left out)
    sets = prediction_sets(probs, qhat, "raps", lam=0.25, k_reg=2)
    expected = [[True, True, True, False], [True, False, True, True], [False, True, True, False]]
    assert sets.tolist() == expected

    # the same three points as calibration and test set: labels of rows 0 and 2 are covered
    result = classification_conformal(probs, y, probs, y, alpha=0.5, method="raps", lam=0.25,
                                      k_reg=2)
    assert result == pytest.approx({"coverage": 2 / 3, "set_size": 8 / 3, "qhat": 1.125})


def test_conformal_quantile_order_statistic() -> None:
    scores = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6])  # n = 9
    # alpha = 0.2: k = ceil(10 * 0.8) = 8 -> 8th smallest = 0.8
    assert conformal_quantile(scores, 0.2) == pytest.approx(0.8)
    # alpha = 0.7: k = ceil(10 * 0.3) = 3 -> 0.3 (1 - 0.7 rounds to 0.30000000000000004)
    assert conformal_quantile(scores, 0.7) == pytest.approx(0.3)
    # alpha = 0.05: k = ceil(10 * 0.95) = 10 > n -> +inf, every class in every set
    assert conformal_quantile(scores, 0.05) == math.inf
    probs = torch.softmax(torch.randn(4, 3, dtype=torch.float64), dim=1)
    result = classification_conformal(probs, torch.zeros(4, dtype=torch.int64), probs,
                                      torch.ones(4, dtype=torch.int64), alpha=0.1)
    assert result == {"coverage": 1.0, "set_size": 3.0, "qhat": math.inf}


def test_regression_absolute_matches_mapie() -> None:
    gen = torch.Generator().manual_seed(3)
    n_val, n_test, alpha = 300, 200, 0.1
    mean = torch.randn(n_val + n_test, generator=gen, dtype=torch.float64) * 3
    var = torch.rand(n_val + n_test, generator=gen, dtype=torch.float64) + 0.1
    y = mean + var.sqrt() * torch.randn(n_val + n_test, generator=gen, dtype=torch.float64)

    ours = regression_conformal(y[:n_val], mean[:n_val], var[:n_val], y[n_val:], mean[n_val:],
                                var[n_val:], alpha=alpha, score="absolute")
    lower, upper = regression_intervals(mean[n_val:], var[n_val:], ours["qhat"], "absolute")

    mapie = SplitConformalRegressor(
        estimator=_LookupRegressor(mean.numpy()),
        confidence_level=1 - alpha,
        conformity_score="absolute",
        prefit=True,
    )
    X = np.arange(n_val + n_test)[:, None]
    mapie.conformalize(X[:n_val], y[:n_val].numpy())
    _, intervals = mapie.predict_interval(X[n_val:])
    np.testing.assert_allclose(lower.numpy(), intervals[:, 0, 0], rtol=0, atol=1e-9)
    np.testing.assert_allclose(upper.numpy(), intervals[:, 1, 0], rtol=0, atol=1e-9)
    inside = (y[n_val:].numpy() >= intervals[:, 0, 0]) & (y[n_val:].numpy() <= intervals[:, 1, 0])
    assert ours["coverage"] == pytest.approx(inside.mean(), abs=1e-12)
    assert ours["width"] == pytest.approx(2 * ours["qhat"], rel=1e-12)


def test_regression_normalized_by_hand() -> None:
    gen = torch.Generator().manual_seed(4)
    n_val, n_test, alpha = 50, 40, 0.2
    mean = torch.randn(n_val + n_test, generator=gen, dtype=torch.float64)
    var = torch.rand(n_val + n_test, generator=gen, dtype=torch.float64) * 2 + 0.05
    y = mean + 1.5 * var.sqrt() * torch.randn(n_val + n_test, generator=gen, dtype=torch.float64)

    ours = regression_conformal(y[:n_val], mean[:n_val], var[:n_val], y[n_val:], mean[n_val:],
                                var[n_val:], alpha=alpha, score="normalized")

    m, v, t = mean.numpy(), var.numpy(), y.numpy()
    val_scores = np.sort(np.abs(t[:n_val] - m[:n_val]) / np.sqrt(v[:n_val]))
    k = math.ceil((n_val + 1) * (1 - alpha))  # ceil(51 * 0.8) = ceil(40.8) = 41
    assert k == 41
    qhat = val_scores[k - 1]
    half = qhat * np.sqrt(v[n_val:])
    lo, hi = m[n_val:] - half, m[n_val:] + half
    assert ours["qhat"] == pytest.approx(qhat, rel=1e-15)
    assert ours["width"] == pytest.approx(np.mean(hi - lo), rel=1e-12)
    assert ours["coverage"] == pytest.approx(np.mean((t[n_val:] >= lo) & (t[n_val:] <= hi)))
    lower, upper = regression_intervals(mean[n_val:], var[n_val:], ours["qhat"], "normalized")
    np.testing.assert_allclose(lower.numpy(), lo, rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper.numpy(), hi, rtol=0, atol=1e-12)


def _assert_guarantee(coverages: torch.Tensor, alpha: float, n: int) -> None:
    """Mean coverage within 1 - alpha - 3 se and 1 - alpha + 1 / (n + 1) + 3 se."""
    mean = coverages.mean().item()
    se = coverages.std().item() / math.sqrt(coverages.numel())
    assert 1 - alpha - 3 * se <= mean <= 1 - alpha + 1 / (n + 1) + 3 * se, (mean, se)


REPS, N_CAL, N_EVAL = 200, 100, 200


def test_coverage_guarantee_classification_thr() -> None:
    # exchangeable data: every repetition draws calibration and test points from one
    # distribution (random logits, labels from a tempered version of the softmax, so the
    # probabilities are miscalibrated; the guarantee does not need calibrated probabilities).
    gen = torch.Generator().manual_seed(5)
    alpha = 0.1
    shape = (REPS, N_CAL + N_EVAL, N_CLASSES)
    logits = 2 * torch.randn(shape, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, dim=2)
    # labels by inverting the cumulative distribution of the tempered softmax
    u = torch.rand(REPS, N_CAL + N_EVAL, 1, generator=gen, dtype=torch.float64)
    cdf = torch.softmax(0.5 * logits, dim=2).cumsum(dim=2)
    labels = (cdf < u).sum(dim=2).clamp(max=N_CLASSES - 1)
    coverages = []
    for p, y in zip(probs, labels, strict=True):
        result = classification_conformal(p[:N_CAL], y[:N_CAL], p[N_CAL:], y[N_CAL:],
                                          alpha=alpha, method="thr")
        coverages.append(result["coverage"])
    _assert_guarantee(torch.tensor(coverages), alpha, N_CAL)


def test_coverage_guarantee_regression_normalized() -> None:
    # heteroscedastic targets with heavy-tailed (Student t, 3 degrees of freedom) noise and a
    # variance that is off by a factor: the guarantee needs only exchangeability.
    gen = torch.Generator().manual_seed(6)
    alpha = 0.1
    shape = (REPS, N_CAL + N_EVAL)
    means = torch.randn(shape, generator=gen, dtype=torch.float64)
    variances = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.2
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    chi2 = torch.randn(*shape, 3, generator=gen, dtype=torch.float64).pow(2).sum(dim=2)
    targets = means + 2 * variances.sqrt() * z / (chi2 / 3).sqrt()
    coverages = []
    for y, mean, var in zip(targets, means, variances, strict=True):
        result = regression_conformal(y[:N_CAL], mean[:N_CAL], var[:N_CAL], y[N_CAL:],
                                      mean[N_CAL:], var[N_CAL:], alpha=alpha)
        coverages.append(result["coverage"])
    _assert_guarantee(torch.tensor(coverages), alpha, N_CAL)


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_alpha_outside_unit_interval(alpha: float) -> None:
    probs = torch.full((5, 3), 1 / 3, dtype=torch.float64)
    y = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"got {alpha!r}"):
        conformal_quantile(torch.rand(5), alpha)
    with pytest.raises(ValueError, match=f"got {alpha!r}"):
        classification_conformal(probs, y, probs, y, alpha=alpha)
    with pytest.raises(ValueError, match=f"got {alpha!r}"):
        regression_conformal(torch.rand(5), torch.rand(5), torch.rand(5) + 1, torch.rand(5),
                             torch.rand(5), torch.rand(5) + 1, alpha=alpha)


def test_unknown_method() -> None:
    probs = torch.full((5, 3), 1 / 3, dtype=torch.float64)
    y = torch.zeros(5, dtype=torch.int64)
    for call in (
        lambda: class_scores(probs, y, "lac"),
        lambda: prediction_sets(probs, 0.5, "lac"),
        lambda: classification_conformal(probs, y, probs, y, method="lac"),
    ):
        with pytest.raises(ValueError, match=r"'lac'.*thr, aps, raps"):
            call()
    with pytest.raises(ValueError, match=r"'gaussian'.*absolute, normalized"):
        regression_conformal(torch.rand(5), torch.rand(5), torch.rand(5) + 1, torch.rand(5),
                             torch.rand(5), torch.rand(5) + 1, score="gaussian")
