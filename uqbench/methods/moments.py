"""Sampling-free moment propagation through a mean-field Gaussian network.

Every module maps the elementwise mean and variance of its input, both of shape (B, …), to those
of its output, assuming independent inputs. Weights are w ~ N(μ, σ²) with σ = softplus(ρ).

Each module also has ``forward_sampled(x)``: the same network with weights *sampled*, for
Monte Carlo inference. ``x`` has a leading sample axis (S, B, …) and every sample s uses its own
weight draw, so S forward passes run as one batched computation.

:func:`expected_link` gives E[link(a)] for a ~ N(m, v), the exact mean of an output link
(softplus, exp) under the Gaussian that moment propagation assigns to a pre-activation.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_SQRT_2PI = math.sqrt(2 * math.pi)


# --- activation moments ---------------------------------------------------------------------

_T_MAX = 40.0  # |μ/s| beyond this: Φ, φ are 0 or 1 to float64 precision (Φ(−40) ≈ 4e-350)


def _relu_var_std(t: torch.Tensor, cdf_neg: torch.Tensor, pdf: torch.Tensor) -> torch.Tensor:
    """h(t) = Var[relu(Z + t)], Z ~ N(0, 1), accurate in both tails.

    For u = −|t| ≤ 0 the closed form h(u) = (u²+1)Φ(u) + uφ(u) − (uΦ(u) + φ(u))² only loses a
    factor ~u⁴ of precision (its terms shrink with Φ(u)). For t > 0, relu(z) = z + relu(−z)
    gives h(t) = 1 + h(−t) − 2Φ(−t), which avoids cancelling the large t² terms.
    """
    u = -t.abs()
    g = u * cdf_neg + pdf
    h_neg = ((u * u + 1) * cdf_neg + u * pdf - g * g).clamp_min(0.0)
    return torch.where(t > 0, 1 + h_neg - 2 * cdf_neg, h_neg).clamp_min(0.0)


class _LeakyReLUMoments(torch.autograd.Function):
    """Mean and variance of leaky_relu(z, a) for z ~ N(μ, v), with closed-form gradients.

    With s = √v, t = μ/s, Φ = Φ(t), φ = φ(t), E₊ = E[relu z] = μΦ + sφ:
        mean M = aμ + (1−a)E₊
        var  V = v·[a² + 2a(1−a)Φ + (1−a)²h(t)]          (no large terms cancel)
        ∂M/∂μ = a + (1−a)Φ            ∂M/∂v = (1−a)φ/(2s)
        ∂V/∂μ = 2(1−a)[E₊(1 − (1−a)Φ) − aμΦ]
        ∂V/∂v = a² + (1−a²)Φ − (1−a)Mφ/s
    (from E[f²] = a²(μ²+v) + (1−a²)[(μ²+v)Φ + μsφ], ∂E[relu²]/∂v = Φ). t is clamped to ±40,
    where Φ and φ are exact to float64; v = 0 gives f(μ) and 0 exactly.

    Φ comes from erfc, accurate deep into the tail (torch.special.ndtr is 4 % off at t = −5 in
    float32 and 2 % at t = −8 in float64). Computed in the input dtype: in float64 the moments are
    exact to ~1e-10 relative for |t| ≤ 40; in float32 to ~3e-3 relative for t ≥ −10, where
    they are already below 1e-16·v. E[relu z] ≥ 0 is enforced.
    """

    @staticmethod
    def forward(ctx, mean: torch.Tensor, var: torch.Tensor, a: float):
        v = var.clamp_min(0.0)
        s = v.sqrt().clamp_min(torch.finfo(v.dtype).tiny)
        t = (mean / s).clamp(-_T_MAX, _T_MAX)
        cdf_neg = 0.5 * torch.special.erfc(t.abs() * (1 / math.sqrt(2)))  # Φ(−|t|)
        cdf = torch.where(t > 0, 1 - cdf_neg, cdf_neg)
        pdf = torch.exp(-0.5 * t * t) * (1 / math.sqrt(2 * math.pi))
        e_pos = (mean * cdf + s * pdf).clamp_min(0.0)  # E[relu z] ≥ 0
        out_mean = a * mean + (1 - a) * e_pos
        h = _relu_var_std(t, cdf_neg, pdf)
        out_var = v * (a * a + 2 * a * (1 - a) * cdf + (1 - a) ** 2 * h)
        ctx.save_for_backward(mean, s, cdf, pdf, e_pos, out_mean)
        ctx.a = a
        return out_mean, out_var

    @staticmethod
    def backward(ctx, grad_mean: torch.Tensor, grad_var: torch.Tensor):
        mean, s, cdf, pdf, e_pos, out_mean = ctx.saved_tensors
        a = ctx.a
        dm_dmu = a + (1 - a) * cdf
        dm_dv = (1 - a) * pdf / (2 * s)
        dv_dmu = 2 * (1 - a) * (e_pos * (1 - (1 - a) * cdf) - a * mean * cdf)
        dv_dv = a * a + (1 - a * a) * cdf - (1 - a) * out_mean * pdf / s
        return (grad_mean * dm_dmu + grad_var * dv_dmu,
                grad_mean * dm_dv + grad_var * dv_dv, None)


def leaky_relu_moments(mean: torch.Tensor, var: torch.Tensor,
                       slope: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact mean and variance of leaky_relu(z, slope) for z ~ N(mean, var); ReLU is slope 0.

    Shapes are elementwise and preserved. Stable for |mean/std| up to and beyond 40 and for
    var down to 0 (see :class:`_LeakyReLUMoments` for the formulas).
    """
    return _LeakyReLUMoments.apply(mean, var, float(slope))


