"""The fused moment pass equals the reference layers (values and gradients, float64 and float32,
tails and v = 0 included); hand-computed values and finite differences check it on its own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP, check_options
from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.fused import erfcx_fit, leaky_relu_moments_fused
from uqbench.methods.moments.layers import GaussianLinear

# Tolerances. float64: both paths are exact to ~1e-13 relative except where a tail term cancels
# (g = φ − |t|Φ(−|t|) loses ~t² digits, h₋ ~t⁴): 1e-9 relative covers |t| ≤ 40, and values
# near float64's underflow (< 1e-280 of the scale) are only held to an absolute bound.
# float32: ~1e-7 relative per op, so 2e-6 of the scale (|μ| + s for means, v for variances).
TOL = {torch.float64: dict(rtol=1e-9, floor=1e-280, scale_tol=1e-13),
       torch.float32: dict(rtol=None, floor=None, scale_tol=2e-6)}
SLOPES = (0.0, 0.1, 0.3)


def assert_equal_to_rounding(fast, ref, scale, dtype):
    """|fast − ref| ≤ scale_tol·scale everywhere and, float64, ≤ rtol·|ref| wherever |ref| is
    a normal number well above underflow (floor·scale)."""
    tol = TOL[dtype]
    assert torch.isfinite(fast).all() == torch.isfinite(ref).all()
    err = (fast - ref).abs()
    assert (err <= tol["scale_tol"] * scale).all(), (err / scale).max()
    if tol["rtol"] is not None:
        normal = ref.abs() > tol["floor"] * scale
        assert (err[normal] <= tol["rtol"] * ref.abs()[normal]).all(), \
            (err[normal] / ref.abs()[normal]).max()


def tail_grid(dtype):
    """μ = t·s for t in [−45, 45] (clamped at ±40 inside) and s over 4.5 decades: (N,) each."""
    t = torch.linspace(-45, 45, 721, dtype=dtype)
    s = torch.tensor([1e-3, 0.7, 30.0], dtype=dtype)
    return (t[:, None] * s).flatten(), (s * s).expand(len(t), 3).flatten()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("slope", SLOPES)
def test_fused_leaky_relu_moments_equal_the_reference(dtype, slope):
    mean, var = tail_grid(dtype)
    fm, fv = leaky_relu_moments_fused(mean, var, slope)
    rm, rv = leaky_relu_moments(mean, var, slope)
    assert_equal_to_rounding(fm, rm, mean.abs() + var.sqrt(), dtype)
    assert_equal_to_rounding(fv, rv, var, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("slope", SLOPES)
def test_fused_gradients_equal_the_reference(dtype, slope):
    """∂/∂μ and ∂/∂v of Σ(g₁·M + g₂·V) for random g, over the tail grid."""
    mean, var = tail_grid(dtype)
    gen = torch.Generator().manual_seed(0)
    g_mean, g_var = (torch.randn(mean.shape, generator=gen, dtype=dtype) for _ in range(2))
    grads = []
    for fn in (leaky_relu_moments_fused, leaky_relu_moments):
        m, v = mean.clone().requires_grad_(), var.clone().requires_grad_()
        out_m, out_v = fn(m, v, slope)
        grads.append(torch.autograd.grad((g_mean * out_m + g_var * out_v).sum(), (m, v)))
    (fast_dm, fast_dv), (ref_dm, ref_dv) = grads
    s = var.sqrt()
    # |∂M/∂μ|, |∂V/∂v| ≤ 1 + O(a); ∂V/∂μ ~ |μ| + s; ∂M/∂v ~ 1/s
    assert_equal_to_rounding(fast_dm, ref_dm, (1 + mean.abs() + s) * (g_mean.abs() + g_var.abs()),
                             dtype)
    assert_equal_to_rounding(fast_dv, ref_dv, (1 + 1 / s) * (g_mean.abs() + g_var.abs()), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zero_variance_gives_the_activation_itself(dtype):
    """v = 0: leaky(μ) and 0, the gradient in μ is the activation's slope (by hand)."""
    mean = torch.tensor([-30.0, -2.0, -1e-3, 1e-3, 0.5, 40.0], dtype=dtype, requires_grad=True)
    var = torch.zeros_like(mean)
    out_m, out_v = leaky_relu_moments_fused(mean, var, 0.2)
    assert torch.equal(out_v, torch.zeros_like(out_v))
    torch.testing.assert_close(out_m, F.leaky_relu(mean.detach(), 0.2), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out_m.sum(), mean)
    torch.testing.assert_close(grad, torch.tensor([0.2, 0.2, 0.2, 1, 1, 1], dtype=dtype))


