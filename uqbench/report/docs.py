"""README.md's and docs/*.md's result numbers, written from tables/ (`uqbench-docs`, `make docs`).

A page never types a measured number: it cites the file of ``tables/`` that holds it, and
``uqbench-docs`` writes the number, or the whole table, in place. ``uqbench-docs --check``
rewrites nothing and lists every citation whose text differs from its table or that cites a
file, row, section or column that does not exist (exit status 1), so a test can hold the pages
to the tables. Without ``--check`` it rewrites every marker it can resolve and lists the others,
left as they were (exit status 1): the tables that exist update their pages while the others are
still being made. Two markers, both HTML comments, which Markdown renders as nothing:

**A whole table**, or one section of a table file, on lines of their own::

    <!-- table: bench.md -->
    …the file's text, written by uqbench-docs…
    <!-- /table -->

    <!-- table: p2_width_sweep_claims.md | Paper 2 — …: claims -->
    …the text under the heading "Paper 2 — …: claims", the heading line left out…
    <!-- /table -->

``FILE`` is a file name in tables/; after ``|``, the exact text of one of its headings (without
the ``#``): the section runs to the next heading of the same or a higher level. uqbench-tables
puts each table under one ``## <title>`` heading, so citing the title includes the table (and a
claims file's legend) under the page's own heading.

**One number**, inline, on one line, never inside a Markdown table row (its ``|`` would split
the cell)::

    <!-- n: p2_width_sweep.csv | width=4, variance=learned | test NLL | .3f -->…<!-- /n -->

where uqbench-docs writes the cited cell in place of ``…``, here ``0.049 ± 0.004``.

``FILE | FILTERS | COLUMN [| FORMAT]``:

- ``FILE``: a ``.csv`` in tables/ (uqbench-tables' ``<experiment>.csv`` and
  ``<experiment>_claims.csv``) or a ``.json`` list of records (``bench.json``).
- ``FILTERS``: ``column=value`` pairs separated by commas; together they select exactly one
  row. A value matches a cell when the texts are equal, or when both read as numbers and are
  equal (``ρ₀=-2`` matches ``-2.0``). A value holding a comma or a ``|`` is written in double
  quotes: ``figure="Monte Carlo S = 10 / moment pass, 1→64→64→1"``.
- ``COLUMN``: the cited column. Where the file has no column of that name but has
  ``<COLUMN> mean`` (uqbench-tables' numeric CSV), the number is the table's cell:
  ``mean ± std`` in FORMAT, the mean alone when the std is empty or 0 (one seed).
- ``FORMAT``: a Python format spec (``.3f``, ``.1f``, ``+.1%``) applied to the cell read as a
  number. Without one the cell's text is written as it is: the claims CSVs already hold the
  text their Markdown shows (``0.014 ± 0.008``, ``✓ +33.4%``). An empty cell is an error. A
  cell holding a list of numbers (bench.json's ``ours_interval``) is written ``[low, high]``,
  each in FORMAT.

Markers inside code (fenced blocks and backtick spans) are examples, not citations: they are
never rewritten. Imports nothing of uqbench but its error reporting. Longer than most modules:
the marker syntax, the reader of the table files and the command are one contract, and read
best in one file.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from uqbench.errors import user_errors

# a spec never holds "-->", a number's text never "<!--": a marker left open cannot swallow the
# next one on its line
BLOCK_OPEN = re.compile(r"<!-- table: (?P<spec>(?:(?!-->)[^\n])*?) -->[ \t]*\n")
BLOCK_CLOSE = "<!-- /table -->"
NUMBER = re.compile(r"<!-- n: (?P<spec>(?:(?!-->)[^\n])*?) -->"
                    r"(?P<text>(?:(?!<!--)[^\n])*?)<!-- /n -->")
NUMBER_OPEN = "<!-- n:"


class CitationError(ValueError):
    """A marker that cites nothing: the file, the section, the row or the column is missing, or
    the marker itself is malformed. The message names what is missing and what exists."""


@dataclass(frozen=True)
class Marker:
    """One citation on a page: ``kind`` "table" or "n", what it cites (``spec``, as written),
    and the span ``[start, end)`` of the generated text it guards."""

    kind: str
    spec: str
    start: int
    end: int
    line: int

    def shown(self) -> str:
        return f"<!-- {self.kind}: {self.spec} -->"


@dataclass(frozen=True)
class Problem:
    """What ``--check`` (or a rewrite that could not resolve a marker) reports about one
    marker: ``page:line: marker: message``."""

    page: str
    line: int
    marker: str
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.marker}: {self.message}"


# --- finding the markers -----------------------------------------------------------------------

def mask_code(text: str) -> str:
    """``text`` with fenced code blocks and inline code spans blanked (same length, newlines
    kept), so that offsets into it are offsets into ``text``."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        stripped = line.lstrip()
        opener = stripped[:3] if stripped[:3] in ("```", "~~~") else None
        if fence is None and opener:
            fence = opener
            out.append(_blank(line))
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            out.append(_blank(line))
        else:
            out.append(re.sub(r"(`+)[^`\n]+?\1", lambda m: _blank(m.group(0)), line))
    return "".join(out)


