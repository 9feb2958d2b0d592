"""ARC-Easy (allenai/ai2_arc, config ARC-Easy) read from the data root, in two formats.

    arc_easy/   id, question, choices{text, label}, answerKey (`save_to_disk` or parquet)

Official train / validation (→ ``val``) / test. Choice labels are letters "A".."E" or digits
"1".."5" and a question has 3–5 choices; both are normalised to positions 0..4, lettered A–E,
and the answer to its position. Two formats (``dataset.format``; default ``causal_lm``, P1's
LLaMA-2-7B setup):

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
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from uqbench.contracts import DataInfo, one_of
from uqbench.data.on_disk import DatasetCorruptError
from uqbench.data.splits import ListDataset
from uqbench.data.text import TextDataModule, read_hf_split

LETTERS = "ABCDE"
# encoder: multiple-choice scoring; causal_lm: a lettered prompt, scored by the next token
Format = Literal["encoder", "causal_lm"]


# --- questions and prompts ----------------------------------------------------------------------

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


# --- batching ----------------------------------------------------------------------------------

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


# --- the dataset -------------------------------------------------------------------------------

class ARCEasyData(TextDataModule):
    """ARC-Easy multiple choice (up to 5 choices): official train / validation / test."""

    num_classes = len(LETTERS)
    layouts = ("arc_easy",)

    def __init__(self, root: str | Path, name: str = "arc_easy", format: Format = "causal_lm",
                 **kwargs: Any) -> None:
        super().__init__(root, name, **kwargs)
        self.format = one_of("dataset.format", format, Format)
        self.answer_token_ids: list[int] | None = None

    def build(self) -> dict[str, Dataset]:
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
