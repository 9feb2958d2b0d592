"""Training memory per device, estimated from a model's tensors and the engine settings.

What one device holds during a training step, in bytes:

- parameters: frozen (the pretrained encoder, SVE's U and V, or top-k SVE's kept W with U_k
  and V_k …) and trained, each in the dtype it is held in: as built under ``32`` and the
  mixed precisions (which keep the weights and compute in 16 bit under autocast), every
  floating tensor in bfloat16 under ``bf16-true``; buffers likewise.
- gradients: one per trained parameter, in its dtype.
- optimiser state: Adam and AdamW keep two tensors per trained parameter (exp_avg,
  exp_avg_sq), SGD one with momentum and none without; torch keeps them in the parameter's
  dtype (float32 for uqbench's trained parameters, bfloat16 under ``bf16-true``).
- activations: what the forward keeps for the backward pass. Per transformer block, from
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198, Sec. 4.1): s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations, s tokens,
  b sequences, width h, a heads; with full recomputation (activation checkpointing) only each
  block's input, 2·s·b·h bytes. b is the micro-batch times the encoder passes a training step
  keeps (``method.training_passes()``: M for the members in one batch or M encoder copies, 1
  for MC-Dropout, 0 when only heads train). 32-bit activations (``32`` with a float32 encoder)
  count twice the bytes. Without recomputation the member-aware wrappers add what they keep
  themselves (``saved_values``: SVE's x·V or its member weights, whichever form a training
  call uses; LoRA's x·Aᵀ).
- Distribution: ``fsdp`` shards parameters, gradients and optimiser state over the
  devices × nodes (buffers are not sharded), ``ddp`` replicates them; ``auto`` is one device,
  or ddp over several. Each device's micro-batch is batch / (devices × nodes × accumulate).

Not included: the CUDA context and kernels (≈ 0.5–1 GB per process), the allocator's caching
and fragmentation, temporary buffers (FSDP's all-gathered block, DDP's gradient buckets,
autocast's 16-bit weight copies, attention workspaces, the logits and loss), and the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

GB = 1e9  # the table's GB: 10⁹ bytes (an "80 GB" GPU holds 80 GiB = 85.9 GB)
# The precisions and strategies a step can run in: the Trainer checks its settings here too.
PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
Strategy = Literal["auto", "ddp", "fsdp"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
ADAM_LIKE = ("Adam", "AdamW")


def check_precision_and_strategy(precision: str, strategy: str) -> None:
    """``trainer.precision`` and ``trainer.strategy`` must be among the choices above."""
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision '{precision}' is not one of {PRECISIONS}")
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer.strategy '{strategy}' is not one of {STRATEGIES}")


@dataclass(frozen=True)
class Engine:
    """Where and how a step runs (``trainer.precision``, ``strategy``, ``devices``,
    ``num_nodes``, ``accumulate``, ``activation_checkpointing``)."""

    precision: str = "32"
    strategy: str = "auto"
    devices: int = 1
    num_nodes: int = 1
    accumulate: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_precision_and_strategy(self.precision, self.strategy)
        for key in ("devices", "num_nodes", "accumulate"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"trainer.{key} must be a positive integer, got "
                                 f"{getattr(self, key)!r}")

    @property
    def world(self) -> int:
        return int(self.devices) * int(self.num_nodes)

    @property
    def layout(self) -> str:
        """single | ddp | fsdp: what ``strategy`` amounts to on ``world`` devices."""
        if self.strategy == "auto":
            return "single" if self.world == 1 else "ddp"
        return self.strategy


def optimizer_states(optimizer: str, momentum: float = 0.0) -> int:
    """Tensors the optimiser keeps per trained parameter: ``optimizer`` is its class name."""
    if optimizer in ADAM_LIKE:
        return 2
    if optimizer == "SGD":
        return 1 if momentum else 0
    raise ValueError(f"the memory estimate knows the optimisers {(*ADAM_LIKE, 'SGD')}, not "
                     f"'{optimizer}'; set trainer.optimizer._target_ to one of them")


def held_bytes(tensors: Iterable[torch.Tensor], precision: str) -> int:
    """Bytes of ``tensors`` as a step holds them: their own dtypes, floating ones in bfloat16
    under ``bf16-true``."""
    total = 0
    for t in tensors:
        size = 2 if precision == "bf16-true" and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


def block_activation_bytes(layers: int, hidden: int, heads: int, tokens: int, rows: int,
                           recompute: bool, value_bytes: int = 2) -> int:
    """Activations the transformer blocks keep for the backward pass (Korthikanti et al. 2022,
    Sec. 4.1): per block s·b·h·(34 + 5·a·s/h) bytes in 16 bit, 2·s·b·h with full
    recomputation; ``value_bytes`` 4 doubles them. s = tokens, b = rows, h = hidden, a = heads."""
    s, b, h, a = tokens, rows, hidden, heads
    per_block = 2 * s * b * h if recompute else s * b * (34 * h + 5 * a * s)
    return layers * per_block * value_bytes // 2


def estimate(*, frozen: list[torch.Tensor], trained: list[torch.Tensor],
             buffers: list[torch.Tensor], engine: Engine, states: int, batch_size: int,
             passes: int, dims: Any | None, wrapper_values: Any = None,
             value_bytes: int = 2) -> dict[str, Any]:
    """The per-device breakdown of one training step and its total, in bytes and GB.

    frozen, trained, buffers: the model's tensors (they may live on the meta device).
    states: optimiser tensors per trained parameter. passes: encoder passes per example kept
    for the backward (``training_passes()``). dims: :class:`TransformerDims` or None (no
    activations estimated). wrapper_values(rows per member) → values the wrappers keep.
    value_bytes: bytes per activation value (2 for 16-bit compute, 4 for 32-bit).
    """
    world = engine.world
    shard = world if engine.layout == "fsdp" else 1
    micro = math.ceil(batch_size / (world * int(engine.accumulate)))  # a partial one counts whole
    rows = micro * passes
    trained_bytes = held_bytes(trained, engine.precision)
    blocks = wrappers = 0
    if dims is not None and rows:
        blocks = block_activation_bytes(dims.layers, dims.hidden, dims.heads, dims.tokens, rows,
                                        engine.activation_checkpointing, value_bytes)
        if wrapper_values is not None and not engine.activation_checkpointing:
            wrappers = wrapper_values(micro * dims.tokens) * value_bytes
    parts = {
        "frozen_params": held_bytes(frozen, engine.precision) // shard,
        "trained_params": trained_bytes // shard,
        "buffers": held_bytes(buffers, engine.precision),
        "gradients": trained_bytes // shard,
        "optimizer": states * trained_bytes // shard,
        "activations_blocks": blocks,
        "activations_wrappers": wrappers,
    }
    parts["total"] = sum(parts.values())
    return {
        "precision": engine.precision, "strategy": engine.layout, "world_size": world,
        "batch_size": int(batch_size), "accumulate": int(engine.accumulate),
        "micro_batch": micro, "passes": passes, "rows": rows,
        "activation_checkpointing": bool(engine.activation_checkpointing),
        "activation_value_bytes": value_bytes, "optimizer_states": states,
        "tokens": None if dims is None else dims.tokens,
        "bytes": parts,
        "gb": {k: round(v / GB, 3) for k, v in parts.items()},
    }
