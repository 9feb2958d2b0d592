"""The one contract every method fulfils, so that the runner never branches on a method's name.

A method is an ``nn.Module`` built by Hydra from ``conf/method/<name>.yaml`` (``_partial_: true``)
and then called with the backbone and the data's description::

    method = instantiate(cfg.method)(backbone=backbone, info=data.info)

Classification methods return member logits of shape (M, B, C) from ``forward``; regression
methods return a :class:`RegressionOutput`. Both know how to compute their training loss, and
declare which of their trained parameters belong to which member (:class:`MemberParameters`),
so that the training loop can clip each member's gradient on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from uqbench.contracts import Batch


@dataclass
class MemberParameters:
    """Which trained parameters belong to which member: each member's gradient is clipped on
    its own (one member's large gradient must not shrink the others' steps).

    members: M. stacked: parameters whose dim 0 indexes the members, shape (M, …) (SVE's
    ``sve_s`` (M, r), LoRA's ``lora_A`` (M, r, in), the heads' (M, C, D)); member m owns the
    slice [m]. owned: owned[m] lists the parameters member m owns whole (a Deep Ensemble's
    encoder copy m); empty, or M lists. shared: parameters of no single member (one model's
    parameters, a head shared by all members): clipped together as one more group.
    """

    members: int = 1
    stacked: list[nn.Parameter] = field(default_factory=list)
    owned: list[list[nn.Parameter]] = field(default_factory=list)
    shared: list[nn.Parameter] = field(default_factory=list)


class Method(nn.Module):
    """Base class: subclasses set ``task`` and implement ``forward`` and ``loss``.

    ``settings()`` returns the method's key settings (members, rank, variance, …) that go into
    results.json and the run folder's name; ``diagnostics(inputs)``, any extra test metrics.
    ``trainable_parameters()`` declares what the method trains (all of its parameters unless a
    subclass says otherwise); the parameter counts and the best-checkpoint state follow from it.
    """

    task: str = "classification"
    name: str = "method"
    # How the training loss scales with the batch. False: a mean over the batch's examples
    # (plus any term that does not depend on the batch); the loop weights each micro-batch's
    # loss by its share of the optimiser step. True: a sum over the examples plus batch-free
    # terms, and ``loss(batch, share=…)`` adds only ``share`` of the batch-free terms.
    loss_sums_examples: bool = False

    def loss(self, batch: Batch) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        return {}

    @classmethod
    def stack_refusal(cls, settings: dict[str, Any]) -> str | None:
        """Why runs of this method with the config's ``settings`` cannot train side by side
        in one job (``stack_seeds``), or None when they can: when a training step draws no
        random numbers (each member's data order is then its own random stream, as in its own
        job). Not by default."""
        return (f"method '{settings.get('name', cls.name)}' does not declare that its runs "
                f"can train side by side")

    @staticmethod
    def stacked_losses(members: Sequence[Method], batches: Sequence[Batch],
                       stacked: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Each member's training loss on its own batch, shape (R,): what a job that trains
        the members side by side sums and differentiates (each member's parameters get their
        own loss's gradient). A method may compute them together, faster. ``stacked``: the
        members' parameters side by side, (R, …) each in the order of ``parameters()``, for
        members that :meth:`trains_stacked`: the losses are then computed from those."""
        if stacked is not None:
            raise ValueError(f"method '{members[0].name}' computes its members' losses from "
                             f"their own parameters, not stacked ones")
        return torch.stack([m.loss(b) for m, b in zip(members, batches, strict=True)])

    @staticmethod
    def trains_stacked(members: Sequence[Method]) -> bool:
        """Whether :meth:`stacked_losses` can compute these members' losses from their
        parameters stacked side by side (the job then trains one (R, …) tensor per parameter,
        fewer and larger optimiser updates). Not by default."""
        return False

    def diagnostics(self, inputs: torch.Tensor) -> dict[str, float]:
        """Checks of the trained model on test inputs (B, …) that only this method can make
        (the BNN: moment inference against Monte Carlo); the runner calls it once after
        evaluation and records each value as ``test/<name>``. None by default. It must leave
        the global random state as it found it."""
        return {}

    def fit_posthoc(self, data: Any, device: torch.device) -> dict[str, Any]:
        """A step after training and before scoring, on the trained (or loaded) weights and
        the set-up data (Laplace methods fit their posterior here); what it returns goes into
        results.json under ``posthoc``. Nothing by default."""
        return {}

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """Name → parameter of everything the method trains, in registration order."""
        return dict(self.named_parameters())

    def data_streams(self) -> int:
        """Independently shuffled training batches each step reads (stacked stream-major, see
        ``uqbench.contracts.stack_streams``); 1 (one shared batch) unless a method trains its
        members on data orders of their own."""
        return 1

    def member_parameters(self) -> MemberParameters:
        """The trained parameters by member; by default one model: all of them shared."""
        return MemberParameters(shared=list(self.trainable_parameters().values()))

    def param_counts(self) -> dict[str, int | float]:
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
