"""The full-covariance Leaky-ReLU's pair terms as one autograd node: its values and gradients
against autograd through the same formula written as plain operations (the Mehler series of R
summed term by term), against central differences, and compiled against eager."""

from __future__ import annotations

import math

import pytest
import torch

from uqbench.methods.moments import covariance, mehler, pair_terms

F64 = torch.float64
BETA = (1 - 0.1) ** 2


def _inputs(b: int, d: int, dtype: torch.dtype = F64, seed: int = 7) -> dict[str, torch.Tensor]:
    """An exactly symmetric covariance with moderate correlations, and its units' inputs."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.randn(b, d, d, generator=gen, dtype=F64) / (3 * math.sqrt(d))
    cov = root @ root.transpose(1, 2) + torch.diag_embed(0.2 + torch.rand(b, d, generator=gen,
                                                                            dtype=F64))
    cov = 0.5 * (cov + cov.transpose(1, 2))
    s = cov.diagonal(dim1=1, dim2=2).sqrt()
    return {"cov": cov.to(dtype), "inv": (1 / s).to(dtype),
            "slopes": torch.rand(b, d, generator=gen, dtype=F64).to(dtype),
            "out_var": torch.rand(b, d, generator=gen, dtype=F64).to(dtype),
            "t": torch.randn(b, d, generator=gen, dtype=F64).to(dtype), "s": s.to(dtype)}


def _plain(cov, inv, slopes, out_var, t, s, n):
    """The module docstring's F by out-of-place operations (autograd differentiates them)."""
    off = 1 - torch.eye(cov.shape[-1], dtype=cov.dtype)
    pairs = cov * off
    rho = pairs * inv.unsqueeze(-1) * inv.unsqueeze(-2)
    psi = mehler.hermite_functions(t, n)
    series = sum(psi[k].unsqueeze(-1) * psi[k].unsqueeze(-2) * rho ** (k + 2)
                 / ((k + 1) * (k + 2)) for k in range(n))
    curv = s.unsqueeze(-1) * s.unsqueeze(-2) * series
    full = pairs * slopes.unsqueeze(-1) * slopes.unsqueeze(-2) + BETA * curv
    return full * off + torch.diag_embed(out_var)


def _node(cov, inv, slopes, out_var, t, s, n):
    off = pair_terms.off_diagonal(cov.shape[-1], cov.dtype, cov.device)
    rho, _ = pair_terms.correlations(cov, inv, off)
    return pair_terms.pair_terms(cov, inv, slopes, out_var, t, s, rho, n, BETA)


def _values_and_grads(rule, inputs, weights, n):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = rule(**leaves, n=n)
    return out.detach(), torch.autograd.grad((out * weights).sum(), list(leaves.values()))


def test_pair_terms_match_autograd_through_the_plain_formula():
    """Values within 1e-13 and every input's gradient within 1e-12 relative, for an output
    gradient that is not symmetric (as the next layer's is not, to rounding)."""
    inputs = _inputs(3, 6)
    weights = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    (o1, g1), (o2, g2) = (_values_and_grads(rule, inputs, weights, 9) for rule in (_node, _plain))
    assert torch.equal(o1, o1.transpose(1, 2))
    torch.testing.assert_close(o1, o2, rtol=1e-13, atol=1e-15)
    for name, a, b in zip(inputs, g1, g2, strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max(), name


def test_pair_terms_gradients_pass_gradcheck():
    inputs = {k: v.requires_grad_() for k, v in _inputs(2, 4).items()}
    assert torch.autograd.gradcheck(lambda *a: _node(*a, n=7), tuple(inputs.values()))


def test_the_series_pass_with_the_symmetric_promise_reads_the_same():
    """The layers' promise that a covariance is exactly symmetric changes nothing but the
    check; a covariance that is not symmetric is read above its diagonal, mirrored."""
    inputs = _inputs(2, 5)
    mean = torch.randn(2, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    cov, out_var = inputs["cov"], inputs["out_var"]
    told = covariance.leaky_relu_full_covariance(mean, cov, out_var, 0.1, symmetric=True)
    checked = covariance.leaky_relu_full_covariance(mean, cov, out_var, 0.1)
    assert torch.equal(told, checked)
    lopsided = cov.triu() + 0.5 * cov.tril(-1)                  # the lower triangle is not read
    assert torch.equal(covariance.leaky_relu_full_covariance(mean, lopsided, out_var, 0.1),
                       checked)


@pytest.mark.slow
@pytest.mark.parametrize(("asked", "used"), [(3, 12), (15, 18)])
def test_the_compiled_programs_equal_the_eager_ones(monkeypatch, asked, used):
    """float32, every matrix compiled (the threshold lowered): the forward and backward
    programs, with the term count rounded up to the smallest compiled count that suffices,
    against the same programs run eagerly with that number of terms, within float32's rounding
    of the compiled code's other order of operations."""
    assert used == min(m for m in pair_terms.COMPILED_TERMS if m >= asked)
    inputs = _inputs(4, 8, torch.float32)
    weights = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(3))
    eager = _values_and_grads(_node, inputs, weights, used)
    monkeypatch.setattr(pair_terms, "COMPILE_ENTRIES", 1)
    calls, terms = [], []
    original = pair_terms.PROGRAMS.compiled

    def counted(which):
        calls.append(which)
        program = original(which)
        if which != "forward":
            return program

        def forward(*args):
            terms.append(args[7])                       # N, after cov, ρ, e, v, t, σ, off
            return program(*args)
        return forward
    monkeypatch.setattr(pair_terms.PROGRAMS, "compiled", counted)
    compiled = _values_and_grads(_node, inputs, weights, asked)
    assert set(calls) == {"correlations", "forward", "symmetrised", "backward"}
    assert terms and set(terms) == {used}
    torch.testing.assert_close(compiled[0], eager[0], rtol=2e-6, atol=1e-7)
    for a, b in zip(compiled[1], eager[1], strict=True):
        assert (a - b).abs().max() <= 2e-6 * b.abs().max()
