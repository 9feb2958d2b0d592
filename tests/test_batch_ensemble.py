"""BatchEnsemble: its layer against torch-uncertainty's ``BatchLinear``, the identity at r = s = 1,
members that differ and train, what trains under ``train_shared`` (counted by hand) and bad
options.

References are torch-uncertainty's layer, the unwrapped ``nn.Linear`` or an independently built
copy of the encoder, never the method's own code path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torch_uncertainty.layers import BatchLinear

from tests.helpers import build_method as build
from tests.helpers import inputs_for, tiny_text_batch
from uqbench.contracts import DataInfo
from uqbench.methods.batch_ensemble import (
    BatchEnsemble,
    BatchEnsembleLinear,
    SplitBatchEnsembleLinear,
)

pytestmark = pytest.mark.usefixtures("one_thread")
INFO = DataInfo(task="classification", num_classes=3)
INITS = ("random_sign", "normal")


@pytest.fixture(scope="module")
def text_batch():
    return tiny_text_batch()


def torch_uncertainty_copy(layer: BatchEnsembleLinear, W: torch.Tensor, r: torch.Tensor,
                           s: torch.Tensor, b: torch.Tensor) -> BatchLinear:
    """A torch-uncertainty BatchLinear holding W (out, in), r (M, in), s (M, out), b (M, out)."""
    tu = BatchLinear(W.shape[1], W.shape[0], num_estimators=layer.members)
    with torch.no_grad():
        tu.linear.weight.copy_(W)
        tu.r_group.copy_(r)
        tu.s_group.copy_(s)
        tu.bias.copy_(b)
    return tu


# --- the layer --------------------------------------------------------------------------------

@pytest.mark.parametrize("init", INITS)
def test_layer_equals_torch_uncertaintys_batch_linear(init):
    torch.manual_seed(0)
    linear = nn.Linear(7, 5)
    layer = BatchEnsembleLinear(copy.deepcopy(linear), members=3, init=init)
    tu = torch_uncertainty_copy(layer, linear.weight, layer.be_r, layer.be_s, layer.be_bias)
    x = torch.randn(3 * 4, 7)                                 # (M·B, in), member-major as theirs
    with torch.no_grad():
        torch.testing.assert_close(layer(x), tu(x), atol=1e-6, rtol=0)
    # tokens: (M·B, T, in), member m's rows are its B sequences; theirs sees one row per call
    xt = torch.randn(3 * 2, 4, 7)
    with torch.no_grad():
        ours = layer(xt)
        for m in range(3):
            rows = xt[2 * m: 2 * m + 2].reshape(-1, 7)                          # (B·T, in)
            theirs = tu(rows.repeat(3, 1))[m * 8: (m + 1) * 8].reshape(2, 4, 5)
            torch.testing.assert_close(ours[2 * m: 2 * m + 2], theirs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("init", INITS)
def test_split_layer_is_three_batch_linears_one_per_q_k_v(init):
    torch.manual_seed(0)
    fused = nn.Linear(8, 3 * 6)
    layer = SplitBatchEnsembleLinear(copy.deepcopy(fused), members=2, init=init)
    assert layer.be_r.shape == (2, 3, 8) and layer.be_s.shape == (2, 18)
    x = torch.randn(2 * 5, 8)
    blocks = []
    for j in range(3):
        out = slice(6 * j, 6 * (j + 1))
        tu = torch_uncertainty_copy(layer, fused.weight[out], layer.be_r[:, j],
                                    layer.be_s[:, out], layer.be_bias[:, out])
        blocks.append(tu(x))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.cat(blocks, dim=-1), atol=1e-6, rtol=0)
        # one input-side vector for q, k and v: the fused form's numbers
        plain = BatchEnsembleLinear(copy.deepcopy(fused), members=2, init=init)
        plain.be_r.copy_(layer.be_r[:, 0])
        plain.be_s.copy_(layer.be_s)
        layer.be_r.copy_(layer.be_r[:, :1].expand(-1, 3, -1))
        torch.testing.assert_close(layer(x), plain(x), atol=1e-6, rtol=0)


def test_inits_draw_signs_or_torch_uncertaintys_normal():
    torch.manual_seed(0)
    sign = BatchEnsembleLinear(nn.Linear(500, 300), members=8, init="random_sign")
    for t in (sign.be_r, sign.be_s):
        assert set(t.unique().tolist()) == {-1.0, 1.0}
        assert abs((t > 0).float().mean().item() - 0.5) < 0.03  # ±1 with probability ½
    normal = BatchEnsembleLinear(nn.Linear(500, 300), members=8, init="normal", init_std=0.2)
    tu = BatchLinear(500, 300, num_estimators=8)  # torch-uncertainty's own draw: N(1, 0.5²)
    default = BatchEnsembleLinear(nn.Linear(500, 300), members=8, init="normal")
    for t, std in ((normal.be_r, 0.2), (normal.be_s, 0.2), (default.be_r, 0.5),
                   (tu.r_group, 0.5), (tu.s_group, 0.5)):
        assert abs(t.mean().item() - 1) < 0.02 and abs(t.std().item() - std) < 0.02
    assert normal.be_r.dtype == normal.be_s.dtype == torch.float32


@pytest.mark.parametrize("kind", [BatchEnsembleLinear, SplitBatchEnsembleLinear])
def test_with_r_and_s_one_every_member_is_the_wrapped_layer(kind):
    torch.manual_seed(0)
    linear = nn.Linear(8, 12)
    layer = kind(copy.deepcopy(linear), members=3)
    assert layer.base_layer.bias is None and layer.released == 12  # b_m replaces b
    for m in range(3):  # every member's bias starts as the wrapped layer's
        assert torch.equal(layer.be_bias[m], linear.bias)
    with torch.no_grad():
        layer.be_r.fill_(1.0)
        layer.be_s.fill_(1.0)
        x = torch.randn(3 * 2, 4, 8)                                             # (M·B, T, in)
        torch.testing.assert_close(layer(x), linear(x), atol=1e-6, rtol=1e-6)


def test_bias_free_layer_has_no_member_bias():
    layer = BatchEnsembleLinear(nn.Linear(8, 4, bias=False), members=2)
    assert layer.be_bias is None and layer.released == 0
    assert [p.shape for p in layer.adapters()] == [(2, 8), (2, 4)]
    assert layer(torch.randn(2 * 3, 8)).shape == (6, 4)


# --- the method on tiny backbones -------------------------------------------------------------

def set_fast_weights_to_one(m: BatchEnsemble) -> None:
    with torch.no_grad():
        for layer in m.layers():
            layer.be_r.fill_(1.0)
            layer.be_s.fill_(1.0)


@pytest.mark.parametrize("backbone", ["tiny_vit", "tiny_bert", "tiny_llama"])
def test_with_r_and_s_one_members_reproduce_the_pretrained_model(cfg, text_batch, backbone):
    m, ref = build(cfg, backbone, "batch_ensemble", reference=True)
    set_fast_weights_to_one(m)
    for layer in m.layers():  # the member biases start equal (the wrapped layer's bias)
        if layer.be_bias is not None:
            assert (layer.be_bias == layer.be_bias[:1]).all()
    m.eval()
    x = inputs_for(backbone, text_batch)
    with torch.no_grad():
        expected = ref(x)                                                        # (B, D)
        feats = m.features(x).view(m.members, *expected.shape)                  # (M, B, D)
        logits = m(x)                                                            # (M, B, C)
        for k in range(m.members):  # member k = the single model with head k
            torch.testing.assert_close(feats[k], expected, atol=1e-5, rtol=1e-5)
            head = expected @ m.head.weight[k].T + m.head.bias[k]
            torch.testing.assert_close(logits[k], head, atol=1e-5, rtol=1e-5)
        m.head.weight.copy_(m.head.weight[:1].expand_as(m.head.weight))
        m.head.bias.copy_(m.head.bias[:1].expand_as(m.head.bias))
        same = m(x)
    for k in range(1, m.members):  # equal heads too: identical members
        torch.testing.assert_close(same[k], same[0], atol=1e-6, rtol=1e-6)


def test_random_signs_make_members_differ_and_every_member_trains(cfg):
    m, _ = build(cfg, "tiny_vit", "batch_ensemble")
    m.eval()  # no dropout: the members differ through r and s alone
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():  # equal heads, so that only r and s tell the members apart
        m.head.weight.copy_(m.head.weight[:1].expand_as(m.head.weight))
        m.head.bias.copy_(m.head.bias[:1].expand_as(m.head.bias))
        logits = m(x)
    for a in range(m.members):
        for b in range(a + 1, m.members):
            assert not torch.allclose(logits[a], logits[b], atol=1e-4), (a, b)
    layers = m.layers()
    before = [(layer.be_r.detach().clone(), layer.be_s.detach().clone()) for layer in layers]
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m.train()
    m.loss((x, y)).backward()
    for layer in layers:
        for k in range(m.members):  # member k's own loss reaches its r and s in every layer
            assert layer.be_r.grad[k].abs().sum() > 0 and layer.be_s.grad[k].abs().sum() > 0
    opt.step()
    for layer, (r, s) in zip(layers, before, strict=True):
        for k in range(m.members):
            assert not torch.equal(layer.be_r[k], r[k]) and not torch.equal(layer.be_s[k], s[k])


def test_member_m_logits_come_from_member_m_parameters(cfg):
    m, _ = build(cfg, "tiny_vit", "batch_ensemble")
    m.eval()
    x = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        before = m(x)
        for layer in m.layers():
            layer.be_s[2].mul_(1.5)
            layer.be_r[2].add_(0.3)
        after = m(x)
    assert [not torch.allclose(before[k], after[k]) for k in range(4)] == [False, False, True,
                                                                          False]


# --- what trains, counted by hand -------------------------------------------------------------

# tiny_vit (conf/backbone/tiny_vit.yaml): width d = 16, 2 blocks, each with qkv (16 → 48),
# proj (16 → 16), fc1 (16 → 32), fc2 (32 → 16), all with a bias; M = 4, 3 classes.
# A wrapped layer adds M·(in + out + out) (r, s, b) trained values; a split qkv layer has three r,
# M·(3·in + out + out). Per member and block, targets all:
#   fused: r 16 + 16 + 16 + 32 = 80, s 48 + 16 + 32 + 16 = 112, b 112 → 304
#   split: r 3·16 + 16 + 16 + 32 = 112, s 112, b 112               → 336
#   attention only (split qkv, proj): r 48 + 16, s 48 + 16, b 48 + 16 → 192
# Heads: M·C·(D + 1) = 4·3·17 = 204.
# The encoder: cls 16 + pos 17·16 = 272 + patch conv 3·4·4·16 + 16 = 784, per block norms
# 4·16 = 64, weights 768 + 256 + 512 + 512 = 2048, biases 48 + 16 + 32 + 16 = 112, final norm
# 32: 16 + 272 + 784 + 2·(64 + 2048 + 112) + 32 = 5552. The wrapped layers' biases (2·112 = 224
# with targets all, 2·(48 + 16) = 128 with attention) are dropped: b_m replaces them.
# train_shared=true also trains everything else of the encoder once (shared by the members),
# each W counted once, not M times: 5552 − 224 = 5328 (attention: 5552 − 128 = 5424).
TINY_VIT_BASE = 5552
TRAINABLE = {
    (("method.qkv=fused",), False): 4 * 2 * 304 + 204,                           # 2636
    ((), False): 4 * 2 * 336 + 204,                                              # 2892
    (("method.targets=attention",), False): 4 * 2 * 192 + 204,                   # 1740
    ((), True): (TINY_VIT_BASE - 224) + 4 * 2 * 336 + 204,                       # 8220
    (("method.targets=attention",), True): (TINY_VIT_BASE - 128) + 4 * 2 * 192 + 204,  # 7164
}


@pytest.mark.parametrize("overrides,train_shared", list(TRAINABLE))
def test_trainable_parameters_follow_train_shared_and_the_hand_counts(cfg, overrides,
                                                                      train_shared):
    m, _ = build(cfg, "tiny_vit", "batch_ensemble", *overrides,
                 f"method.train_shared={str(train_shared).lower()}")
    assert m.base_params == TINY_VIT_BASE
    trained = {id(p) for p in m.trainable_parameters().values()}
    for layer in m.layers():
        W = layer.base_layer.weight
        assert W.requires_grad == train_shared and (id(W) in trained) == train_shared
        assert all(p.requires_grad and id(p) in trained for p in layer.adapters())
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert bool(frozen) != train_shared  # all of the encoder trains, or only r, s, b, heads
    counts = m.param_counts()
    assert counts["trainable"] == TRAINABLE[(overrides, train_shared)]
    wrappers = TRAINABLE[(overrides, False)] - 204  # the wrapped layers' r, s and b
    assert m.released_params == (128 if overrides == ("method.targets=attention",) else 224)
    assert counts["added"] == wrappers and counts["heads"] == 204
    assert counts["total"] == TINY_VIT_BASE - m.released_params + wrappers + 204
    # per-member clipping: r, s, b and the heads are stacked; a shared W is in no member's group
    groups = m.member_parameters()
    stacked, shared = {id(p) for p in groups.stacked}, {id(p) for p in groups.shared}
    assert not stacked & shared and stacked | shared == trained
    assert all((id(layer.base_layer.weight) in shared) == train_shared for layer in m.layers())


def test_shared_weights_get_one_gradient_from_all_members(cfg):
    m, _ = build(cfg, "tiny_vit", "batch_ensemble", "method.train_shared=true")
    W = m.encoder.get_submodule("blocks.0.mlp.fc1").base_layer.weight
    m.train()
    m.loss((torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0]))).backward()
    assert W.grad is not None and W.grad.shape == W.shape and W.grad.abs().sum() > 0
    assert m.training_passes() == 4


def test_settings_record_the_options(cfg):
    m, _ = build(cfg, "tiny_vit", "batch_ensemble")
    assert m.settings() | {"head_from_lm": None} == {
        "members": 4, "head_from_lm": None, "init": "random_sign", "init_std": 0.5,
        "targets": "qkv,proj,fc1,fc2", "replaced_layers": 8, "qkv": "split",
        "split_qkv_layers": 2, "train_shared": False}
    assert cfg("method=batch_ensemble").method.name == "be_m4"


# --- bad options ------------------------------------------------------------------------------

@pytest.mark.parametrize("option,value,match", [
    ("init", "uniform", "method.init='uniform' is not one of: random_sign, normal"),
    ("members", 0, "method.members must be a positive integer.*got 0"),
    ("init_std", 0.0, "method.init_std must be a number > 0.*got 0.0"),
    ("init_std", -0.5, "got -0.5"),
    ("qkv", "both", "method.qkv 'both' is not one of \\('split', 'fused'\\)"),
    ("train_shared", "yes", "method.train_shared must be true or false, got 'yes'"),
])
def test_bad_options_fail_before_anything_is_built(cfg, option, value, match):
    backbone = instantiate(cfg("backbone=tiny_vit").backbone)
    backbone.build = lambda: pytest.fail("the backbone was built before the options were checked")
    with pytest.raises(ValueError, match=match):
        BatchEnsemble(backbone, INFO, **{option: value})


def test_bad_options_from_the_command_line_name_the_value(cfg):
    with pytest.raises(ValueError, match="'uniform'"):
        build(cfg, "tiny_vit", "batch_ensemble", "method.init=uniform")
    with pytest.raises(ValueError, match="-1"):
        build(cfg, "tiny_vit", "batch_ensemble", "method.init_std=-1")
