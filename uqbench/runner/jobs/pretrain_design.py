"""Choose the digits ViTs' design on the validation split (``uqbench-pretrain --design``).

The candidates are :data:`~uqbench.backbones.digits_vit.DESIGN_GRID` (the pooled feature: mean
patch token or [CLS]; the pretraining augmentation: on or off). Each is pretrained at one level
(``other``: the level that never sees a downstream digit) with the given seeds, and scored by
the linear probe on the downstream validation split; the highest mean wins, ties go to the first
candidate in the grid's order. The result, with every candidate's score, is written to
:data:`~uqbench.backbones.digits_vit.DESIGN_FILE`, which the backbone module reads.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from uqbench.backbones.digits_vit import DESIGN_FILE, DESIGN_GRID, designed


def choose_design(build: Callable[..., Any], cache_dir: str | Path, level: str = "other",
                  seeds: tuple[int, ...] = (0,), jobs: int = 1, threads: int | None = 1
                  ) -> dict[str, Any]:
    """Every candidate of :data:`DESIGN_GRID` on ``level``: the mean validation probe over
    ``seeds``, each built by ``build`` (:func:`uqbench.runner.jobs.pretrain.pretrain`); the highest
    wins (ties: the first in the grid's order). Returns the recipe (provenance and choices)
    that ``--design`` writes."""
    keys = list(DESIGN_GRID)
    candidates = [dict(zip(keys, values, strict=True))
                  for values in itertools.product(*(DESIGN_GRID[k] for k in keys))]
    jobs_list = [(build, c, level, seed, str(cache_dir), threads)
                 for c in candidates for seed in seeds]
    if jobs == 1:
        probes = [_probe_design(job) for job in jobs_list]
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            probes = pool.map(_probe_design, jobs_list, chunksize=1)
    scored = []
    for i, cand in enumerate(candidates):
        values = probes[i * len(seeds):(i + 1) * len(seeds)]
        scored.append({**cand, "probe_mean": round(float(np.mean(values)), 6),
                       "probe_std": round(float(np.std(values, ddof=1)), 6)
                       if len(values) > 1 else None,
                       "probes": [round(v, 6) for v in values]})
    best = max(scored, key=lambda c: c["probe_mean"])  # max keeps the first of equal means
    ties = [{k: c[k] for k in keys} for c in scored
            if c is not best and c["probe_mean"] == best["probe_mean"]]
    return {"provenance": {
        "command": "uqbench-pretrain --design --seeds " + " ".join(map(str, seeds)),
        "date": time.strftime("%Y-%m-%d"),
        "level": level, "seeds": list(seeds),
        "metric": "linear probe accuracy on the downstream validation split (higher wins)",
        "grid": DESIGN_GRID, "tie_rule": "the first candidate in the grid's order",
        "candidates": scored, "ties": ties},
        "choices": {k: best[k] for k in keys}}


def _probe_design(job: tuple[Callable[..., Any], dict[str, Any], str, int, str, int | None]
                  ) -> float:
    build, choices, level, seed, cache_dir, threads = job
    with designed(choices):
        result = build(level, cache_dir, seed=seed, threads=threads,
                          log=lambda line: print(f"[{choices} s{seed}] {line.strip()}",
                                                 flush=True))
    return float(result.meta["probe"]["acc"])


def write_design(recipe: dict[str, Any], path: Path = DESIGN_FILE) -> None:
    import yaml

    header = ("# The digits ViTs' design, chosen on the validation split by `uqbench-pretrain "
              "--design`\n# (which wrote this file; uqbench/backbones/digits_vit.py reads "
              "it). Do not edit by hand.\n")
    path.write_text(header + yaml.safe_dump(recipe, sort_keys=False, width=96))


