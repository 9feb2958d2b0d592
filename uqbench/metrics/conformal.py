"""Split conformal prediction for classifiers and Gaussian regressors.

Split conformal prediction turns the output of any trained model into prediction sets (or
intervals) that contain the true label with probability at least 1 - alpha, as long as the
calibration and test points are exchangeable (Vovk, Gammerman and Shafer, 2005; Papadopoulos
et al., 2002; Lei et al., 2018). A nonconformity score is computed for every calibration point,
its conformal quantile qhat is taken, and a test point's set holds every label whose score is at
most qhat.

Classification scores, computed from predictive probabilities:

- "thr": one minus the probability of the label, the threshold classifier of Sadinle, Lei and
  Wasserman (2019) (least ambiguous set-valued classifier).
- "aps": adaptive prediction sets of Romano, Sesia and Candès (2020), in their non-randomised
  form: the total probability of all classes ranked at or above the label.
- "raps": regularised adaptive prediction sets of Angelopoulos, Bates, Malik and Jordan (2021),
  non-randomised: the aps score plus lam * max(0, rank - k_reg).

Regression scores, for a Gaussian predictive with mean mu and variance sigma^2 per point:

- "absolute": |y - mu|, giving the interval mu +/- qhat (Lei et al., 2018).
- "normalized": |y - mu| / sigma, giving the interval mu +/- qhat * sigma (Papadopoulos et al.,
  2008; Lei et al., 2018).

Conventions used throughout:

- The conformal quantile of n scores is the k-th smallest score with k = ceil((n + 1)(1 - alpha)),
  that is the smallest score s with at least k of the n scores at most s (the inverse of the
  empirical distribution function at level k / n). It is +inf when k > n, in which case every
  label (or the whole real line) is in the set. Taking the quantile at level k / n with the
  "higher" interpolation rule over the n - 1 gaps between sorted scores would give the
  (k + 1)-th smallest score whenever k < n, one more than needed; the k-th is what is used here.
- A label is in the set exactly when its score, computed as if it were the true label, is at
  most qhat. For aps and raps this means the class at which the cumulative probability first
  goes above qhat is left out, and a set may be empty. This is what makes the test label fall in
  its set exactly when its score is at most qhat, which is where the coverage guarantee comes
  from.
- Classes are ranked by decreasing probability; equal probabilities are ranked by class index,
  the lower index first.

All computation is done in float64 on CPU tensors; the summary numbers are returned as floats.
"""

from __future__ import annotations

import math
from typing import Final, Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "CLASSIFICATION_METHODS",
    "ClassScore",
    "RegressionScore",
    "REGRESSION_SCORES",
    "all_class_scores",
    "class_scores",
    "classification_conformal",
    "conformal_quantile",
    "interval_metrics",
    "prediction_sets",
    "set_metrics",
    "regression_conformal",
    "regression_intervals",
    "regression_scores",
]

ClassScore = Literal["thr", "aps", "raps"]
RegressionScore = Literal["absolute", "normalized"]
CLASSIFICATION_METHODS: Final[tuple[str, ...]] = get_args(ClassScore)
REGRESSION_SCORES: Final[tuple[str, ...]] = get_args(RegressionScore)

# Our defaults for raps (the paper tunes both on held-out data instead of fixing them).
RAPS_LAMBDA: Final[float] = 0.01
RAPS_K_REG: Final[int] = 1


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join(choices)}")


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:  # also rejects nan
        raise ValueError(f"alpha must lie strictly between 0 and 1, got {alpha!r}")


def _float64(values: Tensor, name: str, ndim: int) -> Tensor:
    out = torch.as_tensor(values).detach().to(device="cpu", dtype=torch.float64)
    if out.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(out.shape)}")
    return out


def _labels(y: Tensor, n: int, n_classes: int) -> Tensor:
    labels = torch.as_tensor(y).detach().to(device="cpu", dtype=torch.int64)
    if labels.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(labels.shape)}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise ValueError(f"labels must lie in [0, {n_classes}), got values outside it")
    return labels


