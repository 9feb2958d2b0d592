"""SVE — Singular Value Ensemble (P1), and SVF, its single-member ablation.

Each targeted pretrained linear layer W (out×in) with bias b is decomposed once,
W = U diag(s) Vᵀ (float32 SVD on W's device, r = min(out, in)); U and V are frozen and shared
by all members, held as frozen parameters (requires_grad False) so that FSDP shards them.
Member m owns singular values s_m (r) and a bias b_m (out), initialised
s_m = s ⊙ (1 + ε_m), ε_m ~ N(0, σ_init² I), and b_m = b + σ_init·N(0, I) (no bias for bias-free
layers). With σ_init = 0 every member reproduces the pretrained layer.

Options following P1's public minimal code: ``qkv: fused`` decomposes a fused 3d×d qkv matrix
(timm ViTs) as one (d singular values), ``split`` decomposes q, k and v apart (3d singular
values, as P1's text counts and as BERT's separate projections get); ``clamp_singular_values``
uses max(s_m, 0) in the forward; ``head_init: p1`` starts the heads at N(0, 0.01²), bias 0.
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
from uqbench.methods.ensemble import EnsembleMethod, check_sigma
from uqbench.methods.layers import (
    MemberLinear,
    check_qkv,
    frozen,
    fused_qkv,
    replace_linears,
    resolve_targets,
    split_members,
)

log = logging.getLogger("uqbench")
FORWARD_MODES = ("auto", "factorized", "materialized")


def svd(weight: torch.Tensor, cache: Path | None = None, key: str = ""
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U (out, r), s (r,), V (in, r) of W = U diag(s) Vᵀ, computed in float32 on W's device
    (the runner places the backbone before the method wraps it, so a GPU decomposes; CUDA has
    no 16-bit SVD, hence float32 whatever W's dtype).

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

    Frozen parameters (the ``frozen_names``, requires_grad False, in W's dtype and on W's
    device): sve_U (out, r), sve_V (in, r), sve_s0 (r,). Trained parameters (float32, the
    ``adapter_names``): sve_s (M, r), sve_bias (M, out) or None for bias-free layers.

    ``release_pretrained``: drop the wrapped layer's W and b once decomposed (the forward never
    reads them): U and V replace W, so the layer costs (out + in)·r instead of out·in + (out + in)·r
    — for LLaMA-2-7B 20.5 GB instead of 33.7 GB in bf16. ``released`` counts the dropped entries.
    ``clamp``: the forward uses max(s_m, 0) (P1's public code), so no singular value turns
    negative however far training moves it.
    """

    adapter_names = ("sve_s", "sve_bias")
    frozen_names = ("sve_U", "sve_V", "sve_s0")

    def __init__(self, base_layer: nn.Linear, members: int, sigma_init: float,
                 forward_mode: str = "auto", cache: Path | None = None, key: str = "",
                 release_pretrained: bool = False, clamp: bool = False) -> None:
        super().__init__(base_layer, members)
        self.forward_mode = forward_mode
        self.clamp = bool(clamp)
        W = base_layer.weight
        U, s, V = self.decompose(W, cache, key)
        self.rank = s.shape[-1]
        # frozen parameters, not buffers: FSDP shards parameters only (U and V are most of the
        # layer's memory); the factors are on W's device and in W's dtype
        self.sve_U = frozen(U.to(W.dtype))                                      # (out, r)
        self.sve_V = frozen(V.to(W.dtype))                                      # (in, r)
        self.sve_s0 = frozen(s.to(W.dtype))                                     # (r,)
        eps = torch.randn(members, *s.shape, device=W.device) * sigma_init
        self.sve_s = nn.Parameter(s.float() * (1 + eps))             # (M, r) or (M, 3, r)
        if base_layer.bias is not None:
            noise = torch.randn(members, self.out_features, device=W.device) * sigma_init
            self.sve_bias = nn.Parameter(base_layer.bias.detach().float() + noise)  # (M, out)
        else:
            self.register_parameter("sve_bias", None)
        self.released = 0
        if release_pretrained:
            self.released = sum(p.numel() for p in base_layer.parameters())
            self.base_layer = None

    def decompose(self, W: torch.Tensor, cache: Path | None, key: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U (out, r), s (r,), V (in, r) of the wrapped weight W (out, in)."""
        return svd(W, cache, key)

    def singular_values(self, dtype: torch.dtype) -> torch.Tensor:
        """The members' singular values as the forward uses them, (M, …) in ``dtype``."""
        s = self.sve_s.clamp_min(0) if self.clamp else self.sve_s
        return s.to(dtype)

    def flops(self, rows: int) -> dict[str, int]:
        """Multiply-adds per member for ``rows`` input rows, in both forms."""
        r, i, o = self.rank, self.in_features, self.out_features
        return {"factorized": rows * r * (i + o), "materialized": o * r * i + rows * i * o}

    def mode(self, rows: int) -> str:
        """The forward form for ``rows`` input rows per member: forward_mode, or under auto
        the form with fewer multiply-adds (:meth:`flops`)."""
        if self.forward_mode != "auto":
            return self.forward_mode
        f = self.flops(rows)
        return "factorized" if f["factorized"] <= f["materialized"] else "materialized"

    def saved_values(self, rows: int) -> int:
        """Factorised: x V (M, N, r), kept for the gradient of s_m; materialised: the member
        weights (M, out, in). U and V are frozen, so nothing else is kept."""
        if self.mode(rows) == "factorized":
            return self.members * rows * self.sve_s[0].numel()
        return self.members * self.out_features * self.in_features

    def member_weights(self) -> torch.Tensor:
        """W_m = U diag(s_m) Vᵀ for all members: (M, out, in)."""
        s = self.singular_values(self.sve_U.dtype)
        return (self.sve_U * s[:, None, :]) @ self.sve_V.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xm = split_members(x, self.members)                                      # (M, N, in)
        mode = self.mode(xm.shape[1])
        s = self.singular_values(x.dtype)
        if mode == "factorized":
            y = ((xm @ self.sve_V.to(x.dtype)) * s[:, None, :]) @ self.sve_U.to(x.dtype).T
        else:
            y = xm @ self.member_weights().to(x.dtype).transpose(1, 2)          # (M, N, out)
        if self.sve_bias is not None:
            y = y + self.sve_bias.to(x.dtype)[:, None, :]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, forward_mode={self.forward_mode}"


class SplitSVELinear(SVELinear):
    """SVE on a fused q/k/v layer with q, k and v decomposed apart (``qkv: split``).

    The wrapped weight (3·o, in) holds W_q, W_k, W_v (o × in each) stacked along the outputs;
    each gets its own float32 SVD W_j = U_j diag(s_j) V_jᵀ, r = min(o, in). Frozen: sve_U
    (3, o, r), sve_V (3, in, r), sve_s0 (3, r). Trained: sve_s (M, 3, r), sve_bias (M, 3·o).
    Input (M·B, …, in) member-major, output (M·B, …, 3·o): member m computes
        factorised:   y_j = ((x V_j) ⊙ s_mj) U_jᵀ,  y = [y_q, y_k, y_v] + b_m
        materialised: y = x W_mᵀ + b_m,  W_m = [U_j diag(s_mj) V_jᵀ]_j stacked  (3·o, in)
    With σ_init = 0 it reproduces the fused layer.
    """

    splits = 3

    def decompose(self, W: torch.Tensor, cache: Path | None, key: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U (3, o, r), s (3, r), V (3, in, r): one SVD per q, k, v block of W (3·o, in)."""
        if W.shape[0] % self.splits:
            raise ValueError(f"method.qkv=split: layer '{key}' has {W.shape[0]} outputs, not "
                             f"q, k and v of equal width (a multiple of {self.splits}); use "
                             f"method.qkv=fused or fix backbone.fused_qkv")
        parts = [svd(w, cache, f"{key}.{j}") for j, w in enumerate(W.chunk(self.splits))]
        return tuple(torch.stack(f) for f in zip(*parts, strict=True))          # type: ignore

    def flops(self, rows: int) -> dict[str, int]:
        r, i, o = self.rank, self.in_features, self.out_features // self.splits
        return {"factorized": self.splits * rows * r * (i + o),
                "materialized": self.splits * o * r * i + rows * i * self.splits * o}

    def member_weights(self) -> torch.Tensor:
        """W_m for all members: (M, 3·o, in)."""
        s = self.singular_values(self.sve_U.dtype)                               # (M, 3, r)
        W = (self.sve_U * s[:, :, None, :]) @ self.sve_V.transpose(1, 2)        # (M, 3, o, in)
        return W.flatten(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xm = split_members(x, self.members)                                      # (M, N, in)
        mode = self.mode(xm.shape[1])
        if mode == "factorized":
            s = self.singular_values(x.dtype)                                    # (M, 3, r)
            h = torch.einsum("mni,jir->mjnr", xm, self.sve_V.to(x.dtype)) * s[:, :, None, :]
            y = torch.einsum("mjnr,jor->mnjo", h, self.sve_U.to(x.dtype)).flatten(2)
        else:
            y = xm @ self.member_weights().to(x.dtype).transpose(1, 2)          # (M, N, 3·o)
        if self.sve_bias is not None:
            y = y + self.sve_bias.to(x.dtype)[:, None, :]
        return y.reshape(*x.shape[:-1], self.out_features)


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
    Trains each wrapped layer's sve_s and sve_bias and the heads.
    """

    def __init__(self, backbone: Any, info: DataInfo, members: int = 4,
                 sigma_init: float = 0.01, forward_mode: str = "auto",
                 targets: str | Sequence[str] | None = None, pretrained_decay: float = 0.0,
                 svd_cache: str | None = None, release_pretrained: bool = True,
                 qkv: str = "fused", clamp_singular_values: bool = False,
                 head_init: str = "default", name: str = "sve") -> None:
        sigma_init = check_sigma(sigma_init)
        qkv = check_qkv(qkv)
        if forward_mode not in FORWARD_MODES:
            raise ValueError(f"method.forward_mode '{forward_mode}' is not one of "
                             f"{FORWARD_MODES}")
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

        def wrap(n: str, layer: nn.Linear) -> SVELinear:
            kind = SplitSVELinear if qkv == "split" and fused_qkv(backbone, n) else SVELinear
            return kind(layer, self.members, self.sigma_init, forward_mode, cache, n,
                        release_pretrained, self.clamp)

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
            "clamp_singular_values": self.clamp, "head_init": self.head_init}
