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

Failed runs count against their method. A run that a side selects but whose value is not a
finite number (a diverged or NaN run, a failed run record) is a failure of that side's method
on that seed, never dropped silently: a failure of ``a`` (the method the claim is about) makes
the claim **not hold**; a failure of ``b`` leaves its seed out of the pairing; either way the
verdict names the failures (``failed`` in the claims table, "a failed k" in a grid cell).

Multiplicity. ``multiplicity: holm`` (spec level) corrects the family of every claim the table
judges (every cell of a grid), ``ratio`` claims aside (a count, no test): each verdict is read
from one-sided p-values, p_hold for "the whole interval lies beyond the bound" and p_fail for
"it lies wholly on the other side" (t-tests of d at the bound, the same tests the interval
makes at α = (1 − confidence)/2), each family Holm-adjusted (step-down) before it is compared
with α; the table shows the adjusted p-value of the verdict. ``multiplicity: none`` (the
default) is the interval rule alone, uncorrected, and the legend says so.

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
MULTIPLICITY = ("none", "holm")
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
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
           for v in values):
        return None
    return float(values[0] - values[1]) if len(values) == 2 else float(values[0])


def _per_seed(claim: dict, side: str, runs: list[Run], rows: list[dict]
              ) -> tuple[dict[int, float], set[int]]:
    """({seed: value}, failed seeds) of the runs whose row values match the claim's ``side``
    (matched as strings): a matched run without a finite value is a failure of its seed.
    InvalidClaims when two runs of one seed match (the selection leaves a row open)."""
    by_title = {r["title"]: r["key"] for r in rows}
    sel = claim[side]
    out: dict[int, float] = {}
    failed: set[int] = set()
    for run in runs:
        if all(str(get_path(run, by_title[t])) == str(v) for t, v in sel.items()):
            seed = int(run["seed"])
            if seed in out or seed in failed:
                raise InvalidClaims(
                    f"claim {claim['claim']!r}: {side} {sel} matches more than one run of seed "
                    f"{run['seed']}; name the row that tells them apart, or set claims_by")
            value = _value(run, claim["key"])
            if value is None or not math.isfinite(value) or run.get("status") == "failed":
                failed.add(seed)
            else:
                out[seed] = value
    return out, failed


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
    a, a_failed = _per_seed(claim, "a", runs, rows)
    out |= {"failed": "", "a_failed": len(a_failed), "b_failed": 0, "p_hold": math.nan,
            "p_fail": math.nan}
    if kind == "ratio":
        b, _ = _per_seed(claim, "b", runs, rows)
        if a and b:
            r = float(np.mean(list(a.values())) / np.mean(list(b.values())) - 1)
            lo, hi = claim["range"]
            out |= {"value": f"{r:+.1%}", "mean": r, "seeds": min(len(a), len(b)),
                    "verdict": HOLDS if lo <= r <= hi else FAILS}
        return out
    b_failed: set[int] = set()
    if kind in ONE_SIDED:
        seeds = sorted(a)
        shown = np.array([a[s] for s in seeds])  # the value itself; d = ±(value − than)
    else:
        b, b_failed = _per_seed(claim, "b", runs, rows)
        seeds = sorted(set(a) & set(b))
        sign = -1.0 if claim.get("better", "higher") == "lower" else 1.0
        shown = np.array([sign * (a[s] - b[s]) for s in seeds])  # d > 0 agrees with the claim
        m = float(claim.get("margin", 0.0))
        if "relative_margin" in claim and seeds:
            m = claim["relative_margin"] * abs(float(np.mean([b[s] for s in seeds])))
            out["margin"] = bound_text(claim, m)
    out |= {"a_failed": len(a_failed), "b_failed": len(b_failed),
            "failed": failure_text(len(a_failed), len(b_failed))}
    if not seeds:
        return out | ({"verdict": FAILS} if a_failed else {})
    out |= {"seeds": len(seeds), "mean": float(shown.mean()), "value": format(shown.mean(), fmt)}
    if len(seeds) == 1:
        return out | {"interval": ONE_SEED, "verdict": FAILS if a_failed else UNCLEAR}
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
    p_hold, p_fail = p_values(shown, kind, m if kind in PAIRED else float(claim["than"]))
    return out | {"lo": lo, "hi": hi, "verdict": FAILS if a_failed else verdict,
                  "p_hold": p_hold, "p_fail": p_fail,
                  "interval": f"[{format(lo, fmt)}, {format(hi, fmt)}]"}


