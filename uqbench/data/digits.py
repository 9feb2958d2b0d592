"""scikit-learn's handwritten digits as a P1 benchmark that needs no download.

``sklearn.datasets.load_digits``: 1,797 grey 8×8 images (intensity 0–16) of the digits 0–9,
about 180 per class, shipped with scikit-learn.

The ten classes are used twice, never overlapping (all splits stratified by class and seeded by
``split_seed``, fixed across model seeds):

- classes 0–4 (901 images) are the other digits, split by ``ood_classes``. With
  ``ood_classes = (3, 4)`` (the default): every image of 0–2 (537) is a **pretraining** image of
  the digits ViTs (``uqbench-pretrain``) and every image of 3 and 4 (364) is the **OOD** split
  ``ood``, digits of classes no backbone level ever pretrains on. With ``ood_classes = None``
  (the benchmark's first protocol): two thirds of 0–4 (600) are the pretraining images and the
  held-out third (301) is ``ood``: unseen images, but of classes the pretrained levels were
  trained to tell apart.
- classes 5–9 (896 images), relabelled 0–4, are the **downstream** task. ``kind_fraction``
  (0.25: 224) of them is the **kind** pool: other images of the downstream classes, which only
  the foundation-grade backbone levels pretrain on (as a foundation model has seen flowers
  before it is fine-tuned on Flowers102), never a downstream split. Of the rest: ``test`` =
  ``test_fraction`` of the 896 (0.30: 269), ``val`` = ``val_fraction`` (0.15: 134), ``train``
  = what remains (269).

Images are scaled to 0–255, upsampled bilinearly from 8×8 to ``image_size`` and repeated to 3
channels (uint8 (N, S, S, 3)); then the backbone's ``data_config()`` preprocessing (mean/std) is
applied like every image dataset's. 32 px: the size of CIFAR-10/100-C, the smallest images the
corruptions are commonly applied to (the library's parameters are ImageNet's, so they are harsher
at 32 px), and the digits ViTs' input size, so the backbone's resize is the identity.

Corruption splits ``test_c/<corruption>/<severity>``: the test images corrupted by the
``imagecorruptions`` library (Hendrycks & Dietterich's ImageNet-C code), one seed per image,
generated once per process and kept in memory. :data:`DEFAULT_CORRUPTIONS` is one corruption of
each ImageNet-C family, each under 1 ms per 32-px image on one core (glass_blur takes ~27 ms,
frost ~8 ms, zoom_blur ~3 ms).

Longer than most modules: the splits, the two protocols' OOD rules, the corruptions and the
data module share the images and their indices, and reading them in one place is what keeps
a pretraining image out of every downstream and OOD split.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset

from uqbench.contracts import InputBackbone
from uqbench.data.base import resolve_names
from uqbench.data.cifar import resolve_severities
from uqbench.data.image_base import ArrayImageDataset, ImageDataModule
from uqbench.data.on_disk import SEVERITIES

OTHER_CLASSES = (0, 1, 2, 3, 4)       # pretraining + OOD
DOWNSTREAM_CLASSES = (5, 6, 7, 8, 9)  # the fine-tuning task, relabelled 0–4
OOD_CLASSES = (3, 4)                  # the default: OOD digits of classes no level pretrains on
OOD_FRACTION = 1 / 3                  # ood_classes None: of classes 0–4 held out as `ood`
DEFAULT_CORRUPTIONS = ("gaussian_noise", "defocus_blur", "fog", "contrast")


@functools.lru_cache(maxsize=4)
def digit_images(image_size: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 digits: images (N, S, S, 3) uint8 (S = image_size) and labels (N,) int64."""
    from sklearn.datasets import load_digits

    if int(image_size) < 8:
        raise ValueError(f"dataset.image_size must be >= 8 (the digits are 8×8), got {image_size}")
    digits = load_digits()
    grey = np.round(digits.images * (255 / 16)).astype(np.uint8)  # (N, 8, 8), 0–16 → 0–255
    # bilinear: smooth strokes; nearest would make 8-px-aligned blocks the ViT patches see whole
    big = np.stack([np.asarray(Image.fromarray(g).resize((image_size, image_size),
                                                          Image.Resampling.BILINEAR))
                    for g in grey])
    images = np.repeat(big[..., None], 3, axis=3)
    images.setflags(write=False)  # shared by every caller of the cache
    return images, digits.target.astype(np.int64)


