"""The curvature term R of the full-covariance pass by its Mehler series: its values and its
ρ-derivative against adaptive quadrature of their defining integrals (scipy, independent of
both of uqbench's forms), its gradients against central differences, and the pass built on it
against the Gauss–Legendre pass it replaces in training (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments import covariance, mehler
from uqbench.methods.moments.layers import GaussianLinear

F64 = torch.float64
GRID = [(h, k, rho) for h in (-6.0, -1.3, 0.0, 0.4, 2.5) for k in (-3.0, 0.0, 1.1, 7.0)
        for rho in (-0.5, -0.21, 0.03, 0.3, 0.5)]


def _phi2(h: float, k: float, tau: float) -> float:
    q = 1 - tau * tau
    return math.exp(-(h * h + k * k - 2 * tau * h * k) / (2 * q)) / (2 * math.pi * math.sqrt(q))


def _integrals(h: float, k: float, rho: float) -> tuple[float, float]:
    """R = ∫₀^ρ (ρ − τ)φ₂(h, k; τ) dτ and ∂R/∂ρ = ∫₀^ρ φ₂(h, k; τ) dτ, adaptively."""
    r = integrate.quad(lambda tau: (rho - tau) * _phi2(h, k, tau), 0, rho,
                       epsabs=1e-14, epsrel=1e-12)[0]
    d = integrate.quad(lambda tau: _phi2(h, k, tau), 0, rho, epsabs=1e-14, epsrel=1e-12)[0]
    return r, d


def test_series_and_its_rho_derivative_match_the_integrals():
    """Within the series' stated bound (1e-9, here for σ = 1) of the integrals, across both
    signs of ρ up to the largest |ρ| the pass sums by series, wide means included."""
    h = torch.tensor([g[0] for g in GRID], dtype=F64).view(-1, 1)
    k = torch.tensor([g[1] for g in GRID], dtype=F64).view(-1, 1)
    rho = torch.tensor([g[2] for g in GRID], dtype=F64).view(-1, 1, 1)
    # each grid point as a 2-unit layer: R at entry (0, 1) is R(h, k, ρ)
    t = torch.cat([h, k], 1).requires_grad_()
    rho2 = (rho * torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=F64)).requires_grad_()
    out = mehler.curvature_series(t, rho2)
    (d_rho,) = torch.autograd.grad(out[:, 0, 1].sum(), rho2)
    for n, (hh, kk, rr) in enumerate(GRID):
        ref, ref_d = _integrals(hh, kk, rr)
        assert abs(out[n, 0, 1].item() - ref) <= mehler.TOLERANCE, (hh, kk, rr)
        assert abs(out[n, 1, 0].item() - ref) <= mehler.TOLERANCE, (hh, kk, rr)  # R(k, h, ρ)
        assert abs(d_rho[n, 0, 1].item() - ref_d) <= mehler.TOLERANCE, (hh, kk, rr)


def test_the_number_of_terms_follows_the_bound():
    """The bound's N grows with |ρ| and leaves the remainder under the tolerance: against
    100 terms (far past convergence) at the ψ's largest (t near 0) over a grid of ρ."""
    assert mehler.terms(0.0) == 0
    counts = [mehler.terms(r) for r in (0.05, 0.1, 0.3, 0.5)]
    assert counts == sorted(counts) and counts[-1] < 40
    t = torch.tensor([[0.0, 0.3, -0.8, 1.7]], dtype=F64)
    for r in (0.05, 0.1, 0.3, 0.5):
        rho = torch.full((1, 4, 4), r, dtype=F64)
        few = mehler.curvature_series(t, rho)
        many = mehler.curvature_series(t, rho, n=100)
        assert (few - many).abs().max() <= mehler.TOLERANCE


@pytest.mark.parametrize("symmetric", [True, False])
def test_scaled_series_gradients_pass_gradcheck(symmetric):
    """t, σ and ρ (B, d, d) against central differences, with a symmetric ρ (the pass's, whose
    backward takes the transpose's shortcut) and without."""
    gen = torch.Generator().manual_seed(3)
    t = (2 * torch.randn(2, 4, generator=gen, dtype=F64)).requires_grad_()
    s = (0.5 + torch.rand(2, 4, generator=gen, dtype=F64)).requires_grad_()
    rho = 0.8 * torch.rand(2, 4, 4, generator=gen, dtype=F64) - 0.4
    if symmetric:
        rho = 0.5 * (rho + rho.transpose(1, 2))
    rho.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b, c: mehler.scaled_curvature_series(a, b, c, n=9), (t, s, rho))


def _net(rho_init: float, positive: bool) -> tuple[BayesianMLP, torch.Tensor, torch.Tensor]:
    """Width 16, depth 3, float64; ``positive``: every mean weight made positive, so that the
    units of a layer move together (|ρ| up to ~0.9 at ρ₀ = −3)."""
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=16, depth=3, slope=0.1), info, covariance="full",
                      rho_init=rho_init).double().train()
    if positive:
        with torch.no_grad():
            for layer in bnn.net:
                if isinstance(layer, GaussianLinear):
                    layer.weight_mu.abs_()
    x = torch.linspace(-3, 3, 40, dtype=F64).unsqueeze(1)
    return bnn, x, x ** 3 - x


