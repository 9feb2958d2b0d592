"""A paper's claims, tested on the runs of an experiment (``uqbench-tables`` writes them).

An experiment's table spec may list ``claims``; each is one statement of the paper and the
measurement that tests it, read from the same validated runs as the table::

    confidence: 0.90                        # optional, for every claim of the spec
    claims:
      - claim: "SVE is as accurate as the Deep Ensemble"
        short: "ACC vs DE"                  # the grid's column title (optional)
        measure: "test accuracy, SVE − DE"
        kind: not_worse                     # greater | not_worse | alike | below | above | ratio
        margin: 0.01                        # or relative_margin: 0.1 (of |mean of b|)
        better: higher                      # higher (default) | lower: d = b − a
        key: metrics.test/acc               # or [key1, key2]: the value is key1 − key2
        a: {method: sve}                    # row titles → values, as in the table
        b: {method: deep_ensemble}

One rule for every kind but ``ratio``. Per claim, the runs are paired by their ``seed`` (only
seeds present on both sides count) and each seed gives a difference d_s, oriented so that
d > 0 agrees with the claim: d = a − b, or b − a with ``better: lower`` (NLL, ECE: a better
than b means a lower). With n ≥ 2 seeds, the mean of d and its two-sided confidence interval
[lo, hi] = mean ± t_{(1+c)/2, n−1} · sd/√n (Student t, sd with ddof = 1, c = ``confidence``,
default 0.90) decide:

- ``greater`` (a better than b by more than ``margin`` m ≥ 0, default 0): **holds** if lo > m,
  **does not hold** if hi ≤ m, **unclear** otherwise (the interval straddles m).
- ``not_worse`` (non-inferiority, m > 0 required): **holds** if lo > −m, **does not hold** if
  hi ≤ −m, **unclear** otherwise.
- ``alike`` (equivalence, m > 0 required): **holds** if the whole interval lies inside
  (−m, m), **does not hold** if it lies wholly outside (lo ≥ m or hi ≤ −m), **unclear**
  otherwise. Seeds that disagree in sign never make a claim hold by themselves: a difference
  that is large in most seeds stays large.
- ``below`` / ``above`` a number ``than``: the same interval on d_s = than − value (below) or
  value − than (above), margin 0; the tables show the value's own mean and interval, which is
  the same test (the interval shifted by ``than``).
- ``ratio``: r = mean a / mean b − 1 **holds** when it lies in ``range: [lo, hi]``, else
  **does not hold**. It is meant for quantities that a seed does not change (parameter counts):
  every seed gives the same number, so there is no spread to put an interval on, and the seeds
  need not pair.

One seed is **unclear** ("one seed: no interval"); no paired seed is **not measured**.

Margins are stated in the spec, fixed before the runs, in the key's units (``margin``) or as a
fraction of |mean of b| over the paired seeds (``relative_margin``, for a relative tolerance);
``not_worse`` and ``alike`` need one of them, and a spec without is refused (InvalidClaims
naming the entry), as is any field the claim's kind does not read.

``<experiment>_claims.md``/``.csv``: per claim the measurement, mean, interval, margin (where
the interval must lie to hold), seeds and verdict. ``claims_by: <dotted key>`` (e.g.
``variant``) repeats every claim within each value of that key, for a sweep over setups, and
writes one grid instead: a row per setup, a column per claim, each cell the verdict's mark, the
mean and the interval, with a key below giving each column's claim and margin. A side must pick
one run per seed (within a setup): a selection that several runs of one seed match (a row it
leaves open) is refused rather than averaged or picked from.

Imports nothing of uqbench; the runs are dicts as ``uqbench.report.tables`` loads them.
Longer than most modules: the rule, the check of the spec it reads and the tables that print
it are one piece, changed together whenever a kind or a field is added.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

KINDS = ("greater", "not_worse", "alike", "below", "above", "ratio")
ONE_SIDED = ("below", "above")          # a against the number ``than``
PAIRED = ("greater", "not_worse", "alike")  # a against b, seed by seed
NEEDS_MARGIN = ("not_worse", "alike")
CONFIDENCE = 0.90
BETTER = ("higher", "lower")
HOLDS, FAILS, UNCLEAR, MISSING = "holds", "does not hold", "unclear", "not measured"
MARKS = {HOLDS: "✓", FAILS: "✗", UNCLEAR: "~", MISSING: "–"}
ONE_SEED = "one seed: no interval"

# the fields each kind reads; any other field is a typo or a leftover of an older rule
_COMMON = {"claim", "short", "measure", "kind", "key", "a", "fmt"}
FIELDS = {"greater": _COMMON | {"b", "better", "margin", "relative_margin"},
          "not_worse": _COMMON | {"b", "better", "margin", "relative_margin"},
          "alike": _COMMON | {"b", "better", "margin", "relative_margin"},
          "below": _COMMON | {"than"}, "above": _COMMON | {"than"},
          "ratio": _COMMON | {"b", "range"}}

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


def sort_key(value: Any) -> tuple:
    """The order of a row key's values, in tables and claims grids: numbers first, by value
    (widths 4, 16, 64, 256; not "16" before "4"), then the rest as text."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, value, "") if is_number else (1, 0, str(value))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_confidence(confidence: Any) -> float:
    """The spec's ``confidence`` as a float in (0, 1), or InvalidClaims."""
    if not _is_number(confidence) or not 0 < confidence < 1:
        raise InvalidClaims(f"table.confidence {confidence!r} is not a number between 0 and 1 "
                            f"(e.g. {CONFIDENCE}, the default)")
    return float(confidence)


