"""Classification heads of the ensemble methods, and heads that start as a causal LM's scorer.

Every member of an ensemble reads the features of its own rows through its own linear head;
MC-Dropout's T stochastic passes all read ONE set of head parameters. :class:`EnsembleHead`
serves both as one batched layer.

A prompt answered by a next token (ARC-Easy with a causal LM) can start every head as the LM
itself: the head's rows become the LM's output-embedding rows of the answer tokens and its bias
zero, so that member logits equal the LM's next-token logits of those tokens. Such heads start
equal, so a method whose members have nothing else to tell them apart (a Deep Ensemble: exact
encoder copies, the same batches) perturbs each set like SVE perturbs the pretrained spectrum:
W_m = rows ⊙ (1 + σ·ε_m), b_m = σ·N(0, I), ε_m ~ N(0, I).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch
from torch import nn

from uqbench.backbones.base import Backbone

HeadInit = Literal["default", "p1"]
HEAD_INITS: tuple[str, ...] = get_args(HeadInit)


def check_head_init(init: str) -> HeadInit:
    """``init`` if it is one of :data:`HEAD_INITS`, else a ValueError naming the choices."""
    if init not in HEAD_INITS:
        raise ValueError(f"method.head_init '{init}' is not one of {HEAD_INITS} (default: "
                         f"nn.Linear's uniform init; p1: weights N(0, 0.01²), zero bias)")
    return init  # type: ignore[return-value]  # one of HEAD_INITS


class EnsembleHead(nn.Module):
    """``sets`` linear classification heads as one batched layer.

    weight (S, C, D), bias (S, C) with S = ``sets``; each set initialised independently, by
    ``init``: ``default`` like ``nn.Linear`` (U(±1/√D) weights and bias), ``p1`` as P1's public
    code (weights N(0, 0.01²), bias 0). Input features (G, B, D), one group of rows per member
    → logits (G, B, C). With S = G group g reads set g; with S = 1 the one set serves any
    number of groups.
    """

    def __init__(self, sets: int, in_features: int, outputs: int,
                 init: str = "default") -> None:
        super().__init__()
        self.sets = sets
        self.weight = nn.Parameter(torch.empty(sets, outputs, in_features))
        self.bias = nn.Parameter(torch.empty(sets, outputs))
        if check_head_init(init) == "p1":
            nn.init.normal_(self.weight, 0.0, 0.01)
            nn.init.zeros_(self.bias)
        else:
            bound = 1 / math.sqrt(in_features)  # nn.Linear's default init, per set
            nn.init.uniform_(self.weight, -bound, bound)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features (G, B, D) → logits (G, B, C)."""
        f = features.to(self.weight.dtype)
        if self.sets == 1:
            return f @ self.weight[0].T + self.bias[0]                           # (G, B, C)
        if f.shape[0] != self.sets:
            raise RuntimeError(f"{self.sets} head parameter sets cannot serve {f.shape[0]} "
                               f"groups of rows: expected 1 or {self.sets} groups")
        return torch.einsum("gbd,gcd->gbc", f, self.weight) + self.bias[:, None, :]

    def start_from_rows(self, rows: torch.Tensor, sigma: float = 0.0) -> None:
        """Every set's weight := ``rows`` (C, D), bias := 0: each set then computes rows · f.

        sigma > 0: set s instead starts at rows ⊙ (1 + σ·ε_s) with bias σ·N(0, I), ε_s ~ N(0, I)
        drawn per set (weight noise (S, C, D), then bias noise (S, C)); 0 = exact copies and no
        random numbers drawn.
        """
        with torch.no_grad():
            self.weight.copy_(rows.to(self.weight.dtype).expand_as(self.weight))
            self.bias.zero_()
            if sigma > 0:
                self.weight.mul_(1 + sigma * torch.randn_like(self.weight))
                self.bias.add_(sigma * torch.randn_like(self.bias))

    def extra_repr(self) -> str:
        S, C, D = self.weight.shape
        return f"sets={S}, in_features={D}, outputs={C}"


def answer_rows(backbone: Backbone, token_ids: Sequence[int] | None) -> torch.Tensor | None:
    """The causal LM's output-embedding rows (C, D) of the answer tokens, or None.

    None when the data is not answered by next tokens (``token_ids`` None) or the backbone is
    not a causal LM (its ``output_rows`` returns None). Call after
    ``backbone.build()``: the rows are read from the built model.
    """
    return None if token_ids is None else backbone.output_rows(token_ids)
