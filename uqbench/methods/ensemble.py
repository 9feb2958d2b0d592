"""What every ensemble method shares: checks, the heads, what is trained, forward and loss.

Members run in one forward pass, member-major along the batch axis
(``uqbench.methods.member_layers``: ``repeat_members``, the member-aware layers, their
replacement in the backbone); the heads
(``uqbench.methods.heads``) return (M, B, C).

What a method trains is declared, never inferred: each wrapper names its own parameters in
``adapter_names`` (as peft's layers do), a method lists the modules it fine-tunes whole in
``fine_tuned()``, and the head always trains. ``requires_grad``, the parameter counts, the
best-checkpoint state and the per-member gradient groups (``member_parameters()``) all follow
from those declarations.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.backbones.base import Backbone, stem_modules, stem_parameters
from uqbench.contracts import Batch, DataInfo, one_of
from uqbench.methods.base import MemberParameters, Method
from uqbench.methods.heads import EnsembleHead, HeadInit, answer_rows, check_head_init
from uqbench.methods.member_layers import (
    Inputs,
    MemberLinear,
    repeat_members,
    split_members,
    wrappable_backbones,
)
from uqbench.methods.multiple_choice import mask_absent, score_choices

# Backbones whose build() takes no input width and returns a feature encoder (B, feature_dim).
FEATURE_MODALITIES = ("image", "text")
# what the members train on: the same mini-batches, or each its own shuffled stream
DataOrder = Literal["shared", "independent"]


# --- the shared method ------------------------------------------------------------------------

def positive_int(value: Any, field: str, hint: str = "") -> int:
    """``value`` as an int >= 1, or a ValueError naming the field."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and int(value) == value
    if not ok or int(value) < 1:
        raise ValueError(f"{field} must be a positive integer{hint}, got {value!r}")
    return int(value)


def check_members(members: Any) -> int:
    """``members`` as an int >= 1, or a ValueError with the sizes P1 uses."""
    return positive_int(members, "method.members",
                        " (P1 uses 4 for ViTs, 8 for BERT, 16 for LLaMA)")


def check_sigma(value: Any, field: str = "method.sigma_init") -> float:
    """``value`` as a float >= 0, or a ValueError with P1's value and range."""
    if float(value) < 0:
        raise ValueError(f"{field} must be >= 0 (P1: 0.01, robust in 0.001–0.1), got {value}")
    return float(value)


