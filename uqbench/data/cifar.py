"""CIFAR-100 with its two evaluation extensions: CIFAR-10 as the OOD set, CIFAR-100-C.

Read from the data root (never the network):

    cifar-100-python/{train,test,meta}          torchvision's layout (python pickles)
    cifar-10-batches-py/test_batch, ...         CIFAR-10, only its test split is used (OOD)
    CIFAR-100-C/<corruption>.npy, labels.npy    (5·N, 32, 32, 3) uint8, severity 1 rows first

Splits: ``train`` / ``val`` (a seeded hold-out of the official train set, ``val_fraction``,
``split_seed``), ``test`` (official test), ``ood`` (CIFAR-10 test, through the same eval
preprocessing as ``test``), and one eval split ``test_c/<corruption>/<severity>`` per corruption
and severity: rows (s-1)·N … s·N of the corruption's array, N = len(labels) / 5 (10000 in the
published arrays), memory-mapped so only the rows read are loaded.

The pickles are parsed here rather than by torchvision's ``CIFAR100`` class because that class
refuses any file whose md5 differs from the published one (so tiny test copies could not go
through the same code); the parsing is the same (``pickle.load(f, encoding="latin1")``, keys
``data`` and ``fine_labels``/``labels``), and ``uqbench-data list --verify`` runs torchvision's
md5 check on the real files.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from uqbench.data.base import resolve_names
from uqbench.data.image_base import ArrayImageDataset, ImageDataModule
from uqbench.data.on_disk import (
    ALL_CORRUPTIONS,
    LAYOUTS,
    SEVERITIES,
    STANDARD_CORRUPTIONS,
    DatasetCorruptError,
    check_cifar_c_file,
    check_cifar_c_labels,
    missing_error,
)
from uqbench.data.splits import holdout_split


def read_cifar(folder: Path, files: Sequence[str], dataset: str
               ) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 32, 32, 3) uint8 and labels (N,) int64 from CIFAR python pickles."""
    images: list[np.ndarray] = []
    labels: list[int] = []
    for name in files:
        path = folder / name
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="latin1")
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                ImportError, IndexError) as err:  # what unpickling garbage or a cut file raises
            raise DatasetCorruptError(
                f"{path} is corrupt or truncated ({type(err).__name__}: {err}); re-fetch with "
                f"`uqbench-data download {dataset} --force`") from None
        if not isinstance(entry, dict):
            raise DatasetCorruptError(
                f"{path} is not a CIFAR batch (it holds a {type(entry).__name__}); re-fetch "
                f"with `uqbench-data download {dataset} --force`")
        # The published pickles (Python 2) load with str keys; ones written by Python 3 with
        # bytes keys (b"data", as `pickle.load(f, encoding="bytes")` shows them) are accepted too.
        entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
        data = entry.get("data")
        targets = entry.get("fine_labels", entry.get("labels"))
        if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 \
                or targets is None or len(targets) != len(data):
            shape = getattr(data, "shape", None)
            raise DatasetCorruptError(
                f"{path} is not a CIFAR batch: expected 'data' (N, 3072) uint8 and N "
                f"'fine_labels'/'labels', got data shape {shape} and "
                f"{None if targets is None else len(targets)} labels; "
                f"re-fetch with `uqbench-data download {dataset} --force`")
        images.append(data.astype(np.uint8, copy=False))
        labels.extend(int(t) for t in targets)
    # CHW rows → HWC images, as torchvision does
    return (np.concatenate(images).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).copy(),
            np.asarray(labels, dtype=np.int64))


def resolve_corruptions(spec: Any) -> tuple[str, ...]:
    """``standard`` (15) | ``all`` (19) | a list of names | null (none) → corruption names."""
    return resolve_names(spec, {"standard": STANDARD_CORRUPTIONS, "all": ALL_CORRUPTIONS},
                         ALL_CORRUPTIONS, "dataset.corruptions", "corruption")


def resolve_severities(spec: Any) -> tuple[int, ...]:
    values = [spec] if isinstance(spec, int | str) else list(spec)
    try:
        severities = tuple(int(s) for s in values)
    except (TypeError, ValueError):
        raise ValueError(f"dataset.severities must be integers in 1–5, got {values}") from None
    bad = [s for s in severities if s not in SEVERITIES]
    if bad or not severities or len(set(severities)) != len(severities):
        raise ValueError(
            f"dataset.severities {list(severities)} is invalid: each severity must appear once "
            f"and lie in 1–5 (valid: {list(SEVERITIES)}); e.g. dataset.severities=[1,2,3,4,5]")
    return severities


