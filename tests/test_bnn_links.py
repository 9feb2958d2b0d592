"""The BNN's learned-variance link, prior, KL scale, training by sampling, and its moment-vs-Monte
Carlo diagnostics (recorded by the runner as test/mc_*)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import quick_trainer, run_cli
from uqbench.backbones.mlp import MLP
from uqbench.configs import check_types
from uqbench.contracts import DataInfo, RegressionOutput
from uqbench.data.polynomial import PolynomialData
from uqbench.methods import bnn as bnn_module
from uqbench.methods.bnn import BayesianMLP
from uqbench.records.loggers import NullLogger
from uqbench.tasks.regression import RegressionTask

pytestmark = pytest.mark.usefixtures("one_thread")

INFO = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
DRAWS = 100_000


class _Losses(NullLogger):
    """Records each epoch's mean training loss."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.losses.append(metrics["train/loss"])


def _fit(method: BayesianMLP, data: PolynomialData, epochs: int = 40) -> list[float]:
    logger = _Losses()
    quick_trainer(epochs).fit(method, data, RegressionTask(), logger)
    return logger.losses


def _draws(method: BayesianMLP, x: torch.Tensor, n: int = DRAWS,
           chunk: int = 20_000) -> torch.Tensor:
    """(n, B, outputs) float64 network outputs under n weight draws."""
    with torch.no_grad():
        return torch.cat([method.net.forward_sampled(x.expand(chunk, *x.shape)).double()
                          for _ in range(n // chunk)])


def _deterministic_features(method: BayesianMLP) -> BayesianMLP:
    """σ ≈ 1e-13 on the hidden layer: its features are fixed, so both outputs are exactly
    Gaussian (a sum of Gaussian weights times fixed features) and every moment rule is exact."""
    with torch.no_grad():
        method.net[0].weight_rho.fill_(-30.0)
        method.net[0].bias_rho.fill_(-30.0)
    return method


# --- the link: moments and Monte Carlo estimate the same E[link(a₂)] --------------------------

@pytest.mark.parametrize("link", ["softplus", "exp"])
def test_each_link_gives_the_same_aleatoric_variance_by_moments_and_by_sampling(link):
    """With fixed features a₂ ~ N(m₂, v₂) exactly, so moment inference's E[link(a₂)] and the MC
    average of link(a₂) over 1e5 weight draws agree within 5 standard errors; so do the means
    and total variances. The output layer's σ is raised (ρ = 0: σ ≈ 0.7) so that v₂ matters."""
    torch.manual_seed(0)
    method = _deterministic_features(BayesianMLP(MLP(width=8), INFO, variance="learned",
                                                 variance_link=link, rho_init=0.0))
    x = torch.linspace(-2.0, 2.0, 9)[:, None]
    with torch.no_grad():
        mom = method(x, inference="moments")
        mean, var = method.net(x, torch.zeros_like(x))
    torch.manual_seed(1)
    out = _draws(method, x)
    y, a2 = out[..., :1], out[..., 1:]
    f = torch.exp(a2) if link == "exp" else F.softplus(a2, threshold=50)
    se = f.std(0) / math.sqrt(DRAWS)
    assert var[:, 1].min() > 0.5  # a₂'s spread is far from negligible: Jensen's gap is large
    assert torch.all((mom.var_aleatoric.double() - 1e-8 - f.mean(0)).abs() <= 5 * se)
    # softplus of the mean (what moment inference used before) is off by far more than that
    if link == "softplus":
        assert torch.all((F.softplus(mean[:, 1:].double()) - f.mean(0)).abs() > 50 * se)
    total = (y - y.mean(0)) ** 2 + f  # one draw's share of the total-variance estimate
    assert torch.all((mom.mean.double() - y.mean(0)).abs() <= 5 * y.std(0) / math.sqrt(DRAWS))
    assert torch.all((mom.var.double() - total.mean(0)).abs()
                     <= 5 * total.std(0) / math.sqrt(DRAWS))


def test_a_trained_learned_model_agrees_with_monte_carlo():
    """A learned-variance BNN trained briefly on the polynomial (width 16, 40 epochs), against
    1e5 weight draws.

    One hidden layer, deterministic input: output 1's mean and variance and a₂'s mean and
    variance are exact under mean-field, so they must match MC within 5 standard errors.
    E[softplus(a₂)] assumes a₂ Gaussian, but a₂ = Σ_j w_j h_j + b is a sum of products: on this
    model its skewness is about −0.2 and the aleatoric parts differ by up to ~45 % where a₂'s
    tail carries E[softplus] (measured; 98 % with the old softplus(mean)). The derived check:
    the moment value must equal the MC average of softplus over *Gaussian* draws with a₂'s MC
    mean and variance (within 5 SE), and the total variance must match MC within 5 SE plus the
    measured non-Gaussian gap Δ = MC average over weight draws − over the Gaussian draws. At this
    width and training length the epistemic part dominates the total and Δ is well below the
    MC error of the total (measured |z| ≤ 2.4 without Δ over 3 seeds, widths 8 and 16).
    """
    torch.manual_seed(0)
    data = PolynomialData(n_train=400, n_val=100, n_test=300, n_ood=300, batch_size=100)
    data.setup()
    method = BayesianMLP(MLP(width=16), data.info, variance="learned")
    _fit(method, data)
    method.eval()
    x = data.plot_grid(25)
    with torch.no_grad():
        mom = method(x, inference="moments")
        mean, var = method.net(x, torch.zeros_like(x))
    torch.manual_seed(1)
    out = _draws(method, x)
    root_n = math.sqrt(DRAWS)
    y, a2 = out[..., :1], out[..., 1:]
    # exact parts: output 1's mean and variance, a₂'s mean and variance
    for draws, m, v in ((y, mean[:, :1], var[:, :1]), (a2, mean[:, 1:], var[:, 1:])):
        centred = draws - draws.mean(0)
        se_var = ((centred ** 2).var(0) / DRAWS).sqrt()
        assert torch.all((m.double() - draws.mean(0)).abs() <= 5 * draws.std(0) / root_n)
        assert torch.all((v.double() - draws.var(0)).abs() <= 5 * se_var)
    # the Gaussian step: E[softplus] of N(a₂'s MC mean, MC variance), sampled
    gen = torch.Generator().manual_seed(2)
    gauss = a2.mean(0) + a2.std(0) * torch.randn(a2.shape, generator=gen, dtype=torch.float64)
    fg, fw = F.softplus(gauss, threshold=50), F.softplus(a2, threshold=50)
    ale = mom.var_aleatoric.double() - 1e-8
    se_g = fg.std(0) / root_n
    # a₂'s MC mean and variance are themselves off by their SE: allow for that too (σ'·δm, ½σ''δv)
    slack = (torch.sigmoid(a2).mean(0) * a2.std(0) / root_n
             + 0.125 * (((a2 - a2.mean(0)) ** 2).var(0) / DRAWS).sqrt())
    assert torch.all((ale - fg.mean(0)).abs() <= 5 * se_g + 5 * slack)
    gap = (fw.mean(0) - fg.mean(0)).abs()
    total = (y - y.mean(0)) ** 2 + fw
    assert torch.all((mom.var.double() - total.mean(0)).abs()
                     <= 5 * total.std(0) / root_n + gap)
    assert torch.all((mom.mean.double() - y.mean(0)).abs() <= 5 * y.std(0) / root_n)


# --- training by sampling ---------------------------------------------------------------------

def test_the_sampling_loss_is_the_gaussian_nll_of_the_draws(monkeypatch):
    """Two fixed draws (S, B, outputs) = (2, 1, 2): output 1 ∈ {1, 3}, exp(output 2) ∈ {1, 3}:
    mean 2, unbiased variance 2, mean link 2, so var = 4 + min_var; with y = 4 and no KL the
    loss is ½(log 2π·4 + 2²/4), by hand."""
    method = BayesianMLP(MLP(width=4), INFO, variance="learned", variance_link="exp",
                         training="sampling", train_samples=2, kl_weight=0.0, min_var=0.0)
    draws = torch.tensor([[[1.0, 0.0]], [[3.0, math.log(3.0)]]])
    monkeypatch.setattr(method, "_draws", lambda x, n: draws[:n])
    loss = method.loss((torch.zeros(1, 1), torch.tensor([[4.0]])))
    assert loss.item() == pytest.approx(0.5 * (math.log(2 * math.pi * 4) + 1.0), rel=1e-6)


def test_sampling_gradients_reach_every_parameter():
    torch.manual_seed(0)
    method = BayesianMLP(MLP(width=4, depth=2), INFO, variance="learned", training="sampling",
                         train_samples=4)
    method.loss((torch.randn(8, 1), torch.randn(8, 1))).backward()
    for name, p in method.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_training_by_sampling_learns_what_training_by_moments_learns(variance):
    """An easy case, y = x + N(0, 0.2²): both trainings decrease the ELBO and predict alike —
    means within half the noise σ of each other and σ within 25 %, both near the true 0.2."""
    def trained(training: str) -> tuple[BayesianMLP, list[float]]:
        torch.manual_seed(0)
        data = PolynomialData(coefficients=[0.0, 1.0], noise_base=0.2, noise_scale=0.0,
                              n_train=400, n_val=100, n_test=300, n_ood=300, batch_size=100)
        data.setup()
        method = BayesianMLP(MLP(width=8), data.info, variance=variance, training=training)
        return method, _fit(method, data)

    sampled, losses = trained("sampling")
    moments, _ = trained("moments")
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.1 * losses[0]
    x = torch.linspace(-1.4, 1.4, 29)[:, None]
    with torch.no_grad():
        a, b = sampled(x), moments(x)
    assert (a.mean - b.mean).abs().max() < 0.1
    ratio = a.var.sqrt() / b.var.sqrt()
    assert ratio.min() > 0.8 and ratio.max() < 1.25
    for out in (a, b):
        assert 0.15 < out.var.sqrt().mean() < 0.3


# --- prior and KL scale ---------------------------------------------------------------------

def test_fan_in_prior_and_kl_scale_set_the_kl_term():
    """prior: fan_in divides each layer's prior std by √fan_in (1, 16, 16 here); kl_scale
    multiplies β = 1/batches; an explicit kl_weight overrides it; the loss's KL term moves by
    exactly (β₂ − β₁)·KL."""
    torch.manual_seed(0)
    fixed = BayesianMLP(MLP(width=16, depth=2), INFO, prior_std=0.8)
    torch.manual_seed(0)
    scaled = BayesianMLP(MLP(width=16, depth=2), INFO, prior_std=0.8, prior="fan_in",
                         kl_scale=3.0)
    assert [m.prior_std for m in scaled.net if hasattr(m, "prior_std")] == pytest.approx(
        [0.8, 0.2, 0.2])
    assert [m.prior_std for m in fixed.net if hasattr(m, "prior_std")] == [0.8] * 3
    assert (fixed.kl_weight, scaled.kl_weight) == (pytest.approx(1 / 20), pytest.approx(3 / 20))
    assert BayesianMLP(MLP(width=4), INFO, kl_scale=3.0, kl_weight=0.5).kl_weight == 0.5
    batch = (torch.randn(10, 1), torch.randn(10, 1))
    torch.manual_seed(0)
    heavier = BayesianMLP(MLP(width=16, depth=2), INFO, prior_std=0.8, kl_scale=3.0)
    with torch.no_grad():
        step = heavier.loss(batch) - fixed.loss(batch)
        assert step.item() == pytest.approx((2 / 20) * fixed.net.kl().item(), rel=1e-5)
    assert scaled.settings() | {"kl_weight": None} == {
        "variance": "embedded", "inference": "moments", "variance_link": "softplus",
        "prior": "fan_in", "kl_scale": 3.0, "kl_weight": None, "training": "moments",
        "train_samples": 16, "check_samples": 2000, "covariance": "diagonal"}


# --- diagnostics -------------------------------------------------------------------------------

class _Shifted(BayesianMLP):
    """Moment inference deliberately wrong by a known amount: mean + 1·σ and variance × 4."""

    def _moments(self, x: torch.Tensor) -> RegressionOutput:
        out = super()._moments(x)
        return RegressionOutput(out.mean + out.var.sqrt(), 4 * out.var, out.var_aleatoric)


@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_diagnostics_measure_the_moment_vs_mc_gap(variance, monkeypatch):
    """Exact moments (fixed features): gap ≈ 0 and σ ratio ≈ 1 within MC error at S = 2000
    (the mean gap's MC floor is E|N(0, 1/S)| ≈ 0.018; σ's relative SE is 1/√(2S) ≈ 0.016);
    a model whose moments are off by +1σ in the mean and ×2 in σ reads gap ≈ 1 (|μ − μ_MC|/σ_MC
    with σ_MC the true σ), ratio ≈ 2. Chunks of one or a few draws give the same statistics."""
    x = torch.linspace(-2.0, 2.0, 300)[:, None]
    for chunked in (False, True):
        if chunked:  # a few draws per chunk, and a short last chunk
            monkeypatch.setattr(bnn_module, "CHECK_CHUNK_ELEMENTS", 7 * 256 * 10)
        torch.manual_seed(0)
        exact = _deterministic_features(BayesianMLP(MLP(width=8), INFO, variance=variance,
                                                    rho_init=-1.0))
        found = exact.diagnostics(x)
        parts = ({"mc_epistemic_std_ratio", "mc_aleatoric_ratio", "mc_link_closure_ratio",
                  "mc_link_last_layer_ratio"} if variance == "learned" else set())
        assert set(found) == {"mc_mean_gap", "mc_std_ratio", "mc_std_ratio_se",
                              "mc_std_ratio_z", "mc_samples"} | parts
        assert found["mc_std_ratio_z"] == pytest.approx(
            (found["mc_std_ratio"] - 1) / found["mc_std_ratio_se"])
        for key in parts:  # each part exact too: ≈ 1 within its MC error
            assert found[key] == pytest.approx(1.0, abs=5 / math.sqrt(2000)), key
        assert found["mc_samples"] == 2000
        assert found["mc_mean_gap"] < 5 / math.sqrt(2000)
        assert found["mc_std_ratio"] == pytest.approx(1.0, abs=5 / math.sqrt(4000))
    torch.manual_seed(0)
    wrong = _deterministic_features(_Shifted(MLP(width=8), INFO, variance=variance,
                                             rho_init=-1.0))
    found = wrong.diagnostics(x)
    assert found["mc_mean_gap"] == pytest.approx(1.0, abs=0.1)
    assert found["mc_std_ratio"] == pytest.approx(2.0, abs=0.1)


def test_grouping_the_draws_changes_no_draw_and_no_sum(monkeypatch):
    """The draws split into groups (for the error of mc_std_ratio) are the draws taken without
    groups, whatever the chunks (which set how the random numbers are drawn): the groups' sums
    add up to the ungrouped sums, and every group holds its share of the draws."""
    torch.manual_seed(0)
    method = BayesianMLP(MLP(width=8, depth=2), INFO, variance="learned", rho_init=-1.0)
    x = torch.linspace(-2.0, 2.0, 30)[:, None]
    shift = torch.zeros(30, 1, dtype=torch.float64)
    for chunk in (None, 7 * 30 * 10, 3 * 30 * 10):  # one chunk; chunks straddling the groups
        if chunk is not None:
            monkeypatch.setattr(bnn_module, "CHECK_CHUNK_ELEMENTS", chunk)
        found = {}
        for groups in (1, 7, 20):
            torch.manual_seed(1)
            found[groups] = method._mc_sums(x, 103, shift, groups)
            counts = found[groups][3].flatten().tolist()
            assert sum(counts) == 103 and max(counts) - min(counts) <= 1
            assert len(counts) == groups
        whole = [t.sum(0) for t in found[1]]
        assert whole[0].abs().sum() > 0 and whole[2].abs().sum() > 0  # the link's sums too
        for groups in (7, 20):
            for a, b in zip(whole, (t.sum(0) for t in found[groups]), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_error_of_the_sigma_ratio_is_the_spread_of_independent_checks(monkeypatch):
    """mc_std_ratio_se, the jackknife error over groups of one check's draws, against the
    standard deviation of mc_std_ratio over 60 checks with independent draws (their own
    seeds): the mean jackknife error within 25 % of it (the spread of 60 values is known to
    about ±9 %, the mean of 60 jackknife errors to a few %). A net of two hidden layers, whose
    moments are not Monte Carlo's exactly, learned variance (both parts of σ drawn)."""
    torch.manual_seed(0)
    method = BayesianMLP(MLP(width=8, depth=2), INFO, variance="learned", rho_init=-1.0,
                         check_samples=400)
    x = torch.linspace(-2.0, 2.0, 40)[:, None]
    seeds = iter(range(1, 1000))
    real = bnn_module._private_rng
    monkeypatch.setattr(bnn_module, "_private_rng",
                        lambda device, seed: real(device, seed=next(seeds)))
    found = [method.diagnostics(x) for _ in range(60)]
    ratios = torch.tensor([f["mc_std_ratio"] for f in found], dtype=torch.float64)
    errors = torch.tensor([f["mc_std_ratio_se"] for f in found], dtype=torch.float64)
    assert ratios.std() > 0
    assert 0.75 < (errors.mean() / ratios.std()).item() < 1.25


class _NoiseDoubled(BayesianMLP):
    """Learned variance whose moment inference doubles E[link(a₂)] and keeps the spread of the
    mean output: the total grows by the one, the parts read ×2 and ×1."""

    def _moments(self, x: torch.Tensor) -> RegressionOutput:
        out = super()._moments(x)
        extra = out.var_aleatoric - self.min_var
        return RegressionOutput(out.mean, out.var + extra, out.var_aleatoric + extra)


def test_diagnostics_split_the_learned_variance_into_its_parts():
    """mc_aleatoric_ratio reads the noise variance's error alone and mc_epistemic_std_ratio the
    mean output's spread alone: doubling E[link(a₂)] reads 2 and 1 (exact moments otherwise,
    fixed features), and the total ratio lies between."""
    x = torch.linspace(-2.0, 2.0, 300)[:, None]
    torch.manual_seed(0)
    doubled = _deterministic_features(_NoiseDoubled(MLP(width=8), INFO, variance="learned",
                                                    rho_init=-1.0))
    found = doubled.diagnostics(x)
    assert found["mc_aleatoric_ratio"] == pytest.approx(2.0, abs=0.1)
    assert found["mc_epistemic_std_ratio"] == pytest.approx(1.0, abs=5 / math.sqrt(2000))
    assert 1.0 + 5 / math.sqrt(2000) < found["mc_std_ratio"] < math.sqrt(2.0)


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_the_link_closure_is_the_gaussian_at_the_draws_own_moments(covariance, monkeypatch):
    """mc_link_closure_ratio: E[softplus(a)] for a ~ N(mean, variance of the draws' a₂), by
    scipy's adaptive quadrature, over the draws' mean softplus(a₂), averaged over inputs: the
    same draws rebuilt by hand (the diagnostics' seed and chunks, uneven ones), to 1e-7. With
    the full pass the last activation's input is tapped on the same draws too. On this deep,
    narrow network a₂ is far from Gaussian, and the ratio is far from 1."""
    from scipy import integrate, stats

    monkeypatch.setattr(bnn_module, "CHECK_CHUNK_ELEMENTS", 7 * 9 * 10)
    torch.manual_seed(3)
    bnn = BayesianMLP(MLP(width=4, depth=3), INFO, variance="learned", rho_init=0.5,
                      covariance=covariance, check_samples=301).double()
    x = torch.linspace(-2, 2, 9, dtype=torch.float64).unsqueeze(1)
    layers = [m for m in bnn.net if isinstance(m, bnn_module.GaussianLinear)]
    per_draw = sum(m.weight_mu.numel() + m.bias_mu.numel() + 9 * m.out_features for m in layers)
    chunk = max(1, 7 * 9 * 10 // per_draw)
    assert chunk < 301 and 301 % chunk != 0  # several chunks, a short last one
    with torch.no_grad(), bnn_module._private_rng(x.device, seed=0):
        a2 = torch.cat([bnn.net.forward_sampled(x.expand(min(chunk, 301 - lo), *x.shape))
                        for lo in range(0, 301, chunk)])[..., 1].numpy()
    ratios = []
    for b in range(9):
        m, sd = a2[:, b].mean(), a2[:, b].std(ddof=1)
        closed = integrate.quad(lambda a, m=m, sd=sd: np.logaddexp(0, a) * stats.norm.pdf(a, m, sd),
                                m - 40 * sd, m + 40 * sd, epsabs=0, epsrel=1e-11, limit=400,
                                points=[m])[0]
        ratios.append(closed / np.logaddexp(0, a2[:, b]).mean())
    expected = float(np.mean(ratios))
    found = bnn.diagnostics(x)["mc_link_closure_ratio"]
    assert found == pytest.approx(expected, rel=1e-7)
    assert abs(expected - 1) > 0.1


def test_the_last_layer_link_takes_the_layers_below_from_the_draws(monkeypatch):
    """mc_link_last_layer_ratio on a depth-2 network: for each of Monte Carlo's draws of the
    last hidden layer's input h (rebuilt by hand: the diagnostics' seed and uneven chunks), a₂'s
    mean and variance given h by the textbook rules in numpy (Gaussian pre-activations, the
    rectified Gaussian's two moments, a sum of independent products), E[softplus] under that
    Gaussian by scipy's adaptive quadrature, averaged over the draws, over the draws' mean
    softplus(a₂), averaged over inputs: to 1e-7. On this narrow network with wide weights the
    last layer's sum alone is far from Gaussian, and the ratio far from 1."""
    from scipy import integrate, stats

    monkeypatch.setattr(bnn_module, "CHECK_CHUNK_ELEMENTS", 7 * 5 * 10)
    torch.manual_seed(4)
    bnn = BayesianMLP(MLP(width=3, depth=2), INFO, variance="learned", rho_init=1.0,
                      check_samples=61).double()
    x = torch.linspace(-2, 2, 5, dtype=torch.float64).unsqueeze(1)
    net = list(bnn.net)
    assert [type(m).__name__ for m in net] == ["GaussianLinear", "MomentLeakyReLU"] * 2 + [
        "GaussianLinear"]
    k = net[1].slope  # Leaky-ReLU: y = k·z + (1 − k)·relu(z)
    layers = [m for m in net if isinstance(m, bnn_module.GaussianLinear)]
    per_draw = sum(m.weight_mu.numel() + m.bias_mu.numel() + 5 * m.out_features for m in layers)
    chunk = max(1, 7 * 5 * 10 // per_draw)
    assert chunk < 61 and 61 % chunk != 0
    hs, outs = [], []
    with torch.no_grad(), bnn_module._private_rng(x.device, seed=0):
        for lo in range(0, 61, chunk):
            a = x.expand(min(chunk, 61 - lo), *x.shape)
            for i, m in enumerate(net):
                if i == 2:
                    hs.append(a)
                a = m.forward_sampled(a)
            outs.append(a)
    h = torch.cat(hs).numpy()                                     # (S, B, 3)
    a2 = torch.cat(outs)[..., 1].numpy()                          # (S, B)

    def params(m):
        return (m.weight_mu.detach().numpy(), F.softplus(m.weight_rho).detach().numpy() ** 2,
                m.bias_mu.detach().numpy(), F.softplus(m.bias_rho).detach().numpy() ** 2)

    mw, vw, mb, vb = params(net[2])
    mz, vz = h @ mw.T + mb, (h * h) @ vw.T + vb                   # (S, B, 3)
    t = mz / np.sqrt(vz)
    r1 = mz * stats.norm.cdf(t) + np.sqrt(vz) * stats.norm.pdf(t)                # E[relu z]
    r2 = (mz * mz + vz) * stats.norm.cdf(t) + mz * np.sqrt(vz) * stats.norm.pdf(t)  # E[relu² z]
    e1 = k * mz + (1 - k) * r1                      # E[z·relu z] = E[relu² z] below
    e2 = k * k * (mz * mz + vz) + (1 - k * k) * r2
    mw, vw, mb, vb = params(net[4])
    m2 = e1 @ mw[1] + mb[1]
    v2 = (e2 - e1 * e1) @ (mw[1] ** 2 + vw[1]) + (e1 * e1) @ vw[1] + vb[1]

    def closed(m, sd):
        return integrate.quad(lambda a: np.logaddexp(0, a) * stats.norm.pdf(a, m, sd),
                              m - 40 * sd, m + 40 * sd, epsabs=0, epsrel=1e-11, limit=400,
                              points=[m])[0]

    given = np.array([[closed(m2[s, b], np.sqrt(v2[s, b])) for b in range(5)]
                      for s in range(61)])
    expected = float(np.mean(given.mean(0) / np.logaddexp(0, a2).mean(0)))
    found = bnn.diagnostics(x)
    assert found["mc_link_last_layer_ratio"] == pytest.approx(expected, rel=1e-7)
    assert abs(expected - 1) > 0.1


def test_the_last_layer_link_at_depth_one_is_the_moment_pass():
    """With one hidden layer its input is the network's input, the same for every draw: the
    last-layer ratio is the diagonal pass's own noise ratio (its moments are exact there)."""
    torch.manual_seed(5)
    bnn = BayesianMLP(MLP(width=6), INFO, variance="learned", rho_init=0.0,
                      check_samples=200).double()
    found = bnn.diagnostics(torch.linspace(-2, 2, 7, dtype=torch.float64).unsqueeze(1))
    assert found["mc_link_last_layer_ratio"] == pytest.approx(found["mc_aleatoric_ratio"],
                                                              rel=1e-9)
    assert abs(found["mc_aleatoric_ratio"] - 1) > 1e-3  # Monte Carlo's own error: not trivially 1


def test_diagnostics_leave_the_random_state_alone_and_can_be_switched_off():
    torch.manual_seed(0)
    method = BayesianMLP(MLP(width=8, depth=2), INFO, variance="learned", check_samples=300)
    x = torch.randn(20, 1)
    state = torch.random.get_rng_state()
    first = method.diagnostics(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.randn(5)  # another random state: the diagnostics draw from their own seed
    assert method.diagnostics(x) == first
    assert BayesianMLP(MLP(width=8), INFO, check_samples=0).diagnostics(x) == {}


# --- the runner --------------------------------------------------------------------------------

TINY = ["trainer.epochs=3", "trainer.progress=false", "dataset.n_train=200", "dataset.n_val=50",
        "dataset.n_test=100", "dataset.n_ood=100", "plot=false", "device=cpu"]


def test_the_runner_records_diagnostics_and_changes_no_other_metric(compose_cfg, tmp_path):
    """test/mc_* appear in every BNN run (check_samples=0 leaves them out), the other metrics
    are those of a run without them, and job=eval on the run reproduces them exactly (the
    draws come from a fixed seed)."""
    from uqbench.runner.cli import run

    common = [*TINY, f"paths.runs_dir={tmp_path}", "method.variance=learned",
              "method.inference=mc", "method.mc_samples=50"]  # MC inference: RNG-sensitive
    on = run(compose_cfg([*common, "run_name=on"]))
    off = run(compose_cfg([*common, "run_name=off", "method.check_samples=0"]))
    keys = {"test/mc_mean_gap", "test/mc_std_ratio", "test/mc_std_ratio_se",
            "test/mc_std_ratio_z", "test/mc_samples",
            "test/mc_epistemic_std_ratio", "test/mc_aleatoric_ratio",
            "test/mc_link_closure_ratio", "test/mc_link_last_layer_ratio"}  # learned: parts
    assert keys <= set(on["metrics"]) and not keys & set(off["metrics"])
    assert {k: v for k, v in on["metrics"].items() if k not in keys} == off["metrics"]
    assert on["metrics"]["test/mc_samples"] == 2000
    assert 0 <= on["metrics"]["test/mc_mean_gap"] < 1 and on["time"]["diagnostics_s"] > 0
    stored = json.loads((tmp_path / "on" / "results.json").read_text())
    assert stored["metrics"]["test/mc_std_ratio"] == on["metrics"]["test/mc_std_ratio"]
    scored = run(compose_cfg([*common, "run_name=on", "job=eval",
                              f"eval_run={tmp_path / 'on'}"]))
    assert {k: scored["metrics"][k] for k in keys} == {k: on["metrics"][k] for k in keys}


def test_a_bad_link_on_the_command_line_fails_before_anything_is_written(tmp_path, cfg):
    with pytest.raises(ValueError, match=r"variance_link 'cube' is not one of"):
        check_types(cfg("method.variance_link=cube").method, "method")
    proc = run_cli(*TINY, f"paths.runs_dir={tmp_path}", "method.variance_link=cube",
                   check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "method.variance_link 'cube' is not one of ('softplus', 'exp')" in proc.stderr
    # refused by the config check, before the run folder is locked (no .lock file keeps its
    # parent) or built; the runner then drops the folder Hydra made for its log
    assert list(tmp_path.iterdir()) == []


class _FakeClock:
    """perf_counter for pass_cost: time moves only when a faked pass runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_pass_cost_is_the_median_of_the_rounds_ratios_on_a_fake_clock(monkeypatch):
    """pass_cost's arithmetic by hand: the full pass takes 3, 6 and 4 ticks in its three rounds,
    the diagonal one 1 tick, so it is repeated 3, 6 and 4 times to match and the ratios are 3, 6
    and 4, median 4; a full pass of 2 s is timed in one round (ratio 2048). A tick is 2⁻¹⁰ s,
    so that the clock's sums are exact."""
    clock = _FakeClock()
    monkeypatch.setattr(bnn_module, "time", clock)
    method = BayesianMLP(MLP(width=4), INFO, variance="learned")
    tick = 2.0 ** -10
    own = iter([3 * tick, 6 * tick, 4 * tick])
    diagonal_calls = []

    def full_pass(_inputs):
        clock.now += next(own)

    def diagonal_pass(_net, _inputs):
        diagonal_calls.append(1)
        clock.now += tick

    monkeypatch.setattr(method, "moment_pass", full_pass)
    monkeypatch.setattr(bnn_module, "eager_inference", diagonal_pass)
    assert method.pass_cost(torch.zeros(2, 1)) == pytest.approx(4.0)
    assert len(diagonal_calls) == (1 + 3) + (1 + 6) + (1 + 4)   # one to size, then the repeats
    own = iter([2.0, 3 * tick, 3 * tick])
    assert method.pass_cost(torch.zeros(2, 1)) == pytest.approx(2048.0)
    assert next(own) == 3 * tick                                   # the second round never ran


@pytest.mark.slow  # four CLI runs
def test_scoring_takes_the_bnns_inference_options_and_refuses_what_it_would_ignore(tmp_path):
    """job=eval scores the run as trained: a method setting it cannot apply (the variance head)
    is refused, naming it, where it used to be ignored; the run's own value passes; the BNN's
    scoring options (``method.covariance=full``: the same weights, propagated with their
    covariances) score the run again into a folder of their own."""
    # two hidden layers: the second's units share the first's outputs, so covariances matter
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "run_name=diag", "trainer.epochs=1",
            "backbone.depth=2")
    run = tmp_path / "diag"
    trained = json.loads((run / "results.json").read_text())
    proc = run_cli("job=eval", f"eval_run={run}", f"paths.runs_dir={tmp_path}",
                   "method.variance=learned", check=False)
    assert proc.returncode != 0
    assert "method.variance=learned (the run has embedded)" in proc.stderr
    assert "method.covariance" in proc.stderr                    # what a scoring job takes
    assert not (run / "eval").exists()
    run_cli("job=eval", f"eval_run={run}", f"paths.runs_dir={tmp_path}",
            "method.variance=embedded", "logger=none")
    same = json.loads((run / "eval" / "polynomial" / "results.json").read_text())
    assert same["metrics"]["test/nll"] == trained["metrics"]["test/nll"]
    run_cli("job=eval", f"eval_run={run}", f"paths.runs_dir={tmp_path}",
            "method.covariance=full", "logger=none")
    full = json.loads((run / "eval" / "polynomial,method.covariance=full"
                       / "results.json").read_text())
    assert full["scored_with"] == {"method.covariance": "full"}
    assert full["metrics"]["test/nll"] != trained["metrics"]["test/nll"]  # another inference
    assert math.isfinite(full["metrics"]["test/nll"])
    # the run's settings as scored (a table groups the scoring by them) and its model's size
    assert full["settings"]["method"] == trained["settings"]["method"] | {"covariance": "full"}
    assert trained["settings"]["method"]["covariance"] == "diagonal"
    assert full["settings"]["backbone"] == trained["settings"]["backbone"]
    assert full["params"] == trained["params"]
    # the cost ratio is recorded (a wall-clock figure: its arithmetic is pinned on a fake clock
    # below, its size is make bench's to measure, not a test's)
    assert full["metrics"]["test/pass_cost_vs_diagonal"] > 0
    assert math.isfinite(full["metrics"]["test/pass_cost_vs_diagonal"])
    assert "test/pass_cost_vs_diagonal" not in trained["metrics"]
