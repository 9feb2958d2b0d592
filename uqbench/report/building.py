"""One experiment's table from its runs: a row per setting, each cell mean ± std over seeds.

Also the warning for a key of the spec that no run has (a typo, a metric this dataset does not
write), naming the closest keys the runs do have. Std everywhere: the sample standard deviation
over seeds (``ddof=1``).

Edge choices. A run that used a recipe entry (results.json's ``recipe``, which the runner fills
from the recipe files an experiment reads: :mod:`uqbench.report.selection`) whose value was
chosen at the edge of its grid marks its row: :data:`EDGE_MARK` after the last row key, and
:func:`edge_note` says which keys under the table.
"""

from __future__ import annotations

import difflib
from typing import Any

import numpy as np
import pandas as pd

from uqbench.report.claims import get_path, sort_key
from uqbench.report.validation import Run, figure_keys, figure_specs, is_number, setting_of

MISSING = "–"  # a cell, a row key or a paper value that has no number
EDGE_MARK = "†"  # a row whose runs used a setting chosen at the edge of its grid


# --- the spec's keys against the runs' keys ----------------------------------------------------

def has_path(obj: Any, dotted: str) -> bool:
    """Whether the dotted path exists in ``obj`` (its value may be null)."""
    for part in dotted.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return False
        obj = obj[part]
    return True


def _leaf_keys(obj: Any, prefix: str = "") -> set[str]:
    """Every dotted path to a value that is not an object (the spec and our own keys left out)."""
    if not isinstance(obj, dict):
        return {prefix}
    keys: set[str] = set()
    for k, v in obj.items():
        if not prefix and k in ("table", "_path"):
            continue
        keys |= _leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))
    return keys