def failure_text(a_failed: int, b_failed: int) -> str:
    """"a failed 1, b failed 2" (the seeds each side's method failed on), or ""."""
    return ", ".join(f"{side} failed {k}" for side, k in (("a", a_failed), ("b", b_failed)) if k)


def _t_p(stat: float, df: int) -> float:
    """One-sided p-value P(T ≥ stat) of Student's t with ``df`` degrees of freedom."""
    return float(stats.t.sf(stat, df))


def p_values(d: np.ndarray, kind: str, bound: float) -> tuple[float, float]:
    """(p_hold, p_fail): the one-sided t-tests of the mean of ``d`` (n ≥ 2) that the interval
    rule makes at its bound (greater: m; not_worse: −m; alike: ±m; below/above: ``than``, d
    the values). p_hold small: the whole interval lies beyond the bound; p_fail small: wholly
    on the other side. A spread of 0 gives 0 or 1."""
    n, mean = len(d), float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n)

    def beyond(x: float) -> float:  # P-value of "mean > x"
        if se == 0:
            return 0.0 if mean > x else 1.0
        return _t_p((mean - x) / se, n - 1)

    def short_of(x: float) -> float:  # P-value of "mean < x"
        if se == 0:
            return 0.0 if mean < x else 1.0
        return _t_p((x - mean) / se, n - 1)

    if kind == "greater":
        return beyond(bound), short_of(bound)
    if kind == "not_worse":
        return beyond(-bound), short_of(-bound)
    if kind == "above":
        return beyond(bound), short_of(bound)
    if kind == "below":
        return short_of(bound), beyond(bound)
    # alike: inside (−m, m) needs both one-sided tests (TOST); outside, one of the two
    return max(beyond(-bound), short_of(bound)), min(beyond(bound), short_of(-bound))


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN entries left out of the family, kept NaN)."""
    idx = [i for i, v in enumerate(p) if not math.isnan(v)]
    order = sorted(idx, key=lambda i: p[i])
    k, out, running = len(order), [math.nan] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (k - rank) * p[i]))
        out[i] = running
    return out


def check_multiplicity(spec: dict[str, Any]) -> str:
    value = spec.get("multiplicity", "none")
    if value not in MULTIPLICITY:
        raise InvalidClaims(f"table.multiplicity {value!r} is not one of {MULTIPLICITY}")
    return str(value)


def corrected(results: list[dict[str, Any]], spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The family's verdicts under ``multiplicity`` (module docstring): with holm, each claim
    with p-values is judged on the Holm-adjusted p_hold and p_fail at α = (1 − c)/2, and
    carries ``p`` (the adjusted p-value of its verdict); failures of ``a`` still do not hold."""
    if check_multiplicity(spec) == "none":
        return results
    alpha = (1 - spec_confidence(spec)) / 2
    hold = holm([r.get("p_hold", math.nan) for r in results])
    fail = holm([r.get("p_fail", math.nan) for r in results])
    out = []
    for r, ph, pf in zip(results, hold, fail, strict=True):
        if not math.isnan(ph) and not r.get("a_failed"):
            verdict = HOLDS if ph < alpha else FAILS if pf <= alpha else UNCLEAR
            r = r | {"verdict": verdict, "p": pf if verdict == FAILS else ph}
        out.append(r)
    return out


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
    results = corrected([evaluate(c, runs, spec["rows"], confidence) for c in spec["claims"]],
                        spec)
    holm_on = check_multiplicity(spec) == "holm"
    return pd.DataFrame([{"claim": r["claim"], "measurement": r["measure"],
                          "mean": r["value"], "interval": r["interval"],
                          "margin": r["margin"], "seeds": r["seeds"],
                          **({"p (Holm)": "–" if math.isnan(r.get("p", math.nan))
                              else f"{r['p']:.3f}"} if holm_on else {}),
                          "failed": r.get("failed", ""), "verdict": r["verdict"]}
                         for r in results])


