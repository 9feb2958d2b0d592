"""Calibration of top-label confidence and of every class's probability: ECE over equal-width,
equal-mass and class-wise bins, and the reliability diagram's bins. Inputs: a predictive
distribution (N, C) and labels (N,)."""

from __future__ import annotations

import torch


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
