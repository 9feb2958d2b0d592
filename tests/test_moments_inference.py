"""The compiled inference pass's formulas and plan: the activation's compiled form against the
reference closed forms (tails and v = 0 included), the planned pass against the module's fused
pass, and, compiled, networks of two widths and several batch sizes in one process against
the eager pass, with the compilations that takes."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.test_moments_fused import SLOPES, assert_equal_to_rounding, tail_grid
from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments import fused, inference
from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.fused import leaky_relu_moments_compiled
from uqbench.methods.moments.inference import eager_inference, inference_plan, planned_pass
from uqbench.methods.moments.layers import GaussianLinear, MomentLeakyReLU, MomentSequential


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("slope", SLOPES)
def test_compiled_form_of_the_activation_equals_the_reference(dtype, slope):
    mean, var = tail_grid(dtype)
    mean = torch.cat([mean, torch.tensor([-2.0, 0.0, 3.0], dtype=dtype)])
    var = torch.cat([var, torch.zeros(3, dtype=dtype)])   # deterministic units: f(μ), 0
    got_mean, got_var = leaky_relu_moments_compiled(mean, var, slope)
    ref_mean, ref_var = leaky_relu_moments(mean[:-3], var[:-3], slope)
    assert_equal_to_rounding(got_mean[:-3], ref_mean, mean[:-3].abs() + var[:-3].sqrt(), dtype)
    assert_equal_to_rounding(got_var[:-3], ref_var, var[:-3], dtype)
    # a deterministic unit: f(μ) (s is clamped to the smallest normal number, so at μ = 0 the
    # mean is s·φ(0), below any scale) and variance exactly 0
    leaky = torch.nn.functional.leaky_relu(mean[-3:], slope)
    tiny = torch.finfo(dtype).tiny
    assert ((got_mean[-3:] - leaky).abs() <= tiny).all()
    assert torch.equal(got_var[-3:], torch.zeros(3, dtype=dtype))


def _net(widths: tuple[int, ...], slope: float) -> MomentSequential:
    """Gaussian linear layers of ``widths`` (in, hidden…, out) with Leaky-ReLUs between."""
    torch.manual_seed(0)
    layers: list = []
    for n, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        if n:
            layers.append(MomentLeakyReLU(slope))
        layers.append(GaussianLinear(fan_in, fan_out))
    return MomentSequential(*layers).double()


@pytest.mark.parametrize("widths", [(1, 16, 16, 1), (3, 8, 2), (5, 4)])
@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_planned_pass_equals_the_modules_fused_pass(widths, slope):
    """Eagerly, float64: the plan's pass gives the module's ``forward_fused`` numbers to
    rounding, an outer-product first layer (in = 1), several inputs and two outputs alike."""
    net = _net(widths, slope)
    x = torch.linspace(-4, 4, 40 * widths[0], dtype=torch.float64).reshape(40, widths[0])
    with torch.no_grad():
        got = planned_pass(x, *inference_plan(net))
        want = net.forward_fused(x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_kept_plan_follows_every_change_of_the_network():
    """kept_plan reuses the plan (the same object) while nothing changed, and makes it afresh
    after an optimiser step, load_state_dict, a change of dtype, a replaced parameter, a new
    slope and a replaced layer, and always with autograd; after each change the planned pass
    with it gives the module's fused pass (which reads the parameters now) to rounding."""
    net = _net((1, 8, 8, 1), 0.1)
    x = torch.linspace(-3, 3, 20, dtype=torch.float64).unsqueeze(1)

    def check(dtype=torch.float64):
        with torch.no_grad():
            got = planned_pass(x.to(dtype), *inference.kept_plan(net))
            want = net.forward_fused(x.to(dtype))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 1e-12,
                                       atol=1e-7 if dtype == torch.float32 else 1e-14)

    with torch.no_grad():
        first = inference.kept_plan(net)
        assert inference.kept_plan(net) is first
    check()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net.forward_fused(x)[1].sum().backward()
    opt.step()
    with torch.no_grad():
        assert inference.kept_plan(net) is not first
    check()
    state = {k: v + 0.25 for k, v in net.state_dict().items()}
    net.load_state_dict(state)
    check()
    net.float()
    check(torch.float32)
    net.double()
    check()
    net[2].weight_rho = torch.nn.Parameter(net[2].weight_rho.detach() - 1.0)
    check()
    net[1].slope = 0.3
    check()
    setattr(net, "4", GaussianLinear(8, 1).double())   # a new output layer in its place
    check()
    with torch.enable_grad():
        assert inference.kept_plan(net) is not inference.kept_plan(net)


