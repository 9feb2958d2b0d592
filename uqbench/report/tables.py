"""Results → tables (`uqbench-tables`, `make tables`).

(Longer than uqbench's other modules on purpose: it validates every results file it reads —
they come from any version and any user — and builds the tables, their LaTeX and their figures
from the same validated runs; it imports nothing else of uqbench but :mod:`uqbench.report.claims`.)

Scans ``<runs_dir>/**/results.json`` and, for every experiment whose runs carry a ``table`` spec
(declared in ``conf/experiment/<name>.yaml`` and copied into each results.json), writes
``<out>/<experiment>.md``, ``.tex``, ``.csv`` and ``.command``: one row per combination of the
row keys, each cell the mean ± std over seeds. The spec::

    table:
      title: "…"
      rows:    [{key: settings.backbone.width, title: width, fmt: ".0f"}, …]  # dotted paths
      columns: [{key: metrics.test/nll, title: test NLL, fmt: ".3f", scale: 1}, …]
      paper:   [{row: {method: sve}, values: {ACC: 95.4}}, …]        # optional reference numbers
      figure:  {x: params.trainable, y: [metrics.test/nll], hue: settings.method.variance,
                facet: settings.backbone.depth, xscale: log}   # hue, facet: a key or a list
      figures: {severity: {series: [key, …], labels: [0, …], hue: method}}   # <exp>_severity.png
      claims:  [{claim: "…", kind: greater, key: metrics.test/nll, a: {…}, b: {…}}, …]

A spec with ``claims`` also gets ``<experiment>_claims.md``/``.csv``: each claim of the paper,
the measurement that tests it and whether it holds (:mod:`uqbench.report.claims`).

Paper values are matched on row titles and shown in a "<column> (paper)" column beside ours.
Tables read only results.json files, never a logger.

Which files count. A results.json is used when it is UTF-8 JSON holding an object with
``experiment`` (a non-empty string), ``seed`` (an integer) and ``metrics`` (an object, empty for
the parameter job), and, when it has a ``table``, a spec of the shape above. Within an
experiment, every value its table reads must be a number or absent (columns, figure x and y)
or a single value (rows, figure hue and facet). Any other file is skipped with one warning line
on stderr naming it and the problem, and every table is still written from the valid files. A
key of the spec that no run of the experiment has (a typo, a metric this dataset does not
write) gets one warning naming the experiment, the key and the closest keys the runs do have;
its cells show "–" and the figure has no points for it.

Ensemble members. A run that trained one member of a Deep Ensemble as its own job
(``settings.method.member`` set) is not a row: its ensemble is, once ``uqbench-combine`` has
written it (it would otherwise pass for the ensemble in the ensemble's row).

Seeds. A cell aggregates one result per distinct seed, and ``seeds`` counts distinct seeds.
When two files hold the same seed of the same setting (a copied run folder, a backup), the one
first in sorted path order is kept, so the choice does not depend on file times, and a warning
names both files.

Std. One convention everywhere: the sample standard deviation over seeds (``ddof=1``), in the
table cells (mean ± std; the mean alone when there is one seed or no spread), the CSV's
``<column> std`` (empty with one seed) and the figures' error bars (none with one seed).

Output. The Markdown and the LaTeX show the same text: numbers in the column's ``fmt`` (default
``.4g``), numeric row keys in the row's ``fmt`` (integers as they are, other numbers ``.4g``),
"–" for a missing value. The LaTeX is a booktabs table (``\\usepackage{booktabs}``) written by
pandas' ``Styler.to_latex``, with LaTeX's specials escaped and Unicode turned into LaTeX
(``±`` → ``$\\pm$``, ``σ`` → ``$\\sigma$``, ``ρ₀`` → ``$\\rho_0$``, ``–`` → ``--``), so it
compiles with pdflatex. ``<experiment>.command`` holds the command that rebuilds exactly these
files and lists the results.json files that went in. Building twice from the same runs writes
the same bytes (the figures carry no date or software version).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import sys
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from uqbench.report.claims import InvalidClaims, check_claims, get_path, write_claims

Run = dict[str, Any]
MISSING = "–"  # a cell, a row key or a paper value that has no number


class InvalidResults(ValueError):
    """A results.json the tables cannot use; the message says why, in a few words."""


def _json_type(value: Any) -> str:
    """How JSON names a value's type, for warnings (never the value: it may be huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_json(path: Path) -> Any:
    """The parsed file, or InvalidResults saying why it cannot be parsed."""
    if path.is_dir():
        raise InvalidResults("is a directory, not a file")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise InvalidResults(f"cannot be read ({err.strerror or err})") from err
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidResults(f"is not UTF-8 text (bad byte at offset {err.start})") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidResults(f"is not valid JSON ({err.msg} at line {err.lineno} "
                             f"column {err.colno})") from err
    except RecursionError as err:
        raise InvalidResults("is not valid JSON (nested too deeply)") from err


