"""Member-aware linear layers and where they go: members in the batch, wrappers, replacement.

Members in the batch. An input batch x of shape (B, …) is repeated ONCE at the stem to (M·B, …)
in member-major order ``(m b)``: rows m·B:(m+1)·B belong to member m. Every member-aware layer
receives (M·B, …, in), views it as (M, B·…, in) and applies member m's parameters to block m;
everything else in the backbone (attention, norms, embeddings) is unchanged code that simply
sees M times more batch rows.

Layer replacement (the peft way). A method WRAPS each targeted ``nn.Linear`` (has-a
``base_layer``; the pretrained layer is kept, not copied) and swaps it in through its parent
module (``model.get_submodule(parent)`` + ``setattr``), which works on nested models. Targets
are module-name suffixes read from the backbone's config; matching is on dotted-name boundaries
(``output.dense`` matches ``layer.0.output.dense`` and ``layer.0.attention.output.dense``, not
``pooler.dense``); each module is wrapped once even if several suffixes match it.

Fused q, k, v. Some backbones (timm ViTs) compute q, k and v with ONE linear layer of 3·d
outputs, stacked in that order; the backbone names these layers in ``fused_qkv`` (suffixes).
A method's ``qkv`` option says how it treats them: ``split`` gives q, k and v their own
member parameters (as on backbones with three separate projections), ``fused`` treats the
3·d × d matrix as one. On a backbone without fused layers both mean the same (q, k and v are
already separate), so the option is a no-op there rather than an error: one sweep can then
combine it with every backbone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn

from uqbench.backbones.base import Backbone, stem_modules
from uqbench.configs import options_with

Inputs = torch.Tensor | dict[str, torch.Tensor]
Qkv = Literal["split", "fused"]
QKV_FORMS: tuple[str, ...] = get_args(Qkv)
# What method.targets may name besides a list of module-name suffixes (null: all).
Targets = Literal["all", "attention"] | Sequence[str] | None


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
        return {k: repeat_members(v, members)  # type: ignore[misc]  # a tensor per key
                for k, v in inputs.items()}
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


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a parameter that never trains (requires_grad False).

    Large frozen tensors a method derives (SVE's U and V) are parameters, not buffers, because
    FSDP shards parameters only: as buffers every device would hold all of them. Wrappers list
    them in ``frozen_names``, so that they are counted apart from the model's parameters.
    """
    return nn.Parameter(tensor, requires_grad=False)


class MemberLinear(nn.Module):
    """Base of the member-aware wrappers of a frozen ``nn.Linear`` (``base_layer``).

    Input (M·B, …, in_features) in member-major order, output (M·B, …, out_features); member m's
    parameters act on rows m·B:(m+1)·B. ``adapter_names``: the names of the parameters the
    wrapper adds and trains (an entry may be None, e.g. the bias of a bias-free layer); the
    wrapped layer's own parameters stay frozen. ``frozen_names``: the frozen tensors the
    wrapper derives from the wrapped layer (:func:`frozen` parameters, e.g. SVE's factors):
    held like parameters, counted like buffers.
    """

    adapter_names: tuple[str, ...] = ()
    frozen_names: tuple[str, ...] = ()

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

    def saved_values(self, rows: int) -> int:
        """Values the wrapper keeps for the backward pass beyond its input, all members
        together, when each member sees ``rows`` input rows (the training-memory estimate);
        0 here."""
        return 0

    def frozen_tensors(self) -> list[nn.Parameter]:
        """The parameters named in ``frozen_names``, in declaration order."""
        return [getattr(self, name) for name in self.frozen_names]

    def extra_repr(self) -> str:
        return f"members={self.members}, in={self.in_features}, out={self.out_features}"


def wrapped_bytes(model: nn.Module) -> int:
    """Bytes of everything ``model``'s member-aware wrappers hold, at the dtypes used: kept
    pretrained weights, derived frozen tensors and the members' parameters (counted from the
    shapes, so a model built on the meta device is counted too)."""
    return sum(t.numel() * t.element_size() for m in model.modules()
               if isinstance(m, MemberLinear) for t in (*m.parameters(), *m.buffers()))


# --- targets and replacement ------------------------------------------------------------------

def matches(name: str, suffix: str) -> bool:
    """True if the dotted module ``name`` ends with ``suffix`` on a '.' boundary."""
    return name == suffix or name.endswith("." + suffix)


def resolve_targets(backbone: Backbone, targets: Targets,
                    method: str) -> list[str]:
    """The module-name suffixes a method adapts.

    targets: null or "all" → ``backbone.targets``; "attention" → ``backbone.attention_targets``;
    a list → used as given (``method.targets=[q_proj,v_proj]``).
    """
    if targets is None or targets == "all":
        chosen, field = list(backbone.targets), "targets"
    elif targets == "attention":
        chosen, field = list(backbone.attention_targets), "attention_targets"
    elif isinstance(targets, str):
        raise ValueError(f"method.targets '{targets}' is not one of: null, all, attention, or a "
                         f"list of module-name suffixes such as [qkv,proj]")
    else:
        chosen, field = [str(t) for t in targets], None
    if not chosen:
        where = f"backbone.{field} is empty" if field else "method.targets is empty"
        raise ValueError(
            f"method '{method}' adapts pretrained linear layers, but backbone "
            f"'{backbone.name}' declares none ({where}). Pick a backbone that declares targets "
            f"({wrappable_backbones()}) or set method.targets=[<module-name suffixes>]")
    return chosen


def replace_linears(model: nn.Module, suffixes: Sequence[str],
                    wrap: Callable[[str, nn.Linear], nn.Module], method: str) -> list[str]:
    """Wrap every ``nn.Linear`` whose name ends with one of ``suffixes``; return their names.

    Raises if a suffix matches no linear layer (a typo, or the wrong backbone), naming the
    suffixes and the linear layers that exist. Layers inside a backbone's frozen stem
    (``frozen_stem`` modules, ``backbone.frozen_blocks``) are left out: nothing adapts there.
    """
    stem = {n for n, _ in stem_modules(model)}  # a backbone's frozen stem is never a target
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in stem]
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


def check_qkv(qkv: Any) -> Qkv:
    """``qkv`` if it is one of :data:`QKV_FORMS`, else a ValueError naming the choices."""
    if qkv not in QKV_FORMS:
        raise ValueError(f"method.qkv '{qkv}' is not one of {QKV_FORMS} (split: q, k and v "
                         f"each get their own parameters; fused: the fused qkv matrix as one)")
    return qkv  # type: ignore[no-any-return]  # one of QKV_FORMS


def fused_qkv(backbone: Backbone, name: str) -> bool:
    """True if module ``name`` is one of the backbone's fused q/k/v layers (``fused_qkv``)."""
    return any(matches(name, s) for s in backbone.fused_qkv)
