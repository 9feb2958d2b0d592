"""A small ViT pretrained on scikit-learn's digits, at four quality levels.

The architecture (:data:`ARCHITECTURE`, timm ``vit_tiny_patch16_224`` resized: 32 px input,
8-px patches → 16 tokens + [CLS], width 64, 4 blocks of 4 heads, MLP ×2; 148k parameters) has
the DINO ViTs' module names (``blocks.N.attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``),
so every method applies. Features: the mean patch token after the final norm, (B, 64).

Levels (:data:`RECIPES`; ``uqbench-pretrain`` builds them, :mod:`uqbench.runner.jobs.pretrain`), by
what each has seen; their quality is the linear probe on the downstream validation split,
recorded per pretraining seed in each checkpoint's sidecar and in every run's results:

- ``random``: timm's random initialisation under the pretraining seed; no checkpoint.
- ``other``: supervised on the pretraining images of the *other* digits (0–2 by default, every
  image of them; never a 5–9, never an OOD class), 60 epochs with random affine augmentation.
- ``near``: the same recipe on those images plus 25 of the kind pool (5 images of each
  downstream digit 5–9 that no downstream split holds): it has glimpsed the task's kind.
- ``foundation``: the same recipe plus the whole kind pool (224 images of 5–9), as a foundation
  model has seen many flowers before it is fine-tuned on Flowers102; its frozen features are
  meant to be nearly as good as fine-tuning, the regime P1's claims are made in.

How the kind pool is learnt (``kind_targets``): ``clusters`` (the default) without its labels,
as a self-supervised foundation model learns: the pool's images are grouped by k-means on their
pixels into :data:`KIND_CLUSTERS` clusters (over-clustering, as DeepCluster does; seeded by the
pretraining seed) and the head learns to predict the cluster, beside the other digits' labels.
``labels`` (the benchmark's first protocol): the pool's digit labels, ten-way: the level has
then seen labelled images of the downstream classes.

Each level is pretrained with several seeds (``pretrain_seed``; the benchmark pairs run seed k
with pretraining seed k). A pretrained level's weights are a ``.safetensors`` file in
``<cache_dir>/digits_vit/`` named by the level, the seed and a fingerprint of every setting the
weights depend on, with a sidecar JSON (sha256 of the weights, settings, linear probe). They
load through timm's pretrained loader exactly as the DINO checkpoints do
(:class:`~uqbench.backbones.timm_vit.TimmViT`); the file is checked against its sidecar first,
so a truncated or altered file is refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from uqbench.backbones.timm_vit import TimmViT
from uqbench.contracts import one_of, sha256_file
from uqbench.data.digits import OOD_CLASSES, split_dict

MODEL = "vit_tiny_patch16_224"
# The design choices made on the validation split by `uqbench-pretrain --design` (the pooled
# feature and the pretraining augmentation), with their provenance: read here, never typed.
DESIGN_FILE = Path(__file__).resolve().parents[1] / "conf" / "recipe" / "digits_backbone.yaml"
DESIGN_GRID: dict[str, list[Any]] = {"global_pool": ["avg", "token"], "augment": [True, False]}


def _design() -> dict[str, Any]:
    import yaml

    return dict(yaml.safe_load(DESIGN_FILE.read_text())["choices"])


DESIGN = _design()
ARCHITECTURE: dict[str, Any] = {"img_size": 32, "patch_size": 8, "embed_dim": 64, "depth": 4,
                                "num_heads": 4, "mlp_ratio": 2.0,
                                "global_pool": DESIGN["global_pool"]}
# AdamW with a cosine schedule; `augment`: random rotation ±10°, shift ±10 %, scale 0.9–1.1.
# `kind_images`: how many images of the kind pool (other images of the downstream digits 5–9,
# never a downstream split; balanced over classes; null: all of it) join the pretraining images
# of the other digits, with their pixel clusters as targets (`kind_targets`: clusters) or their
# digit labels (labels, the first protocol's).
Level = Literal["random", "other", "near", "foundation"]
RECIPES: dict[str, dict[str, Any] | None] = {
    "random": None,
    "other": {"kind_images": 0, "epochs": 60, "lr": 3e-3, "weight_decay": 0.3,
              "batch_size": 32, "augment": DESIGN["augment"]},
    "near": {"kind_images": 25, "epochs": 60, "lr": 3e-3, "weight_decay": 0.3,
             "batch_size": 32, "augment": DESIGN["augment"]},
    "foundation": {"kind_images": None, "epochs": 60, "lr": 3e-3, "weight_decay": 0.3,
                   "batch_size": 32, "augment": DESIGN["augment"]},
}
LEVELS: tuple[str, ...] = get_args(Level)
KindTargets = Literal["clusters", "labels"]
KIND_CLUSTERS = 10  # k-means clusters of the kind pool (twice its five digits: over-clustering)
FORMAT = 2  # bump when the pretraining code changes what a recipe produces
SUBDIR = "digits_vit"
# The digits split every level is pretrained on by default (= the digits dataset's defaults).
DEFAULT_SPLIT: dict[str, Any] = {"split_seed": 0, "kind_fraction": 0.25,
                                 "ood_classes": list(OOD_CLASSES)}


@contextmanager
def designed(choices: dict[str, Any]) -> Iterator[None]:
    """Build with other design choices (``uqbench-pretrain --design`` tries each candidate):
    the architecture's pooling and every recipe's augmentation, restored afterwards. The
    choices enter each checkpoint's fingerprint, so candidates never shadow each other."""
    unknown = sorted(set(choices) - set(DESIGN_GRID))
    if unknown:
        raise ValueError(f"unknown design choice(s) {unknown}; valid: {sorted(DESIGN_GRID)}")
    before = (ARCHITECTURE["global_pool"], {k: r["augment"] for k, r in RECIPES.items() if r})
    ARCHITECTURE["global_pool"] = choices.get("global_pool", before[0])
    for recipe in (r for r in RECIPES.values() if r):
        recipe["augment"] = choices.get("augment", recipe["augment"])
    try:
        yield
    finally:
        ARCHITECTURE["global_pool"] = before[0]
        for level, augment in before[1].items():
            RECIPES[level]["augment"] = augment  # type: ignore[index]


