"""Choose settings on the validation split from a sweep of finished runs, and write them as a
recipe file that experiments read (``uqbench-select``)::

    uqbench-select p1_digits_select --key trainer.optimizer.lr --key trainer.decay_to \\
        --metric val/nll --write conf/recipe/p1_digits.yaml

reads the sweep experiment's results.json files (nothing else), groups its runs (default: by
backbone and method name; ``--group-by`` takes any results.json path, ``--group-by none`` makes
one group) and, in each group, averages ``--metric`` over seeds for every combination of the
``--key`` values (paths under results.json's ``settings``) and chooses the best
(``--direction``, default min). It prints the choices with every candidate's score, and with
``--write`` writes them as a recipe file.

The rules, each also stated in the file's provenance:

- **Sealed.** Every run of the sweep must hold validation metrics only (every key under
  ``val/``: runs made with ``eval_splits: [val]``). One run holding any other (``test/``,
  ``ood/``, ``test_c/``…) makes the tool refuse and write nothing: a choice made where test
  numbers were in reach is no validation choice.
- **Candidates.** A combination of key values with at least one run whose metric is a finite
  number, scored by its mean and sample std (ddof=1; null with one seed) over those runs. A run
  that does not set the first key is no candidate.
- **Constraints.** ``--require METRIC=LO:HI``: a candidate whose mean of METRIC lies outside
  [LO, HI] is not eligible (recorded with the reason); ``--require-each METRIC=LO:HI``: nor is
  one any of whose runs has METRIC outside [LO, HI] or not a finite number (every seed and
  every cell the group pools, e.g. every width and variance when it groups by none); a group
  with no eligible candidate is an error naming it.
- **Ties** (:data:`TIE_RULE`). **Edges** (:data:`EDGE_RULE`): each edge choice is also printed
  as a warning, and tables mark the rows of runs that used it.

The recipe file is a plain mapping: ``provenance`` (how it was made), ``choices`` (group … →
{key: value}, a key named by the last part of its ``--key`` path, a key a group's runs never set
left out) and ``groups`` (group … → candidates, ties, edge). An experiment reads it as a lookup
table (a defaults entry ``- /recipe@lookup.<table>: <name>`` and interpolations
``${lookup.<table>.choices.${backbone.name}.${method.name}.lr}``), never as typed values.

Longer than ~350 lines because the rules above and the file that records them are one
contract: each rule's code sits beside the provenance text that states it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from uqbench.errors import user_errors
from uqbench.report.claims import get_path
from uqbench.report.validation import is_number, load_results

GROUP_BY = ["settings.backbone.name", "settings.method.name"]
TIE_TOLERANCE = 1e-9
TIE_RULE = (f"candidates whose mean is within {TIE_TOLERANCE:g} relative of the best "
            f"(|a - b| <= {TIE_TOLERANCE:g} * max(|a|, |b|)) tie; the tie goes to the smallest "
            f"values, compared key by key in --key order (numbers ascending, then text "
            f"alphabetically, an unset key first)")
EDGE_RULE = ("a numeric key is at the edge when its chosen value is the smallest or the "
             "largest value of its grid in the group (every value the group's runs hold, "
             "eligible or not); a key with one value in the grid was not chosen and is never "
             "at the edge. An edge choice may have its best beyond the grid: widen the grid")


# --- the sweep's runs --------------------------------------------------------------------------

def outside_validation(runs_dir: Path, experiment: str) -> list[tuple[str, list[str]]]:
    """(results.json path, its metric keys outside ``val/``) for every run of ``experiment``
    that holds any: ensemble members and scorings on other data (``<run>/eval/``) included."""
    found = []
    for path in sorted(runs_dir.rglob("results.json")):
        if any(part.startswith(".") for part in path.relative_to(runs_dir).parts[:-1]):
            continue  # a run being published or cut short
        try:
            res = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # unreadable: load_results warns about it
        if not isinstance(res, dict) or res.get("experiment") != experiment:
            continue
        outside = sorted(k for k in res.get("metrics") or {} if not str(k).startswith("val/"))
        if outside:
            found.append((str(path), outside))
    return found


def check_sealed(runs_dir: Path, experiment: str) -> None:
    """Refuse a sweep any of whose runs holds a metric outside the validation split."""
    breaches = outside_validation(runs_dir, experiment)
    if not breaches:
        return
    shown = "\n  ".join(f"{path}: {', '.join(keys[:4])}{' …' if len(keys) > 4 else ''}"
                        for path, keys in breaches[:5])
    more = f"\n  … and {len(breaches) - 5} more" if len(breaches) > 5 else ""
    raise ValueError(
        f"refusing to select from experiment '{experiment}': {len(breaches)} of its runs hold "
        f"metrics outside the validation split, so its choice would not be made on "
        f"validation alone (nothing written):\n  {shown}{more}\nrun the sweep with "
        f"eval_splits=[val] (in its experiment config), in a runs folder without these runs")


# --- choosing ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Require:
    """``--require METRIC=LO:HI``: a candidate's mean of METRIC must lie in [LO, HI];
    ``each``: every run's METRIC must (``--require-each``): a mean can sit inside the band
    while one width or variance lies far outside it."""

    metric: str
    low: float
    high: float
    each: bool = False

    @classmethod
    def parse(cls, text: str, each: bool = False) -> Require:
        metric, _, bounds = text.rpartition("=")
        low, _, high = bounds.partition(":")
        try:
            lo, hi = float(low), float(high)
        except ValueError:
            lo = hi = math.nan
        if not metric or not (lo <= hi):
            flag = "--require-each" if each else "--require"
            raise ValueError(f"{flag} {text!r} is not METRIC=LO:HI with numbers LO <= HI, "
                             f"e.g. val/coverage_2sigma=0.90:0.99")
        return cls(metric, lo, hi, each)

    def __str__(self) -> str:
        return f"{self.metric}={self.low:g}:{self.high:g}" + (" on every run" if self.each
                                                              else "")

    def breach(self, candidate: Candidate) -> str | None:
        """Why ``candidate`` fails this constraint, or None when it meets it."""
        seen = candidate.checked.get(self.metric)
        band = f"[{self.low:g}, {self.high:g}]"
        if not seen:
            return f"no finite {self.metric}"
        if not self.each:
            mean = statistics.fmean(seen)
            return None if self.low <= mean <= self.high else (
                f"{self.metric} mean {mean:.6g} outside {band}")
        outside = sum(not self.low <= v <= self.high for v in seen)
        missing = len(candidate.scores) - len(seen)  # runs scored without a finite METRIC
        if not outside and not missing:
            return None
        return (f"{self.metric} of {outside + missing} of {len(candidate.scores)} runs outside "
                f"{band} (runs: {min(seen):.6g} … {max(seen):.6g}"
                + (f", {missing} not finite)" if missing else ")"))


@dataclass
class Candidate:
    """One combination of the keys' values in a group, and its runs' scores."""

    values: tuple
    scores: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    checked: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    excluded: str | None = None  # why it is not eligible (a --require it fails)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.scores)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.scores) if len(self.scores) > 1 else None


@dataclass
class Choice:
    """A group's outcome: its candidates (sorted by value), the one chosen, the ties and the
    keys chosen at their grid's edge."""

    candidates: list[Candidate]
    best: Candidate
    tied: list[Candidate]
    grid: dict[str, list[Any]]
    edge: list[str]