def _blank(s: str) -> str:
    return re.sub(r"[^\n]", " ", s)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def find_markers(text: str) -> tuple[list[Marker], list[tuple[int, str]]]:
    """Every marker of a page in order, and (line, message) for every malformed one: a table
    block without its closing comment, a number marker left open, or one in a table row."""
    masked = mask_code(text)
    found: list[Marker] = []
    bad: list[tuple[int, str]] = []
    blocks: list[tuple[int, int]] = []  # the blocks' whole spans, closing comment included
    pos = 0
    while (m := BLOCK_OPEN.search(masked, pos)) is not None:
        close = masked.find(BLOCK_CLOSE, m.end())
        nxt = BLOCK_OPEN.search(masked, m.end())
        if close < 0 or (nxt is not None and nxt.start() < close):
            bad.append((_line(text, m.start()), f"<!-- table: {m['spec']} --> has no "
                                                f"closing {BLOCK_CLOSE}"))
            pos = m.end()
            continue
        found.append(Marker("table", m["spec"].strip(), m.end(), close, _line(text, m.start())))
        blocks.append((m.start(), close + len(BLOCK_CLOSE)))
        pos = close + len(BLOCK_CLOSE)

    def outside_blocks(i: int) -> bool:
        return not any(a <= i < b for a, b in blocks)

    starts = set()
    for m in NUMBER.finditer(masked):
        if not outside_blocks(m.start()):
            continue
        starts.add(m.start())
        line = _line(text, m.start())
        if masked[masked.rfind("\n", 0, m.start()) + 1:m.start()].lstrip().startswith("|"):
            bad.append((line, f"<!-- n: {m['spec']} --> sits in a Markdown table row, whose "
                              f"'|' would split it; cite the table whole (<!-- table: … -->)"))
            continue
        found.append(Marker("n", m["spec"].strip(), m.start("text"), m.end("text"), line))
    for i in (m.start() for m in re.finditer(re.escape(NUMBER_OPEN), masked)):
        if outside_blocks(i) and i not in starts:
            bad.append((_line(text, i), "a number marker without its closing <!-- /n --> on "
                                        "the same line"))
    found.sort(key=lambda mk: mk.start)
    return found, sorted(bad)


def without_citations(text: str) -> str:
    """``text`` with its code, its generated tables and numbers (markers included) and every
    other HTML comment blanked: the words a writer typed, at their offsets."""
    masked = mask_code(text)
    for pattern in (r"<!-- table: .*?<!-- /table -->", NUMBER.pattern, r"<!--.*?-->"):
        masked = re.sub(pattern, lambda m: _blank(m.group(0)), masked, flags=re.S)
    return masked


# --- reading the tables ------------------------------------------------------------------------

def split_fields(spec: str, sep: str) -> list[str]:
    """``spec`` split at ``sep`` outside double quotes, each part stripped."""
    parts: list[str] = []
    cur: list[str] = []
    quoted = False
    for ch in spec:
        if ch == '"':
            quoted = not quoted
        if ch == sep and not quoted:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if quoted:
        raise CitationError(f"unbalanced double quote in '{spec}'")
    parts.append("".join(cur).strip())
    return parts


def _unquote(value: str) -> str:
    value = value.strip()
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value


def _table_file(tables: Path, name: str) -> Path:
    if not name or Path(name).name != name:
        raise CitationError(f"'{name}' is not a file name in tables/ (no folders)")
    path = tables / name
    if not path.is_file():
        raise CitationError(f"{path} does not exist (uqbench-tables, `make tables` or "
                            f"`make bench` writes the files of tables/)")
    return path


