"""Which results.json files enter a table, read and checked (``uqbench-tables``).

A results.json is used when it is UTF-8 JSON holding an object with ``experiment`` (a non-empty
string), ``seed`` (an integer) and ``metrics`` (an object, empty for the parameter job), and,
when it has a ``table``, a spec of the shape :mod:`uqbench.report.tables` describes. Within an
experiment, every value its table reads must be a number or absent (columns, figure x and y)
or a single value (rows, figure hue and facet). Any other file is skipped with one warning line
on stderr naming it and the problem.

Ensemble members. A run that trained one member of a Deep Ensemble as its own job
(``settings.method.member`` set) is not a row: its ensemble is, once ``uqbench-combine`` has
written it (it would otherwise pass for the ensemble in the ensemble's row).

Scorings. A scoring job's results (``job: eval``, in ``<run>/eval/…/``) carry their run's
experiment but enter its table only when the spec says ``scorings: true``; they are then rows
like any run, told apart by a row key such as ``settings.method.covariance``. A row entry's
``default`` is the value a run without that key counts as (one stored before the setting
existed).

Seeds. One result per (setting, seed): when two files hold the same seed of the same setting
(a copied run folder, a backup), the one first in sorted path order is kept, so the choice does
not depend on file times, and a warning names both files.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from uqbench.records.runfolder import FAILED
from uqbench.report.claims import (
    CONFIDENCE,
    InvalidClaims,
    check_claims,
    check_multiplicity,
    get_path,
)
from uqbench.report.levels import InvalidLevels, check_levels

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


def is_number(value: Any) -> bool:
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


def check_spec(spec: Any) -> None:
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
    for c in spec["columns"]:
        if "within" in c and not (is_number(c["within"]) and c["within"] > 0):
            raise InvalidResults(f"table column '{c['title']}' has within: {c['within']!r}; "
                                 f"it must be a positive number (the bound on |value|)")
    if not isinstance(spec.get("scorings", False), bool):
        raise InvalidResults("table.scorings is not true or false")
    paper = spec.get("paper") or []
    if not isinstance(paper, list) or not all(
            isinstance(p, dict) and isinstance(p.get("row"), dict)
            and isinstance(p.get("values"), dict)
            and all(v is None or is_number(v) for v in p["values"].values()) for p in paper):
        raise InvalidResults("table.paper is not a list of {row, values: numbers} objects")
    if spec.get("figures") is not None and not isinstance(spec["figures"], dict):
        raise InvalidResults("table.figures is not an object {name: figure}")
    for figure in figure_specs(spec).values():
        figure_keys(figure)
    subtables = spec.get("subtables") or {}
    if not isinstance(subtables, dict) or not all(isinstance(v, dict) for v in
                                                  subtables.values()):
        raise InvalidResults("table.subtables is not an object {name: {title, columns}}")
    for name, sub in subtables.items():
        try:
            check_spec({k: v for k, v in (spec | sub).items()
                        if k not in ("subtables", "claims")})
        except InvalidResults as err:
            raise InvalidResults(f"table.subtables.{name}: {err}") from err
    if spec.get("claims") is not None:
        try:
            check_claims(spec["claims"], [r["title"] for r in spec["rows"]],
                         spec.get("confidence", CONFIDENCE))
            check_multiplicity(spec)
        except InvalidClaims as err:
            raise InvalidResults(str(err)) from err
    if spec.get("levels") is not None:
        try:
            check_levels(spec["levels"])
        except InvalidLevels as err:
            raise InvalidResults(str(err)) from err


def figure_specs(spec: dict[str, Any]) -> dict[str, Any]:
    """{file suffix: figure spec}: ``figure`` → <experiment>.png, ``figures: {name: …}`` →
    <experiment>_<name>.png."""
    named = {f"_{k}": v for k, v in (spec.get("figures") or {}).items()}
    return ({"": spec["figure"]} if spec.get("figure") else {}) | named


def key_list(value: Any) -> list[Any]:
    """A figure's hue or facet: one dotted key or a list of them (their values joined)."""
    return value if isinstance(value, list) and value else [value]


