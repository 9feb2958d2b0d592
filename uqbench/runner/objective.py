"""The validation objective a sweeper tunes: which metric (``objective``), checked before any
training, and its value read from a finished run's metrics.

``objective: val/nll`` (conf/config.yaml) names a key of results.json's ``metrics``; the
runner's Hydra main returns its value. Hydra's basic sweeper ignores it; a sweeper that reads it
(Optuna: ``hydra/sweeper=tune``) minimises or maximises it (``hydra.sweeper.direction``). For
such a sweep a missing objective is an error, for a single run it is only not returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def sweeper_direction() -> str | None:
    """``hydra.sweeper.direction`` of the sweep this job is part of, when its sweeper reads the
    job's return value (any but Hydra's basic sweeper, which only lists jobs); None otherwise
    (a single run, a grid sweep, or a process started without Hydra)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    target = str(hc.sweeper.get("_target_") or "")
    if hc.mode != RunMode.MULTIRUN or target.endswith(".BasicSweeper"):
        return None
    direction = hc.sweeper.get("direction", "minimize")
    return str(getattr(direction, "name", direction))


def check(objective: str, task: Any, dataset: str, eval_splits: Sequence[str] | None) -> None:
    """Before anything is read or built: ``objective`` must be a validation metric the task
    (built: a small object, the metric names are its class's) computes, and, under a sweeper
    that reads it, better in the sweep's direction and the only split scored validation
    (``eval_splits: [val]``: a selection run never scores test)."""
    valid = task.metric_names("val")  # none declared: checked only once the run has metrics
    if valid and objective not in valid:
        raise ValueError(
            f"objective '{objective}' is not a validation metric of the {task.name} task "
            f"(dataset '{dataset}'); choose one of: {', '.join(valid)} "
            f"(or objective=null)")
    direction, better = sweeper_direction(), task.direction(objective)
    splits = eval_splits
    if direction is not None and (splits is None or list(splits) != ["val"]):
        raise ValueError(
            f"eval_splits={'null' if splits is None else list(splits)}: a trial of a sweeper "
            f"that reads the objective is a selection run, which scores the validation split "
            f"only; use eval_splits=[val] (hydra/sweeper=tune sets it) and score the chosen "
            f"setting on test with a plain run afterwards")
    if direction is not None and better is not None and direction != better:
        raise ValueError(
            f"the sweep would {direction} objective '{objective}', which is better when it "
            f"is {'lower' if better == 'minimize' else 'higher'}: add "
            f"hydra.sweeper.direction={better}")


def check_split(objective: str | None, data: Any, dataset: str) -> None:
    """Once the data is set up, before training: a sweeper that reads the objective needs the
    validation split it is computed on."""
    if objective is not None and not data.has_val and sweeper_direction() is not None:
        raise ValueError(
            f"dataset '{dataset}' has no validation split, so objective '{objective}' cannot "
            f"be computed for the sweeper; give it one (e.g. dataset.val_fraction=0.1)")


def value(objective: str | None, results: dict[str, Any]) -> float | None:
    """The objective's value in a run's results (a skipped run's stored ones too); None without
    an objective. A key the run lacks is an error under a sweeper that reads it (listing the
    validation metrics the run has), and None for a single run."""
    if objective is None:
        return None
    metrics = results.get("metrics") or {}
    if objective in metrics:
        return float(metrics[objective])
    if sweeper_direction() is None:
        return None
    val = sorted(k for k in metrics if k.startswith("val/"))
    raise ValueError(
        f"objective '{objective}' is not among the metrics of run {results.get('run')}; its "
        f"validation metrics: {', '.join(val) or 'none (the run has no validation split)'}")

