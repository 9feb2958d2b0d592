"""Parameter counts of the overhead table (experiment p1_overhead) against closed forms.

Base model sizes are published counts or written out layer by layer here; the added
parameters follow from the layer shapes: per member and block, SVE owns min(out, in) singular
values and `out` biases per wrapped matrix, LoRA r·(in + out) per wrapped matrix, and a Deep
Ensemble holds M − 1 extra copies of the whole model.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from uqbench.runner.jobs.params import params_job
from uqbench.runner.spec import RunSpec

R = 8  # LoRA rank in p1_overhead


def vit_s16_base(d: int = 384, L: int = 12, patch: int = 16, tokens: int = 197) -> int:
    block = 12 * d * d + 9 * d + 4 * d  # qkv, proj, fc1, fc2 (+ 9d biases), two LayerNorms
    return 3 * patch * patch * d + d + d + tokens * d + L * block + 2 * d  # patch, cls, pos, norm


BERT_BASE = 109_482_240            # bert-base-uncased, pooler included (BertModel)
LLAMA2_7B = 6_738_415_616 - 32_000 * 4096  # Llama-2-7b-hf minus its LM head (LlamaModel)

# (backbone, M, d, blocks, base, SVE per member per block, LoRA q,k,v,o per member per block)
CASES = {
    # ViT: fused qkv (d → 3d, rank d) + proj + fc1 (d → 4d) + fc2: 4d singular values, 9d biases.
    # LoRA, as the official code: separate rank-R adapters for q, k, v (d → d each) on the
    # fused qkv layer, plus proj: 3·R·2d + R·2d.
    "dino_vits16": (4, 384, 12, vit_s16_base(), 4 * 384 + 9 * 384, 3 * R * 2 * 384
                    + R * 2 * 384),
    # BERT: q, k, v, o, intermediate, output: 6d singular values + 9d biases = 15d
    "bert_base": (8, 768, 12, BERT_BASE, 15 * 768, 4 * R * 2 * 768),
    # LLaMA: 7 bias-free matrices of rank d (MLP 11008 ≥ d)
    "llama2_7b": (16, 4096, 32, LLAMA2_7B, 7 * 4096, 4 * R * 2 * 4096),
}


@pytest.fixture(scope="module")
def job():
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        yield lambda backbone, method: params_job(RunSpec.of(compose(
            "config", overrides=["experiment=p1_overhead", f"backbone={backbone}",
                                 f"method={method}"])))
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("backbone", list(CASES))
def test_sve_and_lora_follow_the_closed_forms(job, backbone):
    M, d, L, base, sve_block, lora_block = CASES[backbone]
    sve = job(backbone, "sve")
    assert sve["settings"]["method"]["members"] == M
    assert sve["params"]["base"] == base
    assert sve["params"]["added"] == M * L * sve_block
    assert sve["params"]["overhead_pct"] == pytest.approx(100 * M * L * sve_block / base)
    assert sve["params"]["trainable"] == sve["params"]["added"] + sve["params"]["heads"]
    lora = job(backbone, "lora_ensemble")
    assert lora["settings"]["method"]["rank"] == R
    assert lora["params"]["added"] == M * L * lora_block
    assert lora["params"]["total"] == base + M * L * lora_block + lora["params"]["heads"]


@pytest.fixture(scope="module")
def job_with():
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        yield lambda *overrides: params_job(RunSpec.of(compose(
            "config", overrides=["experiment=p1_overhead", *overrides])))
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("backbone,d,base", [("dino_vits16", 384, vit_s16_base()),
                                             ("dinov2_vits14", 384, None)])
def test_vit_sve_in_both_qkv_forms_and_lora_on_the_fused_matrix(job_with, backbone, d, base):
    """SVE with q, k, v decomposed apart (P1's text): per block and member 3d (q, k, v, each
    d × d of rank d) + d (proj) + d (fc1, d → 4d) + d (fc2) = 6d singular values and
    3d + d + 4d + d = 9d biases, as BERT. Fused (P1's public code): 4d singular values, 9d
    biases. LoRA with one adapter on the fused matrix: R·(d + 3d) + R·2d (proj)."""
    M, L = 4, 12
    split = job_with(f"backbone={backbone}", "method=sve_split")
    fused = job_with(f"backbone={backbone}", "method=sve")
    assert split["settings"]["method"]["qkv"] == "split"
    assert split["settings"]["method"]["split_qkv_layers"] == L
    assert split["params"]["added"] == M * L * (6 * d + 9 * d)
    assert fused["params"]["added"] == M * L * (4 * d + 9 * d)
    assert split["params"]["base"] == fused["params"]["base"]
    if base is not None:
        assert split["params"]["base"] == base
    # U and V buffers: fused qkv U (3d × d), V (d × d); split 3 × (U (d × d), V (d × d)).
    extra_uv = L * (3 * 2 * d * d - (3 * d * d + d * d)) * 4  # float32 bytes
    extra_s0 = L * (3 * d - d) * 4
    assert split["params"]["buffer_bytes"] - fused["params"]["buffer_bytes"] == \
        extra_uv + extra_s0
    lora = job_with(f"backbone={backbone}", "method=lora_ensemble", "method.qkv=fused")
    assert lora["params"]["added"] == M * L * (R * (d + 3 * d) + R * 2 * d)


def test_sve_split_is_plain_sve_without_a_fused_qkv_layer(job_with):
    split = job_with("backbone=bert_base", "method=sve_split")
    plain = job_with("backbone=bert_base", "method=sve")
    assert split["settings"]["method"]["split_qkv_layers"] == 0
    assert split["params"] == plain["params"]


def test_bert_base_reproduces_p1_within_rounding(job):
    sve, de = job("bert_base", "sve"), job("bert_base", "deep_ensemble")
    assert round(sve["params"]["overhead_pct"], 1) == 1.0            # P1: ≈ 1.0 %
    assert de["params"]["overhead_pct"] == pytest.approx(700.0)      # P1: ≈ 700 %
    assert de["params"]["added"] == 7 * BERT_BASE
    # by hand: LoRA rank 8 on q, k, v, o ≈ 4.3 %, on all six linears ≈ 9.7 % (P1: 10.3 %).
    assert round(job("bert_base", "lora_ensemble")["params"]["overhead_pct"], 1) == 4.3
    assert round(job("bert_base", "lora_ensemble_all")["params"]["overhead_pct"], 1) == 9.7
    # The 5(M−1)/(4d) form: M − 1 extra member sets over the 12d² weights of each block.
    M, d, L = 8, 768, 12
    extra = sve["params"]["added"] * (M - 1) / M
    assert extra / (12 * d * d * L) == pytest.approx(5 * (M - 1) / (4 * d))


def test_llama_sve_overhead_and_bf16_memory(job):
    sve = job("llama2_7b", "sve")
    assert round(sve["params"]["overhead_pct"], 1) == 0.2            # P1: ≈ 0.2 %
    assert sve["params"]["base_bytes"] == 2 * LLAMA2_7B                # bfloat16
    # U (out×r) and V (in×r) per matrix and block, r = 4096, in bf16: q, k, v, o, gate, up, down.
    d, f = 4096, 11008
    uv = 4 * (d * d + d * d) + 2 * (f * d + d * d) + (d * d + f * d)
    rotary = 2 * 2 * (128 // 2)  # LLaMA's own buffers: inv_freq and original_inv_freq (bf16)
    assert sve["params"]["buffer_bytes"] == 2 * 32 * (uv + 7 * d) + rotary  # U, V, pretrained s


def test_deep_ensemble_copies_the_whole_model(job):
    de = job("dino_vits16", "deep_ensemble")
    assert de["params"]["added"] == 3 * vit_s16_base()
    assert de["params"]["trainable"] == 4 * vit_s16_base() + de["params"]["heads"]
    assert de["params"]["heads"] == 4 * (384 * 2 + 2)


def test_llama_sve_training_memory_fits_one_80gb_gpu_with_checkpointing(job):
    """P1's recipe (AdamW, batch 16, M = 16 in one batch, 256 tokens) on LLaMA-2-7B: the bf16
    embeddings, RMSNorms, U, V and s0 are held frozen; the float32 singular values and heads
    each carry a gradient and two AdamW states; with full recomputation each of the 32 blocks
    keeps its input, 2·s·b·h bytes (Korthikanti et al. 2022) with b = 16 · 16 rows."""
    mem = job("llama2_7b", "sve")["memory"]
    d, f, L, M = 4096, 11008, 32, 16
    uv = 4 * (d * d + d * d) + 2 * (f * d + d * d) + (d * d + f * d)
    frozen = 2 * (32_000 * d + (2 * L + 1) * d + L * (uv + 7 * d))
    trained = 4 * (M * L * 7 * d + M * (2 * d + 2))
    ckpt = mem["layouts"]["ckpt"]["bytes"]
    assert ckpt["frozen_params"] == frozen and ckpt["trained_params"] == trained
    assert ckpt["optimizer"] == 2 * trained
    assert ckpt["activations_blocks"] == 2 * 256 * (16 * M) * d * L
    assert ckpt["total"] == frozen + 4 * trained + 2 * 2 * 64 + 2 * 256 * 16 * M * d * L
    assert ckpt["total"] < 80e9 < mem["bytes"]["total"]  # fits only with checkpointing
    fsdp8 = mem["layouts"]["fsdp8"]["bytes"]
    assert fsdp8["frozen_params"] == frozen // 8


def test_overhead_options_that_are_not_a_mapping_are_refused():
    """A list where the options mapping belongs is named, not read as options, when the job's
    spec is built (before any backbone)."""
    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=["job=params", "+overhead=[cpu]"])
    GlobalHydra.instance().clear()
    with pytest.raises(ValueError, match=r"overhead must be a mapping of options, got \['cpu'\]"):
        RunSpec.of(cfg)
