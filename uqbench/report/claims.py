"""A paper's claims, tested on the runs of an experiment (``uqbench-tables`` writes them).

An experiment's table spec may list ``claims``; each is one statement of the paper and the
measurement that tests it, read from the same validated runs as the table::

    claims:
      - claim: "Width 4: embedded fits better than learned in distribution"
        measure: "test NLL, learned − embedded"
        kind: greater                       # greater | alike | below | above | ratio
        key: metrics.test/nll               # or [key1, key2]: the value is key1 − key2
        a: {width: 4, variance: learned}    # row titles → values, as in the table
        b: {width: 4, variance: embedded}

Kinds and verdicts (paired by seed: only seeds present in both a and b count):

- ``greater``: d = a − b per seed. **holds** when d > 0 in every seed, **does not hold** when
  the mean of d is ≤ 0, **unclear** when the mean is > 0 but some seed disagrees (the effect is
  within the seed spread).
- ``alike``: d = a − b per seed. **holds** when the seeds disagree on the sign of d or
  |mean d| ≤ ``tolerance`` · |mean b| (default 0.1); **does not hold** otherwise.
- ``below`` / ``above``: a alone, against the number ``than`` (e.g. a predicted-to-true noise
  ratio below 1). **holds** when every seed is on the claimed side, **does not hold** when the
  mean is not, **unclear** otherwise.
- ``ratio``: r = mean a / mean b − 1 (seeds need not pair). **holds** when r lies in
  ``range: [lo, hi]``.

A claim whose runs are missing is **not measured**. ``claims_by: <dotted key>`` (e.g.
``variant``) repeats every claim within each value of that key, for a sweep over setups, and
writes one grid: a row per setup, a column per claim.

Imports nothing of uqbench; the runs are dicts as ``uqbench.report.tables`` loads them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

KINDS = ("greater", "alike", "below", "above", "ratio")
ONE_SIDED = ("below", "above")
HOLDS, FAILS, UNCLEAR, MISSING = "holds", "does not hold", "unclear", "not measured"
MARKS = {HOLDS: "✓", FAILS: "✗", UNCLEAR: "~", MISSING: "–"}

Run = dict[str, Any]


class InvalidClaims(ValueError):
    """A claims spec that cannot be evaluated; the message names the entry and the problem."""


def get_path(obj: dict[str, Any], dotted: str) -> Any:
    """Value at a dotted path; a metric key such as ``metrics.test/nll`` keeps its slash."""
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def check_claims(claims: Any, row_titles: list[str]) -> None:
    """The claims spec has the shape :func:`evaluate` reads (InvalidClaims if not)."""
    if not isinstance(claims, list):
        raise InvalidClaims("table.claims is not a list")
    for i, c in enumerate(claims):
        where = f"table.claims[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("claim"), str):
            raise InvalidClaims(f"{where} has no 'claim' text")
        if c.get("kind") not in KINDS:
            raise InvalidClaims(f"{where} kind {c.get('kind')!r} is not one of {KINDS}")
        key = c.get("key")
        keys = key if isinstance(key, list) else [key]
        if not (1 <= len(keys) <= 2 and all(isinstance(k, str) for k in keys)):
            raise InvalidClaims(f"{where} key must be a dotted key or a list of two")
        for side in ("a",) if c["kind"] in ONE_SIDED else ("a", "b"):
            sel = c.get(side)
            if not isinstance(sel, dict) or not sel:
                raise InvalidClaims(f"{where} needs '{side}': {{row title: value}}")
            unknown = sorted(set(sel) - set(row_titles))
            if unknown:
                raise InvalidClaims(f"{where} {side} names {unknown}, which are not row titles "
                                    f"of the table; valid: {row_titles}")
        if c["kind"] in ONE_SIDED and not isinstance(c.get("than"), (int, float)):
            raise InvalidClaims(f"{where} ({c['kind']}) needs than: <number>")
        if c["kind"] == "ratio":
            rng = c.get("range")
            if not (isinstance(rng, list) and len(rng) == 2
                    and all(isinstance(v, (int, float)) for v in rng) and rng[0] <= rng[1]):
                raise InvalidClaims(f"{where} (ratio) needs range: [lo, hi] with lo <= hi")


def _value(run: Run, key: str | list[str]) -> float | None:
    keys = key if isinstance(key, list) else [key]
    values = [get_path(run, k) for k in keys]
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v)
           for v in values):
        return None
    return float(values[0] - values[1]) if len(values) == 2 else float(values[0])


def _per_seed(runs: list[Run], rows: list[dict], sel: dict, key: Any) -> dict[int, float]:
    """{seed: value} of the runs whose row values match ``sel`` (matched as strings)."""
    by_title = {r["title"]: r["key"] for r in rows}
    out: dict[int, float] = {}
    for run in runs:
        if all(str(get_path(run, by_title[t])) == str(v) for t, v in sel.items()):
            value = _value(run, key)
            if value is not None:
                out.setdefault(int(run["seed"]), value)
    return out


def evaluate(claim: dict, runs: list[Run], rows: list[dict]) -> dict[str, Any]:
    """One claim on one set of runs: {claim, measure, value (text), mean, std, seeds,
    verdict}."""
    fmt = claim.get("fmt", ".3f")
    a = _per_seed(runs, rows, claim["a"], claim["key"])
    if claim["kind"] in ONE_SIDED:  # a against a number: b is that number in every seed
        b = dict.fromkeys(a, float(claim["than"]))
        if claim["kind"] == "below":
            a, b = b, a  # below: than − a > 0
    else:
        b = _per_seed(runs, rows, claim["b"], claim["key"])
    out = {"claim": claim["claim"], "measure": claim.get("measure", ""), "value": "–",
           "mean": math.nan, "std": math.nan, "seeds": 0, "verdict": MISSING}
    if claim["kind"] == "ratio":
        if a and b:
            r = float(np.mean(list(a.values())) / np.mean(list(b.values())) - 1)
            lo, hi = claim["range"]
            out |= {"value": f"{r:+.1%}", "mean": r, "seeds": min(len(a), len(b)),
                    "verdict": HOLDS if lo <= r <= hi else FAILS}
        return out
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return out
    d = np.array([a[s] - b[s] for s in seeds])  # > 0 where the seed agrees with the claim
    # what the table shows: the difference, or for a one-sided claim the value itself
    shown = (np.array([(b if claim["kind"] == "below" else a)[s] for s in seeds])
             if claim["kind"] in ONE_SIDED else d)
    mean, std = float(shown.mean()), float(shown.std(ddof=1)) if len(d) > 1 else math.nan
    text = format(mean, fmt) + (f" ± {format(std, fmt)}" if len(d) > 1 else "")
    if claim["kind"] in ("greater", *ONE_SIDED):
        verdict = HOLDS if (d > 0).all() else FAILS if d.mean() <= 0 else UNCLEAR
    else:  # alike
        scale = abs(float(np.mean([b[s] for s in seeds])))
        mixed = (d > 0).any() and (d < 0).any()
        verdict = (HOLDS if mixed or abs(d.mean()) <= claim.get("tolerance", 0.1) * scale
                   else FAILS)
    return out | {"value": text, "mean": mean, "std": std, "seeds": len(seeds),
                  "verdict": verdict}


def claims_table(runs: list[Run], spec: dict[str, Any]) -> pd.DataFrame:
    """One row per claim: claim, measurement, value (mean ± std over seeds), seeds, verdict."""
    check_claims(spec["claims"], [r["title"] for r in spec["rows"]])
    results = [evaluate(c, runs, spec["rows"]) for c in spec["claims"]]
    return pd.DataFrame([{"claim": r["claim"], "measurement": r["measure"],
                          "value": r["value"], "seeds": r["seeds"], "verdict": r["verdict"]}
                         for r in results])


def claims_grid(runs: list[Run], spec: dict[str, Any]) -> pd.DataFrame:
    """``claims_by``: a row per setup, a column per claim (its ``short`` title, else its
    number); each cell the verdict's mark and the value."""
    check_claims(spec["claims"], [r["title"] for r in spec["rows"]])
    by = spec["claims_by"]
    setups = sorted({str(get_path(r, by)) for r in runs})
    table = []
    for setup in setups:
        sub = [r for r in runs if str(get_path(r, by)) == setup]
        row = {by.split(".")[-1]: setup}
        for i, claim in enumerate(spec["claims"], 1):
            res = evaluate(claim, sub, spec["rows"])
            row[claim.get("short", f"claim {i}")] = f"{MARKS[res['verdict']]} {res['value']}"
        table.append(row)
    return pd.DataFrame(table)