def _check_entries(entries: Any, where: str) -> None:
    def named(entry: Any) -> bool:
        return (isinstance(entry, dict) and isinstance(entry.get("key"), str)
                and isinstance(entry.get("title"), str))

    if not isinstance(entries, list) or not all(named(e) for e in entries):
        raise InvalidResults(f"{where} is not a list of {{key, title}} objects")


def _check_spec(spec: Any) -> None:
    """The table spec has the shape build_table and summary_figure read."""
    if not isinstance(spec, dict):
        raise InvalidResults(f"table is {_json_type(spec)}, not an object")
    _check_entries(spec.get("rows"), "table.rows")
    _check_entries(spec.get("columns"), "table.columns")
    entries = [("column", c) for c in spec["columns"]]
    entries += [("row", r) for r in spec["rows"] if "fmt" in r]  # a row's fmt formats numbers
    for kind, entry in entries:
        try:
            format(float(entry.get("scale", 1)), entry.get("fmt", ".4g"))
        except (TypeError, ValueError) as err:
            raise InvalidResults(f"table {kind} '{entry['title']}' has a bad fmt or "
                                 f"scale") from err
    paper = spec.get("paper") or []
    if not isinstance(paper, list) or not all(
            isinstance(p, dict) and isinstance(p.get("row"), dict)
            and isinstance(p.get("values"), dict)
            and all(v is None or _is_number(v) for v in p["values"].values()) for p in paper):
        raise InvalidResults("table.paper is not a list of {row, values: numbers} objects")
    if spec.get("figures") is not None and not isinstance(spec["figures"], dict):
        raise InvalidResults("table.figures is not an object {name: figure}")
    for figure in _figures(spec).values():
        _figure_keys(figure)
    if spec.get("claims") is not None:
        try:
            check_claims(spec["claims"], [r["title"] for r in spec["rows"]])
        except InvalidClaims as err:
            raise InvalidResults(str(err)) from err


def _figures(spec: dict[str, Any]) -> dict[str, Any]:
    """{file suffix: figure spec}: ``figure`` → <experiment>.png, ``figures: {name: …}`` →
    <experiment>_<name>.png."""
    named = {f"_{k}": v for k, v in (spec.get("figures") or {}).items()}
    return ({"": spec["figure"]} if spec.get("figure") else {}) | named


def _keys(value: Any) -> list[Any]:
    """A figure's hue or facet: one dotted key or a list of them (their values joined)."""
    return value if isinstance(value, list) and value else [value]


def _ys(figure: dict[str, Any]) -> list[Any]:
    """The y keys a figure draws, one panel each: ``[None]`` for a ``series`` figure."""
    if figure.get("series"):
        return [None]
    return figure["y"] if isinstance(figure["y"], list) else [figure["y"]]


