"""Multiple-choice scoring: the classes of an example are its candidate answers.

A multiple-choice batch holds C candidate sequences per example, (B, C, L) tensors, and a
``choice_mask`` (B, C) that is false where an example has fewer than C choices. Every (example,
choice) pair is scored on its own as one sequence of a (B·C, L) batch; member m's logit of class
c is its score of choice c. Absent choices get the dtype's lowest value, so that a softmax gives
them probability 0 and they never win an argmax.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def mask_absent(logits: torch.Tensor, choice_mask: torch.Tensor | None) -> torch.Tensor:
    """logits (M, B, C) with the classes where ``choice_mask`` (B, C) is false set to the
    dtype's lowest value; unchanged when there is no mask."""
    if choice_mask is None:
        return logits
    return logits.masked_fill(~choice_mask.bool(), torch.finfo(logits.dtype).min)


def score_choices(score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                  inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Member logits (M, B, C) of a multiple-choice batch.

    inputs: (B, C, L) tensors plus ``choice_mask`` (B, C). ``score`` maps a dict of (B·C, L)
    tensors to member scores (M, B·C, 1), one output per (example, choice) pair.
    """
    mask = inputs["choice_mask"]                                                 # (B, C)
    B, C = mask.shape
    flat = {k: v.flatten(0, 1) for k, v in inputs.items() if k != "choice_mask"}  # (B·C, L)
    scores = score(flat)                                                         # (M, B·C, 1)
    return mask_absent(scores.reshape(scores.shape[0], B, C), mask)
