"""SST-2 (GLUE) and ARC-Easy, read from Hugging Face datasets saved under the data root.

    sst2/       GLUE sst2 (`save_to_disk` folder, or <split>-*.parquet): sentence, label, idx
    arc_easy/   allenai/ai2_arc ARC-Easy: id, question, choices{text, label}, answerKey

Tokenisation comes from the backbone: ``backbone.tokenizer()`` (a Hugging Face tokenizer) and
``backbone.max_length`` (``dataset.max_length`` overrides it; 128 when neither is set).
Batches are ``(inputs, labels)``: ``inputs`` a dict of tensors, ``labels`` (B,) int64.

SST-2: GLUE's test labels are hidden (all -1), so ``test`` is GLUE's *validation* split (872
sentences, as the papers report) and ``val`` — for model selection — is a seeded hold-out of
GLUE's train (``val_fraction``, ``split_seed``); ``train`` is the rest. Inputs: the tokenizer's
``input_ids``, ``attention_mask`` [, ``token_type_ids``], each (B, L).

ARC-Easy: official train / validation (→ ``val``) / test. Choice labels are letters "A".."E" or
digits "1".."5" and a question has 3–5 choices; both are normalised to positions 0..4, lettered
A–E, and the answer to its position. Two formats (``dataset.format``; default ``causal_lm``,
P1's LLaMA-2-7B setup):

- ``encoder`` (multiple-choice scoring, e.g. BERT): every (question, choice) pair is encoded;
  inputs ``input_ids``, ``attention_mask`` [, ``token_type_ids``] of shape (B, C_max, L) with
  C_max = 5 and ``choice_mask`` (B, C_max) bool marking real choices. A missing choice is
  encoded as (question, "") so no row is all padding; methods must mask its logit.
- ``causal_lm`` (next-token scoring, e.g. LLaMA): the prompt of :func:`arc_prompt`; inputs
  ``input_ids``, ``attention_mask`` (B, L) right-padded, ``last_index`` (B,) the position of
  the prompt's last token (read the answer-letter logits there) and ``choice_mask`` (B, 5);
  ``data.answer_token_ids`` holds the token id of each answer letter " A" … " E".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from uqbench.contracts import DataInfo
from uqbench.data.layout import LAYOUTS, DatasetCorruptError, hf_split_files
from uqbench.data.splits import ListDataset, SplitDataModule, holdout_split

LETTERS = "ABCDE"
DEFAULT_MAX_LENGTH = 128
FORMATS = ("encoder", "causal_lm")


# --- reading ------------------------------------------------------------------------------------

def read_hf_split(name: str, root: str | Path, split: str, columns: tuple[str, ...]
                  ) -> list[dict[str, Any]]:
    """Rows of one split of a Hugging Face dataset saved under the data root, as dicts."""
    folder = LAYOUTS[name].path(root)
    kind, files = hf_split_files(folder, split)  # presence was checked by require()
    if kind == "arrow":
        import datasets

        table = datasets.load_from_disk(str(files[0])).data.table
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.concat_tables([pq.read_table(f) for f in files])
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DatasetCorruptError(
            f"{folder} split '{split}' lacks column(s) {missing} (has {table.column_names}); "
            f"expected {LAYOUTS[name].expected}; re-fetch with "
            f"`uqbench-data download {name} --force`")
    return table.select(list(columns)).to_pylist()


@dataclass(frozen=True)
class MultipleChoice:
    """One ARC question: choices in order (lettered A, B, … by position), answer = position."""

    id: str
    question: str
    choices: tuple[str, ...]
    answer: int


def normalise_arc(row: dict[str, Any]) -> MultipleChoice:
    """ARC row (labels letters or digits, 3–5 choices) → :class:`MultipleChoice`."""
    texts, labels = list(row["choices"]["text"]), [str(x) for x in row["choices"]["label"]]
    key = str(row["answerKey"])
    if not 2 <= len(texts) <= len(LETTERS) or len(texts) != len(labels) \
            or len(set(labels)) != len(labels) or key not in labels:
        raise DatasetCorruptError(
            f"ARC question {row.get('id')!r}: choices {labels} / answerKey {key!r} are not "
            f"2–5 distinct labels containing the answer; re-fetch with "
            f"`uqbench-data download arc_easy --force`")
    return MultipleChoice(str(row["id"]), str(row["question"]), tuple(texts), labels.index(key))


def arc_prompt(question: str, choices: tuple[str, ...] | list[str]) -> tuple[str, list[str]]:
    """Prompt with lettered choices, and the answer strings that continue it.

    >>> arc_prompt("2+2?", ["3", "4"])
    ('Question: 2+2?\\nA. 3\\nB. 4\\nAnswer:', [' A', ' B'])
    """
    lines = [f"Question: {question}"]
    lines += [f"{LETTERS[i]}. {text}" for i, text in enumerate(choices)]
    lines.append("Answer:")
    return "\n".join(lines), [f" {LETTERS[i]}" for i in range(len(choices))]


def answer_token_ids(tokenizer: Any, prompt: str, answers: list[str]) -> list[int]:
    """Token id that each answer string starts with when it follows ``prompt``.

    Found by tokenising prompt and prompt + answer and taking the first new token, so the
    tokenizer's own handling of the leading space (" A" → "▁A", "ĠA", …) is respected.
    """
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = []
    for answer in answers:
        full = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
        if len(full) <= len(base) or full[:len(base)] != base:
            raise ValueError(f"tokenizer merges the answer {answer!r} into the prompt's last "
                             f"token; cannot score answers by next-token logits")
        ids.append(full[len(base)])
    if len(set(ids)) != len(ids):
        raise ValueError(f"answers {answers} share a first token: {ids}")
    return ids


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


def _choice_mask(batch: list[MultipleChoice]) -> torch.Tensor:
    return torch.tensor([[c < len(ex.choices) for c in range(len(LETTERS))] for ex in batch])


class ChoiceCollator:
    """[MultipleChoice] → ({input_ids, attention_mask[, token_type_ids]: (B, C_max, L),
    choice_mask: (B, C_max)}, answers (B,)); C_max = 5."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer, self.max_length = tokenizer, max_length

    def __call__(self, batch: list[MultipleChoice]) -> tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]:
        c_max = len(LETTERS)
        questions = [ex.question for ex in batch for _ in range(c_max)]
        choices = [ex.choices[c] if c < len(ex.choices) else ""
                   for ex in batch for c in range(c_max)]
        enc = self.tokenizer(questions, choices, padding=True, truncation=True,
                             max_length=self.max_length, return_tensors="pt")
        inputs = {k: v.view(len(batch), c_max, -1) for k, v in enc.items()}  # (B, C_max, L)
        inputs["choice_mask"] = _choice_mask(batch)
        return inputs, torch.tensor([ex.answer for ex in batch], dtype=torch.long)