def _figure_keys(figure: Any) -> tuple[list[str], list[str]]:
    """(the keys that must hold numbers, those that must hold single values), or
    InvalidResults. A figure draws ``y`` against ``x``, or (``series`` with ``labels``) one
    line through several keys, e.g. a metric per corruption severity; ``hue`` splits lines,
    ``facet`` (optional) splits rows of panels; each is a key or a list of keys."""
    if not isinstance(figure, dict):
        raise InvalidResults(f"table.figure is {_json_type(figure)}, not an object")
    if "series" in figure:
        numbers, labels = figure.get("series"), figure.get("labels")
        if not isinstance(numbers, list) or not isinstance(labels, list) \
                or len(labels) != len(numbers) or not numbers:
            raise InvalidResults("table.figure series and labels are not two lists of one length")
    else:
        ys = figure.get("y") if isinstance(figure.get("y"), list) else [figure.get("y")]
        numbers = [figure.get("x"), *ys]
    scalars = _keys(figure.get("hue")) + (_keys(figure["facet"]) if "facet" in figure else [])
    if not all(isinstance(k, str) for k in [*numbers, *scalars]):
        raise InvalidResults("table.figure lacks a string x, y, series, hue or facet key")
    return numbers, scalars


def check_results(res: Any) -> None:
    """The minimum every results.json must satisfy to enter a table (InvalidResults if not)."""
    if not isinstance(res, dict):
        raise InvalidResults(f"holds {_json_type(res)}, not an object")
    missing = [k for k in ("experiment", "seed", "metrics") if k not in res]
    if missing:
        raise InvalidResults(f"lacks {', '.join(missing)}")
    if not isinstance(res["experiment"], str) or not res["experiment"]:
        raise InvalidResults(f"experiment is {_json_type(res['experiment'])}, not a name")
    if not isinstance(res["seed"], int) or isinstance(res["seed"], bool):
        raise InvalidResults(f"seed is {_json_type(res['seed'])}, not an integer")
    if not isinstance(res["metrics"], dict):
        raise InvalidResults(f"metrics is {_json_type(res['metrics'])}, not an object")
    if res.get("table") is not None:
        _check_spec(res["table"])


def check_values(run: Run, spec: dict[str, Any]) -> None:
    """Every value ``spec`` reads from ``run`` can be averaged (numbers) or grouped (scalars)."""
    numbers = [c["key"] for c in spec["columns"]]
    scalars = [r["key"] for r in spec["rows"]]
    for figure in _figures(spec).values():
        fig_numbers, fig_scalars = _figure_keys(figure)
        numbers, scalars = numbers + fig_numbers, scalars + fig_scalars
    for key in numbers:
        value = get_path(run, key)
        if value is not None and not _is_number(value):
            raise InvalidResults(f"{key} is {_json_type(value)}, not a number")
    for key in scalars:
        value = get_path(run, key)
        if isinstance(value, (dict, list)):
            raise InvalidResults(f"{key} is {_json_type(value)}, not a single value")


def _warn(path: str | Path, problem: str) -> None:
    print(f"warning: skipping {path}: {problem}", file=sys.stderr)


def load_results(runs_dir: Path) -> list[Run]:
    """Every valid results.json under ``runs_dir``, in sorted path order; a warning for each
    file skipped. Hidden folders (``.staging-…``: a run being published or cut short) are not
    runs and are passed over silently."""
    runs = []
    for path in sorted(runs_dir.rglob("results.json")):
        if any(part.startswith(".") for part in path.relative_to(runs_dir).parts[:-1]):
            continue
        try:
            res = _read_json(path)
            check_results(res)
        except InvalidResults as err:
            _warn(path, str(err))
            continue
        if get_path(res, "settings.method.member") is not None:
            continue  # one member of an ensemble trained apart: its ensemble is the row
        res["_path"] = str(path)
        runs.append(res)
    return runs


def _setting(run: Run, spec: dict[str, Any]) -> tuple:
    return tuple(get_path(run, r["key"]) for r in spec["rows"])


