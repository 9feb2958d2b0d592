r"""The curvature term of the full-covariance pass by its Mehler series, for the pairs of a layer
whose correlation is moderate (all of them in the depth-3, width-64 networks measured: |ρ| under
0.3 at their evaluation inputs, trained and at initialisation; a training batch's largest |ρ|
under 0.5, mostly under 0.35).

Mehler's formula, φ₂(h, k; τ) = φ(h)φ(k) Σₙ Heₙ(h)Heₙ(k) τⁿ/n!, integrated against (ρ − τ) over
[0, ρ] (∫₀^ρ (ρ − τ)τⁿ dτ = ρⁿ⁺²/((n + 1)(n + 2))), gives
    R(h, k, ρ) = Σₙ ψₙ(h)ψₙ(k) ρⁿ⁺²/((n + 1)(n + 2)),     ψₙ = φ·Heₙ/√(n!),
with the Hermite functions ψₙ from ψ₀ = φ, ψ₁ = hφ and ψₙ₊₁ = (hψₙ − √n ψₙ₋₁)/√(n + 1)
(bounded, so nothing overflows where Heₙ would), and its derivatives term by term:
    ∂R/∂ρ = Σₙ ψₙ(h)ψₙ(k) ρⁿ⁺¹/(n + 1),      ∂R/∂h = −Σₙ √(n + 1) ψₙ₊₁(h)ψₙ(k) ρⁿ⁺²/((n + 1)(n + 2))
(d(φHeₙ)/dh = −φHeₙ₊₁). Cramér's inequality, |ψₙ| ≤ K e^(−h²/4)/√(2π) with K ≈ 1.0865, bounds
the terms left out after N of them by 0.188·rᴺ⁺¹/((N + 1)(1 − r)) for ∂R/∂ρ (r = |ρ|, in units
of σ_aσ_b; R's own remainder is smaller), so N is chosen per call from the largest r:
:data:`TOLERANCE`, tighter than the quadrature's 1e-8, in float64; in float32,
:data:`TOLERANCE_FLOAT32` = 2⁻²⁴, the dtype's own rounding of σ_aσ_b (13 terms at r = 0.3 in
float64, 10 in float32). Each term costs two passes over a
(B, d, d) matrix (a product and a rank-one update: Horner's rule in ρ), no exponential, against
the quadrature's 24 exponentials and ~8 passes per node over the pairs: no pair is gathered,
and the pass works on the layer's whole covariance matrix.
"""

from __future__ import annotations

import math
from typing import Any

import torch

TOLERANCE = 1e-9  # the truncation bound on R and on ∂R/∂ρ, in units of σ_aσ_b
TOLERANCE_FLOAT32 = 2.0 ** -24  # the same in float32 (and narrower dtypes): its rounding
MAX_RHO = 0.5     # |ρ| up to which the series is used (at 0.5: 27 terms; beyond: the quadrature)
_CRAMER = 1.0864348 ** 2 / (2 * math.pi)  # K²/(2π): |ψₙ(h)ψₙ(k)| ≤ this


def tolerance(dtype: torch.dtype) -> float:
    """The truncation bound for a pass in ``dtype``: :data:`TOLERANCE` in float64, else
    :data:`TOLERANCE_FLOAT32` (a smaller remainder would be lost to float32's rounding)."""
    return TOLERANCE if dtype == torch.float64 else TOLERANCE_FLOAT32


def terms(r: float, tol: float = TOLERANCE) -> int:
    """The number of terms N whose remainder bound 0.188·rᴺ⁺¹/((N + 1)(1 − r)) (∂R/∂ρ's, the
    largest) is at most ``tol`` (:func:`tolerance` of the pass's dtype); r < 1."""
    if r <= 0:
        return 0
    n = 0
    while _CRAMER * r ** (n + 1) / ((n + 1) * (1 - r)) > tol:
        n += 1
    return n