def check_claims(claims: Any, row_titles: list[str], confidence: Any = CONFIDENCE) -> None:
    """The claims spec (and its ``confidence``) has the shape :func:`evaluate` reads
    (InvalidClaims naming the entry if not)."""
    check_confidence(confidence)
    if not isinstance(claims, list):
        raise InvalidClaims("table.claims is not a list")
    for i, c in enumerate(claims):
        where = f"table.claims[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("claim"), str):
            raise InvalidClaims(f"{where} has no 'claim' text")
        kind = c.get("kind")
        if kind not in KINDS:
            raise InvalidClaims(f"{where} kind {kind!r} is not one of {KINDS}")
        extra = sorted(set(c) - FIELDS[kind])
        if extra:
            hint = (" (a tolerance relative to b is written relative_margin)"
                    if "tolerance" in extra else "")
            raise InvalidClaims(f"{where} ({kind}) does not read {extra}{hint}; its fields: "
                                f"{sorted(FIELDS[kind])}")
        key = c.get("key")
        keys = key if isinstance(key, list) else [key]
        if not (1 <= len(keys) <= 2 and all(isinstance(k, str) for k in keys)):
            raise InvalidClaims(f"{where} key must be a dotted key or a list of two")
        for side in ("a",) if kind in ONE_SIDED else ("a", "b"):
            sel = c.get(side)
            if not isinstance(sel, dict) or not sel:
                raise InvalidClaims(f"{where} needs '{side}': {{row title: value}}")
            unknown = sorted(set(sel) - set(row_titles))
            if unknown:
                raise InvalidClaims(f"{where} {side} names {unknown}, which are not row titles "
                                    f"of the table; valid: {row_titles}")
        for field in ("claim", "short", "measure"):
            if field in c and not isinstance(c[field], str):
                raise InvalidClaims(f"{where} {field} {c[field]!r} is not text")
        try:
            format(1.0, c.get("fmt", ".3f"))
        except (TypeError, ValueError) as err:
            raise InvalidClaims(f"{where} fmt {c.get('fmt')!r} is not a number format "
                                f"(e.g. '.3f')") from err
        if kind in ONE_SIDED and not _is_number(c.get("than")):
            raise InvalidClaims(f"{where} ({kind}) needs than: <number>")
        if kind == "ratio":
            rng = c.get("range")
            if not (isinstance(rng, list) and len(rng) == 2
                    and all(_is_number(v) for v in rng) and rng[0] <= rng[1]):
                raise InvalidClaims(f"{where} (ratio) needs range: [lo, hi] with lo <= hi")
        if kind in PAIRED:
            _check_margin(c, where)
    shorts = [c.get("short", f"claim {i}") for i, c in enumerate(claims, 1)]
    twice = sorted({t for t in shorts if shorts.count(t) > 1})
    if twice:
        raise InvalidClaims(f"table.claims: short titles {twice} name more than one claim (the "
                            f"grid's columns)")


