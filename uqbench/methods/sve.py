"""SVE — Singular Value Ensemble (P1), and SVF, its single-member ablation.

Each targeted pretrained linear layer W (out×in) with bias b is decomposed once,
W = U diag(s) Vᵀ (float32 SVD, r = min(out, in)); U and V are frozen and shared by all members.
Member m owns singular values s_m (r) and a bias b_m (out), initialised
s_m = s ⊙ (1 + ε_m), ε_m ~ N(0, σ_init² I), and b_m = b + σ_init·N(0, I) (no bias for bias-free
layers). With σ_init = 0 every member reproduces the pretrained layer.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uqbench.contracts import Batch, DataInfo
from uqbench.methods.ensemble import EnsembleMethod
from uqbench.methods.layers import (
    MemberLinear,
    replace_linears,
    resolve_targets,
    split_members,
)

log = logging.getLogger("uqbench")
FORWARD_MODES = ("auto", "factorized", "materialized")


def svd(weight: torch.Tensor, cache: Path | None = None, key: str = ""
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U (out, r), s (r,), V (in, r) of W = U diag(s) Vᵀ, computed in float32.

    With ``cache`` set the factors are stored as ``<cache>/<key>.pt`` and reused when the
    weight's fingerprint (shape, dtype, a hash of the values) still matches.
    """
    w = weight.detach()
    if cache is None or w.device.type == "meta":
        U, s, Vh = torch.linalg.svd(w.float(), full_matrices=False)
        return U, s, Vh.mT
    digest = hashlib.sha1(w.float().cpu().numpy().tobytes()).hexdigest()[:16]
    fingerprint = f"{tuple(w.shape)}:{w.dtype}:{digest}"
    path = Path(cache) / f"{key}.pt"
    if path.is_file():
        stored = torch.load(path, map_location=w.device)
        if stored.get("fingerprint") == fingerprint:
            return stored["U"], stored["s"], stored["V"]
    U, s, Vh = torch.linalg.svd(w.float(), full_matrices=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"fingerprint": fingerprint, "U": U.cpu(), "s": s.cpu(), "V": Vh.mT.cpu()}, path)
    return U, s, Vh.mT


class SVELinear(MemberLinear):
    """Per-member singular values and biases over a frozen SVD of the wrapped linear layer.

    Input (M·B, …, in) in member-major order (rows m·B:(m+1)·B are member m's), output
    (M·B, …, out). Member m computes
        factorised:   y = ((x V) ⊙ s_m) Uᵀ + b_m
        materialised: y = x W_mᵀ + b_m,  W_m = U diag(s_m) Vᵀ  (built once per call)
    Both give the same numbers; ``forward_mode=auto`` picks the one with fewer FLOPs for the
    number of rows N per member: N·r·(in + out) against out·r·in + N·in·out.

    Buffers (frozen, not saved in state_dict): sve_U (out, r), sve_V (in, r), sve_s0 (r,).
    Parameters (float32, the ``adapter_names``): sve_s (M, r), sve_bias (M, out) or None for
    bias-free layers.

    ``release_pretrained``: drop the wrapped layer's W and b once decomposed (the forward never
    reads them): U and V replace W, so the layer costs (out + in)·r instead of out·in + (out + in)·r
    — for LLaMA-2-7B 20.5 GB instead of 33.7 GB in bf16. ``released`` counts the dropped entries.
    """

    adapter_names = ("sve_s", "sve_bias")

    def __init__(self, base_layer: nn.Linear, members: int, sigma_init: float,
                 forward_mode: str = "auto", cache: Path | None = None, key: str = "",
                 release_pretrained: bool = False) -> None:
        super().__init__(base_layer, members)
        self.forward_mode = forward_mode
        W = base_layer.weight
        U, s, V = svd(W, cache, key)
        self.rank = s.shape[0]
        self.register_buffer("sve_U", U.to(W.dtype), persistent=False)
        self.register_buffer("sve_V", V.to(W.dtype), persistent=False)
        self.register_buffer("sve_s0", s.to(W.dtype), persistent=False)
        eps = torch.randn(members, self.rank, device=W.device) * sigma_init
        self.sve_s = nn.Parameter(s.float() * (1 + eps))                       # (M, r)
        if base_layer.bias is not None:
            noise = torch.randn(members, self.out_features, device=W.device) * sigma_init
            self.sve_bias = nn.Parameter(base_layer.bias.detach().float() + noise)  # (M, out)
        else:
            self.register_parameter("sve_bias", None)
        self.released = 0
        if release_pretrained:
            self.released = sum(p.numel() for p in base_layer.parameters())
            self.base_layer = None

    def flops(self, rows: int) -> dict[str, int]:
        """Multiply-adds per member for ``rows`` input rows, in both forms."""
        r, i, o = self.rank, self.in_features, self.out_features
        return {"factorized": rows * r * (i + o), "materialized": o * r * i + rows * i * o}

    def member_weights(self) -> torch.Tensor:
        """W_m = U diag(s_m) Vᵀ for all members: (M, out, in)."""
        s = self.sve_s.to(self.sve_U.dtype)
        return (self.sve_U * s[:, None, :]) @ self.sve_V.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xm = split_members(x, self.members)                                      # (M, N, in)
        mode = self.forward_mode
        if mode == "auto":
            f = self.flops(xm.shape[1])
            mode = "factorized" if f["factorized"] <= f["materialized"] else "materialized"
        s = self.sve_s.to(x.dtype)
        if mode == "factorized":
            y = ((xm @ self.sve_V.to(x.dtype)) * s[:, None, :]) @ self.sve_U.to(x.dtype).T
        else:
            y = xm @ self.member_weights().to(x.dtype).transpose(1, 2)          # (M, N, out)
        if self.sve_bias is not None:
            y = y + self.sve_bias.to(x.dtype)[:, None, :]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, forward_mode={self.forward_mode}"


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
    Trains each wrapped layer's sve_s and sve_bias and the heads.
    """

    def __init__(self, backbone: Any, info: DataInfo, members: int = 4,
                 sigma_init: float = 0.01, forward_mode: str = "auto",
                 targets: str | Sequence[str] | None = None, pretrained_decay: float = 0.0,
                 svd_cache: str | None = None, release_pretrained: bool = True,
                 name: str = "sve") -> None:
        if float(sigma_init) < 0:
            raise ValueError(f"method.sigma_init must be >= 0 (P1: 0.01, robust in 0.001–0.1), "
                             f"got {sigma_init}")
        if forward_mode not in FORWARD_MODES:
            raise ValueError(f"method.forward_mode '{forward_mode}' is not one of "
                             f"{FORWARD_MODES}")
        if float(pretrained_decay) < 0:
            raise ValueError(f"method.pretrained_decay must be >= 0, got {pretrained_decay}")
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, members, name)
        self.sigma_init = float(sigma_init)
        self.forward_mode = forward_mode
        self.pretrained_decay = float(pretrained_decay)
        cache = None if svd_cache is None else Path(svd_cache) / backbone.name
        self.targets = suffixes
        self.replaced = replace_linears(
            self.encoder, suffixes,
            lambda n, layer: SVELinear(layer, self.members, self.sigma_init, forward_mode,
                                       cache, n, release_pretrained),
            name)
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
            "release_pretrained": self.release_pretrained}