class Tables:
    """The files of one tables folder, each read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._rows: dict[str, tuple[list[str], list[dict[str, str]]]] = {}

    def section(self, spec: str) -> str:
        """The text a ``<!-- table: spec -->`` block holds: the file, or one section of it."""
        name, *rest = split_fields(spec, "|")
        if len(rest) > 1:
            raise CitationError(f"'{spec}': give FILE or FILE | HEADING")
        text = _table_file(self.folder, name).read_text()
        if not rest:
            return text.strip("\n")
        heading = _unquote(rest[0])
        lines = text.splitlines()
        heads = [(i, len(h.group(1)), h.group(2).strip()) for i, ln in enumerate(lines)
                 if (h := re.match(r"(#{1,6})\s+(.*?)\s*#*\s*$", ln))]
        match = [(i, level) for i, level, title in heads if title == heading]
        if not match:
            titles = "; ".join(f"'{t}'" for _, _, t in heads) or "none"
            raise CitationError(f"{name} has no heading '{heading}' (its headings: {titles})")
        start, level = match[0]
        end = next((i for i, lv, _ in heads if i > start and lv <= level), len(lines))
        return "\n".join(lines[start + 1:end]).strip("\n")

    def rows(self, name: str) -> tuple[list[str], list[dict[str, str]]]:
        """(columns, rows as {column: text}) of a CSV or JSON table file."""
        if name not in self._rows:
            path = _table_file(self.folder, name)
            if path.suffix == ".csv":
                with path.open(newline="") as f:
                    reader = csv.DictReader(f)
                    rows = [dict(r) for r in reader]
                    columns = list(reader.fieldnames or [])
            elif path.suffix == ".json":
                records = json.loads(path.read_text())
                if not isinstance(records, list) or not all(isinstance(r, dict)
                                                            for r in records):
                    raise CitationError(f"{path} is not a list of records")
                columns = list(dict.fromkeys(k for r in records for k in r))
                rows = [{k: _text(r.get(k)) for k in columns} for r in records]
            else:
                raise CitationError(f"a number cites a .csv or .json file, not '{name}' (a "
                                    f"Markdown table is cited whole: <!-- table: {name} -->)")
            self._rows[name] = (columns, rows)
        return self._rows[name]

    def number(self, spec: str) -> str:
        """The text a ``<!-- n: spec -->`` marker holds."""
        fields = split_fields(spec, "|")
        if len(fields) not in (3, 4):
            raise CitationError(f"'{spec}': give FILE | FILTERS | COLUMN [| FORMAT]")
        name, filters, column = fields[:3]
        fmt = fields[3] if len(fields) == 4 else None
        columns, rows = self.rows(name)
        row = _one_row(name, columns, rows, filters)
        if column in columns:
            cell = row[column]
            if cell.strip() == "":
                raise CitationError(f"the cell '{column}' of {name} is empty in that row")
            if fmt is not None and cell.lstrip().startswith("["):  # an interval [low, high]
                return "[" + ", ".join(_format(v, fmt) for v in _numbers(cell, column, name)) + "]"
            return cell if fmt is None else _format(_number(cell, column, name), fmt)
        if f"{column} mean" in columns:
            if fmt is None:
                raise CitationError(f"'{column}' is a mean ± std of {name}: give a FORMAT "
                                    f"(e.g. | .3f)")
            mean = _number(row[f"{column} mean"], f"{column} mean", name)
            std_text = row.get(f"{column} std", "").strip()
            std = float(std_text) if std_text else math.nan
            text = _format(mean, fmt)
            return text + f" ± {_format(std, fmt)}" if std > 0 else text
        raise CitationError(f"{name} has no column '{column}' (columns: {', '.join(columns)})")


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _same(cell: str, value: str) -> bool:
    if cell.strip() == value:
        return True
    try:
        return float(cell) == float(value)
    except ValueError:
        return False


def _one_row(name: str, columns: list[str], rows: list[dict[str, str]],
             filters: str) -> dict[str, str]:
    """The one row the ``column=value`` filters select."""
    pairs = []
    for part in split_fields(filters, ","):
        column, eq, value = part.partition("=")
        if not eq or not column.strip():
            raise CitationError(f"filter '{part}' is not column=value")
        column = column.strip()
        if column not in columns:
            raise CitationError(f"{name} has no column '{column}' to filter on (columns: "
                                f"{', '.join(columns)})")
        pairs.append((column, _unquote(value)))
    if not pairs:
        raise CitationError("no filter: give column=value pairs that select one row")
    chosen = [r for r in rows if all(_same(r[c], v) for c, v in pairs)]
    where = ", ".join(f"{c}={v}" for c, v in pairs)
    if not chosen:
        have = "; ".join(f"{c}: {', '.join(dict.fromkeys(r[c] for r in rows))}"
                         for c, _ in pairs)
        raise CitationError(f"no row of {name} has {where} (values there: {have})")
    if len(chosen) > 1:
        raise CitationError(f"{len(chosen)} rows of {name} have {where}; add a filter on "
                            f"another column to select one")
    return chosen[0]


def _number(cell: str, column: str, name: str) -> float:
    if cell.strip() == "":
        raise CitationError(f"the cell '{column}' of {name} is empty in that row")
    try:
        return float(cell)
    except ValueError:
        raise CitationError(f"the cell '{column}' of {name} is '{cell}', not a number; "
                            f"drop the FORMAT to cite its text") from None


def _numbers(cell: str, column: str, name: str) -> list[float]:
    """The numbers of a cell holding a JSON list of them (an interval of bench.json)."""
    try:
        values = json.loads(cell)
        return [float(v) for v in values]
    except (ValueError, TypeError):
        raise CitationError(f"the cell '{column}' of {name} is '{cell}', not a list of "
                            f"numbers") from None


def _format(value: float, fmt: str) -> str:
    try:
        return format(value, fmt)
    except ValueError:
        raise CitationError(f"'{fmt}' is not a format for a number (e.g. .3f, +.1%)") from None


# --- rendering and checking --------------------------------------------------------------------

def expected(marker: Marker, tables: Tables) -> str:
    """What ``marker``'s span should hold (a block: its content between blank lines)."""
    if marker.kind == "table":
        return "\n" + tables.section(marker.spec) + "\n\n"
    return tables.number(marker.spec)


