"""Whether two runs of `make bench` give the same verdicts: ``bench_repeat.json`` and ``.md``.

A verdict is only worth quoting if the next run of the same code on the same machine gives it
again. Every run of ``uqbench-bench`` keeps the run before it (``bench.json`` becomes
``bench_previous.json`` when the new run has finished) and compares the two here, row by row:
each row that has a target in either run, with its verdict and its interval to the target
(ours / target) in both, and whether the verdict repeats. A row measured in only one of the two
runs (another ``--parts``, another M) is listed as such and not counted. The summary record
(figure ``every targeted row``) counts the rows compared and those whose verdict repeats.

``python -m uqbench.bench.repeat PREVIOUS.json CURRENT.json --out DIR`` compares any two
``bench.json`` files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from uqbench.bench.report import write_files
from uqbench.errors import user_errors

SUMMARY = "every targeted row"


def _targeted(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["figure"]: r for r in records if r.get("target") is not None}


def compare(previous: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per targeted row (in the current run's order, then rows only the previous run
    had), and a last one, :data:`SUMMARY`, with ``rows`` (compared: in both runs) and
    ``repeated`` (the same verdict in both)."""
    before, now = _targeted(previous), _targeted(current)
    figures = list(now) + [f for f in before if f not in now]
    rows = []
    for figure in figures:
        a, b = before.get(figure), now.get(figure)
        rows.append({
            "figure": figure,
            "verdict": b["verdict"] if b else None,
            "to_target_interval": b.get("to_target_interval") if b else None,
            "previous_verdict": a["verdict"] if a else None,
            "previous_to_target_interval": a.get("to_target_interval") if a else None,
            "repeated": ("yes" if a["verdict"] == b["verdict"] else "no") if a and b else
                        ("this run only" if b else "previous run only"),
            "compared": bool(a and b)})
    compared = [r for r in rows if r["compared"]]
    rows.append({"figure": SUMMARY, "rows": len(compared),
                 "repeated": sum(r["repeated"] == "yes" for r in compared),
                 "date": _date(current), "previous_date": _date(previous)})
    return rows


def _date(records: list[dict[str, Any]]) -> str | None:
    return next((r["date"] for r in records if r.get("date")), None)


def _interval(span: list[float] | None) -> str:
    return "—" if span is None else f"[{span[0]:.3f}, {span[1]:.3f}]"


def markdown(rows: list[dict[str, Any]]) -> str:
    summary, body = rows[-1], rows[:-1]
    lines = [f"# Two consecutive runs of the benchmark ({summary['previous_date']}, "
             f"{summary['date']})", "",
             f"{summary['repeated']} of {summary['rows']} targeted rows gave the same verdict in "
             f"both runs. Each interval is ours / target (at or under 1: met; wholly above: "
             f"missed; otherwise unclear).", "", "## Verdicts in both runs", "",
             "| figure | previous run | interval | this run | interval | same verdict |",
             "|---|---|---|---|---|---|"]
    for r in body:
        lines.append(f"| {r['figure']} | {r['previous_verdict'] or '—'} | "
                     f"{_interval(r['previous_to_target_interval'])} | {r['verdict'] or '—'} | "
                     f"{_interval(r['to_target_interval'])} | {r['repeated']} |")
    return "\n".join(lines) + "\n"


def write(previous: list[dict[str, Any]], current: list[dict[str, Any]], out: Path
          ) -> list[dict[str, Any]]:
    """Compare the runs and write ``bench_repeat.json`` and ``bench_repeat.md`` into ``out``."""
    rows = compare(previous, current)
    write_files(out, {"bench_repeat.json": json.dumps(rows, indent=1) + "\n",
                      "bench_repeat.md": markdown(rows)})
    return rows


def _load(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"{path}: no such file (a bench.json written by uqbench-bench)")
    data = json.loads(path.read_text())
    if not isinstance(data, list) or not all(isinstance(r, dict) and "figure" in r for r in data):
        raise ValueError(f"{path}: not a list of benchmark records (uqbench-bench's bench.json)")
    return data


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m uqbench.bench.repeat",
                                description=__doc__.split("\n")[0])
    p.add_argument("previous", type=Path, help="the earlier run's bench.json")
    p.add_argument("current", type=Path, help="the later run's bench.json")
    p.add_argument("--out", type=Path, default=Path("tables"),
                   help="folder for bench_repeat.json/.md")
    args = p.parse_args(argv)
    with user_errors():
        rows = write(_load(args.previous), _load(args.current), args.out)
    print(markdown(rows))


if __name__ == "__main__":
    main()
