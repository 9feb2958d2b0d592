"""Activation checkpointing of the timm and Hugging Face backbones, under wrapped layers.

The reference is the same model trained without checkpointing: one step from the same random
state must give the same loss and the same gradient of every trained parameter (dropout
included: non-reentrant checkpoints restore the RNG state, so a recomputed block draws the
masks it drew in the forward), while a block inside the encoder really runs twice.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from tests.helpers import build_method
from uqbench.backbones.hf import bundled_tokenizer_path

pytestmark = pytest.mark.usefixtures("one_thread")
# A linear layer inside the first block of each tiny backbone (wrapped by SVE and LoRA there).
BLOCK_LAYER = {"tiny_vit": "blocks.0.mlp.fc1",
               "tiny_bert": "model.encoder.layer.0.attention.self.query",
               "tiny_llama": "model.layers.0.self_attn.q_proj"}


@pytest.fixture(scope="module")
def text():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    return dict(tok(["a good movie", "the plot was boring", "x", "great"], padding="max_length",
                    max_length=10, truncation=True, return_tensors="pt"))


def step(method, inputs, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and the gradient of every trained parameter after one backward from seed 1."""
    method.train()
    method.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = method.loss((inputs, y))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in method.trainable_parameters().items()}


def checkpointing_on(encoder) -> bool:
    """What the library itself reports: timm's flag, or transformers' property."""
    if hasattr(encoder, "grad_checkpointing"):
        return bool(encoder.grad_checkpointing)
    hf = encoder.model
    flag = getattr(type(hf), "is_activation_checkpointing", None)
    return bool(hf.is_activation_checkpointing if flag is not None
                else hf.is_gradient_checkpointing)


@pytest.mark.parametrize("backbone", ["tiny_vit", "tiny_bert", "tiny_llama"])
@pytest.mark.parametrize("method,override", [("sve", "method.sigma_init=0.1"),
                                             ("lora_ensemble", "method.members=3"),
                                             ("mc_dropout", "method.p=0.3")])
def test_checkpointing_keeps_loss_and_gradients(cfg, text, backbone, method, override):
    m, _ = build_method(cfg, backbone, method, override)
    if method == "lora_ensemble":  # B = 0 at init gives A no gradient: move B off zero
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("lora_B"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    inputs = (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(2))
              if backbone == "tiny_vit" else text)
    y = torch.tensor([0, 1, 2, 1])
    calls = []
    m.encoder.get_submodule(BLOCK_LAYER[backbone]).register_forward_hook(
        lambda *_: calls.append(1))
    loss, grads = step(m, inputs, y)
    assert len(calls) == 1 and not checkpointing_on(m.encoder)
    bb = instantiate(cfg(f"backbone={backbone}").backbone)
    assert bb.enable_activation_checkpointing(m) == 1
    assert checkpointing_on(m.encoder)
    calls.clear()
    loss_ckpt, grads_ckpt = step(m, inputs, y)
    assert len(calls) == 2  # the forward, and the block's recomputation in the backward
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-6, atol=1e-7)
    assert grads_ckpt.keys() == grads.keys()
    assert sum(g.abs().sum() > 0 for g in grads.values()) == len(grads)  # all really trained
    for n, g in grads.items():
        torch.testing.assert_close(grads_ckpt[n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_a_backbone_that_cannot_checkpoint_says_which_can(cfg):
    bb = instantiate(cfg("backbone=mlp").backbone)
    with pytest.raises(ValueError, match=r"'mlp_w16'.*cannot checkpoint.*tiny_bert.*tiny_vit"):
        bb.enable_activation_checkpointing(bb.build(3))


def test_every_encoder_copy_of_a_deep_ensemble_is_switched_on(cfg):
    m, _ = build_method(cfg, "tiny_vit", "deep_ensemble", "method.members=3")
    assert instantiate(cfg("backbone=tiny_vit").backbone).enable_activation_checkpointing(m) == 3
    assert all(enc.grad_checkpointing for enc in m.de_encoders)
