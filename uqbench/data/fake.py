"""Seeded synthetic classification data, so that every method runs end to end in seconds.

- ``fake_images``: images (3, H, W) = signal · prototype[y] + N(0, 1), one random prototype per
  class; H, W follow the backbone's ``data_config()['input_size']`` unless ``image_size`` is set.
  OOD split: images from prototypes of classes never seen in training.
- ``fake_text``: sentences of random filler words with a class keyword mixed in, tokenised by
  the backbone's tokenizer (padded to ``max_length``). OOD split: sentences of other words.

Splits: train, val, test (eval) and ood. Each split has its own seed derived from ``seed``.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from uqbench.contracts import DataInfo, InputBackbone
from uqbench.data.base import DataModule, check_image_size, check_modality, image_shape

SPLITS = ("train", "val", "test", "ood")


class _FakeData(DataModule):
    task = "classification"
    eval_splits = ("test",)
    ood_splits = ("ood",)

    def __init__(self, name: str, num_classes: int, sizes: dict[str, int], seed: int,
                 batch_size: int, eval_batch_size: int | None, num_workers: int,
                 pin_memory: bool) -> None:
        super().__init__(batch_size, eval_batch_size, num_workers, pin_memory)
        if int(num_classes) < 2:
            raise ValueError(f"dataset.num_classes must be >= 2, got {num_classes}")
        for split, n in sizes.items():
            if int(n) < 1:
                raise ValueError(f"dataset.n_{split} must be >= 1, got {n}")
        self.name, self.num_classes, self.seed = name, int(num_classes), int(seed)
        self.sizes = {k: int(v) for k, v in sizes.items()}
        self._datasets: dict[str, Dataset] | None = None

    def split_seed(self, split: str) -> int:
        return self.seed * 1000 + SPLITS.index(split)

    def dataset(self, split: str) -> Dataset:
        if self._datasets is None:
            raise RuntimeError(f"dataset '{self.name}': call setup(backbone) first")
        if split not in self._datasets:
            raise KeyError(f"dataset '{self.name}' has no split '{split}'; valid splits: "
                           f"{', '.join(self._datasets)}")
        return self._datasets[split]

    @property
    def info(self) -> DataInfo:
        return DataInfo(task="classification", num_classes=self.num_classes,
                        num_train_batches=self.num_train_batches())

    def settings(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "sizes": self.sizes, "seed": self.seed}


class FakeImages(_FakeData):
    """Random class-prototype images; see the module docstring."""

    def __init__(self, name: str = "fake_images", num_classes: int = 4, n_train: int = 64,
                 n_val: int = 32, n_test: int = 32, n_ood: int = 32,
                 image_size: int | None = None, signal: float = 1.0, seed: int = 0,
                 batch_size: int = 16, eval_batch_size: int | None = None,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        sizes = {"train": n_train, "val": n_val, "test": n_test, "ood": n_ood}
        super().__init__(name, num_classes, sizes, seed, batch_size, eval_batch_size,
                         num_workers, pin_memory)
        self.image_size = None if image_size is None else int(image_size)
        self.signal = float(signal)
        self.shape: tuple[int, int, int] | None = None

    def setup(self, backbone: InputBackbone | None = None) -> None:
        if backbone is None and self.image_size is not None:  # the data alone (tests, figures)
            self.shape = (3, self.image_size, self.image_size)
        else:
            backbone = check_modality(self.name, backbone, "image")
            if self.image_size is not None:
                check_image_size(self.name, self.image_size, backbone)
            self.shape = image_shape(backbone)
        shape = self.shape
        g = torch.Generator().manual_seed(self.seed)
        prototypes = torch.randn(2 * self.num_classes, *shape, generator=g)
        self._datasets = {}
        for split, n in self.sizes.items():
            g = torch.Generator().manual_seed(self.split_seed(split))
            y = torch.randint(self.num_classes, (n,), generator=g)
            proto = prototypes[y + self.num_classes] if split == "ood" else prototypes[y]
            x = self.signal * proto + torch.randn(n, *shape, generator=g)
            self._datasets[split] = TensorDataset(x, y)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"shape": list(self.shape or ()), "signal": self.signal}


class TokenDataset(Dataset):
    """Pre-tokenised sequences: items ({input_ids, attention_mask, …: (T,)}, label)."""

    def __init__(self, encodings: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.encodings, self.labels = encodings, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        return {k: v[i] for k, v in self.encodings.items()}, int(self.labels[i])


FILLER = ("the a movie film story plot actor scene was is it very quite rather this that and "
          "but with of to".split())
KEYWORDS = ("good bad great awful funny boring lovely terrible".split())
OOD_WORDS = ("seven blue river engine market winter copper planet".split())


class FakeText(_FakeData):
    """Sentences of filler words with class keyword(s); see the module docstring."""

    def __init__(self, name: str = "fake_text", num_classes: int = 2, n_train: int = 64,
                 n_val: int = 32, n_test: int = 32, n_ood: int = 32, words: int = 8,
                 seed: int = 0, batch_size: int = 16, eval_batch_size: int | None = None,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        if not 2 <= int(num_classes) <= len(KEYWORDS):
            raise ValueError(f"dataset.num_classes must be in [2, {len(KEYWORDS)}] for "
                             f"fake_text, got {num_classes}")
        sizes = {"train": n_train, "val": n_val, "test": n_test, "ood": n_ood}
        super().__init__(name, num_classes, sizes, seed, batch_size, eval_batch_size,
                         num_workers, pin_memory)
        self.words = int(words)

    def sentences(self, split: str) -> tuple[list[str], list[int]]:
        rng = random.Random(self.split_seed(split))
        texts, labels = [], []
        for _ in range(self.sizes[split]):
            y = rng.randrange(self.num_classes)
            pool = OOD_WORDS if split == "ood" else FILLER
            words = [rng.choice(pool) for _ in range(self.words)]
            if split != "ood":
                words[rng.randrange(self.words)] = KEYWORDS[y]
            texts.append(" ".join(words))
            labels.append(y)
        return texts, labels

    def setup(self, backbone: InputBackbone | None = None) -> None:
        backbone = check_modality(self.name, backbone, "text")
        tok = backbone.tokenizer()
        self._datasets = {}
        for split in self.sizes:
            texts, labels = self.sentences(split)
            enc = tok(texts, padding="max_length", truncation=True,
                      max_length=backbone.max_length, return_tensors="pt")
            self._datasets[split] = TokenDataset(dict(enc), torch.tensor(labels))
