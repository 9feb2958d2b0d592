"""The fused path: :mod:`.activations`' moments in fewer passes over memory.

The reference path spends most of its time in ~45 elementwise passes of the activation (each a
full read and write of a (B, width) tensor). The fused path evaluates the same closed forms,
rearranged around erfc and exp of one variable, in ~20 mostly in-place passes; under
torch.compile they become one loop per layer, erfc included (:func:`erfcx_fit`, which
shares φ's exponential). Eagerly
without autograd (inference) the same operations run with fewer fresh tensors and, on large
layers, in blocks that stay in cache (:func:`leaky_relu_moments_inference`), bit for bit.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch
import torch.nn.functional as F

from uqbench.methods.moments.activations import _T_MAX, _LeakyReLUMoments

_SQRT_2PI = math.sqrt(2 * math.pi)


# erfcx(z) = exp(z²)·erfc(z) ≈ τ·P(τ − τ₀), τ = 1/(1 + z/2), z ∈ [0, 40/√2] (t up to the clamp):
# a degree-10 polynomial fitted here to the relative error over that range (minimax by
# iteratively reweighted least squares against scipy's erfcx), fractional error under 1e-8
_ERFCX_MID = 0.53302044  # τ₀: the middle of τ's range [1/(1 + 20/√2), 1]
_ERFCX_FIT = (0.5340961861, 0.7245252051, 0.5722227363, 0.1219914475, -0.1875083927,
              -0.08327143273, 0.1083400815, 0.03416931226, -0.08065740218, -0.004130548471,
              0.04411497943)


def erfcx_fit(z: torch.Tensor) -> torch.Tensor:
    """erfcx(z) = exp(z²)·erfc(z) for 0 ≤ z ≤ 40/√2 by :data:`_ERFCX_FIT`: a division and ten
    multiply-adds, no exponential. The compiled pass takes erfc(|t|/√2) = erfcx·exp(−t²/2)
    from it, sharing φ(t)'s exponential, so each unit costs one exp instead of two; compiled,
    it fuses into the pass's loop (ATen's erfc kernel is a call of its own, and inductor's
    own erfc is slower still). In float32 its error is the rounding of τ and of the ten
    steps (a few units of 2⁻²⁴)."""
    tau = 1 / (1 + 0.5 * z)
    u = tau - _ERFCX_MID
    poly = u * _ERFCX_FIT[-1] + _ERFCX_FIT[-2]
    for c in reversed(_ERFCX_FIT[:-2]):
        poly = poly * u + c
    return tau * poly


@torch.library.custom_op("uqbench::erfc", mutates_args=())
def _erfc_kernel(z: torch.Tensor) -> torch.Tensor:
    """ATen's erfc kernel, called as is from compiled float64 code (inductor's own erfc is
    about twice as slow on CPU)."""
    return torch.special.erfc(z)


@_erfc_kernel.register_fake
def _(z: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(z)


def _erfc(z: torch.Tensor, pdf: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
    """erfc of z = |t|/√2 ≥ 0, given φ(t) = exp(−z²)/√(2π) (or ``e`` = exp(−z²) itself, a
    rounding less): in compiled code, :func:`erfcx_fit` times exp(−z²) in float32 and lower
    (its error is float32's rounding, so the compiled pass equals the eager one to rounding)
    and ATen's kernel in float64 (where the fit's 1e-8 would not be rounding); ATen's kernel
    eagerly."""
    if not torch.compiler.is_compiling():
        return torch.special.erfc(z)
    if z.dtype == torch.float64:
        return _erfc_kernel(z)
    return erfcx_fit(z) * (pdf * _SQRT_2PI if e is None else e)


def leaky_relu_moments_compiled(mean: torch.Tensor, var: torch.Tensor,
                                a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_leaky_relu_moments_fused`'s mean and variance (``keep`` false) in the fewest
    operations of one compiled loop: erfc(|t|/√2) = erfcx·e from e = exp(−t²/2) itself (not
    from φ(t) = e/√(2π) times √(2π): a rounding less), q(1 − C) as a select, and no in-place
    chains (the compiler writes each value once either way). The same closed forms on the same
    erfc and exp arguments, so they agree to rounding; what the compiled inference pass runs
    (:mod:`.inference`). Eagerly it takes ATen's erfc (:func:`_erfc`)."""
    s = var.clamp_min(0.0).sqrt().clamp_min(torch.finfo(var.dtype).tiny)
    t = (mean / s).clamp(-_T_MAX, _T_MAX)
    at = t.abs()
    t2 = t * t
    e = torch.exp(t2 * -0.5)
    pdf = e * (1 / _SQRT_2PI)                                   # φ(t)
    big_c = _erfc(at * (1 / math.sqrt(2)), pdf, e)              # 2Φ(−|t|)
    g = (pdf - 0.5 * at * big_c).clamp_min(0.0)
    out_mean = F.leaky_relu(mean, a) + (1 - a) * s * g
    upper = torch.where(t > 0, 1 - big_c, 0.0)                  # q(1 − C)
    h2 = ((t2 + 1) * big_c - 2 * at * pdf - 2 * g * g).clamp_min(0.0)  # 2h₋
    factor = h2 * ((1 - a) ** 2 / 2) + big_c * (a * (1 - a)) + upper * (1 - a * a) + a * a
    return out_mean, (var * factor).clamp_min(0.0)


