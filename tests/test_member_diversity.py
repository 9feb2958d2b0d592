"""Every ensemble's members really differ after training, on every backbone family, and are
exact copies only when a method is asked for them.

Families: a tiny timm ViT, BERT and LLaMA (random heads), and LLaMA scoring ARC-Easy as next
tokens, where every head starts as the LM's own answer-letter rows (where, without a
per-member perturbation, a Deep Ensemble's members are identical: same rows, exact encoder
copies, same batches).
SVF and the single model have one member and are left out.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hydra.utils import instantiate

from tests.fixtures.datasets import write_arc_easy
from uqbench.backbones.hf import bundled_tokenizer_path
from uqbench.contracts import DataInfo
from uqbench.data.arc import ARCEasyData

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ("tiny_vit", "tiny_bert", "tiny_llama", "llama_arc")
METHODS = {  # method config → overrides: M = 3 everywhere
    "sve": ["method.members=3"],
    "lora_ensemble": ["method.members=3"],
    "deep_ensemble": ["method.members=3"],
    "deep_ensemble_lp": ["method.members=3"],
    "mc_dropout": ["method.samples=3"],
}
# Exact copies when asked: only where nothing else tells the members apart (LM-row heads,
# no dropout in LLaMA); MC-Dropout with p = 0 is deterministic on every backbone.
COPIES = [("sve", "llama_arc", ["method.sigma_init=0"]),
          ("deep_ensemble", "llama_arc", ["method.sigma_init=0"]),
          ("deep_ensemble_lp", "llama_arc", ["method.sigma_init=0"]),
          ("deep_ensemble", "llama_arc", ["method.sigma_init=0", "method.vectorize=true"]),
          ("mc_dropout", "tiny_vit", ["method.p=0"]),
          ("mc_dropout", "tiny_bert", ["method.p=0"])]


@pytest.fixture(scope="module")
def arc_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("arc")
    write_arc_easy(root)
    return root


def family_batch(cfg, family: str, arc_root):
    """(backbone, data info, one training batch (inputs, labels))."""
    backbone = instantiate(cfg(f"backbone={family.replace('llama_arc', 'tiny_llama')}").backbone)
    if family == "llama_arc":
        data = ARCEasyData(root=arc_root, format="causal_lm", batch_size=8)
        data.setup(backbone)
        assert data.info.answer_token_ids is not None
        return backbone, data.info, next(iter(data.loader("train")))
    y = torch.tensor([0, 1, 2, 0, 1])
    if family == "tiny_vit":
        x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3))
        return backbone, DataInfo(task="classification", num_classes=3), (x, y)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    texts = ["a good movie", "the plot was very boring indeed", "x", "great", "bad film"]
    x = dict(tok(texts, padding="max_length", max_length=12, return_tensors="pt"))
    return backbone, DataInfo(task="classification", num_classes=3), (x, y)


def trained_member_probs(cfg, arc_root, method: str, family: str, *overrides: str,
                         steps: int = 3) -> torch.Tensor:
    """Member probabilities (M, B, C) after ``steps`` AdamW steps on one batch."""
    backbone, info, (x, y) = family_batch(cfg, family, arc_root)
    torch.manual_seed(0)
    m = instantiate(cfg(f"method={method}", *overrides).method)(backbone=backbone, info=info)
    assert m.head_from_lm == (family == "llama_arc")
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    m.train()
    for _ in range(steps):
        opt.zero_grad()
        m.loss((x, y)).backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        return m(x).softmax(-1)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", list(METHODS))
def test_members_differ_after_training(cfg, arc_root, method, family):
    probs = trained_member_probs(cfg, arc_root, method, family, *METHODS[method])
    assert probs.shape[0] == 3
    for a, b in itertools.combinations(range(3), 2):
        gap = (probs[a] - probs[b]).abs().max().item()
        assert gap > 1e-5, f"members {a} and {b} of {method} on {family} predict alike ({gap})"


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("method,family,overrides", COPIES)
def test_members_are_exact_copies_only_when_asked(cfg, arc_root, method, family, overrides):
    size = "method.samples=3" if method == "mc_dropout" else "method.members=3"
    probs = trained_member_probs(cfg, arc_root, method, family, size, *overrides)
    for k in range(1, 3):
        torch.testing.assert_close(probs[k], probs[0], atol=1e-6, rtol=0)


def test_deep_ensemble_perturbs_lm_row_heads_like_sve_perturbs_the_spectrum(cfg, arc_root):
    """Heads from the LM's rows: W_m = rows ⊙ (1 + σ ε_m), b_m = σ N(0, I); the relative
    perturbation's spread is σ (0.1 here), and σ = 0 leaves every member at the rows."""
    backbone, info, _ = family_batch(cfg, "llama_arc", arc_root)
    torch.manual_seed(0)
    m = instantiate(cfg("method=deep_ensemble", "method.members=4",
                        "method.sigma_init=0.1").method)(backbone=backbone, info=info)
    rows = backbone.output_rows(info.answer_token_ids)                           # (C, D)
    W, b = m.head.weight.detach(), m.head.bias.detach()                          # (4, C, D)
    rel = W / rows - 1
    assert 0.08 < rel.std().item() < 0.12  # 4·5·16 draws
    assert 0.05 < b.std().item() < 0.2  # 4·5 draws
    assert not torch.allclose(W[0], W[1])
    exact = instantiate(cfg("method=deep_ensemble_lp", "method.members=4",
                            "method.sigma_init=0").method)(backbone=backbone, info=info)
    rows = backbone.output_rows(info.answer_token_ids)  # of the model built for `exact`
    assert torch.equal(exact.head.weight, rows.expand(4, *rows.shape))
    assert torch.equal(exact.head.bias, torch.zeros(4, rows.shape[0]))