def table_runs(runs: list[Run], spec: dict[str, Any]) -> list[Run]:
    """The runs of one experiment that enter its table: values ``spec`` can read, and one run
    per (setting, seed), the first in path order (``runs`` come sorted), so a copied run
    folder or a backup never counts as another seed."""
    kept: dict[tuple, Run] = {}
    for run in runs:
        try:
            check_values(run, spec)
        except InvalidResults as err:
            _warn(run["_path"], str(err))
            continue
        key = (_setting(run, spec), run["seed"])
        if key in kept:
            setting = ", ".join(f"{r['title']}={v}" for r, v in zip(spec["rows"], key[0],
                                                                     strict=True))
            _warn(run["_path"], f"seed {run['seed']} of ({setting}) is already in "
                                f"{kept[key]['_path']}, which is kept")
            continue
        kept[key] = run
    return list(kept.values())


# --- the spec's keys against the runs' keys ----------------------------------------------------

def _has_path(obj: Any, dotted: str) -> bool:
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
    for suffix, figure in _figures(spec).items():
        name = f"figure '{suffix[1:]}'" if suffix else "figure"
        numbers, scalars = _figure_keys(figure)
        keys += [(name, k, "the figure has no points for it") for k in numbers]
        keys += [(name, k, "its lines are not split by it") for k in scalars]
    return keys


def missing_keys(exp: str, spec: dict[str, Any], runs: list[Run]) -> list[str]:
    """One warning per key of the spec that no run has, with the closest keys the runs have
    (the table is still written: those cells show "–")."""
    absent = [(where, key, effect) for where, key, effect in _spec_keys(spec)
              if not any(_has_path(run, key) for run in runs)]
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

def _sort_key(value: Any) -> tuple:
    return (0, value, "") if _is_number(value) else (1, 0, str(value))


def _show_key(value: Any, fmt: str | None = None) -> str:
    """A row key (or a figure's hue) as the table shows it: the row's fmt for numbers, else
    integers as they are and other numbers compactly (``.4g``: -2.0 → -2, 0.03 → 0.03)."""
    if value is None:
        return MISSING
    if not _is_number(value):
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


