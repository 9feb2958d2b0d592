"""Scores of a classifier's predictive distribution: the members' probabilities (M, N, C) made
one (``aggregate``), accuracy, NLL, Brier and entropy, the summary of one split
(``classification_metrics``) and post-hoc temperature scaling."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from uqbench.metrics.calibration import adaptive_ece, classwise_ece, ece
from uqbench.metrics.selective import RISK_COVERAGES, at_coverage, risk_curve

# Inputs: member probabilities p of shape (M, N, C) (softmax of each member's logits) and labels
# y of shape (N,) (int64). The predictive distribution is built by `aggregate` (default: the mean
# of member probabilities, the ensemble mixture). Scores and metrics are fractions, never percent.
Aggregation = Literal["mean_probs", "mean_logits"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


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


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last axis; 0·log 0 = 0."""
    p = probs.double()
    return -(p * p.clamp_min(torch.finfo(torch.float64).tiny).log()).sum(-1)


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
    curve = risk_curve(probs, y)
    return {
        "acc": accuracy(probs, y).item(),
        "nll": nll_value.item(),
        "brier": brier(probs.double(), y).item(),
        "ece": ece(probs, y, ece_bins).item(),
        "ece_adaptive": adaptive_ece(probs, y, ece_bins).item(),
        "ece_classwise": classwise_ece(probs, y, ece_bins).item(),
        "aurc": curve.mean().item(),
        **{f"risk_cov{round(100 * c)}": at_coverage(curve, c).item() for c in RISK_COVERAGES},
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