class CheckpointCorruptError(ValueError):
    """A cached checkpoint does not match its sidecar (truncated, altered or half-written)."""


def level_recipe(level: str, kind_targets: str = "clusters") -> dict[str, Any] | None:
    """A level's recipe under ``kind_targets`` (None: the random level). The first protocol's
    (labels) is the recipe as it was, so its checkpoints keep their fingerprints."""
    one_of("backbone.level", level, Level)
    one_of("backbone.kind_targets", kind_targets, KindTargets)
    recipe = RECIPES[level]
    if recipe is None:
        return None
    recipe = dict(recipe)
    if kind_targets != "labels" and recipe.get("kind_images", 0) != 0:
        recipe["kind_targets"] = kind_targets
        recipe["kind_clusters"] = KIND_CLUSTERS
    return recipe


def pretrain_settings(level: str, split: dict[str, Any] | None = None, seed: int = 0,
                      recipe: dict[str, Any] | None = None, kind_targets: str = "clusters"
                      ) -> dict[str, Any]:
    """Everything a level's weights depend on: the recipe (``recipe`` replaces the level's
    own under ``kind_targets``), the digits split it reads (``{split_seed, kind_fraction,
    ood_classes}``, see :func:`~uqbench.data.digits.split_dict`) and the seed."""
    chosen = level_recipe(level, kind_targets) if recipe is None else recipe
    return {"format": FORMAT, "model": MODEL, "architecture": dict(ARCHITECTURE),
            "level": level, "recipe": None if chosen is None else dict(chosen),
            "split": normal_split(split), "seed": int(seed),
            "image_size": ARCHITECTURE["img_size"]}


def fingerprint(settings: dict[str, Any]) -> str:
    """Short hash of the settings: changing any of them names a new checkpoint."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def checkpoint_paths(cache_dir: str | Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    """(weights .safetensors, sidecar .json) of these settings under ``cache_dir``; the random
    level has a sidecar only (its probe)."""
    stem = (Path(cache_dir).expanduser() / SUBDIR
            / f"{settings['level']}-s{settings['seed']}-{fingerprint(settings)}")
    return stem.with_suffix(".safetensors"), stem.with_suffix(".json")


def normal_split(split: dict[str, Any] | None) -> dict[str, Any]:
    """A split as checkpoints record it (:func:`~uqbench.data.digits.split_dict`; None: the
    default); a split without ``ood_classes`` is the first protocol's (None)."""
    split = dict(DEFAULT_SPLIT if split is None else split)
    return split_dict(split["split_seed"], split["kind_fraction"], split.get("ood_classes"))


