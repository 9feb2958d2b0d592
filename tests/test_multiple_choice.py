"""ARC-Easy in encoder format: every ensemble scores (question, choice) pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.fixtures.datasets import write_arc_easy
from tests.helpers import run_cli
from uqbench.backbones.hf import HFEncoder
from uqbench.data.arc import ARCEasyData
from uqbench.methods.sve import SVE

TINY_BERT = dict(name="tiny_bert", model_type="bert", pretrained=False, max_length=16,
                 pooling="pooler", dtype="float32",
                 config=dict(vocab_size=30522, hidden_size=16, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=32,
                             max_position_embeddings=64),
                 targets=["query", "key", "value", "attention.output.dense",
                          "intermediate.dense", "output.dense"])


def test_choices_are_scored_independently_and_absent_ones_get_zero_probability(tmp_path):
    torch.manual_seed(0)
    write_arc_easy(tmp_path)
    backbone = HFEncoder(**TINY_BERT)
    data = ARCEasyData(root=tmp_path, format="encoder", batch_size=8)
    data.setup(backbone)
    assert data.info.multiple_choice and data.info.num_classes == 5
    method = SVE(backbone=backbone, info=data.info, members=3, sigma_init=0.05).eval()
    inputs, answers = next(iter(data.loader("train")))
    with torch.no_grad():
        logits = method(inputs)
    mask = inputs["choice_mask"]
    assert logits.shape == (3, *mask.shape)
    assert (~mask).any() and mask.sum(1).min() >= 3       # the fixture has 3- to 5-choice rows
    probs = logits.softmax(-1)
    assert torch.all(probs[:, ~mask] == 0)
    # permuting the choices of the batch permutes the logits: each pair is scored on its own
    perm = torch.tensor([2, 0, 1, 4, 3])
    permuted = {k: (v[:, perm] if v.dim() >= 2 else v) for k, v in inputs.items()}
    with torch.no_grad():
        logits_p = method(permuted)
    valid = mask[:, perm]
    assert torch.allclose(logits_p[:, valid], logits[:, :, perm][:, valid], atol=1e-5)
    loss = method.loss((inputs, answers))
    assert torch.isfinite(loss)


def test_arc_encoder_runs_end_to_end(tmp_path):
    write_arc_easy(tmp_path / "data")
    run_cli("backbone=tiny_bert", "dataset=arc_easy", "dataset.format=encoder", "method=sve",
            "method.members=2", "trainer.epochs=1", "trainer.progress=false", "torch_threads=1",
            f"paths.data_root={tmp_path / 'data'}", f"paths.runs_dir={tmp_path / 'runs'}",
            "run_name=arc")
    res = json.loads((tmp_path / "runs/arc/results.json").read_text())
    pred = np.load(tmp_path / "runs/arc/predictions/test.npz")
    assert pred["member_probs"].shape[::2] == (2, 5)
    assert 0 <= res["metrics"]["test/acc"] <= 1
    assert res["metrics"]["test/nll"] == pytest.approx(
        -np.log(pred["member_probs"].mean(0)[np.arange(len(pred["labels"])),
                                             pred["labels"]]).mean(), rel=1e-4)


TINY_LLAMA = dict(name="tiny_llama", model_type="llama", pretrained=False, max_length=16,
                  pooling="last", dtype="float32", causal_lm=True,
                  config=dict(vocab_size=30522, hidden_size=16, intermediate_size=40,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                              max_position_embeddings=64, pad_token_id=0),
                  targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"])


def test_causal_lm_members_start_as_the_lms_answer_letter_scorer(tmp_path, monkeypatch):
    """ARC-Easy as a prompt: with σ_init = 0 every SVE member's logits are the causal LM's own
    next-token logits of " A" … " E" at the prompt's last token (computed independently by
    transformers' LlamaForCausalLM); absent choices get probability 0."""
    import copy

    from transformers import AutoModelForCausalLM

    write_arc_easy(tmp_path)
    torch.manual_seed(0)
    backbone = HFEncoder(**TINY_LLAMA)
    reference = AutoModelForCausalLM.from_config(backbone.hf_config()).eval()
    monkeypatch.setattr(AutoModelForCausalLM, "from_config",
                        lambda config, **kwargs: copy.deepcopy(reference))
    data = ARCEasyData(root=tmp_path, format="causal_lm", batch_size=8)
    data.setup(backbone)
    assert len(data.info.answer_token_ids) == 5
    method = SVE(backbone=backbone, info=data.info, members=2, sigma_init=0.0).eval()
    assert method.settings()["head_from_lm"] is True
    inputs, _ = next(iter(data.loader("test")))
    with torch.no_grad():
        logits = method(inputs)                                                  # (M, B, 5)
        lm = reference(input_ids=inputs["input_ids"],
                       attention_mask=inputs["attention_mask"]).logits          # (B, T, V)
    rows = torch.arange(lm.shape[0])
    expected = lm[rows, inputs["last_index"]][:, data.answer_token_ids]          # (B, 5)
    mask = inputs["choice_mask"]
    assert (~mask).any()
    for m in range(2):
        torch.testing.assert_close(logits[m][mask], expected[mask], atol=1e-4, rtol=1e-4)
    assert torch.all(logits.softmax(-1)[:, ~mask] == 0)
