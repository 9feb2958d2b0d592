"""Choose a setting on the validation split from a grid of finished runs.

``uqbench-select p1_digits_lr --key trainer.optimizer.lr --key trainer.decay_to``
reads the grid experiment's results.json files (nothing else), groups them by backbone and
method, and prints, per group, the combination of the ``--key`` values with the lowest mean
``--metric`` over seeds, as the YAML mapping an experiment records
(``<backbone>: {<method name>: {<key>: <value>, …}}``; a key a group's runs never set is left
out), with every candidate's score as a comment.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from uqbench.errors import user_errors
from uqbench.report.claims import get_path
from uqbench.report.validation import load_results


def choose(runs: list[dict], keys: list[str], metric: str) -> dict[str, dict[str, tuple]]:
    """{backbone: {method name: (best values, {values: mean metric})}}, values a tuple over
    ``keys`` (None where a run does not set one); lower metric wins."""
    scores: dict[tuple, list[float]] = defaultdict(list)
    for run in runs:
        values = tuple(get_path(run, f"settings.{key}") for key in keys)
        score = get_path(run, f"metrics.{metric}")
        if values[0] is not None and isinstance(score, int | float) and math.isfinite(score):
            name = get_path(run, "settings.method.name") or run.get("method")
            scores[(run.get("backbone"), name, values)].append(float(score))
    means: dict[str, dict[str, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    for (backbone, method, values), found in scores.items():
        means[backbone][method][values] = sum(found) / len(found)
    return {backbone: {method: (min(candidates, key=lambda v: candidates[v]),
                                dict(candidates))
                       for method, candidates in methods.items()}
            for backbone, methods in means.items()}


def _show(values: tuple) -> str:
    return "/".join("-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
                    for v in values)


def _chosen(runs_dir: Path, experiment: str, keys: list[str], metric: str
            ) -> tuple[list[dict], dict[str, dict[str, tuple]]]:
    """(the experiment's runs, :func:`choose`'s table), or a ValueError when nothing is chosen."""
    runs = [r for r in load_results(runs_dir) if r.get("experiment") == experiment]
    table = choose(runs, keys, metric)
    if not table:
        raise ValueError(f"no runs of experiment '{experiment}' with settings.{keys[0]} and "
                         f"metrics.{metric} under {runs_dir}")
    return runs, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="uqbench-select", description=__doc__)
    parser.add_argument("experiment")
    parser.add_argument("--key", action="append", default=None,
                        help="a setting chosen (a dotted path under results.json's settings); "
                             "repeat for several (default: trainer.optimizer.lr)")
    parser.add_argument("--metric", default="val/nll", help="lower is better")
    parser.add_argument("--runs", type=Path,
                        default=Path(os.environ.get("UQBENCH_RUNS") or "runs"))
    args = parser.parse_args(argv)
    keys = args.key or ["trainer.optimizer.lr"]
    with user_errors():
        runs, table = _chosen(args.runs, args.experiment, keys, args.metric)
    names = [k.split(".")[-1] for k in keys]
    print(f"# chosen by lowest {args.metric} ({len(runs)} runs of {args.experiment}); "
          f"candidates as {'/'.join(names)}: score")
    for backbone, methods in sorted(table.items()):
        print(f"{backbone}:")
        for method, (best, candidates) in sorted(methods.items()):
            chosen = ", ".join(f"{n}: {v:g}" if isinstance(v, float) else f"{n}: {v}"
                               for n, v in zip(names, best, strict=True) if v is not None)
            tried = ", ".join(f"{_show(v)}: {c:.4f}"
                              for v, c in sorted(candidates.items(), key=lambda kv: str(kv[0])))
            print(f"  {method}: {{{chosen}}}    # {tried}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