def _check_margin(c: dict, where: str) -> None:
    if c.get("better", "higher") not in BETTER:
        raise InvalidClaims(f"{where} better {c['better']!r} is not one of {BETTER}")
    given = [f for f in ("margin", "relative_margin") if f in c]
    if len(given) == 2:
        raise InvalidClaims(f"{where} has both margin and relative_margin; give one")
    if not given:
        if c["kind"] in NEEDS_MARGIN:
            raise InvalidClaims(f"{where} ({c['kind']}) needs a margin fixed before the runs: "
                                f"margin: <number in the key's units> or relative_margin: "
                                f"<fraction of |mean of b|>")
        return
    value = c[given[0]]
    positive = c["kind"] in NEEDS_MARGIN
    if not _is_number(value) or value < 0 or (positive and value == 0):
        raise InvalidClaims(f"{where} {given[0]} {value!r} is not a number "
                            f"{'> 0' if positive else '>= 0'}")


def _value(run: Run, key: str | list[str]) -> float | None:
    keys = key if isinstance(key, list) else [key]
    values = [get_path(run, k) for k in keys]
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v)
           for v in values):
        return None
    return float(values[0] - values[1]) if len(values) == 2 else float(values[0])


def _per_seed(claim: dict, side: str, runs: list[Run], rows: list[dict]) -> dict[int, float]:
    """{seed: value} of the runs whose row values match the claim's ``side`` (matched as
    strings); InvalidClaims when two runs of one seed match (the selection leaves a row open)."""
    by_title = {r["title"]: r["key"] for r in rows}
    sel = claim[side]
    out: dict[int, float] = {}
    for run in runs:
        if all(str(get_path(run, by_title[t])) == str(v) for t, v in sel.items()):
            value = _value(run, claim["key"])
            if value is None:
                continue
            if int(run["seed"]) in out:
                raise InvalidClaims(
                    f"claim {claim['claim']!r}: {side} {sel} matches more than one run of seed "
                    f"{run['seed']}; name the row that tells them apart, or set claims_by")
            out[int(run["seed"])] = value
    return out


