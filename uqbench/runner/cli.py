"""The runner: the single Hydra entry point (`uqbench`).

Builds backbone, dataset and method from the config, trains, evaluates every split the dataset
declares, and writes the run folder:

    <run_dir>/config.yaml            resolved config
    <run_dir>/results.json           choices, settings, params, metrics, time (written last)
    <run_dir>/predictions/<split>.npz per-example predictions
    <run_dir>/figure.png             where the dataset can be drawn

Every check that can fail on the user's input runs before any expensive work.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from uqbench.configs import build, check_types, check_value, options_where
from uqbench.contracts import to_device
from uqbench.errors import USER_ERRORS
from uqbench.methods.base import Method
from uqbench.records.loggers import Logger, NullLogger, RunLabels, log_results, run_labels
from uqbench.records.results import group_choices, group_settings, run_header, write_stage
from uqbench.records.runfolder import (
    ConfigMismatchError,
    RunExistsError,
    RunLock,
    differences,
    finished,
    new_stage,
    publish,
    recover,
)
from uqbench.records.runfolder import reuse as reuse_folder
from uqbench.runner import checkpoints, engine, objective
from uqbench.runner.engine import resolve_device
from uqbench.runner.evaluation import evaluate, forward_cost, predict_splits, score
from uqbench.runner.training import NonFiniteLossError, Preempted

log = logging.getLogger("uqbench")


JOBS = ("train", "params", "eval")
DIAGNOSTIC_INPUTS = 256  # test inputs handed to Method.diagnostics


# --- helpers ----------------------------------------------------------------------------------

def check_config(cfg: DictConfig) -> None:
    """Types and choices of the whole config, before anything is read, built or written: every
    buildable group against its constructor's annotations, and the top-level keys."""
    for group in ("backbone", "method", "dataset", "task", "trainer", "logger"):
        if isinstance(cfg.get(group), DictConfig):
            check_types(cfg[group], group)
    check_value("seed", cfg.seed, int)
    check_value("torch_threads", cfg.get("torch_threads"), int | None)
    if cfg.get("torch_threads") is not None and cfg.torch_threads < 1:
        raise ValueError(f"torch_threads must be >= 1 or null, got {cfg.torch_threads}")
    resolve_device(str(cfg.device))
    if cfg.get("job", "train") not in JOBS:
        raise ValueError(f"job '{cfg.job}' is not one of: {', '.join(JOBS)}")
    if cfg.get("job", "train") == "train":
        objective.check(cfg)  # the metric a sweeper reads, before any data or model
    if isinstance(cfg.get("logger"), DictConfig):
        build(cfg.logger)  # a tracker's settings are checked as it is built (cheap, offline)


def environment() -> dict[str, Any]:
    """What decides whether a run is bit-reproducible: thread count and library versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {"torch_threads": torch.get_num_threads(),
                           "python": platform.python_version(), "machine": platform.machine()}
    for package in ("uqbench", "torch", "numpy", "timm", "transformers", "scikit-learn"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    env["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    return env


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_tasks_agree(cfg: DictConfig, method_factory: Any, data: Any, task: Any) -> None:
    """The dataset, the task scoring it and the method must all mean the same problem."""
    if task.name != data.task:
        raise ValueError(
            f"dataset '{cfg.dataset.name}' is a {data.task} dataset but task={task.name} was "
            f"chosen; drop the task override (each dataset selects its own task)")
    method_task = getattr(getattr(method_factory, "func", method_factory), "task", None)
    if method_task is not None and method_task != data.task:
        raise ValueError(
            f"method '{cfg.method.name}' solves {method_task} but dataset '{cfg.dataset.name}' "
            f"is a {data.task} task; pick a {data.task} method (one of: "
            f"{', '.join(options_where('method', 'task', data.task))}) or another dataset")


# --- the run ----------------------------------------------------------------------------------

def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate one configuration (or score a finished one: ``job=eval``); return the
    results dict (also written to disk).

    The job holds its run folder's lock throughout, mends what a killed job left, reuses a
    finished run only if it has the same configuration, continues an unfinished one from its
    checkpoint, and publishes all files at once. Under a cluster manager that starts one
    process per device, only rank 0 locks and writes; the others train beside it.
    """
    check_config(cfg)
    if cfg.get("job", "train") == "eval":
        return eval_job(cfg)
    run_dir = Path(cfg.run_dir)
    if engine.rank() != 0:
        return _run(cfg, run_dir)
    with RunLock(run_dir):
        for path in recover(run_dir):
            log.info("removed %s, left by an interrupted job", path)
        return _run(cfg, run_dir)


