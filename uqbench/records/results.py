"""Writing a run folder: the header every results.json starts with, and the atomic writer.

Used by the runner (``job=train``) and the parameter job (``job=params``) alike, so both write
the same keys the same way. Layout of a run folder::

    <run_dir>/config.yaml             resolved config
    <run_dir>/results.json            header, settings, params, metrics, time (written last)
    <run_dir>/predictions/<split>.npz per-example predictions
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, cast

import numpy as np
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


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
    fields = cast(dict[str, Any], OmegaConf.to_container(node, resolve=True))  # a mapping
    return {k: v for k, v in fields.items() if not k.startswith("_")}


def run_header(cfg: DictConfig) -> dict[str, Any]:
    """The keys every results.json starts with: experiment, run folder, choices, variant (the
    setup's label within its experiment, or None), overrides."""
    choices = group_choices(cfg)
    return {"experiment": cfg.experiment_name, "run": cfg.run_subdir,
            "dataset": choices["dataset"], "method": choices["method"],
            "backbone": choices["backbone"], "seed": int(cfg.seed),
            "variant": cfg.get("variant"), "overrides": cli_overrides()}


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file and one rename (never half a file)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=float))
    os.replace(tmp, path)


def write_stage(stage: Path, config: dict[str, Any], results: dict[str, Any],
                predictions: dict[str, dict[str, np.ndarray]]) -> None:
    """Write a run's files into its staging folder (``uqbench.records.runfolder.publish`` swaps the
    whole folder in at once, so the order of the files does not matter)."""
    (stage / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    for split, arrays in predictions.items():
        path = stage / "predictions" / f"{split}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        # numpy's stub matches **arrays against allow_pickle: bool
        np.savez_compressed(path, **arrays)  # type: ignore[arg-type]
    write_json(stage / "results.json", results)