def mean_interval(d: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(mean, lo, hi): the two-sided Student-t confidence interval of the mean of d (n ≥ 2)."""
    n = len(d)
    mean = float(d.mean())
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1) * d.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half


def _one_bound(lo: float, hi: float, bound: float) -> str:
    return HOLDS if lo > bound else FAILS if hi <= bound else UNCLEAR


def evaluate(claim: dict, runs: list[Run], rows: list[dict],
             confidence: float = CONFIDENCE) -> dict[str, Any]:
    """One claim on one set of runs: {claim, measure, mean, lo, hi, seeds, verdict} and their
    texts (value, interval, margin), as the module docstring's rule decides."""
    fmt, kind = claim.get("fmt", ".3f"), claim["kind"]
    out: dict[str, Any] = {"claim": claim["claim"], "measure": claim.get("measure", ""),
                           "mean": math.nan, "lo": math.nan, "hi": math.nan, "seeds": 0,
                           "value": "–", "interval": "–", "margin": bound_text(claim),
                           "verdict": MISSING}
    a = _per_seed(claim, "a", runs, rows)
    if kind == "ratio":
        b = _per_seed(claim, "b", runs, rows)
        if a and b:
            r = float(np.mean(list(a.values())) / np.mean(list(b.values())) - 1)
            lo, hi = claim["range"]
            out |= {"value": f"{r:+.1%}", "mean": r, "seeds": min(len(a), len(b)),
                    "verdict": HOLDS if lo <= r <= hi else FAILS}
        return out
    if kind in ONE_SIDED:
        seeds = sorted(a)
        shown = np.array([a[s] for s in seeds])  # the value itself; d = ±(value − than)
    else:
        b = _per_seed(claim, "b", runs, rows)
        seeds = sorted(set(a) & set(b))
        sign = -1.0 if claim.get("better", "higher") == "lower" else 1.0
        shown = np.array([sign * (a[s] - b[s]) for s in seeds])  # d > 0 agrees with the claim
        m = float(claim.get("margin", 0.0))
        if "relative_margin" in claim and seeds:
            m = claim["relative_margin"] * abs(float(np.mean([b[s] for s in seeds])))
            out["margin"] = bound_text(claim, m)
    if not seeds:
        return out
    out |= {"seeds": len(seeds), "mean": float(shown.mean()), "value": format(shown.mean(), fmt)}
    if len(seeds) == 1:
        return out | {"interval": ONE_SEED, "verdict": UNCLEAR}
    mean, lo, hi = mean_interval(shown, confidence)
    if kind == "above":
        verdict = _one_bound(lo, hi, float(claim["than"]))
    elif kind == "below":  # than − value > 0: the interval of −value against −than
        verdict = _one_bound(-hi, -lo, -float(claim["than"]))
    elif kind == "greater":
        verdict = _one_bound(lo, hi, m)
    elif kind == "not_worse":
        verdict = _one_bound(lo, hi, -m)
    else:  # alike: inside (−m, m) holds, wholly outside does not, straddling a bound is unclear
        verdict = (HOLDS if -m < lo and hi < m else FAILS if lo >= m or hi <= -m
                   else UNCLEAR)
    return out | {"lo": lo, "hi": hi, "verdict": verdict,
                  "interval": f"[{format(lo, fmt)}, {format(hi, fmt)}]"}


def bound_text(claim: dict, m: float | None = None) -> str:
    """Where the interval must lie for the claim to hold, e.g. "> -0.010" or "inside ±0.050
    (10% of |b|)"; a relative margin before it is measured (``m`` None): "inside ±10% of |b|"."""
    kind, fmt = claim["kind"], claim.get("fmt", ".3f")
    if kind == "ratio":
        return f"in [{claim['range'][0]:+.1%}, {claim['range'][1]:+.1%}]"
    if kind in ONE_SIDED:
        return f"{'<' if kind == 'below' else '>'} {format(float(claim['than']), fmt)}"
    relative = claim.get("relative_margin")
    if m is not None:
        number = format(m, fmt) + (f" ({relative:.0%} of |b|)" if relative is not None else "")
    else:
        number = (f"{relative:.0%} of |b|" if relative is not None
                  else format(float(claim.get("margin", 0.0)), fmt))
    return {"greater": f"> {number}", "not_worse": f"> -{number}",
            "alike": f"inside ±{number}"}[kind]


def spec_confidence(spec: dict[str, Any]) -> float:
    return check_confidence(spec.get("confidence", CONFIDENCE))


def claims_table(runs: list[Run], spec: dict[str, Any]) -> pd.DataFrame:
    """One row per claim: claim, measurement, mean, interval, margin, seeds, verdict."""
    confidence = spec_confidence(spec)
    check_claims(spec["claims"], [r["title"] for r in spec["rows"]], confidence)
    results = [evaluate(c, runs, spec["rows"], confidence) for c in spec["claims"]]
    return pd.DataFrame([{"claim": r["claim"], "measurement": r["measure"],
                          "mean": r["value"], "interval": r["interval"],
                          "margin": r["margin"], "seeds": r["seeds"], "verdict": r["verdict"]}
                         for r in results])


def _cell(res: dict[str, Any]) -> str:
    """A grid cell: the verdict's mark, the mean and the interval."""
    if res["verdict"] == MISSING:
        return MARKS[MISSING]
    if res["interval"] == ONE_SEED:
        return f"{MARKS[UNCLEAR]} {res['value']} (one seed)"
    tail = "" if res["interval"] == "–" else f" {res['interval']}"
    return f"{MARKS[res['verdict']]} {res['value']}{tail}"


def _short(claim: dict, i: int) -> str:
    return claim.get("short", f"claim {i}")


def claims_grid(runs: list[Run], spec: dict[str, Any]) -> pd.DataFrame:
    """``claims_by``: a row per setup, a column per claim (its ``short`` title, else its
    number); each cell the verdict's mark, the mean and the interval."""
    confidence = spec_confidence(spec)
    check_claims(spec["claims"], [r["title"] for r in spec["rows"]], confidence)
    by = spec["claims_by"]
    table = []
    values = {str(get_path(r, by)): get_path(r, by) for r in runs}  # a setup's runs: by text
    for setup in sorted(values, key=lambda text: sort_key(values[text])):
        sub = [r for r in runs if str(get_path(r, by)) == setup]
        table.append({by.split(".")[-1]: setup}
                     | {_short(c, i): _cell(evaluate(c, sub, spec["rows"], confidence))
                        for i, c in enumerate(spec["claims"], 1)})
    return pd.DataFrame(table)


def legend(spec: dict[str, Any]) -> str:
    """The rule in a few sentences, below the claims table; below the grid also the marks and
    each column's claim, measurement and margin (the cells have no room for them)."""
    c = spec_confidence(spec)
    rule = (f"Paired by seed; d > 0 agrees with the claim. mean: the mean of d (below/above: "
            f"of the value); interval: its two-sided {c:.0%} Student-t confidence interval, "
            f"mean ± t·sd/√n. holds: the whole interval lies beyond the margin (greater: above "
            f"it, 0 unless stated; not_worse: above −margin; alike: inside ±margin; "
            f"below/above: beyond the number); does not hold: it lies wholly on the other side "
            f"(alike: wholly outside ±margin); unclear: it straddles the bound, or one seed (no "
            f"interval); not measured: no paired seed. Margins are the spec's, in the "
            f"measurement's units or a stated fraction of |mean b|. ratio: mean a / mean b − 1 "
            f"of a count the seed does not change (no interval), holds inside its range.")
    if not spec.get("claims_by"):
        return rule
    key = "".join(f"\n- **{_short(cl, i)}**: {cl['claim']}. {cl.get('measure', '')}; margin: "
                  f"{bound_text(cl)}" for i, cl in enumerate(spec["claims"], 1))
    return (f"{MARKS[HOLDS]} holds · {MARKS[UNCLEAR]} unclear · {MARKS[FAILS]} does not hold · "
            f"{MARKS[MISSING]} not measured. Each cell: mean [{c:.0%} interval]. {rule}\n{key}")


def markdown_table(frame: pd.DataFrame) -> str:
    """``frame`` as a Markdown table: our formatting kept (numbers are not parsed again) and a
    "|" in a header or a cell escaped, so that it cannot split a row ("mean |σ − true σ|")."""
    def escaped(value: Any) -> Any:
        return value.replace("|", "\\|") if isinstance(value, str) else value

    shown = frame.rename(columns=lambda c: escaped(str(c))).map(escaped)
    return str(shown.to_markdown(index=False, disable_numparse=True))


def write_claims(runs: list[Run], spec: dict[str, Any], out_dir: Path | str,
                 exp: str) -> list[Path]:
    """Write ``<exp>_claims.md``/``.csv`` (and with ``claims_by`` the grid); the paths."""
    out_dir = Path(out_dir)
    title = f"{spec.get('title', exp)}: claims"
    frame = claims_grid(runs, spec) if spec.get("claims_by") else claims_table(runs, spec)
    md = f"## {title}\n\n" + markdown_table(frame) + f"\n\n{legend(spec)}\n"
    paths = [out_dir / f"{exp}_claims.md", out_dir / f"{exp}_claims.csv"]
    paths[0].write_text(md)
    frame.to_csv(paths[1], index=False)
    return paths
