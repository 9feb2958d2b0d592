"""LoRA-Ensemble (Mühlematter et al., arXiv 2405.14438).

Member m adds a low-rank update to each targeted frozen layer: y = W x + b + scaling·B_m A_m x,
A_m (r×in), B_m (out×r). As in the official code: B = 0 and A Xavier-uniform with gain 10 (so
members start equal to the pretrained model and diverge through A), no α/r scaling, targets q, k,
v and the attention output (the backbone's ``attention_targets``), with separate adapters for
q, k and v also where the backbone computes them with one fused layer (timm ViTs, ``qkv:
split``; ``fused`` puts one adapter on the fused matrix instead).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import DataInfo
from uqbench.methods.ensemble import EnsembleMethod, positive_int
from uqbench.methods.member_layers import (
    MemberLinear,
    Qkv,
    Targets,
    check_qkv,
    fused_qkv,
    replace_linears,
    resolve_targets,
    split_members,
)


class LoRALinear(MemberLinear):
    """Per-member low-rank adapters on a frozen linear layer.

    Input (M·B, …, in) in member-major order (rows m·B:(m+1)·B are member m's), output
    (M·B, …, out) = base_layer(x) + scaling · (x A_mᵀ) B_mᵀ for member m's rows.
    Parameters (float32, the ``adapter_names``): lora_A (M, r, in), Xavier-uniform with gain
    ``init_gain`` per member (fan_in = in, fan_out = r); lora_B (M, out, r), zeros.
    """

    adapter_names = ("lora_A", "lora_B")

    def __init__(self, base_layer: nn.Linear, members: int, rank: int, init_gain: float,
                 scaling: float) -> None:
        super().__init__(base_layer, members)
        self.rank, self.scaling = rank, scaling
        device = base_layer.weight.device
        bound = init_gain * math.sqrt(6.0 / (self.in_features + rank))
        self.lora_A = nn.Parameter(
            torch.empty(members, rank, self.in_features, device=device).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(members, self.out_features, rank, device=device))

    def saved_values(self, rows: int) -> int:
        """x A_mᵀ (M, N, r) per member's rows (per q, k, v block when split), kept for the
        gradient of B_m."""
        return self.members * rows * self.lora_A[0].numel() // self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)                                                   # (M·B, …, out)
        xm = split_members(x, self.members)                                      # (M, N, in)
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        delta = (xm @ A.transpose(1, 2)) @ B.transpose(1, 2)                     # (M, N, out)
        return y + self.scaling * delta.reshape(y.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling}"


class SplitLoRALinear(LoRALinear):
    """Separate per-member adapters for q, k and v on a fused q/k/v layer (``qkv: split``).

    The wrapped layer's outputs (3·o) are q, k, v in that order. Parameters: lora_A
    (M, 3, r, in), each (r, in) block Xavier-uniform with gain ``init_gain`` (fan_in = in,
    fan_out = r, as one adapter of its own); lora_B (M, 3, o, r), zeros. Input (M·B, …, in)
    member-major, output (M·B, …, 3·o) = base_layer(x) + scaling · [x A_mjᵀ B_mjᵀ]_{j=q,k,v}.
    """

    splits = 3

    def __init__(self, base_layer: nn.Linear, members: int, rank: int, init_gain: float,
                 scaling: float, name: str = "") -> None:
        MemberLinear.__init__(self, base_layer, members)  # not LoRALinear's: other shapes
        if self.out_features % self.splits:
            raise ValueError(f"method.qkv=split: layer '{name}' has {self.out_features} "
                             f"outputs, not q, k and v of equal width (a multiple of "
                             f"{self.splits}); use method.qkv=fused or fix backbone.fused_qkv")
        self.rank, self.scaling = rank, scaling
        S, o, device = self.splits, self.out_features // self.splits, base_layer.weight.device
        bound = init_gain * math.sqrt(6.0 / (self.in_features + rank))
        self.lora_A = nn.Parameter(
            torch.empty(members, S, rank, self.in_features, device=device).uniform_(-bound, bound))
        self.lora_B = nn.Parameter(torch.zeros(members, S, o, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)                                                   # (M·B, …, 3·o)
        xm = split_members(x, self.members)                                      # (M, N, in)
        A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        h = torch.einsum("mni,mjri->mjnr", xm, A)                               # (M, 3, N, r)
        delta = torch.einsum("mjnr,mjor->mnjo", h, B).flatten(2)                # (M, N, 3·o)
        return y + self.scaling * delta.reshape(y.shape)


class LoRAEnsemble(EnsembleMethod):
    """M LoRA members over one frozen backbone.

    rank: r (8 in the official CIFAR runs). init_gain: Xavier gain of A (10, official).
    alpha: null = scaling 1 (official, no α/r); a number sets scaling = alpha / rank.
    targets: attention (default: backbone.attention_targets, i.e. q, k, v, o), all, or a list.
    qkv: split (official: separate q, k, v adapters on a fused qkv layer) | fused (one adapter
    on the fused matrix); a no-op on backbones without fused layers (``backbone.fused_qkv``).
    data_order: shared (official: the members train on the same mini-batches) | independent
    (member m on its own shuffled stream, as M separate runs; ``EnsembleMethod.set_data_order``).
    Trains each wrapped layer's lora_A and lora_B and the heads.
    """

    def __init__(self, backbone: Backbone, info: DataInfo, members: int = 4, rank: int = 8,
                 init_gain: float = 10.0, alpha: float | None = None,
                 targets: Targets = "attention", qkv: Qkv = "split",
                 data_order: str = "shared", name: str = "lora_ensemble") -> None:
        rank = positive_int(rank, "method.rank", " (the official CIFAR runs use 8)")
        qkv = check_qkv(qkv)
        if float(init_gain) <= 0:
            raise ValueError(f"method.init_gain must be > 0 (official: 10), got {init_gain}")
        if alpha is not None and float(alpha) <= 0:
            raise ValueError(f"method.alpha must be > 0 or null (no scaling), got {alpha}")
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, members, name)
        self.set_data_order(data_order)
        self.rank, self.init_gain = rank, float(init_gain)
        self.alpha = None if alpha is None else float(alpha)
        self.scaling = 1.0 if alpha is None else float(alpha) / rank
        self.qkv = qkv

        def wrap(n: str, layer: nn.Linear) -> LoRALinear:
            if qkv == "split" and fused_qkv(backbone, n):
                return SplitLoRALinear(layer, self.members, rank, self.init_gain, self.scaling, n)
            return LoRALinear(layer, self.members, rank, self.init_gain, self.scaling)

        self.targets = suffixes
        self.replaced = replace_linears(self.encoder, suffixes, wrap, name)
        self.train_declared()

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "rank": self.rank, "init_gain": self.init_gain, "alpha": self.alpha,
            "scaling": self.scaling, "targets": ",".join(self.targets),
            "data_order": self.data_order,
            "replaced_layers": len(self.replaced), "qkv": self.qkv,
            "split_qkv_layers": sum(isinstance(m, SplitLoRALinear) for m in self.modules())}
