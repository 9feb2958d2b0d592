"""Tasks turn a method's outputs into saved predictions and metrics.

The runner picks the task from the dataset (``data.info.task``) and never from the method.
"""

from __future__ import annotations

from uqbench.tasks.base import Task


def get_task(name: str, **kwargs) -> Task:
    if name == "regression":
        from uqbench.tasks.regression import RegressionTask

        return RegressionTask(**kwargs)
    if name == "classification":
        from uqbench.tasks.classification import ClassificationTask

        return ClassificationTask(**kwargs)
    raise ValueError(f"unknown task '{name}'; valid tasks: classification, regression")
