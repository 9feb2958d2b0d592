"""One training loop for every method: the method supplies the loss, the task the validation.

The loop is a :class:`Trainer`, built by Hydra from ``conf/trainer/<name>.yaml`` (the optimiser
arrives as a ``_partial_`` factory): its settings are checked when it is built, so a bad value
fails before any data is read or any model is built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from uqbench.contracts import to_device
from uqbench.loggers import Logger

if TYPE_CHECKING:  # types only: the loop takes a built method, data and task from the runner
    from uqbench.data.base import DataModule
    from uqbench.methods.base import Method
    from uqbench.tasks.base import Task

SCHEDULES = ("constant", "cosine")
SELECTIONS = ("last", "best")
DECAY_TARGETS = ("zero", "init")
PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("auto", "ddp", "fsdp")
KEEP_CHECKPOINT = ("trainable", "full", "none")
# A gradient group: (parameter, member index into its dim 0, or None for the whole tensor).
Group = list[tuple[torch.nn.Parameter, int | None]]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; no results are written."""


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over ``warmup`` steps, then constant or cosine decay to 0."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def clip_groups(method: Method, params: list[torch.nn.Parameter]) -> list[Group]:
    """The groups whose gradient norms are clipped apart: one per member, then one of the
    shared parameters (``method.member_parameters()``), each in the order of ``params``.

    Raises if a trained parameter belongs to no group or to two, or if a stacked parameter's
    dim 0 is not the number of members.
    """
    layout = method.member_parameters()
    M = int(layout.members)
    if layout.owned and len(layout.owned) != M:
        raise RuntimeError(f"method '{method.name}' declares {len(layout.owned)} lists of "
                           f"member-owned parameters for {M} members")
    places: dict[int, list[tuple[int | None, int | None]]] = {}  # id → [(group, index)]
    declared: dict[int, int] = {}  # id → how many declarations name it
    for p in layout.stacked:
        if p.dim() == 0 or p.shape[0] != M:
            raise RuntimeError(f"method '{method.name}': a stacked member parameter has shape "
                               f"{tuple(p.shape)}, not ({M}, …)")
        places.setdefault(id(p), []).extend((m, m) for m in range(M))
        declared[id(p)] = declared.get(id(p), 0) + 1
    for group, plist in [*enumerate(layout.owned), (None, layout.shared)]:
        for p in plist:
            places.setdefault(id(p), []).append((group, None))
            declared[id(p)] = declared.get(id(p), 0) + 1
    names = {id(p): n for n, p in method.named_parameters()}
    groups: list[Group] = [[] for _ in range(M + 1)]  # the members', then the shared group
    for p in params:
        if declared.get(id(p), 0) != 1:
            how = "not declared" if id(p) not in declared else "declared more than once"
            raise RuntimeError(f"method '{method.name}': trained parameter "
                               f"'{names.get(id(p), '?')}' is {how} in member_parameters() "
                               f"(stacked, owned by a member, or shared)")
        for group, index in places[id(p)]:
            groups[M if group is None else group].append((p, index))
    return [g for g in groups if g]


def clip_per_member_(groups: list[Group], max_norm: float) -> list[torch.Tensor]:
    """Clip each group's gradient to 2-norm ``max_norm`` on its own, as
    ``torch.nn.utils.clip_grad_norm_`` clips a whole model (factor min(1, max / (norm + 1e-6)));
    returns the norms before clipping. One group of whole tensors IS that call."""
    if len(groups) == 1 and all(index is None for _, index in groups[0]):
        return [torch.nn.utils.clip_grad_norm_([p for p, _ in groups[0]], max_norm)]
    norms = []
    for group in groups:
        grads = [p.grad if index is None else p.grad[index] for p, index in group
                 if p.grad is not None]                       # views: scaling them scales p.grad
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.device))
        norms.append(norm)
    return norms


