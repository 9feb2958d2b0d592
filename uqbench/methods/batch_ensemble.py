"""BatchEnsemble (Wen, Tran & Ba, ICLR 2020) over the targeted linear layers of a backbone.

Member m's weight is the shared weight W (out × in) scaled by a rank-one matrix of its own,
W_m = W ∘ (s_m r_mᵀ), so that a layer computes y = ((x ∘ r_m) Wᵀ) ∘ s_m + b_m with r_m (in,),
s_m (out,) and a bias b_m (out,) per member, started from the wrapped layer's bias. All members
run in one batch (``uqbench.methods.member_layers``: the input repeated once at the stem,
member-major).

``train_shared: false`` keeps every pretrained weight frozen and trains r, s, b and the heads
(the parameter-efficient form); ``true`` trains the shared weights as well (the paper's recipe:
every weight of the network trains), i.e. the whole encoder is fine-tuned and only r, s, b and
the heads belong to single members.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import DataInfo, one_of
from uqbench.methods.base import MemberParameters
from uqbench.methods.ensemble import EnsembleMethod, check_members
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

Init = Literal["random_sign", "normal"]
INITS: tuple[str, ...] = get_args(Init)


def check_init_std(value: Any) -> float:
    """``value`` as a float > 0, or a ValueError naming it."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not float(value) > 0:
        raise ValueError(f"method.init_std must be a number > 0 (the σ of init=normal, "
                         f"N(1, σ²); 0.5 as torch-uncertainty), got {value!r}")
    return float(value)


def fast_weights(shape: tuple[int, ...], init: str, std: float,
                 device: torch.device) -> torch.Tensor:
    """A float32 tensor of ``shape`` for r or s. random_sign: every entry +1 or −1 with
    probability ½ each (edward2's ``RandomSign(0.5)``, uncertainty-baselines'
    ``random_sign_init=0.5``); normal: N(1, std²) (torch-uncertainty's ``BatchLinear``:
    ``nn.init.normal_(mean=1.0, std=0.5)``)."""
    if init == "random_sign":
        return torch.randint(0, 2, shape, device=device).float() * 2 - 1
    return torch.empty(shape, device=device).normal_(1.0, std)


class BatchEnsembleLinear(MemberLinear):
    """Per-member rank-one scaling of a linear layer's weight: W_m = W ∘ (s_m r_mᵀ).

    Input (M·B, …, in) in member-major order (rows m·B:(m+1)·B are member m's), output
    (M·B, …, out) = ((x ∘ r_m) Wᵀ) ∘ s_m + b_m for member m's rows, computed as one GEMM with
    the shared W over all M·N rows. Parameters (float32, the ``adapter_names``): be_r (M, in),
    be_s (M, out), drawn by :func:`fast_weights`; be_bias (M, out), every row the wrapped
    layer's bias, or None for a bias-free layer. b_m replaces the wrapped layer's bias, which is
    dropped (``released`` counts its entries); W stays in ``base_layer`` and is shared.
    """

    adapter_names = ("be_r", "be_s", "be_bias")
    splits = 1  # input-side vectors per member (SplitBatchEnsembleLinear: q, k, v)

    def __init__(self, base_layer: nn.Linear, members: int, init: str = "random_sign",
                 init_std: float = 0.5, name: str = "") -> None:
        super().__init__(base_layer, members)
        if self.out_features % self.splits:
            raise ValueError(f"method.qkv=split: layer '{name}' has {self.out_features} "
                             f"outputs, not q, k and v of equal width (a multiple of "
                             f"{self.splits}); use method.qkv=fused or fix backbone.fused_qkv")
        self.init, self.init_std = init, init_std
        device = base_layer.weight.device
        r_shape = (members, self.in_features) if self.splits == 1 else \
            (members, self.splits, self.in_features)
        self.be_r = nn.Parameter(fast_weights(r_shape, init, init_std, device))
        self.be_s = nn.Parameter(fast_weights((members, self.out_features), init, init_std,
                                              device))
        self.released = 0
        if base_layer.bias is not None:
            bias = base_layer.bias.detach().float()
            self.be_bias = nn.Parameter(bias.expand(members, -1).clone())       # (M, out)
            self.released = bias.numel()
            base_layer.register_parameter("bias", None)  # b_m replaces it: never read again
        else:
            self.register_parameter("be_bias", None)

    def shared_product(self, xm: torch.Tensor) -> torch.Tensor:
        """(x ∘ r_m) Wᵀ for every member: xm (M, N, in) → (M, N, out)."""
        return self.base_layer(xm * self.be_r.to(xm.dtype)[:, None, :])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared_product(split_members(x, self.members))                  # (M, N, out)
        y = h * self.be_s.to(h.dtype)[:, None, :]
        if self.be_bias is not None:
            y = y + self.be_bias.to(h.dtype)[:, None, :]
        return y.reshape(*x.shape[:-1], self.out_features)

    def saved_values(self, rows: int) -> int:
        """(x ∘ r_m) Wᵀ (M, N, out), kept for the gradient of s_m; when W trains also
        x ∘ r_m (M, N, in), per q, k, v block when split, kept for W's gradient."""
        values = self.members * rows * self.out_features
        if self.base_layer.weight.requires_grad:
            values += self.members * rows * self.in_features * self.splits
        return values

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init={self.init}"


