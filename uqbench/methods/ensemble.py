"""What every ensemble method shares: members in the batch, layer replacement, the method.

Members in the batch. An input batch x of shape (B, …) is repeated ONCE at the stem to (M·B, …)
in member-major order ``(m b)``: rows m·B:(m+1)·B belong to member m. Every member-aware layer
receives (M·B, …, in), views it as (M, B·…, in) and applies member m's parameters to block m;
everything else in the backbone (attention, norms, embeddings) is unchanged code that simply
sees M times more batch rows. The heads (``uqbench.methods.heads``) return (M, B, C).

Layer replacement (the peft way). A method WRAPS each targeted ``nn.Linear`` (has-a
``base_layer``; the pretrained layer is kept, not copied) and swaps it in through its parent
module (``model.get_submodule(parent)`` + ``setattr``), which works on nested models. Targets
are module-name suffixes read from the backbone's config; matching is on dotted-name boundaries
(``output.dense`` matches ``layer.0.output.dense`` and ``layer.0.attention.output.dense``, not
``pooler.dense``); each module is wrapped once even if several suffixes match it.

What a method trains is declared, never inferred: each wrapper names its own parameters in
``adapter_names`` (as peft's layers do), a method lists the modules it fine-tunes whole in
``fine_tuned()``, and the head always trains. ``requires_grad``, the parameter counts and the
best-checkpoint state all follow from those declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.configs import options_with
from uqbench.contracts import Batch, DataInfo
from uqbench.methods.base import Method
from uqbench.methods.choices import mask_absent, score_choices
from uqbench.methods.heads import EnsembleHead, answer_rows

Inputs = torch.Tensor | dict[str, torch.Tensor]
# Backbones whose build() takes no input width and returns a feature encoder (B, feature_dim).
FEATURE_MODALITIES = ("image", "text")


def wrappable_backbones() -> str:
    """The backbone configs that declare target layers: the pretrained image and text encoders
    every ensemble method (adapter or not) can use."""
    return ", ".join(options_with("backbone", "targets")) or "<no backbone config with targets>"


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
    """Base of the member-aware wrappers of a frozen ``nn.Linear`` (``base_layer``).

    Input (M·B, …, in_features) in member-major order, output (M·B, …, out_features); member m's
    parameters act on rows m·B:(m+1)·B. ``adapter_names``: the names of the parameters the
    wrapper adds and trains (an entry may be None, e.g. the bias of a bias-free layer); the
    wrapped layer's own parameters stay frozen.
    """

    adapter_names: tuple[str, ...] = ()

    def __init__(self, base_layer: nn.Linear, members: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.members = members
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features

    def adapters(self) -> list[nn.Parameter]:
        """The parameters named in ``adapter_names`` that exist, in declaration order."""
        found = (getattr(self, name) for name in self.adapter_names)
        return [p for p in found if p is not None]

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
            f"none ({where}). Pick a backbone that declares targets ({wrappable_backbones()}) "
            f"or set method.targets=[<module-name suffixes>]")
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
    """

    task = "classification"
    shared_head = False
    released_params = 0  # pretrained entries the method dropped (SVE's decomposed W)

    def __init__(self, backbone: Any, info: DataInfo, members: int, name: str) -> None:
        super().__init__()
        self.name = name
        self.members = check_members(members)
        if info.task != "classification" or not info.num_classes or info.num_classes < 2:
            raise ValueError(f"method '{name}' needs a classification dataset with >= 2 classes, "
                             f"got task={info.task!r}, num_classes={info.num_classes!r}")
        modality = getattr(backbone, "modality", None)
        if modality not in FEATURE_MODALITIES:
            raise ValueError(
                f"method '{name}' classifies the features of an image or text backbone; "
                f"'{getattr(backbone, 'name', backbone)}' has modality {modality!r}. Pick one of: "
                f"{wrappable_backbones()}")
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
            sets = 1 if self.shared_head else self.members
            self.head = EnsembleHead(sets, backbone.feature_dim, outputs)
        rows = answer_rows(backbone, info.answer_token_ids)                     # (C, D) or None
        if rows is not None:  # every member starts as the LM scoring the answer tokens
            self.head.start_from_rows(rows)
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
        ids = {id(p) for p in declared}
        return {n: p for n, p in self.named_parameters() if id(p) in ids}

    def train_declared(self) -> None:
        """requires_grad on exactly the declared parameters; everything else is frozen."""
        self.requires_grad_(False)
        for p in self.trainable_parameters().values():
            p.requires_grad_(True)

    # -- forward and loss ----------------------------------------------------------------------
    def features(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) or a dict of (B, T) tensors → member-major features (M·B, D)."""
        return self.encoder(repeat_members(inputs, self.members))

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) or a dict of (B, T) tensors → logits (M, B, C)."""
        return self.head(split_members(self.features(inputs), self.members))

    def forward(self, inputs: Inputs) -> torch.Tensor:
        """Logits (M, B, C). Multiple choice: (B, C, L) inputs, each (example, choice) pair
        scored on its own (``uqbench.methods.choices``); absent choices (``choice_mask``
        false) get probability 0."""
        if self.multiple_choice:
            return score_choices(self.logits, inputs)
        mask = inputs.get("choice_mask") if isinstance(inputs, dict) else None
        return mask_absent(self.logits(inputs), mask)

    def loss(self, batch: Batch) -> torch.Tensor:
        """(1/M) Σ_m CE(logits_m, y): all members see the same mini-batch."""
        inputs, y = batch
        logits = self(inputs)                                                    # (M, B, C)
        G, B, C = logits.shape
        return F.cross_entropy(logits.reshape(G * B, C).float(), y.repeat(G))

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
        *_bytes: memory at the dtypes used; buffer_bytes: e.g. SVE's frozen U and V factors;
        memory_bytes = param_bytes + buffer_bytes.
        """
        params = list(self.parameters())
        param_bytes, buffer_bytes = nbytes(params), nbytes(self.buffers())
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