def linear_moments(mean: torch.Tensor, var: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor,
                   w_var: torch.Tensor, w_second: torch.Tensor, b_var: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gaussian linear layer's output mean and variance, (B, in) → (B, out), from its μ_W,
    μ_b, σ_W², μ_W² + σ_W² and σ_b² (var None: a deterministic input, v = 0, so its product is
    skipped): one input as an outer product written pointwise (a compiler fuses it into the
    next activation), otherwise matrix products."""
    if w.shape[1] == 1:
        out_mean = torch.addcmul(b, mean, w.T)                      # (B, 1)·(1, out)
        out_var = torch.addcmul(b_var, mean * mean, w_var.T)
        if var is not None:
            out_var.addcmul_(var, w_second.T)
        return out_mean, out_var
    out_mean = F.linear(mean, w, b)
    out_var = torch.addmm(b_var, mean * mean, w_var.T)
    if var is not None:  # out of place: torch's FLOP counter skips an in-place addmm_
        out_var = torch.addmm(out_var, var, w_second.T)
    return out_mean, out_var


# the six tensors _LeakyReLUMoments.backward reads: mean, s, Φ(t), φ(t), E₊, the output mean
Saved = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@overload
def _leaky_relu_moments_fused(mean: torch.Tensor, var: torch.Tensor, a: float,
                              keep: Literal[False] = False) -> tuple[torch.Tensor, torch.Tensor]:
    ...


@overload
def _leaky_relu_moments_fused(mean: torch.Tensor, var: torch.Tensor, a: float,
                              keep: Literal[True]) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    ...


def _leaky_relu_moments_fused(
        mean: torch.Tensor, var: torch.Tensor, a: float, keep: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, Saved]:
    """:class:`_LeakyReLUMoments`'s mean and variance (and, ``keep``, the six tensors its
    backward reads), elementwise, shapes kept, from one erfc and one exp.

    With t = μ/s clamped to ±40 as there, C = erfc(|t|/√2) = 2Φ(−|t|), φ = φ(t), q = [t > 0]:
        g = φ − |t|·C/2 = E[relu(Z − |t|)]      E₊ = relu(μ) + s·g     M = leaky(μ) + (1−a)·s·g
        2h₋ = (t²+1)·C − 2|t|φ − 2g²             (h₋ = h(−|t|) of :func:`_relu_var_std`)
        V/v = a² + (1−a)²h₋ + a(1−a)·C + (1−a²)·q(1 − C),      Φ(t) = C/2 + q(1 − C)
    the reference's terms (its t > 0 branch, h = 1 + h₋ − C, folds into the last one), with
    the same erfc and exp arguments, so the two agree to rounding even where g and h₋ cancel.
    """
    s = var.clamp_min(0.0).sqrt_().clamp_min_(torch.finfo(var.dtype).tiny)
    t = torch.div(mean, s).clamp_(-_T_MAX, _T_MAX)
    at = t.abs()
    t2 = t * t
    pdf = torch.exp(t2 * -0.5).mul_(1 / _SQRT_2PI)              # φ(t)
    big_c = _erfc(at * (1 / math.sqrt(2)), pdf)                 # 2Φ(−|t|)
    g = torch.addcmul(pdf, at, big_c, value=-0.5).clamp_min_(0.0)
    out_mean = F.leaky_relu(mean, a).addcmul_(s, g, value=1 - a)
    upper = torch.rsub(big_c, 1.0).copysign_(t).clamp_min_(0.0)  # q(1 − C) = Φ(t) − Φ(−|t|)
    h2 = (t2.add_(1).mul_(big_c).addcmul_(at, pdf, value=-2.0)
          .addcmul_(g, g, value=-2.0).clamp_min_(0.0))          # 2h₋, in t²'s memory
    out_var = (h2.mul_((1 - a) ** 2 / 2).add_(big_c, alpha=a * (1 - a))
               .add_(upper, alpha=1 - a * a).add_(a * a).mul_(var).clamp_min_(0.0))
    if not keep:
        return out_mean, out_var
    cdf = upper.add_(big_c, alpha=0.5)
    e_pos = torch.relu(mean).addcmul_(s, g)
    return out_mean, out_var, (mean, s, cdf, pdf, e_pos, out_mean)


CHUNK = 2**17  # elements per block of the eager inference pass (its temporaries stay in cache)


def _leaky_relu_moments_lean(mean: torch.Tensor, var: torch.Tensor,
                             a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_leaky_relu_moments_fused`'s mean and variance (``keep`` false), eagerly and
    bit for bit: the same operations on the same operands in the same order, with fewer fresh
    tensors (the erfc and exp in place, Φ(t)'s upper part in s's memory once the mean is
    formed) and the two terms that vanish for ReLU (a = 0: adding 0·C and a² = 0) skipped."""
    s = var.clamp_min(0.0).sqrt_().clamp_min_(torch.finfo(var.dtype).tiny)
    t = torch.div(mean, s).clamp_(-_T_MAX, _T_MAX)
    at = t.abs()
    big_c = torch.mul(at, 1 / math.sqrt(2)).erfc_()             # 2Φ(−|t|)
    t2 = t * t
    pdf = torch.mul(t2, -0.5).exp_().mul_(1 / _SQRT_2PI)        # φ(t)
    g = torch.addcmul(pdf, at, big_c, value=-0.5).clamp_min_(0.0)
    out_mean = F.leaky_relu(mean, a).addcmul_(s, g, value=1 - a)
    upper = (torch.mul(big_c, -1.0, out=s) if s.shape == big_c.shape else big_c.neg()
             ).add_(1.0).copysign_(t).clamp_min_(0.0)          # q(1 − C), as 1 + (−C)
    out_var = (t2.add_(1).mul_(big_c).addcmul_(at, pdf, value=-2.0)
               .addcmul_(g, g, value=-2.0).clamp_min_(0.0).mul_((1 - a) ** 2 / 2))
    if a != 0:
        out_var.add_(big_c, alpha=a * (1 - a))
    out_var.add_(upper, alpha=1 - a * a)
    if a != 0:
        out_var.add_(a * a)
    return out_mean, out_var.mul_(var).clamp_min_(0.0)


