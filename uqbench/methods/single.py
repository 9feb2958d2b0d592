"""Single model: one fine-tuned (or linear-probed) backbone with one head, M = 1."""

from __future__ import annotations

from typing import Any

from uqbench.contracts import DataInfo
from uqbench.methods.deep_ensemble import DeepEnsemble


class Single(DeepEnsemble):
    """A Deep Ensemble of one member; logits (1, B, C)."""

    def __init__(self, backbone: Any, info: DataInfo, finetune: bool = True,
                 name: str = "single") -> None:
        super().__init__(backbone, info, members=1, finetune=finetune, name=name)
