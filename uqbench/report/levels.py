"""The backbone-quality axis of an experiment: each level's probe beside full fine-tuning.

A table spec may describe its backbone levels (``uqbench-tables`` then writes
``<experiment>_levels.md``/``.csv``)::

    levels:
      by: settings.backbone.level                # a run's level
      order: [random, other, near, foundation]   # the axis, lowest first
      probe: settings.backbone.probe_acc         # the level's quality, one per pretraining seed
      reference: {method: single, key: metrics.val/acc}   # full fine-tuning, same split
      foundation_margin: 0.02                    # foundation-grade: probe ≥ reference − margin
      min_spacing: 0.02                          # neighbouring levels' probes at least this apart

Per level: the probe's mean ± std over the pretraining seeds (one value per run seed: every
method of a seed shares its backbone), the reference method's mean ± std, the gap (reference −
probe, by the means), whether the level is **foundation-grade** (gap ≤ margin) and the spacing
to the level below (✓ when ≥ min_spacing). Both the probe and the reference read the validation
split, so the axis is designed without a test number.

Imports nothing of uqbench but the claims module's dotted-path reader.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from uqbench.report.claims import get_path, markdown_table

REQUIRED = ("by", "order", "probe", "reference")


class InvalidLevels(ValueError):
    """A ``levels`` spec that cannot be read; the message names the field."""


def check_levels(spec: Any) -> None:
    """The spec has the shape :func:`levels_table` reads (InvalidLevels if not)."""
    if not isinstance(spec, dict):
        raise InvalidLevels("table.levels is not a mapping")
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise InvalidLevels(f"table.levels lacks {missing}; it needs {list(REQUIRED)}")
    ref = spec["reference"]
    if not (isinstance(ref, dict) and isinstance(ref.get("method"), str)
            and isinstance(ref.get("key"), str)):
        raise InvalidLevels("table.levels.reference needs {method: <name>, key: <dotted key>}")
    if not isinstance(spec["order"], list) or not spec["order"]:
        raise InvalidLevels("table.levels.order must be a non-empty list of levels")


def _per_seed(runs: list[dict], level: str, by: str, key: str,
              method: str | None = None) -> dict[int, float]:
    out: dict[int, float] = {}
    for run in runs:
        if str(get_path(run, by)) != str(level):
            continue
        if method is not None and run.get("method") != method:
            continue
        value = get_path(run, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            out.setdefault(int(run["seed"]), float(value))
    return out


def _mean_std(values: dict[int, float]) -> tuple[float, float]:
    x = np.array(list(values.values()))
    if not len(x):
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1)) if len(x) > 1 else math.nan


def _show(mean: float, std: float) -> str:
    if math.isnan(mean):
        return "–"
    return f"{100 * mean:.1f}" + ("" if math.isnan(std) else f" ± {100 * std:.1f}")


def levels_table(runs: list[dict], spec: dict[str, Any]) -> pd.DataFrame:
    """A row per level of ``spec['order']`` (percent, mean ± std over seeds)."""
    check_levels(spec)
    margin = float(spec.get("foundation_margin", 0.02))
    spacing = float(spec.get("min_spacing", 0.02))
    ref = spec["reference"]
    rows, below = [], math.nan
    for level in spec["order"]:
        probe = _per_seed(runs, level, spec["by"], spec["probe"])
        tuned = _per_seed(runs, level, spec["by"], ref["key"], ref["method"])
        (p, ps), (t, ts) = _mean_std(probe), _mean_std(tuned)
        gap = t - p
        # 1e-9: the means of decimal accuracies carry float noise (0.98 − 0.96 > 0.02)
        grade = "–" if math.isnan(gap) else "yes" if gap <= margin + 1e-9 else "no"
        step = p - below
        rows.append({
            "level": level, "seeds": len(probe), "probe (val)": _show(p, ps),
            f"{ref['method']} (val)": _show(t, ts),
            "gap": "–" if math.isnan(gap) else f"{100 * gap:.1f}",
            f"foundation-grade (gap ≤ {100 * margin:g})": grade,
            f"above the level below (≥ {100 * spacing:g})":
                "–" if math.isnan(step) else f"{'✓' if step >= spacing - 1e-9 else '✗'} "
                                             f"{100 * step:+.1f}"})
        below = p
    return pd.DataFrame(rows)


def write_levels(runs: list[dict], spec: dict[str, Any], out_dir: Path | str,
                 exp: str) -> list[Path]:
    """Write ``<exp>_levels.md``/``.csv``; the paths."""
    frame = levels_table(runs, spec["levels"])
    out_dir = Path(out_dir)
    ref = spec["levels"]["reference"]
    legend = (f"Percent on the downstream validation split, mean ± std over the pretraining "
              f"seeds (run seed k uses pretraining seed k). probe: a logistic regression on "
              f"the frozen features; {ref['method']}: full fine-tuning ({ref['key']}); gap: "
              f"{ref['method']} − probe, by the means.")
    md = (f"## {spec.get('title', exp)}: backbone levels\n\n"
          + markdown_table(frame) + f"\n\n{legend}\n")
    paths = [out_dir / f"{exp}_levels.md", out_dir / f"{exp}_levels.csv"]
    paths[0].write_text(md)
    frame.to_csv(paths[1], index=False)
    return paths