def test_fused_moments_at_zero_mean_match_the_half_normal():
    """μ = 0, ReLU: E = s/√(2π), Var = v(1/2 − 1/(2π)) (the half-normal, by hand)."""
    var = torch.tensor([1e-6, 1.0, 9.0], dtype=torch.float64)
    out_m, out_v = leaky_relu_moments_fused(torch.zeros(3, dtype=torch.float64), var, 0.0)
    torch.testing.assert_close(out_m, var.sqrt() / math.sqrt(2 * math.pi), rtol=1e-14, atol=0)
    torch.testing.assert_close(out_v, var * (0.5 - 1 / (2 * math.pi)), rtol=1e-14, atol=0)


def test_fused_gradients_match_finite_differences():
    mean = torch.tensor([-6.0, -1.5, -0.2, 0.0, 0.3, 2.0, 7.0], dtype=torch.float64)
    var = torch.tensor([0.5, 2.0, 0.1, 1.0, 3.0, 0.7, 1.5], dtype=torch.float64)
    mean.requires_grad_()
    var.requires_grad_()
    assert torch.autograd.gradcheck(lambda m, v: leaky_relu_moments_fused(m, v, 0.1),
                                    (mean, var), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("in_features", [1, 5])
def test_fused_gaussian_linear_equals_the_reference(dtype, in_features):
    """Moments and gradients w.r.t. the input mean and var and every parameter; var = None
    (a deterministic input) equals var = 0."""
    torch.manual_seed(0)
    layer = GaussianLinear(in_features, 3, rho_init=-1.0).to(dtype)
    mean = (3 * torch.randn(6, in_features, dtype=dtype)).requires_grad_()
    var = torch.rand(6, in_features, dtype=dtype).requires_grad_()
    outs, grads = [], []
    for fn in (layer.forward_fused, layer.forward):
        out_m, out_v = fn(mean, var)
        loss = (out_m * torch.arange(3, dtype=dtype)).sum() + (out_v ** 2).sum()
        outs.append((out_m, out_v))
        grads.append(torch.autograd.grad(loss, (mean, var, *layer.parameters())))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for fast, ref in zip(outs[0] + grads[0], outs[1] + grads[1], strict=True):
        torch.testing.assert_close(fast, ref, **tol)
    for fast, ref in zip(layer.forward_fused(mean, None),
                         layer(mean, torch.zeros_like(mean)), strict=True):
        torch.testing.assert_close(fast, ref, **tol)


def bnn_pair(dtype, variance="learned", in_dim=3, width=8, depth=2):
    """The same BNN (same weights) with the fused pass and with the reference layers."""
    info = DataInfo("regression", in_dim=in_dim, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    fused = BayesianMLP(MLP(width=width, depth=depth), info, variance=variance,
                        rho_init=-1.0).to(dtype)
    ref = BayesianMLP(MLP(width=width, depth=depth), info, variance=variance, fused=False)
    ref.load_state_dict(fused.state_dict())
    return fused, ref.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variance,in_dim,depth", [("learned", 3, 2), ("embedded", 1, 1)])
def test_bnn_fused_pass_and_loss_gradients_equal_the_reference(dtype, variance, in_dim, depth):
    """moment_pass, the loss and ∂loss/∂(every parameter and the input) agree; inputs up to
    ±30 push hidden units deep into the tails."""
    fused, ref = bnn_pair(dtype, variance, in_dim, depth=depth)
    x = torch.linspace(-30, 30, 40 * in_dim, dtype=dtype).reshape(40, in_dim)
    y = torch.sin(x[:, :1])
    outs = []
    for model in (fused, ref):
        xg = x.clone().requires_grad_()
        mean, var = model.moment_pass(xg)
        loss = model.loss((xg, y))
        outs.append((mean, var, loss, *torch.autograd.grad(loss, (xg, *model.parameters()))))
    assert len(outs[0]) == 4 + 4 * (depth + 1)  # mean, var, loss, x; μ, ρ of W, b per layer
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)
    for fast, ref_value in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(fast, ref_value, **tol)


def test_fused_sequential_keeps_an_input_variance():
    """A non-zero input variance goes through every layer as in the reference."""
    fused, _ = bnn_pair(torch.float64)
    mean = torch.randn(10, 3, dtype=torch.float64)
    var = torch.rand(10, 3, dtype=torch.float64)
    for fast, ref in zip(fused.net.forward_fused(mean, var), fused.net(mean, var), strict=True):
        torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)


