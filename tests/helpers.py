"""Helpers shared by tests (import them; fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m uqbench.runner.cli ARGS`` in a subprocess, as a user would from the shell."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"uqbench {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def build_method(cfg, backbone: str, method: str, *overrides: str, reference: bool = False,
                 info=None):
    """(method, reference encoder or None) from the real configs, on 3 classes by default;
    with reference=True the method's encoder is a deep copy of an independently built model
    in eval mode (dropout off), returned as the reference."""
    import copy

    import torch
    from hydra.utils import instantiate

    from uqbench.contracts import DataInfo

    c = cfg(f"backbone={backbone}", f"method={method}", *overrides)
    bb = instantiate(c.backbone)
    ref = None
    if reference:
        ref = bb.build().eval()
        bb.build = lambda: copy.deepcopy(ref)
    torch.manual_seed(0)
    info = info or DataInfo(task="classification", num_classes=3)
    return instantiate(c.method)(backbone=bb, info=info), ref


def quick_trainer(epochs: int, lr: float = 1e-2, optimizer: str = "torch.optim.Adam",
                  val_every: int = 1000, **settings):
    """A Trainer built from config as the runner builds it: constant lr, no warm-up, no
    clipping, last epoch kept, no progress bar; ``settings`` override any field."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return instantiate(OmegaConf.create({
        "_target_": "uqbench.runner.engine.loop.Trainer", "epochs": epochs, "grad_clip": None,
        "warmup_epochs": 0, "schedule": "constant", "select": "last", "val_every": val_every,
        "progress": False, **settings,
        "optimizer": {"_target_": optimizer, "_partial_": True, "lr": lr}}))


def tiny_text_batch() -> dict:
    """Five sentences through the bundled BERT tokenizer (max length 12): a tiny text batch."""
    from transformers import AutoTokenizer

    from uqbench.backbones.hf import bundled_tokenizer_path

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_path())
    texts = ["a good movie", "the plot was very boring indeed", "x", "great", "bad film"]
    return dict(tok(texts, padding="max_length", max_length=12, truncation=True,
                    return_tensors="pt"))


def inputs_for(backbone: str, text_batch: dict, batch: int = 5):
    """A tiny batch for a tiny backbone: 16 × 16 images for tiny_vit, else the text batch."""
    import torch

    if backbone == "tiny_vit":
        return torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    return {k: v[:batch] for k, v in text_batch.items()}
