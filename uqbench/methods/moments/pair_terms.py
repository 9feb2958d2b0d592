r"""The full-covariance Leaky-ReLU's pair terms, wherever every |ρ| is moderate: one autograd node
whose forward and backward are each one tensor program over the layer's (B, d, d) matrix,
compiled where the matrix is large.

For an exactly symmetric covariance C (B, d, d) read whole with its diagonal zeroed (P = C off
the diagonal), the unit-level inputs 1/σ, the expected slopes e = α + (1 − α)Φ(t), t and σ
(each (B, d), differentiated by autograd outside), and the univariate rule's variances v:
    ρᵢⱼ = Pᵢⱼ/σᵢσⱼ,    Fᵢⱼ = Pᵢⱼeᵢeⱼ + β·σᵢσⱼR(tᵢ, tⱼ, ρᵢⱼ) (i ≠ j),    Fᵢᵢ = vᵢ,
β = (1 − α)², R by N terms of its Mehler series (:mod:`.mehler`). Given the output's gradient
G, with Ĝ = G off the diagonal and every other factor symmetric in (i, j):
    ∂/∂Pᵢⱼ = Ĝᵢⱼeᵢeⱼ + (∂/∂ρᵢⱼ)/σᵢσⱼ,    ∂/∂eᵢ = Σⱼ (ĜᵢⱼPᵢⱼ + ĜⱼᵢPⱼᵢ)eⱼ,
    ∂/∂(1/σᵢ) = Σⱼ ((∂/∂ρ)ᵢⱼ + (∂/∂ρ)ⱼᵢ)Pᵢⱼ/σⱼ,    ∂/∂vᵢ = Gᵢᵢ,
and the series' own ∂/∂ρ, ∂/∂t and ∂/∂σ as :class:`.mehler._Series` takes them (β·Ĝ its
gradient). Autograd through the same steps keeps every intermediate (B, d, d) matrix and runs
~40 passes over them per layer; here the forward pass is one program (in eager: the same
operations as the autograd pass, the same numbers) and the backward pass another.

Speed only: a matrix of at least :data:`COMPILE_ENTRIES` entries whose series needs at most
the largest of :data:`COMPILED_TERMS` terms runs both programs through torch.compile with the
smallest of those counts that suffices (the N terms a loop in registers: one read of C and ρ
instead of two passes per term; more terms than needed are closer to R, within the same
bound, and a few fixed N are a few programs to compile however N moves during training: the
first compilation on a machine takes tens of seconds, later processes read torch's on-disk
cache). Anything else runs them eagerly, as does a compilation that fails (with torch's
warning). The second count covers float32's series up to |ρ| = 0.5 (the series' limit):
early in training a batch's largest |ρ| passes 0.35 (P2's depth-3, width-64 network, seed 0:
about one call in six of its first sixty epochs, from the sixth, and none after), where the
eager programs take three times the compiled 18-term ones' time.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import torch

from uqbench.methods.moments import mehler
from uqbench.methods.moments.compiling import Programs

COMPILE_ENTRIES = 2 ** 18  # B·d² from which the programs run compiled (a width-64 batch of 64)
COMPILED_TERMS = (12, 18)  # the compiled programs' series terms (float32: |ρ| up to 0.35, 0.5)


def _correlations(cov: torch.Tensor, inv: torch.Tensor, off: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    rho = (cov * off) * (inv.unsqueeze(-1) * inv.unsqueeze(-2))
    return rho, rho.abs().amax()


def correlations(cov: torch.Tensor, inv: torch.Tensor, off: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ρ = (C off the diagonal)·(1/σᵢ)(1/σⱼ) (B, d, d) and its largest |ρ| (a 0-d tensor),
    without gradient (one program, compiled where large, as the others)."""
    with torch.no_grad():
        return PROGRAMS("correlations", cov.numel() >= COMPILE_ENTRIES)(cov, inv, off)


