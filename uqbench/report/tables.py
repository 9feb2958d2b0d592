"""Results → tables (`uqbench-tables`, `make tables`).

Scans ``<runs_dir>/**/results.json`` and, for every experiment with a table, writes
``<out>/<experiment>.md``, ``.tex``, ``.csv`` and ``.command``: one row per combination of the
row keys, each cell the mean ± std over seeds. The table's layout is the ``table:`` of the
experiment's config, ``conf/experiment/<name>.yaml``, read when the tables are built (editing a
title or a column redraws finished runs; :mod:`uqbench.report.table_layout`); an experiment
without a config keeps the spec its runs copied into results.json. The spec::

    table:
      title: "…"
      rows:    [{key: settings.backbone.width, title: width, fmt: ".0f"}, …]  # dotted paths
      columns: [{key: metrics.test/nll, title: test NLL, fmt: ".3f", scale: 1}, …]
               # {key: …, title: …, within: 2}: a verdict, ✓ when every run has |value| ≤ 2
      paper:   [{row: {method: sve}, values: {ACC: 95.4}}, …]        # optional reference numbers
      figure:  {x: params.trainable, y: [metrics.test/nll], hue: settings.method.variance,
                facet: settings.backbone.depth, xscale: log}   # hue, facet: a key or a list
      figures: {severity: {series: [key, …], labels: [0, …], hue: method}}   # <exp>_severity.png
      claims:  [{claim: "…", kind: greater, key: metrics.test/nll, a: {…}, b: {…}}, …]

A spec with ``claims`` also gets ``<experiment>_claims.md``/``.csv``: each claim of the paper,
the measurement that tests it and whether it holds (:mod:`uqbench.report.claims`).

A verdict column (``within: b``) judges each run's value by the rule |value| ≤ b and shows
✓ (every run of the row), ✗ (none) or "k/n ✓"; the CSV holds the same text.

Paper values are matched on row titles and shown in a "<column> (paper)" column beside ours.
Tables read only results.json files, never a logger.

Which files count, ensemble members and seeds: :mod:`uqbench.report.validation`. A key of the
spec that no run of the experiment has gets one warning naming the experiment, the key and the
closest keys the runs do have; its cells show "–" and the figure has no points for it.

Std. One convention everywhere: the sample standard deviation over seeds (``ddof=1``), in the
table cells (mean ± std; the mean alone when there is one seed or no spread), the CSV's
``<column> std`` (empty with one seed) and the figures' error bars (none with one seed).

Edge choices. A row whose runs used a recipe setting chosen at the edge of its grid
(results.json's ``recipe``) is marked "†" after its last row key, with the footnote
"† chosen at the edge of its grid: <key>" under the Markdown table (in the LaTeX caption).

Output. The Markdown and the LaTeX show the same text: numbers in the column's ``fmt`` (default
``.4g``), numeric row keys in the row's ``fmt`` (integers as they are, other numbers ``.4g``),
"–" for a missing value. The LaTeX is a booktabs table (``\\usepackage{booktabs}``) written by
pandas' ``Styler.to_latex`` that compiles with pdflatex (:mod:`uqbench.report.latex`).
``<experiment>.command`` holds the command that rebuilds exactly these files and lists the
results.json files that went in. Building twice from the same runs writes
the same bytes (the figures carry no date or software version).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import unicodedata
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from uqbench.errors import user_errors
from uqbench.report.building import build_table, edge_note, missing_keys
from uqbench.report.claims import (
    InvalidClaims,
    markdown_table,
    multiplicity_sentence,
    write_claims,
)
from uqbench.report.figures import summary_figure
from uqbench.report.latex import to_latex
from uqbench.report.levels import write_levels
from uqbench.report.table_layout import layout
from uqbench.report.validation import Run, figure_specs, load_results, table_runs

# --- writing -----------------------------------------------------------------------------------

def tabled_experiments(runs_dir: Path, configs: Path | None = None
                       ) -> dict[str, tuple[dict[str, Any], list[Run]]]:
    """{experiment: (table spec, the runs that enter the table)} for every experiment with at
    least one valid run and a table layout (:func:`uqbench.report.table_layout.layout`; ``configs``:
    a config folder searched besides the packaged one)."""
    by_exp: dict[str, list[Run]] = defaultdict(list)
    for run in load_results(runs_dir):
        by_exp[run["experiment"]].append(run)
    tabled = {}
    for exp, runs in sorted(by_exp.items()):
        spec = layout(exp, runs, configs)
        if spec and (kept := table_runs(runs, spec)):
            tabled[exp] = (spec, kept)
    return tabled


def command_file(exp: str, runs_dir: Path, out_dir: Path, runs: list[Run],
                 files: list[str], configs: Path | None = None) -> str:
    """``<experiment>.command``: the shell command that rebuilds exactly these files (paths
    as given, relative to the folder it ran in) and the results.json files that went in."""
    command = shlex.join(["uqbench-tables", "--runs", str(runs_dir), "--out", str(out_dir),
                          "--experiment", exp,
                          *(["--configs", str(configs)] if configs is not None else [])])
    paths = sorted(Path(run["_path"]).relative_to(runs_dir).as_posix() for run in runs)
    return (f"# {', '.join(files)} were made by (run from the folder the paths are "
            f"relative to):\n{command}\n"
            f"# from {len(paths)} results.json under {runs_dir}:\n"
            + "".join(f"#   {p}\n" for p in paths))


def write_tables(runs_dir: Path, out_dir: Path, only: str | list[str] | None = None,
                 publish: Callable[..., None] | None = None,
                 configs: Path | None = None) -> dict[str, Path]:
    """Write every experiment's table (or those named in ``only``, each of which must have
    valid results); return {experiment: markdown path}. The runs folder is read once.
    ``publish(exp, frames, figures, command)``, if given, gets each experiment's tables
    ({"table": as shown, "numbers": means and stds}), figure paths and rebuild command.
    ``configs``: a config folder searched besides the packaged one for experiment configs."""
    by_exp = tabled_experiments(runs_dir, configs)
    if only is not None:
        wanted = [only] if isinstance(only, str) else list(only)
        missing = [e for e in wanted if e not in by_exp]
        if missing:
            known = ", ".join(sorted(by_exp)) or "none"
            raise ValueError(f"no valid results with a table for experiment "
                             f"'{', '.join(missing)}' under {runs_dir} (experiments found: "
                             f"{known})")
        by_exp = {e: by_exp[e] for e in wanted}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for exp, (spec, runs) in sorted(by_exp.items()):
        for warning in missing_keys(exp, spec, runs):
            print(warning, file=sys.stderr)
        shown, numeric = build_table(runs, spec)
        files = _write_files(exp, spec, runs, shown, numeric, out_dir)
        command = command_file(exp, runs_dir, out_dir, runs, files, configs)
        (out_dir / f"{exp}.command").write_text(command)
        if publish is not None:
            publish(exp, {"table": shown, "numbers": numeric},
                    [out_dir / f for f in files if f.endswith(".png")], command)
        written[exp] = out_dir / f"{exp}.md"
    return written


def _write_files(exp: str, spec: dict[str, Any], runs: list[Run], shown: pd.DataFrame,
                 numeric: pd.DataFrame, out_dir: Path) -> list[str]:
    """Write one experiment's Markdown, LaTeX, CSV, figures and claims; their file names."""
    title = spec.get("title", exp)
    note = edge_note(runs)  # the rows marked † used a setting chosen at its grid's edge
    md = f"## {title}\n\n" + markdown_table(shown) + "\n"  # our formatting, "|" escaped
    (out_dir / f"{exp}.md").write_text(md + (f"\n{note}\n" if note else ""))
    unknown: set[str] = set()
    caption = f"{title}. {note}" if note else title
    (out_dir / f"{exp}.tex").write_text(
        to_latex(shown, caption, f"tab:{exp}", len(spec["rows"]), unknown))
    for char in sorted(unknown):
        print(f"warning: {exp}.tex: no LaTeX for {char!r} (U+{ord(char):04X} "
              f"{unicodedata.name(char, 'unnamed')}); written as '?'", file=sys.stderr)
    numeric.to_csv(out_dir / f"{exp}.csv", index=False)
    files = [f"{exp}.md", f"{exp}.tex", f"{exp}.csv"]
    for suffix, figure in figure_specs(spec).items():
        files.append(summary_figure(runs, figure, out_dir / f"{exp}{suffix}.png", title).name)
    for name, sub in (spec.get("subtables") or {}).items():
        files += _write_subtable(exp, name, spec | sub, runs, out_dir)
    claims: list[str] = []
    if spec.get("claims"):
        try:
            claims = [p.name for p in write_claims(runs, spec, out_dir, exp)]
        except InvalidClaims as err:  # e.g. a claim's side that several runs of a seed match
            print(f"warning: {exp}: no claims table: {err}", file=sys.stderr)
        if claims and spec.get("claims_tex"):
            frame = pd.read_csv(out_dir / f"{exp}_claims.csv", dtype=str, keep_default_na=False)
            caption = f"{title}: claims. {multiplicity_sentence(spec)}"
            (out_dir / f"{exp}_claims.tex").write_text(
                to_latex(frame, caption, f"tab:{exp}_claims", 1))
            claims.append(f"{exp}_claims.tex")
    if not claims:  # a claims file left from an older spec would pass for this one's
        for stale in out_dir.glob(f"{exp}_claims.*"):
            stale.unlink()
    levels = ([p.name for p in write_levels(runs, spec, out_dir, exp)] if spec.get("levels")
              else [])
    return files + claims + levels


