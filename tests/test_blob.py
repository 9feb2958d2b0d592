"""BLoB: the Gaussian KL, the sampled layer against hand-built LoRA products, identity at
initialisation, the moments of the drawn A, one training step, the CLI end to end, bad options.

References come from independent code (torch.distributions, plain matmuls, an unwrapped copy of
the backbone), never from the method's own code path.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributions import Normal, kl_divergence

from tests.helpers import build_method, run_cli
from uqbench.contracts import DataInfo
from uqbench.methods.blob import BLoB, BLoBLinear, check_options, kl_factor

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["trainer.epochs=1", "trainer.val_every=1", "trainer.progress=false", "logger=none",
        "plot=false", "torch_threads=1"]
FAST_DIR = "trainer.epochs=1,trainer.val_every=1"


def layer(in_f: int = 6, out_f: int = 5, members: int = 3, rank: int = 4, splits: int = 1,
          scaling: float = 2.0, init_std: float = 0.01, flipout: bool = True) -> BLoBLinear:
    torch.manual_seed(0)
    return BLoBLinear(nn.Linear(in_f, out_f), members, rank, scaling, prior_std=0.2,
                      init_std=init_std, flipout=flipout, splits=splits)


# --- 1. the KL ------------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [1, 3])
def test_kl_equals_torch_distributions(splits):
    lay = layer(out_f=6, splits=splits)
    with torch.no_grad():
        lay.blob_A_mu.normal_(0, 0.3)
        lay.blob_A_g.uniform_(0.05, 0.6)
    mu = lay.blob_A_mu.detach().double()
    sigma = lay.blob_A_g.detach().double() ** 2
    expected = kl_divergence(Normal(mu, sigma), Normal(torch.zeros_like(mu), 0.2)).sum()
    assert lay.kl().item() == pytest.approx(expected.item(), rel=1e-10)
    assert lay.kl().item() > 0


def test_initial_sigma_follows_the_reference_range():
    lay = layer(in_f=64, out_f=32, rank=8, init_std=0.0025)
    sigma = lay.sigma().detach()
    assert sigma.min() >= 0.0025 / 2 - 1e-9 and sigma.max() <= 0.0025 + 1e-9
    assert sigma.max() - sigma.min() > 0.0009  # spread over the range, not one value
    assert (lay.blob_B == 0).all() and lay.blob_A_mu.abs().max() <= 1 / math.sqrt(64)


# --- 2. σ → 0: every draw is the LoRA product with A = μ --------------------------------------

@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_zero_sigma_samples_equal_a_plain_lora_forward(training, splits):
    S, B, T, in_f, out_f, r = 3, 2, 4, 6, 9, 4
    lay = layer(in_f, out_f, members=S, rank=r, splits=splits)
    with torch.no_grad():
        lay.blob_A_g.fill_(1e-6)                                     # σ = 1e-12
        lay.blob_B.normal_()
    lay.train(training)
    x = torch.randn(B, T, in_f)
    with torch.no_grad():
        y = lay(x.repeat(S, 1, 1)).view(S, B, T, out_f)
    W, b = lay.base_layer.weight, lay.base_layer.bias
    o = out_f // splits
    with torch.no_grad():
        parts = [(x @ lay.blob_A_mu[j].T) @ lay.blob_B[j].T for j in range(splits)]
        expected = x @ W.T + b + 2.0 * torch.cat(parts, -1)
    assert expected.shape[-1] == o * splits
    for s in range(S):
        torch.testing.assert_close(y[s], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y[s], y[0], atol=1e-6, rtol=1e-6)


# --- 3. identity at initialisation on a tiny ViT ---------------------------------------------

@pytest.mark.parametrize("qkv", ["split", "fused"])
@pytest.mark.parametrize("training", [False, True])
def test_every_draw_reproduces_the_backbone_at_init(cfg, qkv, training):
    m, ref = build_method(cfg, "tiny_vit", "blob", f"method.qkv={qkv}", "method.samples=4",
                          "method.train_samples=2", reference=True)
    assert len(m.layers()) == 4  # qkv and proj of 2 blocks
    assert sum(lay.splits == 3 for lay in m.layers()) == (2 if qkv == "split" else 0)
    m.train(training)
    for mod in m.encoder.modules():  # the backbone's own dropout off, as in the reference copy
        if isinstance(mod, nn.Dropout):
            mod.eval()
    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = ref(x)                                                           # (B, D)
        expected = feats @ m.head.weight[0].T + m.head.bias[0]                  # (B, C)
        logits = m(x)
    assert logits.shape == (2 if training else 4, 5, 3)
    for z in logits:
        torch.testing.assert_close(z, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backbone,targets,wrapped", [
    ("tiny_bert", "method.targets=[query,value]", 4),  # the reference's layers on BERT
    ("tiny_llama", "method.targets=attention", 8)])
def test_text_backbones_reproduce_the_backbone_at_init(cfg, backbone, targets, wrapped):
    from transformers import AutoTokenizer

    from uqbench.backbones.hf import bundled_tokenizer_path

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    batch = dict(tok(["a good movie", "the plot was very boring", "x"], padding="max_length",
                     max_length=8, truncation=True, return_tensors="pt"))
    m, ref = build_method(cfg, backbone, "blob", targets, "method.samples=3", reference=True)
    assert len(m.layers()) == wrapped
    m.eval()
    with torch.no_grad():
        expected = ref(batch) @ m.head.weight[0].T + m.head.bias[0]             # (B, C)
        logits = m(batch)                                                        # (S, B, C)
    assert logits.shape == (3, 3, 3)
    for z in logits:
        torch.testing.assert_close(z, expected, atol=1e-5, rtol=1e-5)


# --- 4. the draws: they differ, with the posterior's mean and variance ------------------------

def test_draws_differ_and_have_the_posterior_moments():
    S, in_f, r = 4000, 6, 3
    lay = layer(in_f, out_f=r, members=S, rank=r, scaling=1.0, flipout=False)
    torch.manual_seed(1)
    with torch.no_grad():
        lay.base_layer.weight.zero_()
        lay.base_layer.bias.zero_()
        lay.blob_B.copy_(torch.eye(r))          # the layer's output is A x
        lay.blob_A_g.uniform_(0.3, 0.7)          # σ ∈ [0.09, 0.49]
    lay.eval()
    x = torch.randn(1, in_f)
    with torch.no_grad():
        ax = lay(x.repeat(S, 1)).double()                                     # (S, r)
    mu, sigma = lay.blob_A_mu.detach()[0].double(), lay.sigma().detach()[0].double()
    mean, var = (x.double() @ mu.T)[0], (sigma ** 2 @ (x.double()[0] ** 2))  # (r,)
    assert (ax.std(0) > 0.05).all()  # the samples really differ
    se = var.sqrt() / math.sqrt(S)
    assert ((ax.mean(0) - mean).abs() < 4 * se).all(), (ax.mean(0), mean, se)
    assert ((ax.var(0) / var - 1).abs() < 0.1).all(), (ax.var(0), var)


def test_flipout_keeps_the_marginal_and_decorrelates_examples():
    S, in_f, r = 4000, 5, 2
    lay = layer(in_f, out_f=r, members=S, rank=r, scaling=1.0, flipout=True)
    torch.manual_seed(2)
    with torch.no_grad():
        lay.base_layer.weight.zero_()
        lay.base_layer.bias.zero_()
        lay.blob_B.copy_(torch.eye(r))
        lay.blob_A_g.fill_(0.5)                  # σ = 0.25
    lay.train()
    x = torch.randn(1, in_f).repeat(2, 1)        # one input, twice per block
    with torch.no_grad():
        ax = lay(x.repeat(S, 1)).double().view(S, 2, r)
    mu = lay.blob_A_mu.detach()[0].double()
    mean = (x[:1].double() @ mu.T)[0]
    var = 0.25 ** 2 * (x[0].double() ** 2).sum()
    assert ((ax[:, 0].mean(0) - mean).abs() < 4 * (var / S).sqrt()).all()
    assert ((ax[:, 0].var(0) / var - 1).abs() < 0.1).all()
    corr = [np.corrcoef(ax[:, 0, k], ax[:, 1, k])[0, 1] for k in range(r)]
    assert max(abs(c) for c in corr) < 0.1       # the two examples: uncorrelated draws
    lay.flipout = False                          # one A per block: both examples equal
    with torch.no_grad():
        same = lay(x.repeat(S, 1)).view(S, 2, r)
    torch.testing.assert_close(same[:, 0], same[:, 1])


# --- 5. one training step ----------------------------------------------------------------------

def test_one_training_step(cfg):
    info = DataInfo(task="classification", num_classes=3, num_train_batches=7)
    m, _ = build_method(cfg, "tiny_vit", "blob", "method.train_samples=2", info=info)
    assert m.kl_factor(0) == pytest.approx(1 / 7)
    with torch.no_grad():
        for lay in m.layers():
            lay.blob_B.normal_(0, 0.1)   # B = 0 would give μ_A and G no gradient from the CE
    m.train()
    x, y = torch.randn(6, 3, 16, 16), torch.tensor([0, 1, 2, 0, 1, 2])
    torch.manual_seed(5)
    loss = m.loss((x, y))
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    loss.backward()
    for lay in m.layers():
        for p in (lay.blob_A_mu, lay.blob_A_g, lay.blob_B):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
        assert lay.base_layer.weight.grad is None and not lay.base_layer.weight.requires_grad
    assert m.head.weight.grad is not None
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for n, p in m.named_parameters() if n in frozen)
    # a small step lowers the same loss (the same draws: the seed repeated)
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad
    torch.manual_seed(5)
    assert m.loss((x, y)).item() < loss.item()
    with torch.no_grad():
        mus = [lay.blob_A_mu.double() for lay in m.layers()]
        expected_kl = sum(kl_divergence(Normal(mu, lay.blob_A_g.double() ** 2),
                                        Normal(torch.zeros_like(mu), 0.2)).sum()
                          for mu, lay in zip(mus, m.layers(), strict=True))
        assert m.kl().item() == pytest.approx(float(expected_kl), rel=1e-10)
    assert m.member_parameters().members == 1  # one model: clipped as a whole


def test_reweighted_schedule_matches_the_reference():
    weights = [kl_factor("reweighted", 5, c) for c in range(10)]
    reference = [2 ** i / (2 ** 6 - 1) for i in (1, 2, 3, 4, 5)] * 2  # self.i = 1, 2, …
    assert weights == pytest.approx(reference, rel=1e-12)
    assert sum(weights[:5]) == pytest.approx(1 - 1 / 63)
    assert kl_factor("reweighted", 1, 0) == pytest.approx(2 / 3)
    assert kl_factor("reweighted", 3000, 2999) == pytest.approx(0.5)  # no overflow
    assert kl_factor("reweighted", 3000, 0) == 0.0
    assert kl_factor("constant", 7, 123) == pytest.approx(1 / 7)


# --- 6. the CLI end to end ---------------------------------------------------------------------

def test_cli_runs_blob_end_to_end(tmp_path):
    run_cli("-m", "backbone=tiny_vit", "dataset=fake_images", "method=blob",
            f"paths.runs_dir={tmp_path}", *FAST)
    run_dir = tmp_path / "default/fake_images/blob_s10_r8/tiny_vit" / FAST_DIR / "seed0"
    res = json.loads((run_dir / "results.json").read_text())
    assert (res["method"], res["backbone"]) == ("blob", "tiny_vit")
    assert res["settings"]["method"]["members"] == 10
    assert math.isfinite(res["metrics"]["test/nll"])
    test = np.load(run_dir / "predictions/test.npz")
    assert test["member_probs"].shape == (10, 32, 4)
    assert np.isfinite(test["member_probs"]).all()
    # the draws differ (B has moved from 0 after a training epoch)
    assert np.abs(test["member_probs"] - test["member_probs"][:1]).max() > 0
    # trainable: the head and 3 tensors per wrapped layer
    assert res["params"]["trainable"] > 0 and res["params"]["added"] > 0


# --- 7. bad options ----------------------------------------------------------------------------

BAD = [("samples", 0, "method.samples"), ("train_samples", 0, "method.train_samples"),
       ("rank", 0, "method.rank"), ("rank", 2.5, "method.rank"), ("alpha", 0, "method.alpha"),
       ("prior_std", 0.0, "method.prior_std"), ("prior_std", -1.0, "method.prior_std"),
       ("init_std", 0.0, "method.init_std"), ("init_std", float("nan"), "method.init_std"),
       ("kl_weight", -0.5, "method.kl_weight"), ("kl_schedule", "cosine", "kl_schedule"),
       ("flipout", "yes", "method.flipout"), ("qkv", "both", "method.qkv")]


@pytest.mark.parametrize("key,value,field", BAD)
def test_bad_options_are_refused_before_anything_is_built(key, value, field):
    class Unbuildable:
        name, targets, attention_targets, fused_qkv = "x", ["qkv"], ["qkv"], ["qkv"]
        modality, device = "image", None

        def build(self):
            raise AssertionError("built before the options were checked")

    info = DataInfo(task="classification", num_classes=3)
    with pytest.raises(ValueError, match=field) as err:
        BLoB(Unbuildable(), info, **{key: value})  # type: ignore[arg-type]
    assert repr(value) in str(err.value) or str(value) in str(err.value)
    with pytest.raises(ValueError, match=field):
        check_options(**{key: value})


def test_bad_option_is_refused_by_the_config_check(compose_cfg):
    from uqbench.runner.spec import check_config

    cfg = compose_cfg(["backbone=tiny_vit", "dataset=fake_images", "method=blob"])
    check_config(cfg)  # the defaults pass
    with pytest.raises(ValueError, match=r"method\.prior_std .*got 0"):
        check_config(compose_cfg(["backbone=tiny_vit", "dataset=fake_images", "method=blob",
                                  "method.prior_std=0"]))
    with pytest.raises(ValueError, match="kl_schedule"):
        check_config(compose_cfg(["backbone=tiny_vit", "dataset=fake_images", "method=blob",
                                  "method.kl_schedule=cyclic"]))
