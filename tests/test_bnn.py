"""The variational BNN: parameter counts, moments vs Monte Carlo inference, training, errors."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import quick_trainer
from uqbench.backbones.base import Backbone
from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.data.polynomial import PolynomialData
from uqbench.methods.base import Method
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments.layers import GaussianLinear, MomentLeakyReLU
from uqbench.records.loggers import NullLogger
from uqbench.runner.engine.loop import NonFiniteLossError
from uqbench.tasks.regression import RegressionTask

INFO = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)


@pytest.mark.parametrize("width,depth", [(4, 1), (7, 2), (64, 1)])
def test_learned_variance_costs_exactly_the_extra_output(width, depth):
    """Hand count: each Bayesian weight/bias has a mean and a ρ; the extra output row has
    `width` weights and 1 bias."""
    emb = BayesianMLP(MLP(width=width, depth=depth), INFO, variance="embedded")
    lea = BayesianMLP(MLP(width=width, depth=depth), INFO, variance="learned")
    n_det = (1 * width + width) + (depth - 1) * (width * width + width) + (width + 1)
    assert emb.param_counts()["trainable"] == 2 * n_det
    assert lea.param_counts()["trainable"] - emb.param_counts()["trainable"] == 2 * (width + 1)


def test_width_4_matches_the_reference_counts():
    """By hand: 26 (embedded) vs 36 (learned) parameters at width 4."""
    assert BayesianMLP(MLP(width=4), INFO, variance="embedded").param_counts()["trainable"] == 26
    assert BayesianMLP(MLP(width=4), INFO, variance="learned").param_counts()["trainable"] == 36


@pytest.mark.parametrize("activation,slope,kind", [("leaky_relu", 0.2, torch.nn.LeakyReLU),
                                                   ("relu", 0.0, torch.nn.ReLU)])
def test_mlp_honours_the_backbone_contract(activation, slope, kind):
    bb = MLP(width=5, depth=2, activation=activation, slope=slope)
    assert isinstance(bb, Backbone) and bb.modality == "tabular" and not bb.pretrained
    assert bb.targets == [] and bb.attention_targets == [] and bb.feature_dim == 5
    net = bb.build(3)
    assert [type(m) for m in net] == [torch.nn.Linear, kind, torch.nn.Linear, kind]
    assert (net[0].in_features, net[0].out_features, net[2].in_features) == (3, 5, 5)
    assert net(torch.zeros(7, 3)).shape == (7, 5)


@pytest.mark.parametrize("activation,slope", [("leaky_relu", 0.1), ("relu", 0.0)])
def test_bnn_is_the_hand_built_twin_of_the_mlp(activation, slope):
    """The backbone's network is built on the meta device, so it draws no random numbers: from
    the same seed the BNN equals the Bayesian layers written out by hand."""
    torch.manual_seed(0)
    bnn = BayesianMLP(MLP(width=4, depth=2, activation=activation, slope=0.1), INFO,
                      variance="learned", prior_std=0.5, rho_init=-3.0)
    torch.manual_seed(0)
    hand = [GaussianLinear(1, 4, 0.5, -3.0), GaussianLinear(4, 4, 0.5, -3.0),
            GaussianLinear(4, 2, 0.5, -3.0)]  # learned variance: 2 outputs
    kinds = [GaussianLinear, MomentLeakyReLU] * 2 + [GaussianLinear]  # ReLU: slope-0 subclass
    assert all(isinstance(m, k) for m, k in zip(bnn.net, kinds, strict=True))
    assert bnn.net[1].slope == bnn.net[3].slope == slope
    expected = [p for layer in hand for p in layer.parameters()]
    for (name, p), q in zip(bnn.named_parameters(), expected, strict=True):
        assert torch.equal(p, q), name


def test_bnn_names_a_layer_it_cannot_convert():
    class TanhMLP(MLP):
        def build(self, in_features: int) -> torch.nn.Sequential:
            return torch.nn.Sequential(torch.nn.Linear(in_features, self.width), torch.nn.Tanh())

    with pytest.raises(ValueError, match=r"layer 1 \(Tanh\(\)\).*nn\.LeakyReLU.*work: .*mlp"):
        BayesianMLP(TanhMLP(width=4), INFO)


def test_bnn_on_an_image_backbone_names_the_tabular_ones():
    from uqbench.backbones.timm_vit import TimmViT

    vit = TimmViT(name="tiny_vit", model="vit_tiny_patch16_224", pretrained=False)
    with pytest.raises(ValueError, match="'tiny_vit' has modality 'image'. Pick one of: mlp"):
        BayesianMLP(vit, INFO)


def _trained(variance: str) -> tuple[BayesianMLP, PolynomialData]:
    torch.manual_seed(0)
    data = PolynomialData(n_train=400, n_val=100, n_test=300, n_ood=300, batch_size=100)
    data.setup()
    method = BayesianMLP(MLP(width=8), data.info, variance=variance, rho_init=-2.0,
                         mc_samples=20_000)
    quick_trainer(40, val_every=20).fit(method, data, RegressionTask(), NullLogger())
    return method, data


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_moment_inference_agrees_with_monte_carlo(variance):
    """One hidden layer and a deterministic input: moment propagation is exact, so the MC
    estimate over 2e4 weight draws must agree within its sampling error."""
    method, data = _trained(variance)
    method.eval()
    x = data.plot_grid(25)
    with torch.no_grad():
        mom = method(x, inference="moments")
        torch.manual_seed(1)
        mc = method(x, inference="mc")
    n = method.mc_samples
    epistemic = mom.var - (mom.var_aleatoric if mom.var_aleatoric is not None else 0)
    se_mean = (epistemic / n).sqrt()
    assert torch.all((mom.mean - mc.mean).abs() <= 5 * se_mean + 1e-5)
    if variance == "embedded":
        # variance of a sample variance ≈ 2σ⁴/n for near-Gaussian outputs; allow 6 %
        assert torch.allclose(mc.var, mom.var, rtol=0.06)
    else:
        # The epistemic parts are the same quantity and must agree; the aleatoric parts are
        # E[softplus(a₂)] under a₂'s Gaussian vs the MC average (tests/test_bnn_links.py).
        mc_epistemic = mc.var - mc.var_aleatoric
        assert torch.allclose(mc_epistemic, epistemic, rtol=0.06, atol=1e-6)


def test_training_improves_the_elbo_and_tracks_the_noise():
    method, data = _trained("embedded")
    x, y = data.dataset("test").tensors
    with torch.no_grad():
        out = method(x)
    nll = 0.5 * (torch.log(2 * torch.pi * out.var) + (y - out.mean) ** 2 / out.var).mean()
    assert nll < 1.0  # untrained ≈ several nats
    # heteroscedastic: predicted σ grows with |x| as the true σ(x) = 0.05 + 0.3|x| does
    inner = x.abs()[:, 0] < 0.5
    outer = x.abs()[:, 0] > 1.0
    assert out.var[inner].sqrt().mean() < out.var[outer].sqrt().mean()


class _NaNAt(Method):
    task = "regression"
    name = "nan_at"

    def __init__(self, epoch: int, step: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.when, self.calls = (epoch, step), 0

    def loss(self, batch):
        epoch, step = divmod(self.calls, 4)
        self.calls += 1
        bad = (epoch + 1, step) == self.when
        return self.w.sum() + (float("nan") if bad else 1.0)


def test_nan_loss_names_epoch_and_step():
    data = PolynomialData(n_train=400, batch_size=100)  # 4 steps per epoch
    data.setup()
    trainer = quick_trainer(3, lr=0.1, optimizer="torch.optim.SGD", val_every=100)
    with pytest.raises(NonFiniteLossError, match="epoch 2, step 3"):
        trainer.fit(_NaNAt(2, 3), data, RegressionTask(),
                             NullLogger())


@pytest.mark.parametrize("kwargs,match", [
    ({"variance": "both"}, "variance 'both'"),
    ({"inference": "sampling"}, "inference 'sampling'"),
    ({"variance_link": "cube"}, r"variance_link 'cube' is not one of \('softplus', 'exp'\)"),
    ({"prior": "wide"}, r"prior 'wide' is not one of \('fixed', 'fan_in'\)"),
    ({"training": "mc"}, r"training 'mc' is not one of \('moments', 'sampling'\)"),
    ({"train_samples": 1}, "train_samples must be >= 2, got 1"),
    ({"check_samples": 1}, r"check_samples must be 0 \(off\) or >= 2, got 1"),
    ({"check_samples": -5}, "check_samples .* got -5"),
    ({"kl_scale": -1.0}, "kl_scale must be a finite number >= 0, got -1.0"),
    ({"kl_scale": float("inf")}, "kl_scale .* got inf"),
    ({"prior_std": -1.0}, "prior_std"),
    ({"prior_std": 0.0}, "prior_std"),
])
def test_bad_method_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BayesianMLP(MLP(width=4), INFO, **kwargs)


@pytest.mark.parametrize("kwargs,match", [({"width": 0}, "width"), ({"width": -3}, "width"),
                                          ({"depth": 0}, "depth"),
                                          ({"activation": "tanh"}, "activation")])
def test_bad_backbone_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MLP(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"train_range": [1.0, 1.0]}, "empty"),
    ({"train_range": [2.0, -2.0]}, "empty"),
    ({"ood_range": [-1.0, 1.0]}, "enclose"),
    ({"noise_base": -0.1}, "non-negative"),
    ({"noise_base": 0.0, "noise_scale": 0.0}, "must be > 0"),
    ({"n_train": 0}, "n_train"),
])
def test_bad_data_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolynomialData(**kwargs)


def test_polynomial_splits_follow_the_documented_process():
    data = PolynomialData(n_train=20000, n_ood=5000, seed=3)
    data.setup()
    x, y = data.dataset("train").tensors
    assert x.min() >= -1.5 and x.max() <= 1.5
    xo, _ = data.dataset("ood").tensors
    assert ((xo.abs() > 1.5) & (xo.abs() <= 2.25)).all()
    assert (xo < 0).float().mean().item() == pytest.approx(0.5, abs=0.03)  # both flanks
    # residuals have the documented σ(x) = 0.05 + 0.3|x|: standardised variance ≈ 1
    z = (y - (x ** 3 - x)) / (0.05 + 0.3 * x.abs())
    assert z.var().item() == pytest.approx(1.0, abs=0.05)
    again = PolynomialData(n_train=20000, n_ood=5000, seed=3)
    again.setup()
    assert torch.equal(again.dataset("train").tensors[1], y)  # seeded
