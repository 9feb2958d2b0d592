"""MC-Dropout's fast masks (``FastDropout``) and the shared prefix of its T passes.

Expected values come from hand computations (the quantised rates, x·mask/(1 − p)), from
``nn.Dropout`` itself (the plain path, its mask read off its output) and from binomial
Monte-Carlo bounds (5 standard deviations).
"""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from uqbench.contracts import DataInfo
from uqbench.methods.dropout import FastDropout, keep_mask, quantised_rate, repeat_at_first_dropout
from uqbench.methods.member_layers import repeat_members, split_members

pytestmark = pytest.mark.usefixtures("one_thread")


def mc_dropout(cfg, *overrides: str, seed: int = 0):
    c = cfg("backbone=tiny_vit", "method=mc_dropout", "method.samples=4", *overrides)
    torch.manual_seed(seed)
    return instantiate(c.method)(backbone=instantiate(c.backbone),
                                 info=DataInfo(task="classification", num_classes=3))


# --- the module ---------------------------------------------------------------------------------

def test_quantised_rates_by_hand():
    # k = round((1 − p)·65536): 0.9·65536 = 58982.4 → 58982, 0.7·65536 = 45875.2 → 45875
    assert quantised_rate(0.1) == 1 - 58982 / 65536 == 6554 / 65536
    assert quantised_rate(0.3) == 1 - 45875 / 65536
    assert quantised_rate(0.25) == 0.25 and quantised_rate(0.0) == 0.0
    assert quantised_rate(1e-6) == 0.0  # below 1/131072: rounds to no dropout


def test_given_the_same_mask_fast_and_plain_dropout_agree_in_output_and_gradient():
    """The plain path's mask is read off nn.Dropout's output (x has no zeros) and injected
    into FastDropout; p = 0.25 is exact in 16 bits, so both scale by 4/3."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, 7).abs_().add_(0.5)
    w = torch.randn(6, 5, 7)                                   # a loss Σ w·out
    x_plain, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_plain = nn.Dropout(0.25)(x_plain)
    mask = out_plain.detach() != 0
    assert 0 < mask.sum() < mask.numel()
    fast = FastDropout(0.25)
    fast.draw = lambda shape, device, dtype: mask.to(dtype, copy=True)
    out_fast = fast(x_fast)
    (out_plain * w).sum().backward()
    (out_fast * w).sum().backward()
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(x_fast.grad, x_plain.grad, rtol=1e-6, atol=0)
    # and against the closed form x·mask/(1 − p), gradient w·mask/(1 − p)
    torch.testing.assert_close(out_fast, x * mask / 0.75)
    torch.testing.assert_close(x_fast.grad, w * mask / 0.75)


@pytest.mark.parametrize("path", ["no_grad", "inplace", "bfloat16"])
def test_every_path_computes_x_times_mask_over_keep_rate(path):
    """Without autograd the product is written over a mask of x's dtype; ``inplace`` writes
    into x. Both equal x·mask/(1 − p) with the injected mask (p = 0.25: scale 4/3)."""
    torch.manual_seed(6)
    dtype = torch.bfloat16 if path == "bfloat16" else torch.float32
    x = torch.randn(4, 3, 5).to(dtype)
    mask = torch.rand(4, 3, 5) < 0.75
    fast = FastDropout(0.25, inplace=path == "inplace")
    fast.draw = lambda shape, device, dtype: mask.to(dtype, copy=True)
    expected = (x.double() * mask / 0.75).to(dtype)
    with torch.no_grad():
        out = fast(x.clone() if path != "inplace" else x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    if path == "inplace":
        assert out is x


def test_scaling_uses_the_quantised_keep_probability():
    x = torch.ones(3, 4)
    fast = FastDropout(0.3)
    fast.draw = lambda shape, device, dtype: torch.ones(shape, dtype=dtype)
    torch.testing.assert_close(fast(x), x * 65536 / 45875)


@pytest.mark.parametrize("p", [0.0, 0.001, 0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p_within_binomial_error(p):
    torch.manual_seed(1)
    n = 1 << 22
    kept = keep_mask(torch.Size([n]), p).double().mean().item()
    if p == 0:
        assert kept == 1.0
    bound = 5 * math.sqrt(p * (1 - p) / n) + 1 / 131072   # MC error + quantisation
    assert abs(kept - (1 - p)) <= bound


def test_zero_rate_is_the_identity_and_eval_mode_is_off():
    x = torch.randn(4, 9)
    assert FastDropout(0.0)(x) is x
    assert FastDropout(0.5).eval()(x) is x


def test_masks_are_independent_across_rows_and_neighbouring_elements():
    """Correlation of the masks of different rows, of neighbouring elements (which share a
    64-bit word) and of elements 4 apart (the next word): each ~N(0, 1/n), |r| < 5/√n."""
    torch.manual_seed(2)
    rows, n = 8, 1 << 16
    m = keep_mask(torch.Size([rows, n]), 0.3).double()
    r = torch.corrcoef(m)                                                   # (rows, rows)
    off = r[~torch.eye(rows, dtype=torch.bool)]
    assert off.abs().max() < 5 / math.sqrt(n)
    flat = m.flatten()
    for lag in (1, 2, 3, 4):
        r = torch.corrcoef(torch.stack([flat[:-lag], flat[lag:]]))[0, 1]
        assert abs(r) < 5 / math.sqrt(flat.numel())


def test_expected_output_is_the_input():
    torch.manual_seed(3)
    p, n = 0.3, 1 << 21
    x = torch.rand(n) + 0.5
    ratio = (FastDropout(p)(x) / x).double().mean().item()
    # out/x = scale·Bernoulli(1 − p): mean 1, sd √(p/(1 − p)) per element
    assert abs(ratio - 1) < 5 * math.sqrt(p / (1 - p) / n)


# --- the shared prefix --------------------------------------------------------------------------

def test_the_first_active_dropout_repeats_and_a_dropout_is_never_shared():
    """Linear → dropout p=0 (inactive) → Linear → FastDropout → Linear: the rows each layer
    sees are B up to the active dropout, T·B after; the T copies draw their own masks."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(3, 64), nn.Dropout(0.0), nn.Linear(64, 64),
                        FastDropout(0.5), nn.Linear(64, 2))
    rows: dict[int, int] = {}

    def count(i):
        def hook(mod, args, out):
            rows[i] = args[0].shape[0]
        return hook

    for i in (0, 2, 4):
        net[i].register_forward_hook(count(i))
    x = torch.randn(5, 3)
    with repeat_at_first_dropout(net, 4) as shared, torch.no_grad():
        out = net(x)
    assert shared["repeated"] and out.shape == (20, 2)
    assert rows == {0: 5, 2: 5, 4: 20}
    copies = out.view(4, 5, 2)
    assert not torch.equal(copies[0], copies[1])
    assert not net[3]._forward_pre_hooks  # the hooks are gone after the block