def write_claims(runs: list[Run], spec: dict[str, Any], out_dir: Path | str,
                 exp: str) -> list[Path]:
    """Write ``<exp>_claims.md``/``.csv`` (and with ``claims_by`` the grid); the paths."""
    out_dir = Path(out_dir)
    title = f"{spec.get('title', exp)}: claims"
    if spec.get("claims_by"):
        frame = claims_grid(runs, spec)
        legend = ("✓ holds in every seed · ~ unclear (seeds disagree) · ✗ does not hold · "
                  "– not measured; each cell: the verdict and the measurement, mean ± std "
                  "over seeds.")
    else:
        frame = claims_table(runs, spec)
        legend = ("Paired by seed. holds: the claimed sign in every seed (greater, below, "
                  "above), no resolved difference (alike: the seeds disagree in sign or the "
                  "mean gap is within the tolerance), or inside the stated range (ratio); "
                  "unclear: the mean has the claimed sign but a seed disagrees; does not "
                  "hold: the mean does not have the claimed sign, or the value is out of "
                  "range.")
    md = (f"## {title}\n\n" + frame.to_markdown(index=False, disable_numparse=True)
          + f"\n\n{legend}\n")
    paths = [out_dir / f"{exp}_claims.md", out_dir / f"{exp}_claims.csv"]
    paths[0].write_text(md)
    frame.to_csv(paths[1], index=False)
    return paths