def test_fused_is_the_default_and_the_options_are_checked(compose_cfg):
    method = compose_cfg(["method=bnn"]).method
    assert (method.fused, method.compile) == (True, False)
    with pytest.raises(ValueError, match="method.compile: true compiles the fused"):
        check_options(fused=False, compile=True)
    with pytest.raises(ValueError, match="method.fused must be true or false, got 'yes'"):
        check_options(fused="yes")


@pytest.mark.slow
def test_compiled_pass_equals_the_reference():
    """torch.compile of the fused pass (inference, float32), as the BNN runs it
    (:mod:`uqbench.methods.moments.inference`): in = 1 written pointwise, erfc from the fitted
    erfcx."""
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    comp = BayesianMLP(MLP(width=16, depth=2), info, variance="learned", compile=True)
    ref = BayesianMLP(MLP(width=16, depth=2), info, variance="learned", fused=False)
    ref.load_state_dict(comp.state_dict())
    x = torch.linspace(-30, 30, 64).unsqueeze(1)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for fast, ref_value in zip(comp.moment_pass(x), ref.moment_pass(x), strict=True):
            torch.testing.assert_close(fast, ref_value, rtol=2e-5, atol=2e-5)
    # the compiled path really ran: dynamo compiled a graph for the fused pass
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs


def test_compiled_erfcx_fit_against_float64_erfcx():
    """The erfcx that compiled float32 passes use (a polynomial in τ = 1/(1 + z/2)), against
    float64 ``torch.special.erfcx`` over z ≥ 0 up to the clamp (t = 40): in float64 within its
    stated fractional error 1e-8, in float32 within a few units of 2⁻²⁴; and erfc as the pass
    forms it, erfcx·√(2π)·φ(t) from float32 t, against float64 erfc wherever erfc is a normal
    float32, within the float32 exp's own error (about z²·2⁻²⁴)."""
    z = torch.linspace(0, 40 / math.sqrt(2), 100_001, dtype=torch.float64)
    ref = torch.special.erfcx(z)
    assert ((erfcx_fit(z) - ref).abs() / ref).max().item() < 1e-8
    rel32 = ((erfcx_fit(z.float()).double() - ref).abs() / ref).max().item()
    assert rel32 < 8 * 2.0 ** -24
    t = (z * math.sqrt(2)).float()
    pdf = torch.exp(t * t * -0.5) * (1 / math.sqrt(2 * math.pi))
    erfc32 = (erfcx_fit(t.abs() * (1 / math.sqrt(2))) * (pdf * math.sqrt(2 * math.pi))).double()
    erfc = torch.special.erfc(t.double() / math.sqrt(2))
    normal = erfc > torch.finfo(torch.float32).tiny
    bound = 1e-8 + 4 * (z * z + 4) * 2.0 ** -24
    assert ((erfc32 - erfc).abs() / erfc <= bound)[normal].all()
    # beyond float32's normal range it underflows to a subnormal or zero, never above erfc
    assert (erfc32[~normal] <= 2 * torch.finfo(torch.float32).tiny).all()
