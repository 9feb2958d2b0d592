"""Interface shared by the regression and classification tasks."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader

Predictions = dict[str, np.ndarray]  # per-example arrays, saved as predictions/<split>.npz


class Task:
    name: str = "task"

    def predict(self, method: torch.nn.Module, loader: DataLoader,
                device: torch.device) -> Predictions:  # pragma: no cover - interface
        """Run the method over a loader (eval mode, no grad); return per-example arrays."""
        raise NotImplementedError

    def metrics(self, split: str, preds: Predictions) -> dict[str, float]:  # pragma: no cover
        """Standard metrics of one split, keyed ``<split>/<metric>``."""
        raise NotImplementedError

    def ood_metrics(self, split: str, id_preds: Predictions,
                    ood_preds: Predictions) -> dict[str, float]:  # pragma: no cover
        """Metrics of an out-of-distribution split, keyed ``<split>/<metric>``."""
        raise NotImplementedError

    def val_loss(self, preds: Predictions) -> float:  # pragma: no cover - interface
        """Scalar for model selection on the validation split (lower is better)."""
        raise NotImplementedError
