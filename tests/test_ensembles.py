"""The ensemble methods on tiny timm ViT, BERT and LLaMA models built from config.

Reference outputs come from an independent copy of the unwrapped model (the method's encoder
is a deep copy of it), never from the method's own code path.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from tests.helpers import build_method as build
from tests.helpers import inputs_for, tiny_text_batch
from uqbench.backbones.hf import bundled_tokenizer_path, last_token_index
from uqbench.contracts import DataInfo
from uqbench.methods.lora_ensemble import LoRALinear
from uqbench.methods.member_layers import repeat_members, replace_linears
from uqbench.methods.sve_layers import SVELinear

BACKBONES = ("tiny_vit", "tiny_bert", "tiny_llama")
METHODS = ("sve", "svf", "lora_ensemble", "deep_ensemble", "deep_ensemble_lp", "mc_dropout",
           "single")
# Which parameters each method trains (name prefixes); everything else must stay frozen.
TRAINS = {"sve": ("encoder.", "head."), "svf": ("encoder.", "head."),
          "lora_ensemble": ("encoder.", "head."), "deep_ensemble": ("de_encoders.", "head."),
          "deep_ensemble_lp": ("head.",), "mc_dropout": ("encoder.", "head."),
          "single": ("encoder.", "head.")}
# The adapter parameters inside the encoder (SVE's frozen factors sve_U, sve_V, sve_s0 are
# parameters too, but never train).
OWN = {"sve": ("sve_s", "sve_bias"), "svf": ("sve_s", "sve_bias"),
       "lora_ensemble": ("lora_A", "lora_B")}
pytestmark = pytest.mark.usefixtures("one_thread")
INFO = DataInfo(task="classification", num_classes=3)


@pytest.fixture(scope="module")
def text_batch():
    return tiny_text_batch()


# --- initialisation ---------------------------------------------------------------------------

@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method,override", [("sve", "method.sigma_init=0"),
                                             ("lora_ensemble", "method.members=4"),
                                             ("deep_ensemble", "method.members=3")])
def test_members_at_init_reproduce_the_pretrained_model(cfg, text_batch, backbone, method,
                                                        override):
    m, ref = build(cfg, backbone, method, override, reference=True)
    m.eval()
    x = inputs_for(backbone, text_batch)
    with torch.no_grad():
        expected = ref(x)                                                        # (B, D)
        feats = m.features(x).view(m.members, *expected.shape)                  # (M, B, D)
        logits = m(x)
    for k in range(m.members):
        torch.testing.assert_close(feats[k], expected, atol=1e-5, rtol=1e-5)
        head = expected @ m.head.weight[k].T + m.head.bias[k]
        torch.testing.assert_close(logits[k], head, atol=1e-5, rtol=1e-5)


def test_sve_sigma_init_makes_members_differ(cfg):
    m, _ = build(cfg, "tiny_vit", "sve", "method.sigma_init=0.1")
    layer = m.layers()[0]
    s = layer.sve_s.detach()
    assert not torch.allclose(s[0], s[1])
    rel = (s / layer.sve_s0 - 1).std().item()
    assert 0.05 < rel < 0.2  # ε ~ N(0, 0.1²)


def test_sve_forward_modes_agree_and_reconstruct_w():
    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    layer = SVELinear(base, members=3, sigma_init=0.2)
    U, s0, V = layer.sve_U, layer.sve_s0, layer.sve_V
    torch.testing.assert_close(U @ torch.diag(s0) @ V.T, base.weight.detach(), atol=1e-5,
                               rtol=1e-5)
    x = torch.randn(3 * 2, 7, 24)  # (M·B, T, in)
    out = {}
    for mode in ("factorized", "materialized", "auto"):
        layer.forward_mode = mode
        out[mode] = layer(x)
    torch.testing.assert_close(out["factorized"], out["materialized"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["auto"], out["factorized"], atol=1e-5, rtol=1e-5)
    # Member m's rows by hand: x W_mᵀ + b_m with W_m = W + U diag(s_m − s) Vᵀ.
    for k in range(3):
        W = base.weight + U @ torch.diag(layer.sve_s[k] - s0) @ V.T
        torch.testing.assert_close(out["factorized"][2 * k: 2 * k + 2],
                                   x[2 * k: 2 * k + 2] @ W.T + layer.sve_bias[k],
                                   atol=1e-5, rtol=1e-5)
    # FLOPs per member (r = 24, in = 24, out = 40): factorised N·24·64, materialised
    # 40·24·24 + N·24·40 → the factorised form is cheaper up to N = 40 rows.
    assert layer.flops(40) == {"factorized": 61440, "materialized": 61440}
    assert layer.flops(41)["factorized"] > layer.flops(41)["materialized"]


def test_lora_init_is_xavier_with_gain_and_b_zero():
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(64, 32), members=4, rank=8, init_gain=10.0, scaling=1.0)
    bound = 10.0 * (6 / (64 + 8)) ** 0.5
    A = layer.lora_A.detach()
    assert A.abs().max() <= bound and A.abs().max() > 0.95 * bound
    assert (layer.lora_B == 0).all()
    assert not torch.allclose(A[0], A[1])


# --- training: what moves, what stays ---------------------------------------------------------

@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", METHODS)
def test_one_step_trains_only_the_methods_parameters(cfg, text_batch, backbone, method):
    overrides = ["method=deep_ensemble_lp"] if method == "deep_ensemble_lp" else []
    m, _ = build(cfg, backbone, method, *overrides)
    named = dict(m.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    expected = {n for n in named if n.startswith(TRAINS[method])
                and (method not in OWN or n.startswith("head.")
                     or n.rpartition(".")[2] in OWN[method])}
    assert trainable == expected
    before = {n: p.detach().clone() for n, p in named.items()}
    m.train()
    opt = torch.optim.SGD([named[n] for n in trainable], lr=0.5)
    x, y = inputs_for(backbone, text_batch), torch.tensor([0, 1, 2, 0, 1])
    m.loss((x, y)).backward()
    for n, p in named.items():
        assert (p.grad is not None) == (n in trainable), n
    opt.step()
    moved = {n for n, p in named.items() if not torch.equal(p.detach(), before[n])}
    assert moved <= trainable
    # (a key bias has a zero gradient in exact arithmetic: softmax ignores a per-query shift)
    assert {n for n in trainable if named[n].grad.abs().max() > 1e-6} <= moved
    assert any(n.startswith("head.") for n in moved)
    assert moved - {"head.weight", "head.bias"} or method == "deep_ensemble_lp"


# Full fine-tuning methods train these encoders whole (besides the head).
FINE_TUNED = {"deep_ensemble": "de_encoders.", "mc_dropout": "encoder.", "single": "encoder."}


def declared(m, method: str) -> set[str]:
    """What the method must train, read from the declarations: every wrapper's adapter_names
    (entries that are None, e.g. a bias-free layer's bias, do not exist), the head, and the
    whole encoder of the full fine-tuning methods."""
    names = {f"{mod_name}.{attr}" for mod_name, mod in m.named_modules()
             for attr in getattr(mod, "adapter_names", ()) if getattr(mod, attr) is not None}
    prefixes = ("head.", FINE_TUNED[method]) if method in FINE_TUNED else ("head.",)
    return names | {n for n, _ in m.named_parameters() if n.startswith(prefixes)}


# Declared adapter parameters: wrapped layers (as in test_replacement_counts) × 2 parameters
# each, except SVE on the bias-free LLaMA layers (sve_s only).
ADAPTER_PARAMS = ("sve_s", "sve_bias", "lora_A", "lora_B")
ADAPTERS = {("tiny_vit", "sve"): 8 * 2, ("tiny_bert", "sve"): 12 * 2, ("tiny_llama", "sve"): 14,
            ("tiny_vit", "lora_ensemble"): 4 * 2, ("tiny_bert", "lora_ensemble"): 8 * 2,
            ("tiny_llama", "lora_ensemble"): 8 * 2}


def test_wrappers_declare_their_trainable_parameters():
    assert SVELinear.adapter_names == ("sve_s", "sve_bias")
    assert LoRALinear.adapter_names == ("lora_A", "lora_B")


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", METHODS)
def test_declared_parameters_and_only_they_get_gradients(cfg, text_batch, backbone, method):
    overrides = ["method=deep_ensemble_lp"] if method == "deep_ensemble_lp" else []
    m, _ = build(cfg, backbone, method, *overrides)
    expected = declared(m, method)
    adapters = {n for n in expected if n.rpartition(".")[2] in ADAPTER_PARAMS}
    assert len(adapters) == ADAPTERS.get((backbone, method.replace("svf", "sve")), 0)
    m.train()
    x, y = inputs_for(backbone, text_batch), torch.tensor([0, 1, 2, 0, 1])
    m.loss((x, y)).backward()
    assert {n for n, p in m.named_parameters() if p.grad is not None} == expected
    assert set(m.trainable_state()) == expected
    params = dict(m.named_parameters())
    assert m.param_counts()["trainable"] == sum(params[n].numel() for n in expected)


def test_trainable_state_restores_the_declared_parameters_only(cfg):
    m, _ = build(cfg, "tiny_vit", "lora_ensemble")
    state = m.trainable_state()
    frozen = m.encoder.get_submodule("blocks.0.attn.qkv").base_layer.weight
    frozen_before = frozen.detach().clone()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    m.load_trainable_state(state)
    params = dict(m.named_parameters())
    for n, t in state.items():
        assert torch.equal(params[n], t), n
    assert torch.equal(frozen, frozen_before + 1.0)  # not part of the state: left as it is
    with pytest.raises(KeyError, match="missing: \\['head.bias'\\]"):
        m.load_trainable_state({n: t for n, t in state.items() if n != "head.bias"})


def test_members_differ_after_one_step(cfg):
    for method, key in (("lora_ensemble", "lora_B"), ("deep_ensemble", None)):
        m, _ = build(cfg, "tiny_vit", method)
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
        m.loss((torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0]))).backward()
        opt.step()
        if key:  # B starts at 0 for every member; each member's head sends it its own gradient
            B = next(mod for mod in m.modules() if isinstance(mod, LoRALinear)).lora_B
            assert not torch.allclose(B[0], B[1])
        else:  # identical pretrained copies at init
            p0, p1 = (dict(enc.named_parameters())["blocks.0.attn.qkv.weight"]
                      for enc in m.de_encoders[:2])
            assert not torch.equal(p0, p1)


# --- member order -----------------------------------------------------------------------------

def test_repeat_members_is_member_major():
    x = torch.arange(3).view(3, 1).float()
    assert repeat_members(x, 2).view(-1).tolist() == [0, 1, 2, 0, 1, 2]
    d = repeat_members({"input_ids": torch.tensor([[5], [6]])}, 3)
    assert d["input_ids"].view(-1).tolist() == [5, 6, 5, 6, 5, 6]


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("method", ["sve", "lora_ensemble", "deep_ensemble"])
def test_member_m_logits_come_from_member_m_parameters(cfg, text_batch, backbone, method):
    m, _ = build(cfg, backbone, method)
    m.eval()
    x = inputs_for(backbone, text_batch)
    with torch.no_grad():
        before = m(x)
        if method == "deep_ensemble":
            for p in m.de_encoders[2].parameters():
                p.add_(0.05 * torch.randn_like(p))
        else:
            for mod in m.encoder.modules():
                if isinstance(mod, SVELinear):
                    mod.sve_s[2].mul_(1.5)
                elif isinstance(mod, LoRALinear):
                    mod.lora_B[2].normal_()
        after = m(x)
    changed = [not torch.allclose(before[k], after[k]) for k in range(m.members)]
    assert changed == [k == 2 for k in range(m.members)]
    with torch.no_grad():  # the heads: perturb head 1 only
        m.head.weight[1].add_(torch.randn_like(m.head.weight[1]))
        again = m(x)
    assert [not torch.allclose(after[k], again[k]) for k in range(m.members)] == \
        [k == 1 for k in range(m.members)]


# --- replacement ------------------------------------------------------------------------------

@pytest.mark.parametrize("backbone,method,count,wrapped,untouched", [
    ("tiny_vit", "sve", 8, ["blocks.1.attn.qkv", "blocks.0.mlp.fc2"], []),
    ("tiny_vit", "lora_ensemble", 4, ["blocks.1.attn.proj"], ["blocks.0.mlp.fc1"]),
    ("tiny_bert", "sve", 12, ["model.encoder.layer.1.attention.output.dense",
                              "model.encoder.layer.1.output.dense",
                              "model.encoder.layer.0.attention.self.key"], ["model.pooler.dense"]),
    ("tiny_bert", "lora_ensemble", 8, ["model.encoder.layer.0.attention.output.dense"],
     ["model.encoder.layer.0.output.dense", "model.encoder.layer.0.intermediate.dense"]),
    ("tiny_llama", "sve", 14, ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.k_proj"],
     []),
    ("tiny_llama", "lora_ensemble", 8, ["model.layers.1.self_attn.o_proj"],
     ["model.layers.1.mlp.up_proj"]),
])
def test_replacement_counts(cfg, backbone, method, count, wrapped, untouched):
    m, _ = build(cfg, backbone, method)
    kind = SVELinear if method == "sve" else LoRALinear
    assert len(m.replaced) == count
    assert sum(isinstance(mod, kind) for mod in m.encoder.modules()) == count
    for name in wrapped:
        assert isinstance(m.encoder.get_submodule(name), kind), name
    for name in untouched:
        assert type(m.encoder.get_submodule(name)) is nn.Linear, name


def test_tiny_llama_layers_are_bias_free_and_rectangular(cfg):
    m, _ = build(cfg, "tiny_llama", "sve")
    k_proj = m.encoder.get_submodule("model.layers.0.self_attn.k_proj")
    assert k_proj.sve_bias is None and k_proj.sve_U.shape == (8, 8)  # 16 → 8: r = 8
    assert k_proj.sve_V.shape == (16, 8)


def test_replacement_on_a_nested_model_wraps_the_original_layer():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.other = nn.Linear(4, 4)

    outer = nn.Sequential(nn.Linear(4, 4), nn.ModuleDict({"deep": nn.Sequential(Inner())}))
    original = outer[1]["deep"][0].proj
    names = replace_linears(outer, ["proj"], lambda n, lin: LoRALinear(lin, 2, 2, 1.0, 1.0),
                            "lora")
    assert names == ["1.deep.0.proj"]
    wrapper = outer[1]["deep"][0].proj
    assert isinstance(wrapper, LoRALinear) and wrapper.base_layer is original
    assert type(outer[1]["deep"][0].other) is nn.Linear and type(outer[0]) is nn.Linear


# --- MC-Dropout -------------------------------------------------------------------------------

def test_mc_dropout_keeps_only_dropout_on_at_test_time(cfg):
    m, _ = build(cfg, "tiny_vit", "mc_dropout", "method.samples=6", "method.p=0.3")
    m.eval()
    # the dropouts MC-Dropout applies (attention-probability dropout is off: rate 0)
    dropouts = [mod for name, mod in m.named_modules()
                if isinstance(mod, nn.Dropout) and not name.endswith("attn_drop")]
    assert len(dropouts) > 1 and all(d.training and d.p == 0.3 for d in dropouts)
    others = [mod for mod in m.modules() if not isinstance(mod, nn.Dropout)]
    assert not any(mod.training for mod in others)  # LayerNorm, attention, DropPath …
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        logits = m(x)
    assert logits.shape == (6, 2, 3)
    assert not torch.allclose(logits[0], logits[1])
    m.train()
    assert m(x).shape == (1, 2, 3)


def test_mc_dropout_members_are_its_passes_over_one_head(cfg):
    m, _ = build(cfg, "tiny_vit", "mc_dropout", "method.samples=5")
    assert m.members == 5 and m.settings()["members"] == 5 and m.settings()["samples"] == 5
    assert m.head.weight.shape == (1, 3, 16)  # one set: C = 3 classes, D = 16 features
    assert m.param_counts()["heads"] == 3 * 16 + 3 and m.param_counts()["added"] == 0
    x = torch.randn(2, 3, 16, 16)
    m.eval()
    with torch.no_grad():
        assert m.features(x).shape == (5 * 2, 16) and m(x).shape == (5, 2, 3)
    m.train()
    assert m.features(x).shape == (2, 16)  # training: one pass


def test_mc_dropout_with_p_zero_is_deterministic(cfg):
    m, _ = build(cfg, "tiny_vit", "mc_dropout", "method.samples=3", "method.p=0")
    m.eval()
    with torch.no_grad():
        logits = m(torch.randn(2, 3, 16, 16))
    torch.testing.assert_close(logits[0], logits[2])


# --- text pooling -----------------------------------------------------------------------------

def test_last_token_index_for_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_token_index(mask).tolist() == [2, 4, 4]


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("method,override,match", [
    ("sve", "method.members=0", "method.members must be a positive integer"),
    ("lora_ensemble", "method.rank=0", "method.rank must be a positive integer"),
    ("sve", "method.targets=[qkv,nonexistent]", r"\['nonexistent'\].*blocks\.0\.attn\.qkv"),
    ("sve", "method.forward_mode=fast", "factorized"),
    ("sve", "method.sigma_init=-1", "sigma_init"),
    ("mc_dropout", "method.p=1.0", "method.p"),
    ("lora_ensemble", "method.targets=mlp", "attention"),
])
def test_bad_method_settings_fail_with_a_clear_error(cfg, method, override, match):
    with pytest.raises(ValueError, match=match):
        build(cfg, "tiny_vit", method, override)


def test_adapter_method_on_an_mlp_backbone_fails_clearly(cfg):
    with pytest.raises(ValueError, match="declares none"):
        build(cfg, "mlp", "lora_ensemble")


# Backbones whose module names an adapter method can wrap (conf/backbone/*.yaml with targets).
WRAPPABLE = ("tiny_vit", "dino_vits16", "dinov2_vits14", "tiny_bert", "bert_base", "tiny_llama",
             "llama2_7b")


@pytest.mark.parametrize("method,before_list", [("lora_ensemble", "declares targets ("),
                                                ("single", "Pick one of: ")])
def test_backbone_errors_list_the_configs_that_work(cfg, method, before_list):
    with pytest.raises(ValueError) as err:
        build(cfg, "mlp", method)
    listed = str(err.value).split(before_list, 1)[1]
    assert all(name in listed for name in WRAPPABLE), listed
    assert "mlp" not in listed


def test_missing_checkpoint_names_the_path_and_the_fix(cfg, tmp_path):
    c = cfg("backbone=dino_vits16", f"paths.checkpoints={tmp_path}")
    with pytest.raises(FileNotFoundError) as err:
        instantiate(c.backbone).build()
    assert str(tmp_path / "vit_small_patch16_224.dino.safetensors") in str(err.value)
    assert "backbone.pretrained=false" in str(err.value)


def test_image_backbones_expose_their_preprocessing(cfg):
    dc = instantiate(cfg("backbone=dinov2_vits14").backbone).data_config()
    assert dc["input_size"] == (3, 224, 224)  # built at 224 px although DINOv2 says 518
    assert {"mean", "std", "crop_pct", "interpolation"} <= set(dc)
    assert instantiate(cfg("backbone=tiny_vit").backbone).feature_dim == 16


# --- SVE extras -------------------------------------------------------------------------------

def test_pretrained_decay_adds_the_l2_pull_toward_the_pretrained_spectrum(cfg):
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    m, _ = build(cfg, "tiny_vit", "sve", "method.sigma_init=0.1", "method.pretrained_decay=0.5")
    m.eval()
    penalty = sum(((layer.sve_s - layer.sve_s0) ** 2).sum() for layer in m.layers())
    m.pretrained_decay = 0.0
    plain = m.loss((x, y))
    m.pretrained_decay = 0.5
    torch.testing.assert_close(m.loss((x, y)), plain + 0.25 * penalty)


def test_svd_cache_reuses_factors_and_notices_new_weights(tmp_path):
    from uqbench.methods import sve_layers as sve

    w = torch.randn(6, 5)
    U, s, V = sve.svd(w, tmp_path, "layer")
    assert (tmp_path / "layer.pt").is_file()
    stored = torch.load(tmp_path / "layer.pt")
    stored["s"] = stored["s"] * 0 + 7  # a marker: a cache hit returns it
    torch.save(stored, tmp_path / "layer.pt")
    assert torch.equal(sve.svd(w, tmp_path, "layer")[1], torch.full((5,), 7.0))
    torch.testing.assert_close(sve.svd(w + 1, tmp_path, "layer")[1],
                               torch.linalg.svdvals(w + 1))


# --- Single -------------------------------------------------------------------------------------

@pytest.mark.parametrize("finetune", [True, False])
def test_single_is_one_encoder_and_one_head(cfg, finetune):
    from uqbench.methods.deep_ensemble import DeepEnsemble

    m, ref = build(cfg, "tiny_vit", "single", f"method.finetune={finetune}", reference=True)
    assert not isinstance(m, DeepEnsemble)
    base = sum(p.numel() for p in ref.parameters())  # the independently built encoder
    heads = 3 * 16 + 3  # one head: C = 3 classes over D = 16 features, and its bias
    counts = m.param_counts()
    assert (counts["base"], counts["heads"], counts["total"]) == (base, heads, base + heads)
    assert counts["trainable"] == (base + heads if finetune else heads)
    x = torch.randn(4, 3, 16, 16)
    m.eval()
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], ref(x) @ m.head.weight[0].T + m.head.bias[0])
    assert m(x).shape == (1, 4, 3)


# --- Deep Ensemble, vectorised ----------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap of CPU attention
@pytest.mark.parametrize("backbone", BACKBONES)
def test_vectorized_deep_ensemble_matches_the_loop(cfg, text_batch, backbone):
    loop, _ = build(cfg, backbone, "deep_ensemble", "method.members=3")
    vec, _ = build(cfg, backbone, "deep_ensemble", "method.members=3", "method.vectorize=true")
    assert vec.param_counts()["total"] == loop.param_counts()["total"]
    with torch.no_grad():  # give every member different weights, the same in both versions
        for k, enc in enumerate(loop.de_encoders):
            for name, p in enc.named_parameters():
                p.add_(0.02 * torch.randn_like(p))
                vec.de_params[name.replace(".", "__")][k].copy_(p)
    loop.eval(), vec.eval()
    x = inputs_for(backbone, text_batch)
    with torch.no_grad():
        torch.testing.assert_close(vec(x), loop(x), atol=1e-5, rtol=1e-5)
    vec.train()
    vec.loss((x, torch.tensor([0, 1, 2, 0, 1]))).backward()
    assert all(p.grad is not None for p in vec.de_params.values())


# --- local pretrained weights -----------------------------------------------------------------

def test_timm_checkpoint_file_is_loaded(cfg, tmp_path):
    import safetensors.torch as st

    bb = instantiate(cfg("backbone=tiny_vit").backbone)
    saved = bb.build()
    st.save_file(saved.state_dict(), tmp_path / "tiny.safetensors")
    bb = instantiate(cfg("backbone=tiny_vit", "backbone.pretrained=true",
                         f"backbone.checkpoint={tmp_path}/tiny.safetensors").backbone)
    loaded = bb.build()
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_hf_local_directory_is_loaded_with_its_tokenizer(cfg, tmp_path):
    from transformers import AutoTokenizer

    bb = instantiate(cfg("backbone=tiny_bert").backbone)
    saved = bb.build()
    saved.model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(bundled_tokenizer_path()).save_pretrained(tmp_path)
    bb = instantiate(cfg("backbone=tiny_bert", "backbone.pretrained=true",
                         f"backbone.path={tmp_path}").backbone)
    loaded = bb.build()
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    assert bb.tokenizer()("a good movie")["input_ids"][:2] == [101, 1037]  # [CLS], "a"
    assert bb.feature_dim == 16


@pytest.mark.parametrize("backbone", ["tiny_vit", "tiny_llama"])
def test_sve_releasing_the_pretrained_weights_changes_memory_not_outputs(cfg, text_batch,
                                                                         backbone):
    """Dropping each decomposed W (and b) saves exactly their bytes; outputs and the overhead
    count stay the same."""
    kept, _ = build(cfg, backbone, "sve", "method.release_pretrained=false")
    lean, _ = build(cfg, backbone, "sve", "method.release_pretrained=true")
    x = inputs_for(backbone, text_batch)
    with torch.no_grad():
        torch.testing.assert_close(lean.eval()(x), kept.eval()(x))
    wrapped = [m for m in kept.encoder.modules() if isinstance(m, SVELinear)]
    dropped = sum(p.numel() * p.element_size() for m in wrapped
                  for p in m.base_layer.parameters())
    assert all(m.base_layer is None for m in lean.encoder.modules() if isinstance(m, SVELinear))
    pk, pl = kept.param_counts(), lean.param_counts()
    assert pk["param_bytes"] - pl["param_bytes"] == dropped > 0
    assert pk["added"] == pl["added"] and pk["trainable"] == pl["trainable"]


# --- SVE's frozen factors: where they live and what they count as ----------------------------

# tiny_vit by hand: d = 16, 2 blocks of qkv (16 → 48), proj (16 → 16), fc1 (16 → 32),
# fc2 (32 → 16); every matrix has rank 16. Per member and block, fused: 4·16 singular values
# and 48 + 16 + 32 + 16 biases; split: q, k, v apart, 6·16 singular values. Heads: 3 × (16 + 1).
TINY_VIT_WRAPPED = 2 * (16 * 48 + 48 + 16 * 16 + 16 + 16 * 32 + 32 + 32 * 16 + 16)
TINY_VIT_SVE = {"sve": 4 * 2 * (4 * 16 + 112) + 4 * 3 * 17,
                "sve_split": 4 * 2 * (6 * 16 + 112) + 4 * 3 * 17}
DEVICES = ["meta", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["sve", "sve_split"])
def test_sve_factors_are_frozen_parameters_on_the_weights_device(cfg, device, method):
    """The runner places the backbone before the method wraps it: the SVD and every factor
    stay on that device; U, V and s0 are parameters (FSDP shards only those) that never train,
    are not in trainable_state and are not counted as the model's parameters."""
    c = cfg("backbone=tiny_vit", f"method={method}")
    bb = instantiate(c.backbone)
    base = sum(p.numel() for p in bb.build().parameters())
    make = bb.build
    bb.build = lambda: make().to(device)
    torch.manual_seed(0)
    m = instantiate(c.method)(backbone=bb, info=INFO)
    layers = m.layers()
    assert len(layers) == 8
    for layer in layers:
        for name in ("sve_U", "sve_V", "sve_s0"):
            t = getattr(layer, name)
            assert isinstance(t, nn.Parameter) and not t.requires_grad, name
            assert t.device.type == device and t.dtype == torch.float32, name
        assert layer.sve_s.device.type == device and layer.sve_s.requires_grad
    assert {p.device.type for p in m.parameters()} == {device}
    factors = {n for n, _ in m.named_parameters()
               if n.rpartition(".")[2] in ("sve_U", "sve_V", "sve_s0")}
    assert len(factors) == 3 * 8
    state = m.trainable_state()
    assert not factors & set(state)
    assert sum(t.numel() for t in state.values()) == TINY_VIT_SVE[method]
    counts = m.param_counts()
    assert counts["trainable"] == TINY_VIT_SVE[method]
    assert counts["total"] == base - TINY_VIT_WRAPPED + TINY_VIT_SVE[method]


def test_sve_decomposes_16_bit_weights_in_float32_and_keeps_their_dtype(cfg):
    m, ref = build(cfg, "tiny_llama", "sve", "backbone.dtype=bfloat16", reference=True)
    W = ref.model.layers[0].self_attn.q_proj.weight                          # (16, 16) bf16
    U, s, Vh = torch.linalg.svd(W.float(), full_matrices=False)
    layer = m.encoder.model.layers[0].self_attn.q_proj
    assert layer.sve_U.dtype == layer.sve_V.dtype == torch.bfloat16
    assert torch.equal(layer.sve_U, U.to(torch.bfloat16))
    assert torch.equal(layer.sve_V, Vh.mT.to(torch.bfloat16))
    assert torch.equal(layer.sve_s0, s.to(torch.bfloat16))
    assert layer.sve_s.dtype == torch.float32                                # trained: float32