def _spec_keys(spec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where the spec reads it, the key, what the output shows without it) for every key."""
    keys = [(f"row '{r['title']}'", r["key"], f"the row key shows {MISSING}")
            for r in spec["rows"]]
    keys += [(f"column '{c['title']}'", c["key"], f"its cells show {MISSING}")
             for c in spec["columns"]]
    for suffix, figure in figure_specs(spec).items():
        name = f"figure '{suffix[1:]}'" if suffix else "figure"
        numbers, scalars = figure_keys(figure)
        keys += [(name, k, "the figure has no points for it") for k in numbers]
        keys += [(name, k, "its lines are not split by it") for k in scalars]
    return keys


def missing_keys(exp: str, spec: dict[str, Any], runs: list[Run]) -> list[str]:
    """One warning per key of the spec that no run has, with the closest keys the runs have
    (the table is still written: those cells show "–")."""
    absent = [(where, key, effect) for where, key, effect in _spec_keys(spec)
              if not any(has_path(run, key) for run in runs)]
    if not absent:
        return []
    have = sorted(set().union(*(_leaf_keys(run) for run in runs)))
    warnings, seen = [], set()
    for where, key, effect in absent:
        if (where, key) in seen:
            continue
        seen.add((where, key))
        close = difflib.get_close_matches(key, have, n=3, cutoff=0.6)
        hint = (f"closest keys the runs have: {', '.join(close)}" if close
                else "no key of the runs comes close")
        warnings.append(f"warning: {exp}: {where} reads '{key}', which no run of the "
                        f"experiment has ({hint}); {effect}")
    return warnings



# --- the table ---------------------------------------------------------------------------------

def show_key(value: Any, fmt: str | None = None) -> str:
    """A row key (or a figure's hue) as the table shows it: the row's fmt for numbers, else
    integers as they are and other numbers compactly (``.4g``: -2.0 → -2, 0.03 → 0.03)."""
    if value is None:
        return MISSING
    if not is_number(value):
        return str(value)
    if fmt is not None:
        return format(value, fmt)
    return str(value) if isinstance(value, int) else format(value, ".4g")


def _cell(mean: float, std: float, n: int, fmt: str) -> str:
    """mean ± std; the mean alone with one value or no spread; "–" with none."""
    if n == 0:
        return MISSING
    text = format(mean, fmt)
    return text + f" ± {format(std, fmt)}" if n > 1 and std > 0 else text


def _paper_refs(spec: dict[str, Any], settings: list[tuple]) -> list[dict[str, Any]]:
    """Each setting's paper values: those of the first ``paper`` entry whose row titles all
    match the setting's values (compared as text, so ``M: 4`` matches 4)."""
    titles = [r["title"] for r in spec["rows"]]
    labels = pd.DataFrame([[str(v) for v in s] for s in settings], columns=titles, dtype=object)
    refs: list[dict[str, Any] | None] = [None] * len(settings)
    for entry in spec.get("paper") or []:
        match = pd.Series(True, index=labels.index)
        for title, value in entry["row"].items():
            match &= labels[title].eq(str(value)) if title in labels else False
        for i in np.flatnonzero(match.to_numpy()):
            refs[i] = entry["values"] if refs[i] is None else refs[i]
    return [r or {} for r in refs]


def edge_keys(run: Run) -> set[str]:
    """The keys of the recipe entries a run used that were chosen at the edge of their grid."""
    recipe = run.get("recipe")
    entries = recipe.values() if isinstance(recipe, dict) else []
    return {str(k) for e in entries if isinstance(e, dict) for k in e.get("edge") or []}


def edge_note(runs: list[Run]) -> str | None:
    """The footnote for the rows :data:`EDGE_MARK` marks, or None when no run used an edge
    choice."""
    keys = sorted(set().union(*(edge_keys(run) for run in runs)))
    return f"{EDGE_MARK} chosen at the edge of its grid: {', '.join(keys)}" if keys else None


WITHIN, OUTSIDE = "✓", "✗"


def within_cell(values: np.ndarray, bound: float) -> str:
    """A verdict column's cell (``within: bound``) from its setting's runs' values: ✓ when
    every run has |value| ≤ bound, ✗ when none has, "k/n ✓" when k of n runs have, and "–"
    when no run has a finite value (then it judges nothing)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return MISSING
    k = int((np.abs(finite) <= bound).sum())
    if k == finite.size:
        return WITHIN
    return OUTSIDE if k == 0 else f"{k}/{finite.size} {WITHIN}"


def build_table(runs: list[Run], spec: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(display table with formatted cells, numeric table with mean/std columns): one row per
    setting (the row keys' values, sorted: numbers first, in order), each column's mean, sample
    std (ddof=1) and count over the setting's runs, and ``seeds``, its distinct seeds. A setting
    whose runs used an edge choice shows :data:`EDGE_MARK` after its last row key. With
    ``failed_key``, a ``failed`` column counts the setting's runs without a finite value there
    (a diverged or NaN run is a failure of its method, not a seed left out unnoticed), and the
    failed runs' records (``failed: true``, :func:`~uqbench.report.validation.load_results`);
    without it the column is there whenever such a record is. A column
    with ``within: b`` is a verdict instead of a mean: :func:`within_cell` of its runs."""
    rows, cols = spec["rows"], spec["columns"]
    settings = [setting_of(run, spec) for run in runs]
    order = sorted(set(settings), key=lambda s: tuple(sort_key(v) for v in s))
    index = {s: i for i, s in enumerate(order)}
    # one row per run: its setting's position, its seed and each column's scaled value
    frame = pd.DataFrame({"setting": [index[s] for s in settings],
                          "seed": [run["seed"] for run in runs]})
    for j, c in enumerate(cols):
        values = pd.Series([get_path(run, c["key"]) for run in runs], dtype=object)
        frame[f"c{j}"] = pd.to_numeric(values, errors="coerce") * float(c.get("scale", 1))
    stats = frame.groupby("setting", sort=True).agg(
        seeds=("seed", "nunique"),
        **{f"c{j}_{k}": (f"c{j}", k) for j in range(len(cols))
           for k in ("mean", "std", "count")})  # std: the sample std, ddof=1
    refs = _paper_refs(spec, order)
    papered = {t for p in spec.get("paper") or [] for t in p["values"]}

    shown = pd.DataFrame({r["title"]: [show_key(s[i], r.get("fmt")) for s in order]
                          for i, r in enumerate(rows)})
    edged = {index[s] for s, run in zip(settings, runs, strict=True) if edge_keys(run)}
    last = rows[-1]["title"]
    shown[last] = [f"{v} {EDGE_MARK}" if i in edged else v for i, v in enumerate(shown[last])]
    numeric = pd.DataFrame({r["title"]: [MISSING if s[i] is None else
                                         format(s[i], r["fmt"]) if "fmt" in r
                                         and is_number(s[i]) else s[i] for s in order]
                            for i, r in enumerate(rows)})
    for j, c in enumerate(cols):
        title, fmt = c["title"], c.get("fmt", ".4g")
        if "within" in c:  # a verdict, per setting, on each of its runs' values
            verdicts = [within_cell(frame.loc[frame["setting"] == i, f"c{j}"].to_numpy(float),
                                    float(c["within"])) for i in range(len(order))]
            shown[title] = numeric[title] = verdicts
            continue
        mean, std, n = (stats[f"c{j}_{k}"].to_numpy() for k in ("mean", "std", "count"))
        shown[title] = [_cell(m, s, k, fmt) for m, s, k in zip(mean, std, n, strict=True)]
        numeric[f"{title} mean"], numeric[f"{title} std"] = mean, std
        if title in papered:
            values = [ref.get(title) for ref in refs]
            shown[f"{title} (paper)"] = [MISSING if v is None else format(v, fmt)
                                         for v in values]
            numeric[f"{title} (paper)"] = pd.Series(values, dtype=float)
    shown["seeds"] = numeric["seeds"] = stats["seeds"].to_numpy()
    recorded = np.array([bool(run.get("failed")) for run in runs], dtype=bool)
    if spec.get("failed_key") or recorded.any():  # failures, not runs dropped unnoticed
        failed = recorded
        if spec.get("failed_key"):
            value = pd.to_numeric(pd.Series([get_path(run, spec["failed_key"]) for run in runs],
                                            dtype=object), errors="coerce")
            failed = failed | ~np.isfinite(value.to_numpy(dtype=float))
        counts = pd.Series(failed.astype(int)).groupby(frame["setting"]).sum()
        shown["failed"] = numeric["failed"] = counts.reindex(range(len(order)),
                                                             fill_value=0).to_numpy()
    return shown, numeric