def figure_keys(figure: Any) -> tuple[list[str], list[str]]:
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
        y = figure.get("y")
        numbers = [figure.get("x"), *(y if isinstance(y, list) else [y])]
    scalars = key_list(figure.get("hue")) + (key_list(figure["facet"]) if "facet" in figure
                                             else [])
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
        check_spec(res["table"])


def check_values(run: Run, spec: dict[str, Any]) -> None:
    """Every value ``spec`` reads from ``run`` can be averaged (numbers) or grouped (scalars)."""
    numbers = [c["key"] for c in spec["columns"]]
    scalars = [r["key"] for r in spec["rows"]]
    for figure in figure_specs(spec).values():
        fig_numbers, fig_scalars = figure_keys(figure)
        numbers, scalars = numbers + fig_numbers, scalars + fig_scalars
    for key in numbers:
        value = get_path(run, key)
        if value is not None and not is_number(value):
            raise InvalidResults(f"{key} is {_json_type(value)}, not a number")
    for key in scalars:
        value = get_path(run, key)
        if isinstance(value, (dict, list)):
            raise InvalidResults(f"{key} is {_json_type(value)}, not a single value")


def warn(path: str | Path, problem: str) -> None:
    print(f"warning: skipping {path}: {problem}", file=sys.stderr)


def load_results(runs_dir: Path) -> list[Run]:
    """Every valid results.json under ``runs_dir``, and every failed run's record
    (``failed.json`` in a folder without results.json: the run without metrics, ``failed:
    true``), in sorted path order; a warning for each file skipped. Hidden folders
    (``.staging-…``: a run being published or cut short) are not runs and are passed over
    silently."""
    runs = []
    paths = sorted([*runs_dir.rglob("results.json"),
                    *(p for p in runs_dir.rglob(FAILED)
                      if not (p.parent / "results.json").exists())])
    for path in paths:
        if any(part.startswith(".") for part in path.relative_to(runs_dir).parts[:-1]):
            continue
        try:
            res = _read_json(path)
            if path.name == FAILED:  # a failed run: its record, without metrics
                if not isinstance(res, dict) or not isinstance(res.get("run"), dict):
                    continue  # a record from before failed runs named their cell
                res = res["run"] | {"metrics": {}, "failed": True}
            check_results(res)
        except InvalidResults as err:
            warn(path, str(err))
            continue
        if get_path(res, "settings.method.member") is not None:
            continue  # one member of an ensemble trained apart: its ensemble is the row
        res["_path"] = str(path)
        runs.append(res)
    return runs


def setting_of(run: Run, spec: dict[str, Any]) -> tuple:
    return tuple(get_path(run, r["key"]) for r in spec["rows"])


def with_defaults(run: Run, spec: dict[str, Any]) -> Run:
    """``run`` with each row key it lacks set to that row's ``default`` (a copy, when any)."""
    missing = [r for r in spec["rows"] if "default" in r and get_path(run, r["key"]) is None]
    if not missing:
        return run
    run = copy.deepcopy(run)
    for row in missing:
        node = run
        *parents, leaf = row["key"].split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                break  # a value where the path goes on: not a run this key describes
        else:
            node[leaf] = row["default"]
    return run


def table_runs(runs: list[Run], spec: dict[str, Any]) -> list[Run]:
    """The runs of one experiment that enter its table: values ``spec`` can read, and one run
    per (setting, seed), the first in path order (``runs`` come sorted), so a copied run
    folder or a backup never counts as another seed; a trained run before any scoring (a
    scoring that changed nothing the rows show is the same setting)."""
    kept: dict[tuple, Run] = {}
    for run in sorted(runs, key=lambda r: r.get("job") == "eval"):  # trained runs first
        if run.get("job") == "eval" and not spec.get("scorings", False):
            continue  # a scoring of a run: a row only where the table asks for scorings
        run = with_defaults(run, spec)
        try:
            check_values(run, spec)
        except InvalidResults as err:
            warn(run["_path"], str(err))
            continue
        key = (setting_of(run, spec), run["seed"])
        if key in kept:
            setting = ", ".join(f"{r['title']}={v}" for r, v in zip(spec["rows"], key[0],
                                                                     strict=True))
            warn(run["_path"], f"seed {run['seed']} of ({setting}) is already in "
                                f"{kept[key]['_path']}, which is kept")
            continue
        kept[key] = run
    return list(kept.values())