def hermite_functions(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """ψ₀ … ψₙ₋₁ at t (each t's shape): φ(t)·Heₖ(t)/√(k!) by their three-term recurrence."""
    psi = [torch.exp(-0.5 * t * t) * (1 / math.sqrt(2 * math.pi))]
    if n > 1:
        psi.append(t * psi[0])
    for k in range(1, n - 1):
        psi.append((t * psi[k] - math.sqrt(k) * psi[k - 1]) * (1 / math.sqrt(k + 1)))
    return psi[:n]


def horner(rows: list[torch.Tensor], cols: list[torch.Tensor], rho: torch.Tensor
            ) -> torch.Tensor:
    """Σₖ rowsₖ ⊗ colsₖ · ρᵏ (rows, cols: (B, d) each; ρ: (B, d, d)) by Horner's rule."""
    acc = rows[-1].unsqueeze(-1) * cols[-1].unsqueeze(-2)
    for u, v in zip(reversed(rows[:-1]), reversed(cols[:-1]), strict=True):
        acc.mul_(rho).addcmul_(u.unsqueeze(-1), v.unsqueeze(-2))
    return acc


class _Series(torch.autograd.Function):
    """σᵢσⱼ·R(tᵢ, tⱼ, ρᵢⱼ) for every entry (i, j) of ρ (B, d, d), with t and σ (B, d): N terms
    of the series (module docstring; σ folded into the Hermite functions, so that the terms
    are rank-one updates of σψₖ ⊗ σψₖ), with the exact derivatives of those N terms."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, s: torch.Tensor, rho: torch.Tensor, n: int,
                symmetric: bool) -> torch.Tensor:
        if n == 0:
            out = torch.zeros_like(rho)
        else:
            # √cₖσψₖ on both sides of each rank-one term: a symmetric ρ gives a symmetric
            # matrix to the last bit
            root = [p * s * (1 / math.sqrt((k + 1) * (k + 2)))
                    for k, p in enumerate(hermite_functions(t, n))]
            out = horner(root, root, rho).mul_(rho).mul_(rho)
        ctx.save_for_backward(t, s, rho, out)
        ctx.n, ctx.symmetric = n, symmetric
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        t, s, rho, out = ctx.saved_tensors
        n = ctx.n
        if n == 0:
            return torch.zeros_like(t), torch.zeros_like(s), torch.zeros_like(rho), None, None
        psi = [p * s for p in hermite_functions(t, n + 1)]
        # ∂/∂ρ: σσ·ρ Σₖ ψₖ⊗ψₖ ρᵏ/(k + 1)
        d_rho = horner([p * (1 / (k + 1)) for k, p in enumerate(psi[:n])], psi[:n], rho)
        d_rho.mul_(rho).mul_(grad)
        # ∂/∂σᵤ: each entry of row u and of column u over σᵤ
        weighted = grad * out
        d_s = (weighted.sum(-1) + weighted.sum(-2)) / s
        # ∂(σσR)ᵢⱼ/∂tᵢ = −ρᵢⱼ² Dᵢⱼ, D = Σₖ aₖ⊗σψₖ ρᵏ, aₖ = σ√(k + 1)ψₖ₊₁/((k + 1)(k + 2)); tᵤ
        # also enters column u (as k), whose derivative is the transpose's where ρ is symmetric
        a = [psi[k + 1] * (math.sqrt(k + 1) / ((k + 1) * (k + 2))) for k in range(n)]
        rho_t = rho.transpose(-1, -2)
        if ctx.symmetric:
            both = grad + grad.transpose(-1, -2)
            d_t = -(horner(a, psi[:n], rho).mul_(rho).mul_(rho).mul_(both)).sum(-1)
        else:
            d_t = -((horner(a, psi[:n], rho).mul_(rho).mul_(rho).mul_(grad)).sum(-1)
                    + (horner(a, psi[:n], rho_t).mul_(rho_t).mul_(rho_t)
                       .mul_(grad.transpose(-1, -2))).sum(-1))
        return d_t, d_s, d_rho, None, None


def scaled_curvature_series(t: torch.Tensor, s: torch.Tensor, rho: torch.Tensor,
                            n: int | None = None, symmetric: bool = False) -> torch.Tensor:
    """σᵢσⱼ·R(tᵢ, tⱼ, ρᵢⱼ) (B, d, d) for standardised means t (B, d), standard deviations
    σ (B, d) and correlations ρ (B, d, d), |ρ| < 1, by ``n`` terms of the series (None:
    :func:`terms` of the largest |ρ| at :func:`tolerance` of ρ's dtype). ``symmetric``: the
    caller's promise that ρ equals its transpose (the backward pass then needs one sum
    fewer)."""
    if n is None:
        n = (terms(float(rho.detach().abs().max()), tolerance(rho.dtype)) if rho.numel()
             else 0)
    return _Series.apply(t, s, rho, n, symmetric)


def curvature_series(t: torch.Tensor, rho: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """R(tᵢ, tⱼ, ρᵢⱼ) (B, d, d): :func:`scaled_curvature_series` with σ = 1."""
    return scaled_curvature_series(t, torch.ones_like(t), rho, n)