def build_table(runs: list[Run], spec: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(display table with formatted cells, numeric table with mean/std columns): one row per
    setting (the row keys' values, sorted: numbers first, in order), each column's mean, sample
    std (ddof=1) and count over the setting's runs, and ``seeds``, its distinct seeds."""
    rows, cols = spec["rows"], spec["columns"]
    settings = [_setting(run, spec) for run in runs]
    order = sorted(set(settings), key=lambda s: tuple(_sort_key(v) for v in s))
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

    shown = pd.DataFrame({r["title"]: [_show_key(s[i], r.get("fmt")) for s in order]
                          for i, r in enumerate(rows)})
    numeric = pd.DataFrame({r["title"]: [MISSING if s[i] is None else
                                         format(s[i], r["fmt"]) if "fmt" in r
                                         and _is_number(s[i]) else s[i] for s in order]
                            for i, r in enumerate(rows)})
    for j, c in enumerate(cols):
        title, fmt = c["title"], c.get("fmt", ".4g")
        mean, std, n = (stats[f"c{j}_{k}"].to_numpy() for k in ("mean", "std", "count"))
        shown[title] = [_cell(m, s, k, fmt) for m, s, k in zip(mean, std, n, strict=True)]
        numeric[f"{title} mean"], numeric[f"{title} std"] = mean, std
        if title in papered:
            values = [ref.get(title) for ref in refs]
            shown[f"{title} (paper)"] = [MISSING if v is None else format(v, fmt)
                                         for v in values]
            numeric[f"{title} (paper)"] = pd.Series(values, dtype=float)
    shown["seeds"] = numeric["seeds"] = stats["seeds"].to_numpy()
    return shown, numeric


# --- LaTeX -------------------------------------------------------------------------------------

# Text-mode escapes for LaTeX's special characters (and those OT1 fonts print as others).
_TEXT = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
         "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
         "<": r"\textless{}", ">": r"\textgreater{}", "|": r"\textbar{}",
         "–": "--", "—": "---", "…": r"\ldots{}", "‘": "`", "’": "'", "“": "``", "”": "''",
         "\u00a0": "~", "\u2009": r"\,", "\u202f": r"\,"}
_GREEK = {"α": "alpha", "β": "beta", "γ": "gamma", "δ": "delta", "ε": "varepsilon",
          "ϵ": "epsilon", "ζ": "zeta", "η": "eta", "θ": "theta", "ϑ": "vartheta", "ι": "iota",
          "κ": "kappa", "λ": "lambda", "μ": "mu", "µ": "mu", "ν": "nu", "ξ": "xi", "π": "pi",
          "ϖ": "varpi", "ρ": "rho", "ϱ": "varrho", "σ": "sigma", "ς": "varsigma", "τ": "tau",
          "υ": "upsilon", "φ": "varphi", "ϕ": "phi", "χ": "chi", "ψ": "psi", "ω": "omega",
          "Γ": "Gamma", "Δ": "Delta", "Θ": "Theta", "Λ": "Lambda", "Ξ": "Xi", "Π": "Pi",
          "Σ": "Sigma", "Υ": "Upsilon", "Φ": "Phi", "Ψ": "Psi", "Ω": "Omega"}
# Math-mode pieces: symbols, Greek letters, and the Greek capitals that look Latin
_MATH = {"±": r"\pm", "∓": r"\mp", "×": r"\times", "·": r"\cdot", "−": "-", "≈": r"\approx",
         "≤": r"\leq", "≥": r"\geq", "≠": r"\neq", "→": r"\rightarrow", "←": r"\leftarrow",
         "↔": r"\leftrightarrow", "⇒": r"\Rightarrow", "∞": r"\infty", "‖": r"\|",
         "∈": r"\in", "∼": r"\sim", "∝": r"\propto", "√": r"\surd", "∑": r"\sum",
         "∏": r"\prod", "∂": r"\partial", "∇": r"\nabla", "°": r"^\circ", "′": r"\prime",
         "¬": r"\neg", "«": r"\ll", "»": r"\gg", "✓": r"\surd", "✗": r"\times",
         "⊤": r"\top", "ℓ": r"\ell"} | {k: "\\" + v for k, v in _GREEK.items()} | {
    g: rf"\mathrm{{{latin}}}" for g, latin in zip("ΑΒΕΖΗΙΚΜΝΟΡΤΧ", "ABEZHIKMNOPTX", strict=True)}
_SUPER = dict(zip("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿⁱ", "0123456789+-=()ni", strict=True)) | {"ᵀ": r"\top"}
_SUB = dict(zip("₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎ₐₑₒₓₕₖₗₘₙₚₛₜᵢⱼ", "0123456789+-=()aeoxhklmnpstij", strict=True))
_SCRIPT = re.compile(f"([{re.escape(''.join(_SUPER))}]+)|([{re.escape(''.join(_SUB))}]+)|(.)", re.S)
_MINUS = re.compile(r"(?<![\w.])-(?=\.?\d)")  # "-2", "(-0.5": not "1e-05", "x-1" or "--"
# Latin-1 letters pdflatex's default input reads as they are, but for these
_NO_LATIN1 = set("ÐÞðþ\u00ad")


def latex_text(text: str, unknown: set[str] | None = None) -> str:
    """``text`` for LaTeX's text mode: specials escaped, Unicode as LaTeX (runs of math pieces
    share one ``$…$``: ``ρ₀`` → ``$\\rho_{0}$``, ``10⁻²`` → ``10$^{-2}$``, a leading ``-2`` →
    ``$-$2``). A character LaTeX
    cannot print without extra packages becomes ``?`` and is added to ``unknown``."""
    out: list[str] = []
    math: list[str] = []

    def flush() -> None:
        if math:
            out.append("$" + "".join(math) + "$")
            math.clear()

    text = _MINUS.sub("−", text)  # a number's sign, typeset as a minus
    for sup, sub, char in _SCRIPT.findall(text):
        if sup or sub:
            math.append(("^{" + "".join(_SUPER[c] for c in sup) if sup else
                         "_{" + "".join(_SUB[c] for c in sub)) + "}")
        elif char in _MATH:
            math.append(_MATH[char])
        else:
            flush()
            if char in _TEXT:
                out.append(_TEXT[char])
            elif char.isascii() or ("\u00a0" <= char <= "\u00ff" and char not in _NO_LATIN1):
                out.append(char)
            else:
                if unknown is not None:
                    unknown.add(char)
                out.append("?")
    flush()
    return "".join(out)


def to_latex(shown: pd.DataFrame, title: str, label: str, keys: int,
             unknown: set[str] | None = None) -> str:
    """The display table as a booktabs LaTeX table (``Styler.to_latex``), every header, cell
    and the caption through :func:`latex_text`; the ``keys`` row-key columns left-aligned,
    the numbers right."""
    from pandas.io.formats.style import Styler

    body = shown.map(lambda v: latex_text(str(v), unknown))
    body.columns = [latex_text(str(c), unknown) for c in shown.columns]
    return Styler(body).hide(axis="index").to_latex(
        column_format="l" * keys + "r" * (len(shown.columns) - keys), hrules=True,
        caption=latex_text(title, unknown), label=label, position_float="centering")


# --- figures -----------------------------------------------------------------------------------

def _label(run: Run, keys: Any) -> tuple[tuple, str]:
    """(sort key, label) of a run's hue or facet: its values, joined by ", " for several keys."""
    values = [get_path(run, k) for k in _keys(keys)]
    return tuple(_sort_key(v) for v in values), ", ".join(_show_key(v) for v in values)


def figure_points(runs: list[Run], figure: dict[str, Any]) -> pd.DataFrame:
    """The points a figure draws, in drawing order: one row per (facet, hue, y key, x) with
    the mean, the sample std (ddof=1; NaN with one value) and the count of the runs' values
    there (runs without the value are left out). x is the run's ``x`` value, or the label of
    a ``series`` key; ``y`` is the position of the y key (0 for a series)."""
    series = figure.get("series")
    ys = _ys(figure)
    hues = [_label(run, figure["hue"]) for run in runs]
    facets = [_label(run, figure["facet"]) if figure.get("facet") else ((), "") for run in runs]
    hue_rank = {h: i for i, h in enumerate(sorted(set(hues)))}
    facet_rank = {f: i for i, f in enumerate(sorted(set(facets)))}
    records = []
    for run, hue, facet in zip(runs, hues, facets, strict=True):
        if series:  # x: the key's label, in the order the spec lists them
            points = [(i, label, 0, get_path(run, key)) for i, (label, key)
                      in enumerate(zip(figure["labels"], series, strict=True))]
        else:
            x = get_path(run, figure["x"])
            points = [(x, x, j, get_path(run, y)) for j, y in enumerate(ys)]
        records += [(facet_rank[facet], facet[1], hue_rank[hue], hue[1], j, order, x, value)
                    for order, x, j, value in points if order is not None and value is not None]
    frame = pd.DataFrame(records, columns=["facet_rank", "facet", "hue_rank", "hue", "y",
                                           "order", "x", "value"])
    frame["value"] = frame["value"].astype(float)
    return (frame.groupby(["facet_rank", "hue_rank", "y", "order"], sort=True)
            .agg(facet=("facet", "first"), hue=("hue", "first"), x=("x", "first"),
                 mean=("value", "mean"), std=("value", "std"), count=("value", "count"))
            .reset_index())


def summary_figure(runs: list[Run], figure: dict[str, Any], path: Path, title: str) -> Path:
    """Mean over seeds (error bars: sample std, ddof=1; none with one seed), one line per hue
    value, one row of panels per facet value: y against x per y key (e.g. NLL vs parameters),
    or one ``series`` of keys against its ``labels`` (e.g. accuracy per corruption severity).
    The PNG carries no software version, so the same runs give the same bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = figure.get("series")
    ys = _ys(figure)
    points = figure_points(runs, figure)
    facets = sorted({_label(run, figure["facet"]) for run in runs}) if figure.get("facet") \
        else [((), "")]
    fig, axes = plt.subplots(len(facets), len(ys), figsize=(5 * len(ys), 3.8 * len(facets)),
                             squeeze=False)
    for row, (_, facet) in zip(axes, facets, strict=True):
        for j, (ax, ykey) in enumerate(zip(row, ys, strict=True)):
            panel = points[(points["facet"] == facet) & (points["y"] == j)]
            for _, line in panel.groupby("hue_rank", sort=True):
                ax.errorbar(line["x"].tolist(), line["mean"].tolist(),
                            yerr=line["std"].fillna(0.0).tolist(), marker="o", ms=4,
                            capsize=2, label=line["hue"].iloc[0])
            ax.set_xscale(figure.get("xscale", "linear"))
            ax.set_xlabel(figure.get("xlabel") or ("" if series else figure["x"].split(".")[-1]))
            ax.set_ylabel(figure.get("ylabel") or (ykey or "").split(".", 1)[-1])
            if figure.get("facet"):
                names = ", ".join(k.split(".")[-1] for k in _keys(figure["facet"]))
                ax.set_title(f"{names} = {facet}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, title=", ".join(k.split(".")[-1]
                                                      for k in _keys(figure["hue"])),
                          title_fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)
    return path


# --- writing -----------------------------------------------------------------------------------

def tabled_experiments(runs_dir: Path) -> dict[str, tuple[dict[str, Any], list[Run]]]:
    """{experiment: (table spec, the runs that enter the table)} for every experiment with at
    least one valid run carrying a table spec; the spec is the last run's in path order."""
    by_exp: dict[str, list[Run]] = defaultdict(list)
    for run in load_results(runs_dir):
        if run.get("table"):
            by_exp[run["experiment"]].append(run)
    tabled = {}
    for exp, runs in sorted(by_exp.items()):
        spec = runs[-1]["table"]
        if kept := table_runs(runs, spec):
            tabled[exp] = (spec, kept)
    return tabled


def command_file(exp: str, runs_dir: Path, out_dir: Path, runs: list[Run],
                 files: list[str]) -> str:
    """``<experiment>.command``: the shell command that rebuilds exactly these files (paths
    as given, relative to the folder it ran in) and the results.json files that went in."""
    command = shlex.join(["uqbench-tables", "--runs", str(runs_dir), "--out", str(out_dir),
                          "--experiment", exp])
    paths = sorted(Path(run["_path"]).relative_to(runs_dir).as_posix() for run in runs)
    return (f"# {', '.join(files)} were made by (run from the folder the paths are "
            f"relative to):\n{command}\n"
            f"# from {len(paths)} results.json under {runs_dir}:\n"
            + "".join(f"#   {p}\n" for p in paths))


def write_tables(runs_dir: Path, out_dir: Path, only: str | list[str] | None = None,
                 publish: Callable[..., None] | None = None) -> dict[str, Path]:
    """Write every experiment's table (or those named in ``only``, each of which must have
    valid results); return {experiment: markdown path}. The runs folder is read once.
    ``publish(exp, frames, figures, command)``, if given, gets each experiment's tables
    ({"table": as shown, "numbers": means and stds}), figure paths and rebuild command."""
    by_exp = tabled_experiments(runs_dir)
    if only is not None:
        wanted = [only] if isinstance(only, str) else list(only)
        missing = [e for e in wanted if e not in by_exp]
        if missing:
            known = ", ".join(sorted(by_exp)) or "none"
            raise SystemExit(f"error: no valid results with a table for experiment "
                             f"'{', '.join(missing)}' under {runs_dir} (experiments found: "
                             f"{known})")
        by_exp = {e: by_exp[e] for e in wanted}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for exp, (spec, runs) in sorted(by_exp.items()):
        for warning in missing_keys(exp, spec, runs):
            print(warning, file=sys.stderr)
        shown, numeric = build_table(runs, spec)
        title = spec.get("title", exp)
        # disable_numparse keeps our formatting ("95.0", "0.20") instead of re-parsing numbers
        md = f"## {title}\n\n" + shown.to_markdown(index=False, disable_numparse=True) + "\n"
        (out_dir / f"{exp}.md").write_text(md)
        unknown: set[str] = set()
        (out_dir / f"{exp}.tex").write_text(
            to_latex(shown, title, f"tab:{exp}", len(spec["rows"]), unknown))
        for char in sorted(unknown):
            print(f"warning: {exp}.tex: no LaTeX for {char!r} (U+{ord(char):04X} "
                  f"{unicodedata.name(char, 'unnamed')}); written as '?'", file=sys.stderr)
        numeric.to_csv(out_dir / f"{exp}.csv", index=False)
        files = [f"{exp}.md", f"{exp}.tex", f"{exp}.csv"]
        for suffix, figure in _figures(spec).items():
            files.append(summary_figure(runs, figure, out_dir / f"{exp}{suffix}.png",
                                        title).name)
        if spec.get("claims"):
            files += [p.name for p in write_claims(runs, spec, out_dir, exp)]
        else:  # a claims file left from an older spec would pass for this one's
            for stale in out_dir.glob(f"{exp}_claims.*"):
                stale.unlink()
        command = command_file(exp, runs_dir, out_dir, runs, files)
        (out_dir / f"{exp}.command").write_text(command)
        if publish is not None:
            publish(exp, {"table": shown, "numbers": numeric},
                    [out_dir / f for f in files if f.endswith(".png")], command)
        written[exp] = out_dir / f"{exp}.md"
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="uqbench-tables",
        description="Build each experiment's table (Markdown, LaTeX, CSV), its figures and "
                    "the command that made them from runs/**/results.json")
    parser.add_argument("--runs", type=Path, default=Path(os.environ.get("UQBENCH_RUNS", "runs")),
                        help="runs folder ($UQBENCH_RUNS, else runs/)")
    parser.add_argument("--out", type=Path, default=Path("tables"), help="output folder (tables/)")
    parser.add_argument("--experiment", default=None, help="only this experiment")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
    parser.add_argument("--wandb", action="store_true",
                        help="also log each table and its figures to W&B, one run per "
                             "experiment (files under <runs>/<experiment>/wandb)")
    parser.add_argument("--wandb-project", default="uqbench", help="W&B project (uqbench)")
    parser.add_argument("--wandb-entity", default=None, help="W&B user or team")
    parser.add_argument("--wandb-mode", default=os.environ.get("WANDB_MODE", "offline"),
                        help="online | offline | disabled ($WANDB_MODE, else offline)")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"error: runs folder {args.runs} does not exist; run an experiment "
                         f"first (e.g. `make demo`) or pass --runs")
    publish = _wandb_publisher(args) if args.wandb else None
    written = write_tables(args.runs, args.out, args.experiment, publish)
    if not written:
        print(f"no valid results with a table spec under {args.runs}", file=sys.stderr)
    for exp, path in written.items():
        claims = path.with_name(f"{exp}_claims.md")
        if not args.quiet:
            print(path.read_text())
            if claims.exists():
                print(claims.read_text())
        extras = [p.name for p in sorted(path.parent.glob(f"{exp}.*")) if p != path]
        print(f"→ {path} (+ {', '.join(extras)})\n")


def _wandb_publisher(args: argparse.Namespace) -> Callable[..., None]:
    """``publish`` for write_tables: each experiment's tables as one W&B ``tables`` run."""
    from uqbench.records.loggers import WandbLogger, log_experiment_table

    def make() -> WandbLogger:
        try:
            return WandbLogger(project=args.wandb_project, entity=args.wandb_entity,
                               mode=args.wandb_mode)
        except ValueError as err:  # the same checks as logger=wandb, with the flags' names
            message = str(err).replace("logger.mode", "--wandb-mode").replace(
                "logger.project", "--wandb-project").replace("logger.entity", "--wandb-entity")
            raise SystemExit(f"error: {message}") from None

    make()  # bad settings fail before any table is built

    def publish(exp: str, frames: dict[str, pd.DataFrame], figures: list[Path],
                command: str) -> None:
        log_experiment_table(make(), args.runs / exp, exp, frames, figures, command)
        print(f"W&B: {exp}'s tables → {args.runs / exp / 'wandb'}", file=sys.stderr)

    return publish


if __name__ == "__main__":
    main()
