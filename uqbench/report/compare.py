"""Two folders of tables, cell by cell (`uqbench-compare`): does a rerun reproduce the numbers?

``uqbench-compare TABLES_A TABLES_B [--experiment NAME] [--ignore TITLE]`` reads, for every
experiment in either folder, the two files ``uqbench-tables`` writes side by side:
``<experiment>.csv`` (each column's mean and sample std over seeds at full precision, and the
number of seeds) and ``<experiment>.md`` (each cell as the table shows it, which tells how many
digits a cell shows). Rows are matched by their row-title columns, columns by their titles.

One rule decides every cell, with n the seeds of its row (sqrt(s_A²/n_A + s_B²/n_B) where the
two rows have different seeds, which the ``seeds`` cell reports as a disagreement of its own):

- a cell that shows a spread on either side (mean ± std, m ± s): the means agree when
  |m_A − m_B| ≤ 2·sqrt((s_A² + s_B²)/n), two standard errors of their difference (a side without
  a spread counts s = 0), or when |m_A − m_B| ≤ one unit of the last digit shown (each side's
  mean may be off its shown value by half a unit): the allowed difference is the larger;
- a cell without a spread on either side (one seed, or every seed the same, the ``seeds``
  column, a paper value, a verdict column's ✓/✗, the ``failed`` count): the two must be equal
  as shown;
- a cell with no value ("–") agrees only with a cell with no value.

The command prints each experiment's summary and every disagreeing cell with both values and
the allowed difference, and exits with status 1 when a cell disagrees, or when an experiment,
a row or a column exists on one side only. ``--ignore`` leaves out columns that never repeat
(the wall-clock training time). Claims files (``<experiment>_claims.*``) are not compared.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

import pandas as pd

from uqbench.errors import user_errors

SPREAD = " ± "
SEEDS = "seeds"
FAILED = "failed"  # a table with failed_key: its runs without a finite value
PAPER = " (paper)"


# --- one side's table --------------------------------------------------------------------------

@dataclass
class Table:
    """One experiment's table as written: its rows by their row titles, and for each column
    the means, stds (NaN: none) and shown cells of those rows."""

    titles: list[str]                             # the row-title columns
    rows: list[tuple[str, ...]]                   # each row's titles (+ its repeat, if any)
    means: dict[str, list[float]] = field(default_factory=dict)
    stds: dict[str, list[float]] = field(default_factory=dict)
    shown: dict[str, list[str]] = field(default_factory=dict)   # every compared column
    seeds: list[int] = field(default_factory=list)


def _number(text: str) -> float:
    return float(text) if text.strip() else math.nan


def _markdown_columns(path: Path) -> dict[str, list[str]]:
    """{column title: its cells} of the first pipe table in a Markdown file."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        raise ValueError(f"{path} holds no table (a pipe table, as uqbench-tables writes)")
    body = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        body.append([cell.strip() for cell in line.strip("|").split("|")])
    header, rows = body[0], body[2:]  # body[1]: the |:---| line
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"{path}: a row has another number of cells than the header")
    return {title: [row[j] for row in rows] for j, title in enumerate(header)}


def read_table(folder: Path, experiment: str) -> Table:
    """``<experiment>.csv`` and ``.md`` of ``folder`` as one :class:`Table`."""
    csv_path, md_path = folder / f"{experiment}.csv", folder / f"{experiment}.md"
    for path in (csv_path, md_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; uqbench-tables writes "
                                    f"{experiment}.csv and {experiment}.md side by side")
    frame = pd.read_csv(csv_path, dtype=str, keep_default_na=False)
    columns = list(frame.columns)
    values = [c[: -len(" mean")] for c in columns
              if c.endswith(" mean") and f"{c[: -len(' mean')]} std" in columns]
    if not values or SEEDS not in columns or set(columns[columns.index(SEEDS) + 1:]) - {FAILED}:
        raise ValueError(f"{csv_path} is not a table of uqbench-tables (it needs '<title> "
                         f"mean' and '<title> std' columns and '{SEEDS}' last, or before "
                         f"'{FAILED}')")
    first = columns.index(f"{values[0]} mean")
    titles = columns[:first]
    derived = {f"{v} {k}" for v in values for k in ("mean", "std")}
    texts = [c for c in columns[first:]  # verdicts (✓/✗), failures: compared as shown
             if c not in derived and not c.endswith(PAPER) and c != SEEDS]
    shown = _markdown_columns(md_path)
    expected = [*titles, *values, *texts, *(c for c in columns if c.endswith(PAPER)), SEEDS]
    absent = [c for c in expected if c not in shown]
    if absent or any(len(cells) != len(frame) for cells in shown.values()):
        raise ValueError(f"{md_path} and {csv_path.name} are not one table (columns "
                         f"{absent or 'alike'}, {len(frame)} rows in the CSV); rebuild both "
                         f"with uqbench-tables")
    keys: list[tuple[str, ...]] = []
    for row in frame[titles].itertuples(index=False):
        key = tuple(str(v) for v in row)
        repeat = sum(k[: len(titles)] == key for k in keys)  # titles shown alike: keep apart
        keys.append(key + ((f"#{repeat + 1}",) if repeat else ()))
    table = Table(titles, keys, seeds=[int(_number(v)) for v in frame[SEEDS]])
    for title in values:
        table.means[title] = [_number(v) for v in frame[f"{title} mean"]]
        table.stds[title] = [_number(v) for v in frame[f"{title} std"]]
    for title in [*values, *texts, *(c for c in columns if c.endswith(PAPER)), SEEDS]:
        table.shown[title] = shown[title]
    return table


