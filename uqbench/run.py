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

import json
import logging
import os
import random
import re
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

from uqbench.configs import USER_ERRORS, build, check_types, check_value, options_where
from uqbench.evaluation import evaluate, forward_cost
from uqbench.results import group_settings, run_header, write_stage
from uqbench.runfolder import (
    ConfigMismatchError,
    RunLock,
    differences,
    new_stage,
    publish,
    recover,
    stored_config,
)

log = logging.getLogger("uqbench")


class RunExistsError(FileExistsError):
    pass


# --- helpers ----------------------------------------------------------------------------------

DEVICES = "auto, cpu, cuda, cuda:<index>, mps"


def resolve_device(name: str) -> torch.device:
    """The torch device for ``device=``; auto picks CUDA, then MPS, then the CPU."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise ValueError(f"device '{name}' is not one of uqbench's devices: {DEVICES}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' was asked for but CUDA is not available; "
                         f"use device=cpu or device=auto")
    return torch.device(name)


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
    """Train and evaluate one configuration; return the results dict (also written to disk).

    The job holds its run folder's lock throughout, mends what a killed job left, reuses a
    finished run only if it has the same configuration, and publishes all files at once.
    """
    check_config(cfg)
    run_dir = Path(cfg.run_dir)
    with RunLock(run_dir):
        for path in recover(run_dir):
            log.info("removed %s, left by an interrupted job", path)
        return _run(cfg, run_dir)


def reuse(cfg: DictConfig, run_dir: Path) -> dict[str, Any] | None:
    """A finished run's results where skip_existing may return them; None where this job
    runs. Refuses a folder holding another configuration, whatever the flags."""
    results_path = run_dir / "results.json"
    if not results_path.exists():
        return None
    stored = stored_config(run_dir)
    diff = (differences(stored, OmegaConf.to_container(cfg, resolve=True)) if stored
            else ["config.yaml is missing or unreadable"])
    if diff:
        raise ConfigMismatchError(
            f"{run_dir} holds the results of another configuration:\n  " + "\n  ".join(diff)
            + "\nskip_existing and overwrite act only on the same configuration: give this "
              "run its own folder (run_name=<name>) or delete that one")
    if cfg.skip_existing and not cfg.overwrite:
        log.info("skip: %s holds this configuration's results (skip_existing=true)", run_dir)
        return json.loads(results_path.read_text())
    if not cfg.overwrite:
        raise RunExistsError(
            f"{results_path} already exists for this configuration. Pass overwrite=true to "
            f"replace it, skip_existing=true to keep it and move on, or run_name=<new name>.")
    return None


def publish_run(cfg: DictConfig, run_dir: Path, config: dict, results: dict,
                predictions: dict, figure: Callable[[Path], Path | None] | None = None,
                logger: Any = None) -> None:
    """Stage every file of the run, hand the summary to the logger, swap the folder in."""
    stage = new_stage(run_dir)
    try:
        write_stage(stage, config, results, predictions if cfg.save_predictions else {})
        image = figure(stage / "figure.png") if figure is not None else None
        if logger is not None:
            logger.log_summary(results["metrics"])
            if image is not None:
                logger.log_image("figure", image)
                # the tracker copied the image; the published one lives in the run folder
            logger.finish()
        publish(stage, run_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log.info("wrote %s", run_dir / "results.json")


def _run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    job = cfg.get("job", "train")
    if job not in ("train", "params"):
        raise ValueError(f"job '{job}' is not one of: train, params")
    if job == "train":
        trainer = build(cfg.trainer)  # checks its own settings (uqbench.training.Trainer)
        if trainer.batch_size is not None:  # the recipe's batch, recorded where it acts
            cfg.dataset.batch_size = trainer.batch_size
        if not trainer.updates_weights:
            log.warning("trainer.epochs=%s, lr=%s: the untrained model is evaluated "
                        "(results.json: train.updated_weights=false)", trainer.epochs,
                        cfg.trainer.optimizer.get("lr"))
    if (existing := reuse(cfg, run_dir)) is not None:
        return existing
    seed_everything(int(cfg.seed))
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
    config = OmegaConf.to_container(cfg, resolve=True)
    if job == "params":  # count parameters only: no data, no training (uqbench/overhead.py)
        from uqbench.overhead import params_job

        results = {**run_header(cfg), "job": job, **params_job(cfg),
                   "table": config.get("table")}
        publish_run(cfg, run_dir, config, results, {})
        return results
    device = resolve_device(str(cfg.device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # Build cheap things first and check they fit together before anything expensive.
    method_factory = build(cfg.method)
    data = build(cfg.dataset)
    task = build(cfg.task)
    check_tasks_agree(cfg, method_factory, data, task)
    data.check()  # missing or partial data fails here, before any model is built
    backbone = build(cfg.backbone)
    data.setup(backbone)
    method = method_factory(backbone=backbone, info=data.info).to(device)

    logger = build(cfg.logger)
    logger.start(run_dir, name=cfg.run_subdir, config=config)
    try:
        train = trainer.fit(method, data, task, device, logger)
        start = time.perf_counter()
        metrics, predictions, calibration = evaluate(method, data, task, device)
        eval_s = time.perf_counter() - start
        results = {
            **run_header(cfg),
            "settings": {
                "dataset": group_settings(cfg.dataset) | data.settings(),
                "method": group_settings(cfg.method) | method.settings(),
                "backbone": group_settings(cfg.backbone) | backbone.details(),
                "task": group_settings(cfg.task),
                "trainer": {k: v for k, v in group_settings(cfg.trainer).items()
                            if k != "progress"},
            },
            "params": method.param_counts(),
            "metrics": metrics,
            "calibration": calibration,
            "time": {"train_s": train["train_s"], "eval_s": eval_s},
            "cost": forward_cost(method, data, device),
            "environment": environment(),
            "train": {"epochs": train["epochs"], "selected_epoch": train["selected_epoch"],
                      "updated_weights": trainer.updates_weights,
                      "device": str(device)},
            "table": config.get("table"),
        }
        title = f"{cfg.run_subdir}  test NLL {metrics.get('test/nll', float('nan')):.3f}"
        figure = ((lambda path: task.plot(path, method, data, device, title=title))
                  if cfg.plot and hasattr(task, "plot") else None)
        publish_run(cfg, run_dir, config, results, predictions, figure, logger)
    finally:
        logger.finish()  # a second finish is a no-op; a failed run still closes its tracker
    return results


@hydra.main(config_path="pkg://uqbench.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        results = run(cfg)
    except USER_ERRORS as err:
        if os.environ.get("UQBENCH_TRACEBACK"):
            raise
        log.error("%s: %s", type(err).__name__, err)
        print(f"error: {err}\n(set UQBENCH_TRACEBACK=1 for the full traceback)",
              file=sys.stderr)
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
    main()
