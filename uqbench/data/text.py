"""Text classification read from Hugging Face datasets saved under the data root: SST-2.

    sst2/       GLUE sst2 (`save_to_disk` folder, or <split>-*.parquet): sentence, label, idx

Tokenisation comes from the backbone: ``backbone.tokenizer()`` (a Hugging Face tokenizer) and
``backbone.max_length`` (``dataset.max_length`` overrides it; 128 when neither is set).
Batches are ``(inputs, labels)``: ``inputs`` a dict of tensors, ``labels`` (B,) int64.
:class:`TextDataModule` and :func:`read_hf_split` serve every text dataset (ARC-Easy:
``uqbench.data.arc``).

SST-2: GLUE's test labels are hidden (all -1), so ``test`` is GLUE's *validation* split (872
sentences, as the papers report) and ``val`` — for model selection — is a seeded hold-out of
GLUE's train (``val_fraction``, ``split_seed``); ``train`` is the rest. Inputs: the tokenizer's
``input_ids``, ``attention_mask`` [, ``token_type_ids``], each (B, L).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from uqbench.contracts import InputBackbone
from uqbench.data.base import check_modality
from uqbench.data.on_disk import LAYOUTS, DatasetCorruptError, hf_split_files
from uqbench.data.splits import ListDataset, SplitDataModule, holdout_split

DEFAULT_MAX_LENGTH = 128


# --- reading ------------------------------------------------------------------------------------

def read_hf_split(name: str, root: str | Path, split: str, columns: tuple[str, ...]
                  ) -> list[dict[str, Any]]:
    """Rows of one split of a Hugging Face dataset saved under the data root, as dicts."""
    folder = LAYOUTS[name].path(root)
    kind, files = hf_split_files(folder, split)  # type: ignore[misc]  # require() checked it
    import pyarrow as pa

    try:
        if kind == "arrow":
            import datasets

            table = datasets.load_from_disk(str(files[0])).data.table
        else:
            import pyarrow.parquet as pq

            table = pa.concat_tables([pq.read_table(f) for f in files])
    except (pa.ArrowException, OSError, ValueError) as err:  # garbage or truncated files
        raise DatasetCorruptError(
            f"{folder} split '{split}' cannot be read, a file is corrupt or truncated "
            f"({type(err).__name__}: {err}); re-fetch with "
            f"`uqbench-data download {name} --force`") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DatasetCorruptError(
            f"{folder} split '{split}' lacks column(s) {missing} (has {table.column_names}); "
            f"expected {LAYOUTS[name].expected}; re-fetch with "
            f"`uqbench-data download {name} --force`")
    return table.select(list(columns)).to_pylist()


# --- batching -----------------------------------------------------------------------------------

class SentenceCollator:
    """[(sentence, label)] → (tokenizer outputs (B, L), labels (B,))."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: list[tuple[str, int]]) -> tuple[dict[str, torch.Tensor],
                                                              torch.Tensor]:
        sentences, labels = zip(*batch, strict=True)
        inputs = self.tokenizer(list(sentences), padding=True, truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        return dict(inputs), torch.tensor(labels, dtype=torch.long)


# --- the datasets -------------------------------------------------------------------------------

def backbone_tokenizer(backbone: InputBackbone | None, dataset: str) -> Any:
    """The text backbone's Hugging Face tokenizer; any other backbone is refused by name."""
    return check_modality(dataset, backbone, "text").tokenizer()


class TextDataModule(SplitDataModule):
    """A text classification dataset: tokenizer and max_length from the backbone at setup."""

    def __init__(self, root: str | Path, name: str, max_length: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        if max_length is not None and int(max_length) < 8:
            raise ValueError(f"dataset.max_length must be >= 8 tokens or null, got {max_length}")
        self.max_length_override = None if max_length is None else int(max_length)
        self.tokenizer: Any = None
        self.max_length = DEFAULT_MAX_LENGTH

    def setup(self, backbone: InputBackbone | None = None) -> None:
        self.check()
        self.tokenizer = backbone_tokenizer(backbone, self.name)
        assert backbone is not None  # backbone_tokenizer refuses None
        self.max_length = int(self.max_length_override or backbone.max_length
                              or DEFAULT_MAX_LENGTH)
        self._datasets = self.build()
        self.collate_fn = self.make_collate()

    def build(self) -> dict[str, Dataset]:  # pragma: no cover - interface
        raise NotImplementedError

    def make_collate(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"max_length": self.max_length}


class SST2Data(TextDataModule):
    """GLUE SST-2: binary sentiment. test = GLUE validation (GLUE's test labels are hidden)."""

    num_classes = 2
    layouts = ("sst2",)

    def __init__(self, root: str | Path, name: str = "sst2", val_fraction: float = 0.1,
                 split_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        self.val_fraction, self.split_seed = float(val_fraction), int(split_seed)
        holdout_split(1, self.val_fraction, 0)  # validates the fraction now

    def _rows(self, split: str) -> list[tuple[str, int]]:
        rows = read_hf_split("sst2", self.root, split, ("sentence", "label"))
        bad = sorted({r["label"] for r in rows} - {0, 1})
        if bad:
            raise DatasetCorruptError(
                f"SST-2 split '{split}' has labels {bad}; expected 0 (negative) / 1 (positive); "
                f"re-fetch with `uqbench-data download sst2 --force`")
        return [(str(r["sentence"]), int(r["label"])) for r in rows]

    def build(self) -> dict[str, Dataset]:
        train = self._rows("train")
        train_idx, val_idx = holdout_split(len(train), self.val_fraction, self.split_seed)
        out: dict[str, Dataset] = {"train": ListDataset([train[i] for i in train_idx])}
        if len(val_idx):
            out["val"] = ListDataset([train[i] for i in val_idx])
        out["test"] = ListDataset(self._rows("validation"))
        return out

    def make_collate(self) -> SentenceCollator:
        return SentenceCollator(self.tokenizer, self.max_length)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "val_fraction": self.val_fraction, "split_seed": self.split_seed,
            "test_split": "GLUE validation (GLUE test labels are hidden)",
            "val_split": "seeded hold-out of GLUE train"}