def experiments_in(folder: Path) -> set[str]:
    """The experiments whose tables a folder holds: ``<name>.csv`` with ``<name>.md`` beside
    it, less the claims files of an experiment (``<name>_claims.csv``)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"tables folder {folder} does not exist (uqbench-tables --out "
                                f"<folder> writes one)")
    names = {p.stem for p in folder.glob("*.csv") if (folder / f"{p.stem}.md").is_file()}
    return {n for n in names if not (n.endswith("_claims") and n[: -len("_claims")] in names)}


# --- the rule ----------------------------------------------------------------------------------

def display_unit(shown: str) -> float:
    """One unit of the last digit a number is shown with ("95.0" → 0.1, "1.2e+03" → 100);
    0 for a text that is no finite number."""
    try:
        exponent = Decimal(shown.split(SPREAD)[0].strip()).as_tuple().exponent
    except InvalidOperation:
        return 0.0
    return 10.0 ** exponent if isinstance(exponent, int) else 0.0


@dataclass
class Cell:
    """One compared cell: both shown values, the difference of the means and the difference
    allowed (None: must be equal as shown), and the verdict."""

    row: tuple[str, ...]
    column: str
    shown_a: str
    shown_b: str
    agree: bool
    difference: float | None = None
    allowed: float | None = None
    note: str = ""


def _spread(std: float, n: int) -> float:
    """The std a cell shows (0 without a spread: one seed, or none between the seeds)."""
    return std if n > 1 and math.isfinite(std) and std > 0 else 0.0


def compare_cell(row: tuple[str, ...], column: str, a: Table, i: int, b: Table, j: int
                 ) -> Cell:
    """Row ``i`` of ``a`` against row ``j`` of ``b`` in ``column``, by the module's rule."""
    shown_a, shown_b = a.shown[column][i], b.shown[column][j]
    if column not in a.means:  # seeds, a paper value, a verdict, failures: no spread
        return Cell(row, column, shown_a, shown_b, shown_a == shown_b, note="equal as shown")
    m_a, m_b = a.means[column][i], b.means[column][j]
    if math.isnan(m_a) or math.isnan(m_b):
        return Cell(row, column, shown_a, shown_b, math.isnan(m_a) and math.isnan(m_b),
                    note="a value on one side only")
    n_a, n_b = a.seeds[i], b.seeds[j]
    s_a, s_b = _spread(a.stds[column][i], n_a), _spread(b.stds[column][j], n_b)
    if s_a == 0 and s_b == 0:
        return Cell(row, column, shown_a, shown_b, shown_a == shown_b, abs(m_a - m_b),
                    note="no spread: equal as shown")
    two_se = 2 * math.sqrt(s_a**2 / n_a + s_b**2 / n_b)
    unit = max(display_unit(shown_a), display_unit(shown_b))
    allowed = max(two_se, unit)
    difference = abs(m_a - m_b)
    agree = difference <= allowed * (1 + 1e-9)  # a rounding of the difference itself
    note = (f"2·SE {two_se:.4g}" + (f", n {n_a}" if n_a == n_b else f", n {n_a}/{n_b}")
            + f"; shown to {unit:g}")
    return Cell(row, column, shown_a, shown_b, agree, difference, allowed, note)


# --- two folders -------------------------------------------------------------------------------

@dataclass
class Comparison:
    """One experiment in both folders (or in one: ``only_in``)."""

    experiment: str
    only_in: str | None = None
    titles: list[str] = field(default_factory=list)   # the row-title columns
    cells: list[Cell] = field(default_factory=list)
    rows: int = 0
    columns: int = 0
    rows_only: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    columns_only: list[tuple[str, str]] = field(default_factory=list)

    @property
    def disagreeing(self) -> list[Cell]:
        return [c for c in self.cells if not c.agree]

    @property
    def agrees(self) -> bool:
        return (self.only_in is None and not self.disagreeing and not self.rows_only
                and not self.columns_only)


