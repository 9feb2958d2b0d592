"""The one contract every method fulfils, so that the runner never branches on a method's name.

A method is an ``nn.Module`` built by Hydra from ``conf/method/<name>.yaml`` (``_partial_: true``)
and then called with the backbone and the data's description::

    method = instantiate(cfg.method)(backbone=backbone, info=data.info)

Classification methods return member logits of shape (M, B, C) from ``forward``; regression
methods return a :class:`RegressionOutput`. Both know how to compute their training loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uqbench.contracts import Batch, DataInfo


class Method(nn.Module):
    """Base class: subclasses set ``task`` and implement ``forward`` and ``loss``.

    ``settings()`` returns the method's key settings (members, rank, variance, …) that go into
    results.json and the run folder's name. ``trainable_parameters()`` declares what the method
    trains (all of its parameters unless a subclass says otherwise); the parameter counts and
    the best-checkpoint state follow from it.
    """

    task: str = "classification"
    name: str = "method"

    def loss(self, batch: Batch) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        return {}

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name → parameter of everything the method trains, in registration order."""
        return dict(self.named_parameters())

    def param_counts(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        trainable = sum(p.numel() for p in self.trainable_parameters().values())
        return {"total": total, "trainable": trainable}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Copy of the trainable parameters only (cheap best-checkpoint for frozen backbones)."""
        return {n: p.detach().clone() for n, p in self.trainable_parameters().items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a :meth:`trainable_state` copy; its names must be exactly the trained ones."""
        params = self.trainable_parameters()
        if set(state) != set(params):
            missing, unknown = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise KeyError(f"method '{self.name}': the state does not match the parameters it "
                           f"trains (missing: {missing[:5]}, unknown: {unknown[:5]})")
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)


def check_task(method: Method, info: DataInfo) -> None:
    """Fail before any work if a method cannot serve the dataset's task."""
    if method.task != info.task:
        raise ValueError(
            f"method '{method.name}' solves {method.task} but the dataset is a {info.task} task; "
            f"choose a {info.task} method (see `uqbench --help` for the method group's options)"
        )
