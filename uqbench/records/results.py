"""Writing a run folder: its files, through the atomic writer (a run's header comes from its
spec, :meth:`uqbench.runner.spec.RunSpec.header`).

Used by the runner (``job=train``), the parameter job (``job=params``) and scoring
(``job=eval``) alike, so all write the same files the same way. Layout of a run folder::

    <run_dir>/config.yaml             resolved config
    <run_dir>/results.json            header, settings, params, metrics, time (written last)
    <run_dir>/predictions/<split>.npz per-example predictions
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf


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