def compare_tables(experiment: str, a: Table, b: Table, ignore: frozenset[str] = frozenset()
                   ) -> Comparison:
    """Every cell of the rows and columns both tables have; the rest listed by side."""
    out = Comparison(experiment, titles=a.titles)
    if a.titles != b.titles:
        out.columns_only += [("A", f"row title {t}") for t in a.titles if t not in b.titles]
        out.columns_only += [("B", f"row title {t}") for t in b.titles if t not in a.titles]
        return out
    cols_a = [c for c in a.shown if c not in ignore]
    cols_b = [c for c in b.shown if c not in ignore]
    out.columns_only += [("A", c) for c in cols_a if c not in cols_b]
    out.columns_only += [("B", c) for c in cols_b if c not in cols_a]
    shared = [c for c in cols_a if c in cols_b]
    where_b = {row: j for j, row in enumerate(b.rows)}
    in_a = set(a.rows)
    out.rows_only += [("A", r) for r in a.rows if r not in where_b]
    out.rows_only += [("B", r) for r in b.rows if r not in in_a]
    out.columns = len(shared)
    for i, row in enumerate(a.rows):
        if row in where_b:
            out.rows += 1
            out.cells += [compare_cell(row, c, a, i, b, where_b[row]) for c in shared]
    return out


def compare_folders(folder_a: Path, folder_b: Path, only: list[str] | None = None,
                    ignore: frozenset[str] = frozenset()) -> list[Comparison]:
    """Each experiment of either folder (or those named in ``only``), compared."""
    in_a, in_b = experiments_in(folder_a), experiments_in(folder_b)
    names = sorted(in_a | in_b) if not only else list(dict.fromkeys(only))
    unknown = [n for n in names if n not in in_a | in_b]
    if unknown or not names:
        found = ", ".join(sorted(in_a | in_b)) or "none"
        raise ValueError(f"no table of {', '.join(unknown) or 'any experiment'} in {folder_a} "
                         f"or {folder_b} (tables there: {found})")
    comparisons = []
    for name in names:
        if name not in in_a or name not in in_b:
            comparisons.append(Comparison(name, only_in="A" if name in in_a else "B"))
            continue
        comparisons.append(compare_tables(name, read_table(folder_a, name),
                                          read_table(folder_b, name), ignore))
    return comparisons


# --- the report --------------------------------------------------------------------------------

def _row_text(titles: list[str], row: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"{t}={v}" for t, v in zip([*titles, "repeat"], row,
                                                      strict=False)) + "]"


def report(comparisons: list[Comparison]) -> str:
    """Each experiment's summary line, then its disagreements; the last line the verdict."""
    lines = []
    for comp in comparisons:
        name = comp.experiment
        if comp.only_in is not None:
            lines.append(f"{name}: only in {comp.only_in}")
            continue
        bad = comp.disagreeing
        lines.append(f"{name}: {comp.rows} rows × {comp.columns} columns, {len(comp.cells)} "
                     f"cells: {len(comp.cells) - len(bad)} agree, {len(bad)} disagree"
                     + (f"; {len(comp.rows_only)} rows and {len(comp.columns_only)} columns "
                        f"on one side only" if comp.rows_only or comp.columns_only else ""))
        for side, row in comp.rows_only:
            lines.append(f"  row {_row_text(comp.titles, row)} only in {side}")
        for side, column in comp.columns_only:
            lines.append(f"  column '{column}' only in {side}")
        for cell in bad:
            where = (f"  {_row_text(comp.titles, cell.row)} {cell.column}: A {cell.shown_a}, "
                     f"B {cell.shown_b}")
            if cell.allowed is None:
                lines.append(f"{where}: not equal ({cell.note})")
            else:
                lines.append(f"{where}: |Δ| {cell.difference:.4g} > allowed "
                             f"{cell.allowed:.4g} ({cell.note})")
    failed = [c.experiment for c in comparisons if not c.agrees]
    lines.append(f"DIFFER: {len(failed)} of {len(comparisons)} experiments "
                 f"({', '.join(failed)})" if failed else
                 f"AGREE: every cell of {len(comparisons)} experiment"
                 f"{'s' if len(comparisons) != 1 else ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="uqbench-compare",
        description="Compare two folders of uqbench-tables output cell by cell (e.g. from two "
                    "fresh clones); exit 1 when a cell disagrees or a table, row or column is "
                    "on one side only.",
        epilog="A cell with a spread agrees when |m_A − m_B| ≤ max(2·sqrt((s_A² + s_B²)/n), one "
               "unit of the last digit shown); a cell without one must be equal as shown.")
    parser.add_argument("tables_a", type=Path, help="one folder of tables (A)")
    parser.add_argument("tables_b", type=Path, help="the other folder of tables (B)")
    parser.add_argument("--experiment", action="append", default=None,
                        help="only this experiment (repeatable)")
    parser.add_argument("--ignore", action="append", default=[], metavar="TITLE",
                        help="leave out the column with this title in every table, e.g. "
                             "'train s' (repeatable)")
    args = parser.parse_args(argv)
    with user_errors():
        comparisons = compare_folders(args.tables_a, args.tables_b, args.experiment,
                                      frozenset(args.ignore))
        print(report(comparisons))
    if not all(c.agrees for c in comparisons):
        sys.exit(1)


if __name__ == "__main__":
    main()
