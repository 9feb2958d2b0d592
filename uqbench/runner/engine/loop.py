"""One training loop for every method: the method supplies the loss, the task the validation.

The loop is a :class:`Trainer`, built by Hydra from ``conf/trainer/<name>.yaml`` (the optimiser
arrives as a ``_partial_`` factory): its settings are checked when it is built, so a bad value
fails before any data is read or any model is built. ``Trainer.fit`` runs one ``_Loop``: set
up, resume, the epochs (each its steps, then its end), the outcome.

Longer than ~350 lines because the Trainer's settings and the loop that reads them share one
state and change together; the gradient arithmetic lives apart, in
:mod:`uqbench.runner.engine.gradients`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sized
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
from tqdm.auto import tqdm

from uqbench.contracts import Shard, stack_streams, to_device
from uqbench.records.loggers import Logger
from uqbench.runner.engine import fabric as engine
from uqbench.runner.engine.checkpoints import rng_state, set_rng_state
from uqbench.runner.engine.gradients import clip_groups, clip_per_member_, decay_toward_
from uqbench.runner.engine.memory import Strategy, check_precision_and_strategy

if TYPE_CHECKING:  # types only: the loop takes a built method, data and task from the runner
    from uqbench.data.base import DataModule
    from uqbench.methods.base import Method
    from uqbench.tasks.base import Task

# The choices of the trainer's settings, declared once: the config check (check_types) reads
# the annotations, the constructor checks a Trainer built in code against the same tuples.
Schedule = Literal["constant", "cosine"]
Selection = Literal["last", "best"]
SelectMetric = Literal["nll", "acc"]  # what select=best ranks epochs by: lowest nll, highest acc
DecayTarget = Literal["zero", "init"]
KeepCheckpoint = Literal["trainable", "full", "none"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
SELECTIONS: tuple[str, ...] = get_args(Selection)
SELECT_METRICS: tuple[str, ...] = get_args(SelectMetric)
DECAY_TARGETS: tuple[str, ...] = get_args(DecayTarget)
KEEP_CHECKPOINT: tuple[str, ...] = get_args(KeepCheckpoint)
PROGRESS = ("auto", "bar", "lines", "none")


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


def schedule(optimizer: torch.optim.Optimizer, trainer: Trainer, steps_per_epoch: int) -> Any:
    """The learning-rate schedule of ``trainer`` (warm-up, then constant or cosine) over its
    epochs of ``steps_per_epoch`` optimiser steps, stepped once per optimiser step."""
    total = trainer.epochs * steps_per_epoch
    # warm-up in optimiser steps when given (LoRA-Ensemble's recipe), else in epochs
    warmup = (trainer.warmup_steps if trainer.warmup_steps is not None
              else trainer.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, warmup, trainer.schedule))


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


def logged_epoch(epoch: int, trainer: Any) -> bool:
    """Whether ``lines`` progress writes this epoch's line: every ``trainer.log_every`` epochs,
    or (null, the default) about ten lines a run, at epochs that validate (the smallest
    multiple of ``val_every`` that gives at most ten); always the first and the last."""
    every = trainer.log_every
    if every is None:
        step = trainer.val_every or 1
        every = step * max(1, math.ceil(trainer.epochs / (10 * step)))
    return epoch == 1 or epoch == trainer.epochs or epoch % every == 0


def epoch_line(epoch: int, epochs: int, metrics: dict[str, float], seconds: float) -> str:
    """One epoch as one line: ``epoch 3/10 train/loss 0.1234 val/nll 0.567 elapsed 12.3s``
    (the validation metrics where the epoch evaluated them)."""
    shown = [f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith(("train/", "val/"))]
    return f"epoch {epoch}/{epochs} " + " ".join(shown) + f" elapsed {seconds:.1f}s"


class Trainer:
    """Optimisation and model selection, the same for every method.

    optimizer: a factory ``optimizer(params=…)`` (Hydra ``_partial_``). epochs: passes over the
    training split (0 = evaluate the untrained model). batch_size: the recipe's training batch;
    the runner writes it into ``dataset.batch_size`` before the data is built (None = keep the
    dataset's). grad_clip: max gradient norm or None, applied to each member's gradient on its
    own (:func:`clip_groups`): one member's large gradient never shrinks another's step.
    warmup_epochs / warmup_steps: linear warm-up, in epochs or (when set) optimiser steps.
    schedule: constant | cosine after the warm-up. select: last | best (the trainable parameters
    of the best validated epoch). select_metric: what best means: nll (the lowest validation
    loss, the task's ``val_loss``) | acc (the highest validation accuracy; of equal ones the
    earlier epoch, as with equal losses). val_every: epochs between validation passes (only
    validated epochs can be selected); 0: none while training (select=last), the scoring
    after it validates. progress: auto (a bar on a terminal, log lines otherwise) | bar |
    lines | none (:func:`progress_mode`). log_every: epochs between the log lines of ``lines``
    (null: about ten a run, at validated epochs; 1: every epoch), the first and last always
    written (:func:`logged_epoch`).
    decay_to: zero or None (the optimiser's own weight decay, toward 0) | init (decoupled weight
    decay toward the values training started from — for SVE the pretrained spectrum, for full
    fine-tuning the pretrained weights: p ← p − lr·wd·(p − p₀) after each step, with the
    optimiser's ``weight_decay`` as wd and the optimiser itself run without decay).
    """

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer], epochs: int = 300,
                 batch_size: int | None = None, grad_clip: float | None = None,
                 warmup_epochs: int = 0, warmup_steps: int | None = None,
                 schedule: Schedule = "constant",
                 select: Selection = "last", select_metric: SelectMetric = "nll",
                 val_every: int = 10, progress: bool | str = "auto",
                 log_every: int | None = None,
                 decay_to: DecayTarget | None = None, precision: str | int = "32",
                 strategy: Strategy = "auto", devices: int = 1, num_nodes: int = 1,
                 accumulate: int = 1, activation_checkpointing: bool = False,
                 checkpoint_every: int | None = 500,
                 keep_checkpoint: KeepCheckpoint = "trainable") -> None:
        if int(epochs) < 0:
            raise ValueError(f"trainer.epochs must be >= 0, got {epochs}")
        if schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule '{schedule}' is not one of {SCHEDULES}")
        if select not in SELECTIONS:
            raise ValueError(f"trainer.select '{select}' is not one of {SELECTIONS}")
        if select_metric not in SELECT_METRICS:
            raise ValueError(f"trainer.select_metric '{select_metric}' is not one of "
                             f"{SELECT_METRICS}")
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
        self.schedule, self.select, self.select_metric = schedule, select, select_metric
        progress_mode(progress, tty=False)  # refuses an unknown mode when the trainer is built
        self.val_every, self.progress = int(val_every), progress
        if log_every is not None and int(log_every) < 1:
            raise ValueError(f"trainer.log_every must be >= 1 (epochs between log lines) or "
                             f"null (the validation epochs), got {log_every}")
        self.log_every = None if log_every is None else int(log_every)
        if self.val_every < 0 or (self.val_every == 0 and select != "last"):
            raise ValueError(f"trainer.val_every must be >= 1 (epochs between validation "
                             f"passes), or 0 for none with trainer.select=last; got "
                             f"{val_every} with select={select}")
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

    def check_task(self, task: Task) -> None:
        """Refuse a selection metric the task does not compute (acc of a regression task)
        before anything trains."""
        key = f"val/{self.select_metric}"
        if self.select == "best" and key not in task.metric_names("val"):
            known = tuple(m for m in SELECT_METRICS if f"val/{m}" in task.metric_names("val"))
            raise ValueError(f"trainer.select_metric '{self.select_metric}' is not a metric of "
                             f"the {task.name} task; with trainer.select=best choose one of "
                             f"{known}")

    def validates(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` ends with a validation pass: every ``val_every``, and the
        last; never with ``val_every: 0`` (select=last only: the run's scoring validates)."""
        if self.val_every == 0:
            return False
        return epoch % self.val_every == 0 or epoch == self.epochs

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
        self.check_task(task)
        params = [p for p in method.parameters() if p.requires_grad]
        if not params and self.epochs > 0:
            raise ValueError(f"method '{method.name}' has no trainable parameters")
        start = time.perf_counter()
        if self.epochs == 0:
            return {"epochs": 0, "train_s": 0.0, "selected_epoch": 0, "selected_by": "last",
                    "selected_value": None, "steps_run": 0}
        if fabric is None:  # no runner: this process, on the device the method is on
            fabric = engine.fabric(next(method.parameters()).device, self)
            model = fabric.setup_module(method)
            model.mark_forward_method("loss")
        loop = _Loop(self, method, data, task, logger or Logger(), fabric, model, params, start)
        if resume is not None:
            loop.resume(resume)
        loop.run(save, stop)
        return loop.outcome(resume)


class _Loop:
    """One fit: the optimiser, schedule and step sizes it sets up, and its position (what a
    checkpoint stores and a resumed job restores). Reads top to bottom as the fit runs:
    set up, resume, run the epochs (each: its batches' steps, then its end), the outcome."""

    def __init__(self, trainer: Trainer, method: Method, data: DataModule, task: Task,
                 logger: Logger, fabric: Any, model: Any, params: list[torch.nn.Parameter],
                 start: float) -> None:
        self.trainer, self.method, self.data, self.task = trainer, method, data, task
        self.logger, self.fabric, self.model, self.start = logger, fabric, model, start
        self.optimizer, self.anchors, self.decay = self._optimizer(params)
        self.groups = clip_groups(method, params) if trainer.grad_clip is not None else []
        self.shard = Shard(rank=fabric.global_rank, world=fabric.world_size,
                           parts=trainer.accumulate)
        self.sizes = self._step_sizes()
        self.scheduler = self._schedule()
        # the position of a fresh fit: epoch 1, step 0 (resume() moves it)
        # select=best: the best validated epoch so far; "loss" is its selection metric oriented
        # so that lower is better (−acc), "value" the metric itself
        self.best: dict[str, Any] = {"loss": math.inf, "value": None, "epoch": trainer.epochs,
                                     "state": None}
        self.first_epoch, self.skip, self.running, self.n, self.elapsed = 1, 0, 0.0, 0, 0.0
        self.epoch_rng: dict[str, Any] | None = None    # the data order of the epoch running
        self.resumed_rng: dict[str, Any] | None = None  # the streams where a checkpoint left
        self.global_step, self.steps_run = 0, 0

    # --- set up ---------------------------------------------------------------------------

    def _optimizer(self, params: list[torch.nn.Parameter]
                   ) -> tuple[Any, list[torch.Tensor], float]:
        """The optimiser set up by Fabric, and the p₀ anchors and rate of decay toward them."""
        factory = self.trainer.optimizer
        anchors: list[torch.Tensor] = []
        decay = 0.0
        if self.trainer.decay_to == "init":  # the optimiser runs without decay; we decay to p₀
            decay = float(getattr(factory, "keywords", {}).get("weight_decay") or 0.0)
            optimizer = factory(params=params, weight_decay=0.0)
            anchors = [p.detach().clone() for p in params] if decay else []
        else:
            optimizer = factory(params=params)
        return self.fabric.setup_optimizers(optimizer), anchors, decay

    def _step_sizes(self) -> list[int]:
        """The examples of each optimiser step of an epoch (all processes together)."""
        n_train = len(cast(Sized, self.data.dataset("train")))
        sizes = self.shard.steps(n_train, self.data.batch_size)
        if not sizes:
            raise ValueError(f"the training split has {n_train} examples, fewer than the "
                             f"{self.fabric.world_size} processes × {self.trainer.accumulate} "
                             f"micro-batches of one step")
        return sizes

    def _schedule(self) -> Any:
        return schedule(self.optimizer, self.trainer, len(self.sizes))

    def resume(self, resume: dict[str, Any]) -> None:
        """Continue from a checkpoint: weights, optimiser, schedule, precision state, position;
        a finished epoch's random streams now, an unfinished one's when it replays."""
        fabric, model, method = self.fabric, self.model, self.method
        engine.load_trainable_state(fabric, model, method, resume["trainable"])
        engine.load_optimizer_state(fabric, model, self.optimizer, resume["optimizer"])
        self.scheduler.load_state_dict(resume["scheduler"])
        fabric.strategy.precision.load_state_dict(resume.get("precision") or {})
        self.best = resume["best"]
        self.elapsed = float(resume["train_s"])
        if resume["epoch_done"]:
            self.first_epoch = resume["epoch"] + 1
            set_rng_state(resume["rng"])
        else:
            self.first_epoch, self.skip = resume["epoch"], resume["step"]
            self.running, self.n = resume["running"]
            self.epoch_rng, self.resumed_rng = resume["epoch_rng"], resume["rng"]
        self.global_step = (self.first_epoch - 1) * len(self.sizes) + self.skip

    def state(self, epoch: int, step: int, epoch_done: bool) -> dict[str, Any]:
        """Everything needed to continue from here (``Trainer.fit(resume=state)``)."""
        fabric, model = self.fabric, self.model
        return {"epoch": epoch, "step": step, "epoch_done": epoch_done,
                "global_step": self.global_step,
                "trainable": engine.trainable_state(fabric, model, self.method),
                "optimizer": engine.optimizer_state(fabric, model, self.optimizer),
                "scheduler": self.scheduler.state_dict(),
                "precision": fabric.strategy.precision.state_dict(),
                "rng": rng_state(), "epoch_rng": None if epoch_done else self.epoch_rng,
                "running": (self.running, self.n), "best": self.best,
                "train_s": self.elapsed + time.perf_counter() - self.start}

    # --- the epochs -----------------------------------------------------------------------

    def run(self, save: Callable[[dict[str, Any]], None] | None,
            stop: Callable[[], bool] | None) -> None:
        """The remaining epochs; then the selected epoch's weights (select=best)."""
        trainer, fabric = self.trainer, self.fabric
        shown = progress_mode(trainer.progress) if fabric.global_rank == 0 else "none"
        bar = tqdm(range(self.first_epoch, trainer.epochs + 1), desc=f"train {self.method.name}",
                   disable=shown != "bar", dynamic_ncols=True, leave=False)
        for epoch in bar:
            self._train_epoch(epoch, save, stop)
            log = self._end_epoch(epoch)
            bar.set_postfix(loss=f"{log['train/loss']:.4g}")
            if shown == "lines" and logged_epoch(epoch, trainer):
                console.info("%s", epoch_line(epoch, trainer.epochs, log,
                                              self.elapsed + time.perf_counter() - self.start))
            if save is not None:  # the last one too: a kill while scoring retrains nothing
                save(self.state(epoch, len(self.sizes), True))
            if stop is not None and epoch < trainer.epochs and _agreed(fabric, stop()):
                raise Preempted(epoch + 1, 0, self.global_step, getattr(stop, "signum", None))
        if self.best["state"] is not None:
            engine.load_trainable_state(fabric, self.model, self.method, self.best["state"])

    def _train_epoch(self, epoch: int, save: Callable[[dict[str, Any]], None] | None,
                     stop: Callable[[], bool] | None) -> None:
        """The epoch's optimiser steps (from the checkpoint's step in a resumed epoch), with a
        checkpoint every ``checkpoint_every`` steps and a stop when asked."""
        every = self.trainer.checkpoint_every
        self.model.train()
        loader = self._epoch_loader()
        for step in range(self.skip, len(self.sizes)):
            loss_value = self._step(loader, self.sizes[step], epoch, step)
            self.scheduler.step()
            self.running += loss_value
            self.n += 1
            self.global_step += 1
            self.steps_run += 1
            more = step + 1 < len(self.sizes)
            if save is not None and every and self.global_step % every == 0 and more:
                save(self.state(epoch, step + 1, False))
            if stop is not None and more and _agreed(self.fabric, stop()):
                if save is not None:
                    save(self.state(epoch, step + 1, False))
                raise Preempted(epoch, step + 1, self.global_step, getattr(stop, "signum", None))
        self.epoch_rng, self.resumed_rng = None, None

    def _epoch_loader(self) -> Any:
        """This epoch's batches. A resumed epoch replays its data order, skips the steps done,
        then puts the random streams back where the checkpoint left them; a new epoch records
        its data order (a checkpoint within it stores that)."""
        on_skip = None
        if self.epoch_rng is not None:
            set_rng_state(self.epoch_rng)
            if self.resumed_rng is not None:
                on_skip = partial(set_rng_state, self.resumed_rng)
        else:
            self.epoch_rng, self.skip, self.running, self.n = rng_state(), 0, 0.0, 0
        streams = self.method.data_streams()
        if streams == 1:
            return iter(self.data.loader("train", train=True, shard=self.shard, skip=self.skip,
                                         on_skip=on_skip))
        # one independently shuffled loader per stream (a Deep Ensemble member's own data
        # order), drawn in stream order from the epoch's random state; a step's batch stacks
        # theirs, stream-major
        loaders = [iter(self.data.loader("train", train=True, shard=self.shard, skip=self.skip,
                                         on_skip=on_skip if k == streams - 1 else None))
                   for k in range(streams)]
        return map(lambda *batches: stack_streams(list(batches)), *loaders)

    def _end_epoch(self, epoch: int) -> dict[str, float]:
        """The epoch's mean loss over every process, validation where due, logged by rank 0."""
        fabric, trainer = self.fabric, self.trainer
        mean_loss = self.running / self.n
        if fabric.world_size > 1:  # every process's share of each step's loss, summed
            mean_loss = float(fabric.all_reduce(torch.tensor(mean_loss), reduce_op="sum"))
        log = {"train/loss": mean_loss, "epoch": epoch, "lr": self.scheduler.get_last_lr()[0]}
        if self.data.has_val and trainer.validates(epoch):
            log.update(self._validate(epoch))
        if fabric.global_rank == 0:
            self.logger.log_metrics(log, step=epoch)
        return log

    def _validate(self, epoch: int) -> dict[str, float]:
        """The validation metrics; with select=best, keep the weights of the best epoch."""
        # Task.predict reads any loader (TensorBatches too), whatever its annotation says
        preds = self.task.predict(self.model, self.data.loader("val"),  # type: ignore[arg-type]
                                  self.fabric.device)
        val = self.task.metrics("val", preds)
        if self.trainer.select == "best":
            self._keep_if_best(epoch, preds, val)
        return val

    def _keep_if_best(self, epoch: int, preds: Any, val: dict[str, float]) -> None:
        """Keep this epoch's weights if its selection metric beats every earlier validated
        epoch's: strictly, so that of equal ones the earlier epoch stays. nll is the task's
        ``val_loss`` (the predictive distribution's NLL under ``task.aggregation``)."""
        metric = self.trainer.select_metric
        value = self.task.val_loss(preds) if metric == "nll" else val[f"val/{metric}"]
        loss = -value if self.task.direction(f"val/{metric}") == "maximize" else value
        if loss < self.best["loss"]:
            self.best = {"loss": loss, "value": value, "epoch": epoch,
                         "state": engine.trainable_state(self.fabric, self.model, self.method)}

    def outcome(self, resume: dict[str, Any] | None) -> dict[str, Any]:
        """The fit's timing, model-selection and resumption facts: the epoch whose weights were
        kept, and by what (``last``, or the validation metric of select=best and its value
        there; ``last`` too where no epoch was validated)."""
        chosen = self.best["state"] is not None
        return {"epochs": self.trainer.epochs,
                "train_s": self.elapsed + time.perf_counter() - self.start,
                "selected_epoch": self.best["epoch"],
                "selected_by": f"val/{self.trainer.select_metric}" if chosen else "last",
                "selected_value": self.best.get("value") if chosen else None,
                "steps_run": self.steps_run,
                "resumed_at": None if resume is None else
                {"epoch": resume["epoch"] + int(resume["epoch_done"]),
                 "step": 0 if resume["epoch_done"] else resume["step"],
                 "global_step": resume["global_step"]}}

    # --- one optimiser step ---------------------------------------------------------------

    def _step(self, loader: Any, size: int, epoch: int, step: int) -> float:
        """One optimiser step over this process's micro-batches of a ``size``-example batch;
        returns this process's share of the step's loss."""
        fabric, model, optimizer, shard = self.fabric, self.model, self.optimizer, self.shard
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
                        f"(lr {self.scheduler.get_last_lr()[0]:.3g}); lower "
                        f"trainer.optimizer.lr, set trainer.grad_clip, or check the data. No "
                        f"results were written.")
                # the processes' gradients are averaged: × world; a mean loss: × its share
                scale = shard.world * (1 if sums else share)
                fabric.backward(loss if scale == 1 else loss * scale)
            value += loss.item() if sums or share == 1 else share * loss.item()
        if self.trainer.grad_clip is not None:
            fabric.strategy.precision.unscale_gradients(optimizer)
            clip_per_member_(self.groups, self.trainer.grad_clip)
        optimizer.step()
        if self.anchors:
            decay_toward_(optimizer, self.anchors, self.decay)
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
