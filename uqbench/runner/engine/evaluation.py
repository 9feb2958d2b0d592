"""Scoring a trained method: the splits a run scores, post-hoc calibration, cost.

A run scores every split the dataset declares (its eval splits, its OOD splits and val), or
only those the root option ``eval_splits`` lists (``eval_splits: [val]``: a selection sweep,
which must hold no number of any other split): :func:`chosen_splits` checks the names against
the dataset once its data is set up, before any model is built. The runner calls
:func:`evaluate` and :func:`forward_cost`; the task (``uqbench.tasks``) turns predictions into
metrics, so nothing here knows the task's type beyond the data's own ``task`` label.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from uqbench.contracts import to_device

log = logging.getLogger("uqbench")


@dataclass(frozen=True)
class Splits:
    """The splits a run predicts and scores, each kind in the dataset's order."""

    eval: tuple[str, ...]  # the task's standard metrics
    ood: tuple[str, ...]   # OOD metrics (classification: detection against test)
    val: bool              # scored, and fits the post-hoc calibration
    # every split the dataset declares (eval_splits: null); the figures, which draw the test
    # and OOD data, are drawn only then
    every: bool = True

    @property
    def predicted(self) -> list[str]:
        """Every split predicted, in a fixed order (eval, OOD, val) so that stochastic methods
        draw the same random numbers as before the validation pass existed (a run that scores
        fewer splits draws its validation predictions from another point of the stream). A
        split that is both scored and detected as OOD (a shifted test set with labels) is
        predicted once."""
        return list(dict.fromkeys([*self.eval, *self.ood, *(["val"] if self.val else [])]))

    @property
    def cost_split(self) -> str:
        """The split whose first batch the FLOP count reads: test where it is scored, else the
        first split scored (a selection run reads no test input at all)."""
        return "test" if "test" in self.eval else self.predicted[0]


def chosen_splits(data: Any, requested: Sequence[str] | None) -> Splits:
    """The splits of ``data`` (set up) a run scores: all it declares when ``requested``
    (``eval_splits``) is None, else those listed; a name the dataset does not have is refused
    with the valid choices, and so is a classification OOD split without ``test``, the
    in-distribution split it is detected against."""
    val = bool(data.has_val)
    if requested is None:
        return Splits(tuple(data.eval_splits), tuple(data.ood_splits), val)
    valid = [*(["val"] if val else []), *data.eval_splits, *data.ood_splits]
    bad = [s for s in requested if s not in valid]
    if bad:
        raise ValueError(
            f"eval_splits={list(requested)}: {', '.join(map(repr, bad))} "
            f"{'is not a split' if len(bad) == 1 else 'are not splits'} of dataset "
            f"'{getattr(data, 'name', '?')}'; choose from: {', '.join(valid)} "
            f"(or eval_splits=null: every split)")
    chosen = Splits(tuple(s for s in data.eval_splits if s in requested),
                    tuple(s for s in data.ood_splits if s in requested), "val" in requested,
                    every=False)
    if chosen.ood and getattr(data, "task", None) == "classification" \
            and "test" not in chosen.eval:
        raise ValueError(
            f"eval_splits={list(requested)}: the OOD split{'s' if len(chosen.ood) > 1 else ''} "
            f"{', '.join(chosen.ood)} {'are' if len(chosen.ood) > 1 else 'is'} detected "
            f"against 'test', which the list leaves out; add test")
    return chosen


