"""A small ViT pretrained on scikit-learn's digits 0–4, at three quality levels.

The architecture (:data:`ARCHITECTURE`, timm ``vit_tiny_patch16_224`` resized: 32 px input,
8-px patches → 16 tokens + [CLS], width 64, 4 blocks of 4 heads, MLP ×2; 148k parameters) has
the DINO ViTs' module names (``blocks.N.attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``),
so every method applies. Features: the mean patch token after the final norm, (B, 64).

Levels (:data:`RECIPES`; ``uqbench-pretrain`` builds them, :mod:`uqbench.runner.pretrain`), with the
linear-probe accuracy on the downstream task (split_seed 0; in brackets: over pretraining seeds
0–2, which shows how far a probe on 314 test images moves by chance):

- ``random``: timm's random initialisation (seeded by the run), no checkpoint: 0.79
  (0.787–0.796). Random ViT features of digits are already a fair linear baseline.
- ``weak``: supervised on the 600 pretraining images (classes 0–4), 20 epochs, lr 1e-3, no
  augmentation: it memorises them (train accuracy 1.0) and transfers little: 0.82 (0.79–0.82).
- ``strong``: supervised on the same images, 60 epochs, lr 3e-3, weight decay 0.3, random
  affine augmentation: 0.90 (0.85–0.90).

A pretrained level's weights are a ``.safetensors`` file in ``<cache_dir>/digits_vit/`` named
by the level and a fingerprint of every setting the weights depend on, with a sidecar JSON
(sha256 of the weights, settings, linear-probe accuracy). They load through timm's pretrained
loader exactly as the DINO checkpoints do (:class:`~uqbench.backbones.timm_vit.TimmViT`); the
file is checked against its sidecar first, so a truncated or altered file is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from uqbench.backbones.timm_vit import TimmViT
from uqbench.contracts import one_of

MODEL = "vit_tiny_patch16_224"
# global_pool "avg": the mean patch token, not [CLS]; from 600 images it transfers better
# (linear probe of the strong level 0.885 against 0.85 with [CLS]).
ARCHITECTURE: dict[str, Any] = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4,
                                "num_heads": 4, "mlp_ratio": 2.0, "global_pool": "avg"}
# AdamW with a cosine schedule; `augment`: random rotation ±10°, shift ±10 %, scale 0.9–1.1.
Level = Literal["random", "weak", "strong"]
RECIPES: dict[str, dict[str, Any] | None] = {
    "random": None,
    "weak": {"epochs": 20, "lr": 1e-3, "weight_decay": 0.05, "batch_size": 32,
             "augment": False, "seed": 0},
    "strong": {"epochs": 60, "lr": 3e-3, "weight_decay": 0.3, "batch_size": 32,
               "augment": True, "seed": 0},
}
LEVELS: tuple[str, ...] = get_args(Level)
FORMAT = 1  # bump when the pretraining code changes what a recipe produces
SUBDIR = "digits_vit"


class CheckpointCorruptError(ValueError):
    """A cached checkpoint does not match its sidecar (truncated, altered or half-written)."""


def pretrain_settings(level: str, split_seed: int = 0,
                      recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a level's weights depend on (``recipe`` replaces the level's own)."""
    one_of("backbone.level", level, Level)
    return {"format": FORMAT, "model": MODEL, "architecture": ARCHITECTURE, "level": level,
            "recipe": RECIPES[level] if recipe is None else dict(recipe),
            "split_seed": int(split_seed), "image_size": ARCHITECTURE["img_size"]}


def fingerprint(settings: dict[str, Any]) -> str:
    """Short hash of the settings: changing any of them names a new checkpoint."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def checkpoint_paths(cache_dir: str | Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    """(weights .safetensors, sidecar .json) of these settings under ``cache_dir``."""
    stem = Path(cache_dir).expanduser() / SUBDIR / f"{settings['level']}-{fingerprint(settings)}"
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def build_command(level: str, cache_dir: str | Path, split_seed: int = 0) -> str:
    """The shell command that (re)builds ``level`` in ``cache_dir``."""
    seed = f" --split-seed {split_seed}" if split_seed else ""
    return f"uqbench-pretrain {level} --cache-dir {cache_dir}{seed}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_sidecar(sidecar: Path) -> dict[str, Any] | None:
    """The sidecar's content, or None when it is missing or not JSON."""
    try:
        return json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None


def verify_checkpoint(weights: Path, sidecar: Path, rebuild: str) -> dict[str, Any]:
    """The sidecar of an intact checkpoint; :class:`CheckpointCorruptError` (naming the file and
    ``rebuild``, the command that rebuilds it) when the weights do not match it."""
    meta = read_sidecar(sidecar)
    if meta is None:
        problem = f"its sidecar {sidecar} is missing or unreadable (an interrupted build?)"
    elif weights.stat().st_size != meta.get("bytes"):
        problem = (f"it has {weights.stat().st_size} bytes, {meta.get('bytes')} were written "
                   f"(truncated?)")
    elif sha256_file(weights) != meta.get("sha256"):
        problem = "its sha256 differs from the one recorded when it was written"
    else:
        return meta
    raise CheckpointCorruptError(
        f"refusing the cached checkpoint {weights}: {problem}. Rebuild it with\n"
        f"  {rebuild} --force")


class DigitsViT(TimmViT):
    """The digits ViT at ``level`` (random | weak | strong); see the module docstring.

    cache_dir: where ``uqbench-pretrain`` put the checkpoints (``paths.cache_dir``).
    split_seed: the digits split it is pretrained on (must equal ``dataset.split_seed``).
    """

    def __init__(self, name: str, level: Level, cache_dir: str | Path, split_seed: int = 0,
                 targets: Sequence[str] = ("qkv", "proj", "fc1", "fc2"),
                 attention_targets: Sequence[str] = ("qkv", "proj")) -> None:
        self.level, self.cache_dir = level, Path(cache_dir).expanduser()
        self.pretrain_split_seed = int(split_seed)
        self.settings = pretrain_settings(level, self.pretrain_split_seed)
        pretrained = RECIPES[level] is not None
        weights, self.sidecar = checkpoint_paths(self.cache_dir, self.settings)
        super().__init__(name, MODEL, pretrained=pretrained,
                         checkpoint=str(weights) if pretrained else None,
                         model_kwargs=ARCHITECTURE, targets=targets,
                         attention_targets=attention_targets)
        if not pretrained:  # random weights are not tied to any pretraining split
            self.pretrain_split_seed = None

    def details(self) -> dict[str, Any]:
        """The level and its linear-probe accuracy on the downstream task (the backbone's
        quality), from the sidecar ``uqbench-pretrain`` wrote; None where it has not run."""
        meta = read_sidecar(self.sidecar) or {}
        return {"level": self.level, "probe_acc": (meta.get("probe") or {}).get("acc")}

    def checkpoint_file(self) -> Path:
        """The verified weight file, or an error saying which command builds it."""
        command = build_command(self.level, self.cache_dir, self.settings["split_seed"])
        if self.checkpoint is None or not self.checkpoint.is_file():
            raise FileNotFoundError(
                f"backbone '{self.name}' has no pretrained checkpoint yet: {self.checkpoint} "
                f"does not exist. Build it with\n  {command}\n"
                f"(or every level into the default cache dir: `make digits-pretrain`), "
                f"then run again")
        verify_checkpoint(self.checkpoint, self.sidecar, command)
        return self.checkpoint
