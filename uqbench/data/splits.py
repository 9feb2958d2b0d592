"""What every dataset read from the data root shares: a root, the on-disk datasets it needs,
a dict of splits built in ``setup``, and the seeded validation hold-out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from uqbench.contracts import DataInfo
from uqbench.data.base import DataModule
from uqbench.data.on_disk import require


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded random hold-out: (train indices, val indices), each sorted, disjoint, covering
    range(n); ``round(fraction · n)`` go to validation."""
    if not 0 <= fraction < 1:
        raise ValueError(f"dataset.val_fraction must be in [0, 1), got {fraction} "
                         f"(0 = no validation split)")
    n_val = int(round(n * fraction))
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


class ListDataset(Dataset):
    """Items held in a list (text examples; batching is the collate function's job)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


class SplitDataModule(DataModule):
    """A classification dataset on disk. Subclasses set ``layouts`` (the on-disk datasets they
    need, :mod:`uqbench.data.on_disk`) and ``num_classes``, and fill ``self._datasets`` in
    ``setup``."""

    layouts: tuple[str, ...] = ()
    num_classes: int = 0

    def __init__(self, root: str | Path, name: str, batch_size: int = 16,
                 eval_batch_size: int | None = None, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        super().__init__(batch_size, eval_batch_size, num_workers, pin_memory)
        self.root = Path(root).expanduser()
        self.name = name
        self._datasets: dict[str, Dataset] | None = None

    def check(self) -> None:
        """Fail at once, reading no examples, if a needed dataset is missing or partial."""
        for layout in self.layouts:
            require(layout, self.root)

    def splits(self) -> tuple[str, ...]:
        return tuple(self._require_setup())

    def dataset(self, split: str) -> Dataset:
        datasets = self._require_setup()
        if split not in datasets:
            raise KeyError(f"dataset '{self.name}' has no split '{split}'; "
                           f"valid splits: {', '.join(datasets)}")
        return datasets[split]

    @property
    def has_val(self) -> bool:
        return "val" in self._require_setup()

    @property
    def info(self) -> DataInfo:
        self._require_setup()
        return DataInfo(task="classification", num_classes=self.num_classes,
                        num_train_batches=self.num_train_batches())

    def settings(self) -> dict[str, Any]:
        if self._datasets is None:
            return {}
        return {"sizes": {s: len(d)  # type: ignore[arg-type]  # map-style datasets
                          for s, d in self._datasets.items()
                          if not s.startswith("test_c/")}}

    def _require_setup(self) -> dict[str, Dataset]:
        if self._datasets is None:
            raise RuntimeError(f"dataset '{self.name}': call setup(backbone) before asking for "
                               f"splits, loaders or info")
        return self._datasets
