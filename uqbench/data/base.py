"""The contract every dataset fulfils.

A dataset is built by Hydra from ``conf/dataset/<name>.yaml``. The runner calls
``setup(backbone)`` once (preprocessing can depend on the backbone: image size, mean/std,
tokenizer), then asks for loaders by split name. Loaders yield ``(inputs, targets)``.

Split kinds, declared by the dataset, tell the runner what to compute on each split:

- ``train`` / ``val``: training and model selection (``val`` may be absent).
- ``eval_splits``: evaluated with the task's standard metrics, keyed ``<split>/<metric>``.
  A split named ``a/b/c`` (e.g. ``test_c/fog/3``) is keyed ``a/b/c/<metric>`` and all splits
  sharing the first part are also averaged into ``a/mean/<metric>``.
- ``ood_splits``: out-of-distribution sets. Regression: standard metrics under ``<split>/``.
  Classification: detection metrics against ``test`` (``ood/auroc_mi`` …).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from uqbench.configs import options_where
from uqbench.contracts import DataInfo, InputBackbone, Shard


class DataModule:
    name: str = "data"
    task: str = "classification"
    eval_splits: tuple[str, ...] = ("test",)
    ood_splits: tuple[str, ...] = ()

    def __init__(self, batch_size: int = 32, eval_batch_size: int | None = None,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"dataset.batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    # -- to implement -------------------------------------------------------------------------
    def check(self) -> None:
        """Fail fast (before any model is built) if the data is missing or malformed."""

    def setup(self, backbone: InputBackbone | None = None) -> None:  # pragma: no cover
        raise NotImplementedError

    def dataset(self, split: str) -> Dataset:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def info(self) -> DataInfo:  # pragma: no cover - interface
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """Key settings recorded in results.json."""
        return {}

    def reference(self, split: str, x: Any) -> dict[str, Any]:
        """What the data knows to be true at a split's inputs, saved beside the predictions and
        scored by the task: a synthetic dataset's true noise std (``noise_std``, shape (N, d)).
        Real data knows nothing: {}."""
        return {}

    collate_fn = None  # set by datasets whose items need custom batching (e.g. tokenisation)

    # -- shared -------------------------------------------------------------------------------
    @property
    def has_val(self) -> bool:
        return True

    def loader(self, split: str, train: bool = False, shard: Shard | None = None,
               skip: int = 0, on_skip: Callable[[], None] | None = None
               ) -> DataLoader | TensorBatches:
        """Batches of ``split`` (shuffled when ``train``). With a ``shard``, each batch is one
        optimiser step's whole batch, cut into micro-batches of which this process yields its
        own (:class:`Shard`); ``skip`` global batches are passed over without being read (a
        resumed epoch), after which ``on_skip`` runs once."""
        dataset = self.dataset(split)
        batch_size = self.batch_size if train else self.eval_batch_size
        shard = shard or Shard()
        if isinstance(dataset, TensorDataset) and self.num_workers == 0:
            return TensorBatches(dataset.tensors, batch_size, shuffle=train, shard=shard,
                                 skip=skip, on_skip=on_skip)
        # every split is a map-style dataset, which has a length
        sampler = (RandomSampler(dataset) if train  # type: ignore[arg-type]
                   else SequentialSampler(dataset))  # type: ignore[arg-type]
        return DataLoader(
            dataset,
            batch_sampler=MicroBatchSampler(sampler, batch_size, shard, skip, on_skip),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn,
        )

    def num_train_batches(self) -> int:
        n = len(self.dataset("train"))  # type: ignore[arg-type]  # a map-style dataset
        return max(1, -(-n // self.batch_size))


class _Skip:
    """``skipped(step)``: True while ``step`` is one of the first ``skip``; calls ``on_skip``
    once, at the first step not skipped (or at the end, when every step was)."""

    def __init__(self, skip: int, on_skip: Callable[[], None] | None) -> None:
        self.skip, self.on_skip = skip, on_skip

    def __call__(self, step: int) -> bool:
        if step < self.skip:
            return True
        if self.on_skip is not None:
            self.on_skip()
            self.on_skip = None
        return False


class MicroBatchSampler:
    """Index lists for a DataLoader: the batches of ``BatchSampler(sampler, batch_size)``, each
    cut into this process's micro-batches (:class:`Shard`); the first ``skip`` batches are
    drawn but not yielded. With the default shard and no skip it yields exactly the batches of
    ``DataLoader(shuffle=…, batch_size=…)``, drawing the same random numbers."""

    def __init__(self, sampler: Any, batch_size: int, shard: Shard, skip: int = 0,
                 on_skip: Callable[[], None] | None = None) -> None:
        self.batches = BatchSampler(sampler, batch_size, drop_last=False)
        self.n, self.batch_size = len(sampler), batch_size
        self.shard, self.skip, self.on_skip = shard, skip, on_skip

    def __len__(self) -> int:
        return self.shard.micro_batches(self.n, self.batch_size, self.skip)

    def __iter__(self) -> Iterator[list[int]]:
        sizes = self.shard.steps(self.n, self.batch_size)
        skipped = _Skip(self.skip, self.on_skip)
        for step, batch in enumerate(self.batches):
            if step >= len(sizes):
                break
            if skipped(step):
                continue
            for start, stop in self.shard.slices(len(batch)):
                yield batch[start:stop]
        skipped(len(sizes))


class TensorBatches:
    """Mini-batches of in-memory tensors by slicing: a DataLoader without per-item collation.

    For small tabular data (the regression benchmarks) collation dominates a training step;
    slicing whole tensors is ~10× cheaper. Shuffling draws from torch's global generator, so
    it follows the run's seed.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int,
                 shuffle: bool = False, shard: Shard | None = None, skip: int = 0,
                 on_skip: Callable[[], None] | None = None) -> None:
        self.tensors, self.batch_size, self.shuffle = tensors, batch_size, shuffle
        self.shard, self.skip, self.on_skip = shard or Shard(), skip, on_skip

    def __len__(self) -> int:
        return self.shard.micro_batches(len(self.tensors[0]), self.batch_size, self.skip)

    def __iter__(self):
        n = len(self.tensors[0])
        order = torch.randperm(n) if self.shuffle else None
        sizes = self.shard.steps(n, self.batch_size)
        skipped = _Skip(self.skip, self.on_skip)
        for step, size in enumerate(sizes):
            if skipped(step):
                continue
            first = step * self.batch_size
            for start, stop in self.shard.slices(size):
                if order is None:
                    yield tuple(t[first + start:first + stop] for t in self.tensors)
                else:
                    idx = order[first + start:first + stop]
                    yield tuple(t[idx] for t in self.tensors)
        skipped(len(sizes))