def test_inference_plan_refuses_a_layer_it_does_not_know():
    inner = MomentSequential(MomentLeakyReLU(0.1))  # a moment module, not one of the two
    net = MomentSequential(GaussianLinear(2, 3), inner, GaussianLinear(3, 1))
    with pytest.raises(ValueError, match="GaussianLinear and MomentLeakyReLU layers, got "
                                         "MomentSequential"):
        inference_plan(net)


@pytest.mark.parametrize("widths", [(1, 16, 16, 1), (3, 24, 2), (1, 40, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eager_inference_in_row_blocks_is_the_whole_pass_bit_for_bit(widths, dtype,
                                                                     monkeypatch):
    """Blocks of 16 rows (the last holding the remainder) over batches that end mid-block and
    on a block: the whole batch's numbers to rounding (a matrix product may round a block's
    last rows otherwise); the blocks ran; with autograd, or a batch under two blocks, the
    whole batch in one pass."""
    net = _net(widths, 0.1).to(dtype)
    monkeypatch.setattr(inference, "BLOCK_ROWS", 16)
    monkeypatch.setattr(fused, "CHUNK", 16 * max(widths))
    calls: list[int] = []
    whole_pass = MomentSequential.forward_fused

    def counted(self, mean, var=None):
        calls.append(mean.shape[0])
        return whole_pass(self, mean, var)

    for n in (32, 67, 96, 31):
        x = torch.linspace(-6, 6, n * widths[0], dtype=dtype).reshape(n, widths[0])
        with torch.no_grad():
            want = net.forward_fused(x)
            monkeypatch.setattr(MomentSequential, "forward_fused", counted)
            calls.clear()
            got = eager_inference(net, x)
            monkeypatch.setattr(MomentSequential, "forward_fused", whole_pass)
        tol = dict(rtol=1e-13, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-6,
                                                                                  atol=1e-7)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tol)
        assert calls == ([n] if n < 32 else [16] * (n // 16 - 1) + [16 + n % 16]), n
    with torch.enable_grad():
        monkeypatch.setattr(MomentSequential, "forward_fused", counted)
        calls.clear()
        eager_inference(net, x.new_zeros(96, widths[0]))
    assert calls == [96]


def _bnn(width: int) -> BayesianMLP:
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(width)
    return BayesianMLP(MLP(width=width, depth=2, slope=0.1), info, variance="learned",
                       compile=True)


@pytest.mark.slow
def test_compiled_inference_over_widths_and_batches_equals_the_eager_pass():
    """Two widths, batches of 64, 17 and 1 in one process: every call within float32's
    rounding of the eager pass, the first width from one graph with its batch dynamic (17
    reuses 64's; a single row is a graph of its own), the second from one more, and nothing
    compiled again on a repeat."""
    counters = torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()
    start = counters["unique_graphs"]
    try:
        for width, graphs in ((16, 2), (24, 4)):
            comp = _bnn(width)
            eager = _bnn(width)
            eager.compiled = False
            for n in (64, 17, 1, 64):
                x = torch.linspace(-30, 30, n).unsqueeze(1)
                with torch.no_grad():
                    (mean, var), (ref_mean, ref_var) = comp.moment_pass(x), eager.moment_pass(x)
                assert ((mean - ref_mean).abs() <= 2e-6 * (ref_mean.abs() + ref_var.sqrt())).all()
                assert ((var - ref_var).abs() <= 2e-6 * ref_var).all()
            assert counters["unique_graphs"] - start == graphs, width
    finally:
        torch._dynamo.reset()