def all_class_scores(
    probs: Tensor, method: str = "thr", *, lam: float = RAPS_LAMBDA, k_reg: int = RAPS_K_REG
) -> Tensor:
    """Score of every class of every point, as if that class were the label: shape (N, C).

    For "aps" and "raps" the classes are ranked by decreasing probability (equal probabilities
    by class index); a class's aps score is the sum of the probabilities of the classes ranked
    at or above it, and raps adds lam * max(0, rank - k_reg) with the rank counted from 1.
    """
    _check_choice(method, CLASSIFICATION_METHODS, "method")
    p = _float64(probs, "probs", 2)
    if method == "thr":
        return 1.0 - p
    order = torch.sort(p, dim=1, descending=True, stable=True).indices
    cumulative = torch.cumsum(torch.gather(p, 1, order), dim=1)
    scores = torch.empty_like(p).scatter_(1, order, cumulative)
    if method == "raps":
        if lam < 0:
            raise ValueError(f"lam must be non-negative, got {lam!r}")
        rank = torch.empty_like(p).scatter_(
            1, order, torch.arange(1, p.shape[1] + 1, dtype=torch.float64).expand_as(p)
        )
        scores = scores + lam * torch.clamp(rank - k_reg, min=0.0)
    return scores


def class_scores(
    probs: Tensor,
    y: Tensor,
    method: str = "thr",
    *,
    lam: float = RAPS_LAMBDA,
    k_reg: int = RAPS_K_REG,
) -> Tensor:
    """Nonconformity score of the true label of each point: shape (N,), float64.

    method "thr": 1 - p_y. method "aps": the total probability of the classes ranked at or
    above y (no random term). method "raps": the aps score plus lam * max(0, rank_y - k_reg),
    rank_y counted from 1; lam = 0.01 and k_reg = 1 by default (our choice).
    """
    scores = all_class_scores(probs, method, lam=lam, k_reg=k_reg)
    labels = _labels(y, scores.shape[0], scores.shape[1])
    return torch.gather(scores, 1, labels[:, None])[:, 0]


def conformal_quantile(scores: Tensor, alpha: float) -> float:
    """Conformal quantile of calibration scores: the k-th smallest, k = ceil((n + 1)(1 - alpha)).

    This is the inverse of the empirical distribution function at level k / n, the smallest
    score with at least k scores at or below it. When k > n (too few scores for this alpha) the
    result is +inf. (n + 1)(1 - alpha) is rounded to 9 decimals
    before the ceiling, so that rounding error in 1 - alpha cannot add one to k (for example
    alpha = 0.7 and n = 9 give k = 3, not 4).
    """
    _check_alpha(alpha)
    s = _float64(scores, "scores", 1)
    n = s.shape[0]
    if torch.isnan(s).any():
        raise ValueError("scores contain nan")
    k = math.ceil(round((n + 1) * (1.0 - alpha), 9))
    if k > n:
        return math.inf
    return float(torch.sort(s).values[k - 1])


def prediction_sets(
    probs: Tensor,
    qhat: float,
    method: str = "thr",
    *,
    lam: float = RAPS_LAMBDA,
    k_reg: int = RAPS_K_REG,
) -> Tensor:
    """Boolean mask (N, C) of the classes whose score is at most qhat.

    The score of a class is the one `class_scores` would give if that class were the label, so
    the true label is in its set exactly when its score is at most qhat. For "aps" and "raps"
    the set is the top-ranked classes whose cumulative probability (plus penalty) is at most
    qhat; the class at which it first goes above qhat is not included, and the set can be
    empty.
    """
    return all_class_scores(probs, method, lam=lam, k_reg=k_reg) <= qhat


def classification_conformal(
    val_probs: Tensor,
    val_y: Tensor,
    test_probs: Tensor,
    test_y: Tensor,
    alpha: float = 0.1,
    method: str = "thr",
    *,
    lam: float = RAPS_LAMBDA,
    k_reg: int = RAPS_K_REG,
) -> dict[str, float]:
    """Calibrate on (val_probs, val_y) and evaluate the prediction sets on the test points.

    Returns "coverage" (share of test labels inside their set), "set_size" (mean number of
    classes per set) and "qhat" (the conformal quantile of the calibration scores), as plain
    floats; coverage is a fraction, not a percentage.
    """
    _check_alpha(alpha)
    _check_choice(method, CLASSIFICATION_METHODS, "method")
    val_scores = class_scores(val_probs, val_y, method, lam=lam, k_reg=k_reg)
    qhat = conformal_quantile(val_scores, alpha)
    return set_metrics(test_probs, test_y, qhat, method, lam=lam, k_reg=k_reg) | {"qhat": qhat}