def check_modality(dataset: str, backbone: InputBackbone | None,
                   modality: str) -> InputBackbone:
    """The backbone, which must take the data's kind of input (image, text, tabular)."""
    got = None if backbone is None else backbone.modality
    if got != modality:
        name = "no backbone" if backbone is None else f"backbone '{backbone.name}'"
        raise ValueError(
            f"the modalities do not match: dataset '{dataset}' holds {modality} inputs but "
            f"{name} takes {got or 'no'} inputs; pick a {modality} backbone, one of: "
            f"{', '.join(options_where('backbone', 'modality', modality))}")
    assert backbone is not None  # a backbone of the right modality
    return backbone


def image_shape(backbone: InputBackbone) -> tuple[int, int, int]:
    """(3, H, W): the images the backbone takes (the image datasets' default where it says
    nothing)."""
    from uqbench.data.transforms import DEFAULT_DATA_CONFIG

    c, h, w = (int(v) for v in (backbone.data_config() or DEFAULT_DATA_CONFIG)["input_size"])
    return c, h, w


def check_image_size(dataset: str, size: int, backbone: InputBackbone) -> None:
    """Images of ``size`` px must be what the backbone takes, unless it takes any size."""
    if backbone.dynamic_image_size:
        return
    expected = image_shape(backbone)[1:]
    if (size, size) != expected:
        raise ValueError(
            f"dataset.image_size={size} but backbone '{backbone.name}' takes "
            f"{expected[0]}×{expected[1]} px images; set dataset.image_size=null (the backbone's "
            f"size) or build the backbone at {size} px (backbone.model_kwargs.img_size={size})")


def resolve_names(spec: Any, presets: dict[str, tuple[str, ...]], valid: Sequence[str],
                  key: str, what: str = "name") -> tuple[str, ...]:
    """A config value naming a subset of ``valid``: null (none), a preset's name, one name or a
    list of names (each once) → the names, or a ValueError listing the presets and the names."""
    if spec is None or spec in ("none", "null", ""):
        return ()
    if isinstance(spec, str):
        if spec in presets:
            return presets[spec]
        spec = [spec]
    names = [str(c) for c in spec]
    unknown = [c for c in names if c not in valid]
    if unknown:
        choices = ", ".join(f"'{k}' ({len(v)})" for k, v in presets.items())
        raise ValueError(f"unknown {what}(s) {unknown} in {key}; valid: {choices}, null, or a "
                         f"list of: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{key} lists a {what} twice: {names}")
    return tuple(names)
