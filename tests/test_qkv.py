"""q, k and v on a ViT's fused qkv layer (SVE split/fused, LoRA's separate adapters), P1's
public-code options (clamped singular values, N(0, 0.01²) heads) and bad method settings.

References are torch's own ops on the pretrained weights (SVD values, matrix products) or an
independently built copy of the model.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from tests.helpers import build_method as build
from uqbench.contracts import DataInfo
from uqbench.methods.lora_ensemble import SplitLoRALinear
from uqbench.methods.sve_layers import SplitSVELinear, SVELinear

INFO = DataInfo(task="classification", num_classes=3)


# --- the layers -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["factorized", "materialized"])
def test_split_sve_at_sigma_zero_reproduces_the_fused_layer(mode):
    torch.manual_seed(0)
    fused = nn.Linear(16, 48)  # q, k, v of width 16 from one matrix
    layer = SplitSVELinear(copy.deepcopy(fused), members=3, sigma_init=0.0, forward_mode=mode)
    x = torch.randn(3 * 2, 5, 16)                                               # (M·B, T, in)
    torch.testing.assert_close(layer(x), fused(x), atol=1e-5, rtol=1e-5)
    # one SVD per block: the singular values of W_q, W_k, W_v, each (16 × 16)
    for j, w in enumerate(fused.weight.detach().chunk(3)):
        torch.testing.assert_close(layer.sve_s0[j], torch.linalg.svdvals(w))
    assert layer.sve_s.shape == (3, 3, 16) and layer.sve_bias.shape == (3, 48)


def test_split_sve_members_scale_their_own_q_k_v_spectra():
    torch.manual_seed(0)
    fused = nn.Linear(8, 24)
    layer = SplitSVELinear(copy.deepcopy(fused), members=2, sigma_init=0.2)
    x = torch.randn(2 * 3, 8)
    out = {}
    for mode in ("factorized", "materialized"):
        layer.forward_mode = mode
        out[mode] = layer(x)
    torch.testing.assert_close(out["factorized"], out["materialized"], atol=1e-5, rtol=1e-5)
    for k in range(2):  # by hand: W_mj = U_j diag(s_mj) V_jᵀ for j = q, k, v, stacked
        blocks = []
        for j, w in enumerate(fused.weight.detach().chunk(3)):
            U, _, Vh = torch.linalg.svd(w)
            blocks.append(U @ torch.diag(layer.sve_s[k, j]) @ Vh)
        W = torch.cat(blocks)
        torch.testing.assert_close(out["factorized"][3 * k: 3 * k + 3],
                                   x[3 * k: 3 * k + 3] @ W.T + layer.sve_bias[k],
                                   atol=1e-5, rtol=1e-5)


def test_split_lora_has_separate_q_k_v_adapters():
    torch.manual_seed(0)
    fused = nn.Linear(16, 48)
    layer = SplitLoRALinear(fused, members=2, rank=4, init_gain=10.0, scaling=1.0)
    assert layer.lora_A.shape == (2, 3, 4, 16) and layer.lora_B.shape == (2, 3, 16, 4)
    bound = 10.0 * math.sqrt(6 / (16 + 4))  # Xavier: fan_in 16, fan_out r = 4 per adapter
    assert 0.95 * bound < layer.lora_A.abs().max() <= bound
    x = torch.randn(2 * 3, 16)
    torch.testing.assert_close(layer(x), fused(x))  # B = 0: the pretrained layer
    with torch.no_grad():
        layer.lora_B.normal_()
    for k in range(2):
        xk = x[3 * k: 3 * k + 3]
        delta = torch.cat([xk @ layer.lora_A[k, j].T @ layer.lora_B[k, j].T for j in range(3)],
                          dim=-1)
        torch.testing.assert_close(layer(x)[3 * k: 3 * k + 3], fused(xk) + delta,
                                   atol=1e-4, rtol=1e-5)


# --- the methods on tiny_vit (d = 16, 2 blocks: qkv 16→48, proj, fc1 16→32, fc2) ----------

@pytest.mark.parametrize("method,overrides", [
    ("sve_split", ["method.sigma_init=0", "method.members=3"]),
    ("sve", ["method.sigma_init=0", "method.qkv=split", "method.forward_mode=materialized"]),
    ("lora_ensemble", ["method.qkv=split"]), ("lora_ensemble", ["method.qkv=fused"])])
def test_split_methods_start_as_the_pretrained_vit(cfg, method, overrides):
    m, ref = build(cfg, "tiny_vit", method, *overrides, reference=True)
    m.eval()
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        expected = ref(x)
        feats = m.features(x).view(m.members, *expected.shape)
    for k in range(m.members):
        torch.testing.assert_close(feats[k], expected, atol=1e-5, rtol=1e-5)


def test_parameter_counts_on_tiny_vit_by_hand(cfg):
    """Per block and member, d = 16 (mlp_ratio 2: fc1 16 → 32). SVE split: q, k, v 3·16
    singular values + proj 16 + fc1 16 + fc2 16 = 96 = 6d; biases 48 + 16 + 32 + 16 = 112.
    Fused: 16 + 16 + 16 + 16 = 64 = 4d, same biases. LoRA r = 8: split 3·8·(16 + 16) + proj
    8·32 = 1024; fused 8·(16 + 48) + 256 = 768."""
    M, L = 4, 2
    added = {}
    for method, over in [("sve", "split"), ("sve", "fused"), ("lora_ensemble", "split"),
                         ("lora_ensemble", "fused")]:
        m, _ = build(cfg, "tiny_vit", method, f"method.qkv={over}")
        added[method, over] = m.param_counts()["added"]
    assert added["sve", "split"] == M * L * (96 + 112)
    assert added["sve", "fused"] == M * L * (64 + 112)
    assert added["lora_ensemble", "split"] == M * L * 1024
    assert added["lora_ensemble", "fused"] == M * L * 768


@pytest.mark.parametrize("method", ["sve", "lora_ensemble"])
def test_qkv_is_a_no_op_without_a_fused_layer(cfg, method):
    """BERT's q, k, v are separate layers: split and fused build the same model."""
    x = {"input_ids": torch.tensor([[101, 1037, 2204, 102]]),
         "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    out = {}
    for form in ("split", "fused"):
        m, _ = build(cfg, "tiny_bert", method, f"method.qkv={form}")
        assert m.settings()["split_qkv_layers"] == 0 and m.settings()["qkv"] == form
        with torch.no_grad():
            out[form] = m.eval()(x)
    assert torch.equal(out["split"], out["fused"])


# --- P1's public-code options ----------------------------------------------------------------

def test_clamped_singular_values_never_act_negative():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    layer = SVELinear(base, members=2, sigma_init=0.0, clamp=True)
    with torch.no_grad():
        layer.sve_s[1, :2] = -1.0  # member 1's two largest singular values pushed negative
    x = torch.randn(2 * 3, 6)
    U, s, Vh = torch.linalg.svd(base.weight.detach(), full_matrices=False)
    s1 = s.clone()
    s1[:2] = 0.0
    W1 = U @ torch.diag(s1) @ Vh
    for mode in ("factorized", "materialized"):
        layer.forward_mode = mode
        torch.testing.assert_close(layer(x)[3:], x[3:] @ W1.T + base.bias, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer(x)[:3], base(x[:3]), atol=1e-5, rtol=1e-5)


def test_p1_head_init_and_the_default(cfg):
    m, _ = build(cfg, "tiny_vit", "sve", "method.head_init=p1", "method.members=8")
    W, b = m.head.weight.detach(), m.head.bias.detach()                          # (8, 3, 16)
    assert 0.008 < W.std().item() < 0.012 and torch.equal(b, torch.zeros_like(b))
    assert m.settings()["head_init"] == "p1"
    m, _ = build(cfg, "tiny_vit", "sve", "method.members=8")
    bound = 1 / math.sqrt(16)  # nn.Linear: U(±1/√D) weights and bias
    assert m.head.weight.abs().max() <= bound and m.head.bias.abs().max() <= bound
    assert m.head.weight.std() > 0.1


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("backbone,method,override,match", [
    ("tiny_vit", "sve", "method.qkv=separate", r"method.qkv 'separate' .*\('split', 'fused'\)"),
    ("tiny_vit", "lora_ensemble", "method.qkv=both", r"method.qkv 'both' .*'split', 'fused'"),
    ("tiny_vit", "sve", "method.head_init=xavier",
     r"method.head_init 'xavier' .*\('default', 'p1'\)"),
    ("tiny_vit", "deep_ensemble", "method.sigma_init=-0.5", r"sigma_init must be >= 0.*-0.5"),
    ("mlp", "sve", "method.members=2", r"backbone 'mlp_w16' declares none.*tiny_vit"),
    ("mlp", "lora_ensemble", "method.qkv=split", r"backbone 'mlp_w16' declares none"),
])
def test_impossible_settings_fail_before_any_training(cfg, backbone, method, override, match):
    with pytest.raises(ValueError, match=match):
        build(cfg, backbone, method, override)


def test_split_needs_q_k_v_of_equal_width(cfg):
    """A layer declared fused whose outputs are not three equal blocks: named, with the fix."""
    for method in ("sve", "lora_ensemble"):
        c = cfg("backbone=tiny_vit", f"method={method}", "method.qkv=split",
                "method.targets=[fc1]")
        bb = instantiate(c.backbone)
        bb.fused_qkv = ["fc1"]  # fc1: 16 → 32 outputs, not a multiple of 3
        with pytest.raises(ValueError, match=r"blocks.0.mlp.fc1' has 32 outputs.*qkv=fused"):
            instantiate(c.method)(backbone=bb, info=INFO)
