"""Interface shared by the regression and classification tasks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

Predictions = dict[str, np.ndarray]  # per-example arrays, saved as predictions/<split>.npz


class Task:
    name: str = "task"
    # The metrics ``metrics(split, …)`` returns, by name, with the direction in which each is
    # better: "minimize", "maximize", or None where neither is (a coverage aims at its level).
    METRICS: dict[str, str | None] = {}

    def metric_names(self, split: str) -> list[str]:
        """Every key ``metrics(split, …)`` may return (some only on some data): e.g. the
        validation objectives a sweep may optimise (``split="val"``)."""
        return [f"{split}/{name}" for name in self.METRICS]

    def direction(self, key: str) -> str | None:
        """"minimize" | "maximize" | None: which way metric ``key`` (``val/ts/acc``) is better."""
        return self.METRICS.get(key.rsplit("/", 1)[-1])

    def predict(self, method: torch.nn.Module, loader: DataLoader,
                device: torch.device) -> Predictions:  # pragma: no cover - interface
        """Run the method over a loader (eval mode, no grad); return per-example arrays."""
        raise NotImplementedError

    def calibrate(self, val_preds: Predictions) -> dict[str, float] | None:
        """Post-hoc calibration fitted on the validation predictions (None: the task has none).
        Passed back to ``metrics`` and ``ood_metrics``, and recorded in results.json."""
        return None

    def metrics(self, split: str, preds: Predictions,
                calibration: dict[str, float] | None = None
                ) -> dict[str, float]:  # pragma: no cover - interface
        """Standard metrics of one split, keyed ``<split>/<metric>`` (and, with a calibration,
        those of the calibrated predictions, keyed ``<split>/<calibration>/<metric>``)."""
        raise NotImplementedError

    def ood_metrics(self, split: str, id_preds: Predictions, ood_preds: Predictions,
                    calibration: dict[str, float] | None = None
                    ) -> dict[str, float]:  # pragma: no cover - interface
        """Metrics of an out-of-distribution split, keyed ``<split>/<metric>``."""
        raise NotImplementedError

    def val_loss(self, preds: Predictions) -> float:  # pragma: no cover - interface
        """Scalar for model selection on the validation split (lower is better)."""
        raise NotImplementedError

    def figures(self, predictions: dict[str, Predictions], folder: Path,
                ood_splits: tuple[str, ...] | list[str] = ()) -> list[Path]:
        """Diagnostic figures of the predictions, drawn into ``folder`` (none by default)."""
        return []