def count(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EnsembleMethod(Method):
    """M members over one pretrained encoder; logits (M, B, C); loss (1/M) Σ_m CE(logits_m, y).

    Checks the data and the backbone, builds the encoder, records its parameter count, freezes
    it and adds the head: M parameter sets, or one shared by all members when the class sets
    ``shared_head`` (MC-Dropout's T passes are one model). Subclasses adapt the encoder
    (wrapping its layers), fine-tune it or replace it (Deep Ensemble), and end their
    constructor with :meth:`train_declared`.

    head_init: default | p1 (``EnsembleHead``), for heads not started from a causal LM's rows.
    head_sigma: σ of the per-member perturbation of heads started from a causal LM's answer
    rows (``EnsembleHead.start_from_rows``); 0 = every member's head starts as the LM itself.
    """

    task = "classification"
    shared_head = False
    released_params = 0  # pretrained entries the method dropped (SVE's decomposed W)
    data_order = "shared"  # a member-aware method that takes method.data_order sets its own

    def __init__(self, backbone: Backbone, info: DataInfo, members: int, name: str,
                 head_init: HeadInit = "default", head_sigma: float = 0.0) -> None:
        super().__init__()
        self.name = name
        self.members = check_members(members)
        head_init = check_head_init(head_init)
        if info.task != "classification" or not info.num_classes or info.num_classes < 2:
            raise ValueError(f"method '{name}' needs a classification dataset with >= 2 classes, "
                             f"got task={info.task!r}, num_classes={info.num_classes!r}")
        if backbone.modality not in FEATURE_MODALITIES:
            raise ValueError(
                f"method '{name}' classifies the features of an image or text backbone; "
                f"'{backbone.name}' has modality {backbone.modality!r}. Pick one of: "
                f"{wrappable_backbones()}")
        self.num_classes = int(info.num_classes)
        self.multiple_choice = bool(info.multiple_choice)
        self.backbone_name = backbone.name
        self.encoder = backbone.build()
        if backbone.device is not None:  # decompose/copy where it will run
            self.encoder.to(backbone.device)
        self.encoder.requires_grad_(False)
        self.base_params = count(self.encoder.parameters())
        self.base_bytes = nbytes(self.encoder.parameters())
        device = next(self.encoder.parameters()).device
        with torch.device(device):
            # multiple choice: one score per (example, choice) pair, the choices are the classes
            outputs = 1 if self.multiple_choice else self.num_classes
            sets = 1 if self.shared_head else self.members
            self.head = EnsembleHead(sets, backbone.feature_dim, outputs, head_init)
        rows = answer_rows(backbone, info.answer_token_ids)                     # (C, D) or None
        if rows is not None:  # every member starts as the LM scoring the answer tokens
            self.head.start_from_rows(rows, head_sigma)
        self.head_from_lm = rows is not None

    # -- what the method trains ----------------------------------------------------------------
    def fine_tuned(self) -> list[nn.Module]:
        """The modules the method trains whole (fine-tuned encoders); none by default."""
        return []

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The head, every member-aware layer's ``adapter_names`` and the ``fine_tuned()``
        modules, by name, in registration order (the optimiser's order)."""
        declared = list(self.head.parameters())
        declared += [p for m in self.modules() if isinstance(m, MemberLinear)
                     for p in m.adapters()]
        declared += [p for module in self.fine_tuned() for p in module.parameters()]
        stem = {id(p) for p in stem_parameters(self)}  # a backbone's frozen stem never trains
        ids = {id(p) for p in declared} - stem
        return {n: p for n, p in self.named_parameters() if id(p) in ids}

    def member_parameters(self) -> MemberParameters:
        """The heads and every wrapper's adapters are stacked (M, …); whole fine-tuned modules
        are shared unless a subclass gives each member its own. One model (M = 1, or the T
        passes of one model over a shared head): everything is one group."""
        if self.members == 1 or self.shared_head:
            return super().member_parameters()
        stacked = list(self.head.parameters())
        stacked += [p for m in self.modules() if isinstance(m, MemberLinear) for p in m.adapters()]
        stem = {id(p) for p in stem_parameters(self)}
        shared = [p for module in self.fine_tuned() for p in module.parameters()
                  if id(p) not in stem]
        return MemberParameters(self.members, stacked=stacked, shared=shared)

    def train_declared(self) -> None:
        """requires_grad on exactly the declared parameters; everything else is frozen. A
        member-aware layer inside the backbone's frozen stem is refused: it would never train."""
        inside = [n for n, m in stem_modules(self) if isinstance(m, MemberLinear)]
        if inside:
            raise ValueError(
                f"method '{self.name}' adapts {inside[:3]}{' …' if len(inside) > 3 else ''} "
                f"inside backbone '{self.backbone_name}''s frozen stem (backbone.frozen_blocks), "
                f"which never trains; target the blocks above it (method.targets: null or "
                f"attention takes the backbone's own targets)")
        self.requires_grad_(False)
        for p in self.trainable_parameters().values():
            p.requires_grad_(True)

    def training_passes(self) -> int:
        """Encoder passes per example whose activations a training step keeps for the backward
        pass (the training-memory estimate of ``job=params``): M (the members in the batch, or
        M encoder copies); 0 when only the heads train (nothing to back-propagate into)."""
        head = {id(p) for p in self.head.parameters()}
        trains_encoder = any(id(p) not in head for p in self.trainable_parameters().values())
        return self.members if trains_encoder else 0

    def set_data_order(self, data_order: Any) -> None:
        """``method.data_order``: shared (every member trains on the same mini-batches) or
        independent (member m on its own shuffled stream, as M separate runs would be: the
        trainer stacks M batches, stream-major, and member m's rows are stream m's).
        Multiple-choice inputs are refused with independent (their rows are (example,
        choice) pairs, which the member streams would split apart)."""
        self.data_order = one_of("method.data_order", data_order, DataOrder)
        if self.data_order == "independent" and self.multiple_choice:
            raise ValueError(f"method '{self.name}': method.data_order=independent needs a "
                             f"single-label dataset, not a multiple-choice one; use "
                             f"method.data_order=shared")

    def data_streams(self) -> int:
        """M with ``data_order: independent`` (one shuffled stream per member), else 1."""
        return self.members if self.data_order == "independent" else 1

    def _own_streams(self) -> bool:
        """Whether this call is a training step on the members' own streams (M·B rows)."""
        return self.training and self.data_streams() > 1

    # -- forward and loss ----------------------------------------------------------------------
    def features(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) or a dict of (B, T) tensors → member-major features (M·B, D). On the
        members' own streams the rows are already member-major (member m's batch m)."""
        if self._own_streams():
            return self.encoder(inputs)
        return self.encoder(repeat_members(inputs, self.members))

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) or a dict of (B, T) tensors → logits (M, B, C)."""
        return self.head(split_members(self.features(inputs), self.members))

    def forward(self, inputs: Inputs) -> torch.Tensor:
        """Logits (M, B, C). Multiple choice: (B, C, L) inputs, each (example, choice) pair
        scored on its own (``uqbench.methods.multiple_choice``); absent choices (``choice_mask``
        false) get probability 0."""
        if self.multiple_choice:
            return score_choices(self.logits, inputs)  # type: ignore[arg-type]  # a dict
        mask = inputs.get("choice_mask") if isinstance(inputs, dict) else None
        logits = self.logits(inputs)                                             # (M, B, C)
        if mask is not None and self._own_streams():  # (M·B, C): member m's rows, stream m
            mask = mask.reshape(logits.shape)
        return mask_absent(logits, mask)

    def loss(self, batch: Batch) -> torch.Tensor:
        """(1/M) Σ_m CE(logits_m, y): all members see the same mini-batch, or, on their own
        streams, member m its own batch (y (M·B,), stream-major)."""
        inputs, y = batch
        logits = self(inputs)                                                    # (M, B, C)
        G, B, C = logits.shape
        labels = y if self._own_streams() else y.repeat(G)
        return F.cross_entropy(logits.reshape(G * B, C).float(), labels)

    def frozen_tensors(self) -> list[nn.Parameter]:
        """The wrappers' derived frozen tensors (``MemberLinear.frozen_names``)."""
        return [t for m in self.modules() if isinstance(m, MemberLinear)
                for t in m.frozen_tensors()]

    # -- reporting -----------------------------------------------------------------------------
    def settings(self) -> dict[str, Any]:
        return {"members": self.members, "head_from_lm": self.head_from_lm}

    def param_counts(self) -> dict[str, int | float]:
        """Parameter counts and memory.

        base: the pretrained encoder as built (one copy). heads: the head parameters.
        total: every parameter of the method; trainable: the declared ones
        (:meth:`trainable_parameters`).
        added = total + released − base − heads (released: pretrained entries the method
        dropped, e.g. SVE's decomposed W): what the ensemble stores beyond one pretrained model
        (SVE: M sets of singular values and biases; LoRA: M (A, B) pairs; Deep Ensemble: M − 1
        backbone copies). overhead_pct = 100 · added / base.
        *_bytes: memory at the dtypes used; buffer_bytes: the buffers and the frozen tensors
        the wrappers derive (``frozen_names``: SVE's U and V factors, held as frozen parameters
        so that FSDP shards them, but not parameters of the model);
        memory_bytes = param_bytes + buffer_bytes.
        """
        derived = {id(t) for t in self.frozen_tensors()}
        params = [p for p in self.parameters() if id(p) not in derived]
        param_bytes = nbytes(params)
        buffer_bytes = nbytes(self.buffers()) + nbytes(self.frozen_tensors())
        heads = count(self.head.parameters())
        total = count(params)
        # pretrained entries a method dropped still belong to the base model
        added = total + self.released_params - self.base_params - heads
        return {
            "base": self.base_params,
            "added": added,
            "heads": heads,
            "total": total,
            "trainable": count(self.trainable_parameters().values()),
            "overhead_pct": 100.0 * added / self.base_params,
            "base_bytes": self.base_bytes,
            "param_bytes": param_bytes,
            "buffer_bytes": buffer_bytes,
            "memory_bytes": param_bytes + buffer_bytes,
        }
