"""SVE — Singular Value Ensemble (P1), and SVF, its single-member ablation: the method.

It wraps every targeted linear layer of the backbone in an :class:`SVELinear` (the layer, its
decomposition and its speed options live in :mod:`uqbench.methods.sve_layers`) and gives each
member its own head. Options following P1's public minimal code: ``qkv: fused`` decomposes a
fused 3d×d qkv matrix (timm ViTs) as one (d singular values), ``split`` decomposes q, k and v
apart (3d singular values, as P1's text counts and as BERT's separate projections get);
``clamp_singular_values`` uses max(s_m, 0) in the forward; ``head_init: p1`` starts the heads at
N(0, 0.01²), bias 0.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import Batch, DataInfo, one_of
from uqbench.methods.ensemble import EnsembleMethod, check_sigma
from uqbench.methods.heads import HeadInit
from uqbench.methods.member_layers import (
    Qkv,
    Targets,
    check_qkv,
    fused_qkv,
    replace_linears,
    resolve_targets,
    wrapped_bytes,
)
from uqbench.methods.sve_layers import ForwardMode, SplitSVELinear, SVELinear, check_rank

log = logging.getLogger("uqbench")


class SVE(EnsembleMethod):
    """Singular Value Ensemble over the backbone's targeted linear layers.

    members: M (SVF = 1). sigma_init: σ_init of the multiplicative init (0.01; 0 = exact copies).
    forward_mode: auto | factorized | materialized. targets: null/all (backbone.targets),
    attention, or a list of suffixes. pretrained_decay: λ of an optional penalty
    λ/2 · Σ ‖s_m − s‖² pulling the singular values toward the pretrained ones (the trainer's
    AdamW weight decay pulls them toward 0, as in P1's release; use one or the other).
    svd_cache: folder for the SVD factors (worth it for LLaMA-2-7B's 224 matrices), null = off.
    release_pretrained: drop each wrapped layer's W and b after its SVD (default; they are never
    read again); false keeps them, e.g. to unwrap the model later.
    qkv: fused | split, how a backbone's fused q/k/v layers (``backbone.fused_qkv``) are
    decomposed (a no-op on backbones without one). clamp_singular_values: use max(s_m, 0).
    head_init: default | p1 (N(0, 0.01²) weights, zero bias).
    rank: null (every singular direction adapts: SVE) | k, top-k SVE, the memory option: each
    member adapts only the k largest singular directions of every layer (per q, k, v block
    when split) over the kept pretrained W (:class:`SVELinear`); 1 <= k <= min(out, in) of
    every targeted layer. cache_weights: in evaluation, keep the member weights W_m between
    calls (M·out·in values per layer; full rank only).
    Trains each wrapped layer's sve_s and sve_bias and the heads.
    """

    speed_options: tuple[str, ...] = ("cache_weights",)  # not part of a run's identity

    def __init__(self, backbone: Backbone, info: DataInfo, members: int = 4,
                 sigma_init: float = 0.01, forward_mode: ForwardMode = "auto",
                 targets: Targets = None, pretrained_decay: float = 0.0,
                 svd_cache: str | None = None, release_pretrained: bool = True,
                 qkv: Qkv = "fused", clamp_singular_values: bool = False,
                 head_init: HeadInit = "default", rank: int | None = None,
                 cache_weights: bool = True, name: str = "sve") -> None:
        sigma_init = check_sigma(sigma_init)
        qkv = check_qkv(qkv)
        forward_mode = one_of("method.forward_mode", forward_mode, ForwardMode)
        if float(pretrained_decay) < 0:
            raise ValueError(f"method.pretrained_decay must be >= 0, got {pretrained_decay}")
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, members, name, head_init)
        self.sigma_init = sigma_init
        self.forward_mode = forward_mode
        self.pretrained_decay = float(pretrained_decay)
        self.qkv, self.clamp = qkv, bool(clamp_singular_values)
        self.head_init = head_init
        cache = None if svd_cache is None else Path(svd_cache) / backbone.name

        def split(n: str) -> bool:
            return qkv == "split" and fused_qkv(backbone, n)

        self.rank = check_rank(rank, self.encoder, suffixes, split)
        self.cache_weights = bool(cache_weights)

        def wrap(n: str, layer: nn.Linear) -> SVELinear:
            kind = SplitSVELinear if split(n) else SVELinear
            return kind(layer, self.members, self.sigma_init, forward_mode, cache, n,
                        release_pretrained, self.clamp, self.rank, self.cache_weights)

        self.targets = suffixes
        self.replaced = replace_linears(self.encoder, suffixes, wrap, name)
        self.release_pretrained = bool(release_pretrained)
        self.released_params = sum(m.released for m in self.layers())
        log.info("%s: wrapped %d linear layers (%s)", name, len(self.replaced), suffixes)
        self.train_declared()

    def layers(self) -> list[SVELinear]:
        return [m for m in self.encoder.modules() if isinstance(m, SVELinear)]

    def loss(self, batch: Batch) -> torch.Tensor:
        loss = super().loss(batch)
        if self.pretrained_decay > 0:
            penalty = sum(((m.sve_s - m.sve_s0.float()) ** 2).sum() for m in self.layers())
            loss = loss + 0.5 * self.pretrained_decay * penalty
        return loss

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "sigma_init": self.sigma_init, "forward_mode": self.forward_mode,
            "targets": ",".join(self.targets), "replaced_layers": len(self.replaced),
            "pretrained_decay": self.pretrained_decay,
            "release_pretrained": self.release_pretrained, "qkv": self.qkv,
            "split_qkv_layers": sum(isinstance(m, SplitSVELinear) for m in self.layers()),
            "clamp_singular_values": self.clamp, "head_init": self.head_init,
            "rank": self.rank, "cache_weights": self.cache_weights}

    def param_counts(self) -> dict[str, int | float]:
        """The ensemble's counts (:meth:`EnsembleMethod.param_counts`) and targeted_bytes:
        everything the wrapped layers hold (kept pretrained weights, frozen factors, the
        members' singular values and biases) at the dtypes used."""
        return super().param_counts() | {"targeted_bytes": wrapped_bytes(self.encoder)}
