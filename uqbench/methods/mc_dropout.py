"""MC-Dropout: one fine-tuned model, dropout kept on at test time, T stochastic passes.

The members of its predictive distribution are the T passes: ``members`` = T = ``samples``,
and evaluation returns logits (T, B, C). All passes are one model, so they read ONE set of head
parameters; training runs one pass, logits (1, B, C).

The same dropouts act in training and in the T test passes:
- Every ``nn.Dropout`` module the forward calls stays in train mode at test time (rate ``p``);
  normalisation layers and timm's DropPath stay in eval mode.
- Attention-probability dropout is OFF in both. Fused attention kernels (timm's ``attn_drop``,
  BERT's attention dropout: ``scaled_dot_product_attention(dropout_p=…)``) read their rate
  from a dropout module but apply it only while the ATTENTION module is in training mode, so
  keeping it at test time would mean running attention in training mode. Its rate is set to 0
  instead (the backbone's ``attention_dropouts``): the T passes then drop exactly what a
  training pass drops, with any attention kernel (timm builds its ViTs, DINO's included, with
  attention dropout 0 anyway).
- ONE dropout in front of the head (ours, rate ``p``, or 0.1 when ``p`` is null): a backbone's
  own dropout of the pooled features (timm's ``head_drop``, the backbone's ``feature_dropout``)
  is removed, so features are not dropped twice.

The T passes run as ONE forward pass: the batch is repeated T times in member-major order
(sample t = rows t·B:(t+1)·B) and every row draws its own dropout mask.

Masks (``masks``). ``fast`` (default): the dropouts above are ``FastDropout`` modules
(``uqbench.methods.dropout``), in training and at test time alike, so both draw from one
distribution: masks from bulk 16-bit random uniforms, the rate quantised to a multiple of
1/65536 and the scaling matched to it. The T test passes then share the deterministic prefix:
an image batch runs on its B rows up to the first active dropout and is repeated there.
On a CPU (ViT-S/16, T = 4) the fast masks add about 8 % to the work of the T passes,
``nn.Dropout``'s ``bernoulli_`` masks about 35 %. ``torch``: the backbone's own ``nn.Dropout``
modules, the batch repeated at the input, as in runs made before the option existed (their
masks, hence their numbers for a given seed, differ from ``fast``'s).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import DataInfo
from uqbench.methods.dropout import (
    MASKS,
    FastDropout,
    Masks,
    fast_dropouts,
    quantised_rate,
    repeat_at_first_dropout,
)
from uqbench.methods.ensemble import EnsembleMethod, Inputs, positive_int
from uqbench.methods.member_layers import matches, repeat_members, split_members


class MCDropout(EnsembleMethod):
    """Training: one pass, logits (1, B, C). Evaluation: T = ``samples`` passes, (T, B, C).

    samples: T. p: dropout probability set on every nn.Dropout the forward calls (null = keep
    the backbone's own rates; the head's dropout then uses 0.1); attention-probability dropout
    is off. finetune: train the backbone too (default) or only the head. masks: fast
    (``FastDropout``, the rate quantised to a multiple of 1/65536; default: never slower) or
    torch (``nn.Dropout`` as built).
    """

    shared_head = True  # the T passes are samples of one model

    def __init__(self, backbone: Backbone, info: DataInfo, samples: int = 10,
                 p: float | None = 0.1, finetune: bool = True, masks: Masks = "fast",
                 name: str = "mc_dropout") -> None:
        samples = positive_int(samples, "method.samples", " (stochastic test-time passes)")
        if p is not None and not 0 <= float(p) < 1:
            raise ValueError(f"method.p must be a dropout probability in [0, 1), got {p}")
        if masks not in MASKS:
            raise ValueError(f"method.masks must be one of {', '.join(MASKS)}, got {masks!r} "
                             f"(fast: bulk random bits, torch: nn.Dropout's bernoulli_ masks)")
        super().__init__(backbone, info, members=samples, name=name)
        self.finetune = bool(finetune)
        self.p = None if p is None else float(p)
        self.attention_dropouts = self._attention_dropout_off(backbone)
        self.removed_feature_dropout = self._remove_feature_dropout(backbone)
        attention = set(self.attention_dropouts)
        dropouts = [n for n, m in self.encoder.named_modules()
                    if isinstance(m, nn.Dropout) and n not in attention]
        if self.p is not None:
            for n in dropouts:
                cast(nn.Dropout, self.encoder.get_submodule(n)).p = self.p
        self.backbone_dropouts = len(dropouts)
        self.masks = masks
        head_dropout = FastDropout if masks == "fast" else nn.Dropout
        self.mc_dropout = head_dropout(0.1 if self.p is None else self.p)
        if masks == "fast":
            fast_dropouts(self.encoder, dropouts)
        self.train_declared()
        self.train()

    def _attention_dropout_off(self, backbone: Backbone) -> list[str]:
        """Rate 0 on the backbone's attention-probability dropouts; returns their names."""
        suffixes = tuple(backbone.attention_dropouts)
        names = [n for n, m in self.encoder.named_modules()
                 if isinstance(m, nn.Dropout) and any(matches(n, s) for s in suffixes)]
        for n in names:
            cast(nn.Dropout, self.encoder.get_submodule(n)).p = 0.0
        return names

    def _remove_feature_dropout(self, backbone: Backbone) -> bool:
        """Replace the backbone's own dropout of the pooled features by nn.Identity: the head's
        dropout is ours. True if there was one."""
        name = backbone.feature_dropout
        found = dict(self.encoder.named_modules()).get(name) if name else None
        if not name or not isinstance(found, nn.Dropout):
            return False
        parent, _, child = name.rpartition(".")
        setattr(self.encoder.get_submodule(parent) if parent else self.encoder, child,
                nn.Identity())
        return True

    def fine_tuned(self) -> list[nn.Module]:
        return [self.encoder] if self.finetune else []

    def train(self, mode: bool = True) -> MCDropout:
        """Set the mode of every module, then switch all nn.Dropout modules back on."""
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.Dropout):
                m.train(True)
        return self

    def training_passes(self) -> int:
        """One pass per example in training (0 when only the head trains)."""
        return min(1, super().training_passes())

    def passes(self) -> int:
        """Stochastic passes per call: 1 in training, T in evaluation."""
        return 1 if self.training else self.members

    def features(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → pass-major features (P·B, D) after the head's dropout, P = passes().

        ``fast`` masks and an image batch: the encoder runs on B rows up to its first active
        dropout, which repeats them P times (a timm ViT: the patch and position embeddings
        run once); with no active dropout in the encoder its features (B, D) are repeated for
        the head's dropout. Text inputs are repeated at the input as before: their attention
        masks enter the encoder again after its first dropout."""
        passes = self.passes()
        if passes == 1 or self.masks != "fast" or not isinstance(inputs, torch.Tensor):
            return self.mc_dropout(self.encoder(repeat_members(inputs, passes)))
        with repeat_at_first_dropout(self.encoder, passes) as shared:
            features = self.encoder(inputs)                            # (P·B, D) or (B, D)
        if not shared["repeated"]:
            features = repeat_members(features, passes)                # (P·B, D)
        return self.mc_dropout(features)

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → logits (1, B, C) in training, (T, B, C) in evaluation."""
        return self.head(split_members(self.features(inputs), self.passes()))

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "samples": self.members, "p": self.p,
            "finetune": self.finetune, "masks": self.masks,
            "p_applied": (quantised_rate(self.mc_dropout.p) if self.masks == "fast"
                          else self.mc_dropout.p),
            "backbone_dropouts": self.backbone_dropouts,
            "attention_dropouts_off": len(self.attention_dropouts),
            "removed_feature_dropout": self.removed_feature_dropout}
