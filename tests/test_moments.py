"""Every moment rule against Monte Carlo (≥ 1e5 samples), far tails included; E[link(a)] also
against scipy quadrature."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.layers import GaussianLinear, MomentLeakyReLU, MomentSequential
from uqbench.methods.moments.links import expected_link, expected_softplus

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


def test_kl_matches_closed_form_and_torch_distributions():
    layer = GaussianLinear(4, 3, prior_std=0.7, rho_init=-1.0)
    q = torch.distributions.Normal(
        torch.cat([layer.weight_mu.flatten(), layer.bias_mu]),
        F.softplus(torch.cat([layer.weight_rho.flatten(), layer.bias_rho])))
    p = torch.distributions.Normal(0.0, 0.7)
    expected = torch.distributions.kl_divergence(q, p).sum()
    assert layer.kl().item() == pytest.approx(expected.item(), rel=1e-5)
    net = MomentSequential(layer, MomentLeakyReLU(0.1))
    assert net.kl().item() == pytest.approx(expected.item(), rel=1e-5)


def test_bad_prior_is_rejected():
    with pytest.raises(ValueError, match="prior_std"):
        GaussianLinear(2, 2, prior_std=-1.0)


# --- E[link(a)] for a ~ N(m, v) ----------------------------------------------------------------

LINK_MEANS = [-30.0, -8.0, -2.0, 0.0, 1.5, 8.0, 30.0]
LINK_VARS = [1e-4, 0.25, 4.0, 100.0, 2500.0]


def _softplus64(a: float) -> float:
    return max(a, 0.0) + math.log1p(math.exp(-abs(a)))


def _sigmoid64(a: float) -> float:
    e = math.exp(-abs(a))
    return 1 / (1 + e) if a >= 0 else e / (1 + e)


def _gaussian_quad(f, m: float, v: float) -> float:
    """E[f(m + √v Z)] by scipy's adaptive quadrature in z ∈ [−40, 40] (φ(40) ≈ 1e-348), split
    at the kink z = −m/√v, to 1e-13 relative: independent of the code under test."""
    from scipy import integrate
    from scipy.stats import norm

    s = math.sqrt(v)
    kink = -m / s
    edges = sorted({-40.0, 40.0, *([kink] if -40 < kink < 40 else [])})
    return sum(integrate.quad(lambda z: f(m + s * z) * norm.pdf(z), a, b, epsabs=0,
                              epsrel=1e-13, limit=500)[0] for a, b in itertools.pairwise(edges))


def _grid(means, variances) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.tensor([a for a in means for _ in variances], dtype=torch.float64)
    v = torch.tensor([b for _ in means for b in variances], dtype=torch.float64)
    return m, v


def test_expected_softplus_matches_monte_carlo_tails_included():
    """10⁶ draws per (m, v); agreement within 5 standard errors of the MC mean."""
    gen = torch.Generator().manual_seed(0)
    m, v = _grid(LINK_MEANS, LINK_VARS)
    got = expected_softplus(m, v)
    for i in range(len(m)):
        a = m[i] + v[i].sqrt() * torch.randn(10**6, generator=gen, dtype=torch.float64)
        f = F.softplus(a, threshold=50)  # float64: exact to rounding below the threshold
        se = f.std() / 1e3
        assert abs(got[i] - f.mean()) <= 5 * se, (m[i].item(), v[i].item(), got[i], f.mean())


def test_expected_softplus_matches_scipy_quadrature_to_1e_minus_6():
    """Relative accuracy 1e-6 on the grid, the edges of the promised range (|m| = 50, v up to
    1e4) and v = 0, which must give softplus(m) itself. (Measured: worst 3e-15.)"""
    m, v = _grid([*LINK_MEANS, -50.0, 50.0], [0.0, *LINK_VARS, 1.0, 1.0001, 1e4])
    got = expected_softplus(m, v)
    for i in range(len(m)):
        mi, vi = m[i].item(), v[i].item()
        expected = _softplus64(mi) if vi == 0 else _gaussian_quad(_softplus64, mi, vi)
        assert got[i].item() == pytest.approx(expected, rel=1e-6, abs=0), (mi, vi)
    zero = v == 0
    assert [x.item() for x in got[zero]] == [_softplus64(x.item()) for x in m[zero]]


def test_expected_softplus_gradients_are_stein_and_finite_differences():
    """d/dm E[softplus(a)] = E[σ(a)] (against quadrature); d/dv against central differences of
    the float64 values; finite and exact at v = 0 (σ(m) and σ'(m)/2)."""
    m, v = _grid(LINK_MEANS, [1e-4, 0.25, 0.81, 1.44, 4.0, 100.0])
    mg, vg = m.clone().requires_grad_(), v.clone().requires_grad_()
    expected_softplus(mg, vg).sum().backward()
    for i in range(len(m)):
        mi, vi = m[i].item(), v[i].item()
        assert mg.grad[i].item() == pytest.approx(_gaussian_quad(_sigmoid64, mi, vi), rel=1e-6)
        h = 1e-5 * max(vi, 1.0)
        up, down = expected_softplus(m[i], v[i] + h), expected_softplus(m[i], v[i] - h)
        fd = ((up - down) / (2 * h)).item()
        rounding = 1e-15 * up.item() / h  # the difference of two values exact to ~2e-16
        assert vg.grad[i].item() == pytest.approx(fd, rel=1e-5, abs=rounding), (mi, vi)
    m0 = torch.tensor([-3.0, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    v0 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    expected_softplus(m0, v0).sum().backward()
    s = torch.sigmoid(m0.detach())
    assert torch.allclose(m0.grad, s, rtol=1e-12) and torch.allclose(v0.grad, s * (1 - s) / 2)


def test_expected_softplus_keeps_dtype_and_shape_and_passes_gradcheck():
    m = torch.tensor([[-3.0, 0.5], [2.0, 40.0]])
    v = torch.tensor([[0.5], [9.0]])  # broadcasts over the columns
    out = expected_softplus(m, v)
    assert out.shape == (2, 2) and out.dtype == torch.float32
    big = expected_softplus(torch.tensor([-1e4, 1e4]), torch.tensor([1e6, 1e6]))
    assert torch.isfinite(big).all() and (big > 0).all()
    gen = torch.Generator().manual_seed(3)
    mg = (5 * torch.randn(12, generator=gen, dtype=torch.float64)).requires_grad_()
    vg = (3 * torch.rand(12, generator=gen, dtype=torch.float64) + 0.01).requires_grad_()
    assert torch.autograd.gradcheck(expected_softplus, (mg, vg))


def test_expected_exp_is_the_lognormal_mean_by_monte_carlo():
    gen = torch.Generator().manual_seed(1)
    for m, v in [(-2.0, 0.25), (0.0, 1.0), (1.0, 0.04)]:
        a = m + math.sqrt(v) * torch.randn(10**6, generator=gen, dtype=torch.float64)
        f = torch.exp(a)
        got = expected_link("exp", torch.tensor(m), torch.tensor(v)).item()
        assert abs(got - f.mean().item()) <= 5 * f.std().item() / 1e3


def test_an_unknown_link_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"link 'cube' is not one of \('softplus', 'exp'\)"):
        expected_link("cube", torch.zeros(1), torch.ones(1))


@pytest.mark.parametrize("fan_in_prior", [False, True])
def test_fan_in_prior_scales_each_layers_prior_and_its_kl(fan_in_prior):
    """prior: fan_in gives a layer of fan-in n the prior N(0, prior_std²/n), biases too; the KL
    is torch.distributions' against that prior."""
    prior = "fan_in" if fan_in_prior else "fixed"
    layer = GaussianLinear(9, 3, prior_std=0.6, rho_init=-1.0, prior=prior)
    std = 0.6 / 3 if fan_in_prior else 0.6
    assert layer.prior_std == pytest.approx(std)
    q = torch.distributions.Normal(
        torch.cat([layer.weight_mu.flatten(), layer.bias_mu]),
        F.softplus(torch.cat([layer.weight_rho.flatten(), layer.bias_rho])))
    expected = torch.distributions.kl_divergence(q, torch.distributions.Normal(0.0, std)).sum()
    assert layer.kl().item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"prior 'wide' is not one of \('fixed', 'fan_in'\)"):
        GaussianLinear(2, 2, prior="wide")


def test_expected_softplus_of_a_mixed_batch_equals_each_element_on_its_own():
    """A batch whose variances straddle the Gauss–Hermite range (s ≤ 1) and the kink split's
    takes the kink split for every element, without selecting; each element alone takes its
    own rule. The two agree to ~1e-12 relative, values and both gradients."""
    m = torch.tensor([-30.0, -4.0, -0.5, 0.0, 0.7, 3.0, 25.0, 1.0], dtype=torch.float64)
    v = torch.tensor([1e-4, 0.3, 0.9, 1.0, 2.0, 0.05, 50.0, 4.0], dtype=torch.float64)
    mb, vb = m.clone().requires_grad_(), v.clone().requires_grad_()
    batch = expected_softplus(mb, vb)
    batch.sum().backward()
    for i in range(len(m)):
        mi, vi = m[i:i + 1].clone().requires_grad_(), v[i:i + 1].clone().requires_grad_()
        alone = expected_softplus(mi, vi)
        alone.sum().backward()
        assert batch[i].item() == pytest.approx(alone.item(), rel=1e-11, abs=0)
        assert mb.grad[i].item() == pytest.approx(mi.grad.item(), rel=1e-11, abs=1e-300)
        assert vb.grad[i].item() == pytest.approx(vi.grad.item(), rel=1e-11, abs=1e-300)


def test_expected_softplus_compiled_chooses_per_element_and_agrees():
    """Under torch.compile the expectations take the kink split for every v > 0 and f(m) at
    v = 0, without branching on the data: the same values as the eager rules, each element
    by its own, to ~1e-11 (float64), v = 0 exactly."""
    from uqbench.methods.moments import links

    m = torch.tensor([-30.0, -4.0, -0.5, 0.0, 0.7, 3.0, 25.0, 1.0, 2.0], dtype=torch.float64)
    v = torch.tensor([1e-4, 0.3, 0.9, 1.0, 2.0, 0.05, 50.0, 4.0, 0.0], dtype=torch.float64)
    names = ("softplus", "sigmoid", "dsigmoid")
    got = torch.compile(links._gaussian_expectations)(names, m, v)
    for i in range(len(m)):
        alone = links._gaussian_expectations(names, m[i:i + 1], v[i:i + 1])
        for g, a in zip(got, alone, strict=True):
            assert g[i].item() == pytest.approx(a.item(), rel=1e-11, abs=1e-300), (i, names)
    assert got[0][-1].item() == _softplus64(2.0)
