"""Every moment rule against Monte Carlo (≥ 1e5 samples), far tails included."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from uqbench.methods.moments import (
    GaussianConv2d,
    GaussianLinear,
    MomentAvgPool2d,
    MomentFlatten,
    MomentLeakyReLU,
    MomentSequential,
    leaky_relu_moments,
)

N_MC = 400_000


def mc_check(samples: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, z: float = 5.0,
             atol: float = 1e-6):
    """Assert analytic mean/var agree with MC samples (S, …) within z standard errors.

    ``atol``: 4e5 samples cannot resolve moments below ~1e-6 (at μ/s = −5 a ReLU is positive
    with probability 3e-7); those tails are checked against scipy's closed forms below.
    """
    samples = samples.double()
    n = samples.shape[0]
    mc_mean, mc_var = samples.mean(0), samples.var(0)
    se_mean = (mc_var / n).sqrt()
    fourth = ((samples - mc_mean) ** 4).mean(0)
    se_var = ((fourth - mc_var ** 2).clamp_min(0) / n).sqrt()
    tol = atol
    assert torch.all((mean.double() - mc_mean).abs() <= z * se_mean + tol), (mean, mc_mean)
    assert torch.all((var.double() - mc_var).abs() <= z * se_var + tol), (var, mc_var)


@pytest.mark.parametrize("slope", [0.0, 0.01, 0.1, 0.3])
@pytest.mark.parametrize("mu,var", [(0.0, 1.0), (1.3, 0.2), (-0.7, 2.5), (-5.0, 1.0),
                                    (5.0, 1.0), (-3.0, 0.04), (12.0, 0.09), (-40.0, 1.0),
                                    (40.0, 1.0), (0.8, 0.0), (-0.8, 0.0)])
def test_leaky_relu_moments_match_monte_carlo(mu, var, slope):
    gen = torch.Generator().manual_seed(0)
    z = mu + math.sqrt(var) * torch.randn(N_MC, generator=gen, dtype=torch.float64)
    f = F.leaky_relu(z, slope)
    for dtype in (torch.float32, torch.float64):
        m, v = leaky_relu_moments(torch.tensor([mu], dtype=dtype),
                                  torch.tensor([var], dtype=dtype), slope)
        assert m.dtype == dtype and torch.isfinite(m).all() and torch.isfinite(v).all()
        assert v.item() >= 0
        mc_check(f.unsqueeze(1), m, v)


def test_relu_mean_in_the_tail_is_positive_and_accurate():
    """At (μ, s²) = (−5, 1): E[relu] = sφ(5) − 5Φ(−5) > 0, Var from the closed form.

    A public implementation that clamps μ/s to ±3 is 39× off in variance here (slope 0.01) and
    returns a negative ReLU mean; the expected values come from scipy, independently.
    """
    from scipy.stats import norm

    t = -5.0
    g = t * norm.cdf(t) + norm.pdf(t)
    e2 = (t * t + 1) * norm.cdf(t) + t * norm.pdf(t)
    m, v = leaky_relu_moments(torch.tensor([-5.0], dtype=torch.float64),
                              torch.tensor([1.0], dtype=torch.float64), 0.0)
    assert m.item() > 0
    assert m.item() == pytest.approx(g, rel=1e-9)
    assert v.item() == pytest.approx(e2 - g * g, rel=1e-7)
    a = 0.01  # leaky: E[f²] − E[f]² with f = a z + (1 − a) relu z
    mean_f = a * t + (1 - a) * g
    ef2 = a * a * (t * t + 1) + (1 - a * a) * e2
    _, v = leaky_relu_moments(torch.tensor([-5.0], dtype=torch.float64),
                              torch.tensor([1.0], dtype=torch.float64), a)
    assert v.item() == pytest.approx(ef2 - mean_f ** 2, rel=1e-7)


def test_leaky_relu_moments_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(1)
    for slope in (0.0, 0.1):
        m = (3 * torch.randn(40, generator=gen, dtype=torch.float64)).requires_grad_()
        v = (0.05 + torch.rand(40, generator=gen, dtype=torch.float64)).requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b, s=slope: leaky_relu_moments(a, b, s), (m, v))


def test_extreme_inputs_stay_finite():
    mu = torch.tensor([-1e4, -400.0, -40.0, 0.0, 40.0, 400.0, 1e4])
    for var in (0.0, 1e-30, 1e-6, 1.0, 1e6):
        m, v = leaky_relu_moments(mu.clone().requires_grad_(), torch.full_like(mu, var), 0.1)
        assert torch.isfinite(m).all() and torch.isfinite(v).all() and (v >= 0).all()


def _mc_layer(layer, x_mean, x_var, n=N_MC // 4):
    """Sample inputs from N(m, v) and weights per sample; return (n, …) outputs."""
    gen = torch.Generator().manual_seed(2)
    x = x_mean + x_var.sqrt() * torch.randn((n, *x_mean.shape), generator=gen)
    return layer.forward_sampled(x)


def test_gaussian_linear_moments_match_monte_carlo():
    torch.manual_seed(0)
    layer = GaussianLinear(3, 2, rho_init=-1.0)
    m = torch.tensor([[0.5, -1.0, 2.0]])
    v = torch.tensor([[0.3, 0.0, 0.1]])
    mean, var = layer(m, v)
    samples = _mc_layer(layer, m, v)  # (n, 1, 2)
    mc_check(samples, mean, var)


def test_gaussian_conv_and_avgpool_moments_match_monte_carlo():
    torch.manual_seed(0)
    conv = GaussianConv2d(2, 2, kernel_size=3, padding=1, rho_init=-1.5)
    pool = MomentAvgPool2d(2)
    net = MomentSequential(conv, MomentLeakyReLU(0.1), pool)
    m = torch.randn(1, 2, 4, 4)
    v = 0.2 * torch.rand(1, 2, 4, 4)
    # conv and pool separately: exact rules, checked against sampling
    mean, var = conv(m, v)
    mc_check(_mc_layer(conv, m, v), mean, var)
    mean, var = pool(m, v)
    mc_check(_mc_layer(pool, m, v), mean, var)
    # The whole chain is exact in its mean only to the Gaussian approximation, and pooling
    # neighbouring conv outputs ignores the correlation their shared kernel weights create
    # (the mean-field assumption); so only the means are compared, within 5 %.
    mean, _ = net(m, v)
    s = _mc_layer(net, m, v).double()
    assert torch.allclose(mean.double(), s.mean(0), rtol=0.05, atol=1e-3)


def test_kl_matches_closed_form_and_torch_distributions():
    layer = GaussianLinear(4, 3, prior_std=0.7, rho_init=-1.0)
    q = torch.distributions.Normal(
        torch.cat([layer.weight_mu.flatten(), layer.bias_mu]),
        F.softplus(torch.cat([layer.weight_rho.flatten(), layer.bias_rho])))
    p = torch.distributions.Normal(0.0, 0.7)
    expected = torch.distributions.kl_divergence(q, p).sum()
    assert layer.kl().item() == pytest.approx(expected.item(), rel=1e-5)
    net = MomentSequential(layer, MomentLeakyReLU(0.1), MomentFlatten())
    assert net.kl().item() == pytest.approx(expected.item(), rel=1e-5)


def test_bad_prior_is_rejected():
    with pytest.raises(ValueError, match="prior_std"):
        GaussianLinear(2, 2, prior_std=-1.0)
