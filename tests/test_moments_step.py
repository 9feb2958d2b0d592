"""The training pass in one autograd node (:mod:`uqbench.methods.moments.step`) against the
layer-by-layer autograd path it replaces: the same moments and KL, the same gradients."""

from __future__ import annotations

import os
import subprocess
import sys

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
    """``compile: true`` trains through torch.compile of the same closed forms, head and NLL
    (as plain operations there): the same ELBO and gradients to rounding (float64), and the
    compiled code is what ran."""
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


@pytest.mark.parametrize("members", [None, 3])
def test_the_traced_pass_compiled_code_runs_gives_the_nodes_numbers(members):
    """What ``compile: true`` traces (plain operations, no custom node), run eagerly here: the
    node's moments, KL and closed-form gradients to rounding, one network and three side by
    side."""
    from uqbench.methods.moments.step import (
        _MomentsAndKL,
        _traced_moments_and_kl,
        fused_plan,
    )

    model = _bnn(3, 8, 0.1, "fixed", in_dim=2)
    plan, own = fused_plan(model.net)
    gen = torch.Generator().manual_seed(1)
    lead = () if members is None else (members,)
    params = [(p.detach().expand(*lead, *p.shape)
               + 0.3 * torch.randn(*lead, *p.shape, generator=gen, dtype=p.dtype))
              .requires_grad_() for p in own]
    x = torch.randn(*lead, 40, 2, dtype=torch.float64, generator=gen) * 3
    out_node = _MomentsAndKL.apply(x, plan, *params)
    out_traced = _traced_moments_and_kl(x, plan, params)
    weights = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in out_node]
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights,
                                                                     strict=True)), params)
             for out in (out_node, out_traced)]
    for got, want in zip(out_traced, out_node, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)


def test_the_traced_expected_softplus_gives_the_nodes_numbers():
    """The learned head's E[softplus(a)] as compiled code traces it: the autograd node's value
    and Stein's-lemma gradients, exactly (the same quadrature), in float64 and float32."""
    from uqbench.methods.moments.links import _expected_softplus_traced, _ExpectedSoftplus

    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float64, torch.float32):
        m = (torch.randn(200, generator=gen, dtype=dtype) * 5).requires_grad_()
        v = (torch.rand(200, generator=gen, dtype=dtype) * 9).requires_grad_()
        a, b = _ExpectedSoftplus.apply(m, v), _expected_softplus_traced(m, v)
        assert torch.equal(a, b)
        for g, w in zip(torch.autograd.grad((b * b).sum(), (m, v)),
                        torch.autograd.grad((a * a).sum(), (m, v)), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0)


_COMPILE_ONCE = """
import torch
from torch._dynamo.utils import counters
from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods import bnn
from uqbench.methods.moments.step import fused_plan
info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
model = bnn.BayesianMLP(MLP(width=4, depth=1, slope=0.01), info, variance="{variance}")
plan, own = fused_plan(model.net)
params = [torch.nn.Parameter(torch.stack([p.detach()] * 2)) for p in own]
x, y = torch.randn(2, 10, 1), torch.randn(2, 10, 1)
loss = bnn._compiled_batched_elbo()(x, y, plan, params, (0.1, 0.1), 1, "{variance}",
                                     "softplus", 1e-8)
loss.sum().backward()
print("hits", counters["aot_autograd"]["autograd_cache_hit"])
"""


# two processes, each compiling (about 30 s cold, a few seconds from the cache)
@pytest.mark.slow
@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_a_second_process_loads_the_compiled_training_loss_from_the_cache(variance, tmp_path):
    """The compiled loss holds no custom autograd node, so torch's compile cache keeps it: the
    second process of a sweep (same cache folder) loads the graph, forward and backward, instead
    of tracing and compiling it again."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    script = _COMPILE_ONCE.format(variance=variance)
    hits = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, check=True)
        hits.append(int(done.stdout.split("hits")[-1]))
    assert hits == [0, 1]
