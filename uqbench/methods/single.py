"""Single model: one backbone, fine-tuned or linear-probed, with one head (M = 1)."""

from __future__ import annotations

from typing import Any

from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import DataInfo
from uqbench.methods.ensemble import EnsembleMethod


class Single(EnsembleMethod):
    """One encoder and one head; logits (1, B, C).

    finetune: train the encoder and the head (default), or the head only (a linear probe over
    the frozen encoder).
    """

    def __init__(self, backbone: Backbone, info: DataInfo, finetune: bool = True,
                 name: str = "single") -> None:
        super().__init__(backbone, info, members=1, name=name)
        self.finetune = bool(finetune)
        if self.finetune:
            # Registered again so that it follows the head: the optimiser has always received
            # the head's parameters first, and gradient clipping sums the per-parameter norms
            # in that order (a different order changes the last bits of every update).
            self.encoder = self._modules.pop("encoder")  # type: ignore[assignment]  # set
        self.train_declared()

    def fine_tuned(self) -> list[nn.Module]:
        return [self.encoder] if self.finetune else []

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "finetune": self.finetune,
            "targets": "full backbone" if self.finetune else "heads only"}
