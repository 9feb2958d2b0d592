"""MC-Dropout: one fine-tuned model, dropout kept on at test time, T stochastic passes.

The members of its predictive distribution are the T passes: ``members`` = T = ``samples``,
and evaluation returns logits (T, B, C). All passes are one model, so they read ONE set of head
parameters; training runs one pass, logits (1, B, C).

Only ``nn.Dropout`` modules are put in train mode at test time; normalisation layers, timm's
DropPath and the attention-probability dropout inside fused attention kernels (which follows
its attention module's mode) stay in eval mode. The T passes run as ONE forward pass: the batch
is repeated T times in member-major order (sample t = rows t·B:(t+1)·B) and every row draws its
own dropout mask. ``p`` is set on every ``nn.Dropout`` of the backbone and on a dropout layer
in front of the head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uqbench.contracts import DataInfo
from uqbench.methods.ensemble import EnsembleMethod, Inputs, positive_int
from uqbench.methods.layers import repeat_members, split_members


class MCDropout(EnsembleMethod):
    """Training: one pass, logits (1, B, C). Evaluation: T = ``samples`` passes, (T, B, C).

    samples: T. p: dropout probability set on every nn.Dropout (null = keep the backbone's
    own rates; the head's dropout then uses 0.1). finetune: train the backbone too (default) or
    only the head.
    """

    shared_head = True  # the T passes are samples of one model

    def __init__(self, backbone: Any, info: DataInfo, samples: int = 10,
                 p: float | None = 0.1, finetune: bool = True,
                 name: str = "mc_dropout") -> None:
        samples = positive_int(samples, "method.samples", " (stochastic test-time passes)")
        if p is not None and not 0 <= float(p) < 1:
            raise ValueError(f"method.p must be a dropout probability in [0, 1), got {p}")
        super().__init__(backbone, info, members=samples, name=name)
        self.finetune = bool(finetune)
        self.p = None if p is None else float(p)
        dropouts = [m for m in self.encoder.modules() if isinstance(m, nn.Dropout)]
        if self.p is not None:
            for m in dropouts:
                m.p = self.p
        self.backbone_dropouts = len(dropouts)
        self.mc_dropout = nn.Dropout(0.1 if self.p is None else self.p)
        self.train_declared()
        self.train()

    def fine_tuned(self) -> list[nn.Module]:
        return [self.encoder] if self.finetune else []

    def train(self, mode: bool = True) -> MCDropout:
        """Set the mode of every module, then switch all nn.Dropout modules back on."""
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.train(True)
        return self

    def passes(self) -> int:
        """Stochastic passes per call: 1 in training, T in evaluation."""
        return 1 if self.training else self.members

    def features(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → pass-major features (P·B, D) after the head's dropout, P = passes()."""
        return self.mc_dropout(self.encoder(repeat_members(inputs, self.passes())))

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → logits (1, B, C) in training, (T, B, C) in evaluation."""
        return self.head(split_members(self.features(inputs), self.passes()))

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "samples": self.members, "p": self.p,
            "finetune": self.finetune, "backbone_dropouts": self.backbone_dropouts}
