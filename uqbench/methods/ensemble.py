"""What every ensemble method shares: members in the batch, layer replacement, heads, counts.

Members-in-batch (METHODS.md §1). An input batch x of shape (B, …) is repeated ONCE at the stem
to (M·B, …) in member-major order ``(m b)``: rows m·B:(m+1)·B belong to member m. Every
ensemble-aware layer receives (M·B, …, in), views it as (M, B·…, in) and applies member m's
parameters to block m; everything else in the backbone (attention, norms, embeddings) is
unchanged code that simply sees M times more batch rows. The heads return (M, B, C).

Layer replacement (the peft way). A method WRAPS each targeted ``nn.Linear`` (has-a
``base_layer``; the pretrained layer is kept, not copied) and swaps it in through its parent
module (``model.get_submodule(parent)`` + ``setattr``), which works on nested models. Targets
are module-name suffixes read from the backbone's config; matching is on dotted-name boundaries
(``output.dense`` matches ``layer.0.output.dense`` and ``layer.0.attention.output.dense``, not
``pooler.dense``); each module is wrapped once even if several suffixes match it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.contracts import Batch, DataInfo
from uqbench.methods.base import Method

Inputs = torch.Tensor | dict[str, torch.Tensor]


# --- members in the batch ---------------------------------------------------------------------

def repeat_members(inputs: Inputs, members: int) -> Inputs:
    """(B, …) → (M·B, …), member-major: copy m occupies rows m·B:(m+1)·B. Dicts per tensor."""
    if members == 1:
        return inputs
    if isinstance(inputs, dict):
        return {k: repeat_members(v, members) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return inputs.repeat(members, *([1] * (inputs.dim() - 1)))
    raise TypeError(f"inputs must be a tensor or a dict of tensors, got {type(inputs).__name__}")


def split_members(x: torch.Tensor, members: int) -> torch.Tensor:
    """(M·B, …, d) → (M, N, d) with N = B·…: member m's rows, in order."""
    if x.shape[0] % members:
        raise RuntimeError(f"an ensemble layer with {members} members got a batch of "
                           f"{x.shape[0]} rows, not a multiple of {members}: the inputs were "
                           f"not repeated once per member at the stem (repeat_members)")
    return x.reshape(members, -1, x.shape[-1])


