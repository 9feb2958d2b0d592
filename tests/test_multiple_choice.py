"""ARC-Easy in encoder format: every ensemble scores (question, choice) pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.fixtures.datasets import write_arc_easy
from tests.helpers import run_cli
from uqbench.backbones.hf import HFEncoder
from uqbench.data.text import ARCEasyData
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