def order(value: Any) -> tuple:
    """The tie rule's order of one value: unset first, then numbers ascending, then text."""
    if value is None:
        return (0, 0, "")
    return (1, value, "") if is_number(value) else (2, 0, str(value))


def key_names(keys: list[str]) -> list[str]:
    """Each --key's name in the recipe: the last part of its path, which must be unique."""
    names = [k.split(".")[-1] for k in keys]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--key paths {', '.join(k for k in keys if k.split('.')[-1] in twice)} "
                         f"share the name {', '.join(twice)} (the last part of the path); choose "
                         f"keys whose last parts differ")
    return names


def _finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def gather(runs: list[dict], keys: list[str], metric: str, group_by: list[str],
           requires: list[Require]) -> dict[tuple, dict[tuple, Candidate]]:
    """{group: {values: candidate}} of the runs with a finite ``metric`` that set the first
    key; a candidate run without a value at a group-by path is an error naming it."""
    groups: dict[tuple, dict[tuple, Candidate]] = defaultdict(dict)
    for run in runs:
        values = tuple(get_path(run, f"settings.{key}") for key in keys)
        score = get_path(run, f"metrics.{metric}")
        if values[0] is None or not _finite(score):
            continue
        group = tuple(get_path(run, path) for path in group_by)
        for path, value in zip(group_by, group, strict=True):
            if value is None or isinstance(value, dict | list):
                raise ValueError(f"{run.get('_path', run.get('run'))} has no single value at "
                                 f"--group-by {path} ({value!r}); group by paths every run sets")
        candidate = groups[tuple(map(str, group))].setdefault(values, Candidate(values))
        candidate.scores.append(float(score))
        candidate.seeds.append(int(run["seed"]))
        for checked in dict.fromkeys(r.metric for r in requires):  # once per metric
            value = get_path(run, f"metrics.{checked}")
            if _finite(value):
                candidate.checked[checked].append(float(value))
    return groups


