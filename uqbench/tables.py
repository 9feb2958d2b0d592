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


def load_results(runs_dir: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(runs_dir.rglob("results.json")):
        try:
            res = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            print(f"warning: skipping unreadable {path}: {err}", file=sys.stderr)
            continue
        res["_path"] = str(path)
        runs.append(res)
    return runs


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
                if str(get_path(r, spec["hue"])) == hue and get_path(r, ykey) is not None:
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


def write_tables(runs_dir: Path, out_dir: Path, only: str | None = None) -> dict[str, Path]:
    """Write every experiment's table; return {experiment: markdown path}."""
    by_exp: dict[str, list[dict]] = defaultdict(list)
    for run in load_results(runs_dir):
        if run.get("table"):
            by_exp[run.get("experiment", "default")].append(run)
    if only is not None:
        if only not in by_exp:
            known = ", ".join(sorted(by_exp)) or "none"
            raise SystemExit(f"error: no results with a table for experiment '{only}' under "
                             f"{runs_dir} (experiments found: {known})")
        by_exp = {only: by_exp[only]}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for exp, runs in sorted(by_exp.items()):
        spec = runs[-1]["table"]
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
        print(f"no results with a table spec under {args.runs}", file=sys.stderr)
    for exp, path in written.items():
        if not args.quiet:
            print(path.read_text())
        extras = [p.name for p in sorted(path.parent.glob(f"{exp}.*")) if p != path]
        print(f"→ {path} (+ {', '.join(extras)})\n")


if __name__ == "__main__":
    main()
