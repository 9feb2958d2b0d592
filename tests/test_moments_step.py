"""The training pass in one autograd node (:mod:`uqbench.methods.moments.step`) against the
layer-by-layer autograd path it replaces: the same moments and KL, the same gradients."""

from __future__ import annotations

import pytest
import torch

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments.layers import GaussianLinear, MomentReLU, MomentSequential
from uqbench.methods.moments.step import fusable, moments_and_kl


def _bnn(depth: int, width: int, slope: float, prior: str, in_dim: int = 3,
         variance: str = "embedded", fused: bool = True) -> BayesianMLP:
    info = DataInfo("regression", in_dim=in_dim, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    model = BayesianMLP(MLP(width=width, depth=depth, slope=slope), info, variance=variance,
                        prior=prior, fused=fused)
    with torch.no_grad():  # away from the initial values: ρ of every sign, μ of every size
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.double()


@pytest.mark.parametrize(("depth", "width", "slope", "prior", "in_dim"), [
    (1, 4, 0.1, "fixed", 1), (2, 16, 0.0, "fan_in", 3), (3, 8, 0.3, "fixed", 2)])
def test_one_node_gives_the_layer_by_layer_moments_kl_and_gradients(depth, width, slope,
                                                                     prior, in_dim):
    model = _bnn(depth, width, slope, prior, in_dim)
    params = list(model.parameters())
    x = torch.randn(64, in_dim, dtype=torch.float64) * 2
    mean, var = model.net.forward_fused(x)
    kl = model.net.kl()
    g_mean, g_var = torch.randn_like(mean), torch.rand_like(var)  # any upstream gradients
    want = torch.autograd.grad((mean * g_mean).sum() + (var * g_var).sum() + 0.3 * kl, params)
    mean2, var2, kl2 = moments_and_kl(model.net, x)
    got = torch.autograd.grad((mean2 * g_mean).sum() + (var2 * g_var).sum() + 0.3 * kl2, params)
    torch.testing.assert_close(mean2, mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(var2, var, rtol=1e-12, atol=0)
    torch.testing.assert_close(kl2, kl, rtol=1e-12, atol=0)
    for name, g, w in zip([n for n, _ in model.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_the_bnn_loss_and_its_gradients_match_the_reference_layers(variance):
    """``fused: true`` trains through the one node, ``fused: false`` through the reference
    layers and autograd: the same ELBO and gradients, both variance heads."""
    fused, reference = (_bnn(2, 8, 0.1, "fixed", variance=variance, fused=f)
                        for f in (True, False))
    x = torch.randn(32, 3, dtype=torch.float64)
    y = torch.randn(32, 1, dtype=torch.float64)
    losses, grads = [], []
    for model in (fused, reference):
        loss = model.loss((x, y))
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-10, atol=0)
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)


def test_a_chain_it_cannot_take_is_refused_by_name():
    class Other(MomentReLU):
        pass

    net = MomentSequential(GaussianLinear(1, 4), torch.nn.Identity())  # type: ignore[arg-type]
    assert not fusable(net)
    with pytest.raises(ValueError, match="GaussianLinear and MomentLeakyReLU layers, got "
                                         "Identity"):
        moments_and_kl(net, torch.zeros(2, 1))
    ends_in_activation = MomentSequential(GaussianLinear(1, 4), Other())
    assert not fusable(ends_in_activation)
    with pytest.raises(ValueError, match="starts and ends with a GaussianLinear"):
        moments_and_kl(ends_in_activation, torch.zeros(2, 1))
    assert fusable(MomentSequential(GaussianLinear(1, 4), Other(), GaussianLinear(4, 1)))


# learned: a second cold compile (about 30 s), in the slow suite
@pytest.mark.parametrize("variance", ["embedded", pytest.param("learned", marks=pytest.mark.slow)])
def test_the_compiled_training_loss_equals_the_eager_one(variance):
    """``compile: true`` trains through torch.compile of the same node, head and NLL: the same
    ELBO and gradients to rounding (float64), and the compiled code is what ran."""
    from torch._dynamo.utils import counters

    eager, compiled = (_bnn(2, 8, 0.1, "fixed", variance=variance) for _ in range(2))
    compiled.compiled = True  # what method.compile: true sets
    x = torch.randn(32, 3, dtype=torch.float64) * 2
    y = torch.randn(32, 1, dtype=torch.float64)
    before = counters["stats"]["unique_graphs"]
    losses, grads = [], []
    for model in (eager, compiled):
        loss = model.loss((x, y), share=0.5)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    assert counters["stats"]["unique_graphs"] > before
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=0)
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)