# --- the fused path: the same moments in fewer passes over memory ----------------------------
# The reference path above spends most of its time in ~45 elementwise passes of the activation
# (each a full read and write of a (B, width) tensor). The fused path evaluates the same closed
# forms, rearranged around erfc and exp of one variable, in ~20 mostly in-place passes; under
# torch.compile they become one loop per layer.

@torch.library.custom_op("uqbench::erfc", mutates_args=())
def _erfc_kernel(z: torch.Tensor) -> torch.Tensor:
    """ATen's erfc kernel; compiled code calls it as is, since inductor's own vectorised erfc is
    about twice as slow on CPU (the one transcendental that dominates the compiled pass)."""
    return torch.special.erfc(z)


@_erfc_kernel.register_fake
def _(z: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(z)


def _erfc(z: torch.Tensor) -> torch.Tensor:
    return _erfc_kernel(z) if torch.compiler.is_compiling() else torch.special.erfc(z)


def _leaky_relu_moments_fused(mean: torch.Tensor, var: torch.Tensor, a: float,
                              keep: bool = False) -> tuple[torch.Tensor, ...]:
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
    big_c = _erfc(at * (1 / math.sqrt(2)))                      # 2Φ(−|t|)
    t2 = t * t
    pdf = torch.exp(t2 * -0.5).mul_(1 / _SQRT_2PI)              # φ(t)
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
    return _leaky_relu_moments_fused(mean, var, float(slope))


# --- expectations of output links under a Gaussian ---------------------------------------------

LINKS = ("softplus", "exp")

# Node counts measured against scipy.integrate.quad on 1500 random (m, v), |m| ≤ 50,
# 1e-6 ≤ v ≤ 1e4: worst relative error 5e-15 (16 × 8 panel nodes and 32 Hermite nodes: 2e-10).
_GH_MAX_STD = 1.0    # s = √v up to this: Gauss–Hermite; above it: the kink split (see below)
_GH_NODES = 40       # the integrand is analytic in a strip of half-width π/s in the standardised
                     # variable: error ~ exp(−2(π/√2s)√(2n)) ≈ e^{-40} at s = 1
_PANELS, _PANEL_NODES = 16, 12  # composite Gauss–Legendre on the half-line window: panels
                                # ≤ 6 wide over |m| ≤ 50, v ≤ 1e4
_TAIL = 100.0        # the half-line window ends where the integrand's envelope is e^{-_TAIL/2}
_SQRT_HALF_PI = math.sqrt(math.pi / 2)


@cache
def _hermite(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes z_i and weights w_i with Σ w_i f(z_i) ≈ E[f(Z)], Z ~ N(0, 1)."""
    x, w = np.polynomial.hermite.hermgauss(n)
    return x * math.sqrt(2), w / math.sqrt(math.pi)


@cache
def _legendre_panels(panels: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes t_j on [0, 1] (``panels`` equal panels of n Gauss–Legendre nodes) and weights with
    Σ w_j f(t_j) ≈ ∫₀¹ f(t) dt."""
    x, w = np.polynomial.legendre.leggauss(n)
    left = np.arange(panels)[:, None] / panels
    return (left + (x + 1) / (2 * panels)).ravel(), np.tile(w / (2 * panels), panels)


def _const(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=like.dtype, device=like.device)


def _softplus(a: torch.Tensor) -> torch.Tensor:
    return a.clamp_min(0) + torch.log1p(torch.exp(-a.abs()))  # no overflow, exact tails


def _dsigmoid(a: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(a) * torch.sigmoid(-a)  # σ'(a), even; e^{-|a|} in the tails


# What each expectation integrates. Where s is large, f = kink part + remainder: the kink part's
# expectation has a closed form, and the remainder r is smooth on each half line, even ("+":
# r(a) = r(|a|)) or odd ("−": r(a) = −sign(a) r(|a|)); ``half`` gives r on u ≥ 0.
#   softplus(a) = relu(a) + log1p(e^{−|a|})      sigmoid(a) = H(a) − sign(a)·σ(−|a|)
#   σ'(a) = σ(a)σ(−a), no kink
_INTEGRANDS = {
    "softplus": (_softplus, lambda u: torch.log1p(torch.exp(-u)), 1.0),
    "sigmoid": (torch.sigmoid, lambda u: torch.sigmoid(-u), -1.0),
    "dsigmoid": (_dsigmoid, _dsigmoid, 1.0),
}


def _kink_part(name: str, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """E[relu(a)] (softplus), Φ(m/s) = E[H(a)] (sigmoid) or 0 (σ'), for a ~ N(m, s²), s > 0.

    E[relu(a)] = relu(m) + s·h(−|m|/s), h(u) = φ(u) + uΦ(u) (u ≤ 0) = φ(u)[1 − |u|·Φ(u)/φ(u)],
    with Φ(u)/φ(u) = √(π/2)·erfcx(|u|/√2): no underflow, and every term is ≥ 0.
    """
    t = m / s
    if name == "softplus":
        u = t.abs()
        bracket = (1 - u * _SQRT_HALF_PI * torch.special.erfcx(u / math.sqrt(2))).clamp_min(0)
        return m.clamp_min(0) + s * torch.exp(-0.5 * u * u) / _SQRT_2PI * bracket
    if name == "sigmoid":
        return 0.5 * torch.special.erfc(-t / math.sqrt(2))
    return torch.zeros_like(m)


def _half_line_part(name: str, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """E[r(a)] = ∫₀^∞ r(u)·[N(u; −m, v) ± N(u; m, v)] du for the remainder r of ``name``.

    r(u) ≤ e^{−u}, so the larger term, r(u)·N(u; |m|, v), is at most a Gaussian in u centred at
    p = |m| − v with variance v: the window [p − W, p + W] ∩ [0, ∞) (W = √(_TAIL·v)), narrowed
    on the right to where that envelope falls by e^{−_TAIL/2} when p < 0, holds all but a
    fraction e^{−_TAIL/2} of the integral. m, v: (N,); returns (N,).
    """
    _, half, sign = _INTEGRANDS[name]
    s = v.sqrt()
    p = m.abs() - v
    q = (-p).clamp_min(0)
    # √(q² + Tv) − q, written so that large q does not cancel
    upper = p.clamp_min(0) + _TAIL * v / (torch.sqrt(q * q + _TAIL * v) + q)
    lower = (p - math.sqrt(_TAIL) * s).clamp_min(0)
    t, w = (_const(a, m) for a in _legendre_panels(_PANELS, _PANEL_NODES))
    width = (upper - lower)[:, None]
    u = lower[:, None] + width * t                                   # (N, K)
    pdf = lambda c: torch.exp(-0.5 * ((u - c[:, None]) / s[:, None]) ** 2)  # noqa: E731
    weight = pdf(-m) + sign * pdf(m)
    return (half(u) * weight * w).sum(-1) * width[:, 0] / (s * _SQRT_2PI)


def _gaussian_expectation(name: str, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E[f(a)], a ~ N(mean, var) elementwise, f = softplus, sigmoid or σ' (``name``).

    s ≤ 1: Gauss–Hermite in the standardised variable; s > 1: closed-form kink part plus the
    half-line remainder (:func:`_half_line_part`); v = 0: f(mean) exactly. Each element is
    computed by one rule only (no work, and no inf/nan, in the branch it does not take).
    """
    full, _, _ = _INTEGRANDS[name]
    v = var.clamp_min(0)
    out = full(mean)  # v = 0
    small = (v > 0) & (v <= _GH_MAX_STD ** 2)
    if small.any():
        z, w = (_const(a, mean) for a in _hermite(_GH_NODES))
        m, s = mean[small], v[small].sqrt()
        out[small] = (full(m[:, None] + s[:, None] * z) * w).sum(-1)  # no matmul: not FLOPs
    large = v > _GH_MAX_STD ** 2
    if large.any():
        m, vl = mean[large], v[large]
        out[large] = _kink_part(name, m, vl.sqrt()) + _half_line_part(name, m, vl)
    return out


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for the quadrature; MPS has no float64, so float32 there (~1e-6 relative)."""
    return torch.float32 if t.device.type == "mps" else torch.float64


class _ExpectedSoftplus(torch.autograd.Function):
    """E[softplus(a)], a ~ N(m, v), with its exact gradients (Stein's lemma):
        ∂/∂m = E[σ(a)]        ∂/∂v = ½·E[σ'(a)] = ½·E[σ(a)σ(−a)]
    all three computed by the same quadrature, in float64, and cast back to the input dtype.
    Closed-form gradients, because autograd through √v is infinite at v = 0.
    """

    @staticmethod
    def forward(ctx, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        dtype = _work_dtype(mean)
        m, v = mean.to(dtype), var.to(dtype)
        ctx.save_for_backward(m, v)
        return _gaussian_expectation("softplus", m, v).to(mean.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        m, v = ctx.saved_tensors
        g = grad.to(m.dtype)
        dm = g * _gaussian_expectation("sigmoid", m, v)
        dv = g * 0.5 * _gaussian_expectation("dsigmoid", m, v)
        return dm.to(grad.dtype), dv.to(grad.dtype)


def expected_softplus(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E[softplus(a)] for a ~ N(mean, var), elementwise, any (broadcastable) shapes.

    Accurate to ~1e-14 relative in float64 (|mean| ≤ 50, 0 ≤ var ≤ 1e4, tails included);
    var = 0 gives softplus(mean) exactly; differentiable in both arguments.
    """
    mean, var = torch.broadcast_tensors(mean, var)
    dtype = torch.promote_types(mean.dtype, var.dtype)
    shape = mean.shape
    out = _ExpectedSoftplus.apply(mean.to(dtype).reshape(-1), var.to(dtype).reshape(-1))
    return out.reshape(shape)


def apply_link(link: str, a: torch.Tensor) -> torch.Tensor:
    """link(a), elementwise: softplus or exp (``LINKS``)."""
    if link == "softplus":
        return F.softplus(a)
    if link == "exp":
        return torch.exp(a)
    raise ValueError(f"link '{link}' is not one of {LINKS}")


def expected_link(link: str, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """E[link(a)] for a ~ N(mean, var), elementwise, shape of the broadcast inputs.

    softplus: :func:`expected_softplus` (quadrature); exp: exp(mean + var/2) (lognormal mean).
    """
    if link == "softplus":
        return expected_softplus(mean, var)
    if link == "exp":
        return torch.exp(mean + 0.5 * var.clamp_min(0))
    raise ValueError(f"link '{link}' is not one of {LINKS}")


# --- layers ---------------------------------------------------------------------------------

class MomentModule(nn.Module):
    """A layer of a moment-propagating network: (mean, var) → (mean, var)."""

    def forward(self, mean: torch.Tensor,
                var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` by the fused path; var None means a deterministic input (v = 0). Layers
        without a fused form run their ``forward``."""
        return self(mean, torch.zeros_like(mean) if var is None else var)

    def kl(self) -> torch.Tensor:
        return torch.zeros(())


PRIORS = ("fixed", "fan_in")


class _GaussianParams(MomentModule):
    """Mean-field Gaussian weight and bias: μ and ρ per entry, σ = softplus(ρ).

    The prior is N(0, prior_std²) on every weight and bias (``prior: fixed``) or
    N(0, prior_std²/fan_in) (``prior: fan_in``: the layer's std shrinks like its init range, so a
    wide layer's summed output keeps the same prior scale).
    """

    def __init__(self, weight_shape: tuple[int, ...], bias_size: int, fan_in: int,
                 prior_std: float, rho_init: float, prior: str = "fixed") -> None:
        super().__init__()
        if prior_std <= 0:
            raise ValueError(f"prior_std must be > 0, got {prior_std}")
        if prior not in PRIORS:
            raise ValueError(f"prior '{prior}' is not one of {PRIORS}")
        self.prior = prior
        self.prior_std = float(prior_std) / (math.sqrt(fan_in) if prior == "fan_in" else 1.0)
        bound = 1.0 / math.sqrt(fan_in)  # PyTorch's default Linear/Conv init range
        self.weight_mu = nn.Parameter(torch.empty(weight_shape).uniform_(-bound, bound))
        self.weight_rho = nn.Parameter(torch.full(weight_shape, float(rho_init)))
        self.bias_mu = nn.Parameter(torch.empty(bias_size).uniform_(-bound, bound))
        self.bias_rho = nn.Parameter(torch.full((bias_size,), float(rho_init)))

    @property
    def weight_var(self) -> torch.Tensor:
        return F.softplus(self.weight_rho) ** 2

    @property
    def bias_var(self) -> torch.Tensor:
        return F.softplus(self.bias_rho) ** 2

    def kl(self) -> torch.Tensor:
        """KL(q ‖ N(0, prior_std²)) summed over every weight and bias (prior_std: this
        layer's, after any fan-in scaling)."""
        total = torch.zeros((), device=self.weight_mu.device)
        p2 = self.prior_std ** 2
        for mu, rho in ((self.weight_mu, self.weight_rho), (self.bias_mu, self.bias_rho)):
            sigma = F.softplus(rho)
            total = total + (math.log(self.prior_std) - torch.log(sigma)
                             + (sigma ** 2 + mu ** 2) / (2 * p2) - 0.5).sum()
        return total

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n independent draws of (weight, bias): shapes (n, *weight_shape), (n, out)."""
        w = self.weight_mu + F.softplus(self.weight_rho) * torch.randn(
            (n, *self.weight_mu.shape), device=self.weight_mu.device)
        b = self.bias_mu + F.softplus(self.bias_rho) * torch.randn(
            (n, *self.bias_mu.shape), device=self.bias_mu.device)
        return w, b


class GaussianLinear(_GaussianParams):
    """Bayesian linear layer. Input and output moments are (B, in) → (B, out).

        mean = m μ_Wᵀ + μ_b
        var  = v (μ_W² + σ_W²)ᵀ + m² (σ_W²)ᵀ + σ_b²
    """

    def __init__(self, in_features: int, out_features: int, prior_std: float = 1.0,
                 rho_init: float = -2.0, prior: str = "fixed") -> None:
        super().__init__((out_features, in_features), out_features, in_features,
                         prior_std, rho_init, prior)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_var = self.weight_var
        out_mean = F.linear(mean, self.weight_mu, self.bias_mu)
        out_var = (F.linear(var, self.weight_mu ** 2 + w_var)
                   + F.linear(mean ** 2, w_var) + self.bias_var)
        return out_mean, out_var

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with fewer passes: (B, in) → (B, out); var None: v = 0, so its product
        is skipped. in = 1 is an outer product, written pointwise (a compiler fuses it into the
        next activation); under torch.compile an output of ≤ 2 units is a sum over the inputs,
        so it fuses into the previous activation instead of writing (B, in) moments out."""
        w_var, b_var = self.weight_var, self.bias_var
        if self.in_features == 1:
            out_mean = torch.addcmul(self.bias_mu, mean, self.weight_mu.T)  # (B, 1)·(1, out)
            out_var = torch.addcmul(b_var, mean * mean, w_var.T)
            if var is not None:
                out_var.addcmul_(var, (self.weight_mu ** 2 + w_var).T)
        elif torch.compiler.is_compiling() and self.out_features <= 2:
            m = mean.unsqueeze(1)                                           # (B, 1, in)
            out_mean = (m * self.weight_mu).sum(-1) + self.bias_mu
            out_var = (m * m * w_var).sum(-1) + b_var
            if var is not None:
                out_var = out_var + (var.unsqueeze(1) * (self.weight_mu ** 2 + w_var)).sum(-1)
        else:
            out_mean = F.linear(mean, self.weight_mu, self.bias_mu)
            out_var = torch.addmm(b_var, mean * mean, w_var.T)
            if var is not None:  # out of place: torch's FLOP counter skips an in-place addmm_
                out_var = torch.addmm(out_var, var, (self.weight_mu ** 2 + w_var).T)
        return out_mean, out_var

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        """(S, B, in) → (S, B, out), weights drawn once per sample s."""
        w, b = self.sample(x.shape[0])  # (S, out, in), (S, out)
        return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, prior_std={self.prior_std}"


class GaussianConv2d(_GaussianParams):
    """Bayesian 2-D convolution, moments (B, C_in, H, W) → (B, C_out, H', W').

    Same rule as the linear layer with the convolution in place of the matrix product, applied
    to the squared kernels for the variance.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 padding: int = 0, prior_std: float = 1.0, rho_init: float = -2.0,
                 prior: str = "fixed") -> None:
        k = kernel_size
        super().__init__((out_channels, in_channels, k, k), out_channels, in_channels * k * k,
                         prior_std, rho_init, prior)
        self.stride, self.padding = stride, padding

    def _conv(self, x: torch.Tensor, w: torch.Tensor,
              b: torch.Tensor | None = None) -> torch.Tensor:
        return F.conv2d(x, w, b, stride=self.stride, padding=self.padding)

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_var = self.weight_var
        out_mean = self._conv(mean, self.weight_mu, self.bias_mu)
        out_var = (self._conv(var, self.weight_mu ** 2 + w_var) + self._conv(mean ** 2, w_var)
                   + self.bias_var[:, None, None])
        return out_mean, out_var

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        """(S, B, C, H, W) → (S, B, C_out, H', W') via one grouped convolution over samples."""
        S, B, C, H, W = x.shape
        w, b = self.sample(S)  # (S, C_out, C, k, k), (S, C_out)
        # samples become channel groups: (B, S*C, H, W) * (S*C_out, C, k, k) → (B, S*C_out, H', W')
        y = F.conv2d(x.transpose(0, 1).reshape(B, S * C, H, W), w.flatten(0, 1), b.flatten(),
                     stride=self.stride, padding=self.padding, groups=S)
        return y.reshape(B, S, -1, *y.shape[-2:]).transpose(0, 1)


class MomentAvgPool2d(MomentModule):
    """Average pooling over n inputs: mean pooled, var = Σv / n² (independent inputs)."""

    def __init__(self, kernel_size: int, stride: int | None = None) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride or kernel_size

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.kernel_size ** 2
        pool = F.avg_pool2d
        return (pool(mean, self.kernel_size, self.stride),
                pool(var, self.kernel_size, self.stride) / n)

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        y = F.avg_pool2d(x.flatten(0, 1), self.kernel_size, self.stride)
        return y.reshape(*x.shape[:2], *y.shape[1:])


class MomentLeakyReLU(MomentModule):
    """Leaky-ReLU with slope a (ReLU: a = 0); moments by :func:`leaky_relu_moments`."""

    def __init__(self, slope: float = 0.0) -> None:
        super().__init__()
        self.slope = float(slope)

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return leaky_relu_moments(mean, var, self.slope)

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.zeros_like(mean) if var is None else var
        return leaky_relu_moments_fused(mean, var, self.slope)

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.slope)

    def extra_repr(self) -> str:
        return f"slope={self.slope}"


class MomentReLU(MomentLeakyReLU):
    def __init__(self) -> None:
        super().__init__(0.0)


class MomentFlatten(MomentModule):
    """Flatten all but the batch axis (and the sample axis in sampled mode)."""

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mean.flatten(1), var.flatten(1)

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2)


class MomentSequential(nn.Sequential):
    """Chain of moment modules; ``kl`` sums the layers' KL terms."""

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self:
            mean, var = layer(mean, var)
        return mean, var

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` by the fused path (equal to rounding, gradients included); var None: a
        deterministic input, v = 0."""
        for layer in self:
            mean, var = layer.forward_fused(mean, var)
        return mean, torch.zeros_like(mean) if var is None else var

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer.forward_sampled(x)
        return x

    def kl(self) -> torch.Tensor:
        return sum((layer.kl() for layer in self), torch.zeros(()))
