"""The training job (``job=train``) and the parameter job (``job=params``).

Longer than most modules: a training job's whole life (build, train, the method's post-hoc
step, score, publish, checkpoint) reads top to bottom in one file.

Both write one run folder through :class:`uqbench.records.runfolder.RunFolder`: the job holds
its lock throughout, mends what a killed job left, reuses a finished run only if it has the
same configuration, and publishes all files at once. A training job continues an unfinished
run from its checkpoint. Under a cluster manager that starts one process per device, only
rank 0 locks and writes; the others train beside it::

    <run_dir>/config.yaml            resolved config
    <run_dir>/results.json           choices, settings, params, metrics, time (written last)
    <run_dir>/predictions/<split>.npz per-example predictions
    <run_dir>/figure.png             where the dataset can be drawn
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from uqbench.identity import differences
from uqbench.records.loggers import Logger, NullLogger, RunLabels, log_results, run_labels
from uqbench.records.results import write_stage
from uqbench.records.runfolder import ConfigMismatchError, RunExistsError, RunFolder
from uqbench.runner import objective, outcomes, parts
from uqbench.runner.engine import checkpoints
from uqbench.runner.engine import fabric as engine
from uqbench.runner.engine.evaluation import Splits, evaluate, forward_cost
from uqbench.runner.engine.fabric import resolve_device
from uqbench.runner.engine.loop import Preempted
from uqbench.runner.outcomes import RunFailed
from uqbench.runner.parts import (
    build_parts,
    environment,
    method_diagnostics,
    seed_and_threads,
)
from uqbench.runner.spec import RunSpec

log = logging.getLogger("uqbench")


def train_job(spec: RunSpec) -> dict[str, Any]:
    """Train and evaluate one configuration in its run folder; return the results dict (also
    written to disk)."""
    with RunFolder(spec.run_dir, writer=engine.rank() == 0) as folder:
        return _launch(spec, folder)


# --- the training job: checks, then one launch per process ----------------------------------

def trained_spec(spec: RunSpec) -> tuple[RunSpec, Any]:
    """The trainer a training job builds (it checks its own settings:
    :class:`uqbench.runner.engine.loop.Trainer`) and the job's spec with the recipe's batch
    (``trainer.batch_size``) put where it acts, ``dataset.batch_size``: the run's config
    records it there."""
    trainer = spec.trainer.build()
    if trainer.batch_size is not None and spec.dataset.get("batch_size") != trainer.batch_size:
        spec = spec.derive({"dataset.batch_size": trainer.batch_size})
    return spec, trainer


def _launch(spec: RunSpec, folder: RunFolder) -> dict[str, Any]:
    """Check the trainer, reuse a finished run, find the checkpoint, launch :func:`_train`."""
    spec, trainer = trained_spec(spec)
    if not trainer.updates_weights:
        log.warning("trainer.epochs=%s, lr=%s: the untrained model is evaluated "
                    "(results.json: train.updated_weights=false)", trainer.epochs,
                    (spec.trainer.get("optimizer") or {}).get("lr"))
    check_batch(spec, trainer)
    device, fallback = resolve_device(spec.device)
    engine.check(device, trainer)  # a layout this machine cannot run fails here
    if (existing := reuse(spec, folder)) is not None:
        return existing
    resume = resume_point(spec, folder.run_dir)
    fabric = engine.fabric(device, trainer)  # after the reuse: a skipped run never loads it
    if fallback:
        log.warning("%s", fallback)
    # Everything a process needs, resolved here as plain data: spawned processes have no
    # Hydra context (and Lightning walks the launch's arguments as collections)
    spawns = fabric.world_size > 1 and not engine.external_processes()
    with engine.StopRequest(forward=True) if spawns else contextlib.nullcontext():
        outcome = fabric.launch(_train, spec.plain(), folder, trainer, spec.header(), resume,
                                fallback)
    if isinstance(outcome, Preempted):
        raise outcome
    return outcome


def reuse(spec: RunSpec, folder: RunFolder) -> dict[str, Any] | None:
    """A finished run's results skip_existing may return; None: run. Refuses another config.
    In a multirun a finished run of the same configuration is always reused (overwrite=true
    replaces it), so that the same sweep again retrains only its failed and missing runs."""
    in_sweep = outcomes.sweep_dir() is not None
    kept = folder.reuse(dict(spec.config), spec.overwrite, spec.skip_existing or in_sweep)
    if kept is not None:
        log.info("skip: %s holds this configuration's results (%s)", folder.run_dir,
                 "skip_existing=true" if spec.skip_existing else "a sweep reuses them")
    return kept


def check_batch(spec: RunSpec, trainer: Any) -> None:
    """The step's batch must split evenly enough over the processes and micro-batches."""
    parts = trainer.world_size * trainer.accumulate
    batch = spec.dataset.get("batch_size")
    if parts > 1 and int(batch) < parts:
        raise ValueError(
            f"the batch of {batch} examples per optimiser step cannot be cut "
            f"into {trainer.world_size} processes × {trainer.accumulate} micro-batches "
            f"(trainer.devices × num_nodes × accumulate); raise trainer.batch_size or lower "
            f"trainer.accumulate")