def choose(candidates: dict[tuple, Candidate], names: list[str], direction: str,
           requires: list[Require], where: str) -> Choice:
    """The best eligible candidate of one group (``where`` names it in errors), its ties and
    the keys chosen at their grid's edge."""
    listed = sorted(candidates.values(), key=lambda c: tuple(order(v) for v in c.values))
    for candidate in listed:
        for require in requires:
            candidate.excluded = require.breach(candidate)
            if candidate.excluded:
                break
    eligible = [c for c in listed if c.excluded is None]
    if not eligible:
        reasons = "; ".join(f"{_show(names, c.values)}: {c.excluded}" for c in listed)
        raise ValueError(f"group {where}: no candidate meets "
                         f"{', '.join(map(str, requires))} ({reasons})")
    pick = min if direction == "min" else max
    top = pick(c.mean for c in eligible)
    tied = [c for c in eligible if math.isclose(c.mean, top, rel_tol=TIE_TOLERANCE)]
    best = tied[0]  # eligible is sorted by the tie rule's order
    grid = {name: sorted({c.values[i] for c in listed if c.values[i] is not None}, key=order)
            for i, name in enumerate(names)}
    edge = [name for i, name in enumerate(names)
            if len(grid[name]) > 1 and all(is_number(v) for v in grid[name])
            and best.values[i] in (grid[name][0], grid[name][-1])]
    return Choice(listed, best, tied if len(tied) > 1 else [], grid, edge)


def select(runs: list[dict], keys: list[str], metric: str, direction: str = "min",
           group_by: list[str] | None = None, requires: list[Require] | None = None
           ) -> dict[tuple, Choice]:
    """{group (its values at the group-by paths, as text): choice} over ``runs``."""
    group_by = GROUP_BY if group_by is None else group_by
    requires = requires or []
    names = key_names(keys)
    return {group: choose(candidates, names, direction, requires,
                          "/".join(group) or "(all runs)")
            for group, candidates in sorted(gather(runs, keys, metric, group_by,
                                                   requires).items())}


# --- the recipe file ---------------------------------------------------------------------------

def _values(names: list[str], values: tuple) -> dict[str, Any]:
    """The set keys of a candidate as a mapping (an unset key left out)."""
    return {n: v for n, v in zip(names, values, strict=True) if v is not None}


def _show(names: list[str], values: tuple) -> str:
    shown = _values(names, values)
    return ", ".join(f"{n}={v:g}" if isinstance(v, float) else f"{n}={v}"
                     for n, v in shown.items()) or "(no key set)"


def _nest(flat: dict[tuple, Any]) -> Any:
    """{(a, b): x} → {a: {b: x}}; with no group-by paths, {(): x} → x."""
    if set(flat) == {()}:
        return flat[()]
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree


def _candidate(names: list[str], candidate: Candidate) -> dict[str, Any]:
    entry: dict[str, Any] = {"values": _values(names, candidate.values),
                             "mean": candidate.mean, "std": candidate.std,
                             "n": len(candidate.scores)}
    if candidate.checked:
        entry["checked"] = {m: statistics.fmean(v) for m, v in candidate.checked.items()}
    if candidate.excluded:
        entry["excluded"] = candidate.excluded
    return entry


def recipe(choices: dict[tuple, Choice], keys: list[str], *, experiment: str, metric: str,
           direction: str, group_by: list[str], requires: list[Require], command: str,
           file: str | None) -> dict[str, Any]:
    """The recipe file's mapping: provenance, choices and each group's details."""
    names = key_names(keys)
    picked = [c for choice in choices.values() for c in choice.candidates]
    seeds = sorted({s for c in picked for s in c.seeds})
    provenance = {
        "file": file, "sweep": experiment, "command": command,
        "date": datetime.now(UTC).date().isoformat(), "metric": metric, "direction": direction,
        "group_by": group_by, "keys": dict(zip(names, keys, strict=True)), "seeds": seeds,
        "runs": sum(len(c.scores) for c in picked),
        "grid": _nest({g: c.grid for g, c in choices.items()}),
        "require": [str(r) for r in requires], "tie_rule": TIE_RULE, "edge_rule": EDGE_RULE}
    details = {g: {"candidates": [_candidate(names, c) for c in choice.candidates],
                   "ties": {"tied": [_values(names, c.values) for c in choice.tied],
                            "broken_by": "the smallest values in --key order (tie_rule)"}
                   if choice.tied else None,
                   "edge": choice.edge}
               for g, choice in choices.items()}
    return {"provenance": provenance,
            "choices": _nest({g: _values(names, c.best.values) for g, c in choices.items()}),
            "groups": _nest(details)}


def write_recipe(path: Path, content: dict[str, Any]) -> None:
    """The recipe as YAML under a header saying how it is remade."""
    import yaml

    header = (f"# Settings chosen on the validation split of sweep "
              f"{content['provenance']['sweep']} by uqbench-select;\n# remake it with\n"
              f"#   {content['provenance']['command']}\n# rather than editing it by hand.\n")
    class Dumper(yaml.SafeDumper):  # every value written out: no &anchors / *aliases
        def ignore_aliases(self, data: Any) -> bool:
            return True

    body = yaml.dump(content, Dumper=Dumper, sort_keys=False, default_flow_style=None,
                     width=100, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + body)


# --- the command -------------------------------------------------------------------------------

def _summary(choices: dict[tuple, Choice], names: list[str], metric: str, direction: str,
             runs: int, experiment: str) -> list[str]:
    lines = [f"# chosen by {'lowest' if direction == 'min' else 'highest'} mean {metric} over "
             f"seeds ({runs} runs of {experiment}); candidates as "
             f"{'/'.join(names)}: mean"]
    previous: tuple = ()
    for group, choice in choices.items():
        for depth in range(len(group) - 1):  # a parent's label once, above its children
            if previous[:depth + 1] != group[:depth + 1]:
                lines.append(f"{'  ' * depth}{group[depth]}:")
        chosen = ", ".join(f"{n}: {v:g}" if isinstance(v, float) else f"{n}: {v}"
                           for n, v in _values(names, choice.best.values).items())
        tried = ", ".join(
            "/".join("-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
                     for v in c.values) + f": {c.mean:.4f}" + (" (excluded)" if c.excluded
                                                              else "")
            for c in choice.candidates)
        notes = ([f"edge: {', '.join(choice.edge)}"] if choice.edge else []) + (
            [f"tie of {len(choice.tied)}"] if choice.tied else [])
        label = f"{'  ' * (len(group) - 1)}{group[-1]}: " if group else ""
        lines.append(f"{label}{{{chosen}}}    # {tried}"
                     + (f"  [{'; '.join(notes)}]" if notes else ""))
        previous = group
    return lines