def _quadrature_pass(mean, cov, out_var, slope, symmetric=False, var=None):
    d = mean.shape[-1]
    return covariance._full_covariance(mean, cov, out_var, *torch.triu_indices(d, d, 1), slope)


@pytest.mark.parametrize("rho_init,positive", [(-2.0, False), (1.0, False), (-3.0, True)])
def test_training_pass_equals_the_quadrature_pass(rho_init, positive, monkeypatch):
    """A depth-3 network's output moments and the training loss's gradients by the series
    path (and, with positive mean weights, its quadrature for the pairs beyond |ρ| = 0.5)
    against the Gauss–Legendre pass it replaces: within 1e-8 relative (the quadrature's own
    error)."""
    bnn, x, y = _net(rho_init, positive)
    results = []
    for quadrature in (False, True):
        if quadrature:
            monkeypatch.setattr(covariance, "_full_covariance_series", _quadrature_pass)
        bnn.zero_grad()
        bnn.loss((x, y)).backward()
        mean, var = bnn.moment_pass(x)
        results.append((mean.detach(), var.detach(),
                        [p.grad.clone() for p in bnn.parameters()]))
    (m1, v1, g1), (m2, v2, g2) = results
    torch.testing.assert_close(m1, m2, rtol=1e-12, atol=0)
    torch.testing.assert_close(v1, v2, rtol=1e-8, atol=0)
    for a, b in zip(g1, g2, strict=True):
        assert (a - b).abs().max() <= 1e-8 * b.abs().max()


def test_pairs_beyond_the_series_take_the_quadrature(monkeypatch):
    """Where some |ρ| > MAX_RHO (positive mean weights, ρ₀ = −3) the quadrature runs on those
    pairs only."""
    calls = []
    original = covariance.relu_curvature

    def counted(h, k, rho):
        calls.append(h.numel())
        return original(h, k, rho)
    monkeypatch.setattr(covariance, "relu_curvature", counted)
    bnn, x, _ = _net(-3.0, True)
    with torch.no_grad():
        bnn.moment_pass(x)
    assert calls and 0 < max(calls) < x.shape[0] * 16 * 15


def test_a_deterministic_unit_gives_zeros_not_nans():
    """A unit of zero variance (its covariances 0) against the quadrature pass: the same
    matrix (0 in its row and column), and finite gradients."""
    mean = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.4]], dtype=F64, requires_grad=True)
    cov = torch.tensor([[1.0, 0.0, 0.2], [0.0, 0.0, 0.0], [0.2, 0.0, 0.5]], dtype=F64)
    cov = cov.repeat(2, 1, 1).requires_grad_()
    var = cov.detach().diagonal(dim1=1, dim2=2)
    out = covariance._full_covariance_series(mean, cov, var, 0.1)
    ref = _quadrature_pass(mean, cov, var, 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-8, atol=1e-12)
    out.sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(cov.grad).all()


def test_float32_series_stops_at_float32s_rounding():
    """In float32 the count follows the 2⁻²⁴ bound (fewer terms than float64's 1e-9) and the
    float32 series stays within that bound, plus float32's rounding, of 100 float64 terms."""
    tol = mehler.tolerance(torch.float32)
    assert mehler.tolerance(F64) == mehler.TOLERANCE and tol == 2.0 ** -24
    assert mehler.terms(0.3, tol) < mehler.terms(0.3)
    t = torch.tensor([[0.0, 0.3, -0.8, 1.7]], dtype=F64)
    for r in (0.05, 0.1, 0.3, 0.5):
        rho = torch.full((1, 4, 4), r, dtype=F64)
        many = mehler.curvature_series(t, rho, n=100)
        few = mehler.curvature_series(t.float(), rho.float())       # n from float32's bound
        assert (few.double() - many).abs().max() <= tol + 4 * 2.0 ** -24 * many.abs().max()


def test_symmetric_covariance_reads_the_same_pairs():
    """An exactly symmetric covariance (read whole, diagonal zeroed) against the quadrature
    pass, which reads the pairs above the diagonal: the same matrix within 1e-8, and the
    same gradient once split evenly between (i, j) and (j, i), as a symmetric input's is."""
    gen = torch.Generator().manual_seed(5)
    b, d = 3, 6
    root = torch.randn(b, d, d, generator=gen, dtype=F64) / 4
    cov = root @ root.transpose(1, 2) + torch.eye(d, dtype=F64)
    cov = 0.5 * (cov + cov.transpose(1, 2))
    assert torch.equal(cov, cov.transpose(1, 2))
    mean = torch.randn(b, d, generator=gen, dtype=F64)
    out_var = torch.rand(b, d, generator=gen, dtype=F64)
    weights = torch.randn(b, d, d, generator=gen, dtype=F64)
    results = []
    for rule in (covariance._full_covariance_series, _quadrature_pass):
        c = cov.clone().requires_grad_()
        out = rule(mean, c, out_var, 0.1)
        (grad,) = torch.autograd.grad((out * weights).sum(), c)
        results.append((out.detach(), 0.5 * (grad + grad.transpose(1, 2))))
    (o1, g1), (o2, g2) = results
    assert torch.equal(o1, o1.transpose(1, 2))
    assert (o1 - o2).abs().max() <= 1e-8 * o2.abs().max()
    assert (g1 - g2).abs().max() <= 1e-8 * g2.abs().max()