def resume_point(spec: RunSpec, run_dir: Path) -> Path | None:
    """The checkpoint this run continues from, or None; refuses one of another configuration
    (showing the difference) or an unreadable one (naming it, keeping it)."""
    path = run_dir / checkpoints.RESUME
    if not path.exists():
        return None
    state = checkpoints.load(path)
    diff = differences(state.get("config") or {}, dict(spec.config))
    if diff:
        raise ConfigMismatchError(
            f"{run_dir} holds an unfinished run of another configuration (its checkpoint "
            f"{path}):\n  " + "\n  ".join(diff) + "\ngive this run its own folder "
            "(run_name=<name>), continue that one with its own command, or delete the "
            "checkpoint to start over")
    if not spec.resume:
        if not spec.overwrite:
            raise RunExistsError(
                f"{path} holds this run's progress (epoch {state['epoch']}, step "
                f"{state['step']}) and resume=false was asked: pass overwrite=true to start "
                f"over (the checkpoint is replaced), or drop resume=false to continue")
        return None
    log.info("resuming from %s (epoch %s, step %s)", path, state["epoch"], state["step"])
    return path


# --- one process's share: build, train, score, assemble results, publish --------------------

@dataclass
class Built:
    """What a process built: the method, its Fabric-wrapped model, data, task, backbone, splits."""

    method: Any
    model: Any
    data: Any
    task: Any
    backbone: Any
    params: dict[str, Any]
    splits: Splits


@dataclass
class Scored:
    """The test-time outcome of a trained model, before the rank-0-only diagnostics."""

    metrics: dict[str, Any]
    predictions: dict[str, Any]
    calibration: Any
    eval_s: float
    cost: dict[str, Any]
    posthoc: dict[str, Any]  # what Method.fit_posthoc returned


def _train(fabric: Any, plain: dict[str, Any], folder: RunFolder, trainer: Any, header: dict,
           resume: Path | None, fallback: str | None) -> dict[str, Any] | Preempted | None:
    """One process's share of a training job (all of it on one device), from its spec as
    plain data (:meth:`RunSpec.plain`). Every process builds, trains and scores; rank 0 writes
    the run folder and returns the results."""
    spec = RunSpec.from_plain(plain)
    _start_process(spec, fabric.device)
    rank0 = fabric.global_rank == 0
    built = _build(fabric, spec, trainer)
    config = dict(spec.config)
    logger = spec.logger.build() if rank0 else NullLogger()
    logger.start(folder.run_dir, _labels(spec, "train"), config, resume=resume is not None)
    resume_state = checkpoints.load(resume) if resume is not None else None
    try:
        train = _fit(fabric, trainer, built, logger, resume_state, _saver(folder, config, rank0))
        del resume_state  # the checkpoint's tensors, before scoring needs the memory
        if isinstance(train, Preempted):
            return train if rank0 else None
        return conclude(spec, folder, header, trainer, fabric, fallback, built, train, logger,
                        rank0)
    except (Exception, SystemExit) as err:  # the work had started: a failed run, not a mistake
        raise RunFailed(folder.run_dir, err, failed_run(spec, header)) from err
    finally:
        logger.finish(failed=True)  # a no-op after a published run closed it: this one failed


