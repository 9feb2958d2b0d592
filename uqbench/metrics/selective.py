"""Selective prediction: the risk of keeping only the most confident predictions, its curve over
coverage, the area under it (AURC) and the risk at chosen coverages. Inputs: a predictive
distribution (N, C) and labels (N,)."""

from __future__ import annotations

import math

import torch

# the coverages at which selective prediction reports its risk (``risk_cov<percent>``)
RISK_COVERAGES = (0.8, 0.9)


def risk_curve(probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
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
    return risk_curve(probs, y).mean()


def risk_at_coverage(probs: torch.Tensor, y: torch.Tensor, coverage: float) -> torch.Tensor:
    """The error rate of the ⌈coverage·N⌉ most confident predictions (ties as :func:`aurc`)."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    return at_coverage(risk_curve(probs, y), coverage)


def at_coverage(curve: torch.Tensor, coverage: float) -> torch.Tensor:
    """The entry of a (N,) risk curve at ⌈coverage·N⌉ predictions kept (at least one)."""
    return curve[max(math.ceil(coverage * len(curve) - 1e-9), 1) - 1]
