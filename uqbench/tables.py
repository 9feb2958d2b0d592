"""Results → tables (`uqbench-tables`, `make tables`).

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

Paper values are matched on row titles and shown in a "<column> (paper)" column beside ours.
Tables read only results.json files, never a logger.

Which files count. A results.json is used when it is UTF-8 JSON holding an object with
``experiment`` (a non-empty string), ``seed`` (an integer) and ``metrics`` (an object, empty for
the parameter job), and, when it has a ``table``, a spec of the shape above. Within an
experiment, every value its table reads must be a number or absent (columns, figure x and y)
or a single value (rows, figure hue). Any other file is skipped with one warning line on stderr
naming it and the problem, and every table is still written from the valid files.

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


def get_path(obj: dict[str, Any], dotted: str) -> Any:
    """Value at a dotted path; a metric key such as ``metrics.test/nll`` keeps its slash."""
    cur: Any = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


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
    for col in spec["columns"]:
        try:
            format(float(col.get("scale", 1)), col.get("fmt", ".4g"))
        except (TypeError, ValueError) as err:
            raise InvalidResults(f"table column '{col['title']}' has a bad fmt or scale") from err
    paper = spec.get("paper") or []
    if not isinstance(paper, list) or not all(
            isinstance(p, dict) and isinstance(p.get("row"), dict)
            and isinstance(p.get("values"), dict)
            and all(v is None or _is_number(v) for v in p["values"].values()) for p in paper):
        raise InvalidResults("table.paper is not a list of {row, values: numbers} objects")
    if spec.get("figure"):
        _figure_keys(spec["figure"])


def _figure_keys(figure: Any) -> tuple[list[str], str]:
    """(the x and y keys, which must hold numbers; the hue key), or InvalidResults."""
    if not isinstance(figure, dict):
        raise InvalidResults(f"table.figure is {_json_type(figure)}, not an object")
    ys = figure.get("y") if isinstance(figure.get("y"), list) else [figure.get("y")]
    xy, hue = [figure.get("x"), *ys], figure.get("hue")
    if not ys or not all(isinstance(k, str) for k in [*xy, hue]):
        raise InvalidResults("table.figure lacks a string x, y or hue key")
    return xy, hue


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
    if spec.get("figure"):
        xy, hue = _figure_keys(spec["figure"])
        numbers, scalars = numbers + xy, scalars + [hue]
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
        disp = {r["title"]: v for r, v in zip(rows, key, strict=True)}
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


def summary_figure(runs: list[dict[str, Any]], spec: dict[str, Any], path: Path,
                   title: str) -> Path:
    """Per y key: mean over seeds vs x, one line per hue value (e.g. NLL vs parameters)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ys = spec["y"] if isinstance(spec["y"], list) else [spec["y"]]
    fig, axes = plt.subplots(1, len(ys), figsize=(5 * len(ys), 3.8), squeeze=False)
    hues = sorted({str(get_path(r, spec["hue"])) for r in runs})
    for ax, ykey in zip(axes[0], ys, strict=True):
        for hue in hues:
            pts: dict[float, list[float]] = defaultdict(list)
            for r in runs:
                # a run without x or y has no point to draw
                if (str(get_path(r, spec["hue"])) == hue and get_path(r, ykey) is not None
                        and get_path(r, spec["x"]) is not None):
                    pts[get_path(r, spec["x"])].append(get_path(r, ykey))
            xs = sorted(pts)
            means = [np.mean(pts[x]) for x in xs]
            stds = [np.std(pts[x]) for x in xs]
            ax.errorbar(xs, means, yerr=stds, marker="o", ms=4, capsize=2, label=hue)
        ax.set_xscale(spec.get("xscale", "linear"))
        ax.set_xlabel(spec["x"].split(".")[-1])
        ax.set_ylabel(ykey.split(".", 1)[-1])
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
        if spec.get("figure"):
            summary_figure(runs, spec["figure"], out_dir / f"{exp}.png", title)
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
        if not args.quiet:
            print(path.read_text())
        extras = [p.name for p in sorted(path.parent.glob(f"{exp}.*")) if p != path]
        print(f"→ {path} (+ {', '.join(extras)})\n")


if __name__ == "__main__":
    main()