def check_fractions(val_fraction: float, test_fraction: float, kind_fraction: float = 0.0
                    ) -> None:
    """The downstream fractions leave a training split (each of the 896 images 5–9)."""
    if (not 0 < test_fraction < 1 or not 0 <= kind_fraction < 1
            or not 0 <= val_fraction < 1 - test_fraction - kind_fraction):
        raise ValueError(f"dataset.test_fraction ({test_fraction}) must be in (0, 1), "
                         f"dataset.kind_fraction ({kind_fraction}) in [0, 1) and "
                         f"dataset.val_fraction ({val_fraction}) in "
                         f"[0, 1 - test_fraction - kind_fraction)")


def check_ood_classes(ood_classes: Any) -> tuple[int, ...] | None:
    """``dataset.ood_classes`` as a sorted tuple (None: the held-out third of 0–4), or an error
    naming the value and the valid choices."""
    if ood_classes is None:
        return None
    try:
        classes = tuple(sorted({int(c) for c in ood_classes}))
    except (TypeError, ValueError):
        classes = ()
    if not classes or not set(classes) < set(OTHER_CLASSES):
        raise ValueError(f"dataset.ood_classes must be null or a non-empty proper subset of the "
                         f"other digits {list(OTHER_CLASSES)} (the rest are the pretraining "
                         f"classes), got {ood_classes!r}")
    return classes


def pretrain_classes(ood_classes: Any) -> tuple[int, ...]:
    """The digits the pretrained levels are trained on under ``ood_classes``."""
    classes = check_ood_classes(ood_classes)
    return tuple(c for c in OTHER_CLASSES if classes is None or c not in classes)


