"""One training loop for every method: the method supplies the loss, the task the validation.

The loop is a :class:`Trainer`, built by Hydra from ``conf/trainer/<name>.yaml`` (the optimiser
arrives as a ``_partial_`` factory): its settings are checked when it is built, so a bad value
fails before any data is read or any model is built.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from uqbench.contracts import Shard, to_device
from uqbench.records.loggers import Logger
from uqbench.runner import engine
from uqbench.runner.checkpoints import rng_state, set_rng_state
from uqbench.runner.memory import check_precision_and_strategy

if TYPE_CHECKING:  # types only: the loop takes a built method, data and task from the runner
    from uqbench.data.base import DataModule
    from uqbench.methods.base import Method
    from uqbench.tasks.base import Task

SCHEDULES = ("constant", "cosine")
SELECTIONS = ("last", "best")
DECAY_TARGETS = ("zero", "init")
KEEP_CHECKPOINT = ("trainable", "full", "none")
PROGRESS = ("auto", "bar", "lines", "none")
# A gradient group: (parameter, member index into its dim 0, or None for the whole tensor).
Group = list[tuple[torch.nn.Parameter, int | None]]


console = logging.getLogger("uqbench")  # the CLI's log: the terminal (stdout) and the run's log


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


def progress_mode(progress: bool | str | None, tty: bool | None = None) -> str:
    """How training reports its epochs: ``bar`` (a tqdm bar, for a terminal), ``lines`` (one
    log line per epoch, for a log file, SLURM or CI, where a bar's carriage returns pile up) or
    ``none``. ``auto`` is the bar when stderr (where the bar draws) is a terminal, else lines;
    ``true`` means auto and ``false`` none, as before the modes existed. ``tty``: whether stderr
    is a terminal (None: ask it)."""
    if isinstance(progress, bool) or progress is None:
        mode = "auto" if progress else "none"
    else:
        mode = str(progress)
    if mode not in PROGRESS:
        raise ValueError(f"trainer.progress '{progress}' is not one of {PROGRESS} (or true = "
                         f"auto, false = none)")
    if mode == "auto":
        tty = sys.stderr.isatty() if tty is None else tty
        return "bar" if tty else "lines"
    return mode


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float], seconds: float) -> str:
    """One epoch as one line: ``epoch 3/10 train/loss 0.1234 val/nll 0.567 elapsed 12.3s``
    (the validation metrics where the epoch evaluated them)."""
    shown = [f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith(("train/", "val/"))]
    return f"epoch {epoch}/{epochs} " + " ".join(shown) + f" elapsed {seconds:.1f}s"


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
    trainable parameters only). val_every: epochs between validation passes. progress: auto (a bar
    on a terminal, one line per epoch otherwise) | bar | lines | none (:func:`progress_mode`).
    decay_to: zero or None (the optimiser's own weight decay, toward 0) | init (decoupled weight
    decay toward the values training started from — for SVE the pretrained spectrum, for full
    fine-tuning the pretrained weights: p ← p − lr·wd·(p − p₀) after each step, with the
    optimiser's ``weight_decay`` as wd and the optimiser itself run without decay).
    """

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer], epochs: int = 300,
                 batch_size: int | None = None, grad_clip: float | None = None,
                 warmup_epochs: int = 0, warmup_steps: int | None = None,
                 schedule: str = "constant",
                 select: str = "last", val_every: int = 10, progress: bool | str = "auto",
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
        progress_mode(progress, tty=False)  # refuses an unknown mode when the trainer is built
        self.val_every, self.progress = int(val_every), progress
        self.decay_to = decay_to
        precision = str(precision)
        check_precision_and_strategy(precision, strategy)  # the choices memory.Engine knows
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

    def fit(self, method: Method, data: DataModule, task: Task, logger: Logger | None = None,
            *, fabric: Any = None, model: Any = None, resume: dict[str, Any] | None = None,
            save: Callable[[dict[str, Any]], None] | None = None,
            stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Train ``method`` for ``epochs``; return timing, model-selection and resumption facts.

        ``fabric`` and ``model`` (the method set up by it) come from the runner; without them
        the method trains in this process on the device it is on.

        Each optimiser step takes ``batch_size`` examples in all: this process's micro-batches
        of it (:class:`uqbench.data.base.Shard`), each loss weighted by its share of the step,
        so that one process, several, or accumulation compute the same update. ``save(state)``
        is called every ``checkpoint_every`` steps and at each epoch end with everything needed
        to continue (``resume=state``): the trained parameters, optimiser, schedule, random
        streams and position. ``stop()`` is asked after every step (a preemption signal): the
        loop then saves and raises :class:`Preempted`.
        """
        params = [p for p in method.parameters() if p.requires_grad]
        if not params and self.epochs > 0:
            raise ValueError(f"method '{method.name}' has no trainable parameters")
        start = time.perf_counter()
        epochs = self.epochs
        if epochs == 0:
            return {"epochs": 0, "train_s": 0.0, "selected_epoch": 0, "steps_run": 0}
        logger = logger or Logger()
        if fabric is None:
            device = next(method.parameters()).device
            fabric = engine.fabric(device, self)
            model = fabric.setup_module(method)
            model.mark_forward_method("loss")
        anchors: list[torch.Tensor] = []
        if self.decay_to == "init":  # the optimiser runs without decay; we decay toward p₀
            decay = float(getattr(self.optimizer, "keywords", {}).get("weight_decay") or 0.0)
            optimizer = self.optimizer(params=params, weight_decay=0.0)
            anchors = [p.detach().clone() for p in params] if decay else []
        else:
            optimizer = self.optimizer(params=params)
        optimizer = fabric.setup_optimizers(optimizer)
        groups = clip_groups(method, params) if self.grad_clip is not None else []
        world = fabric.world_size
        shard = Shard(rank=fabric.global_rank, world=world, parts=self.accumulate)
        n_train = len(data.dataset("train"))
        sizes = shard.steps(n_train, data.batch_size)
        if not sizes:
            raise ValueError(f"the training split has {n_train} examples, fewer than the "
                             f"{world} processes × {self.accumulate} micro-batches of one step")
        total = epochs * len(sizes)
        # warm-up in optimiser steps when given (LoRA-Ensemble's recipe), else in epochs
        warmup = (self.warmup_steps if self.warmup_steps is not None
                  else self.warmup_epochs * len(sizes))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total, warmup, self.schedule))
        best: dict[str, Any] = {"loss": math.inf, "epoch": epochs, "state": None}
        first_epoch, skip, running, n, elapsed = 1, 0, 0.0, 0, 0.0
        epoch_rng: dict[str, Any] | None = None
        resumed_rng: dict[str, Any] | None = None
        if resume is not None:
            engine.load_trainable_state(fabric, model, method, resume["trainable"])
            engine.load_optimizer_state(fabric, model, optimizer, resume["optimizer"])
            scheduler.load_state_dict(resume["scheduler"])
            fabric.strategy.precision.load_state_dict(resume.get("precision") or {})
            best = resume["best"]
            elapsed = float(resume["train_s"])
            if resume["epoch_done"]:
                first_epoch = resume["epoch"] + 1
                set_rng_state(resume["rng"])
            else:
                first_epoch, skip = resume["epoch"], resume["step"]
                running, n = resume["running"]
                epoch_rng, resumed_rng = resume["epoch_rng"], resume["rng"]
        global_step = (first_epoch - 1) * len(sizes) + skip
        steps_run = 0

        def state(epoch: int, step: int, epoch_done: bool) -> dict[str, Any]:
            return {"epoch": epoch, "step": step, "epoch_done": epoch_done,
                    "global_step": global_step,
                    "trainable": engine.trainable_state(fabric, model, method),
                    "optimizer": engine.optimizer_state(fabric, model, optimizer),
                    "scheduler": scheduler.state_dict(),
                    "precision": fabric.strategy.precision.state_dict(),
                    "rng": rng_state(), "epoch_rng": None if epoch_done else epoch_rng,
                    "running": (running, n), "best": best,
                    "train_s": elapsed + time.perf_counter() - start}

        shown = progress_mode(self.progress) if fabric.global_rank == 0 else "none"
        bar = tqdm(range(first_epoch, epochs + 1), desc=f"train {method.name}",
                   disable=shown != "bar", dynamic_ncols=True, leave=False)
        for epoch in bar:
            model.train()
            if epoch_rng is not None:      # a resumed epoch: its data order, then our place
                set_rng_state(epoch_rng)
                on_skip = (partial(set_rng_state, resumed_rng) if resumed_rng is not None
                           else None)
            else:
                epoch_rng, on_skip, skip, running, n = rng_state(), None, 0, 0.0, 0
            loader = iter(data.loader("train", train=True, shard=shard, skip=skip,
                                      on_skip=on_skip))
            for step in range(skip, len(sizes)):
                loss_value = self._step(fabric, model, optimizer, loader, shard, sizes[step],
                                        groups, anchors, decay if anchors else 0.0, epoch, step,
                                        scheduler)
                scheduler.step()
                running += loss_value
                n += 1
                global_step += 1
                steps_run += 1
                if save is not None and self.checkpoint_every and \
                        global_step % self.checkpoint_every == 0 and step + 1 < len(sizes):
                    save(state(epoch, step + 1, False))
                if stop is not None and step + 1 < len(sizes) and _agreed(fabric, stop()):
                    if save is not None:
                        save(state(epoch, step + 1, False))
                    raise Preempted(epoch, step + 1, global_step, getattr(stop, "signum", None))
            epoch_rng, resumed_rng = None, None
            mean_loss = running / n
            if world > 1:  # every process's share of each step's loss, summed
                mean_loss = float(fabric.all_reduce(torch.tensor(mean_loss), reduce_op="sum"))
            log = {"train/loss": mean_loss, "epoch": epoch, "lr": scheduler.get_last_lr()[0]}
            if data.has_val and (epoch % self.val_every == 0 or epoch == epochs):
                preds = task.predict(model, data.loader("val"), fabric.device)
                val = task.metrics("val", preds)
                log.update(val)
                val_loss = task.val_loss(preds)
                if self.select == "best" and val_loss < best["loss"]:
                    best = {"loss": val_loss, "epoch": epoch,
                            "state": engine.trainable_state(fabric, model, method)}
            if fabric.global_rank == 0:
                logger.log_metrics(log, step=epoch)
            bar.set_postfix(loss=f"{log['train/loss']:.4g}")
            if shown == "lines":
                console.info("%s", epoch_line(epoch, epochs, log,
                                              elapsed + time.perf_counter() - start))
            if save is not None:  # the last one too: a kill while scoring retrains nothing
                save(state(epoch, len(sizes), True))
            if stop is not None and epoch < epochs and _agreed(fabric, stop()):
                raise Preempted(epoch + 1, 0, global_step, getattr(stop, "signum", None))
        if best["state"] is not None:
            engine.load_trainable_state(fabric, model, method, best["state"])
        return {"epochs": epochs, "train_s": elapsed + time.perf_counter() - start,
                "selected_epoch": best["epoch"], "steps_run": steps_run,
                "resumed_at": None if resume is None else
                {"epoch": resume["epoch"] + int(resume["epoch_done"]),
                 "step": 0 if resume["epoch_done"] else resume["step"],
                 "global_step": resume["global_step"]}}

    def _step(self, fabric: Any, model: Any, optimizer: Any, loader: Any, shard: Shard,
              size: int, groups: list[Group], anchors: list[torch.Tensor], decay: float,
              epoch: int, step: int, scheduler: Any) -> float:
        """One optimiser step over this process's micro-batches of a ``size``-example batch;
        returns this process's share of the step's loss."""
        slices = shard.slices(size)
        sums = bool(getattr(model, "loss_sums_examples", False))
        optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for k, (lo, hi) in enumerate(slices):
            batch = to_device(next(loader), fabric.device)
            share = (hi - lo) / size               # this micro-batch's part of the step's mean
            with fabric.no_backward_sync(model, enabled=k < len(slices) - 1):
                # the precision's input dtype and autocast (on one device Fabric leaves a
                # method other than forward alone; under DDP/FSDP this repeats it harmlessly)
                inputs = fabric.strategy.precision.convert_input(batch)
                with fabric.autocast():
                    loss = model.loss(inputs, share=share) if sums else model.loss(inputs)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"the training loss became {loss.item()} at epoch {epoch}, step {step} "
                        f"(lr {scheduler.get_last_lr()[0]:.3g}); lower trainer.optimizer.lr, "
                        f"set trainer.grad_clip, or check the data. No results were written.")
                # the processes' gradients are averaged: × world; a mean loss: × its share
                scale = shard.world * (1 if sums else share)
                fabric.backward(loss if scale == 1 else loss * scale)
            value += loss.item() if sums or share == 1 else share * loss.item()
        if self.grad_clip is not None:
            fabric.strategy.precision.unscale_gradients(optimizer)
            clip_per_member_(groups, self.grad_clip)
        optimizer.step()
        if anchors:
            decay_toward_(optimizer, anchors, decay)
        return value


class Preempted(Exception):
    """The job was asked to stop (SIGTERM, SLURM's USR2): its checkpoint is written."""

    def __init__(self, epoch: int, step: int, global_step: int, signum: int | None = None
                 ) -> None:
        super().__init__(f"stopped on request at epoch {epoch}, step {step} (optimiser step "
                         f"{global_step}); the checkpoint is written: the same command "
                         f"continues the run")
        self.epoch, self.step, self.global_step = epoch, step, global_step
        self.signum = signum

    def __reduce__(self) -> tuple:  # a spawned process hands it back to its parent
        return Preempted, (self.epoch, self.step, self.global_step, self.signum)


def _agreed(fabric: Any, flag: bool) -> bool:
    """True if any process was asked to stop (every process then stops at the same step)."""
    if fabric.world_size == 1:
        return bool(flag)
    return bool(fabric.all_reduce(torch.tensor(float(flag)), reduce_op="sum") > 0)
