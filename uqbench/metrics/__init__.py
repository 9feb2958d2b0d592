"""Metrics as pure functions of predictions and targets (fractions, never percent), one module
per kind, every definition in docs/metrics.md:

- :mod:`.gaussian`: regression metrics of a Gaussian predictive (NLL, RMSE, coverage, noise
  recovery), from its mean and total variance;
- :mod:`.probabilities`: a classifier's predictive distribution from its members' probabilities
  (M, N, C), accuracy, NLL, Brier, entropy, one split's summary and temperature scaling;
- :mod:`.calibration`: ECE over equal-width, equal-mass and class-wise bins, the reliability
  diagram;
- :mod:`.selective`: the risk–coverage curve, AURC, the risk at a coverage;
- :mod:`.ood`: OOD scores of probabilities and of mean logits, and their detection metrics;
- :mod:`.conformal`: split conformal prediction sets and intervals, and their metrics.

Each is checked against an independent implementation in the tests. The tasks
(:mod:`uqbench.tasks`) choose which of them score a split; the metrics import nothing of uqbench
but each other. ``from uqbench import metrics as M`` gives every one of them by name.
"""

from __future__ import annotations

from uqbench.metrics.calibration import adaptive_ece, classwise_ece, ece, reliability
from uqbench.metrics.gaussian import (
    gaussian_nll,
    interval_coverage,
    noise_recovery,
    regression_metrics,
    rmse,
)
from uqbench.metrics.ood import (
    LOGIT_SCORES,
    OOD_SCORES,
    fpr_at_tpr,
    logit_scores,
    ood_detection,
    ood_scores,
)
from uqbench.metrics.probabilities import (
    AGGREGATIONS,
    T_RANGE,
    Aggregation,
    accuracy,
    aggregate,
    brier,
    classification_metrics,
    entropy,
    fit_temperature,
    mixture_nll,
    nll,
    temper,
)
from uqbench.metrics.selective import (
    RISK_COVERAGES,
    at_coverage,
    aurc,
    risk_at_coverage,
    risk_curve,
)

__all__ = [
    "AGGREGATIONS", "LOGIT_SCORES", "OOD_SCORES", "RISK_COVERAGES", "T_RANGE", "Aggregation",
    "accuracy", "adaptive_ece", "aggregate", "at_coverage", "aurc", "brier",
    "classification_metrics", "classwise_ece", "ece", "entropy", "fit_temperature",
    "fpr_at_tpr", "gaussian_nll", "interval_coverage", "logit_scores", "mixture_nll", "nll",
    "noise_recovery", "ood_detection", "ood_scores", "regression_metrics", "reliability",
    "risk_at_coverage", "risk_curve", "rmse", "temper",
]