def test_shared_prefix_forward_equals_the_unshared_one(cfg):
    m = mc_dropout(cfg).eval()
    x = torch.randn(3, 3, 16, 16)
    rows = []
    m.encoder.patch_embed.register_forward_hook(lambda mod, a, o: rows.append(a[0].shape[0]))
    with torch.no_grad():
        torch.manual_seed(5)
        shared = m(x)
        torch.manual_seed(5)  # the same draws: every dropout sees T·B rows on both paths
        unshared = m.head(split_members(m.mc_dropout(m.encoder(repeat_members(x, 4))), 4))
    assert rows == [3, 12]  # the patch embedding ran once on B rows, then on T·B
    assert shared.shape == (4, 3, 3)
    torch.testing.assert_close(shared, unshared)
    assert not torch.allclose(shared[0], shared[1])  # the T copies drew their own masks


def test_no_active_dropout_shares_the_whole_encoder(cfg):
    fast, plain = mc_dropout(cfg, "method.p=0"), mc_dropout(cfg, "method.p=0",
                                                            "method.masks=torch")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        a, b = fast.eval()(x), plain.eval()(x)
    assert a.shape == (4, 2, 3)
    torch.testing.assert_close(a, b)                 # same weights, nothing dropped
    torch.testing.assert_close(a, a[:1].expand_as(a))


# --- the method end to end ----------------------------------------------------------------------

def test_tiny_vit_end_to_end(cfg):
    m = mc_dropout(cfg)
    fast = [n for n, mod in m.named_modules() if isinstance(mod, FastDropout)]
    plain = [n for n, mod in m.named_modules() if type(mod) is nn.Dropout]
    # pos_drop + 2 blocks × (attn.proj_drop, mlp.drop1, mlp.drop2) + ours; attn_drop stays
    assert len(fast) == 8 and all(n.endswith("attn.attn_drop") for n in plain)
    assert len(plain) == 2
    assert m.settings()["masks"] == "fast" and m.settings()["p_applied"] == 6554 / 65536
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    m.train()
    assert m(x).shape == (1, 4, 3)
    m.loss((x, y)).backward()
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    with torch.no_grad():
        logits = m.eval()(x)
    assert logits.shape == (4, 4, 3) and torch.isfinite(logits).all()
    assert all(isinstance(mod, FastDropout) == (n in fast) for n, mod in m.named_modules())


def test_torch_masks_keep_nn_dropout_and_a_bad_choice_names_the_options(cfg):
    m = mc_dropout(cfg, "method.masks=torch")
    assert not any(isinstance(mod, FastDropout) for mod in m.modules())
    assert m.settings()["p_applied"] == 0.1
    with pytest.raises(ValueError, match=r"method.masks must be one of fast, torch, got 'bits'"):
        mc_dropout(cfg, "method.masks=bits")
