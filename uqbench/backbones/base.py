"""The contract of a backbone, shared by the timm and Hugging Face wrappers and the MLP.

A backbone is a small description object built by Hydra from ``conf/backbone/<name>.yaml``; the
network itself is made by :meth:`Backbone.build`, so that a method can build it once (or M
times) where and when it wants (e.g. on the ``meta`` device to count parameters).

- ``name``: used in the run folder path.
- ``modality``: what the inputs are: ``image``, ``text`` (pretrained encoders whose features
  the classification methods read) or ``tabular`` (the MLP of the regression benchmarks).
- ``targets``: module-name suffixes of the linear layers a method may adapt (all of them, the
  SVE default); ``attention_targets``: the attention projections only (LoRA-Ensemble's default).
  Method code never names an architecture's module paths; it reads these lists.
- ``build() -> nn.Module``: the encoder, inputs → features (B, feature_dim). A tabular
  backbone's input width is set by the data, so it takes it: ``build(in_features)``.
- ``feature_dim``: width of the features the methods' heads (or output layers) read.
- Image backbones: ``data_config()`` (input_size (3, H, W), mean, std, crop_pct, interpolation).
  Text backbones: ``tokenizer()`` and ``max_length``; inputs arrive as dicts of tensors
  (``input_ids``, ``attention_mask``, optional ``token_type_ids``).
- ``transformer_dims()``: blocks, width, attention heads and tokens per example of a
  transformer backbone (:class:`TransformerDims`), for the training-memory estimate of
  ``job=params``; None for backbones that are not transformers.
- ``enable_activation_checkpointing(model)``: recompute the encoder's block activations in the
  backward pass instead of keeping them (``trainer.activation_checkpointing``), for every
  encoder this backbone built inside ``model`` (the method, with its wrapped layers). Backbones
  that cannot (``supports_activation_checkpointing`` false) raise a ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TransformerDims:
    """A transformer encoder's shape as the activation memory sees it: ``layers`` blocks of
    width ``hidden`` with ``heads`` attention heads, over ``tokens`` positions per example."""

    layers: int
    hidden: int
    heads: int
    tokens: int


class Backbone:
    """A backbone's description; see the module docstring for what each subclass provides.

    The optional hooks below are declared here with their defaults, so that methods and
    datasets read them as attributes; a backbone that has one overrides it.
    """

    name: str = "backbone"
    modality: str = "image"  # image | text | tabular
    supports_activation_checkpointing: bool = False
    # Where the run trains (set by the runner): methods move the built encoder there before
    # wrapping it, so that decompositions (SVE's SVD) run on the target device.
    device: torch.device | None = None
    # Suffixes of the layers that compute q, k and v at once (timm's ``qkv``): read by SVE and
    # LoRA-Ensemble's ``qkv=split``. None of them by default.
    fused_qkv: Sequence[str] = ()
    # Suffixes of the attention-probability dropouts, which MC Dropout switches off.
    attention_dropouts: Sequence[str] = ()
    # The name of the backbone's own dropout of the pooled features, which MC Dropout removes.
    feature_dropout: str | None = None
    # Tokens per text example (text datasets truncate and pad to it); None: not a text backbone.
    max_length: int | None = None
    # The digits split the weights were pretrained on ({split_seed, kind_fraction, ood_classes};
    # the digits dataset must use the same); None: weights that saw no digits split.
    pretrain_split: dict[str, Any] | None = None

    def __init__(self, name: str, targets: Sequence[str] = (),
                 attention_targets: Sequence[str] = (), pretrained: bool = True) -> None:
        self.name = name
        self.targets = [str(t) for t in targets]
        self.attention_targets = [str(t) for t in attention_targets]
        self.pretrained = bool(pretrained)

    @property
    def dynamic_image_size(self) -> bool:
        """Whether the encoder takes images of any size (image datasets then skip the check)."""
        return False

    def data_config(self) -> dict[str, Any] | None:
        """Image preprocessing (input_size (3, H, W), mean, std, crop_pct, interpolation), or
        None: the image datasets' defaults."""
        return None

    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer of a text backbone; None for other backbones."""
        return None

    def output_rows(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """A causal LM's output-embedding rows (C, D) of ``token_ids`` (the heads start from
        them); None for backbones that are not causal LMs."""
        return None

    def build(self) -> nn.Module:  # pragma: no cover - interface
        """A fresh encoder: inputs → features (B, feature_dim)."""
        raise NotImplementedError

    @property
    def feature_dim(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def transformer_dims(self) -> TransformerDims | None:
        """Blocks, width, heads and tokens per example; None if not a transformer."""
        return None

    def enable_activation_checkpointing(self, model: nn.Module) -> int:
        """Switch on activation checkpointing in every encoder of this backbone inside
        ``model``; returns how many. Non-reentrant: it works with frozen inputs and wrapped
        layers, and dropout draws the same masks when a block is recomputed."""
        from uqbench.configs import options_where

        able = ", ".join(options_where("backbone", "supports_activation_checkpointing", True))
        raise ValueError(
            f"backbone '{self.name}' ({type(self).__name__}) cannot checkpoint activations "
            f"(trainer.activation_checkpointing=true); the backbones that can: "
            f"{able or '<none found>'}. Set trainer.activation_checkpointing=false.")

    def details(self) -> dict[str, Any]:
        """Facts about this backbone beyond its config, recorded in results.json under
        ``settings.backbone`` (e.g. a pretrained level's linear-probe accuracy)."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def stem_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of a backbone's frozen stem (every module marked ``frozen_stem``, e.g.
    ``uqbench.backbones.hf.FrozenRows``): no method trains them, whatever it fine-tunes."""
    return [p for m in model.modules() if getattr(m, "frozen_stem", False)
            for p in m.parameters()]


def stem_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module inside a frozen stem."""
    stems = [n for n, m in model.named_modules() if getattr(m, "frozen_stem", False)]
    return [(n, m) for n, m in model.named_modules()
            if any(n == s or n.startswith(s + ".") for s in stems)]


class CheckpointLoadError(ValueError):
    """Pretrained weights that exist but cannot be loaded (garbage, truncated, another model's)."""


# What loading a broken weight file raises: safetensors' and pickle's parse errors, and torch's
# state-dict mismatch (RuntimeError) for another architecture's weights.
def load_errors() -> tuple[type[BaseException], ...]:
    import pickle

    from safetensors import SafetensorError

    return (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError, KeyError,
            ValueError, OSError)


def outermost(model: nn.Module, keep: Any) -> list[nn.Module]:
    """The modules of ``model`` for which ``keep(module)`` holds that are not inside another
    such module, in ``named_modules`` order."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if keep(module) and not any(not n or name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return [module for _, module in found]


def switched_on(model: nn.Module, found: list[nn.Module], backbone: str) -> int:
    """``len(found)``, or a ValueError when ``model`` holds no encoder of the backbone."""
    if not found:
        raise ValueError(f"backbone '{backbone}': no encoder of it inside "
                         f"{type(model).__name__}, so activation checkpointing cannot be "
                         f"switched on (a vectorised Deep Ensemble holds its copies as stacked "
                         f"weights; use method.vectorize=false)")
    return len(found)


def checkpoint_error(backbone: str, path: object, err: BaseException,
                     fix: str) -> CheckpointLoadError:
    """The error for weights at ``path`` that failed to load, naming the file and the fix."""
    reason = " ".join(str(err).split())[:300]
    return CheckpointLoadError(
        f"backbone '{backbone}': cannot load the pretrained weights in {path} "
        f"({type(err).__name__}: {reason}). The file is corrupt, truncated or holds another "
        f"model's weights; {fix}")