class PromptCollator:
    """[MultipleChoice] → ({input_ids, attention_mask: (B, L) right-padded, last_index: (B,),
    choice_mask: (B, 5)}, answers (B,)). Prompts are never truncated (that would cut the
    question or the "Answer:" the letter logits are read after)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)

    def __call__(self, batch: list[MultipleChoice]) -> tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]:
        ids = self.tokenizer([arc_prompt(ex.question, ex.choices)[0] for ex in batch])["input_ids"]
        lengths = torch.tensor([len(x) for x in ids])
        input_ids = torch.full((len(batch), int(lengths.max())), self.pad_id, dtype=torch.long)
        for i, x in enumerate(ids):
            input_ids[i, :len(x)] = torch.tensor(x)
        attention_mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "last_index": lengths - 1, "choice_mask": _choice_mask(batch)}
        return inputs, torch.tensor([ex.answer for ex in batch], dtype=torch.long)


# --- the datasets -------------------------------------------------------------------------------

def backbone_tokenizer(backbone: Any, dataset: str) -> Any:
    """The backbone's Hugging Face tokenizer, or a clear error for non-text backbones."""
    get = getattr(backbone, "tokenizer", None)
    if get is None:
        kind = "no backbone" if backbone is None else f"backbone {type(backbone).__name__}"
        raise ValueError(
            f"dataset '{dataset}' is text and needs a tokenizer, but {kind} provides none "
            f"(no `tokenizer()` method); pick a Hugging Face text backbone (e.g. BERT for "
            f"sst2, LLaMA for arc_easy with dataset.format=causal_lm)")
    return get if hasattr(get, "pad_token_id") else get()  # a tokenizer attribute or a method


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

    def setup(self, backbone: Any = None) -> None:
        self.check()
        self.tokenizer = backbone_tokenizer(backbone, self.name)
        self.max_length = int(self.max_length_override or getattr(backbone, "max_length", None)
                              or DEFAULT_MAX_LENGTH)
        self._datasets = self.build()
        self.collate_fn = self.make_collate()

    def build(self) -> dict[str, ListDataset]:  # pragma: no cover - interface
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

    def build(self) -> dict[str, ListDataset]:
        train = self._rows("train")
        train_idx, val_idx = holdout_split(len(train), self.val_fraction, self.split_seed)
        out = {"train": ListDataset([train[i] for i in train_idx])}
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


class ARCEasyData(TextDataModule):
    """ARC-Easy multiple choice (up to 5 choices): official train / validation / test."""

    num_classes = len(LETTERS)
    layouts = ("arc_easy",)

    def __init__(self, root: str | Path, name: str = "arc_easy", format: str = "causal_lm",
                 **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        if format not in FORMATS:
            raise ValueError(f"dataset.format '{format}' is unknown; valid: "
                             f"{', '.join(FORMATS)} (encoder = multiple-choice scoring, "
                             f"causal_lm = lettered prompt, next-token scoring)")
        self.format = format
        self.answer_token_ids: list[int] | None = None

    def build(self) -> dict[str, ListDataset]:
        columns = ("id", "question", "choices", "answerKey")
        return {ours: ListDataset([normalise_arc(r) for r in
                                   read_hf_split("arc_easy", self.root, theirs, columns)])
                for ours, theirs in (("train", "train"), ("val", "validation"),
                                     ("test", "test"))}

    @property
    def info(self) -> DataInfo:
        # encoder format: the method scores each (question, choice) pair
        return replace(super().info, multiple_choice=self.format == "encoder",
                       answer_token_ids=self.answer_token_ids)

    def make_collate(self) -> ChoiceCollator | PromptCollator:
        if self.format == "encoder":
            return ChoiceCollator(self.tokenizer, self.max_length)
        prompt, answers = arc_prompt("?", list(LETTERS))
        self.answer_token_ids = answer_token_ids(self.tokenizer, prompt, answers)
        return PromptCollator(self.tokenizer)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"format": self.format}
