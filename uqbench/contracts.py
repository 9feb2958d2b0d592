"""The contracts several layers share: what a method reads of the data, the batch, the output.

This module imports nothing of uqbench, so data, methods, tasks and the runner can all depend on
it without depending on one another (tests/test_architecture.py enforces the import rules).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, get_args

import torch

T = TypeVar("T")
Batch = tuple[Any, torch.Tensor]  # (inputs, targets); inputs a tensor or a dict of tensors


@dataclass
class DataInfo:
    """What a method needs to know about the data to build its heads.

    task: "classification" or "regression".
    num_classes: classes (classification) — the width of each member's head.
    in_dim / out_dim: input features and targets (regression).
    num_train_batches: batches per training epoch (the ELBO's KL weight defaults to its inverse).
    multiple_choice: inputs hold C candidate sequences per example, (B, C, L) tensors plus a
        ``choice_mask`` (B, C); a method scores each candidate and the classes are the choices.
    answer_token_ids: for prompts answered by a next token (ARC-Easy as a causal LM), the token
        of each class; a causal-LM backbone then starts every member's head from the LM's rows.
    """

    task: str
    num_classes: int | None = None
    in_dim: int | None = None
    out_dim: int | None = None
    num_train_batches: int = 1
    multiple_choice: bool = False
    answer_token_ids: list[int] | None = None


class InputBackbone(Protocol):
    """What a dataset reads of the backbone it feeds (data never imports the backbones, whose
    base class declares these hooks with their defaults; see docs/extending.md)."""

    name: str
    modality: str  # image | text | tabular: the inputs the encoder takes
    max_length: int | None  # tokens per text example; None: not a text backbone
    pretrain_split: dict[str, Any] | None  # the digits split the weights were pretrained on

    @property
    def dynamic_image_size(self) -> bool:
        """Whether the encoder takes images of any size."""

    def data_config(self) -> dict[str, Any] | None:
        """Image preprocessing (input_size, mean, std, crop_pct, interpolation) or None."""

    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of a text backbone; None for the others."""


@dataclass
class RegressionOutput:
    """Predictive distribution of a regression method, all tensors of shape (B, out_dim).

    var is the total predictive variance; var_aleatoric is set where the method separates it.
    """

    mean: torch.Tensor
    var: torch.Tensor
    var_aleatoric: torch.Tensor | None = None


def one_of(key: str, value: T, choices: Any) -> T:
    """``value`` if the ``Literal`` ``choices`` lists it, else a ValueError naming the field,
    the value and the choices: for objects built in code, the check a config gets from its
    annotation before anything is built (``uqbench.configs.check_value``), in the same words."""
    options = get_args(choices)
    if value not in options:
        raise ValueError(f"{key}={value!r} is not one of: {', '.join(map(str, options))}")
    return value


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks (checkpoints, archives)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def to_device(inputs: Any, device: torch.device) -> Any:
    """Move a tensor, or a dict/list/tuple of tensors, to ``device``."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device, non_blocking=True)
    if isinstance(inputs, dict):
        return {k: to_device(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(to_device(v, device) for v in inputs)
    return inputs


def split_rows(inputs: Any, parts: int) -> list[Any]:
    """(P·B, …) → P inputs of B rows each, in order; a dict per tensor (the inverse of
    :func:`stack_streams` on the inputs)."""
    if isinstance(inputs, dict):
        pieces = {k: split_rows(v, parts) for k, v in inputs.items()}
        return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]
    if inputs.shape[0] % parts:
        raise RuntimeError(f"{inputs.shape[0]} rows do not split into {parts} equal streams")
    return list(inputs.chunk(parts))


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along rows; token tensors (B, T_i) of different lengths are right-padded
    with 0 to the longest first (padding that the attention mask, 0 there too, leaves out)."""
    if tensors[0].dim() == 2 and len({t.shape[1] for t in tensors}) > 1:
        longest = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, longest - t.shape[1])) for t in tensors]
    return torch.cat(tensors)


def stack_streams(batches: list[Any]) -> Any:
    """P batches ``(inputs, y)`` of one step, one per data stream → one batch of P·B rows,
    stream-major (stream p's rows at p·B:(p+1)·B), inputs a tensor or a dict of tensors."""
    inputs, ys = zip(*batches, strict=True)
    if isinstance(inputs[0], dict):
        stacked: Any = {k: _stack([x[k] for x in inputs]) for k in inputs[0]}
    else:
        stacked = _stack(list(inputs))
    return stacked, torch.cat(list(ys))


@dataclass(frozen=True)
class Shard:
    """This process's share of each optimiser step's batch: the step's ``n`` examples are cut
    into ``world × parts`` contiguous micro-batches (sizes differing by at most one), and
    process ``rank`` takes parts ``rank·parts … rank·parts + parts − 1``, in order (``parts`` is
    the gradient accumulation). With several processes, a final step smaller than
    ``world × parts`` is dropped, so that every process has an example in every micro-batch."""

    rank: int = 0
    world: int = 1
    parts: int = 1

    def steps(self, n: int, batch_size: int) -> list[int]:
        """The sizes of the optimiser steps' batches over an ``n``-example epoch."""
        sizes = [min(batch_size, n - start) for start in range(0, n, batch_size)]
        if self.world > 1 and sizes and sizes[-1] < self.world * self.parts:
            sizes.pop()
        return sizes

    def slices(self, n: int) -> list[tuple[int, int]]:
        """(start, stop) of this process's non-empty micro-batches of an ``n``-example step."""
        cuts = self.world * self.parts
        bounds = [n * j // cuts for j in range(cuts + 1)]
        mine = range(self.rank * self.parts, (self.rank + 1) * self.parts)
        return [(bounds[j], bounds[j + 1]) for j in mine if bounds[j + 1] > bounds[j]]

    def micro_batches(self, n: int, batch_size: int, skip: int = 0) -> int:
        """How many micro-batches this process reads in an ``n``-example epoch after passing
        over its first ``skip`` steps."""
        return sum(len(self.slices(s)) for s in self.steps(n, batch_size)[skip:])