class CorruptedBlock(Dataset):
    """Rows [start, stop) of a (5·N, 32, 32, 3) uint8 ``.npy`` array, memory-mapped on first use
    (per worker: the mapping is dropped when the dataset is pickled to a worker process)."""

    def __init__(self, path: Path, start: int, stop: int, labels: np.ndarray,
                 transform: Callable) -> None:
        self.path, self.start, self.stop = path, start, stop
        self.labels, self.transform = labels, transform
        self._array: np.ndarray | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> tuple[Any, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self._array is None:
            self._array = np.load(self.path, mmap_mode="r")
        image = np.array(self._array[self.start + i])  # (32, 32, 3) uint8, read from disk
        return self.transform(Image.fromarray(image)), int(self.labels[i])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}


class CIFAR100Data(ImageDataModule):
    """CIFAR-100 (100 classes) with optional OOD (CIFAR-10 test) and CIFAR-100-C eval splits."""

    num_classes = 100

    def __init__(self, root: str | Path, name: str = "cifar100", ood: bool = True,
                 corruptions: Any = None, severities: Any = SEVERITIES,
                 val_fraction: float = 0.1, split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        self.corruptions = resolve_corruptions(corruptions)
        self.severities = resolve_severities(severities)
        self.use_ood = bool(ood)
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        holdout_split(1, self.val_fraction, 0)  # validates the fraction now
        self.layouts = ("cifar100",) + (("cifar10",) if self.use_ood else ())
        self.eval_splits = ("test",) + tuple(
            f"test_c/{c}/{s}" for c in self.corruptions for s in self.severities)
        self.ood_splits = ("ood",) if self.use_ood else ()

    def check(self) -> None:
        super().check()
        if self.corruptions:
            self._corruption_rows()

    def _corruption_rows(self) -> int:
        """N images per severity; fails on missing files or arrays of the wrong shape."""
        folder = LAYOUTS["cifar100_c"].path(self.root)
        missing = [f"missing {folder / f}" for f in
                   ["labels.npy"] + [f"{c}.npy" for c in self.corruptions]
                   if not (folder / f).is_file()]
        if missing:
            present = [c for c in ALL_CORRUPTIONS if (folder / f"{c}.npy").is_file()]
            hint = (f"; or evaluate only the corruptions present: "
                    f"dataset.corruptions=[{','.join(present)}]") if present else ""
            raise missing_error("cifar100_c", self.root, missing, hint)
        rows, problem = check_cifar_c_labels(folder / "labels.npy")
        problems = [problem] if problem else [
            p for c in self.corruptions if (p := check_cifar_c_file(folder / f"{c}.npy", rows))]
        if problems:
            raise DatasetCorruptError(
                "CIFAR-100-C is present but malformed:\n" + "\n".join(f"  - {p}" for p in problems)
                + "\n  fix: re-fetch with `uqbench-data download cifar100_c --force`")
        assert rows is not None  # None comes with a problem, raised above
        return rows // 5

    def build(self, train_transform: Callable, eval_transform: Callable) -> dict[str, Dataset]:
        folder = LAYOUTS["cifar100"].path(self.root)
        images, labels = read_cifar(folder, ["train"], "cifar100")
        test_images, test_labels = read_cifar(folder, ["test"], "cifar100")
        for split, y in (("train", labels), ("test", test_labels)):
            if y.min() < 0 or y.max() >= self.num_classes:
                raise DatasetCorruptError(
                    f"{folder / split}: labels span {y.min()}..{y.max()}, expected 0..99; "
                    f"re-fetch with `uqbench-data download cifar100 --force`")
        train_idx, val_idx = holdout_split(len(labels), self.val_fraction, self.split_seed)
        out: dict[str, Dataset] = {
            "train": ArrayImageDataset(images, labels, train_transform, train_idx)}
        if len(val_idx):
            out["val"] = ArrayImageDataset(images, labels, eval_transform, val_idx)
        out["test"] = ArrayImageDataset(test_images, test_labels, eval_transform)
        if self.use_ood:
            ood_images, ood_labels = read_cifar(LAYOUTS["cifar10"].path(self.root),
                                                ["test_batch"], "cifar10")
            out["ood"] = ArrayImageDataset(ood_images, ood_labels, eval_transform)
        if self.corruptions:
            out.update(self._corrupted_splits(eval_transform))
        return out

    def _corrupted_splits(self, transform: Callable) -> dict[str, Dataset]:
        n = self._corruption_rows()
        folder = LAYOUTS["cifar100_c"].path(self.root)
        labels = np.load(folder / "labels.npy").astype(np.int64)
        if labels.min() < 0 or labels.max() >= self.num_classes:
            raise DatasetCorruptError(
                f"{folder / 'labels.npy'}: labels span {labels.min()}..{labels.max()}, expected "
                f"0..99; re-fetch with `uqbench-data download cifar100_c --force`")
        return {f"test_c/{c}/{s}": CorruptedBlock(folder / f"{c}.npy", (s - 1) * n, s * n,
                                                  labels[(s - 1) * n:s * n], transform)
                for c in self.corruptions for s in self.severities}

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "val_fraction": self.val_fraction, "split_seed": self.split_seed,
            "ood": "cifar10" if self.use_ood else None,
            "corruptions": list(self.corruptions), "severities": list(self.severities)}