def _write_subtable(exp: str, name: str, spec: dict[str, Any], runs: list[Run],
                    out_dir: Path) -> list[str]:
    """``subtables: {name: {title, columns[, rows]}}``: another table of the same runs (rows
    and the rest of the spec inherited unless given) → ``<exp>_<name>.md/.tex/.csv``."""
    shown, numeric = build_table(runs, spec)
    title, stem = spec.get("title", f"{exp} {name}"), f"{exp}_{name}"
    (out_dir / f"{stem}.md").write_text(f"## {title}\n\n" + markdown_table(shown) + "\n")
    (out_dir / f"{stem}.tex").write_text(to_latex(shown, title, f"tab:{stem}",
                                                  len(spec["rows"])))
    numeric.to_csv(out_dir / f"{stem}.csv", index=False)
    return [f"{stem}.md", f"{stem}.tex", f"{stem}.csv"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="uqbench-tables",
        description="Build each experiment's table (Markdown, LaTeX, CSV), its figures and "
                    "the command that made them from runs/**/results.json")
    parser.add_argument("--runs", type=Path, default=Path(os.environ.get("UQBENCH_RUNS", "runs")),
                        help="runs folder ($UQBENCH_RUNS, else runs/)")
    parser.add_argument("--out", type=Path, default=Path("tables"), help="output folder (tables/)")
    parser.add_argument("--experiment", default=None, help="only this experiment")
    parser.add_argument("--configs", type=Path, default=None,
                        help="a config folder (experiment/<name>.yaml) searched besides the "
                             "packaged one for the experiments' table layouts")
    parser.add_argument("--quiet", action="store_true", help="do not print the tables")
    parser.add_argument("--wandb", action="store_true",
                        help="also log each table and its figures to W&B, one run per "
                             "experiment (files under <runs>/<experiment>/wandb)")
    parser.add_argument("--wandb-project", default="uqbench", help="W&B project (uqbench)")
    parser.add_argument("--wandb-entity", default=None, help="W&B user or team")
    parser.add_argument("--wandb-mode", default=os.environ.get("WANDB_MODE", "offline"),
                        help="online | offline | disabled ($WANDB_MODE, else offline)")
    args = parser.parse_args(argv)
    with user_errors():
        _build(args)


def _build(args: argparse.Namespace) -> None:
    """uqbench-tables once its arguments are read: build, print and report the tables."""
    if not args.runs.is_dir():
        raise FileNotFoundError(f"runs folder {args.runs} does not exist; run an experiment "
                                f"first (e.g. `make demo`) or pass --runs")
    publish = _wandb_publisher(args) if args.wandb else None
    written = write_tables(args.runs, args.out, args.experiment, publish, args.configs)
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
            raise ValueError(message) from None

    make()  # bad settings fail before any table is built

    def publish(exp: str, frames: dict[str, pd.DataFrame], figures: list[Path],
                command: str) -> None:
        log_experiment_table(make(), args.runs / exp, exp, frames, figures, command)
        print(f"W&B: {exp}'s tables → {args.runs / exp / 'wandb'}", file=sys.stderr)

    return publish


if __name__ == "__main__":
    main()
