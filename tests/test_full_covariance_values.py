"""The full-covariance pass's numbers do not move when its speed does: a ``covariance: full``
BNN's moment pass and its training loss's gradients against the values stored in
``fixtures/full_covariance_values.json``, computed at the commit before the Gaussian Linear's
output variances became an output of its sandwich's own autograd node (d7df6f4), on the inputs
below. Width 8 runs every program eagerly (bit for bit); width 64 at batch 100, P2's training
step, runs the sandwiches and the pair terms compiled (slow: their first compilation), checked
to float32's rounding through the mean, the variance and each gradient's sum, norm and first
entries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP

VALUES = json.loads((Path(__file__).parent / "fixtures" / "full_covariance_values.json")
                    .read_text())
INFO = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)


def _run(width: int, variance: str, dtype: torch.dtype, batch: int
         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The fixture's depth-3 network (seed 0, ρ₀ = −1, Leaky-ReLU 0.1) on x over [−3, 3], y =
    x³ − x: the moment pass's mean and variance, and the loss's gradients."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=width, depth=3, slope=0.1), INFO, variance=variance,
                      rho_init=-1.0, covariance="full").to(dtype)
    x = torch.linspace(-3, 3, batch, dtype=dtype).unsqueeze(1)
    with torch.no_grad():
        mean, var = bnn.eval().moment_pass(x)
    bnn.train()
    bnn.loss((x, x ** 3 - x)).backward()
    grads = {}
    for name, p in bnn.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad
    return mean, var, grads


@pytest.mark.parametrize("variance", ["embedded", "learned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_covariance_pass_and_gradients_equal_the_stored_values(variance, dtype):
    stored = VALUES[f"w8_d3_{variance}_{str(dtype).removeprefix('torch.')}"]
    mean, var, grads = _run(8, variance, dtype, 64)
    assert torch.equal(mean, torch.tensor(stored["mean"], dtype=dtype))
    assert torch.equal(var, torch.tensor(stored["var"], dtype=dtype))
    assert grads.keys() == stored["grads"].keys()
    for name, g in grads.items():
        assert torch.equal(g, torch.tensor(stored["grads"][name], dtype=dtype)), name


@pytest.mark.slow
def test_compiled_full_covariance_training_step_equals_the_stored_values():
    stored = VALUES["w64_d3_embedded_float32"]
    mean, var, grads = _run(64, "embedded", torch.float32, 100)
    close = {"rtol": 1e-6, "atol": 0.0}
    torch.testing.assert_close(mean, torch.tensor(stored["mean"]), **close)
    torch.testing.assert_close(var, torch.tensor(stored["var"]), **close)
    assert grads.keys() == stored["grad_sums"].keys()
    for name, g in grads.items():
        g64 = g.double()
        scale = g64.abs().sum().item()          # a sum's rounding is relative to its terms'
        assert abs(g64.sum().item() - stored["grad_sums"][name]) <= 1e-6 * scale, name
        assert g64.norm().item() == pytest.approx(stored["grad_norms"][name], rel=1e-6), name
        torch.testing.assert_close(g.flatten()[:8], torch.tensor(stored["grad_heads"][name]),
                                   rtol=1e-6, atol=1e-6 * g.abs().max().item())
