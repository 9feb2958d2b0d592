"""The full-covariance pass's M Σ Mᵀ with its three-product backward, and M diag(v) Mᵀ with its
one-product backward: values and gradients against autograd through the plain products, and
against central differences; their two-output forms (the covariance plus diag(extra), and its
diagonal as the variances) the same way; the compiled passes against the eager ones."""

from __future__ import annotations

import pytest
import torch

from uqbench.methods.moments import sandwich as sandwich_module
from uqbench.methods.moments.sandwich import (
    diagonal_sandwich,
    diagonal_sandwich_and_variances,
    sandwich,
    sandwich_and_variances,
)

F64 = torch.float64


def _inputs(b: int, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    root = torch.randn(b, n_in, n_in, generator=gen, dtype=F64)
    cov = root @ root.transpose(1, 2)
    cov = 0.5 * (cov + cov.transpose(1, 2))                 # exactly symmetric, as the layers'
    return cov, torch.randn(n_out, n_in, generator=gen, dtype=F64)


def test_sandwich_matches_autograd_through_the_products():
    cov, w = _inputs(4, 5, 3)
    weights = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    results = []
    for rule in (sandwich, lambda c, m: 0.5 * (m @ c @ m.T + (m @ c @ m.T).transpose(1, 2))):
        c, m = cov.clone().requires_grad_(), w.clone().requires_grad_()
        out = rule(c, m)
        results.append((out.detach(), *torch.autograd.grad((out * weights).sum(), (c, m))))
    (o1, c1, m1), (o2, c2, m2) = results
    assert torch.equal(o1, o1.transpose(1, 2))
    torch.testing.assert_close(o1, o2, rtol=1e-13, atol=0)
    torch.testing.assert_close(c1, c2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m1, m2, rtol=1e-12, atol=1e-12)


def test_sandwich_gradients_pass_gradcheck():
    cov, w = _inputs(2, 4, 3)
    assert torch.autograd.gradcheck(sandwich, (cov.requires_grad_(), w.requires_grad_()))


def _plain_diagonal(var: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    spread = w @ torch.diag_embed(var) @ w.T
    return 0.5 * (spread + spread.transpose(1, 2))


def test_diagonal_sandwich_matches_autograd_through_the_products():
    gen = torch.Generator().manual_seed(3)
    var = torch.rand(4, 5, generator=gen, dtype=F64)
    w = torch.randn(3, 5, generator=gen, dtype=F64)
    weights = torch.randn(4, 3, 3, generator=gen, dtype=F64)
    results = []
    for rule in (diagonal_sandwich, _plain_diagonal):
        v, m = var.clone().requires_grad_(), w.clone().requires_grad_()
        out = rule(v, m)
        results.append((out.detach(), *torch.autograd.grad((out * weights).sum(), (v, m))))
    (o1, v1, m1), (o2, v2, m2) = results
    assert torch.equal(o1, o1.transpose(1, 2))
    torch.testing.assert_close(o1, o2, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(v1, v2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m1, m2, rtol=1e-12, atol=1e-12)


def test_diagonal_sandwich_gradients_pass_gradcheck():
    gen = torch.Generator().manual_seed(4)
    var = torch.rand(2, 4, generator=gen, dtype=F64).requires_grad_()
    w = torch.randn(3, 4, generator=gen, dtype=F64).requires_grad_()
    assert torch.autograd.gradcheck(diagonal_sandwich, (var, w))


def _with_variances(spread, extra):
    """Autograd's plain form: spread + diag(extra), and that diagonal (a view's copy)."""
    full = spread + torch.diag_embed(extra)
    return full, full.diagonal(dim1=-2, dim2=-1).clone()


@pytest.mark.parametrize("diagonal", [False, True])
def test_the_variance_outputs_match_autograd_through_the_plain_form(diagonal):
    """Both outputs' gradients taken at once (the layer's covariance and its variances), for
    the full and the diagonal sandwich, against autograd through the products, the diagonal's
    addition and a copy of it."""
    gen = torch.Generator().manual_seed(6)
    cov, w = _inputs(4, 5, 3)
    first = torch.rand(4, 5, generator=gen, dtype=F64) if diagonal else cov
    extra = torch.rand(4, 3, generator=gen, dtype=F64)
    weights = torch.randn(4, 3, 3, generator=gen, dtype=F64)
    weights_var = torch.randn(4, 3, generator=gen, dtype=F64)
    ours = diagonal_sandwich_and_variances if diagonal else sandwich_and_variances
    plain_spread = _plain_diagonal if diagonal else (
        lambda c, m: 0.5 * (m @ c @ m.T + (m @ c @ m.T).transpose(1, 2)))
    results = []
    for rule in (ours, lambda a, m, e: _with_variances(plain_spread(a, m), e)):
        a, m, e = (t.clone().requires_grad_() for t in (first, w, extra))
        full, var = rule(a, m, e)
        loss = (full * weights).sum() + (var * weights_var).sum()
        results.append((full.detach(), var.detach(), *torch.autograd.grad(loss, (a, m, e))))
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    full, var = results[0][:2]
    assert torch.equal(full, full.transpose(1, 2))
    assert torch.equal(var, full.diagonal(dim1=-2, dim2=-1))


def test_the_variance_outputs_pass_gradcheck():
    gen = torch.Generator().manual_seed(7)
    cov, w = _inputs(2, 4, 3)
    var = torch.rand(2, 4, generator=gen, dtype=F64)
    extra = torch.rand(2, 3, generator=gen, dtype=F64)
    for rule, first in ((sandwich_and_variances, cov), (diagonal_sandwich_and_variances, var)):
        inputs = tuple(t.clone().requires_grad_() for t in (first, w, extra))
        assert torch.autograd.gradcheck(rule, inputs)


@pytest.mark.slow
def test_the_compiled_passes_equal_the_eager_ones(monkeypatch):
    """float32, every call compiled (the threshold lowered): both layers' outputs bit for bit
    (the same ATen products; the symmetrisation elementwise), the full sandwich's gradients too,
    the diagonal one's within float32's rounding of the compiled code's order of summation."""
    gen = torch.Generator().manual_seed(5)
    cov, w = (t.float() for t in _inputs(6, 12, 10))
    var = torch.rand(6, 12, generator=gen)
    weights = torch.randn(6, 10, 10, generator=gen)

    def run(rule, first):
        a, m = first.clone().requires_grad_(), w.clone().requires_grad_()
        out = rule(a, m)
        return (out.detach(), *torch.autograd.grad((out * weights).sum(), (a, m)))

    eager = [run(sandwich, cov), run(diagonal_sandwich, var)]
    monkeypatch.setattr(sandwich_module, "COMPILE_ENTRIES", 1)
    calls = []
    original = sandwich_module.PROGRAMS.compiled

    def counted(which):
        calls.append(which)
        return original(which)
    monkeypatch.setattr(sandwich_module.PROGRAMS, "compiled", counted)
    compiled = [run(sandwich, cov), run(diagonal_sandwich, var)]
    assert set(calls) == {"spread", "spread_grads", "diagonal_spread", "diagonal_spread_grads"}
    for a, b in zip(compiled[0], eager[0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(compiled[1][0], eager[1][0])
    for a, b in zip(compiled[1][1:], eager[1][1:], strict=True):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
