"""The SVE layer: a pretrained linear layer decomposed once, each member adapting its
singular values (:class:`SVELinear`; :class:`SplitSVELinear` for fused q/k/v). The method
that wraps a backbone's layers with it is :class:`uqbench.methods.sve.SVE`.

Each targeted pretrained linear layer W (out×in) with bias b is decomposed once,
W = U diag(s) Vᵀ (float32 SVD on W's device, r = min(out, in)); U and V are frozen and shared
by all members, held as frozen parameters (requires_grad False) so that FSDP shards them.
Member m owns singular values s_m (r) and a bias b_m (out), initialised
s_m = s ⊙ (1 + ε_m), ε_m ~ N(0, σ_init² I), and b_m = b + σ_init·N(0, I) (no bias for bias-free
layers). With σ_init = 0 every member reproduces the pretrained layer.

Speed. A training call picks the factorised or the materialised form by the multiply-adds of
the forward AND backward pass (the materialised backward needs the full weight gradient and
its projection on the basis, the factorised one two thin products), so on ViT-S/16 the wide
layers (qkv, fc1, fc2) train factorised and the square proj materialised, together fewer
multiply-adds than a Deep Ensemble's step. Evaluation keeps the member weights between calls
(``cache_weights``), so inference does a Deep Ensemble's work. Memory: ``rank: k`` (top-k SVE)
keeps the pretrained W and adapts only the k largest singular directions, the layer's memory
then at most LoRA-Ensemble's on the same layers for small k.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.methods.member_layers import MemberLinear, frozen, matches, split_members

log = logging.getLogger("uqbench")
ForwardMode = Literal["auto", "factorized", "materialized"]


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
        materialised: y = x W_mᵀ + b_m,  W_m = U diag(s_m) Vᵀ  (built once per call, or cached)
    Both give the same numbers; ``forward_mode=auto`` picks, per call, the form with fewer
    multiply-adds for the N rows per member and for what the call does (:meth:`flops`): a
    training call (s_m needs a gradient) counts the forward and the backward pass, any other
    call the forward alone, with W_m free when it is cached.

    Frozen parameters (the ``frozen_names``, requires_grad False, in W's dtype and on W's
    device): sve_U (out, r), sve_V (in, r), sve_s0 (r,). Trained parameters (float32, the
    ``adapter_names``): sve_s (M, r), sve_bias (M, out) or None for bias-free layers.

    ``release_pretrained``: drop the wrapped layer's W and b once decomposed (the forward never
    reads them): U and V replace W, so the layer costs (out + in)·r instead of out·in + (out + in)·r
    — for LLaMA-2-7B 20.5 GB instead of 33.7 GB in bf16. ``released`` counts the dropped entries.
    ``clamp``: the forward uses max(s_m, 0) (P1's public code), so no singular value turns
    negative however far training moves it.

    ``rank`` k (top-k SVE, the memory option): only the k largest singular directions adapt,
        W_m = W + U_k diag(s_m − s) V_kᵀ,  y = x Wᵀ + ((x V_k) ⊙ (s_m − s)) U_kᵀ + b_m,
    with W the frozen pretrained weight, kept and shared (one GEMM over all M·N rows), U_k
    (out, k), V_k (in, k), s (k,) frozen and s_m (M, k) trained; ``release_pretrained`` then
    drops only the pretrained bias (b_m replaces it). The layer holds out·in + (out + in + 1)·k
    + M·(k + out) values instead of (out + in + 1)·r + M·(r + out); k = r is SVE itself.
    ``forward_mode`` does not apply. None = all r directions (SVE).

    ``cache_weights``: in evaluation mode without gradients, keep the member weights W_m
    (M, out, in) between calls and rebuild them only when s_m or the factors change (a new
    version or storage of the tensors; ``train()`` drops them): inference then does a Deep
    Ensemble's work, at the memory of M copies of W (M·out·in values per layer). Top-k layers
    never cache: they are the memory option.
    """

    adapter_names = ("sve_s", "sve_bias")
    frozen_names = ("sve_U", "sve_V", "sve_s0")
    splits = 1  # blocks decomposed apart (SplitSVELinear: q, k, v)

    def __init__(self, base_layer: nn.Linear, members: int, sigma_init: float,
                 forward_mode: ForwardMode = "auto", cache: Path | None = None, key: str = "",
                 release_pretrained: bool = False, clamp: bool = False,
                 rank: int | None = None, cache_weights: bool = False) -> None:
        super().__init__(base_layer, members)
        self.forward_mode = forward_mode
        self.clamp = bool(clamp)
        self.cache_weights = bool(cache_weights) and rank is None
        self._cached: tuple[tuple[object, ...], torch.Tensor] | None = None
        W = base_layer.weight
        U, s, V = self.decompose(W, cache, key)
        if rank is not None:  # the k largest singular directions (svd sorts them descending)
            U, s, V = (t[..., :rank].contiguous() for t in (U, s, V))
        self.top_k = rank is not None
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
        if release_pretrained and self.top_k:  # W stays (the shared GEMM), b_m replaces b
            self.released = 0 if base_layer.bias is None else base_layer.bias.numel()
            base_layer.register_parameter("bias", None)
        elif release_pretrained:
            self.released = sum(p.numel() for p in base_layer.parameters())
            self.base_layer = None  # type: ignore[assignment]  # released: never read again

    def decompose(self, W: torch.Tensor, cache: Path | None, key: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U (out, r), s (r,), V (in, r) of the wrapped weight W (out, in)."""
        return svd(W, cache, key)

    def singular_values(self, dtype: torch.dtype) -> torch.Tensor:
        """The members' singular values as the forward uses them, (M, …) in ``dtype``."""
        s = self.sve_s.clamp_min(0) if self.clamp else self.sve_s
        return s.to(dtype)

    def flops(self, rows: int, step: bool = False, input_grad: bool = True,
              cached: bool = False) -> dict[str, int]:
        """Multiply-adds per member for ``rows`` input rows, in both forms: the forward, or
        with ``step`` the forward and the backward (the input's gradient only if
        ``input_grad``); ``cached``: W_m is already built.

        factorised: forward N·r·(in + out); backward (g U) N·r·out, (g U ⊙ s) Vᵀ N·r·in,
            and the gradient of s_m is an elementwise product summed over the rows.
        materialised: W_m o·r·in (0 cached), forward N·in·out; backward x's gradient
            N·in·out, W_m's N·in·out and its projection on the basis Uᵀ gW_m V o·r·in.
        Per block of q, k, v (o = out / 3) when split.
        """
        j, r, i = self.splits, self.rank, self.in_features
        o = self.out_features // j
        fact = j * rows * r * (i + o)
        mat = (0 if cached else j * o * r * i) + rows * i * j * o
        if step:
            fact += j * rows * r * (o + (i if input_grad else 0))
            mat += j * o * r * i + rows * i * j * o * (2 if input_grad else 1)
        return {"factorized": fact, "materialized": mat}

    def mode(self, rows: int, step: bool = False, input_grad: bool = True,
             cached: bool = False) -> str:
        """The forward form for ``rows`` input rows per member: forward_mode, or under auto
        the form with fewer multiply-adds (:meth:`flops`, same arguments)."""
        if self.forward_mode != "auto":
            return self.forward_mode
        f = self.flops(rows, step, input_grad, cached)
        return "factorized" if f["factorized"] <= f["materialized"] else "materialized"

    def saved_values(self, rows: int) -> int:
        """What a training call keeps for the gradient of s_m: factorised (and top-k) x V
        (M, N, r); materialised, the member weights (M, out, in). U, V and W are frozen, so
        nothing else is kept."""
        if self.top_k or self.mode(rows, step=True) == "factorized":
            return self.members * rows * self.sve_s[0].numel()
        return self.members * self.out_features * self.in_features

    def member_weights(self) -> torch.Tensor:
        """W_m = U diag(s_m) Vᵀ for all members: (M, out, in)."""
        s = self.singular_values(self.sve_U.dtype)
        return (self.sve_U * s[:, None, :]) @ self.sve_V.T

    def weights(self, dtype: torch.dtype, cached: bool) -> torch.Tensor:
        """The member weights (M, out, in) in ``dtype``: from the cache when ``cached`` and
        nothing they are built from changed since (same tensor versions and storage)."""
        if not cached or not self._cache_fits(dtype):
            return self.member_weights().to(dtype)
        key = (dtype, self.clamp, *((t.data_ptr(), t._version)
                                    for t in (self.sve_s, self.sve_U, self.sve_V)))
        if self._cached is None or self._cached[0] != key:
            self._cached = None  # free the stale weights before building the new ones
            self._cached = (key, self.member_weights().to(dtype))
        return self._cached[1]

    def _cache_fits(self, dtype: torch.dtype) -> bool:
        """On a GPU, a layer's member weights are cached only while they take at most a quarter
        of the free memory (LLaMA-2-7B at M = 16 would need ~16× its targeted weights): the
        layers that do not fit compute W_m per call, as with cache_weights off."""
        if self._cached is not None or self.sve_U.device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(self.sve_U.device)
        need = self.members * self.out_features * self.in_features * dtype.itemsize
        return need <= free // 4

    def project(self, xm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """((x V) ⊙ s_m) Uᵀ for each member's rows: xm (M, N, in), s (M, r) → (M, N, out)."""
        return ((xm @ self.sve_V.to(xm.dtype)) * s[:, None, :]) @ self.sve_U.to(xm.dtype).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xm = split_members(x, self.members)                                      # (M, N, in)
        s = self.singular_values(x.dtype)
        bias = None if self.sve_bias is None else self.sve_bias.to(x.dtype)[:, None, :]
        if self.top_k:  # shared W: one GEMM over all M·N rows, plus each member's rank-k change
            y = F.linear(xm, self.base_layer.weight.to(x.dtype))                  # (M, N, out)
            y = y + self.project(xm, s - self.sve_s0.to(x.dtype))
        else:
            step = torch.is_grad_enabled() and self.sve_s.requires_grad
            cached = self.cache_weights and not self.training and not step
            if self.mode(xm.shape[1], step, x.requires_grad, cached) == "factorized":
                y = self.project(xm, s)                                          # (M, N, out)
            else:
                W = self.weights(x.dtype, cached).transpose(1, 2)                # (M, in, out)
                if bias is not None:  # the bias added inside the batched GEMM
                    return torch.baddbmm(bias, xm, W).reshape(*x.shape[:-1], -1)
                y = xm @ W
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def train(self, mode: bool = True) -> SVELinear:
        if mode:
            self._cached = None  # training changes s_m: cached weights go stale
        return super().train(mode)

    def extra_repr(self) -> str:
        extra = ", top_k" if self.top_k else f", forward_mode={self.forward_mode}"
        return f"{super().extra_repr()}, rank={self.rank}{extra}"


class SplitSVELinear(SVELinear):
    """SVE on a fused q/k/v layer with q, k and v decomposed apart (``qkv: split``).

    The wrapped weight (3·o, in) holds W_q, W_k, W_v (o × in each) stacked along the outputs;
    each gets its own float32 SVD W_j = U_j diag(s_j) V_jᵀ, r = min(o, in) (k with ``rank``).
    Frozen: sve_U (3, o, r), sve_V (3, in, r), sve_s0 (3, r). Trained: sve_s (M, 3, r),
    sve_bias (M, 3·o). Input (M·B, …, in) member-major, output (M·B, …, 3·o): member m computes
        factorised:   y_j = ((x V_j) ⊙ s_mj) U_jᵀ,  y = [y_q, y_k, y_v] + b_m
        materialised: y = x W_mᵀ + b_m,  W_m = [U_j diag(s_mj) V_jᵀ]_j stacked  (3·o, in)
        top-k:        y = x Wᵀ + [((x V_j) ⊙ (s_mj − s_j)) U_jᵀ]_j + b_m
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

    def member_weights(self) -> torch.Tensor:
        """W_m for all members: (M, 3·o, in)."""
        s = self.singular_values(self.sve_U.dtype)                               # (M, 3, r)
        W = (self.sve_U * s[:, :, None, :]) @ self.sve_V.transpose(1, 2)        # (M, 3, o, in)
        return W.flatten(1, 2)

    def project(self, xm: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """[((x V_j) ⊙ s_mj) U_jᵀ]_j: xm (M, N, in), s (M, 3, r) → (M, N, 3·o)."""
        h = torch.einsum("mni,jir->mjnr", xm, self.sve_V.to(xm.dtype)) * s[:, :, None, :]
        return torch.einsum("mjnr,jor->mnjo", h, self.sve_U.to(xm.dtype)).flatten(2)


def check_rank(rank: Any, encoder: nn.Module, suffixes: Sequence[str],
               split: Callable[[str], bool]) -> int | None:
    """``rank`` (None, or k singular directions per layer) if every linear layer ``suffixes``
    match has at least k (min(out, in), per q, k, v block where ``split`` says so), else a
    ValueError naming k and the valid range."""
    if rank is None:
        return None
    limits = {n: min(m.out_features // (3 if split(n) else 1), m.in_features)
              for n, m in encoder.named_modules() if isinstance(m, nn.Linear)
              and any(matches(n, suffix) for suffix in suffixes)}
    name, most = min(limits.items(), key=lambda kv: kv[1]) if limits else ("", None)
    ok = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1
    if not ok or (most is not None and rank > most):
        top = f"{most} (layer '{name}' has {most} singular values)" if most else "min(out, in)"
        raise ValueError(f"method.rank={rank!r}: give an integer from 1 to {top}, the singular "
                         f"directions each member adapts per layer, or null for all of them "
                         f"(SVE)")
    return rank
