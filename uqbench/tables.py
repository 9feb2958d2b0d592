"""Results → tables (`uqbench-tables`, `make tables`).

(Longer than uqbench's other modules on purpose: it validates every results file it reads —
they come from any version and any user — and builds the tables and their figures from the same
validated runs; it imports nothing else of uqbench but :mod:`uqbench.claims`.)

Scans ``<runs_dir>/**/results.json`` and, for every experiment whose runs carry a ``table`` spec
(declared in ``conf/experiment/<name>.yaml`` and copied into each results.json), writes
``<out>/<experiment>.md``, ``.tex`` and ``.csv``: one row per combination of the row keys, each
cell the mean ± std over seeds. The spec::

    table:
      title: "…"
      rows:    [{key: settings.backbone.width, title: width}, …]     # dotted paths
      columns: [{key: metrics.test/nll, title: test NLL, fmt: ".3f", scale: 1}, …]
      paper:   [{row: {method: sve}, values: {ACC: 95.4}}, …]        # optional reference numbers
      figure:  {x: params.trainable, y: [metrics.test/nll], hue: settings.method.variance}
      claims:  [{claim: "…", kind: greater, key: metrics.test/nll, a: {…}, b: {…}}, …]

A spec with ``claims`` also gets ``<experiment>_claims.md``/``.csv``: each claim of the paper,
the measurement that tests it and whether it holds (:mod:`uqbench.claims`).

Paper values are matched on row titles and shown in a "<column> (paper)" column beside ours.
Tables read only results.json files, never a logger.

Which files count. A results.json is used when it is UTF-8 JSON holding an object with
``experiment`` (a non-empty string), ``seed`` (an integer) and ``metrics`` (an object, empty for
the parameter job), and, when it has a ``table``, a spec of the shape above. Within an
experiment, every value its table reads must be a number or absent (columns, figure x and y)
or a single value (rows, figure hue). Any other file is skipped with one warning line on stderr
naming it and the problem, and every table is still written from the valid files.

Ensemble members. A run that trained one member of a Deep Ensemble as its own job
(``settings.method.member`` set) is not a row: its ensemble is, once ``uqbench-combine`` has
written it (it would otherwise pass for the ensemble in the ensemble's row).

Seeds. A cell aggregates one result per distinct seed, and ``seeds`` counts distinct seeds.
When two files hold the same seed of the same setting (a copied run folder, a backup), the one
first in sorted path order is kept, so the choice does not depend on file times, and a warning
names both files.

Std. A table cell is mean ± the sample standard deviation over seeds (``ddof=1``), the mean
alone when there is one seed or no spread. The figure's error bars are ``np.std`` over seeds
(population std, ``ddof=0``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from uqbench.claims import InvalidClaims, check_claims, get_path, write_claims

Run = dict[str, Any]


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


def _figure_keys(figure: Any) -> tuple[list[str], list[str]]:
    """(the keys that must hold numbers, those that must hold single values), or
    InvalidResults. A figure draws ``y`` against ``x``, or (``series`` with ``labels``) one
    line through several keys, e.g. a metric per corruption severity; ``hue`` splits lines,
    ``facet`` (optional) splits rows of panels."""
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
    scalars = [figure.get("hue")] + ([figure["facet"]] if "facet" in figure else [])
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


def _cell(values: list[float], fmt: str, scale: float) -> tuple[str, float, float]:
    vals = np.array([v * scale for v in values if v is not None and not math.isnan(v)])
    if len(vals) == 0:
        return "–", math.nan, math.nan
    mean = float(vals.mean())
    std = float(vals.std(ddof=1)) if len(vals) > 1 else math.nan
    text = format(mean, fmt)
    if len(vals) > 1 and std > 0:
        text += f" ± {format(std, fmt)}"
    return text, mean, std


def _sort_key(value: Any) -> tuple:
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def build_table(runs: list[dict[str, Any]], spec: dict[str, Any]) -> tuple[pd.DataFrame,
                                                                             pd.DataFrame]:
    """(display table with formatted cells, numeric table with mean/std columns)."""
    rows, cols = spec["rows"], spec["columns"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        groups[tuple(get_path(run, r["key"]) for r in rows)].append(run)
    paper = spec.get("paper") or []
    shown, numeric = [], []
    for key in sorted(groups, key=lambda k: tuple(_sort_key(v) for v in k)):
        members = groups[key]
        disp = {r["title"]: ("–" if v is None else
                             format(v, r["fmt"]) if "fmt" in r and _is_number(v) else v)
                for r, v in zip(rows, key, strict=True)}
        num = dict(disp)
        labels = {r["title"]: str(v) for r, v in zip(rows, key, strict=True)}
        ref = next((p["values"] for p in paper
                    if all(str(v) == labels.get(k) for k, v in p["row"].items())), {})
        for c in cols:
            text, mean, std = _cell([get_path(m, c["key"]) for m in members],
                                    c.get("fmt", ".4g"), float(c.get("scale", 1)))
            disp[c["title"]] = text
            num[f"{c['title']} mean"], num[f"{c['title']} std"] = mean, std
            if any(c["title"] in p["values"] for p in paper):
                value = ref.get(c["title"])
                disp[f"{c['title']} (paper)"] = ("–" if value is None
                                                  else format(value, c.get("fmt", ".4g")))
                num[f"{c['title']} (paper)"] = value
        disp["seeds"] = num["seeds"] = len(members)
        shown.append(disp)
        numeric.append(num)
    return pd.DataFrame(shown), pd.DataFrame(numeric)


def _points(runs: list[dict[str, Any]], xs: list[Any], ykeys: list[str]
            ) -> tuple[list[Any], list[float], list[float]]:
    """Mean and std over runs at each x (runs without the value are left out)."""
    kept, means, stds = [], [], []
    for x, ykey in zip(xs, ykeys, strict=True):
        values = [get_path(r, ykey) for r in runs if get_path(r, ykey) is not None]
        if values:
            kept.append(x)
            means.append(float(np.mean(values)))
            stds.append(float(np.std(values)))
    return kept, means, stds


def summary_figure(runs: list[dict[str, Any]], spec: dict[str, Any], path: Path,
                   title: str) -> Path:
    """Mean over seeds (error bars: std, ddof = 0), one line per hue value, one row of panels
    per facet value: y against x per y key (e.g. NLL vs parameters), or one ``series`` of keys
    against its ``labels`` (e.g. accuracy per corruption severity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = spec.get("series")
    ys = [None] if series else (spec["y"] if isinstance(spec["y"], list) else [spec["y"]])
    facet = spec.get("facet")
    facets = sorted({str(get_path(r, facet)) for r in runs}) if facet else [None]
    hues = sorted({str(get_path(r, spec["hue"])) for r in runs})
    fig, axes = plt.subplots(len(facets), len(ys), figsize=(5 * len(ys), 3.8 * len(facets)),
                             squeeze=False)
    for row, facet_value in zip(axes, facets, strict=True):
        for ax, ykey in zip(row, ys, strict=True):
            for hue in hues:
                sub = [r for r in runs if str(get_path(r, spec["hue"])) == hue
                       and (facet is None or str(get_path(r, facet)) == facet_value)]
                if series:
                    xs, means, stds = _points(sub, list(spec["labels"]), list(series))
                else:  # group by x value, each point the mean over the runs at that x
                    at = sorted({get_path(r, spec["x"]) for r in sub} - {None})
                    groups = [[r for r in sub if get_path(r, spec["x"]) == x] for x in at]
                    pts = [_points(g, [x], [ykey]) for x, g in zip(at, groups, strict=True)]
                    xs = [x for p in pts for x in p[0]]
                    means = [m for p in pts for m in p[1]]
                    stds = [d for p in pts for d in p[2]]
                if xs:
                    ax.errorbar(xs, means, yerr=stds, marker="o", ms=4, capsize=2, label=hue)
            ax.set_xscale(spec.get("xscale", "linear"))
            ax.set_xlabel(spec.get("xlabel") or (spec["x"].split(".")[-1] if not series
                                                 else ""))
            ax.set_ylabel(spec.get("ylabel") or (ykey or "").split(".", 1)[-1])
            if facet is not None:
                ax.set_title(f"{facet.split('.')[-1]} = {facet_value}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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


def write_tables(runs_dir: Path, out_dir: Path, only: str | list[str] | None = None
                 ) -> dict[str, Path]:
    """Write every experiment's table (or those named in ``only``, each of which must have
    valid results); return {experiment: markdown path}. The runs folder is read once."""
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
        shown, numeric = build_table(runs, spec)
        title = spec.get("title", exp)
        # disable_numparse keeps our formatting ("95.0", "0.20") instead of re-parsing numbers
        md = f"## {title}\n\n" + shown.to_markdown(index=False, disable_numparse=True) + "\n"
        (out_dir / f"{exp}.md").write_text(md)
        (out_dir / f"{exp}.tex").write_text(
            shown.to_latex(index=False, caption=title, label=f"tab:{exp}", escape=True))
        numeric.to_csv(out_dir / f"{exp}.csv", index=False)
        for suffix, figure in _figures(spec).items():
            summary_figure(runs, figure, out_dir / f"{exp}{suffix}.png", title)
        if spec.get("claims"):
            write_claims(runs, spec, out_dir, exp)
        else:  # a claims file left from an older spec would pass for this one's
            for stale in out_dir.glob(f"{exp}_claims.*"):
                stale.unlink()
        written[exp] = out_dir / f"{exp}.md"
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="uqbench-tables",
        description="Build each experiment's table (Markdown, LaTeX, CSV) "
                    "from runs/**/results.json")
    parser.add_argument("--runs", type=Path, default=Path(os.environ.get("UQBENCH_RUNS", "runs")),
                        help="runs folder ($UQBENCH_RUNS, else runs/)")
    parser.add_argument("--out", type=Path, default=Path("tables"), help="output folder (tables/)")
    parser.add_argument("--experiment", default=None, help="only this experiment")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"error: runs folder {args.runs} does not exist; run an experiment "
                         f"first (e.g. `make demo`) or pass --runs")
    written = write_tables(args.runs, args.out, args.experiment)
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


if __name__ == "__main__":
    main()