def _edge_warnings(choices: dict[tuple, Choice], names: list[str]) -> list[str]:
    out = []
    for group, choice in choices.items():
        for name in choice.edge:
            value = choice.best.values[names.index(name)]
            grid = choice.grid[name]
            side = "smallest" if value == grid[0] else "largest"
            out.append(f"warning: {'/'.join(group) or '(all runs)'}: {name}={value:g} is the "
                       f"{side} value of its grid ({grid[0]:g} … {grid[-1]:g}); the best may "
                       f"lie beyond it: widen the grid")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="uqbench-select", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", help="the sweep experiment (its experiment_name)")
    parser.add_argument("--key", action="append", default=None,
                        help="a setting chosen (a dotted path under results.json's settings); "
                             "repeat for several (default: trainer.optimizer.lr)")
    parser.add_argument("--metric", default="val/nll", help="the validation metric (val/nll)")
    parser.add_argument("--direction", choices=("min", "max"), default="min",
                        help="min: lower is better (default); max: higher is better")
    parser.add_argument("--require", action="append", default=[], metavar="METRIC=LO:HI",
                        help="a candidate whose mean METRIC lies outside [LO, HI] is not "
                             "eligible; repeat for several")
    parser.add_argument("--require-each", action="append", default=[], metavar="METRIC=LO:HI",
                        help="a candidate any of whose runs has METRIC outside [LO, HI] is not "
                             "eligible (every seed and every cell its group pools); repeat for "
                             "several")
    parser.add_argument("--group-by", action="append", default=None, metavar="PATH",
                        help="a results.json path whose value splits the runs into groups, "
                             "each with its own choice; repeat for several (default: "
                             f"{' '.join(GROUP_BY)}); none: one group")
    parser.add_argument("--write", type=Path, default=None, metavar="conf/recipe/NAME.yaml",
                        help="write the recipe file there")
    parser.add_argument("--runs", type=Path,
                        default=Path(os.environ.get("UQBENCH_RUNS") or "runs"))
    args = parser.parse_args(argv)
    keys = args.key or ["trainer.optimizer.lr"]
    with user_errors():
        group_by = _group_by(args.group_by)
        requires = ([Require.parse(r) for r in args.require]
                    + [Require.parse(r, each=True) for r in args.require_each])
        names = key_names(keys)
        if args.write is not None and args.write.suffix != ".yaml":
            raise ValueError(f"--write {args.write}: a recipe is a Hydra config, NAME.yaml "
                             f"(e.g. conf/recipe/{args.write.stem or 'name'}.yaml)")
        runs = [r for r in load_results(args.runs)  # trained runs: no scorings of them
                if r.get("experiment") == args.experiment and r.get("job") != "eval"]
        if not runs:
            raise ValueError(f"no runs of experiment '{args.experiment}' under {args.runs}")
        check_sealed(args.runs, args.experiment)
        choices = select(runs, keys, args.metric, args.direction, group_by, requires)
        if not choices:
            raise ValueError(f"no runs of experiment '{args.experiment}' with settings."
                             f"{keys[0]} and metrics.{args.metric} under {args.runs}")
        content = recipe(choices, keys, experiment=args.experiment, metric=args.metric,
                         direction=args.direction, group_by=group_by, requires=requires,
                         command=shlex.join(["uqbench-select", *argv]),
                         file=None if args.write is None else str(args.write))
        if args.write is not None:
            write_recipe(args.write, content)
    print("\n".join(_summary(choices, names, args.metric, args.direction,
                             content["provenance"]["runs"], args.experiment)))
    for warning in _edge_warnings(choices, names):
        print(warning, file=sys.stderr)
    if args.write is not None:
        print(f"→ {args.write}", file=sys.stderr)
    return 0


def _group_by(given: list[str] | None) -> list[str]:
    """The group-by paths: the default, or those given; ``none`` alone: one group."""
    if given is None:
        return list(GROUP_BY)
    if "none" in given:
        if len(given) > 1:
            raise ValueError(f"--group-by none makes one group; it takes no other path "
                             f"(given: {' '.join(given)})")
        return []
    return given


if __name__ == "__main__":
    sys.exit(main())
