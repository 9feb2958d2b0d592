"""Metrics as pure functions of predictions and targets (fractions, never percent).

Regression metrics take the predictive mean and total variance of a Gaussian predictive
distribution; classification metrics take member probabilities of shape (M, N, C), and the
logit-based OOD scores (energy, max-logit) the members' mean logits (N, C). Every definition is
in docs/metrics.md. Longer than most modules: one place for every metric a table may show
(calibration, selective prediction, OOD detection), each checked against an independent
implementation in the tests.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

# --- regression ---------------------------------------------------------------------------


def gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """Mean Gaussian negative log-likelihood, constant included: ½[log 2πσ² + (y−μ)²/σ²]."""
    return 0.5 * (torch.log(2 * math.pi * var) + (y - mean) ** 2 / var).mean()


def rmse(y: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(((y - mean) ** 2).mean())


def interval_coverage(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                      k: float) -> torch.Tensor:
    """Share of targets inside mean ± k·σ."""
    return ((y - mean).abs() <= k * var.sqrt()).double().mean()


def regression_metrics(y: torch.Tensor, mean: torch.Tensor,
                       var: torch.Tensor) -> dict[str, float]:
    """NLL, RMSE, ±1σ and ±2σ coverage and the mean predicted σ of one split."""
    return {
        "nll": gaussian_nll(y, mean, var).item(),
        "rmse": rmse(y, mean).item(),
        "coverage_1sigma": interval_coverage(y, mean, var, 1.0).item(),
        "coverage_2sigma": interval_coverage(y, mean, var, 2.0).item(),
        "mean_std": var.sqrt().mean().item(),
    }


def noise_recovery(std: torch.Tensor, true_std: torch.Tensor) -> dict[str, float]:
    """How well a predicted σ(x) recovers the true noise σ(x) of a synthetic set, both (N, d):
    ``noise_std_ratio`` = mean σ / mean true σ (below 1: noise underestimated) and
    ``noise_std_error`` = mean |σ − true σ| / mean true σ (0: recovered point by point)."""
    scale = true_std.mean()
    return {"noise_std_ratio": (std.mean() / scale).item(),
            "noise_std_error": ((std - true_std).abs().mean() / scale).item()}


# --- classification ---------------------------------------------------------------------------
# Inputs: member probabilities p of shape (M, N, C) (softmax of each member's logits) and labels
# y of shape (N,) (int64). The predictive distribution is built by `aggregate` (default: the mean
# of member probabilities, the ensemble mixture). Scores and metrics are fractions, never percent.

Aggregation = Literal["mean_probs", "mean_logits"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
OOD_SCORES = ("msp", "entropy", "mi")
# scores of the members' mean logits z̄ (N, C), for methods whose predictions keep them
LOGIT_SCORES = ("energy", "max_logit")
# the coverages at which selective prediction reports its risk (``risk_cov<percent>``)
RISK_COVERAGES = (0.8, 0.9)


def _check_member_probs(member_probs: torch.Tensor) -> None:
    if member_probs.dim() != 3:
        raise ValueError(f"member probabilities must have shape (M, N, C), got "
                         f"{tuple(member_probs.shape)}")


def aggregate(member_probs: torch.Tensor, aggregation: Aggregation = "mean_probs"
              ) -> torch.Tensor:
    """Predictive distribution (N, C) from member probabilities (M, N, C).

    mean_probs: (1/M) Σ_m p_m, the mixture (default).
    mean_logits: softmax of the mean member logits (LoRA-Ensemble's ECE). Computed from the
    member log-probabilities: log p_m = z_m − logsumexp(z_m) differs from the logits z_m by a
    per-member constant, which the softmax of the mean cancels.
    """
    _check_member_probs(member_probs)
    if aggregation == "mean_probs":
        return member_probs.mean(0)
    if aggregation == "mean_logits":
        tiny = torch.finfo(member_probs.dtype).tiny
        return torch.softmax(member_probs.clamp_min(tiny).log().mean(0), dim=-1)
    raise ValueError(f"aggregation '{aggregation}' is not one of {AGGREGATIONS}")


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Share of samples whose argmax class is the label. probs (N, C), y (N,)."""
    return (probs.argmax(-1) == y).double().mean()


def mixture_nll(member_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean −log p(y|x) of the mixture p = (1/M) Σ_m p_m, via log-mean-exp over members.

    Not the mean of member NLLs (that is larger or equal, by Jensen).
    """
    _check_member_probs(member_probs)
    tiny = torch.finfo(torch.float64).tiny
    idx = y.view(1, -1, 1).expand(member_probs.shape[0], -1, 1)
    log_py = member_probs.double().gather(-1, idx).squeeze(-1).clamp_min(tiny).log()  # (M, N)
    log_mix = torch.logsumexp(log_py, dim=0) - math.log(member_probs.shape[0])         # (N,)
    return -log_mix.mean()


def nll(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean −log p(y|x) of one predictive distribution probs (N, C)."""
    return mixture_nll(probs.unsqueeze(0), y)


def brier(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over samples of Σ_c (p_c − 1[c = y])², range [0, 2]. probs (N, C)."""
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).to(probs.dtype)
    return ((probs - onehot) ** 2).sum(-1).mean()


def _bin_sums(probs: torch.Tensor, y: torch.Tensor, bins: int, name: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per equal-width bin of top-label confidence (bins,): the number of samples, the sum
    of their confidences and of their correct predictions. Bin k covers (k/bins, (k+1)/bins]
    (confidence 0 falls into bin 0)."""
    if bins < 1:
        raise ValueError(f"{name} bins must be >= 1, got {bins}")
    conf, pred = probs.double().max(-1)
    correct = (pred == y).double()
    inner = torch.linspace(0, 1, bins + 1, dtype=torch.float64, device=conf.device)[1:-1]
    idx = torch.searchsorted(inner, conf, side="left")  # conf == edge → the lower bin: (lo, hi]
    zeros = torch.zeros(bins, dtype=torch.float64, device=conf.device)
    return (zeros.index_add(0, idx, torch.ones_like(conf)), zeros.index_add(0, idx, conf),
            zeros.index_add(0, idx, correct))


def ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """Expected calibration error with top-label confidence and equal-width bins.

    Bin k covers the interval (k/bins, (k+1)/bins] (confidence 0 falls into bin 0); the gap
    |accuracy − mean confidence| of each bin is weighted by the share of samples in it.
    """
    count, conf_sum, acc_sum = _bin_sums(probs, y, bins, "ece")
    # Σ_k (n_k/N)·|acc_k − conf_k| = Σ_k |Σ_{i∈k} correct_i − Σ_{i∈k} conf_i| / N
    return (acc_sum - conf_sum).abs().sum() / count.sum()


def reliability(probs: torch.Tensor, y: torch.Tensor, bins: int = 15
                ) -> dict[str, torch.Tensor]:
    """The reliability diagram's bins, as :func:`ece` forms them: ``count`` (bins,), and in
    each bin the mean top-label ``confidence`` and the ``accuracy`` (NaN where a bin is
    empty). ECE = Σ_k (count_k / N) · |accuracy_k − confidence_k|."""
    count, conf_sum, acc_sum = _bin_sums(probs, y, bins, "reliability")
    return {"count": count, "confidence": conf_sum / count, "accuracy": acc_sum / count}


def adaptive_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """ECE over equal-mass bins of top-label confidence: the samples sorted by confidence
    (ties kept in sample order) are cut into ``bins`` contiguous groups whose sizes differ by at
    most one (the first N mod bins groups hold one more), and each group's
    |accuracy − mean confidence| is weighted by its share of the samples."""
    if bins < 1:
        raise ValueError(f"adaptive ECE bins must be >= 1, got {bins}")
    conf, pred = probs.double().max(-1)
    order = torch.sort(conf, stable=True).indices
    gaps = torch.zeros((), dtype=torch.float64)
    for part in torch.tensor_split(order, min(bins, len(order))):
        gaps = gaps + ((pred[part] == y[part]).double().sum() - conf[part].sum()).abs()
    return gaps / len(conf)


def classwise_ece(probs: torch.Tensor, y: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """Class-wise ECE (Kull et al., 2019): for every class c, the equal-width-binned gap between
    the predicted p_c and the frequency of c, Σ_k (n_k/N)·|freq_k − mean p_c in k| with bins
    (k/bins, (k+1)/bins] as :func:`ece`'s, averaged over the classes."""
    if bins < 1:
        raise ValueError(f"class-wise ECE bins must be >= 1, got {bins}")
    p = probs.double()
    n, classes = p.shape
    onehot = torch.nn.functional.one_hot(y, classes).double()
    inner = torch.linspace(0, 1, bins + 1, dtype=torch.float64, device=p.device)[1:-1]
    idx = torch.searchsorted(inner, p.contiguous(), side="left")          # (N, C)
    flat = (idx + bins * torch.arange(classes, device=p.device)).flatten()
    zeros = torch.zeros(bins * classes, dtype=torch.float64, device=p.device)
    gap = zeros.index_add(0, flat, onehot.flatten()) - zeros.index_add(0, flat, p.flatten())
    return gap.abs().sum() / (n * classes)


def _risk_curve(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Selective risk (N,) at coverage k/N, k = 1 … N: the error rate of the k most confident
    predictions (top-label probability). Within a group of equal confidences, which of them
    come first is undecided, so the errors of a partly included group count in proportion (the
    expected risk over every order of the ties)."""
    conf, pred = probs.double().max(-1)
    wrong = (pred != y).double()
    conf, order = torch.sort(conf, descending=True, stable=True)
    wrong = wrong[order]
    _, counts = torch.unique_consecutive(conf, return_counts=True)
    group = torch.repeat_interleave(torch.arange(len(counts)), counts)      # (N,) tie group
    group_errors = torch.zeros(len(counts), dtype=torch.float64).index_add(0, group, wrong)
    errors_before = (torch.cumsum(group_errors, 0) - group_errors)[group]
    samples_before = (torch.cumsum(counts, 0) - counts)[group].double()
    k = torch.arange(1, len(conf) + 1, dtype=torch.float64)
    errors = errors_before + group_errors[group] * (k - samples_before) / counts[group].double()
    curve: torch.Tensor = errors / k
    return curve


def aurc(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Area under the risk–coverage curve (Geifman et al., 2019): the mean over k = 1 … N of
    the selective risk of the k most confident predictions (lower is better)."""
    return _risk_curve(probs, y).mean()


def risk_at_coverage(probs: torch.Tensor, y: torch.Tensor, coverage: float) -> torch.Tensor:
    """The error rate of the ⌈coverage·N⌉ most confident predictions (ties as :func:`aurc`)."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    return _at_coverage(_risk_curve(probs, y), coverage)


def _at_coverage(curve: torch.Tensor, coverage: float) -> torch.Tensor:
    """The entry of a (N,) risk curve at ⌈coverage·N⌉ predictions kept (at least one)."""
    return curve[max(math.ceil(coverage * len(curve) - 1e-9), 1) - 1]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last axis; 0·log 0 = 0."""
    p = probs.double()
    return -(p * p.clamp_min(torch.finfo(torch.float64).tiny).log()).sum(-1)


def ood_scores(member_probs: torch.Tensor, aggregation: Aggregation = "mean_probs"
               ) -> dict[str, torch.Tensor]:
    """Per-sample OOD scores (N,), each oriented so that higher means more likely OOD.

    msp: −max_c p̄_c (negative maximum softmax probability), p̄ under ``aggregation``.
    entropy: H(p̄), the predictive entropy, p̄ under ``aggregation``.
    mi: H((1/M) Σ_m p_m) − (1/M) Σ_m H(p_m), the members' mutual information (BALD), always
    on the mixture whatever the aggregation: it is ≥ 0 by the concavity of H, and 0 for a
    single member. (The entropy of the normalised geometric mean minus the mean member
    entropy, its ``mean_logits`` look-alike, is no mutual information and goes negative.)
    """
    mean = aggregate(member_probs, aggregation)
    mixture = mean if aggregation == "mean_probs" else aggregate(member_probs, "mean_probs")
    return {
        "msp": -mean.double().max(-1).values,
        "entropy": entropy(mean),
        "mi": entropy(mixture) - entropy(member_probs).mean(0),
    }


def logit_scores(mean_logits: torch.Tensor, temperature: float = 1.0
                 ) -> dict[str, torch.Tensor]:
    """Per-sample OOD scores (N,) of the members' mean logits z̄ (N, C), higher = more OOD.

    energy: −T·logsumexp(z̄/T), the free energy (Liu et al., 2020); OOD inputs have higher.
    max_logit: −max_c z̄_c (Hendrycks et al., 2022); temperature leaves its order unchanged.
    """
    z = mean_logits.double()
    return {"energy": -temperature * torch.logsumexp(z / temperature, dim=-1),
            "max_logit": -z.max(-1).values}


def fpr_at_tpr(id_score: torch.Tensor, ood_score: torch.Tensor, tpr: float = 0.95) -> float:
    """The share of in-distribution samples flagged as OOD at the highest threshold that still
    flags at least ``tpr`` of the OOD samples (OOD the positive class, score higher = more OOD):
    a sample is flagged when its score is at or above the threshold."""
    ood = torch.sort(ood_score.double(), descending=True).values
    threshold = ood[max(math.ceil(tpr * len(ood) - 1e-9), 1) - 1]
    return float((id_score.double() >= threshold).double().mean())


def ood_detection(id_score: torch.Tensor, ood_score: torch.Tensor) -> dict[str, float]:
    """AUROC and AUPR of separating OOD from in-distribution samples by a score.

    The score must be oriented so that higher = more OOD.
    auroc: OOD is the positive class.
    aupr_in: in-distribution is the positive class, ranked by −score.
    aupr_out: OOD is the positive class, ranked by score.
    AUPR is scikit-learn's average precision (step-wise, no interpolation).
    fpr95: the in-distribution samples flagged at 95 % of the OOD samples detected
    (:func:`fpr_at_tpr`).
    """
    from sklearn.metrics import average_precision_score, roc_auc_score

    score = torch.cat([id_score, ood_score]).double().cpu().numpy()
    is_ood = torch.cat([torch.zeros(len(id_score)), torch.ones(len(ood_score))]).numpy()
    return {
        "auroc": float(roc_auc_score(is_ood, score)),
        "aupr_in": float(average_precision_score(1 - is_ood, -score)),
        "aupr_out": float(average_precision_score(is_ood, score)),
        "fpr95": fpr_at_tpr(id_score, ood_score, 0.95),
    }


def classification_metrics(member_probs: torch.Tensor, y: torch.Tensor, ece_bins: int = 15,
                           aggregation: Aggregation = "mean_probs") -> dict[str, float]:
    """Accuracy, NLL, Brier, ECE (equal-width, equal-mass and class-wise bins) and selective
    prediction (AURC, the risk at :data:`RISK_COVERAGES`) of the ensemble's predictive
    distribution on one split.

    With mean_probs the NLL is the mixture's (log-mean-exp over members); with mean_logits it is
    the NLL of softmax(mean logits).
    """
    probs = aggregate(member_probs, aggregation)
    nll_value = mixture_nll(member_probs, y) if aggregation == "mean_probs" else nll(probs, y)
    curve = _risk_curve(probs, y)
    return {
        "acc": accuracy(probs, y).item(),
        "nll": nll_value.item(),
        "brier": brier(probs.double(), y).item(),
        "ece": ece(probs, y, ece_bins).item(),
        "ece_adaptive": adaptive_ece(probs, y, ece_bins).item(),
        "ece_classwise": classwise_ece(probs, y, ece_bins).item(),
        "aurc": curve.mean().item(),
        **{f"risk_cov{round(100 * c)}": _at_coverage(curve, c).item() for c in RISK_COVERAGES},
    }


# --- post-hoc temperature scaling -------------------------------------------------------------
# Every member's probabilities are tempered, p_m(T) = softmax(log p_m / T): log p_m equals the
# member's logits up to a per-row constant, which the softmax cancels, so saved probabilities
# suffice. One T is fitted for the whole ensemble on the validation split (NLL, LBFGS over log T).

T_RANGE = (1e-2, 1e2)  # log T is clamped here: a degenerate split cannot send T to 0 or ∞


def temper(member_probs: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Member probabilities (M, N, C) at temperature T: softmax(log p_m / T), float64."""
    log_p = member_probs.double().clamp_min(torch.finfo(torch.float32).tiny).log()
    return torch.softmax(log_p / temperature, dim=-1)


def _predictive_nll(member_probs: torch.Tensor, y: torch.Tensor, aggregation: Aggregation
                    ) -> torch.Tensor:
    if aggregation == "mean_probs":
        return mixture_nll(member_probs, y)
    return nll(aggregate(member_probs, aggregation), y)


def fit_temperature(member_probs: torch.Tensor, y: torch.Tensor,
                    aggregation: Aggregation = "mean_probs") -> float:
    """The T > 0 that minimises the NLL of the tempered predictive distribution on (p, y)."""
    lo, hi = (math.log(t) for t in T_RANGE)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=1.0, max_iter=200, tolerance_grad=1e-10,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        t = log_t.clamp(lo, hi).exp()
        loss = _predictive_nll(temper(member_probs, t), y, aggregation)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return loss

    opt.step(closure)  # type: ignore[no-untyped-call]
    return float(log_t.detach().clamp(lo, hi).exp())