class SplitBatchEnsembleLinear(BatchEnsembleLinear):
    """BatchEnsemble on a fused q/k/v layer with q, k and v treated as three layers
    (``qkv: split``), as on a backbone with separate projections.

    The wrapped layer's outputs (3·o) are q, k, v in that order, W = [W_q; W_k; W_v]. Each
    block gets its own input-side vector: be_r (M, 3, in); be_s (M, 3·o) and be_bias (M, 3·o)
    are per output already, so they are the same tensors as in the fused form. Input
    (M·B, …, in) member-major, output (M·B, …, 3·o) = [((x ∘ r_mj) W_jᵀ) ∘ s_mj]_{j=q,k,v} + b_m.
    With r_mq = r_mk = r_mv this is the fused form's output.
    """

    splits = 3

    def shared_product(self, xm: torch.Tensor) -> torch.Tensor:
        S, o = self.splits, self.out_features // self.splits
        W = self.base_layer.weight.view(S, o, self.in_features)                  # (3, o, in)
        xr = xm[:, None] * self.be_r.to(xm.dtype)[:, :, None, :]                 # (M, 3, N, in)
        h = xr @ W.transpose(1, 2)                                               # (M, 3, N, o)
        return h.transpose(1, 2).flatten(2)                                      # (M, N, 3·o)


class BatchEnsemble(EnsembleMethod):
    """M BatchEnsemble members over one backbone, each with its own head.

    members: M. init: random_sign (default, the paper's random sign vectors) | normal
    (N(1, init_std²), torch-uncertainty's BatchLinear init; init_std 0.5 as there), for every
    r and s. targets: all (default: backbone.targets, every linear layer of a block),
    attention, or a list of suffixes. qkv: split (default: q, k and v of a fused qkv layer
    get their own r, as on backbones with separate projections) | fused (one r for the fused
    matrix); a no-op on backbones without fused layers (``backbone.fused_qkv``).
    train_shared: false (default) trains each wrapped layer's be_r, be_s, be_bias and the heads;
    true also fine-tunes the encoder's shared weights (every W, norms, embeddings, untargeted
    layers), which all members share.
    """

    def __init__(self, backbone: Backbone, info: DataInfo, members: int = 4,
                 init: Init = "random_sign", init_std: float = 0.5, targets: Targets = "all",
                 qkv: Qkv = "split", train_shared: bool = False,
                 name: str = "batch_ensemble") -> None:
        members = check_members(members)
        init = one_of("method.init", init, Init)
        init_std = check_init_std(init_std)
        qkv = check_qkv(qkv)
        if not isinstance(train_shared, bool):
            raise ValueError(f"method.train_shared must be true or false, got {train_shared!r}")
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, members, name)
        self.init, self.init_std = init, init_std
        self.qkv, self.train_shared = qkv, train_shared

        def wrap(n: str, layer: nn.Linear) -> BatchEnsembleLinear:
            kind = SplitBatchEnsembleLinear if qkv == "split" and fused_qkv(backbone, n) \
                else BatchEnsembleLinear
            return kind(layer, self.members, init, init_std, n)

        self.targets = suffixes
        self.replaced = replace_linears(self.encoder, suffixes, wrap, name)
        self.released_params = sum(m.released for m in self.layers())
        self.train_declared()

    def layers(self) -> list[BatchEnsembleLinear]:
        return [m for m in self.encoder.modules() if isinstance(m, BatchEnsembleLinear)]

    def fine_tuned(self) -> list[nn.Module]:
        """train_shared: the encoder, whose parameters outside the wrappers' r, s, b are shared
        by all members (the wrapped layers' W included); nothing otherwise."""
        return [self.encoder] if self.train_shared else []

    def member_parameters(self) -> MemberParameters:
        """Heads and every wrapper's r, s, b are stacked (M, …); with train_shared the rest of
        the encoder is one shared group (the fine-tuned encoder also holds the stacked
        tensors: they are listed once, as stacked)."""
        groups = super().member_parameters()
        stacked = {id(p) for p in groups.stacked}
        groups.shared = [p for p in groups.shared if id(p) not in stacked]
        return groups

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "init": self.init, "init_std": self.init_std, "targets": ",".join(self.targets),
            "replaced_layers": len(self.replaced), "qkv": self.qkv,
            "split_qkv_layers": sum(isinstance(m, SplitBatchEnsembleLinear)
                                    for m in self.layers()),
            "train_shared": self.train_shared}
