"""Choose a setting on the validation split from a grid of finished runs.

``python -m uqbench.select p1_digits_lr --key trainer.optimizer.lr --metric val/nll`` reads
the grid experiment's results.json files (nothing else), groups them by backbone and method,
and prints, per group, the value of ``--key`` with the lowest mean ``--metric`` over seeds, as
the YAML mapping an experiment records (``<backbone>: {<method name>: <value>}``), with every
candidate's score as a comment.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from uqbench.tables import get_path, load_results


def choose(runs: list[dict], key: str, metric: str) -> dict[str, dict[str, tuple]]:
    """{backbone: {method name: (best value, {value: mean metric})}}; lower metric wins."""
    scores: dict[tuple, list[float]] = defaultdict(list)
    for run in runs:
        value = get_path(run, f"settings.{key}")
        score = get_path(run, f"metrics.{metric}")
        if value is not None and isinstance(score, int | float) and math.isfinite(score):
            name = get_path(run, "settings.method.name") or run.get("method")
            scores[(run.get("backbone"), name, value)].append(float(score))
    means: dict[str, dict[str, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    for (backbone, method, value), values in scores.items():
        means[backbone][method][value] = sum(values) / len(values)
    return {backbone: {method: (min(candidates, key=candidates.get), dict(candidates))
                       for method, candidates in methods.items()}
            for backbone, methods in means.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m uqbench.select", description=__doc__)
    parser.add_argument("experiment")
    parser.add_argument("--key", default="trainer.optimizer.lr",
                        help="the setting chosen (a dotted path under results.json's settings)")
    parser.add_argument("--metric", default="val/nll", help="lower is better")
    parser.add_argument("--runs", type=Path,
                        default=Path(os.environ.get("UQBENCH_RUNS") or "runs"))
    args = parser.parse_args(argv)
    runs = [r for r in load_results(args.runs) if r.get("experiment") == args.experiment]
    table = choose(runs, args.key, args.metric)
    if not table:
        print(f"error: no runs of experiment '{args.experiment}' with settings.{args.key} and "
              f"metrics.{args.metric} under {args.runs}", file=sys.stderr)
        return 2
    print(f"# chosen by lowest {args.metric} ({len(runs)} runs of {args.experiment})")
    for backbone, methods in sorted(table.items()):
        print(f"{backbone}:")
        for method, (best, candidates) in sorted(methods.items()):
            tried = ", ".join(f"{v:g}: {s:.4f}" for v, s in sorted(candidates.items()))
            print(f"  {method}: {best:g}    # {tried}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
