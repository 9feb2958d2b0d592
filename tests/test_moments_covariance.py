"""Full-covariance moment propagation (Wu et al., ICLR 2019): the bivariate ReLU, Leaky-ReLU and
Heaviside covariances against Monte Carlo, 2-D quadrature and the Φ₂ closed form; the linear and
activation layers' covariances against Monte Carlo; the BNN's full pass against Monte Carlo over
weight draws; the default pass unchanged; training; and the options it refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods import bnn as bnn_module
from uqbench.methods.bnn import BayesianMLP, check_options
from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.covariance import (
    activation_covariance,
    heaviside_covariance,
    leaky_relu_covariance,
    leaky_relu_full_covariance,
    relu_curvature,
)
from uqbench.methods.moments.layers import (
    GaussianLinear,
    MomentLeakyReLU,
    MomentModule,
    MomentSequential,
)

pytestmark = pytest.mark.usefixtures("one_thread")

INFO = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
F64 = torch.float64
N_MC = 1_000_000

# (μ_a, σ_a, μ_b, σ_b, ρ): both signs of ρ up to ±0.9999, ρ = 0, means in either tail
PAIRS = [(0.0, 1.0, 0.0, 1.0, 0.5), (0.3, 0.7, -0.4, 1.6, -0.6), (1.0, 0.5, 2.0, 1.5, 0.9999),
         (-0.5, 1.0, 0.7, 2.0, -0.9999), (0.2, 1.3, -0.1, 0.4, 0.0), (-3.0, 1.0, -2.5, 1.0, 0.8),
         (-5.0, 1.0, -6.0, 1.0, 0.95), (4.0, 1.0, 3.0, 0.5, -0.3), (-2.0, 0.5, 1.5, 0.5, 0.99)]


def _pair(mu_a, s_a, mu_b, s_b, rho):
    """The pair as float64 tensors: means, variances and the covariance ρσ_aσ_b."""
    t = lambda v: torch.tensor(v, dtype=F64)  # noqa: E731
    return t(mu_a), t(s_a ** 2), t(mu_b), t(s_b ** 2), t(rho * s_a * s_b)


def _draws(mu_a, s_a, mu_b, s_b, rho, n=N_MC, seed=0):
    """n draws of (a, b), float64."""
    gen = torch.Generator().manual_seed(seed)
    z1, z2 = torch.randn(2, n, generator=gen, dtype=F64)
    return mu_a + s_a * z1, mu_b + s_b * (rho * z1 + math.sqrt(1 - rho * rho) * z2)


@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("pair", PAIRS)
def test_bivariate_moments_match_monte_carlo(pair, slope):
    """Means (the univariate rule) and the covariance within 5 Monte Carlo standard errors of
    10⁶ draws (the SE of the covariance from the spread of the centred products), plus 1e-6:
    10⁶ draws cannot resolve a moment below that (at μ/σ = −5 a ReLU is positive with
    probability 3e-7); the tails are held to the closed form and the quadrature below."""
    a, b = (F.leaky_relu(v, slope) for v in _draws(*pair))
    mean_a, var_a, mean_b, var_b, cov = _pair(*pair)
    m_a, _ = leaky_relu_moments(mean_a, var_a, slope)
    m_b, _ = leaky_relu_moments(mean_b, var_b, slope)
    for m, f in ((m_a, a), (m_b, b)):
        assert abs(m - f.mean()) <= 5 * f.std() / 1e3 + 1e-6, (m, f.mean())
    prod = (a - a.mean()) * (b - b.mean())
    got = leaky_relu_covariance(mean_a, var_a, mean_b, var_b, cov, slope)
    assert abs(got - prod.mean()) <= 5 * prod.std() / 1e3 + 1e-6, (got, prod.mean())


def _bvn_cdf(h: float, k: float, rho: float) -> float:
    """Φ₂(h, k; ρ) by Owen's T function (h, k ≠ 0, |ρ| < 1): ½Φ(h) + ½Φ(k) − T(h, a_h) −
    T(k, a_k) − β, independent of the code under test."""
    from scipy.special import ndtr, owens_t

    s = math.sqrt(1 - rho * rho)
    beta = 0.0 if h * k > 0 else 0.5
    return (0.5 * ndtr(h) + 0.5 * ndtr(k) - owens_t(h, (k - rho * h) / (h * s))
            - owens_t(k, (h - rho * k) / (k * s)) - beta)


def _closed_form_cov(h: float, k: float, rho: float) -> float:
    """Cov((X+h)⁺, (Y+k)⁺) for standard (X, Y) with correlation ρ: E[(X+h)⁺(Y+k)⁺] =
    (hk + ρ)Φ₂ + hφ(k)Φ((h−ρk)/s) + kφ(h)Φ((k−ρh)/s) + sφ(h)φ((k−ρh)/s), minus the means
    φ(h) + hΦ(h) and φ(k) + kΦ(k)."""
    from scipy.special import ndtr

    pdf = lambda t: math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    s = math.sqrt(1 - rho * rho)
    second = ((h * k + rho) * _bvn_cdf(h, k, rho) + h * pdf(k) * ndtr((h - rho * k) / s)
              + k * pdf(h) * ndtr((k - rho * h) / s) + s * pdf(h) * pdf((k - rho * h) / s))
    return second - (pdf(h) + h * ndtr(h)) * (pdf(k) + k * ndtr(k))


def test_relu_covariance_equals_the_closed_form_with_owens_t():
    """Over a grid of standardised means (tails to −8) and ρ up to ±0.999999: within 1e-8 of
    σ_aσ_b (the quadrature's documented bound) and 1e-6 relative."""
    grid = [-8.0, -4.5, -2.0, -0.7, 0.3, 1.1, 3.0, 6.0]
    rhos = [-0.999999, -0.99, -0.7, -0.2, 0.1, 0.6, 0.95, 0.999999]
    cases = [(h, k, r) for h in grid for k in grid[::2] for r in rhos]
    h, k, rho = (torch.tensor(c, dtype=F64) for c in zip(*cases, strict=True))
    one = torch.ones_like(h)
    got = leaky_relu_covariance(h, one, k, one, rho)
    for i, (hi, ki, ri) in enumerate(cases):
        ref = _closed_form_cov(hi, ki, ri)
        assert got[i].item() == pytest.approx(ref, rel=1e-6, abs=1e-8), (hi, ki, ri)


def _quadrature_cov(mu_a, s_a, mu_b, s_b, rho, slope, n=80, lim=12.0):
    """Cov(f(a), f(b)), f = leaky_relu(·, slope), by a 2-D product Gauss–Legendre rule over
    independent standard (z₁, z₂), a = μ_a + σ_a z₁, b = μ_b + σ_b(ρz₁ + sz₂), |z| ≤ 12: z₁
    split at a's kink and where b's kink line leaves the square, z₂ at b's kink, so the
    integrand is smooth on every piece (agrees with the Owen's T form to ~1e-14)."""
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(n)

    def nodes(lo, hi):
        half = (np.asarray(hi) - np.asarray(lo))[..., None] / 2
        return np.asarray(lo)[..., None] + half * (x + 1), half * w

    s = math.sqrt(1 - rho * rho)
    pdf = lambda z: np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    cuts = [-mu_a / s_a] + ([(-mu_b / s_b - c * s) / rho for c in (-lim, lim)] if rho else [])
    edges = sorted({-lim, lim, *(min(max(c, -lim), lim) for c in cuts)})
    pieces = [nodes(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
    z1 = np.concatenate([z for z, _ in pieces])
    w1 = np.concatenate([v for _, v in pieces])
    kink = np.clip((-mu_b / s_b - rho * z1) / s, -lim, lim)
    (za, wa), (zb, wb) = nodes(np.full_like(z1, -lim), kink), nodes(kink, np.full_like(z1, lim))
    z2, w2 = np.concatenate([za, zb], 1), np.concatenate([wa, wb], 1)
    weight = (w1 * pdf(z1))[:, None] * w2 * pdf(z2)
    f = lambda v: np.where(v > 0, v, slope * v)  # noqa: E731
    fa = f(mu_a + s_a * z1)[:, None]
    fb = f(mu_b + s_b * (rho * z1[:, None] + s * z2))
    return float((weight * (fa - (weight * fa).sum()) * (fb - (weight * fb).sum())).sum())


@pytest.mark.parametrize("slope", [0.0, 0.2])
@pytest.mark.parametrize("pair", [(0.3, 0.7, -0.4, 1.6, -0.6), (1.0, 0.5, 2.0, 1.5, 0.9999),
                                  (-0.5, 1.0, 0.7, 2.0, -0.9999), (-4.0, 1.0, -3.5, 1.0, 0.7),
                                  (-6.0, 1.0, -5.0, 1.0, 0.9), (0.5, 2.0, 0.4, 1.0, 0.0)])
def test_covariance_matches_two_dimensional_quadrature(pair, slope):
    got = leaky_relu_covariance(*_pair(*pair), slope).item()
    expected = _quadrature_cov(*pair, slope)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-9 * pair[1] * pair[3]), pair


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_perfect_and_zero_correlation(slope):
    """ρ = 0: covariance exactly 0. ρ = 1 with a = b: the univariate variance. ρ = −1 (b = −a,
    ReLU): relu(a)·relu(−a) = 0, so Cov = −E[relu a]·E[relu(−a)]. Means in both tails."""
    mean = torch.tensor([-6.0, -1.5, 0.0, 0.8, 5.0], dtype=F64)
    var = torch.tensor([1.0, 0.3, 2.0, 0.5, 4.0], dtype=F64)
    zero = leaky_relu_covariance(mean, var, mean.flip(0), var.flip(0), torch.zeros_like(mean),
                                 slope)
    assert torch.equal(zero, torch.zeros_like(mean))
    same = leaky_relu_covariance(mean, var, mean, var, var, slope)
    _, univariate = leaky_relu_moments(mean, var, slope)
    torch.testing.assert_close(same, univariate, rtol=1e-7, atol=1e-12 * var.max().item())
    if slope == 0.0:
        opposite = leaky_relu_covariance(mean, var, -mean, var, -var)
        m_pos, _ = leaky_relu_moments(mean, var)
        m_neg, _ = leaky_relu_moments(-mean, var)
        torch.testing.assert_close(opposite, -m_pos * m_neg, rtol=1e-7, atol=1e-12)


def test_curvature_gradients_are_exact_for_the_quadrature():
    """gradcheck (float64, central differences) of R(h, k, ρ), ρ up to ±0.995 and at ±1."""
    gen = torch.Generator().manual_seed(0)
    h = (2 * torch.randn(24, generator=gen, dtype=F64)).requires_grad_()
    k = (2 * torch.randn(24, generator=gen, dtype=F64)).requires_grad_()
    rho = (1.99 * torch.rand(24, generator=gen, dtype=F64) - 0.995).requires_grad_()
    assert torch.autograd.gradcheck(relu_curvature, (h, k, rho))
    # at ρ = ±1 only one-sided: ∂R/∂ρ = Φ₂(h, k; ρ) − Φ(h)Φ(k), e.g. Φ(min(h, k)) − Φ(h)Φ(k)
    h1 = torch.tensor([0.5, -1.0], dtype=F64, requires_grad=True)
    k1 = torch.tensor([0.5, 0.3], dtype=F64, requires_grad=True)
    r1 = torch.tensor([1.0, 1.0], dtype=F64, requires_grad=True)
    relu_curvature(h1, k1, r1).sum().backward()
    cdf = torch.special.ndtr
    expected = cdf(torch.minimum(h1, k1)) - cdf(h1) * cdf(k1)
    torch.testing.assert_close(r1.grad, expected.detach(), rtol=1e-6, atol=1e-8)


def test_heaviside_covariance_matches_monte_carlo():
    for pair in PAIRS[:5]:
        a, b = ((v > 0).double() for v in _draws(*pair))
        prod = (a - a.mean()) * (b - b.mean())
        got = heaviside_covariance(*_pair(*pair))
        assert abs(got - prod.mean()) <= 5 * prod.std() / 1e3 + 1e-12, (pair, got, prod.mean())


def test_an_activation_without_a_closed_form_is_named():
    args = _pair(*PAIRS[0])
    assert activation_covariance("relu", *args) == leaky_relu_covariance(*args)
    with pytest.raises(ValueError, match=r"activation 'gelu' has no closed-form covariance.*"
                                         r"supported: relu, leaky_relu, heaviside"):
        activation_covariance("gelu", *args)


def _random_cov(b: int, d: int, gen: torch.Generator) -> torch.Tensor:
    root = torch.randn(b, d, d, generator=gen, dtype=F64) / math.sqrt(d)
    return root @ root.transpose(1, 2) + 0.05 * torch.eye(d, dtype=F64)


def _mc_cov(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Covariance (B, d, d) of samples (n, B, d) and its standard error per entry."""
    centred = samples - samples.mean(0)
    prods = centred.unsqueeze(-1) * centred.unsqueeze(-2)
    return prods.mean(0), prods.std(0) / math.sqrt(samples.shape[0])


def test_linear_layer_covariance_matches_monte_carlo():
    """GaussianLinear.forward_full on a correlated Gaussian input, inputs and weights drawn
    together (4·10⁵ draws): every entry of the output covariance within 5 SE."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layer = GaussianLinear(4, 3, rho_init=-1.0).double()
    mean = torch.randn(2, 4, generator=gen, dtype=F64)
    cov = _random_cov(2, 4, gen)
    out_mean, out_var, out_cov = layer.forward_full(mean, cov.diagonal(dim1=1, dim2=2), cov)
    x = mean + (torch.linalg.cholesky(cov) @ torch.randn(400_000, 2, 4, 1, dtype=F64))[..., 0]
    with torch.no_grad():
        y = layer.forward_sampled(x)
    mc, se = _mc_cov(y)
    assert ((out_cov - mc).abs() <= 5 * se).all()
    assert ((out_mean - y.mean(0)).abs() <= 5 * y.std(0) / math.sqrt(4e5)).all()
    assert torch.equal(out_var, out_cov.diagonal(dim1=1, dim2=2))
    _, var_only, none = layer.forward_full(mean, cov.diagonal(dim1=1, dim2=2), cov,
                                           full_out=False)
    assert none is None
    torch.testing.assert_close(var_only, out_var, rtol=1e-12, atol=0)


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_activation_layer_covariance_matches_monte_carlo(slope):
    """leaky_relu_full_covariance on (B, d) = (2, 4) with a random covariance (4·10⁵ draws):
    symmetric, its diagonal the univariate variances, every entry within 5 SE."""
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(2, 4, generator=gen, dtype=F64)
    cov = _random_cov(2, 4, gen)
    _, var = leaky_relu_moments(mean, cov.diagonal(dim1=1, dim2=2), slope)
    out = leaky_relu_full_covariance(mean, cov, var, slope)
    assert torch.equal(out, out.transpose(1, 2))
    assert torch.equal(out.diagonal(dim1=1, dim2=2), var)
    z = mean + (torch.linalg.cholesky(cov) @ torch.randn(400_000, 2, 4, 1, generator=gen,
                                                         dtype=F64))[..., 0]
    mc, se = _mc_cov(F.leaky_relu(z, slope))
    assert ((out - mc).abs() <= 5 * se).all()


@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_the_compiled_full_covariance_equals_the_eager_one(slope, monkeypatch):
    """A call without gradients of at least COMPILE_PAIRS pairs runs compiled (speed only):
    the same matrix as the eager quadrature to rounding, wide means and near-±1 correlations
    included (and the eager default, the series with the quadrature beyond |ρ| = 0.5, within
    the two's errors of it); a call that needs gradients stays eager and differentiable."""
    from uqbench.methods.moments import covariance

    gen = torch.Generator().manual_seed(5)
    mean = 3 * torch.randn(3, 12, generator=gen, dtype=F64)
    base = torch.randn(3, 12, 2, generator=gen, dtype=F64)  # rank 2 + a little: |ρ| near 1
    cov = base @ base.transpose(1, 2) + 1e-6 * torch.eye(12, dtype=F64)
    _, var = leaky_relu_moments(mean, cov.diagonal(dim1=1, dim2=2), slope)
    i, j = torch.triu_indices(12, 12, 1)
    eager = covariance._full_covariance(mean, cov, var, i, j, slope)  # the eager quadrature
    monkeypatch.setattr(covariance, "COMPILE_PAIRS", 10**12)
    series = leaky_relu_full_covariance(mean, cov, var, slope)  # eager: the Mehler series
    scale = (var.sqrt()[:, :, None] * var.sqrt()[:, None, :])
    assert ((series - eager).abs() <= 2e-8 * scale).all()  # 1e-8 (quadrature) + 1e-9 (series)
    monkeypatch.setattr(covariance, "COMPILE_PAIRS", 1)
    covariance._compiled_full_covariance.cache_clear()
    with torch.no_grad():
        compiled = leaky_relu_full_covariance(mean, cov, var, slope)
    assert covariance._compiled_full_covariance.cache_info().currsize == 1  # it ran compiled
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=1e-15)
    leaf = mean.clone().requires_grad_()
    assert leaky_relu_full_covariance(leaf, cov, var, slope).grad_fn is not None


def _correlated_bnn(depth: int, **kwargs) -> BayesianMLP:
    """Width 16, fixed seed, float64, σ = softplus(−3) ≈ 0.049 on every weight, and every mean
    weight made positive: the units of a layer then move together, so the independence that
    the diagonal pass assumes is far from true."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=16, depth=depth), INFO, rho_init=-3.0, min_var=0.0,
                      **kwargs).double()
    with torch.no_grad():
        for layer in bnn.net:
            if isinstance(layer, GaussianLinear):
                layer.weight_mu.abs_()
    return bnn


@pytest.mark.parametrize("depth", [2, 3])
def test_full_covariance_sigma_matches_monte_carlo_where_diagonal_does_not(depth):
    """Predictive σ over 9 inputs against 4·10⁴ weight draws (σ's Monte Carlo error ~0.4 %):
    the full pass within 2 % on average (3 % at any input), the diagonal pass further off.
    (Measured: diagonal 0.973 at depth 2, 0.809 at depth 3; full 0.999 and 0.989.)"""
    x = torch.linspace(-2, 2, 9, dtype=F64).unsqueeze(1)
    diag = _correlated_bnn(depth)
    full = _correlated_bnn(depth, covariance="full")
    with torch.no_grad():
        mean_d, var_d = diag.moment_pass(x)
        mean_f, var_f = full.moment_pass(x)
        torch.manual_seed(1)
        mean_mc, var_mc = diag._mc_moments(x, 40_000, mean_d)
    ratio_d = (var_d / var_mc).sqrt()
    ratio_f = (var_f / var_mc).sqrt()
    assert abs(ratio_f.mean().item() - 1) <= 0.02 and (ratio_f - 1).abs().max().item() <= 0.03
    assert abs(ratio_d.mean().item() - 1) > abs(ratio_f.mean().item() - 1) + 0.02
    # the means agree with Monte Carlo either way (within 5 SE)
    assert ((mean_f - mean_mc).abs() <= 5 * (var_mc / 40_000).sqrt()).all()


def test_the_closure_bound_is_exact_where_the_last_closure_is():
    """mc_closure_std_ratio starts the pass from Monte Carlo's own moments of the last
    activation's input, so it is exact up to Monte Carlo error wherever that activation's
    Gaussian closure is: a linear last activation (slope 1, exact for any distribution) at
    depth 3, whose units are strongly correlated (the diagonal pass is off by > 10 %, so
    moments without the estimated covariances would be too); and ReLU at depth 1, whose input
    is exactly Gaussian. Within 4 jackknife errors of 1 (the errors of σ_MC, shared with
    mc_std_ratio), plus 1 % for the covariance estimated from the same draws."""
    x = torch.linspace(-2, 2, 9, dtype=F64).unsqueeze(1)
    linear_last = _correlated_bnn(3, covariance="full", check_samples=4000)
    diag = _correlated_bnn(3, check_samples=4000)
    for net in (linear_last, diag):
        net.net[-2].slope = 1.0  # the last activation: identity
    found = linear_last.diagnostics(x)
    assert "mc_closure_std_ratio" not in diag.diagnostics(x)  # the full pass's check only
    assert abs(diag.diagnostics(x)["mc_std_ratio"] - 1) > 0.1
    assert abs(found["mc_closure_std_ratio"] - 1) <= 4 * found["mc_std_ratio_se"] + 0.01
    torch.manual_seed(0)
    shallow = BayesianMLP(MLP(width=16, depth=1), INFO, rho_init=-1.0, covariance="full",
                          check_samples=4000).double()
    found = shallow.diagnostics(x)
    assert abs(found["mc_closure_std_ratio"] - 1) <= 4 * found["mc_std_ratio_se"] + 0.01
    # the full pass is exact here too: the two ratios share σ_MC, so they differ by the
    # covariance estimate's error only
    assert abs(found["mc_closure_std_ratio"] - found["mc_std_ratio"]) <= 0.01


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_the_closure_bound_is_the_pass_from_the_draws_moments(variance, monkeypatch):
    """The bound, computed in chunks of a few draws with running sums (the σ ratio's draws,
    tapped on the way), equals the full pass started by hand from torch.cov of the same draws
    of the last hidden pre-activation (the seed and chunks of diagnostics give the same
    draws), over σ_MC of the same draws' outputs: to rounding, for both heads (learned: the
    link's expectation included), with chunks that straddle the draws unevenly."""
    monkeypatch.setattr(bnn_module, "CHECK_CHUNK_ELEMENTS", 7 * 9 * 10)
    torch.manual_seed(3)
    bnn = BayesianMLP(MLP(width=4, depth=3), INFO, variance=variance, rho_init=-0.5,
                      covariance="full", check_samples=301).double()
    x = torch.linspace(-2, 2, 9, dtype=F64).unsqueeze(1)
    layers = list(bnn.net)
    with torch.no_grad(), bnn_module._private_rng(x.device, seed=0):
        pre, out = [], []
        per_draw = sum(m.weight_mu.numel() + m.bias_mu.numel() + 9 * m.out_features
                       for m in layers if isinstance(m, GaussianLinear))
        chunk = max(1, 7 * 9 * 10 // per_draw)
        for start in range(0, 301, chunk):
            h = x.expand(min(chunk, 301 - start), *x.shape)
            for m in layers[:5]:
                h = m.forward_sampled(h)
            pre.append(h)
            for m in layers[5:]:
                h = m.forward_sampled(h)
            out.append(h)
    a, y = torch.cat(pre), torch.cat(out)
    assert chunk < 301 and 301 % chunk != 0  # several chunks, a short last one
    mean = a.mean(0)
    cov = torch.stack([torch.cov(a[:, b].T) for b in range(9)])
    with torch.no_grad():
        m1, v1, c1 = layers[5].forward_full(mean, cov.diagonal(dim1=-2, dim2=-1), cov)
        m2, v2, _ = layers[6].forward_full(m1, v1, c1, full_out=False)
        sd = bnn._head(m2, v2).var.sqrt()
    total = y[..., :1].var(0)
    if variance == "learned":
        total = total + F.softplus(y[..., 1:]).mean(0)
    expected = (sd / (total + bnn.min_var).sqrt()).mean().item()
    assert bnn.diagnostics(x)["mc_closure_std_ratio"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_one_hidden_layer_full_equals_diagonal(variance):
    """One hidden layer, deterministic input: hidden pre-activation k is w_k·x + b_k, a function
    of its own weights only, so the hidden units are independent and their covariance is
    diagonal; the output's variance Σ_k M_ik² v_k + Σ_k V_ik E[a_k²] + v_i is then the same sum
    in both passes. Checked also with the covariances formed explicitly (a zero input
    covariance), where every off-diagonal correlation is 0 and its Cov exactly 0."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=16, depth=1), INFO, variance=variance, rho_init=-1.5).double()
    x = torch.linspace(-3, 3, 11, dtype=F64).unsqueeze(1)
    with torch.no_grad():
        mean_d, var_d = bnn.moment_pass(x)
        bnn.covariance = "full"
        mean_f, var_f = bnn.moment_pass(x)
        mean_e, var_e, _ = bnn.net.forward_full(x, torch.zeros_like(x),
                                                torch.zeros(11, 1, 1, dtype=F64))
    for mean, var in ((mean_f, var_f), (mean_e, var_e)):  # the same sums, in another order
        torch.testing.assert_close(mean, mean_d, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(var, var_d, rtol=1e-13, atol=0)


# The default pass before covariance existed, on fixed weights (torch.manual_seed(0), width 8,
# depth 3, ρ₀ = −1.5, float64, x = −2, −1, 0, 1, 2).
STORED = {
    "embedded": ([-0.5425010170986746, -0.4579598047973509, -0.4181205389483513,
                  -0.4237456145842866, -0.4438884831977268],
                 [0.09279408604204298, 0.06457706241211852, 0.05775644934231398,
                  0.06333500539135736, 0.07845309274195021]),
    "learned": ([-0.2650804441621397, -0.18053923186081602, -0.1406999660118164,
                 -0.14632504164775173, -0.16646791026119193],
                [0.7182095662661272, 0.7119952700450406, 0.7150128081596742,
                 0.7125940665591118, 0.710989466111372]),
}


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_the_default_pass_is_unchanged(variance):
    """covariance absent or diagonal: bit for bit the fused and the reference passes as they
    are called without the option, and the stored predictions."""
    x = torch.linspace(-2, 2, 5, dtype=F64).unsqueeze(1)
    outs = []
    for kwargs in ({}, {"covariance": "diagonal"}):
        torch.manual_seed(0)
        bnn = BayesianMLP(MLP(width=8, depth=3), INFO, variance=variance, rho_init=-1.5,
                          **kwargs).double()
        with torch.no_grad():
            outs.append(bnn(x))
            assert all(torch.equal(a, b) for a, b in zip(bnn.moment_pass(x),
                                                         bnn.net.forward_fused(x), strict=True))
            bnn.fused = False
            assert all(torch.equal(a, b) for a, b in zip(bnn.moment_pass(x),
                                                         bnn.net(x, torch.zeros_like(x)),
                                                         strict=True))
    assert torch.equal(outs[0].mean, outs[1].mean) and torch.equal(outs[0].var, outs[1].var)
    mean, var = STORED[variance]
    torch.testing.assert_close(outs[0].mean[:, 0], torch.tensor(mean, dtype=F64), rtol=1e-12,
                               atol=0)
    torch.testing.assert_close(outs[0].var[:, 0], torch.tensor(var, dtype=F64), rtol=1e-12,
                               atol=0)


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_training_with_full_covariance_gives_finite_loss_and_gradients(variance):
    """One optimiser step in float32 (the runner's dtype): finite loss, every parameter's
    gradient finite and not all zero; fused and reference univariate rules agree."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=8, depth=3), INFO, variance=variance, covariance="full")
    ref = BayesianMLP(MLP(width=8, depth=3), INFO, variance=variance, covariance="full",
                      fused=False)
    ref.load_state_dict(bnn.state_dict())
    x = torch.linspace(-1.5, 1.5, 32).unsqueeze(1)
    y = x ** 3 - x
    losses = []
    for model in (bnn, ref):
        loss = model.loss((x, y))
        loss.backward()
        losses.append(loss.item())
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-5)
    opt = torch.optim.Adam(bnn.parameters(), lr=1e-2)
    opt.step()
    assert math.isfinite(bnn.loss((x, y)).item())


class _FullPass(torch.nn.Module):
    """A network's full-covariance pass as a forward: x (B, in) → (mean, var) (B, out)."""

    def __init__(self, net: MomentSequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, var, _ = self.net.forward_full(x)
        return mean, var


def test_full_pass_gradients_pass_gradcheck():
    """The whole full-covariance pass (depth 2, width 3, float64): its mean and variance
    against central differences in the input and in a hidden layer's mean weights."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=3, depth=2), INFO, covariance="full", rho_init=-1.0).double()
    model = _FullPass(bnn.net)
    x = torch.tensor([[-0.7], [0.4]], dtype=F64, requires_grad=True)
    w = bnn.net[2].weight_mu.detach().clone().requires_grad_()
    call = lambda x_, w_: torch.func.functional_call(model, {"net.2.weight_mu": w_}, (x_,))  # noqa: E731
    assert torch.autograd.gradcheck(call, (x, w))


@pytest.mark.parametrize("kwargs,match", [
    ({"covariance": "block"},
     r"method.covariance 'block' is not one of \('diagonal', 'full', 'mixture'\)"),
    ({"covariance": "full", "training": "sampling"},
     r"method.covariance: full .* method.training 'sampling' .* method.training: moments"),
    ({"covariance": "full", "compile": True},
     "method.compile: true compiles the diagonal moment pass only"),
])
def test_bad_combinations_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_options(**kwargs)
    with pytest.raises(ValueError, match=match):
        BayesianMLP(MLP(width=4), INFO, **kwargs)


def test_a_layer_without_a_covariance_rule_is_named(monkeypatch):
    monkeypatch.setattr(MomentLeakyReLU, "full_rule", False)
    with pytest.raises(ValueError, match="full needs a covariance rule in every layer; "
                                         "MomentLeakyReLU has none"):
        BayesianMLP(MLP(width=4), INFO, covariance="full")
    monkeypatch.undo()

    class Scale(MomentModule):
        def forward(self, mean, var):
            return 2 * mean, 4 * var

    net = MomentSequential(GaussianLinear(1, 3), Scale(), GaussianLinear(3, 1))
    with pytest.raises(ValueError, match="Scale has no full-covariance rule; the layers with one: "
                                         "GaussianLinear, MomentLeakyReLU"):
        net.forward_full(torch.zeros(2, 1))


def test_the_config_defaults_to_diagonal_and_refuses_bad_combinations(compose_cfg):
    from uqbench.runner.cli import check_config

    assert compose_cfg(["method=bnn"]).method.covariance == "diagonal"
    check_config(compose_cfg(["method=bnn", "method.covariance=full"]))
    cfg = compose_cfg(["method=bnn", "method.covariance=full", "method.training=sampling"])
    with pytest.raises(ValueError, match="method.training 'sampling'"):
        check_config(cfg)
    assert BayesianMLP(MLP(width=4), INFO, covariance="full").settings()["covariance"] == "full"