def render(text: str, tables: Tables, page: str = "page") -> tuple[str, list[Problem]]:
    """``text`` with every marker it can resolve rewritten from ``tables``; the problems of
    those it cannot (left as they were). Rendering a rendered page changes nothing."""
    markers, bad = find_markers(text)
    problems = [Problem(page, line, "marker", msg) for line, msg in bad]
    pieces, pos = [], 0
    for mk in markers:
        try:
            new = expected(mk, tables)
        except CitationError as err:
            problems.append(Problem(page, mk.line, mk.shown(), str(err)))
            continue
        pieces += [text[pos:mk.start], new]
        pos = mk.end
    pieces.append(text[pos:])
    return "".join(pieces), sorted(problems, key=lambda p: p.line)


def check(text: str, tables: Tables, page: str = "page") -> list[Problem]:
    """Every marker of ``text`` that cites nothing or whose text is not its table's."""
    markers, bad = find_markers(text)
    problems = [Problem(page, line, "marker", msg) for line, msg in bad]
    for mk in markers:
        try:
            want = expected(mk, tables)
        except CitationError as err:
            problems.append(Problem(page, mk.line, mk.shown(), str(err)))
            continue
        have = text[mk.start:mk.end]
        if have == want:
            continue
        if mk.kind == "n":
            message = f"reads '{have}', the table gives '{want}'"
        else:
            message = _first_difference(have, want)
        problems.append(Problem(page, mk.line, mk.shown(), message))
    return sorted(problems, key=lambda p: p.line)


def _first_difference(have: str, want: str) -> str:
    if have.strip("\n") == want.strip("\n"):
        return "differs from the table only in the blank lines around it"
    old, new = have.strip("\n").splitlines(), want.strip("\n").splitlines()
    i = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b),
             min(len(old), len(new)))
    return (f"differs from the table at its line {i + 1}: reads "
            f"'{old[i] if i < len(old) else '(nothing)'}', the table gives "
            f"'{new[i] if i < len(new) else '(nothing)'}'")


def pages(root: Path) -> list[Path]:
    """The pages that cite tables: README.md and docs/*.md."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
            if p.is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="uqbench-docs",
        description="Write the result numbers and tables of README.md and docs/*.md from "
                    "tables/ (the markers <!-- n: … --> and <!-- table: … -->; see "
                    "docs/development.md), or check them with --check.")
    parser.add_argument("pages", nargs="*", type=Path,
                        help="Markdown pages (default: README.md and docs/*.md under --root)")
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root (.)")
    parser.add_argument("--tables", type=Path, default=None,
                        help="the tables folder (default: <root>/tables)")
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; list every citation that differs from its "
                             "table or cites nothing, and exit 1 if there is one")
    args = parser.parse_args(argv)
    with user_errors():
        folder = args.tables if args.tables is not None else args.root / "tables"
        if not folder.is_dir():
            raise FileNotFoundError(f"tables folder {folder} does not exist; build it with "
                                    f"`make tables` (and `make bench`) or pass --tables")
        tables = Tables(folder)
        problems: list[Problem] = []
        for path in args.pages or pages(args.root):
            text = path.read_text()
            name = str(path)
            if args.check:
                problems += check(text, tables, name)
                continue
            new, found = render(text, tables, name)
            problems += found
            if new != text:
                path.write_text(new)
                print(f"updated {path}")
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            verb = "differ from tables/ or cite nothing" if args.check else "cite nothing"
            print(f"{len(problems)} citation(s) {verb}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