def failed_run(spec: RunSpec, header: dict) -> dict[str, Any]:
    """What results.json says of a run before its metrics (the header, the groups' settings as
    configured, the table layout): a failed run's record, so that its table cell counts it."""
    return {**header, "eval_splits": spec.config.get("eval_splits"),
            "settings": {g: dict(getattr(spec, g).settings)
                         for g in ("dataset", "method", "backbone", "task", "trainer")},
            "table": spec.config.get("table"), "failed": True}


def conclude(spec: RunSpec, folder: RunFolder, header: dict, trainer: Any, fabric: Any,
             fallback: str | None, built: Built, train: dict[str, Any], logger: Logger,
             rank0: bool = True) -> dict[str, Any] | None:
    """After the fit: score the trained model, then (rank 0) assemble results.json, publish
    the run folder with its checkpoint and figures, and drop the resume checkpoint."""
    scored = _score(built, fabric.device)
    keep = trainer.keep_checkpoint != "none" and trainer.updates_weights
    trained = engine.trainable_state(fabric, built.model, built.method) if keep else None
    if not rank0:
        return None
    results = _results(spec, header, trainer, fabric, fallback, built, train, scored)
    final = _final_checkpoint(folder.run_dir, spec, trainer, trained) if keep else None
    plot = spec.plot and built.splits.every  # the figures draw the test and OOD data
    draw = _drawer(spec, built, scored, fabric.device) if plot else None
    publish_run(spec, folder, results, scored.predictions, draw, logger, final)
    shutil.rmtree(folder.run_dir / Path(checkpoints.RESUME).parent, ignore_errors=True)
    return results


def _start_process(spec: RunSpec, device: torch.device) -> None:
    """Seeds, threads and the peak-memory counter of this process, before anything is built."""
    seed_and_threads(spec)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _build(fabric: Any, spec: RunSpec, trainer: Any) -> Built:
    method, data, task, backbone, splits = build_parts(spec, fabric.device,
                                                       trainer.activation_checkpointing)
    objective.check_split(spec.objective, data, spec.dataset.name)
    params = method.param_counts()  # whole tensors: before FSDP shards them
    model = fabric.setup_module(method)
    model.mark_forward_method("loss")
    return Built(method, model, data, task, backbone, params, splits)


def _saver(folder: RunFolder, config: dict, rank0: bool) -> Callable[[dict[str, Any]], None]:
    def save(state: dict[str, Any]) -> None:  # every process gathers (FSDP), rank 0 writes
        if rank0:
            checkpoints.save(folder.run_dir / checkpoints.RESUME, {**state, "config": config})
    return save


def _fit(fabric: Any, trainer: Any, built: Built, logger: Logger, resume: dict | None,
         save: Callable[[dict[str, Any]], None]) -> dict[str, Any] | Preempted:
    """The trainer's facts, or the Preempted that stopped it (its checkpoint written)."""
    with engine.StopRequest() as stop:
        try:
            return trainer.fit(built.method, built.data, built.task, logger, fabric=fabric,
                               model=built.model, resume=resume, save=save, stop=stop)
        except Preempted as preempted:
            log.warning("%s", preempted)
            logger.finish(failed=True)  # cut short; the resumed job continues its record
            return preempted


def _score(built: Built, device: torch.device) -> Scored:
    posthoc = built.method.fit_posthoc(built.data, device)
    start = time.perf_counter()
    metrics, predictions, calibration = evaluate(built.model, built.data, built.task, device,
                                                 built.splits)
    eval_s = time.perf_counter() - start
    cost = forward_cost(built.model, built.data, device, built.splits.cost_split)
    return Scored(metrics, predictions, calibration, eval_s, cost, posthoc)


