"""Covariances of activations of two correlated Gaussians, for full-covariance moment propagation
(Wu, Nowozin, Meeds, Turner, Hernández-Lobato & Gaunt, "Deterministic Variational Inference for
Robust Bayesian Neural Networks", ICLR 2019, section 3 and appendix).

(a, b) is bivariate Gaussian with means μ_a, μ_b, standard deviations σ_a, σ_b, covariance
c = ρσ_aσ_b; h = μ_a/σ_a and k = μ_b/σ_b are the standardised means, Φ and φ the standard normal
cdf and pdf, φ₂(h, k; τ) = exp(−(h² + k² − 2τhk) / (2(1 − τ²))) / (2π√(1 − τ²)) the standard
bivariate normal density and Φ₂ its cdf.

- ReLU. Price's theorem gives ∂Cov/∂c = E[H(a)H(b)] = Φ₂(h, k; ρ), and Cov = 0 at ρ = 0, so
      Cov(relu a, relu b) = σ_aσ_b·[ρΦ(h)Φ(k) + R(h, k, ρ)],
      R(h, k, ρ) = ∫₀^ρ (ρ − τ) φ₂(h, k; τ) dτ ≥ 0,
  the paper's form (its Q is R/ρ, which it replaces by a closed-form approximation). Here R is
  integrated by Gauss–Legendre in w, τ = ρ(1 − w²): R = 2ρ² ∫₀¹ w³ φ₂(h, k; ρ(1 − w²)) dw, whose
  integrand stays smooth at |ρ| = 1 (the (1 − τ)/√(1 − τ²) endpoint becomes w²). No bivariate cdf is
  needed. Against adaptive quadrature the absolute error (in units of σ_aσ_b) is below 1e-8 over
  |h|, |k| ≤ 8 and −1 ≤ ρ ≤ 1; the worst case is |ρ| = 1 with h ∓ k → 0, where φ₂ turns into
  a step. The equivalent closed form E[relu a relu b] = σ_aσ_b[(hk + ρ)Φ₂ + hφ(k)Φ((h − ρk)/s)
  + kφ(h)Φ((k − ρh)/s) + sφ(h)φ((k − ρh)/s)], s = √(1 − ρ²), needs Φ₂ and cancels in the tails;
  the tests use it as an independent reference.
- Leaky-ReLU with slope α, f(x) = αx + (1 − α)relu(x): by bilinearity and Stein's lemma
  (Cov(a, relu b) = c·Φ(k)),
      Cov(f(a), f(b)) = c·(α + (1 − α)Φ(h))(α + (1 − α)Φ(k)) + (1 − α)²σ_aσ_b·R(h, k, ρ):
  the linearised term (c times the expected slopes) plus the curvature term R.
- Heaviside: Cov(H(a), H(b)) = Φ₂(h, k; ρ) − Φ(h)Φ(k) = ∫₀^ρ φ₂(h, k; τ) dτ
  = 2ρ ∫₀¹ w φ₂(h, k; ρ(1 − w²)) dw, by the same nodes; less accurate than R where |ρ| → 1 and
  h ∓ k → 0 (its integrand keeps the step, ~1e-4 there).

Every rule is elementwise over broadcastable pair tensors; :func:`leaky_relu_full_covariance`
applies the Leaky-ReLU rule to every pair of units of a (B, d) layer with a (B, d, d) covariance.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

from uqbench.methods.moments import mehler, pair_terms
from uqbench.methods.moments.activations import _T_MAX
from uqbench.methods.moments.compiling import compile_dynamic

NODES = 24  # Gauss–Legendre nodes in w ∈ [0, 1]: 7e-9 in the worst case above (32: 2e-9)
ACTIVATIONS = ("relu", "leaky_relu", "heaviside")  # the closed forms available
_INV_2PI = 1 / (2 * math.pi)


@cache
def _nodes(n: int) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """w_n ∈ (0, 1), and the weights of ∫₀¹ 2w³ f dw (R) and of ∫₀¹ 2w f dw (Heaviside)."""
    x, wt = np.polynomial.legendre.leggauss(n)
    w, wt = (x + 1) / 2, wt / 2
    return tuple(w.tolist()), tuple((2 * wt * w ** 3).tolist()), tuple((2 * wt * w).tolist())


class _Pairs:
    """What every node of the quadrature reads for pairs (h, k, ρ): with r = |ρ|, τ = ρ(1 − w²)
    and g = 1 − |τ| = (1 − r) + r·w² (no cancellation as r → 1), q = 1 − τ² = g(2 − g) and
        h² + k² − 2τhk = D + 2P·g,   P = sign(ρ)·hk,  D = h² + k² − 2P = (|h| − s|k|)²
    (s = sign(ρhk)): both parts are non-negative or exact, so the exponent keeps its digits
    where h ≈ ±k and |τ| → 1."""

    def __init__(self, h: torch.Tensor, k: torch.Tensor, rho: torch.Tensor) -> None:
        self.r = rho.abs()
        self.one_minus_r = 1 - self.r
        self.sign = torch.where(rho < 0, -1.0, 1.0).to(rho.dtype)
        self.prod = self.sign * h * k                                       # P
        self.dist = (h.abs() - torch.where(self.prod < 0, -1.0, 1.0).to(h.dtype)
                     * k.abs()) ** 2                                        # D

    def density(self, w: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """2π·φ₂(h, k; τ) = exp(−(D + 2Pg)/(2q))/√q at node w, with g and q, elementwise
        (in place where it can: this loop is the cost of the full-covariance pass; without
        autograd only)."""
        g = torch.add(self.one_minus_r, self.r, alpha=w * w)
        q = torch.rsub(g, 2).mul_(g)
        e = torch.addcmul(self.dist, self.prod, g, value=2).div_(q).mul_(-0.5).exp_()
        return e.mul_(q.rsqrt()), g, q

    def density_autograd(self, w: float) -> torch.Tensor:
        """:meth:`density`'s value out of place, for autograd to differentiate and for
        torch.compile to trace."""
        g = self.one_minus_r + self.r * (w * w)
        q = g * (2 - g)
        return torch.exp(-(self.dist + 2 * self.prod * g) / (2 * q)) * q.rsqrt()


class _Curvature(torch.autograd.Function):
    """R(h, k, ρ) = 2ρ² ∫₀¹ w³ φ₂(h, k; ρ(1 − w²)) dw by NODES Gauss–Legendre nodes, with the
    exact derivatives of that sum (a second pass over the nodes; nothing per node is kept, so
    memory stays that of the pairs):
        ∂R/∂h = ρ² Σ c_n e_n·(−(h − τk)/q)         (∂R/∂k likewise)
        ∂R/∂ρ = 2R/ρ + ρ² Σ c_n e_n·(1 − w²)·d log e/dτ,
        d log e/dτ = sign(ρ)[(1 − g)/q + (Pg² − D(1 − g))/q²]
    with e_n = φ₂ at node n and c_n its weight (the last bracket is τ/q + ∂exponent/∂τ,
    rearranged so that no two large terms cancel)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, k: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        pairs = _Pairs(h, k, rho)
        ws, cs, _ = _nodes(NODES)
        total = torch.zeros_like(h)
        for w, c in zip(ws, cs, strict=True):
            total.add_(pairs.density(w)[0], alpha=c)
        ctx.save_for_backward(h, k, rho, total)
        return rho * rho * total * _INV_2PI

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, k, rho, total = ctx.saved_tensors
        pairs = _Pairs(h, k, rho)
        ws, cs, _ = _nodes(NODES)
        d_h, d_k, d_tau = (torch.zeros_like(h) for _ in range(3))
        for w, c in zip(ws, cs, strict=True):
            e, g, q = pairs.density(w)
            ce = e.div_(q).mul_(c)
            # h − τk with τ = sign(ρ)(1 − g), as (h − sign(ρ)k) + sign(ρ)gk (no cancellation)
            d_h -= ce * ((h - pairs.sign * k) + pairs.sign * g * k)
            d_k -= ce * ((k - pairs.sign * h) + pairs.sign * g * h)
            d_tau += ce * (1 - w * w) * ((1 - g) + (pairs.prod * g * g - pairs.dist * (1 - g)) / q)
        scale = grad * _INV_2PI
        rho2 = rho * rho
        return (scale * rho2 * d_h, scale * rho2 * d_k,
                scale * (2 * rho * total + rho * rho.abs() * d_tau))