@torch.no_grad()
def decay_toward_(optimizer: torch.optim.Optimizer, anchors: list[torch.Tensor],
                  decay: float) -> None:
    """p ← p − lr·decay·(p − p₀) for every parameter, at its group's current learning rate;
    ``anchors`` are the p₀ in the optimiser's parameter order."""
    params = [(p, group["lr"]) for group in optimizer.param_groups for p in group["params"]]
    for (p, lr), anchor in zip(params, anchors, strict=True):
        p.sub_(p - anchor, alpha=lr * decay)


class Trainer:
    """Optimisation and model selection, the same for every method.

    optimizer: a factory ``optimizer(params=…)`` (Hydra ``_partial_``). epochs: passes over the
    training split (0 = evaluate the untrained model). batch_size: the recipe's training batch;
    the runner writes it into ``dataset.batch_size`` before the data is built (None = keep the
    dataset's). grad_clip: max gradient norm or None, applied to each member's gradient on its
    own (:func:`clip_groups`): one member's large gradient never shrinks another's step.
    warmup_epochs / warmup_steps: linear warm-up, in epochs or (when set) optimiser steps.
    schedule: constant | cosine after the warm-up. select: last | best (lowest validation loss,
    trainable parameters only). val_every: epochs between validation passes. progress: a bar.
    decay_to: zero or None (the optimiser's own weight decay, toward 0) | init (decoupled weight
    decay toward the values training started from — for SVE the pretrained spectrum, for full
    fine-tuning the pretrained weights: p ← p − lr·wd·(p − p₀) after each step, with the
    optimiser's ``weight_decay`` as wd and the optimiser itself run without decay).
    """

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer], epochs: int = 300,
                 batch_size: int | None = None, grad_clip: float | None = None,
                 warmup_epochs: int = 0, warmup_steps: int | None = None,
                 schedule: str = "constant",
                 select: str = "last", val_every: int = 10, progress: bool = True,
                 decay_to: str | None = None, precision: str | int = "32",
                 strategy: str = "auto", devices: int = 1, num_nodes: int = 1,
                 accumulate: int = 1, activation_checkpointing: bool = False,
                 checkpoint_every: int | None = 500, keep_checkpoint: str = "trainable") -> None:
        if int(epochs) < 0:
            raise ValueError(f"trainer.epochs must be >= 0, got {epochs}")
        if schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule '{schedule}' is not one of {SCHEDULES}")
        if select not in SELECTIONS:
            raise ValueError(f"trainer.select '{select}' is not one of {SELECTIONS}")
        if grad_clip is not None and grad_clip <= 0:
            raise ValueError(f"trainer.grad_clip must be > 0 or null, got {grad_clip}")
        if warmup_steps is not None and int(warmup_steps) < 0:
            raise ValueError(f"trainer.warmup_steps must be >= 0 or null, got {warmup_steps}")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"trainer.batch_size must be >= 1 or null, got {batch_size}")
        decay_to = decay_to or "zero"  # null: the optimiser's own decay
        if decay_to not in DECAY_TARGETS:
            raise ValueError(f"trainer.decay_to '{decay_to}' is not one of {DECAY_TARGETS}")
        if not callable(optimizer):
            raise ValueError(f"trainer.optimizer must build an optimiser (a Hydra `_partial_` "
                             f"config such as torch.optim.AdamW), got {optimizer!r}")
        self.optimizer = optimizer
        self.epochs, self.grad_clip = int(epochs), grad_clip
        self.batch_size = None if batch_size is None else int(batch_size)
        self.warmup_epochs = int(warmup_epochs)
        self.warmup_steps = None if warmup_steps is None else int(warmup_steps)
        self.schedule, self.select = schedule, select
        self.val_every, self.progress = int(val_every), bool(progress)
        self.decay_to = decay_to
        precision = str(precision)
        if precision not in PRECISIONS:
            raise ValueError(f"trainer.precision '{precision}' is not one of {PRECISIONS}")
        if strategy not in STRATEGIES:
            raise ValueError(f"trainer.strategy '{strategy}' is not one of {STRATEGIES}")
        for key, value in (("devices", devices), ("num_nodes", num_nodes),
                           ("accumulate", accumulate)):
            if int(value) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {value}")
        if checkpoint_every is not None and int(checkpoint_every) < 1:
            raise ValueError(f"trainer.checkpoint_every must be >= 1 (optimiser steps) or null "
                             f"(epoch ends only), got {checkpoint_every}")
        if keep_checkpoint not in KEEP_CHECKPOINT:
            raise ValueError(f"trainer.keep_checkpoint '{keep_checkpoint}' is not one of "
                             f"{KEEP_CHECKPOINT}")
        self.precision, self.strategy = precision, strategy
        self.devices, self.num_nodes = int(devices), int(num_nodes)
        self.accumulate = int(accumulate)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.checkpoint_every = None if checkpoint_every is None else int(checkpoint_every)
        self.keep_checkpoint = keep_checkpoint

    @property
    def world_size(self) -> int:
        """Processes that share one optimiser step (devices × nodes)."""
        return self.devices * self.num_nodes

    @property
    def updates_weights(self) -> bool:
        """False when the run evaluates the untrained model (epochs 0 or a learning rate 0)."""
        lr = getattr(self.optimizer, "keywords", {}).get("lr")
        return self.epochs > 0 and lr != 0

    def fit(self, method: Method, data: DataModule, task: Task, device: torch.device,
            logger: Logger) -> dict[str, Any]:
        """Train ``method`` for ``epochs``; return timing and model-selection facts."""
        params = [p for p in method.parameters() if p.requires_grad]
        if not params and self.epochs > 0:
            raise ValueError(f"method '{method.name}' has no trainable parameters")
        start = time.perf_counter()
        epochs = self.epochs
        if epochs == 0:
            return {"epochs": 0, "train_s": 0.0, "selected_epoch": 0}
        anchors: list[torch.Tensor] = []
        if self.decay_to == "init":  # the optimiser runs without decay; we decay toward p₀
            decay = float(getattr(self.optimizer, "keywords", {}).get("weight_decay") or 0.0)
            optimizer = self.optimizer(params=params, weight_decay=0.0)
            anchors = [p.detach().clone() for p in params] if decay else []
        else:
            optimizer = self.optimizer(params=params)
        groups = clip_groups(method, params) if self.grad_clip is not None else []
        loader = data.loader("train", train=True)
        total = epochs * len(loader)
        # warm-up in optimiser steps when given (LoRA-Ensemble's recipe), else in epochs
        warmup = (self.warmup_steps if self.warmup_steps is not None
                  else self.warmup_epochs * len(loader))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total, warmup, self.schedule))
        best = {"loss": math.inf, "epoch": epochs, "state": None}
        bar = tqdm(range(1, epochs + 1), desc=f"train {method.name}", disable=not self.progress,
                   dynamic_ncols=True, leave=False)
        for epoch in bar:
            method.train()
            running, n = 0.0, 0
            for step, batch in enumerate(loader):
                batch = to_device(batch, device)
                loss = method.loss(batch)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"the training loss became {loss.item()} at epoch {epoch}, step {step} "
                        f"(lr {scheduler.get_last_lr()[0]:.3g}); lower trainer.optimizer.lr, set "
                        f"trainer.grad_clip, or check the data. No results were written.")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if self.grad_clip is not None:
                    clip_per_member_(groups, self.grad_clip)
                optimizer.step()
                if anchors:
                    decay_toward_(optimizer, anchors, decay)
                scheduler.step()
                running += loss.item()
                n += 1
            log = {"train/loss": running / n, "epoch": epoch, "lr": scheduler.get_last_lr()[0]}
            if data.has_val and (epoch % self.val_every == 0 or epoch == epochs):
                preds = task.predict(method, data.loader("val"), device)
                val = task.metrics("val", preds)
                log.update(val)
                val_loss = task.val_loss(preds)
                if self.select == "best" and val_loss < best["loss"]:
                    best = {"loss": val_loss, "epoch": epoch, "state": method.trainable_state()}
            logger.log_metrics(log, step=epoch)
            bar.set_postfix(loss=f"{log['train/loss']:.4g}")
        if best["state"] is not None:
            method.load_trainable_state(best["state"])
        return {"epochs": epochs, "train_s": time.perf_counter() - start,
                "selected_epoch": best["epoch"]}
