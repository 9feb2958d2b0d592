"""Scoring a trained method: every split the dataset declares, post-hoc calibration, cost.

The runner calls :func:`evaluate` and :func:`forward_cost`; the task (``uqbench.tasks``) turns
predictions into metrics, so nothing here knows the task's type.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from uqbench.contracts import to_device

log = logging.getLogger("uqbench")


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


def evaluate(method: torch.nn.Module, data: Any, task: Any, device: torch.device
             ) -> tuple[dict[str, float], dict[str, dict[str, np.ndarray]], dict | None]:
    """Metrics, predictions and post-hoc calibration of every split the dataset declares
    (:func:`predict_splits`, then :func:`score`)."""
    predictions = predict_splits(method, data, task, device)
    metrics, calibration = score(predictions, task, data.eval_splits, data.ood_splits)
    return metrics, predictions, calibration


def predict_splits(method: torch.nn.Module, data: Any, task: Any, device: torch.device
                   ) -> dict[str, dict[str, np.ndarray]]:
    """The task's predictions on every split the dataset declares, in a fixed order (eval, OOD,
    val) so that stochastic methods draw the same random numbers as before the validation pass
    existed."""
    val = ["val"] if data.has_val else []
    predictions = {}
    for split in [*data.eval_splits, *data.ood_splits, *val]:
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


def forward_cost(method: torch.nn.Module, data: Any, device: torch.device) -> dict[str, Any]:
    """Forward FLOPs per example (evaluation mode, one test batch; torch's FLOP counter counts
    matrix products and convolutions) and the peak memory of the run so far."""
    from torch.utils.flop_counter import FlopCounterMode

    cost: dict[str, Any] = {"forward_flops_per_example": None}
    inputs, y = next(iter(data.loader("test")))
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