_TRACED_W, _TRACED_C, _ = _nodes(NODES)  # made once here: compiled code reads the constants


def _curvature_traced(h: torch.Tensor, k: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """:class:`_Curvature`'s value by :meth:`_Pairs.density_autograd` (plain out-of-place
    operations), for torch.compile: compiled, the NODES terms of a pair are one loop in
    registers instead of ~8 passes over memory per node."""
    pairs = _Pairs(h, k, rho)
    total = torch.zeros_like(h)
    for w, c in zip(_TRACED_W, _TRACED_C, strict=True):
        total = total + c * pairs.density_autograd(w)
    return rho * rho * total * _INV_2PI


def relu_curvature(h: torch.Tensor, k: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """R(h, k, ρ) = ∫₀^ρ (ρ − τ) φ₂(h, k; τ) dτ ≥ 0, elementwise (broadcast), so that
    Cov(relu a, relu b) = σ_aσ_b[ρΦ(h)Φ(k) + R]. h, k: standardised means; ρ ∈ [−1, 1]."""
    h, k, rho = torch.broadcast_tensors(h, k, rho)
    return _Curvature.apply(h, k, rho)


def _standardise(mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """σ = √var (at least the dtype's tiny) and h = μ/σ clamped to ±40, as the univariate rule."""
    s = var.clamp_min(0).sqrt().clamp_min(torch.finfo(var.dtype).tiny)
    return s, (mean / s).clamp(-_T_MAX, _T_MAX)


def _cdf(t: torch.Tensor) -> torch.Tensor:
    return 0.5 * torch.special.erfc(-t * (1 / math.sqrt(2)))


def _correlation(cov: torch.Tensor, s_a: torch.Tensor, s_b: torch.Tensor) -> torch.Tensor:
    """ρ = c/(σ_aσ_b), clamped to [−1, 1]; 0 where a variance is 0 (then c is 0 too)."""
    scale = (s_a * s_b).clamp_min(torch.finfo(cov.dtype).tiny)
    return (cov / scale).clamp(-1.0, 1.0)


def leaky_relu_covariance(mean_a: torch.Tensor, var_a: torch.Tensor, mean_b: torch.Tensor,
                          var_b: torch.Tensor, cov: torch.Tensor,
                          slope: float = 0.0) -> torch.Tensor:
    """Cov(f(a), f(b)) for f = leaky_relu(·, slope) (ReLU: slope 0) and (a, b) bivariate
    Gaussian with the given means, variances and covariance, elementwise (broadcast).

    c·(α + (1 − α)Φ(h))(α + (1 − α)Φ(k)) + (1 − α)²σ_aσ_b·R(h, k, ρ) (module docstring). For
    a = b it gives Var f(a) to quadrature accuracy; the layers take that from the univariate
    rule (:func:`~uqbench.methods.moments.activations.leaky_relu_moments`) instead.
    """
    a = float(slope)
    s_a, h = _standardise(mean_a, var_a)
    s_b, k = _standardise(mean_b, var_b)
    rho = _correlation(cov, s_a, s_b)
    lin = (a + (1 - a) * _cdf(h)) * (a + (1 - a) * _cdf(k))
    return cov * lin + (1 - a) ** 2 * s_a * s_b * relu_curvature(h, k, rho)


def heaviside_covariance(mean_a: torch.Tensor, var_a: torch.Tensor, mean_b: torch.Tensor,
                         var_b: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Cov(H(a), H(b)) = Φ₂(h, k; ρ) − Φ(h)Φ(k), H the unit step, elementwise (broadcast);
    by the same nodes (module docstring; no gradient rule of its own: autograd through the sum)."""
    s_a, h = _standardise(mean_a, var_a)
    s_b, k = _standardise(mean_b, var_b)
    rho = _correlation(cov, s_a, s_b)
    h, k, rho = torch.broadcast_tensors(h, k, rho)
    pairs = _Pairs(h, k, rho)
    ws, _, cs = _nodes(NODES)
    total = torch.zeros_like(h)
    for w, c in zip(ws, cs, strict=True):
        total = total + c * pairs.density_autograd(w)
    return rho * total * _INV_2PI


def activation_covariance(name: str, mean_a: torch.Tensor, var_a: torch.Tensor,
                          mean_b: torch.Tensor, var_b: torch.Tensor, cov: torch.Tensor,
                          slope: float = 0.0) -> torch.Tensor:
    """Cov(f(a), f(b)) for the activation ``name`` (one of ACTIVATIONS; ``slope``: leaky_relu's
    α), elementwise; an activation without a closed form is refused by name."""
    if name == "relu":
        return leaky_relu_covariance(mean_a, var_a, mean_b, var_b, cov, 0.0)
    if name == "leaky_relu":
        return leaky_relu_covariance(mean_a, var_a, mean_b, var_b, cov, slope)
    if name == "heaviside":
        return heaviside_covariance(mean_a, var_a, mean_b, var_b, cov)
    raise ValueError(f"activation '{name}' has no closed-form covariance under a Gaussian input "
                     f"here; the ones supported: {', '.join(ACTIVATIONS)}")


COMPILE_PAIRS = 2**20  # pairs in one call from which a call without gradients runs compiled
SERIES = True  # eager calls: R by the Mehler series where |ρ| is moderate (False: quadrature)


def leaky_relu_full_covariance(mean: torch.Tensor, cov: torch.Tensor, out_var: torch.Tensor,
                               slope: float = 0.0, symmetric: bool = False,
                               var: torch.Tensor | None = None) -> torch.Tensor:
    """The (B, d, d) covariance of leaky_relu(z, slope) for z ~ N(mean (B, d), cov (B, d, d)).

    Each of the d(d − 1)/2 pairs above the diagonal by :func:`leaky_relu_covariance`, mirrored
    below; the diagonal is ``out_var`` (B, d), the univariate rule's exact variance.

    Speed only: a call of at least :data:`COMPILE_PAIRS` pairs that needs no gradient (a
    scoring's full pass or mixture: thousands of pairs per input, many inputs at once) runs
    compiled, the NODES terms of each pair one loop in registers instead of ~8 passes over
    memory per node, and the gathers around them fused in (several times faster on a CPU core
    in float64; the same numbers as the eager quadrature to rounding); everything else (a
    training step, a small call) runs eagerly on the whole matrix with R by its Mehler series
    where |ρ| is moderate (:func:`_full_covariance_series`: within 1e-9·σ_aσ_b of R in
    float64, the quadrature's own error being up to 1e-8; within float32's 2⁻²⁴·σ_aσ_b in
    float32). ``var``: ``cov``'s diagonal as a tensor of its own where the caller has one (a
    Gaussian Linear's output variances, the caller's promise): a training step's gradient of
    the units' σ then flows into it, not into a (B, d, d) matrix built around a diagonal view
    (the same numbers).
    """
    d = mean.shape[-1]
    i, j = torch.triu_indices(d, d, 1, device=mean.device)
    needs_grad = torch.is_grad_enabled() and (mean.requires_grad or cov.requires_grad
                                              or out_var.requires_grad)
    if (not needs_grad and mean.shape[0] * i.numel() >= COMPILE_PAIRS
            and not torch.compiler.is_compiling()):
        return _compiled_full_covariance()(mean, cov, out_var, i, j, float(slope))
    if torch.compiler.is_compiling() or not SERIES:
        return _full_covariance(mean, cov, out_var, i, j, float(slope))
    return _full_covariance_series(mean, cov, out_var, float(slope), symmetric, var)


def _full_covariance_series(mean: torch.Tensor, cov: torch.Tensor, out_var: torch.Tensor,
                            slope: float, symmetric: bool = False,
                            var: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_full_covariance` on the whole (B, d, d) matrix, σ_aσ_b·R by its Mehler series
    (within :func:`~uqbench.methods.moments.mehler.tolerance`·σ_aσ_b of the exact R and its
    ρ-derivative: 1e-9 in float64, 2⁻²⁴ in float32) wherever |ρ| ≤
    :data:`~uqbench.methods.moments.mehler.MAX_RHO`, and by the quadrature
    (:func:`relu_curvature`) at the pairs beyond, gathered; the diagonal is ``out_var``. As
    there, c is read above the diagonal only (mirrored below), so the matrix is exactly
    symmetric; a covariance already exactly symmetric (``symmetric``: the caller's promise,
    as the layers' outputs are; else checked) is read whole with its diagonal zeroed, the
    gradient split between (i, j) and (j, i). Where every |ρ| is moderate the pair terms are
    one autograd node (:func:`~uqbench.methods.moments.pair_terms.pair_terms`). ρ = c·(1/σ_a)(1/σ_b)
    (1/σ capped so that the product stays finite; c is 0 where σ is) is clamped to [−1, 1]
    only where the quadrature reads it (the series' |ρ| are under 1). ``var``: ``cov``'s
    diagonal, where the caller has it (:func:`leaky_relu_full_covariance`)."""
    if var is None:
        var = cov.diagonal(dim1=-2, dim2=-1)
    s, t = _standardise(mean, var)
    slopes = slope + (1 - slope) * _cdf(t)
    # 1/σ at most √(dtype max), so that 1/(σ_aσ_b) stays finite (c = 0 where σ is tiny)
    inv = s.reciprocal().clamp_max(math.sqrt(torch.finfo(s.dtype).max))
    if not (symmetric or torch.equal(cov, cov.transpose(-1, -2))):
        upper = cov.triu(1)
        cov = upper + upper.transpose(-1, -2)       # c above the diagonal, mirrored; 0 on it
    off = pair_terms.off_diagonal(cov.shape[-1], cov.dtype, cov.device)
    rho, largest = pair_terms.correlations(cov, inv, off)
    r, tol = float(largest), mehler.tolerance(cov.dtype)
    if r <= mehler.MAX_RHO:
        return pair_terms.pair_terms(cov, inv, slopes, out_var, t, s, rho, mehler.terms(r, tol),
                                     (1 - slope) ** 2)
    pairs = cov * off
    rho = pairs * (inv.unsqueeze(-1) * inv.unsqueeze(-2))                 # symmetric, exactly
    far = rho.detach().abs() > mehler.MAX_RHO
    b, i, j = far.nonzero(as_tuple=True)
    curv = mehler.scaled_curvature_series(t, s, rho * ~far, mehler.terms(mehler.MAX_RHO, tol),
                                          symmetric=True)
    curv = curv.index_put((b, i, j), s[b, i] * s[b, j] * relu_curvature(
        t[b, i], t[b, j], rho[b, i, j].clamp(-1.0, 1.0)))
    full = torch.add(pairs * (slopes.unsqueeze(-1) * slopes.unsqueeze(-2)), curv,
                     alpha=(1 - slope) ** 2)
    full.diagonal(dim1=-2, dim2=-1).copy_(out_var)
    return full


def _assemble(off: torch.Tensor, out_var: torch.Tensor, i: torch.Tensor,
              j: torch.Tensor) -> torch.Tensor:
    """The (B, d, d) matrix with the pairs (i, j) ``off`` above the diagonal, mirrored below,
    and ``out_var`` on it."""
    b, d = out_var.shape
    diag = torch.arange(d, device=out_var.device) * (d + 1)
    index = torch.cat([i * d + j, j * d + i, diag])
    flat = out_var.new_zeros(b, d * d).index_copy(1, index, torch.cat([off, off, out_var], 1))
    return flat.view(-1, d, d)


def _full_covariance(mean: torch.Tensor, cov: torch.Tensor, out_var: torch.Tensor,
                     i: torch.Tensor, j: torch.Tensor, slope: float,
                     curvature: Callable[..., torch.Tensor] = relu_curvature) -> torch.Tensor:
    """:func:`leaky_relu_covariance` for the pairs (i, j) of a layer, assembled by
    :func:`_assemble`: each unit standardised and its expected slope taken once, before the
    pairs gather them (the same numbers as the pairwise rule); R by ``curvature``."""
    var = cov.diagonal(dim1=-2, dim2=-1)
    s, t = _standardise(mean, var)
    slopes = slope + (1 - slope) * _cdf(t)
    s_a, s_b, h, k = s[:, i], s[:, j], t[:, i], t[:, j]
    c = cov[:, i, j]
    rho = _correlation(c, s_a, s_b)
    off = (c * (slopes[:, i] * slopes[:, j])
           + (1 - slope) ** 2 * s_a * s_b * curvature(h, k, rho))
    return _assemble(off, out_var, i, j)


def _full_covariance_traced(mean: torch.Tensor, cov: torch.Tensor, out_var: torch.Tensor,
                            i: torch.Tensor, j: torch.Tensor, slope: float) -> torch.Tensor:
    """:func:`_full_covariance` with R by :func:`_curvature_traced`, for torch.compile (no
    gradient)."""
    return _full_covariance(mean, cov, out_var, i, j, slope, _curvature_traced)


@cache
def _compiled_full_covariance() -> Callable[..., torch.Tensor]:
    """:func:`_full_covariance_traced` through torch.compile (dynamic sizes: one graph for every
    width and chunk; the slope compiled in as a constant), built on first use. A compilation
    that fails (no C++ compiler) runs the same function eagerly, with torch's warning."""
    return compile_dynamic(_full_covariance_traced, suppress_errors=True, specialize_float=True)
