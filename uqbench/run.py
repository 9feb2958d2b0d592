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
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from uqbench.configs import USER_ERRORS, build, check_types, check_value, options_where
from uqbench.contracts import to_device
from uqbench.results import group_settings, run_header, write_run

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


def split_group_means(metrics: dict[str, float], splits: list[str]) -> dict[str, float]:
    """Averages over the splits that share a prefix, e.g. for test_c/<c>/<s>/<metric>:
    test_c/mean/<metric> (all corruptions and severities), test_c/<c>/mean/<metric> (one
    corruption over its severities) and test_c/mean/<s>/<metric> (one severity over the
    corruptions); calibrated metrics (…/ts/<metric>) alike. Only splits whose name has a '/'
    form groups: test/ts/<metric> is a calibrated metric of `test`, not a group."""
    groups: dict[str, list[float]] = {}
    for split in (s for s in splits if "/" in s):
        parts = split.split("/")
        names = [f"{parts[0]}/mean"]
        if len(parts) == 3:  # <group>/<kind>/<level>
            names += [f"{parts[0]}/{parts[1]}/mean", f"{parts[0]}/mean/{parts[2]}"]
        for key, value in metrics.items():
            if key.startswith(split + "/"):
                for name in names:
                    groups.setdefault(f"{name}/{key[len(split) + 1:]}", []).append(value)
    return {k: float(np.mean(v)) for k, v in groups.items()}


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


def evaluate(method: torch.nn.Module, data: Any, task: Any, device: torch.device
             ) -> tuple[dict[str, float], dict[str, dict[str, np.ndarray]], dict | None]:
    """Metrics, predictions and post-hoc calibration of every split the dataset declares.

    eval_splits get the task's standard metrics; ood_splits get its OOD metrics against the
    test predictions; the validation split (where the dataset has one) is scored too and fits
    the task's post-hoc calibration (classification: temperature scaling), whose metrics are
    reported beside the raw ones (``<split>/ts/<metric>``). Splits sharing a prefix are also
    averaged (test_c/mean/<metric>). Predictions run in a fixed order (eval, OOD, val) so that
    stochastic methods draw the same random numbers as before the validation pass existed.
    """
    predictions: dict[str, dict[str, np.ndarray]] = {}
    val = ["val"] if data.has_val else []
    for split in [*data.eval_splits, *data.ood_splits, *val]:
        predictions[split] = task.predict(method, data.loader(split), device)
    calibration = task.calibrate(predictions["val"]) if val else None
    metrics: dict[str, float] = {}
    for split in [*data.eval_splits, *val]:
        metrics.update(task.metrics(split, predictions[split], calibration))
    for split in data.ood_splits:
        metrics.update(task.ood_metrics(split, predictions.get("test", {}), predictions[split],
                                        calibration))
    metrics.update(split_group_means(metrics, list(data.eval_splits)))
    return metrics, predictions, calibration


def forward_cost(method: torch.nn.Module, data: Any, device: torch.device) -> dict[str, Any]:
    """Forward FLOPs per example (evaluation mode, one test batch; torch's FLOP counter counts
    matrix products and convolutions) and the peak memory of the run so far."""
    from torch.utils.flop_counter import FlopCounterMode

    cost: dict[str, Any] = {"forward_flops_per_example": None}
    inputs, y = next(iter(data.loader("test")))
    method.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            method(to_device(inputs, device))
        cost["forward_flops_per_example"] = counter.get_total_flops() / len(y)
    except Exception as err:  # a custom kernel the counter cannot trace: report, never fail
        log.warning("FLOP count unavailable: %s", err)
    if device.type == "cuda":
        cost |= {"peak_memory_bytes": torch.cuda.max_memory_allocated(device),
                 "peak_memory": "torch.cuda.max_memory_allocated"}
    else:
        import resource

        cost |= {"peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "peak_memory": "process peak resident set size"}
    return cost


# --- the run ----------------------------------------------------------------------------------

def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate one configuration; return the results dict (also written to disk)."""
    check_config(cfg)
    run_dir = Path(cfg.run_dir)
    results_path = run_dir / "results.json"
    if results_path.exists():
        if cfg.skip_existing and not cfg.overwrite:
            log.info("skip: %s already exists (skip_existing=true)", results_path)
            return json.loads(results_path.read_text())
        if not cfg.overwrite:
            raise RunExistsError(
                f"{results_path} already exists. Pass overwrite=true to replace it, "
                f"skip_existing=true to keep it and move on, or run_name=<new name>.")
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
    seed_everything(int(cfg.seed))
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
    if job == "params":  # count parameters only: no data, no training (uqbench/overhead.py)
        from uqbench.overhead import params_job

        config = OmegaConf.to_container(cfg, resolve=True)
        results = {**run_header(cfg), "job": job, **params_job(cfg),
                   "table": config.get("table")}
        write_run(run_dir, config, results, {})
        log.info("wrote %s", results_path)
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
    config = OmegaConf.to_container(cfg, resolve=True)

    logger = build(cfg.logger)
    logger.start(run_dir, name=cfg.run_subdir, config=config)
    try:
        train = trainer.fit(method, data, task, device, logger)
        start = time.perf_counter()
        metrics, predictions, calibration = evaluate(method, data, task, device)
        eval_s = time.perf_counter() - start
        cost = forward_cost(method, data, device)
        results = {
            **run_header(cfg),
            "settings": {
                "dataset": group_settings(cfg.dataset) | data.settings(),
                "method": group_settings(cfg.method) | method.settings(),
                "backbone": group_settings(cfg.backbone),
                "task": group_settings(cfg.task),
                "trainer": {k: v for k, v in group_settings(cfg.trainer).items()
                            if k != "progress"},
            },
            "params": method.param_counts(),
            "metrics": metrics,
            "calibration": calibration,
            "time": {"train_s": train["train_s"], "eval_s": eval_s},
            "cost": cost,
            "environment": environment(),
            "train": {"epochs": train["epochs"], "selected_epoch": train["selected_epoch"],
                      "updated_weights": trainer.updates_weights,
                      "device": str(device)},
            "table": config.get("table"),
        }
        write_run(run_dir, config, results, predictions if cfg.save_predictions else {})
        figure = None
        if cfg.plot and hasattr(task, "plot"):
            figure = task.plot(run_dir / "figure.png", method, data, device,
                               title=f"{cfg.run_subdir}  test NLL "
                                     f"{metrics.get('test/nll', float('nan')):.3f}")
        logger.log_summary(metrics)
        if figure is not None:
            logger.log_image("figure", figure)
    finally:
        logger.finish()
    log.info("wrote %s", results_path)
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
    _hydra_main()


if __name__ == "__main__":
    main()