def build_command(level: str, cache_dir: str | Path, split: dict[str, Any] | None = None,
                  seed: int = 0, kind_targets: str = "clusters") -> str:
    """The shell command that (re)builds ``level`` with ``seed`` in ``cache_dir``."""
    split = normal_split(split)
    extra = "".join(f" --{key.replace('_', '-')} {split[key]}" for key in ("split_seed",
                                                                            "kind_fraction")
                    if split[key] != DEFAULT_SPLIT[key])
    classes = split.get("ood_classes")
    if classes != DEFAULT_SPLIT["ood_classes"]:
        extra += " --ood-classes " + ("none" if classes is None else " ".join(map(str, classes)))
    if kind_targets != "clusters":
        extra += f" --kind-targets {kind_targets}"
    return f"uqbench-pretrain {level} --seeds {seed} --cache-dir {cache_dir}{extra}"


def write_weights(state: dict[str, torch.Tensor], path: Path, settings: dict[str, Any]) -> None:
    """Write an encoder's weights as safetensors whose bytes depend on the weights and settings
    only, so that equal weights have equal sha256s. The header's metadata is one entry:
    safetensors writes its metadata map in an order that changes from process to process."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"settings": json.dumps(settings, sort_keys=True)})


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
    """The digits ViT at ``level`` (see the module docstring).

    cache_dir: where ``uqbench-pretrain`` put the checkpoints (``paths.cache_dir``).
    split_seed, kind_fraction, ood_classes: the digits split it is pretrained on (must equal the
    dataset's). kind_targets: how the kind pool is learnt (clusters | labels; module docstring).
    pretrain_seed: which of the level's pretrainings (the benchmark pairs run seed k with
    pretraining seed k, so the spread over seeds includes the backbone's own randomness); for
    the random level, the seed of timm's initialisation.
    """

    def __init__(self, name: str, level: Level, cache_dir: str | Path, split_seed: int = 0,
                 kind_fraction: float = 0.25, pretrain_seed: int = 0,
                 ood_classes: Sequence[int] | None = OOD_CLASSES, kind_targets: str = "clusters",
                 targets: Sequence[str] = ("qkv", "proj", "fc1", "fc2"),
                 attention_targets: Sequence[str] = ("qkv", "proj")) -> None:
        self.level, self.cache_dir = level, Path(cache_dir).expanduser()
        split = split_dict(split_seed, kind_fraction, ood_classes)
        self.pretrain_seed, self.kind_targets = int(pretrain_seed), str(kind_targets)
        self.settings = pretrain_settings(level, split, self.pretrain_seed,
                                          kind_targets=self.kind_targets)
        pretrained = RECIPES[level] is not None
        weights, self.sidecar = checkpoint_paths(self.cache_dir, self.settings)
        super().__init__(name, MODEL, pretrained=pretrained,
                         checkpoint=str(weights) if pretrained else None,
                         model_kwargs=ARCHITECTURE, targets=targets,
                         attention_targets=attention_targets)
        # random weights saw no digits split
        self.pretrain_split = split if pretrained else None

    def build(self) -> nn.Module:
        """The encoder; the random level's weights are timm's initialisation under
        ``pretrain_seed`` (the one its recorded probe measured), whatever the run's RNG state."""
        if self.pretrained:
            return super().build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.pretrain_seed)
            return super().build()

    def details(self) -> dict[str, Any]:
        """The level, its pretraining seed, the weights' sha256 and the linear-probe accuracy
        on the downstream validation split (the backbone's quality), from the sidecar
        ``uqbench-pretrain`` wrote; None where it has not run."""
        meta = read_sidecar(self.sidecar) or {}
        probe = meta.get("probe") or {}
        return {"level": self.level, "pretrain_seed": self.pretrain_seed,
                "probe_acc": probe.get("acc"), "probe_split": probe.get("split"),
                "sha256": meta.get("sha256")}

    def checkpoint_file(self) -> Path:
        """The verified weight file, or an error saying which command builds it."""
        command = build_command(self.level, self.cache_dir, self.settings["split"],
                                self.pretrain_seed, self.kind_targets)
        if self.checkpoint is None or not self.checkpoint.is_file():
            raise FileNotFoundError(
                f"backbone '{self.name}' has no pretrained checkpoint yet: {self.checkpoint} "
                f"does not exist. Build it with\n  {command}\n"
                f"(or every level and seed into the default cache dir: `make digits-pretrain`), "
                f"then run again")
        verify_checkpoint(self.checkpoint, self.sidecar, command)
        return self.checkpoint
