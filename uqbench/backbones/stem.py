"""A frozen stem for Hugging Face encoders (``backbone.frozen_blocks``): the embeddings and the
first k transformer blocks, which no method adapts, run once per distinct input row.

Methods fold their M members into the batch before the encoder (M·B rows, member-major), so
below the first block a method adapts, the M copies of an example are identical; a frozen
block computes them once (:class:`FrozenRows`). Its dropouts are :class:`Inert`: the stem is
deterministic in training and evaluation alike, whatever a method switches on. The parameters
of every ``frozen_stem`` module are left out of what any method trains
(``uqbench.backbones.base.stem_parameters``), and layer replacement skips them.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn


class Inert(nn.Module):
    """A dropout that is always off (rate 0, identity), and no ``nn.Dropout``, so that no method
    switches it on: the dropouts of a frozen stem block. ``p`` stays readable, as attention
    kernels read their dropout's rate."""

    p = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def inert_dropouts(module: nn.Module) -> nn.Module:
    """``module`` with every ``nn.Dropout`` inside it replaced by :class:`Inert`."""
    for name, found in list(module.named_modules()):
        if isinstance(found, nn.Dropout):
            parent, _, child = name.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, child, Inert())
    return module


class FrozenRows(nn.Module):
    """A frozen transformer block (has-a ``base_layer``) run once per distinct input row.

    Methods fold their M members into the batch (M·B rows, member-major) before the encoder, so
    below the first block a method adapts, the M copies of an example are identical: this
    block runs without gradients on the distinct rows only (``torch.unique`` over the hidden
    states and the rows' attention masks, exact) and gives every row its copy's output. The
    output is the same as the block's on all rows, to the last bits of a matmul of another
    batch size. Its dropouts are :class:`Inert`: the stem is deterministic in training and
    evaluation alike. Shapes: hidden (N, T, D), attention mask (N, 1, T, T), (N, 1, 1, T) or
    None → (N, T, D).
    """

    frozen_stem = True

    def __init__(self, base_layer: nn.Module) -> None:
        super().__init__()
        self.base_layer = inert_dropouts(base_layer).requires_grad_(False)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> Any:
        n = hidden.shape[0]
        with torch.no_grad():
            per_row = attention_mask is not None and attention_mask.shape[0] == n
            key = hidden.reshape(n, -1)
            if attention_mask is not None and per_row:
                key = torch.cat([key, attention_mask.reshape(n, -1).to(key.dtype)], 1)
            distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
            if len(distinct) == n:  # nothing repeated (one member, or evaluation of one)
                return self.base_layer(hidden, attention_mask, *args, **kwargs)
            first = torch.full((len(distinct),), n, dtype=torch.long, device=hidden.device)
            first = first.scatter_reduce(0, inverse, torch.arange(n, device=hidden.device),
                                         "amin")                                   # (U,)
            mask = attention_mask[first] if attention_mask is not None and per_row \
                else attention_mask
            out = self.base_layer(hidden[first], mask, *args, **kwargs)            # (U, T, D)
        if isinstance(out, tuple):  # transformers < 5: (hidden, …)
            return (out[0][inverse], *out[1:])
        return out[inverse]                                                        # (N, T, D)


def freeze_stem(model: nn.Module, blocks: int, backbone: str) -> int:
    """Wrap the first ``blocks`` transformer blocks of a Hugging Face encoder (``encoder.layer``,
    BERT's layout) in :class:`FrozenRows`; the number of blocks left to adapt."""
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"backbone '{backbone}': backbone.frozen_blocks needs an encoder with "
                         f"BERT's layout (encoder.layer); {type(model).__name__} has none. "
                         f"Set backbone.frozen_blocks=0")
    if not 0 <= blocks < len(layers):
        raise ValueError(f"backbone '{backbone}': backbone.frozen_blocks={blocks} must leave "
                         f"at least one of its {len(layers)} blocks to adapt (0 … "
                         f"{len(layers) - 1})")
    for i in range(blocks):
        layers[i] = FrozenRows(layers[i])
    embeddings = cast(nn.Module, model.embeddings)
    inert_dropouts(embeddings).requires_grad_(False)
    setattr(embeddings, "frozen_stem", True)  # noqa: B010  # below the stem: frozen too (stem_parameters)
    return len(layers) - blocks