def leaky_relu_moments_inference(mean: torch.Tensor, var: torch.Tensor,
                                 a: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager pass without autograd: :func:`_leaky_relu_moments_lean` (bit for bit
    :func:`_leaky_relu_moments_fused`), in blocks of :data:`CHUNK` elements where the input is
    larger (its ~8 temporaries then stay in cache instead of each pass going out to memory:
    elementwise, so the blocks give the same numbers)."""
    n = mean.numel()
    if (n <= CHUNK or mean.shape != var.shape or not mean.is_contiguous()
            or not var.is_contiguous()):
        return _leaky_relu_moments_lean(mean, var, a)
    out_mean, out_var = torch.empty_like(mean), torch.empty_like(var)
    flat = (mean.view(-1), var.view(-1), out_mean.view(-1), out_var.view(-1))
    for start in range(0, n, CHUNK):
        m, v, om, ov = (x[start:start + CHUNK] for x in flat)
        block_mean, block_var = _leaky_relu_moments_lean(m, v, a)
        om.copy_(block_mean)
        ov.copy_(block_var)
    return out_mean, out_var


class _LeakyReLUMomentsFused(torch.autograd.Function):
    """:func:`_leaky_relu_moments_fused` with :class:`_LeakyReLUMoments`'s closed-form
    gradients (the same backward, fed the same six tensors)."""

    @staticmethod
    def forward(ctx, mean: torch.Tensor, var: torch.Tensor, a: float):
        out_mean, out_var, saved = _leaky_relu_moments_fused(mean, var, a, keep=True)
        ctx.save_for_backward(*saved)
        ctx.a = a
        return out_mean, out_var

    backward = _LeakyReLUMoments.backward


def leaky_relu_moments_fused(mean: torch.Tensor, var: torch.Tensor,
                             slope: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`leaky_relu_moments` by the fused formulas: equal to rounding, gradients included;
    without autograd it skips the autograd.Function and the tensors a backward would need."""
    if torch.is_grad_enabled() and (mean.requires_grad or var.requires_grad):
        return _LeakyReLUMomentsFused.apply(mean, var, float(slope))
    if torch.compiler.is_compiling():
        return _leaky_relu_moments_fused(mean, var, float(slope))
    return leaky_relu_moments_inference(mean, var, float(slope))
