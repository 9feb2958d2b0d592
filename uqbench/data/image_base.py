"""What the image datasets share: the DataModule skeleton and array/file-backed datasets.

Items are ``(image, label)``: a (3, H, W) float tensor from the backbone's preprocessing
(:mod:`uqbench.data.transforms`) and an int class index; the default collate makes batches
``((B, 3, H, W), (B,))``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import default_loader

from uqbench.contracts import InputBackbone
from uqbench.data.base import check_modality
from uqbench.data.splits import SplitDataModule
from uqbench.data.transforms import ImagePreprocessing


class ArrayImageDataset(Dataset):
    """Images held in memory as uint8 (N, H, W, 3); ``indices`` selects a subset without a copy."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable,
                 indices: np.ndarray | None = None) -> None:
        self.images, self.labels, self.transform = images, labels, transform
        self.indices = np.arange(len(labels)) if indices is None else np.asarray(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        j = self.indices[i]
        return self.transform(Image.fromarray(self.images[j])), int(self.labels[j])


class FileImageDataset(Dataset):
    """Images read from files (decoded on access, converted to RGB)."""

    def __init__(self, files: Sequence[Path], labels: Sequence[int], transform: Callable) -> None:
        self.files, self.labels, self.transform = list(files), list(labels), transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.transform(default_loader(self.files[i])), int(self.labels[i])


class ImageDataModule(SplitDataModule):
    """Skeleton of an image classification dataset read from the data root: preprocessing from
    the backbone, then ``build(train_transform, eval_transform) -> {split: Dataset}``."""

    def __init__(self, root: str | Path, name: str, batch_size: int = 16,
                 eval_batch_size: int | None = None, num_workers: int = 0,
                 pin_memory: bool = False, augment: bool = True,
                 scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3),
                 hflip: float = 0.5, crop_pct: float | None = None) -> None:
        super().__init__(root, name, batch_size, eval_batch_size, num_workers, pin_memory)
        self.augment = bool(augment)
        self.scale = tuple(float(v) for v in scale)
        self.ratio = tuple(float(v) for v in ratio)
        self.hflip = float(hflip)
        self.crop_pct = None if crop_pct is None else float(crop_pct)
        if len(self.scale) != 2 or not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"dataset.scale {list(scale)} must be [lo, hi] with "
                             f"0 < lo <= hi <= 1 (the random-resized-crop area range)")
        if not 0 <= self.hflip <= 1:
            raise ValueError(f"dataset.hflip must be a probability in [0, 1], got {hflip}")
        if self.crop_pct is not None and not 0 < self.crop_pct <= 1:
            raise ValueError(f"dataset.crop_pct must be in (0, 1] or null, got {crop_pct}")
        self.preprocessing: ImagePreprocessing | None = None

    def build(self, train_transform: Callable, eval_transform: Callable
              ) -> dict[str, Dataset]:  # pragma: no cover - interface
        raise NotImplementedError

    def setup(self, backbone: InputBackbone | None = None) -> None:
        self.check()
        if backbone is not None:  # None: timm's default preprocessing (the data alone)
            check_modality(self.name, backbone, "image")
        self.preprocessing = ImagePreprocessing.from_backbone(backbone, self.crop_pct)
        eval_tf = self.preprocessing.eval_transform()
        train_tf = self.preprocessing.train_transform(self.augment, self.scale, self.ratio,
                                                      self.hflip)
        self._datasets = self.build(train_tf, eval_tf)

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {"augment": self.augment, "scale": list(self.scale),
                               "hflip": self.hflip}
        if self.preprocessing is not None:
            out["preprocessing"] = self.preprocessing.settings()
        return out | super().settings()