class MemberLinear(nn.Module):
    """Base of the ensemble-aware wrappers of a frozen ``nn.Linear`` (``base_layer``).

    Input (M·B, …, in_features) in member-major order, output (M·B, …, out_features); member m's
    parameters act on rows m·B:(m+1)·B.
    """

    def __init__(self, base_layer: nn.Linear, members: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.members = members
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features

    def extra_repr(self) -> str:
        return f"members={self.members}, in={self.in_features}, out={self.out_features}"


# --- targets and replacement ------------------------------------------------------------------

def matches(name: str, suffix: str) -> bool:
    """True if the dotted module ``name`` ends with ``suffix`` on a '.' boundary."""
    return name == suffix or name.endswith("." + suffix)


def resolve_targets(backbone: Any, targets: str | Sequence[str] | None, method: str) -> list[str]:
    """The module-name suffixes a method adapts.

    targets: null or "all" → ``backbone.targets``; "attention" → ``backbone.attention_targets``;
    a list → used as given (``method.targets=[q_proj,v_proj]``).
    """
    name = getattr(backbone, "name", type(backbone).__name__)
    if targets is None or targets == "all":
        chosen, field = list(getattr(backbone, "targets", ()) or ()), "targets"
    elif targets == "attention":
        chosen, field = list(getattr(backbone, "attention_targets", ()) or ()), "attention_targets"
    elif isinstance(targets, str):
        raise ValueError(f"method.targets '{targets}' is not one of: null, all, attention, or a "
                         f"list of module-name suffixes such as [qkv,proj]")
    else:
        chosen, field = [str(t) for t in targets], None
    if not chosen:
        where = f"backbone.{field} is empty" if field else "method.targets is empty"
        raise ValueError(
            f"method '{method}' adapts pretrained linear layers, but backbone '{name}' declares "
            f"none ({where}). Pick a transformer backbone (tiny_vit, dino_vits16, dinov2_vits14, "
            f"dinov2_vitb14, tiny_bert, bert_base, tiny_llama, llama2_7b) or set "
            f"method.targets=[<module-name suffixes>]")
    return chosen


def replace_linears(model: nn.Module, suffixes: Sequence[str],
                    wrap: Callable[[str, nn.Linear], nn.Module], method: str) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends with one of ``suffixes``; return their names.

    Raises if a suffix matches no linear layer (a typo, or the wrong backbone), naming the
    suffixes and the linear layers that exist.
    """
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [s for s in suffixes if not any(matches(n, s) for n in linears)]
    if unmatched:
        existing = linears or [n for n, _ in model.named_modules() if n][:12]
        kind = "linear layers" if linears else "modules (no nn.Linear at all)"
        shown = ", ".join(existing[:12]) + (" …" if len(existing) > 12 else "")
        raise ValueError(
            f"method '{method}': target suffix(es) {unmatched} matched no nn.Linear module "
            f"(looked for names ending in any of {list(suffixes)}). The model's {kind}: "
            f"{shown}. Set method.targets to suffixes of these, or fix backbone.targets.")
    names = [n for n in linears if any(matches(n, s) for s in suffixes)]
    for full in names:
        parent_name, _, child = full.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, wrap(full, getattr(parent, child)))
    wrapped = [n for n in names if not isinstance(model.get_submodule(n), nn.Linear)]
    if len(wrapped) != len(names):  # pragma: no cover - guards against a silent partial swap
        raise RuntimeError(f"method '{method}': replaced {len(wrapped)} of {len(names)} layers")
    return names


# --- heads ------------------------------------------------------------------------------------

class EnsembleHead(nn.Module):
    """M linear classification heads as one batched layer.

    weight (M, C, D), bias (M, C); each member initialised independently like ``nn.Linear``.
    Input features (G·B, D) in member-major order → logits (G, B, C), G = M. A single head
    (M = 1) also serves G > 1 groups of rows (MC-Dropout's T samples).
    """

    def __init__(self, members: int, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.members = members
        self.weight = nn.Parameter(torch.empty(members, num_classes, in_features))
        self.bias = nn.Parameter(torch.empty(members, num_classes))
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init, per member
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, features: torch.Tensor, groups: int | None = None) -> torch.Tensor:
        groups = groups or self.members
        f = split_members(features, groups).to(self.weight.dtype)               # (G, B, D)
        if self.members == 1:
            return f @ self.weight[0].T + self.bias[0]                           # (G, B, C)
        if groups != self.members:
            raise RuntimeError(f"{self.members} heads cannot serve {groups} groups of rows")
        return torch.einsum("mbd,mcd->mbc", f, self.weight) + self.bias[:, None, :]


# --- the shared method ------------------------------------------------------------------------

def positive_int(value: Any, field: str, hint: str = "") -> int:
    """``value`` as an int >= 1, or a ValueError naming the field."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and int(value) == value
    if not ok or int(value) < 1:
        raise ValueError(f"{field} must be a positive integer{hint}, got {value!r}")
    return int(value)


def check_members(members: Any) -> int:
    return positive_int(members, "method.members",
                        " (P1 uses 4 for ViTs, 8 for BERT, 16 for LLaMA)")


def count(tensors) -> int:
    return sum(t.numel() for t in tensors)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EnsembleMethod(Method):
    """M members over one pretrained encoder; logits (M, B, C); loss (1/M) Σ_m CE(logits_m, y).

    Builds the encoder, records its parameter count, freezes it and adds M heads. Subclasses
    adapt the encoder (wrapping its layers) or replace it (Deep Ensemble). ``prefix`` is the
    name prefix of the method's own parameters besides the heads (``head.``).
    """

    task = "classification"
    prefix = ""

    def __init__(self, backbone: Any, info: DataInfo, members: int, name: str) -> None:
        super().__init__()
        self.name = name
        self.members = check_members(members)
        if info.task != "classification" or not info.num_classes or info.num_classes < 2:
            raise ValueError(f"method '{name}' needs a classification dataset with >= 2 classes, "
                             f"got task={info.task!r}, num_classes={info.num_classes!r}")
        if not callable(getattr(backbone, "build", None)) or not hasattr(backbone,
                                                                          "feature_dim"):
            raise ValueError(f"method '{name}' needs a pretrained feature backbone "
                             f"(tiny_vit, dino_vits16, bert_base, …); "
                             f"'{getattr(backbone, 'name', backbone)}' is not one")
        self.num_classes = int(info.num_classes)
        self.multiple_choice = bool(info.multiple_choice)
        self.backbone_name = backbone.name
        self.encoder = backbone.build()
        self.encoder.requires_grad_(False)
        self.base_params = count(self.encoder.parameters())
        self.base_bytes = nbytes(self.encoder.parameters())
        device = next(self.encoder.parameters()).device
        with torch.device(device):
            # multiple choice: one score per (example, choice) pair, the choices are the classes
            outputs = 1 if self.multiple_choice else self.num_classes
            self.head = EnsembleHead(self.members, backbone.feature_dim, outputs)
        rows = None
        if info.answer_token_ids is not None and callable(getattr(backbone, "output_rows", None)):
            rows = backbone.output_rows(info.answer_token_ids)                  # (C, D)
        if rows is not None:  # every member starts as the LM scoring the answer tokens
            with torch.no_grad():
                self.head.weight.copy_(rows.to(self.head.weight.dtype).expand_as(self.head.weight))
                self.head.bias.zero_()
        self.head_from_lm = rows is not None

    def features(self, inputs: Inputs) -> torch.Tensor:
        """Member-major features (M·B, D)."""
        return self.encoder(repeat_members(inputs, self.members))

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) or a dict of (B, T) tensors → logits (M, B, C)."""
        return self.head(self.features(inputs))

    def forward(self, inputs: Inputs) -> torch.Tensor:
        """Logits (M, B, C). Multiple choice: every (B, C, L) input is scored as B·C sequences,
        each member's score of choice c is its logit for c, and absent choices (``choice_mask``
        false) get the dtype's lowest value, i.e. probability 0."""
        if not self.multiple_choice:
            logits = self.logits(inputs)
            mask = inputs.get("choice_mask") if isinstance(inputs, dict) else None
            if mask is None:
                return logits
            return logits.masked_fill(~mask.bool(), torch.finfo(logits.dtype).min)
        mask = inputs["choice_mask"]                                            # (B, C)
        B, C = mask.shape
        flat = {k: v.flatten(0, 1) for k, v in inputs.items() if k != "choice_mask"}
        scores = self.logits(flat)                                              # (M, B·C, 1)
        scores = scores.reshape(scores.shape[0], B, C)
        return scores.masked_fill(~mask.bool(), torch.finfo(scores.dtype).min)

    def loss(self, batch: Batch) -> torch.Tensor:
        """(1/M) Σ_m CE(logits_m, y): all members see the same mini-batch."""
        inputs, y = batch
        logits = self(inputs)                                                    # (M, B, C)
        G, B, C = logits.shape
        return F.cross_entropy(logits.reshape(G * B, C).float(), y.repeat(G))

    def settings(self) -> dict[str, Any]:
        return {"members": self.members, "head_from_lm": self.head_from_lm}

    def param_counts(self) -> dict[str, int | float]:
        """Parameter counts and memory.

        base: the pretrained encoder as built (one copy). heads: the M heads.
        total / trainable: every parameter of the method / those with requires_grad.
        added = total + released − base − heads (released: pretrained entries the method
        dropped, e.g. SVE's decomposed W): what the ensemble stores beyond one pretrained model
        (SVE: M sets of singular values and biases; LoRA: M (A, B) pairs; Deep Ensemble: M − 1
        backbone copies). overhead_pct = 100 · added / base.
        *_bytes: memory at the dtypes used; buffer_bytes: e.g. SVE's frozen U and V factors;
        memory_bytes = param_bytes + buffer_bytes.
        """
        params = list(self.parameters())
        param_bytes, buffer_bytes = nbytes(params), nbytes(self.buffers())
        heads = count(self.head.parameters())
        total = count(params)
        # pretrained entries a method dropped (SVE's decomposed W) still belong to the base model
        added = total + getattr(self, "released_params", 0) - self.base_params - heads
        return {
            "base": self.base_params,
            "added": added,
            "heads": heads,
            "total": total,
            "trainable": count(p for p in params if p.requires_grad),
            "overhead_pct": 100.0 * added / self.base_params,
            "base_bytes": self.base_bytes,
            "param_bytes": param_bytes,
            "buffer_bytes": buffer_bytes,
            "memory_bytes": param_bytes + buffer_bytes,
        }