def _take(pool: np.ndarray, labels: np.ndarray, n: float, seed: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """(rest, taken): ``n`` images of ``pool`` (a fraction of it when n < 1), stratified."""
    from sklearn.model_selection import train_test_split

    if n == 0:
        return pool, pool[:0]
    rest, taken = train_test_split(pool, test_size=n, stratify=labels[pool], random_state=seed)
    return rest, taken


def digits_splits(labels: np.ndarray, split_seed: int = 0, val_fraction: float = 0.15,
                  test_fraction: float = 0.30, kind_fraction: float = 0.25,
                  ood_classes: Any = OOD_CLASSES) -> dict[str, np.ndarray]:
    """Indices into ``labels`` (N,) of the splits pretrain, ood (classes 0–4) and kind, train,
    val, test (classes 5–9): sorted, disjoint, each stratified by class. The fractions are of
    the images 5–9; ``kind`` is drawn first, so the downstream splits of any kind_fraction > 0
    share one draw order. ``ood_classes``: the digits of 0–4 that are OOD, every image of them
    (the others are all pretraining images); None: a stratified third of 0–4's images."""
    check_fractions(val_fraction, test_fraction, kind_fraction)
    classes = check_ood_classes(ood_classes)
    idx = np.arange(len(labels))
    up = np.isin(labels, OTHER_CLASSES)
    if classes is None:
        pretrain, ood = _take(idx[up], labels, OOD_FRACTION, split_seed)
    else:
        pretrain, ood = idx[up & ~np.isin(labels, classes)], idx[np.isin(labels, classes)]
    down = idx[~up]
    n = len(down)
    rest, kind = _take(down, labels, round(kind_fraction * n), split_seed)
    rest, test = _take(rest, labels, round(test_fraction * n), split_seed)
    train, val = _take(rest, labels, round(val_fraction * n), split_seed)
    return {k: np.sort(v) for k, v in {"pretrain": pretrain, "ood": ood, "kind": kind,
                                       "train": train, "val": val, "test": test}.items()}


def split_dict(split_seed: int, kind_fraction: float, ood_classes: Any) -> dict[str, Any]:
    """The digits split a pretrained level is pretrained on: ``{split_seed, kind_fraction}``
    and, unless None (the first protocol, whose checkpoints keep their names), ``ood_classes``
    as a list."""
    split: dict[str, Any] = {"split_seed": int(split_seed), "kind_fraction": float(kind_fraction)}
    classes = check_ood_classes(ood_classes)
    if classes is not None:
        split["ood_classes"] = list(classes)
    return split


def balanced_head(indices: np.ndarray, labels: np.ndarray, n: int | None) -> np.ndarray:
    """The first ``n`` of ``indices`` taken round-robin over classes (all when n is None)."""
    if n is None or n >= len(indices):
        return indices
    y = labels[indices]
    rank = np.zeros(len(indices), dtype=np.int64)  # position of each index within its class
    for c in np.unique(y):
        rank[y == c] = np.arange((y == c).sum())
    return np.sort(indices[np.lexsort((y, rank))[:n]])


def corruption_names() -> list[str]:
    """Every corruption the imagecorruptions library implements (the 19 of ImageNet-C)."""
    try:
        from imagecorruptions import get_corruption_names
    except ImportError as err:  # a dependency of uqbench; missing only in a broken install
        raise RuntimeError(f"the digits corruption splits need the imagecorruptions library "
                           f"({err}); install it with `pip install imagecorruptions-imaug` "
                           f"(its OpenCV needs the system's libGL: `apt-get install libgl1`)"
                           ) from None
    return list(get_corruption_names("all"))


def resolve_corruptions(spec: Any) -> tuple[str, ...]:
    """``default`` | ``all`` | a list of names | null (none) → corruption names."""
    if spec is None or spec in ("none", "null", ""):
        return ()  # no library needed to evaluate no corruption
    valid = corruption_names()
    return resolve_names(spec, {"default": DEFAULT_CORRUPTIONS, "all": tuple(valid)}, valid,
                         "dataset.corruptions", "corruption")


_CORRUPTED: dict[tuple, np.ndarray] = {}  # in-memory cache for the process (a worker's jobs)


def _images_key(images: np.ndarray) -> tuple[str, tuple[int, ...]]:
    """What identifies an array of images in this module's caches: its bytes and its shape."""
    return hashlib.sha1(np.ascontiguousarray(images).data).hexdigest(), images.shape


def corrupt_images(images: np.ndarray, corruption: str, severity: int, seed: int = 0
                   ) -> np.ndarray:
    """``images`` (N, S, S, 3) uint8 corrupted by ``corruption`` at ``severity`` (1–5) → same
    shape, uint8. Each image draws from its own seed (seed, corruption, severity, a hash of its
    pixels), so its result does not depend on which other images are corrupted with it; the
    result is cached in memory."""
    from imagecorruptions import corrupt
    from imagecorruptions import corruptions as library

    key = (*_images_key(images), corruption, int(severity), int(seed))
    if key in _CORRUPTED:
        return _CORRUPTED[key]
    number = corruption_names().index(corruption)
    # Two functions take their own seed (otherwise they draw fresh entropy); the rest use
    # numpy's global generator, whose state is put back afterwards so training is unaffected.
    takes_seed = "seed" in inspect.signature(getattr(library, corruption)).parameters
    state = np.random.get_state()
    out = np.empty_like(images)
    try:
        for i, image in enumerate(images):
            pixels = int.from_bytes(hashlib.blake2b(image.tobytes(), digest_size=8).digest())
            s = int(np.random.SeedSequence([int(seed), number, int(severity), pixels])
                    .generate_state(1)[0])
            np.random.seed(s)
            kwargs = {"seed": s} if takes_seed else {}
            out[i] = np.clip(corrupt(np.array(image), severity=int(severity),
                                     corruption_name=corruption, **kwargs), 0, 255)
    finally:
        np.random.set_state(state)
    out.setflags(write=False)
    _CORRUPTED[key] = out
    return out


class DigitsData(ImageDataModule):
    """The digits benchmark: downstream classes 5–9, OOD = digits of 0–4 no level pretrained on
    (``ood_classes``), corruption splits.

    See the module docstring for the splits. ``max_per_split`` keeps the first n images of each
    split, balanced over classes (smoke tests). ``augment`` defaults to false: flips and crops
    change what a digit is.
    """

    num_classes = len(DOWNSTREAM_CLASSES)

    def __init__(self, name: str = "digits", image_size: int = 32, split_seed: int = 0,
                 val_fraction: float = 0.15, test_fraction: float = 0.30,
                 kind_fraction: float = 0.25, ood: bool = True,
                 ood_classes: Any = OOD_CLASSES, corruptions: Any = DEFAULT_CORRUPTIONS,
                 severities: Any = SEVERITIES,
                 corruption_seed: int = 0, max_per_split: int | None = None,
                 augment: bool = False, hflip: float = 0.0, crop_pct: float | None = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(".", name, augment=augment, hflip=hflip, crop_pct=crop_pct, **kwargs)
        self.image_size, self.split_seed = int(image_size), int(split_seed)
        self.val_fraction, self.test_fraction = float(val_fraction), float(test_fraction)
        self.kind_fraction = float(kind_fraction)
        check_fractions(self.val_fraction, self.test_fraction, self.kind_fraction)
        self.ood_classes = check_ood_classes(ood_classes)
        if max_per_split is not None and int(max_per_split) < 1:
            raise ValueError(f"dataset.max_per_split must be >= 1 or null, got {max_per_split}")
        self.max_per_split = None if max_per_split is None else int(max_per_split)
        self.use_ood = bool(ood)
        self.corruptions = resolve_corruptions(corruptions)
        self.severities = resolve_severities(severities)
        self.corruption_seed = int(corruption_seed)
        self.eval_splits = ("test",) + tuple(
            f"test_c/{c}/{s}" for c in self.corruptions for s in self.severities)
        self.ood_splits = ("ood",) if self.use_ood else ()

    def check(self) -> None:
        if self.corruptions:
            corruption_names()  # the library imports

    def pretrain_split(self) -> dict[str, Any]:
        """What a pretrained digits backbone must have been pretrained on to leave this
        dataset's downstream and OOD images unseen."""
        return split_dict(self.split_seed, self.kind_fraction, self.ood_classes)

    def setup(self, backbone: InputBackbone | None = None) -> None:
        seen = None if backbone is None else backbone.pretrain_split
        if backbone is not None and seen is not None and seen != self.pretrain_split():
            raise ValueError(
                f"backbone '{backbone.name}' was pretrained on the digits split {seen}, but "
                f"this dataset uses {self.pretrain_split()} (dataset.split_seed, "
                f"dataset.kind_fraction, dataset.ood_classes): its pretraining images would "
                f"fall into the downstream or OOD splits. Use the same values for both "
                f"(backbone.split_seed, backbone.kind_fraction, backbone.ood_classes)")
        super().setup(backbone)

    def split_indices(self) -> dict[str, np.ndarray]:
        """Indices into :func:`digit_images` of every split (after ``max_per_split``)."""
        _, labels = digit_images(self.image_size)
        splits = digits_splits(labels, self.split_seed, self.val_fraction, self.test_fraction,
                               self.kind_fraction, self.ood_classes)
        return {k: balanced_head(v, labels, self.max_per_split) for k, v in splits.items()}

    def build(self, train_transform: Callable, eval_transform: Callable) -> dict[str, Dataset]:
        images, labels = digit_images(self.image_size)
        # downstream labels 5–9 → 0–4; OOD images keep their digit (only predictions are used)
        targets = np.where(labels >= DOWNSTREAM_CLASSES[0], labels - DOWNSTREAM_CLASSES[0],
                           labels)
        idx = self.split_indices()
        wanted = ("train", "val", "test") + (("ood",) if self.use_ood else ())
        out: dict[str, Dataset] = {}
        for split in wanted:
            if not len(idx[split]):
                continue
            if split == "train" and self.augment:  # random transforms: applied per item
                out[split] = ArrayImageDataset(images, targets, train_transform, idx[split])
            else:  # fixed preprocessing: applied once, then batches are tensor slices
                out[split] = _tensors(images[idx[split]], targets[idx[split]], eval_transform)
        for c in self.corruptions:
            for s in self.severities:
                corrupted = corrupt_images(images[idx["test"]], c, s, self.corruption_seed)
                out[f"test_c/{c}/{s}"] = _tensors(corrupted, targets[idx["test"]],
                                                  eval_transform)
        return out

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "image_size": self.image_size, "split_seed": self.split_seed,
            "val_fraction": self.val_fraction, "test_fraction": self.test_fraction,
            "kind_fraction": self.kind_fraction,
            "ood": None if not self.use_ood else (
                "digits 0-4 held out" if self.ood_classes is None
                else "digits " + ",".join(map(str, self.ood_classes)) + " (no level saw them)"),
            "ood_classes": None if self.ood_classes is None else list(self.ood_classes),
            "corruptions": list(self.corruptions), "severities": list(self.severities),
            "corruption_seed": self.corruption_seed, "max_per_split": self.max_per_split}


# Preprocessed splits, kept for the process: a sweep's worker runs job after job on the same
# images (every split but train is fixed across seeds and methods), and preprocessing them one
# PIL image at a time took seconds a job, longer than some runs' training.
_PREPROCESSED: dict[tuple, torch.Tensor] = {}
PREPROCESSED_BYTES = 1 << 30  # the cache's limit (the digits at 32 px: under 100 MB in all)


def _tensors(images: np.ndarray, targets: np.ndarray, transform: Callable) -> TensorDataset:
    """(N, S, S, 3) uint8 through ``transform`` → TensorDataset((N, 3, H, W) float, (N,)).
    The images are preprocessed once per process and transform: the key is their bytes and the
    transform's description, which names every parameter of torchvision's and timm's
    transforms; a transform described only by its address (a lambda) is never cached, nor
    anything past :data:`PREPROCESSED_BYTES` (e.g. the digits upsampled to 224 px)."""
    described = repr(transform)
    cacheable = " at 0x" not in described
    key = (*_images_key(images), described)
    x = _PREPROCESSED.get(key) if cacheable else None
    if x is None:
        x = torch.stack([transform(Image.fromarray(np.asarray(im))) for im in images])
        held = sum(t.nbytes for t in _PREPROCESSED.values())
        if cacheable and held + x.nbytes <= PREPROCESSED_BYTES:
            _PREPROCESSED[key] = x
    # a clone: a job that writes into its inputs cannot change the next job's
    return TensorDataset(x.clone(), torch.as_tensor(targets, dtype=torch.int64))
