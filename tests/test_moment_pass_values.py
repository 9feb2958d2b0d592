"""The moment pass's numbers do not move when its speed does: the fused pass, eager and compiled,
and the training loss's gradients against the values the pass gave before the eager inference
path (in-place blocks) and the cached weight variances existed, stored in
``fixtures/moment_pass_values.json`` (computed at the commit before them, 1c685bd, on the inputs
below); and the eager inference path bit for bit against the fused formulas it rearranges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments import fused
from uqbench.methods.moments.layers import GaussianLinear

VALUES = json.loads((Path(__file__).parent / "fixtures" / "moment_pass_values.json").read_text())
INFO = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
NETS = ((8, 2), (32, 1))


def _bnn(width: int, depth: int, variance: str, dtype: torch.dtype, compile: bool = False
         ) -> tuple[BayesianMLP, torch.Tensor, torch.Tensor]:
    """The fixture's network (seed 0, ρ₀ = −1, Leaky-ReLU 0.1) and inputs: x over [−30, 30],
    deep into both tails of every unit."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=width, depth=depth, slope=0.1), INFO, variance=variance,
                      rho_init=-1.0, compile=compile).to(dtype)
    x = torch.linspace(-30, 30, 64, dtype=dtype).unsqueeze(1)
    return bnn, x, x ** 3 / 100 - x


def _stored(key: str, name: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(VALUES[key][name], dtype=dtype)


@pytest.mark.parametrize("width,depth", NETS)
@pytest.mark.parametrize("variance", ["embedded", "learned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_pass_and_gradients_equal_the_stored_values(width, depth, variance, dtype,
                                                          monkeypatch):
    """Bit for bit, in blocks (a block smaller than a layer) and whole, twice (the second call
    reads the cached weight variances), and the loss's gradients after them."""
    key = f"w{width}_d{depth}_{variance}_{str(dtype).removeprefix('torch.')}"
    bnn, x, y = _bnn(width, depth, variance, dtype)
    for chunk in (16, fused.CHUNK):
        monkeypatch.setattr(fused, "CHUNK", chunk)
        for _ in range(2):
            with torch.no_grad():
                mean, var = bnn.moment_pass(x)
            assert torch.equal(mean, _stored(key, "mean", dtype))
            assert torch.equal(var, _stored(key, "var", dtype))
    bnn.train()
    bnn.loss((x, y)).backward()
    for name, p in bnn.named_parameters():
        assert p.grad is not None
        assert torch.equal(p.grad, torch.tensor(VALUES[key]["grads"][name], dtype=dtype)), name


@pytest.mark.slow
@pytest.mark.parametrize("width,depth", NETS)
@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_compiled_pass_equals_the_stored_values(width, depth, variance):
    """torch.compile of the pass (float32 inference) against its stored values: within 1e-6
    of the scale (|mean| + σ for means, the variance for variances; compiled code may order a
    sum differently)."""
    key = f"w{width}_d{depth}_{variance}_float32_compiled"
    bnn, x, _ = _bnn(width, depth, variance, torch.float32, compile=True)
    try:
        with torch.no_grad():
            mean, var = bnn.moment_pass(x)
    finally:
        torch._dynamo.reset()  # a later test that counts its own compilations starts afresh
    ref_mean, ref_var = _stored(key, "mean", torch.float32), _stored(key, "var", torch.float32)
    assert ((mean - ref_mean).abs() <= 1e-6 * (ref_mean.abs() + ref_var.sqrt())).all()
    assert ((var - ref_var).abs() <= 1e-6 * ref_var).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slope", [0.0, 0.1, 0.3])
def test_eager_inference_path_is_the_fused_formulas_bit_for_bit(dtype, slope, monkeypatch):
    """μ = t·s for t in [−45, 45] and s from 0 (a deterministic unit) over 4.5 decades, in
    blocks of 100 elements and whole, and with a variance broadcast against the mean."""
    t = torch.linspace(-45, 45, 721, dtype=dtype)
    s = torch.tensor([0.0, 1e-3, 0.7, 30.0], dtype=dtype)
    mean = (t[:, None] * torch.where(s > 0, s, 0.3)).contiguous()
    var = (s * s).expand_as(mean).contiguous()
    expected = fused._leaky_relu_moments_fused(mean, var, slope)
    for chunk in (100, fused.CHUNK):
        monkeypatch.setattr(fused, "CHUNK", chunk)
        with torch.no_grad():
            got = fused.leaky_relu_moments_fused(mean, var, slope)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    row = var[:1]                                                   # (1, 4) against (721, 4)
    for a, b in zip(fused.leaky_relu_moments_inference(mean, row, slope),
                    fused._leaky_relu_moments_fused(mean, row, slope), strict=True):
        assert torch.equal(a, b)


def _fresh(layer: GaussianLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's moments from weight variances computed now (the reference layer form)."""
    with torch.no_grad():
        return layer(x, torch.full_like(x, 0.3))


def test_cached_weight_variances_follow_every_change_of_the_parameters():
    """The kept σ_W², μ_W² + σ_W², σ_b² are dropped when a parameter changes: an optimiser step,
    load_state_dict, a change of dtype, a replaced parameter; after each the fused layer agrees
    with the reference form, which computes them afresh."""
    torch.manual_seed(0)
    layer = GaussianLinear(5, 3)
    x = torch.randn(7, 5)

    def check(dtype: torch.dtype = torch.float32) -> None:
        with torch.no_grad():
            fast = layer.forward_fused(x.to(dtype), torch.full_like(x, 0.3).to(dtype))
        for a, b in zip(fast, _fresh(layer, x.to(dtype)), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    check()
    check()                                                          # from the cache
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer.forward_fused(x, None)[1].sum().backward()
    opt.step()
    check()
    other = GaussianLinear(5, 3, rho_init=1.0)
    layer.load_state_dict(other.state_dict())
    check()
    layer.double()
    check(torch.float64)
    layer.float()
    layer.weight_rho = torch.nn.Parameter(torch.full((3, 5), -4.0))
    check()