def _forward(cov: torch.Tensor, rho: torch.Tensor, slopes: torch.Tensor, out_var: torch.Tensor,
             t: torch.Tensor, s: torch.Tensor, off: torch.Tensor, n: int, beta: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """F (module docstring) and the series' σσR (saved for the backward pass)."""
    pairs = cov * off
    # √cₖσψₖ on both sides of each term: a symmetric ρ gives a symmetric matrix to the last bit;
    # stacked, so that compiled code computes each unit's terms once, not once per entry
    root = torch.stack([p * s * (1 / math.sqrt((k + 1) * (k + 2)))
                        for k, p in enumerate(mehler.hermite_functions(t, n))])
    curv = mehler.horner(list(root), list(root), rho).mul_(rho).mul_(rho)
    full = torch.add(pairs * (slopes.unsqueeze(-1) * slopes.unsqueeze(-2)), curv, alpha=beta)
    full.diagonal(dim1=-2, dim2=-1).copy_(out_var)
    return full, curv


def _symmetrised(grad: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """Ĝ + Ĝᵀ, Ĝ = ``grad`` off the diagonal."""
    g = grad * off
    return g + g.transpose(-1, -2)


def _backward(grad: torch.Tensor, both: torch.Tensor, cov: torch.Tensor, rho: torch.Tensor,
              curv: torch.Tensor, inv: torch.Tensor, slopes: torch.Tensor, t: torch.Tensor,
              s: torch.Tensor, off: torch.Tensor, n: int, beta: float
              ) -> tuple[torch.Tensor, ...]:
    """The gradients of F's inputs (module docstring): C, 1/σ, e, v, t, σ, given G and
    :func:`_symmetrised`'s Ĝ + Ĝᵀ (a program of its own: compiled, a transposed read in the
    same loop as the row sums below would have them vectorised across rows). Every factor
    but Ĝ is symmetric, so each sum over a row and a column is one row sum against Ĝ + Ĝᵀ."""
    g = grad * off                                                          # Ĝ
    pairs = cov * off
    psi = list(torch.stack([p * s for p in mehler.hermite_functions(t, n + 1)]))
    # the series against β·Ĝ (β folded into the coefficients): ∂/∂ρ = Ĝ·ρ·Σₖ βψₖ⊗ψₖρᵏ/(k + 1)
    d_rho = mehler.horner([p * (beta / (k + 1)) for k, p in enumerate(psi[:n])], psi[:n],
                           rho).mul_(rho)
    inv2 = inv.unsqueeze(-1) * inv.unsqueeze(-2)
    d_pairs = g * torch.addcmul(slopes.unsqueeze(-1) * slopes.unsqueeze(-2), d_rho, inv2)
    d_inv = (d_rho * both * pairs * inv.unsqueeze(-2)).sum(-1)
    d_slopes = (both * pairs * slopes.unsqueeze(-2)).sum(-1)
    d_s = (both * curv).sum(-1) * beta / s
    a = [psi[k + 1] * (beta * math.sqrt(k + 1) / ((k + 1) * (k + 2))) for k in range(n)]
    d_t = -(mehler.horner(a, psi[:n], rho).mul_(rho).mul_(rho).mul_(both)).sum(-1)
    d_out_var = grad.diagonal(dim1=-2, dim2=-1).clone()
    return d_pairs, d_inv, d_slopes, d_out_var, d_t, d_s      # d_pairs is 0 on the diagonal


PROGRAMS = Programs({"correlations": _correlations, "forward": _forward,
                     "symmetrised": _symmetrised, "backward": _backward},
                    suppress_errors=True, specialize_float=True, cache_size_limit=64)
"""The four programs, compiled with dynamic sizes (N and β compiled in as constants)."""


@cache
def off_diagonal(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (d, d) matrix of ones with zeros on the diagonal."""
    return 1 - torch.eye(d, dtype=dtype, device=device)


class _PairTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cov: torch.Tensor, inv: torch.Tensor, slopes: torch.Tensor,
                out_var: torch.Tensor, t: torch.Tensor, s: torch.Tensor, rho: torch.Tensor,
                n: int, beta: float) -> torch.Tensor:
        off = off_diagonal(cov.shape[-1], cov.dtype, cov.device)
        large = cov.numel() >= COMPILE_ENTRIES and n <= COMPILED_TERMS[-1]
        if large:
            n = min(m for m in COMPILED_TERMS if m >= n)
        full, curv = PROGRAMS("forward", large)(cov, rho, slopes, out_var, t, s, off, n, beta)
        ctx.save_for_backward(cov, rho, curv, inv, slopes, t, s)
        ctx.n, ctx.beta, ctx.large = n, beta, large
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cov, rho, curv, inv, slopes, t, s = ctx.saved_tensors
        off = off_diagonal(cov.shape[-1], cov.dtype, cov.device)
        both = PROGRAMS("symmetrised", ctx.large)(grad, off)
        grads = PROGRAMS("backward", ctx.large)(grad, both, cov, rho, curv, inv, slopes, t, s,
                                                off, ctx.n, ctx.beta)
        return (*grads, None, None, None)


def pair_terms(cov: torch.Tensor, inv: torch.Tensor, slopes: torch.Tensor,
               out_var: torch.Tensor, t: torch.Tensor, s: torch.Tensor, rho: torch.Tensor,
               n: int, beta: float) -> torch.Tensor:
    """F (B, d, d) (module docstring) for an exactly symmetric ``cov``, with ρ as
    :func:`correlations` gives it (no gradient: it is recomputed from ``cov`` and ``inv``
    for theirs) and ``n`` series terms (at least one; where compiled, rounded up to one of
    :data:`COMPILED_TERMS`)."""
    # at least one term: where every ρ is 0 (independent units) it gives 0 exactly, as none would
    return _PairTerms.apply(cov, inv, slopes, out_var, t, s, rho.detach(), max(n, 1), beta)