def _cell(res: dict[str, Any]) -> str:
    """A grid cell: the verdict's mark, the mean and the interval."""
    if res["verdict"] == MISSING:
        return MARKS[MISSING]
    failed = f" ({res['failed']})" if res.get("failed") else ""
    if res["interval"] == ONE_SEED:
        return f"{MARKS[res['verdict']]} {res['value']} (one seed){failed}"
    tail = "" if res["interval"] == "–" else f" {res['interval']}"
    return f"{MARKS[res['verdict']]} {res['value']}{tail}{failed}"


def _short(claim: dict, i: int) -> str:
    return claim.get("short", f"claim {i}")


def claims_grid(runs: list[Run], spec: dict[str, Any]) -> pd.DataFrame:
    """``claims_by``: a row per setup, a column per claim (its ``short`` title, else its
    number); each cell the verdict's mark, the mean and the interval."""
    confidence = spec_confidence(spec)
    check_claims(spec["claims"], [r["title"] for r in spec["rows"]], confidence)
    by = spec["claims_by"]
    values = {str(get_path(r, by)): get_path(r, by) for r in runs}  # a setup's runs: by text
    setups = sorted(values, key=lambda text: sort_key(values[text]))
    cells = [(setup, i, c, evaluate(c, [r for r in runs if str(get_path(r, by)) == setup],
                                    spec["rows"], confidence))
             for setup in setups for i, c in enumerate(spec["claims"], 1)]
    judged = corrected([res for *_, res in cells], spec)  # the family: every cell
    table: dict[str, dict[str, str]] = {s: {by.split(".")[-1]: s} for s in setups}
    for (setup, i, c, _), res in zip(cells, judged, strict=True):
        table[setup][_short(c, i)] = _cell(res)
    return pd.DataFrame(list(table.values()))


def multiplicity_sentence(spec: dict[str, Any]) -> str:
    """The family the claims table judges and how its multiplicity is handled, in words."""
    c = spec_confidence(spec)
    family = sum(cl["kind"] != "ratio" for cl in spec["claims"])
    if check_multiplicity(spec) == "holm":
        where = (f"{family} claims in every setup, all the grid's cells together"
                 if spec.get("claims_by") else f"{family} claims")
        return (f"Multiplicity: the family is every claim judged here ({where}; ratio "
                f"claims aside, which test nothing); each verdict is Holm-corrected "
                f"(step-down) at α = {(1 - c) / 2:.0%} one-sided, for 'holds' and for 'does "
                f"not hold' alike, so a cell whose {c:.0%} interval clears its bound can "
                f"still read unclear.")
    return ("Multiplicity: uncorrected; each verdict is read on its own, so some of the "
            "family's verdicts are expected to be wrong by chance.")


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
    rule += " " + multiplicity_sentence(spec)
    if spec.get("preregistered"):
        rule += (f" Pre-registered: the claims, margins, confidence, multiplicity rule, seeds, "
                 f"splits and selection grid were committed in {spec['preregistered']}, before "
                 f"any run scored a test split.")
    rule += (" A run without a finite value is a failure of its method on that seed: a "
             "failure of a (the claim's method) makes the claim not hold, one of b leaves "
             "its seed out; both are named.")
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