def set_metrics(
    probs: Tensor,
    y: Tensor,
    qhat: float,
    method: str = "thr",
    *,
    lam: float = RAPS_LAMBDA,
    k_reg: int = RAPS_K_REG,
) -> dict[str, float]:
    """"coverage" (share of labels inside their set) and "set_size" (mean number of classes
    per set) of the prediction sets at ``qhat``, as plain floats."""
    sets = prediction_sets(probs, qhat, method, lam=lam, k_reg=k_reg)
    labels = _labels(y, sets.shape[0], sets.shape[1])
    covered = torch.gather(sets, 1, labels[:, None])[:, 0]
    return {
        "coverage": float(covered.to(torch.float64).mean()),
        "set_size": float(sets.sum(dim=1).to(torch.float64).mean()),
    }


def regression_scores(y: Tensor, mean: Tensor, var: Tensor, score: str = "normalized") -> Tensor:
    """Nonconformity scores (N,): |y - mean| for "absolute", |y - mean| / sqrt(var) for
    "normalized" (every variance must then be positive)."""
    _check_choice(score, REGRESSION_SCORES, "score")
    target = _float64(y, "y", 1)
    mu = _float64(mean, "mean", 1)
    if target.shape != mu.shape:
        raise ValueError(f"y and mean differ in shape: {tuple(target.shape)}, {tuple(mu.shape)}")
    residual = (target - mu).abs()
    if score == "absolute":
        return residual
    return residual / _sigma(var, mu.shape[0])


def _sigma(var: Tensor, n: int) -> Tensor:
    v = _float64(var, "var", 1)
    if v.shape != (n,):
        raise ValueError(f"var must have shape ({n},), got {tuple(v.shape)}")
    if not bool((v > 0).all()):
        raise ValueError("the normalized score needs every variance to be positive")
    return v.sqrt()


def regression_intervals(
    mean: Tensor, var: Tensor, qhat: float, score: str = "normalized"
) -> tuple[Tensor, Tensor]:
    """Lower and upper bounds (N,) of the intervals mean -/+ qhat ("absolute") or
    mean -/+ qhat * sqrt(var) ("normalized")."""
    _check_choice(score, REGRESSION_SCORES, "score")
    mu = _float64(mean, "mean", 1)
    half = torch.full_like(mu, qhat) if score == "absolute" else qhat * _sigma(var, mu.shape[0])
    return mu - half, mu + half


def regression_conformal(
    val_y: Tensor,
    val_mean: Tensor,
    val_var: Tensor,
    test_y: Tensor,
    test_mean: Tensor,
    test_var: Tensor,
    alpha: float = 0.1,
    score: str = "normalized",
) -> dict[str, float]:
    """Calibrate intervals on the validation points and evaluate them on the test points.

    Returns "coverage" (share of test targets inside their interval, as a fraction), "width"
    (mean interval width) and "qhat" (the conformal quantile of the calibration scores). A test
    target counts as covered when its score is at most qhat, which is the same as lying in the
    closed interval up to rounding.
    """
    _check_alpha(alpha)
    _check_choice(score, REGRESSION_SCORES, "score")
    qhat = conformal_quantile(regression_scores(val_y, val_mean, val_var, score), alpha)
    return interval_metrics(test_y, test_mean, test_var, qhat, score) | {"qhat": qhat}


def interval_metrics(
    y: Tensor, mean: Tensor, var: Tensor, qhat: float, score: str = "normalized"
) -> dict[str, float]:
    """"coverage" (share of targets inside their interval; a target counts as covered when its
    score is at most qhat, the closed interval up to rounding) and "width" (mean interval
    width) of the intervals at ``qhat``, as plain floats."""
    scores = regression_scores(y, mean, var, score)
    lower, upper = regression_intervals(mean, var, qhat, score)
    return {
        "coverage": float((scores <= qhat).to(torch.float64).mean()),
        "width": float((upper - lower).mean()),
    }
