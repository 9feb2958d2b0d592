"""MC-Dropout drops the same things in training and in its T test passes.

The dropouts actually applied are recorded at the level of torch functions (a
TorchFunctionMode sees every ``F.dropout`` call, whether from an ``nn.Dropout`` module or a
functional call, and every ``scaled_dot_product_attention`` with its ``dropout_p``), so
dropout hidden inside fused attention kernels is counted too. ``FastDropout`` modules (the
default ``masks: fast``) call no ``F.dropout``: a global module hook records their calls.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.modules.module import register_module_forward_hook
from torch.overrides import TorchFunctionMode

from uqbench.backbones.hf import bundled_tokenizer_path
from uqbench.contracts import DataInfo
from uqbench.methods.dropout import FastDropout


class DropoutRecorder(TorchFunctionMode):
    """Records (kind, p, shape without the batch dim) of every dropout that acts."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[tuple[str, float, tuple[int, ...]]] = []

    def __enter__(self):
        def fast(module, args, output):
            if isinstance(module, FastDropout) and module.training and module.p > 0:
                self.applied.append(("dropout", float(module.p), tuple(args[0].shape[1:])))

        self.handle = register_module_forward_hook(fast)
        return super().__enter__()

    def __exit__(self, *exc):
        self.handle.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                self.applied.append(("dropout", float(p), tuple(args[0].shape[1:])))
        elif func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p > 0:
                self.applied.append(("attention", float(p), tuple(args[0].shape[1:])))
        return func(*args, **kwargs)


def inputs_for(backbone: str):
    if backbone == "tiny_vit":
        return torch.randn(2, 3, 16, 16)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    return dict(tok(["a good movie", "bad"], padding="max_length", max_length=8,
                    return_tensors="pt"))


def applied(m, x) -> Counter:
    with DropoutRecorder() as rec, torch.no_grad():
        m(x)
    return Counter(rec.applied)


# Dropouts a forward applies, counted by hand from the architectures (p = 0.1 everywhere):
# tiny_vit (2 blocks, 4·4 patches + [CLS] = 17 tokens of width 16): pos_drop; per block
# attn.proj_drop, mlp.drop1 (width 32), mlp.drop2; ours before the head. timm's own head_drop
# is removed and attention dropout is off. tiny_bert (2 blocks, 8 tokens): embeddings; per
# block attention.output and output; ours. tiny_llama: no dropout of its own; ours.
EXPECTED = {
    "tiny_vit": Counter({("dropout", 0.1, (17, 16)): 1 + 2 * 2, ("dropout", 0.1, (17, 32)): 2,
                         ("dropout", 0.1, (16,)): 1}),
    "tiny_bert": Counter({("dropout", 0.1, (8, 16)): 1 + 2 * 2, ("dropout", 0.1, (16,)): 1}),
    "tiny_llama": Counter({("dropout", 0.1, (16,)): 1}),
}


@pytest.mark.parametrize("masks", ["fast", "torch"])
@pytest.mark.parametrize("backbone", list(EXPECTED))
def test_training_and_test_passes_apply_the_same_dropouts(cfg, backbone, masks):
    c = cfg(f"backbone={backbone}", "method=mc_dropout", "method.samples=4",
            f"method.masks={masks}")
    torch.manual_seed(0)
    m = instantiate(c.method)(backbone=instantiate(c.backbone),
                              info=DataInfo(task="classification", num_classes=3))
    x = inputs_for(backbone)
    train, test = applied(m.train(), x), applied(m.eval(), x)
    assert train == test == EXPECTED[backbone]
    assert m.settings()["removed_feature_dropout"] == (backbone == "tiny_vit")


def test_attention_dropout_was_the_difference(cfg):
    """Without the fix (attention dropout at the backbone's rate, timm's head dropout kept)
    training applies attention dropout the test passes miss: the recorder sees it."""
    c = cfg("backbone=tiny_vit", "method=mc_dropout", "method.samples=4")
    m = instantiate(c.method)(backbone=instantiate(c.backbone),
                              info=DataInfo(task="classification", num_classes=3))
    for name, mod in m.encoder.named_modules():
        if name.endswith("attn_drop"):
            mod.p = 0.1
    x = inputs_for("tiny_vit")
    train, test = applied(m.train(), x), applied(m.eval(), x)
    assert train - test == Counter({("attention", 0.1, (2, 17, 8)): 2})  # 2 heads of width 8