def split_group_means(metrics: dict[str, float], splits: list[str]) -> dict[str, float]:
    """Averages over the splits that share a prefix, e.g. for test_c/<c>/<s>/<metric>:
    test_c/mean/<metric> (all corruptions and severities), test_c/<c>/mean/<metric> (one
    corruption over its severities) and test_c/mean/<s>/<metric> (one severity over the
    corruptions); calibrated metrics (…/ts/<metric>) alike. Only splits whose name has a '/'
    form groups: test/ts/<metric> is a calibrated metric of `test`, not a group."""
    groups: dict[str, list[float]] = {}
    for split in (s for s in splits if "/" in s):
        parts = split.split("/")
        names = [f"{parts[0]}/mean"]
        if len(parts) == 3:  # <group>/<kind>/<level>
            names += [f"{parts[0]}/{parts[1]}/mean", f"{parts[0]}/mean/{parts[2]}"]
        for key, value in metrics.items():
            if key.startswith(split + "/"):
                for name in names:
                    groups.setdefault(f"{name}/{key[len(split) + 1:]}", []).append(value)
    return {k: float(np.mean(v)) for k, v in groups.items()}


def evaluate(method: torch.nn.Module, data: Any, task: Any, device: torch.device,
             splits: Splits) -> tuple[dict[str, float], dict[str, dict[str, np.ndarray]],
                                      dict | None]:
    """Metrics, predictions and post-hoc calibration of the run's splits
    (:func:`predict_splits`, then :func:`score`)."""
    predictions = predict_splits(method, data, task, device, splits)
    metrics, calibration = score(predictions, task, splits.eval, splits.ood)
    return metrics, predictions, calibration


def predict_splits(method: torch.nn.Module, data: Any, task: Any, device: torch.device,
                   splits: Splits) -> dict[str, dict[str, np.ndarray]]:
    """The task's predictions on the run's splits, in :attr:`Splits.predicted`'s order."""
    predictions = {}
    for split in splits.predicted:
        preds = task.predict(method, data.loader(split), device)
        if "x" in preds:  # the data's own truth at these inputs (a synthetic set's noise σ)
            preds |= data.reference(split, preds["x"])
        predictions[split] = preds
    return predictions


def score(predictions: dict[str, dict[str, np.ndarray]], task: Any,
          eval_splits: list[str] | tuple[str, ...], ood_splits: list[str] | tuple[str, ...]
          ) -> tuple[dict[str, float], dict | None]:
    """Metrics and post-hoc calibration from predictions alone (no model needed, so saved
    predictions of separately trained members can be scored as one ensemble).

    eval_splits get the task's standard metrics; ood_splits get its OOD metrics against the
    test predictions; the validation split (where present) is scored too and fits the task's
    post-hoc calibration (classification: temperature scaling), whose metrics are reported
    beside the raw ones (``<split>/ts/<metric>``). Splits sharing a prefix are also averaged
    (test_c/mean/<metric>).
    """
    val = ["val"] if "val" in predictions else []
    calibration = task.calibrate(predictions["val"]) if val else None
    metrics: dict[str, float] = {}
    for split in [*eval_splits, *val]:
        metrics.update(task.metrics(split, predictions[split], calibration))
    for split in ood_splits:
        metrics.update(task.ood_metrics(split, predictions.get("test", {}), predictions[split],
                                        calibration))
    metrics.update(split_group_means(metrics, list(eval_splits)))
    return metrics, calibration


def forward_cost(method: torch.nn.Module, data: Any, device: torch.device,
                 split: str = "test") -> dict[str, Any]:
    """Forward FLOPs per example (evaluation mode, one batch of ``split``, a split the run
    scores; torch's FLOP counter counts matrix products and convolutions) and the peak memory
    of the run so far."""
    from torch.utils.flop_counter import FlopCounterMode

    cost: dict[str, Any] = {"forward_flops_per_example": None}
    inputs, y = next(iter(data.loader(split)))
    method.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            method(to_device(inputs, device))
        cost["forward_flops_per_example"] = counter.get_total_flops() / len(y)
    except Exception as err:  # a custom kernel the counter cannot trace: report, never fail
        log.warning("FLOP count unavailable: %s", err)
    if device.type == "cuda":
        cost |= {"peak_memory_bytes": torch.cuda.max_memory_allocated(device),
                 "peak_memory": "torch.cuda.max_memory_allocated"}
    else:
        import resource

        cost |= {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "peak_memory": "process peak resident set size"}
    return cost
