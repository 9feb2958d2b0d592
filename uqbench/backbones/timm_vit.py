"""Vision transformers from timm (DINO, DINOv2 or a tiny one built from config).

Pretrained weights are read only from a local file (``checkpoint``), or from the folder the
Hub's ``hf download`` fills beside it; nothing is downloaded.
``build()`` returns the timm model with its classifier removed (``num_classes=0``), whose
forward maps images (B, 3, H, W) to pooled features (B, embed_dim) (the [CLS] token after the
final norm for the DINO/DINOv2 models).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uqbench.backbones.base import (
    Backbone,
    TransformerDims,
    checkpoint_error,
    load_errors,
    outermost,
    switched_on,
)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")


def download_command(model: str, folder: Path | str) -> str:
    """The Hub CLI command that puts timm model ``model``'s weights at
    ``<folder>/model.safetensors``: timm publishes them as ``timm/<model>`` (its pretrained
    config names the repository)."""
    import shlex

    import timm

    try:
        cfg = timm.models.get_pretrained_cfg(model)
        repo = (cfg.hf_hub_id if cfg is not None else None) or f"timm/{model}"
    except (AttributeError, RuntimeError, ValueError):  # a name timm has no weights for
        repo = f"timm/{model}"
    return (f"HF_HUB_OFFLINE=0 hf download {shlex.quote(repo)} model.safetensors "
            f"--local-dir {shlex.quote(str(folder))}")


class TimmViT(Backbone):
    """A timm vision transformer.

    model: timm model name, e.g. ``vit_small_patch16_224.dino``.
    pretrained: load ``checkpoint`` (a .safetensors/.pth/.bin file, or a folder holding
        model.safetensors or pytorch_model.bin, e.g. a Hub snapshot; for a file
        ``<dir>/<name>.safetensors`` that does not exist, the folder ``<dir>/<name>/`` that
        ``hf download timm/<model> model.safetensors --local-dir <dir>/<name>`` fills is read
        instead); false = random weights.
    model_kwargs: passed to ``timm.create_model`` (img_size, depth, embed_dim, drop rates …).
    fused_qkv: suffixes of the layers that compute q, k and v at once (outputs 3·d, in that
        order): timm's ``attn.qkv``. Methods may give q, k and v their own parameters there.

    For MC-Dropout: ``attention_dropouts`` names the dropout modules whose rate timm's fused
    attention reads (applied only while the attention module trains), ``feature_dropout`` the
    dropout timm applies to the pooled features before its (removed) classifier.
    """

    modality = "image"
    supports_activation_checkpointing = True
    attention_dropouts = ("attn_drop",)
    feature_dropout = "head_drop"

    def __init__(self, name: str, model: str, pretrained: bool = True,
                 checkpoint: str | None = None, model_kwargs: Mapping[str, Any] | None = None,
                 targets: Sequence[str] = ("qkv", "proj", "fc1", "fc2"),
                 attention_targets: Sequence[str] = ("qkv", "proj"),
                 fused_qkv: Sequence[str] = ("qkv",)) -> None:
        super().__init__(name, targets, attention_targets, pretrained)
        self.fused_qkv = [str(s) for s in fused_qkv]
        self.model = model
        self.checkpoint = None if checkpoint is None else Path(checkpoint).expanduser()
        self.model_kwargs = dict(model_kwargs or {})
        self._shape_model: Any = None  # a timm VisionTransformer on the meta device

    def download_folder(self) -> Path | None:
        """The folder ``hf download`` fills for this backbone: ``checkpoint`` itself when it
        names a folder, ``<dir>/<name>/`` beside a weight file ``<dir>/<name>.safetensors``."""
        path = self.checkpoint
        if path is None:
            return None
        return path.with_suffix("") if path.suffix in WEIGHT_SUFFIXES else path

    def checkpoint_file(self) -> Path:
        """The local weight file, or an error naming where it looked and the command that
        fetches the weights into that place."""
        path, folder = self.checkpoint, self.download_folder()
        if path is not None and path.is_file():
            return path
        if folder is not None and folder.is_dir():
            for fname in WEIGHT_FILES:
                if (folder / fname).is_file():
                    return folder / fname
        if path is None:
            looked = "nowhere: backbone.checkpoint is not set"
            folder = Path("<folder>")
        elif folder == path:
            looked = f"in {path}/ ({', '.join(WEIGHT_FILES)})"
        else:
            looked = f"at {path} and in {folder}/ ({', '.join(WEIGHT_FILES)})"
        raise FileNotFoundError(
            f"pretrained weights for backbone '{self.name}' (timm model {self.model}) not found: "
            f"looked {looked}. uqbench never downloads weights. On a machine with internet "
            f"run\n  {download_command(self.model, folder or '<folder>')}\n"
            f"(from another machine, copy {folder} to the same place here; or set "
            f"paths.checkpoints=<folder> / UQBENCH_CHECKPOINTS), or use random weights with "
            f"backbone.pretrained=false.")

    def build(self) -> nn.Module:
        import timm

        if self.pretrained:
            # timm's own loader: drops the classifier, resamples position embeddings to img_size.
            file = self.checkpoint_file()
            fix = (f"fetch it again for timm model {self.model} (the command is in the error "
                   f"shown when the file is missing), or set backbone.checkpoint=<file>")
            state = torch.random.get_rng_state()
            try:
                model = timm.create_model(self.model, pretrained=True, num_classes=0,
                                          pretrained_cfg_overlay={"file": str(file)},
                                          **self.model_kwargs)
            except load_errors() as err:
                raise checkpoint_error(self.name, file, err, fix) from err
            missing = self._not_loaded(model, state)
            if missing:  # timm loads non-strictly once the classifier is dropped: check here
                raise checkpoint_error(self.name, file, KeyError(
                    f"{len(missing)} weight tensors kept their random init, e.g. "
                    f"{', '.join(missing[:4])}"), fix)
            return model
        return timm.create_model(self.model, pretrained=False, num_classes=0,
                                 **self.model_kwargs)

    def enable_activation_checkpointing(self, model: nn.Module) -> int:
        """timm's ``set_grad_checkpointing(True)`` on every timm model inside ``model``: each
        block's activations are recomputed in the backward pass (in training mode only).
        timm checkpoints non-reentrantly unless TIMM_REENTRANT_CKPT says otherwise, which is
        refused: reentrant checkpoints pass no gradient to a block whose input is frozen (the
        patch embedding's output), so wrapped layers would silently stop training."""
        from timm.layers import use_reentrant_ckpt

        if use_reentrant_ckpt():
            raise ValueError(f"backbone '{self.name}': timm is set to reentrant activation "
                             f"checkpoints (TIMM_REENTRANT_CKPT), which give the wrapped "
                             f"layers of a frozen ViT no gradient; unset TIMM_REENTRANT_CKPT")
        found = outermost(model, lambda m: type(m).__module__.startswith("timm.")
                          and callable(getattr(m, "set_grad_checkpointing", None)))
        for timm_model in found:
            timm_model.set_grad_checkpointing(True)  # type: ignore[operator]  # found: callable
        return switched_on(model, found, self.name)

    def _not_loaded(self, model: nn.Module, rng_state: torch.Tensor) -> list[str]:
        """Names of the randomly initialised tensors that loading left untouched: the same
        architecture built from the same random state, compared value by value. Tensors whose
        init is a constant (norm weights, zero biases) cannot tell and are left out."""
        import timm

        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(rng_state)
            fresh = timm.create_model(self.model, pretrained=False, num_classes=0,
                                      **self.model_kwargs).state_dict()
        return [name for name, value in model.state_dict().items()
                if name in fresh and value.numel() > 1 and value.is_floating_point()
                and fresh[name].std() > 0 and torch.equal(value, fresh[name])]

    def _shapes(self) -> Any:
        """The architecture on the meta device (no memory, no weights): sizes and preprocessing."""
        if self._shape_model is None:
            import timm

            with torch.device("meta"):
                self._shape_model = timm.create_model(self.model, pretrained=False,
                                                      num_classes=0, **self.model_kwargs)
        return self._shape_model

    @property
    def dynamic_image_size(self) -> bool:
        """Whether the model takes any image size (timm's ``dynamic_img_size``)."""
        return bool(self.model_kwargs.get("dynamic_img_size", False))

    @property
    def feature_dim(self) -> int:
        return int(self._shapes().num_features)

    def transformer_dims(self) -> TransformerDims:
        """Tokens: the patches at the model's img_size plus its prefix tokens ([CLS], register
        tokens); e.g. 14 × 14 + 1 = 197 for a ViT-S/16 at 224 px."""
        model = self._shapes()
        tokens = model.patch_embed.num_patches + int(getattr(model, "num_prefix_tokens", 0))
        return TransformerDims(layers=len(model.blocks), hidden=int(model.embed_dim),
                               heads=int(model.blocks[0].attn.num_heads), tokens=int(tokens))

    def data_config(self) -> dict[str, Any]:
        """input_size (3, H, W), mean, std, crop_pct, interpolation (and crop_mode).

        From timm's pretrained config; input_size follows the model's actual ``img_size``
        (e.g. 224 for DINOv2 built at 224 although its pretrained config says 518).
        """
        from timm.data import resolve_data_config

        model = self._shapes()
        cfg = dict(resolve_data_config({}, model=model))
        img_size = getattr(getattr(model, "patch_embed", None), "img_size", None)
        if img_size is not None:
            cfg["input_size"] = (3, int(img_size[0]), int(img_size[1]))
        return cfg