def _results(spec: RunSpec, header: dict, trainer: Any, fabric: Any, fallback: str | None,
             built: Built, train: dict[str, Any], scored: Scored) -> dict[str, Any]:
    """results.json of a training job (rank 0 runs the method's own diagnostics first)."""
    method, data, metrics = built.method, built.data, scored.metrics
    start = time.perf_counter()
    metrics.update(method_diagnostics(method, data, fabric.device, scored=built.splits.eval))
    diagnostics_s = time.perf_counter() - start
    results = {
        **header,
        "eval_splits": spec.config.get("eval_splits"),
        "settings": {
            "dataset": dict(spec.dataset.settings) | data.settings(),
            "method": dict(spec.method.settings) | method.settings(),
            "backbone": dict(spec.backbone.settings) | built.backbone.details(),
            "task": dict(spec.task.settings),
            "trainer": {k: v for k, v in spec.trainer.settings.items()
                        if k not in ("progress", "log_every")},
        },
        "params": built.params,
        "metrics": metrics,
        "calibration": scored.calibration,
        "posthoc": scored.posthoc,
        "time": {"train_s": train["train_s"], "eval_s": scored.eval_s,
                 "diagnostics_s": diagnostics_s},
        "cost": scored.cost,
        "environment": environment(),
        "train": {"epochs": train["epochs"], "selected_epoch": train["selected_epoch"],
                  "selected_by": train.get("selected_by"),
                  "selected_value": train.get("selected_value"),
                  "updated_weights": trainer.updates_weights,
                  "device": str(fabric.device), "device_note": fallback,
                  "precision": trainer.precision, "strategy": type(fabric.strategy).__name__,
                  "world_size": fabric.world_size, "accumulate": trainer.accumulate,
                  "steps_run": train["steps_run"], "resumed_at": train.get("resumed_at"),
                  "stacked_with": train.get("stacked_with")},
        "table": spec.config.get("table"),
    }
    # the recipe rows a table marks
    return results | {"recipe": parts.recipes_used(dict(spec.config), results)}


def _final_checkpoint(run_dir: Path, spec: RunSpec, trainer: Any, trained: Any
                      ) -> dict[str, Any]:
    """checkpoint.ckpt: the trained weights (and, with keep_checkpoint=full, the resume state)."""
    final = {"trainable": trained, "config": dict(spec.config), "method": spec.method.name}
    if trainer.keep_checkpoint == "full" and (run_dir / checkpoints.RESUME).exists():
        final["resume"] = checkpoints.load(run_dir / checkpoints.RESUME)
    return final


def _drawer(spec: RunSpec, built: Built, scored: Scored, device: torch.device
            ) -> Callable[[Path], list[Path]]:
    title = f"{spec.run_subdir}  test NLL {scored.metrics.get('test/nll', float('nan')):.3f}"
    task, method, data = built.task, built.method, built.data

    def draw(folder: Path) -> list[Path]:
        """figure.png where the dataset can be drawn, the task's diagnostics in figures/."""
        drawn = [task.plot(folder / "figure.png", method, data, device, title=title)
                 ] if hasattr(task, "plot") else []
        drawn += task.figures(scored.predictions, folder / "figures", data.ood_splits)
        return [p for p in drawn if p is not None]
    return draw


# --- publishing -----------------------------------------------------------------------------

def publish_run(spec: RunSpec, folder: RunFolder, results: dict,
                predictions: dict[str, dict[str, np.ndarray]],
                draw: Callable[[Path], list[Path]] | None = None,
                logger: Logger | None = None, checkpoint: dict | None = None) -> None:
    """Stage every file of the run (``draw`` puts the figures into the staging folder), swap
    the folder in, then hand the summary, figures and predictions to the logger: the results
    are on disk before any tracker is waited for."""
    with folder.staging() as stage:
        write_stage(stage, dict(spec.config), results,
                    predictions if spec.save_predictions else {})
        if checkpoint is not None:
            checkpoints.save(stage / checkpoints.FINAL, checkpoint)
        images = [p.relative_to(stage) for p in draw(stage)] if draw is not None else []
        folder.publish(stage)
    if logger is not None:
        log_results(logger, results, folder.run_dir, images)


def _labels(spec: RunSpec, job: str) -> RunLabels:
    """The tracker's labels of this job, which has its own run folder."""
    return run_labels(dict(spec.config), dict(spec.choices), job, spec.run_subdir)
