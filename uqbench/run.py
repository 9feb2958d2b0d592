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
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("uqbench")


def _run_subdir(run_name, experiment, dataset, method, backbone, seed) -> str:
    if run_name not in (None, "", "None", "null"):
        return str(run_name)
    return f"{experiment}/{dataset}/{method}/{backbone}/seed{seed}"


OmegaConf.register_new_resolver("uq.run_subdir", _run_subdir, replace=True)


class RunExistsError(FileExistsError):
    pass


# --- helpers ----------------------------------------------------------------------------------

def resolve_device(name: str) -> torch.device:
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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def group_choices(cfg: DictConfig) -> dict[str, str]:
    """The option chosen in each config group (Hydra's runtime choices when available)."""
    choices: dict[str, str] = {}
    if HydraConfig.initialized():
        choices = {k: v for k, v in HydraConfig.get().runtime.choices.items()
                   if v is not None and not k.startswith("hydra")}
    for group in ("backbone", "method", "dataset"):
        choices.setdefault(group, str(cfg[group].get("name", group)))
    return choices


def cli_overrides() -> list[str]:
    """The command-line overrides of this job (empty outside the CLI)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def group_settings(node: DictConfig) -> dict[str, Any]:
    """A config group's resolved fields, without Hydra's instantiation keys."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items()
            if not k.startswith("_")}


def split_group_means(metrics: dict[str, float]) -> dict[str, float]:
    """Average splits sharing a prefix: test_c/<c>/<s>/<m> → test_c/mean/<m>."""
    groups: dict[str, list[float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) >= 3:
            groups.setdefault(f"{parts[0]}/mean/{parts[-1]}", []).append(value)
    return {k: float(np.mean(v)) for k, v in groups.items()}


def run_header(cfg: DictConfig) -> dict[str, Any]:
    """The keys every results.json starts with: experiment, run folder, choices, overrides."""
    choices = group_choices(cfg)
    return {"experiment": cfg.experiment_name, "run": cfg.run_subdir,
            "dataset": choices["dataset"], "method": choices["method"],
            "backbone": choices["backbone"], "seed": int(cfg.seed),
            "overrides": cli_overrides()}


def evaluate(method: torch.nn.Module, data: Any, task: Any, device: torch.device
             ) -> tuple[dict[str, float], dict[str, dict[str, np.ndarray]]]:
    """Metrics and predictions of every split the dataset declares.

    eval_splits get the task's standard metrics; ood_splits get its OOD metrics against the
    test predictions; splits sharing a prefix are also averaged (test_c/mean/<metric>).
    """
    metrics: dict[str, float] = {}
    predictions: dict[str, dict[str, np.ndarray]] = {}
    for split in data.eval_splits:
        predictions[split] = task.predict(method, data.loader(split), device)
        metrics.update(task.metrics(split, predictions[split]))
    for split in data.ood_splits:
        predictions[split] = task.predict(method, data.loader(split), device)
        metrics.update(task.ood_metrics(split, predictions.get("test", {}), predictions[split]))
    metrics.update(split_group_means(metrics))
    return metrics, predictions


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=float))
    os.replace(tmp, path)


# --- the run ----------------------------------------------------------------------------------

def run(cfg: DictConfig) -> dict[str, Any]:
    """Train and evaluate one configuration; return the results dict (also written to disk)."""
    from uqbench.tasks import get_task
    from uqbench.training import check_trainer, fit

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
        check_trainer(cfg.trainer)
    seed_everything(int(cfg.seed))
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg.torch_threads))
    if job == "params":  # count parameters only: no data, no training (uqbench/overhead.py)
        from uqbench.overhead import params_job

        config = OmegaConf.to_container(cfg, resolve=True)
        results = {**run_header(cfg), "job": job, **params_job(cfg),
                   "table": config.get("table")}
        _write_run(run_dir, config, results, {})
        log.info("wrote %s", results_path)
        return results
    device = resolve_device(str(cfg.device))

    # Build cheap things first and check they fit together before anything expensive.
    method_factory = instantiate(cfg.method)
    data = instantiate(cfg.dataset)
    method_task = getattr(getattr(method_factory, "func", method_factory), "task", None)
    if method_task is not None and method_task != data.task:
        raise ValueError(
            f"method '{cfg.method.name}' solves {method_task} but dataset '{cfg.dataset.name}' "
            f"is a {data.task} task; pick a {data.task} method or dataset")
    data.check()  # missing or partial data fails here, before any model is built
    backbone = instantiate(cfg.backbone)
    data.setup(backbone)
    task = get_task(data.task, **(cfg.get("metrics") or {}) if data.task == "classification"
                    else {})
    method = method_factory(backbone=backbone, info=data.info).to(device)
    config = OmegaConf.to_container(cfg, resolve=True)

    logger = instantiate(cfg.logger)
    logger.start(run_dir, name=cfg.run_subdir, config=config)
    try:
        train = fit(method, data, task, cfg.trainer, device, logger)
        start = time.perf_counter()
        metrics, predictions = evaluate(method, data, task, device)
        eval_s = time.perf_counter() - start
        results = {
            **run_header(cfg),
            "settings": {
                "dataset": group_settings(cfg.dataset) | data.settings(),
                "method": group_settings(cfg.method) | method.settings(),
                "backbone": group_settings(cfg.backbone),
                "trainer": {k: v for k, v in group_settings(cfg.trainer).items()
                            if k != "progress"},
            },
            "params": method.param_counts(),
            "metrics": metrics,
            "time": {"train_s": train["train_s"], "eval_s": eval_s},
            "train": {"epochs": train["epochs"], "selected_epoch": train["selected_epoch"],
                      "device": str(device)},
            "table": config.get("table"),
        }
        _write_run(run_dir, config, results, predictions if cfg.save_predictions else {})
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


def _write_run(run_dir: Path, config: dict, results: dict,
               predictions: dict[str, dict[str, np.ndarray]]) -> None:
    """Write everything into a staging folder, then move it into place; results.json last."""
    run_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".staging-", dir=run_dir))
    try:
        (stage / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
        for split, arrays in predictions.items():
            path = stage / "predictions" / f"{split}.npz"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez_compressed(path, **arrays)
        if predictions:
            shutil.rmtree(run_dir / "predictions", ignore_errors=True)
            os.replace(stage / "predictions", run_dir / "predictions")
        os.replace(stage / "config.yaml", run_dir / "config.yaml")
        _write_json(run_dir / "results.json", results)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@hydra.main(config_path="pkg://uqbench.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        results = run(cfg)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, RuntimeError) as err:
        if os.environ.get("UQBENCH_TRACEBACK"):
            raise
        log.error("%s: %s", type(err).__name__, err)
        print(f"error: {err}\n(set UQBENCH_TRACEBACK=1 for the full traceback)",
              file=sys.stderr)
        sys.exit(1)
    summary = {k: round(v, 4) for k, v in results["metrics"].items()
               if k.split("/")[0] in ("test", "ood") and k.count("/") == 1}
    print(f"{results['run']}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
