"""Regression metrics of a Gaussian predictive distribution: its mean and total variance per
target (fractions, never percent)."""

from __future__ import annotations

import math

import torch


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
