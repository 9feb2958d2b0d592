"""Oxford Flowers-102, DTD and Oxford-IIIT Pets in torchvision's on-disk layouts.

    flowers-102/jpg/image_00001.jpg, imagelabels.mat, setid.mat
    dtd/dtd/images/<class>/<file>.jpg, dtd/dtd/labels/{train,val,test}{1..10}.txt
    oxford-iiit-pet/images/<id>.jpg, oxford-iiit-pet/annotations/{trainval,test}.txt

Splits as published: Flowers-102 and DTD have official train/val/test (DTD: ``partition`` 1–10,
default 1); Pets has trainval/test, and ``val`` is a seeded hold-out of trainval
(``val_fraction``, ``split_seed``), ``train`` the rest.

DTD and Pets are read by torchvision's own classes (``download=False``). Flowers-102 is read
here, the same way torchvision does (``setid.mat``: trnid/valid/tstid, ``imagelabels.mat``:
labels 1–102), because torchvision's class refuses ``.mat`` files whose md5 differs from the
published ones, which would keep tiny test copies off the users' code path; real files are
checked against those md5s by ``uqbench-data list --verify``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset
from torchvision.datasets import DTD, OxfordIIITPet

from uqbench.data.image_base import FileImageDataset, ImageDataModule
from uqbench.data.on_disk import LAYOUTS, DatasetCorruptError, flowers_image_ids, read_pets_split
from uqbench.data.splits import holdout_split


class Flowers102Data(ImageDataModule):
    """Oxford Flowers-102: 102 classes, official train (1020) / val (1020) / test (6149)."""

    num_classes = 102
    layouts = ("flowers102",)

    def __init__(self, root: str | Path, name: str = "flowers102", **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)

    def build(self, train_transform: Callable, eval_transform: Callable) -> dict[str, Dataset]:
        from scipy.io import loadmat

        folder = LAYOUTS["flowers102"].path(self.root)
        labels = np.atleast_1d(loadmat(folder / "imagelabels.mat", squeeze_me=True)["labels"])
        labels = labels.astype(np.int64) - 1  # published labels are 1..102
        ids = flowers_image_ids(folder)
        top = max(i for split in ids.values() for i in split)
        if top > len(labels) or labels.min() < 0 or labels.max() >= self.num_classes:
            raise DatasetCorruptError(
                f"{folder}: setid.mat names image ids up to {top} but imagelabels.mat holds "
                f"{len(labels)} labels spanning {labels.min() + 1}..{labels.max() + 1} "
                f"(expected labels 1..102 for every image); re-fetch with "
                f"`uqbench-data download flowers102 --force`")
        transforms = {"train": train_transform, "val": eval_transform, "test": eval_transform}
        return {split: FileImageDataset([folder / "jpg" / f"image_{i:05d}.jpg" for i in ids[split]],
                                        [int(labels[i - 1]) for i in ids[split]], transforms[split])
                for split in ("train", "val", "test")}


class DTDData(ImageDataModule):
    """Describable Textures: 47 classes, official train/val/test of one of 10 partitions."""

    layouts = ("dtd",)

    def __init__(self, root: str | Path, name: str = "dtd", partition: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        if not isinstance(partition, int) or not 1 <= partition <= 10:
            raise ValueError(f"dataset.partition must be an integer in 1–10 (DTD's ten official "
                             f"splits), got {partition!r}")
        self.partition = partition

    def build(self, train_transform: Callable, eval_transform: Callable) -> dict[str, Dataset]:
        transforms = {"train": train_transform, "val": eval_transform, "test": eval_transform}
        out = {split: DTD(str(self.root), split=split, partition=self.partition,
                          transform=transforms[split], download=False)
               for split in ("train", "val", "test")}
        # torchvision numbers classes by the sorted class names of each split file: make sure
        # the three files agree, or the same index would mean different textures.
        classes = {split: ds.classes for split, ds in out.items()}
        if len({tuple(c) for c in classes.values()}) != 1:
            raise DatasetCorruptError(
                f"DTD partition {self.partition}: the split files name different class sets "
                f"({ {s: len(c) for s, c in classes.items()} } classes); re-fetch with "
                f"`uqbench-data download dtd --force`")
        self.num_classes = len(classes["train"])  # 47 in the published dataset
        return out

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"partition": self.partition}


class OxfordPetsData(ImageDataModule):
    """Oxford-IIIT Pets: 37 breeds; trainval split into train / val (seeded), official test."""

    num_classes = 37
    layouts = ("oxford_pets",)

    def __init__(self, root: str | Path, name: str = "oxford_pets", val_fraction: float = 0.1,
                 split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        holdout_split(1, self.val_fraction, 0)  # validates the fraction now

    def build(self, train_transform: Callable, eval_transform: Callable) -> dict[str, Dataset]:
        annotations = LAYOUTS["oxford_pets"].path(self.root) / "annotations"
        for split in ("trainval", "test"):
            labels = [label for _, label in read_pets_split(annotations, split)]
            if not labels or min(labels) < 0 or max(labels) >= self.num_classes:
                raise DatasetCorruptError(
                    f"{annotations / split}.txt: {len(labels)} lines with classes outside "
                    f"1..37 or none at all; re-fetch with `uqbench-data download oxford_pets "
                    f"--force`")

        def pets(split: str, transform: Callable) -> OxfordIIITPet:
            return OxfordIIITPet(str(self.root), split=split, target_types="category",
                                 transform=transform, download=False)

        trainval_train, trainval_eval = pets("trainval", train_transform), pets("trainval",
                                                                                 eval_transform)
        train_idx, val_idx = holdout_split(len(trainval_train), self.val_fraction,
                                           self.split_seed)
        out: dict[str, Dataset] = {"train": Subset(trainval_train, train_idx.tolist())}
        if len(val_idx):
            out["val"] = Subset(trainval_eval, val_idx.tolist())
        out["test"] = pets("test", eval_transform)
        return out

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"val_fraction": self.val_fraction,
                                     "split_seed": self.split_seed}