def reuse(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """A finished run's results where skip_existing may return them; None where this job
    runs. Refuses a folder holding another configuration, whatever the flags."""
    kept = reuse_folder(run_dir, OmegaConf.to_container(cfg, resolve=True), cfg.overwrite,
                        cfg.skip_existing)
    if kept is not None:
        log.info("skip: %s holds this configuration's results (skip_existing=true)", run_dir)
    return kept


def publish_run(cfg: DictConfig, run_dir: Path, config: dict, results: dict,
                predictions: dict, draw: Callable[[Path], list[Path]] | None = None,
                logger: Logger | None = None, checkpoint: dict | None = None) -> None:
    """Stage every file of the run (``draw`` puts the figures into the staging folder), swap
    the folder in, then hand the summary, figures and predictions to the logger: the results
    are on disk before any tracker is waited for."""
    stage = new_stage(run_dir)
    try:
        write_stage(stage, config, results, predictions if cfg.save_predictions else {})
        if checkpoint is not None:
            checkpoints.save(stage / checkpoints.FINAL, checkpoint)
        images = [p.relative_to(stage) for p in draw(stage)] if draw is not None else []
        publish(stage, run_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s", run_dir / "results.json")
    if logger is not None:
        log_results(logger, results, run_dir, images)


def _labels(cfg: DictConfig, config: dict, job: str) -> RunLabels:
    """The tracker's labels of this job, which has its own run folder."""
    return run_labels(config, group_choices(cfg), job, str(cfg.run_subdir))


def _run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    job = cfg.get("job", "train")
    fallback = None
    if job == "train":
        trainer = build(cfg.trainer)  # checks its own settings (uqbench.runner.training.Trainer)
        if trainer.batch_size is not None:  # the recipe's batch, recorded where it acts
            cfg.dataset.batch_size = trainer.batch_size
        if not trainer.updates_weights:
            log.warning("trainer.epochs=%s, lr=%s: the untrained model is evaluated "
                        "(results.json: train.updated_weights=false)", trainer.epochs,
                        cfg.trainer.optimizer.get("lr"))
        check_batch(cfg, trainer)
        device, fallback = resolve_device(str(cfg.device))
        engine.check(device, trainer)  # a layout this machine cannot run fails here
    if (existing := reuse(cfg, run_dir)) is not None:
        return existing
    config = OmegaConf.to_container(cfg, resolve=True)
    if job == "params":  # count parameters only: no data, no training (uqbench/runner/params.py)
        from uqbench.runner.params import params_job

        seed_everything(int(cfg.seed))
        results = {**run_header(cfg), "job": job, **params_job(cfg),
                   "table": config.get("table")}
        logger = build(cfg.logger)
        logger.start(run_dir, _labels(cfg, config, job), config)
        try:
            publish_run(cfg, run_dir, config, results, {}, logger=logger)
        finally:
            logger.finish(failed=True)  # a no-op after log_results closed it
        return results
    resume = resume_point(cfg, run_dir, config)
    fabric = engine.fabric(device, trainer)  # after the reuse: a skipped run never loads it
    if fallback:
        log.warning("%s", fallback)
    # Everything a process needs, resolved here: spawned processes have no Hydra context.
    job_cfg = OmegaConf.create(config)
    spawns = fabric.world_size > 1 and not engine.external_processes()
    with engine.StopRequest(forward=True) if spawns else contextlib.nullcontext():
        outcome = fabric.launch(_train, job_cfg, run_dir, trainer, run_header(cfg), resume,
                                fallback)
    if isinstance(outcome, Preempted):
        raise outcome
    return outcome


def check_batch(cfg: DictConfig, trainer: Any) -> None:
    """The step's batch must split evenly enough over the processes and micro-batches."""
    parts = trainer.world_size * trainer.accumulate
    if parts > 1 and int(cfg.dataset.batch_size) < parts:
        raise ValueError(
            f"the batch of {cfg.dataset.batch_size} examples per optimiser step cannot be cut "
            f"into {trainer.world_size} processes × {trainer.accumulate} micro-batches "
            f"(trainer.devices × num_nodes × accumulate); raise trainer.batch_size or lower "
            f"trainer.accumulate")


def resume_point(cfg: DictConfig, run_dir: Path, config: dict) -> Path | None:
    """The checkpoint this run continues from, or None; refuses one of another configuration
    (showing the difference) or an unreadable one (naming it, keeping it)."""
    path = run_dir / checkpoints.RESUME
    if not path.exists():
        return None
    state = checkpoints.load(path)
    diff = differences(state.get("config") or {}, config)
    if diff:
        raise ConfigMismatchError(
            f"{run_dir} holds an unfinished run of another configuration (its checkpoint "
            f"{path}):\n  " + "\n  ".join(diff) + "\ngive this run its own folder "
            "(run_name=<name>), continue that one with its own command, or delete the "
            "checkpoint to start over")
    if not cfg.get("resume", True):
        if not cfg.overwrite:
            raise RunExistsError(
                f"{path} holds this run's progress (epoch {state['epoch']}, step "
                f"{state['step']}) and resume=false was asked: pass overwrite=true to start "
                f"over (the checkpoint is replaced), or drop resume=false to continue")
        return None
    log.info("resuming from %s (epoch %s, step %s)", path, state["epoch"], state["step"])
    return path


def build_parts(cfg: DictConfig, device: torch.device, activation_checkpointing: bool = False
                ) -> tuple[Any, Any, Any, Any]:
    """Method, data, task and backbone of ``cfg`` on ``device``: cheap things first, checked
    against each other before anything expensive is read or built."""
    method_factory = build(cfg.method)
    data = build(cfg.dataset)
    task = build(cfg.task)
    check_tasks_agree(cfg, method_factory, data, task)
    data.check()  # missing or partial data fails here, before any model is built
    backbone = build(cfg.backbone)
    data.setup(backbone)
    backbone.device = device  # methods decompose and copy pretrained weights where they run
    if activation_checkpointing and not backbone.supports_activation_checkpointing:
        backbone.enable_activation_checkpointing(None)  # refuses, naming the backbones that can
    method = method_factory(backbone=backbone, info=data.info).to(device)
    if activation_checkpointing:
        backbone.enable_activation_checkpointing(method)
    return method, data, task, backbone


def first_inputs(loader: Any, n: int) -> Any:
    """The inputs of a loader's first batches, up to ``n`` rows: a tensor (n, …), or, for
    inputs that are not one tensor (a dict of token tensors), the first batch's as they are."""
    parts, rows = [], 0
    for inputs, _ in loader:
        if not isinstance(inputs, torch.Tensor):
            return inputs
        parts.append(inputs)
        rows += len(inputs)
        if rows >= n:
            break
    return torch.cat(parts)[:n]


def method_diagnostics(method: Method, data: Any, device: torch.device,
                       split: str = "test") -> dict[str, float]:
    """The method's own diagnostics (:meth:`Method.diagnostics`) on the first
    DIAGNOSTIC_INPUTS inputs of ``split``, as ``<split>/<name>``; {} without reading any data
    for a method that has none, or for data without that split."""
    if type(method).diagnostics is Method.diagnostics or split not in data.eval_splits:
        return {}
    # a loader's iterator draws its base seed from the CPU generator: keep the run's stream
    with torch.random.fork_rng(devices=[]):
        inputs = first_inputs(data.loader(split), DIAGNOSTIC_INPUTS)
    found = method.diagnostics(to_device(inputs, device))
    return {f"{split}/{name}": value for name, value in found.items()}


def _train(fabric: Any, cfg: DictConfig, run_dir: Path, trainer: Any, header: dict,
           resume: Path | None, fallback: str | None) -> dict[str, Any] | Preempted | None:
    """One process's share of a training job (all of it on one device). Every process builds,
    trains and scores; rank 0 writes the run folder and returns the results."""
    seed_everything(int(cfg.seed))
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
    device = fabric.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rank0 = fabric.global_rank == 0

    method, data, task, backbone = build_parts(cfg, device, trainer.activation_checkpointing)
    objective.check_split(cfg.get("objective"), data, str(cfg.dataset.name))
    params = method.param_counts()  # whole tensors: before FSDP shards them
    model = fabric.setup_module(method)
    model.mark_forward_method("loss")

    config = OmegaConf.to_container(cfg, resolve=True)
    logger = build(cfg.logger) if rank0 else NullLogger()
    logger.start(run_dir, _labels(cfg, config, "train"), config, resume=resume is not None)
    resume_state = checkpoints.load(resume) if resume is not None else None

    def save(state: dict[str, Any]) -> None:  # every process gathers (FSDP), rank 0 writes
        if rank0:
            checkpoints.save(run_dir / checkpoints.RESUME, {**state, "config": config})

    try:
        with engine.StopRequest() as stop:
            try:
                train = trainer.fit(method, data, task, logger, fabric=fabric, model=model,
                                    resume=resume_state, save=save,
                                    stop=stop)
            except Preempted as preempted:
                log.warning("%s", preempted)
                logger.finish(failed=True)  # cut short; the resumed job continues its record
                return preempted if rank0 else None
        del resume_state
        start = time.perf_counter()
        metrics, predictions, calibration = evaluate(model, data, task, device)
        eval_s = time.perf_counter() - start
        cost = forward_cost(model, data, device)
        keep = trainer.keep_checkpoint != "none" and trainer.updates_weights
        trained = engine.trainable_state(fabric, model, method) if keep else None
        if not rank0:
            return None
        start = time.perf_counter()
        metrics.update(method_diagnostics(method, data, device))
        diagnostics_s = time.perf_counter() - start
        results = {
            **header,
            "settings": {
                "dataset": group_settings(cfg.dataset) | data.settings(),
                "method": group_settings(cfg.method) | method.settings(),
                "backbone": group_settings(cfg.backbone) | backbone.details(),
                "task": group_settings(cfg.task),
                "trainer": {k: v for k, v in group_settings(cfg.trainer).items()
                            if k != "progress"},
            },
            "params": params,
            "metrics": metrics,
            "calibration": calibration,
            "time": {"train_s": train["train_s"], "eval_s": eval_s,
                     "diagnostics_s": diagnostics_s},
            "cost": cost,
            "environment": environment(),
            "train": {"epochs": train["epochs"], "selected_epoch": train["selected_epoch"],
                      "updated_weights": trainer.updates_weights,
                      "device": str(device), "device_note": fallback,
                      "precision": trainer.precision, "strategy": type(fabric.strategy).__name__,
                      "world_size": fabric.world_size, "accumulate": trainer.accumulate,
                      "steps_run": train["steps_run"], "resumed_at": train.get("resumed_at")},
            "table": config.get("table"),
        }
        title = f"{cfg.run_subdir}  test NLL {metrics.get('test/nll', float('nan')):.3f}"

        def draw(folder: Path) -> list[Path]:
            """figure.png where the dataset can be drawn, the task's diagnostics in figures/."""
            drawn = [task.plot(folder / "figure.png", method, data, device, title=title)
                     ] if hasattr(task, "plot") else []
            drawn += task.figures(predictions, folder / "figures", data.ood_splits)
            return [p for p in drawn if p is not None]
        final = None
        if keep:
            final = {"trainable": trained, "config": config, "method": cfg.method.name}
            if trainer.keep_checkpoint == "full" and (run_dir / checkpoints.RESUME).exists():
                final["resume"] = checkpoints.load(run_dir / checkpoints.RESUME)
        publish_run(cfg, run_dir, config, results, predictions, draw if cfg.plot else None,
                    logger, final)
        shutil.rmtree(run_dir / Path(checkpoints.RESUME).parent, ignore_errors=True)
    finally:
        logger.finish(failed=True)  # a no-op after a published run closed it: this one failed
    return results


# --- scoring a finished run -------------------------------------------------------------------

def eval_job(cfg: DictConfig) -> dict[str, Any]:
    """``job=eval``: score a finished run's checkpoint on a dataset's splits, without training.

    The run is ``eval_run`` (or the folder this command names). Everything but the data comes
    from the run's stored config; the dataset (and its task) come from the command when it
    names one (``dataset=cifar100_c``), else from the run. The results land in
    ``<run>/eval/<dataset>/`` (results.json, predictions/), published all at once; the run's
    own files are never touched. A Deep Ensemble combined from member jobs is scored from its
    members' checkpoints, their predictions joined in member order.
    """
    run_dir = Path(str(cfg.eval_run)).expanduser() if cfg.get("eval_run") else Path(cfg.run_dir)
    stored, scored = finished(run_dir, ": job=eval needs a finished run (eval_run=<run folder> "
                                       "names the run to score)")
    # the folders whose checkpoints make up the model, with their stored configs
    members = [Path(str(stored["paths"]["runs_dir"])) / m
               for m in scored.get("combined_from") or []]
    sources = {m: finished(m)[0] for m in members} if members else {run_dir: stored}
    for source in sources:
        if not (source / checkpoints.FINAL).is_file():
            raise checkpoints.CheckpointError(
                f"{source} has no {checkpoints.FINAL}: it was trained without keeping one "
                f"(trainer.keep_checkpoint=none, or before runs kept checkpoints). Train it "
                f"again (overwrite=true) to score it on other data")
    chosen, changed = _dataset_overrides(cfg)
    configs = {s: _eval_config(cfg, c, chosen, changed) for s, c in sources.items()}
    run_cfg = _eval_config(cfg, stored, chosen, changed)
    device, fallback = resolve_device(str(cfg.device))
    out = run_dir / "eval" / ",".join([str(run_cfg.dataset.name), *(
        f"{k}={OmegaConf.select(cfg, k)}" for k in changed)])
    with RunLock(run_dir):
        if (out / "results.json").is_file() and not cfg.overwrite:
            if cfg.skip_existing:
                return json.loads((out / "results.json").read_text())
            raise RunExistsError(f"{out}/results.json already exists: overwrite=true replaces "
                                 f"it, skip_existing=true keeps it")
        start = time.perf_counter()
        parts = []
        for source, source_cfg in configs.items():
            state = checkpoints.load(source / checkpoints.FINAL)
            seed_everything(int(source_cfg.seed))
            if source_cfg.get("torch_threads"):
                torch.set_num_threads(int(source_cfg.torch_threads))
            method, data, task, _ = build_parts(source_cfg, device)
            method.load_trainable_state({k: v.to(device) for k, v in state["trainable"].items()})
            parts.append(predict_splits(method, data, task, device))
        # a model scored from one checkpoint can check itself; members combined cannot
        diagnostics = method_diagnostics(method, data, device) if len(parts) == 1 else {}
        predictions = parts[0] if len(parts) == 1 else {
            split: {k: (np.concatenate([p[split][k] for p in parts]) if k == "member_probs"
                        else v) for k, v in parts[0][split].items()} for split in parts[0]}
        metrics, calibration = score(predictions, task, data.eval_splits, data.ood_splits)
        metrics.update(diagnostics)
        results = {"job": "eval", "of_run": str(run_dir), "experiment": run_cfg.experiment_name,
                   "run": run_cfg.run_subdir, "dataset": str(run_cfg.dataset.name),
                   "method": str(run_cfg.method.name), "backbone": str(run_cfg.backbone.name),
                   "seed": int(run_cfg.seed), "scored_from": [str(s) for s in sources],
                   "settings": {"dataset": group_settings(run_cfg.dataset) | data.settings(),
                                "task": group_settings(run_cfg.task)},
                   "metrics": metrics, "calibration": calibration,
                   "time": {"eval_s": time.perf_counter() - start},
                   "environment": environment(),
                   "device": str(device), "device_note": fallback}
        run_config = OmegaConf.to_container(run_cfg, resolve=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = new_stage(out)
        try:
            write_stage(stage, run_config, results,
                        predictions if cfg.save_predictions else {})
            publish(stage, out)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s", out / "results.json")
    tracked = cfg.copy()  # the tracker's folder is that of the scored run's experiment
    tracked.experiment_name = run_cfg.experiment_name
    logger = build(tracked.logger)
    choices = {g: str(results[g]) for g in ("method", "backbone", "dataset")}
    labels = run_labels(run_config, choices, "eval", f"{run_cfg.run_subdir}/eval/{out.name}",
                        setting=str(run_cfg.run_subdir))
    logger.start(out, labels, run_config)
    log_results(logger, results, out, [])
    return results


def _eval_config(cfg: DictConfig, stored: dict, chosen: bool, changed: list[str]) -> DictConfig:
    """A stored run config with the command's dataset (or dataset keys), device and output
    choices put in."""
    run_cfg = OmegaConf.create(stored)
    if chosen:  # another dataset: its config and task from the command
        run_cfg.dataset, run_cfg.task = cfg.dataset, cfg.task
    for key in changed:  # dataset.<key>=<value>: on top of the run's dataset
        OmegaConf.update(run_cfg, key, OmegaConf.select(cfg, key), force_add=True)
    for key in ("device", "save_predictions"):
        run_cfg[key] = cfg.get(key)
    if cfg.get("torch_threads") is not None:  # else the run's own: the same float reductions
        run_cfg.torch_threads = cfg.torch_threads
    return run_cfg


def _dataset_overrides(cfg: DictConfig) -> tuple[bool, list[str]]:
    """Whether the command chose a dataset (``dataset=…``), and the ``dataset.<key>`` values
    it set. A config composed without Hydra's command line counts as choosing its dataset."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True, []
    keys = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]
    return "dataset" in keys, sorted(k for k in keys if k.startswith("dataset."))


def _drop_log_only_folder(cfg: DictConfig) -> None:
    """A job refused before it wrote anything leaves no folder behind: Hydra made the run
    folder for its log, so the folder (and the parents it made, up to the runs folder) goes
    when the log is all it holds. A folder with anything else in it is never touched."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    folder = Path(hc.runtime.output_dir)
    if not folder.is_dir() or {p.name for p in folder.iterdir()} - {f"{hc.job.name}.log"}:
        return
    (folder / f"{hc.job.name}.log").unlink(missing_ok=True)
    root = Path(str(cfg.paths.runs_dir)).resolve()
    for path in [folder.resolve(), *folder.resolve().parents]:
        if path == root or root not in path.parents:
            break
        try:
            path.rmdir()  # only while empty: a parent other jobs use stays
        except OSError:
            break


@hydra.main(config_path="pkg://uqbench.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    """One job; returns its validation objective (``objective``) for a sweeper that reads it."""
    try:
        try:
            results = run(cfg)
        except NonFiniteLossError as err:
            direction = objective.sweeper_direction()
            if direction is None:
                raise
            # a diverged trial is an outcome of tuning, not the end of the study: it reports
            # the worst value (the sweeper cannot take NaN), and the study goes on
            log.error("%s: %s", type(err).__name__, err)
            return float("inf") if direction == "minimize" else float("-inf")
        value = (objective.value(cfg.get("objective"), results)
                 if cfg.get("job", "train") == "train" else None)
    except Preempted as stopped:  # SIGTERM / USR2: the checkpoint is written
        log.warning("%s", stopped)
        print(str(stopped), file=sys.stderr)
        sys.exit(engine.hand_on(stopped.signum))
    except USER_ERRORS as err:
        if os.environ.get("UQBENCH_TRACEBACK"):
            raise
        log.error("%s: %s", type(err).__name__, err)
        print(f"error: {err}\n(set UQBENCH_TRACEBACK=1 for the full traceback)",
              file=sys.stderr)
        _drop_log_only_folder(cfg)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: one line; the folder is left as a kill leaves it
        if os.environ.get("UQBENCH_TRACEBACK"):
            raise
        log.error("interrupted: no results were written for %s", cfg.run_dir)
        print(f"interrupted: no results were written for {cfg.run_dir}", file=sys.stderr)
        sys.exit(130)
    summary = {k: round(v, 4) for k, v in results["metrics"].items()
               if k.split("/")[0] in ("test", "ood") and k.count("/") == 1}
    print(f"{results['run']}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return value


def main() -> None:
    """The ``uqbench`` command. Hydra's own errors (an unknown option, a config that does not
    resolve) print in the same one-line format as uqbench's: Hydra is asked to raise them."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        _hydra_main()
    except Exception as err:
        if os.environ.get("UQBENCH_TRACEBACK"):
            raise
        message = str(err).strip() or type(err).__name__
        log.error("%s: %s", type(err).__name__, message)
        print(f"error: {message}\n(set UQBENCH_TRACEBACK=1 for the full traceback)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    # `python -m uqbench.runner.cli`: run the importable module's main, so that launchers and
    # spawned processes pickle the job's functions as uqbench.runner.cli's, not as __main__'s
    import importlib

    importlib.import_module("uqbench.runner.cli").main()
