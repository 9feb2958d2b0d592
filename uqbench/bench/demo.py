"""How long ``make demo`` takes after setup (``make demo-time``) → ``tables/demo.json``; with
``--target p1-text``, how long ``make p1-text`` takes (``make p1-text-time``) →
``tables/p1_text_time.json``, its tables kept in ``--tables`` for a comparison with tables/.

Runs the Makefile's ``demo`` target with its runs in an empty temporary folder
(``UQBENCH_RUNS``), its tables there too (``DEMO_TABLES``), and torch's compile cache empty
(``TORCHINDUCTOR_CACHE_DIR``; ``--keep-compile-cache`` keeps the machine's), so that nothing
earlier runs left is reused and nothing in runs/ or tables/ is touched; then writes the wall
time, with the machine's CPU count, the date and the commit, as the record that the README
cites (a list of records, as bench.json, for ``uqbench-docs``). The record it replaces stays in
the file as the previous measurement: machines of one kind differ by up to 2× here, so the
README shows both rather than one draw.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

FIGURE = "make demo after setup, from empty runs and compile-cache folders"
TARGETS = {"demo": ("demo.json", FIGURE),
           "p1-text": ("p1_text_time.json", "make p1-text after setup, from an empty runs folder")}


def previous(figure: str) -> str:
    """The name under which a figure's replaced measurement is kept."""
    return f"{figure}, the measurement before"


def _commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def time_demo(make: str = "make", keep_compile_cache: bool = False, target: str = "demo",
              tables: Path | None = None, runs: Path | None = None) -> dict[str, object]:
    """Run ``make <target>`` (demo, p1-text) in fresh folders and return its record; its tables
    go to ``tables`` and its runs to ``runs`` (kept: an empty or new folder) or a temporary
    folder."""
    figure = TARGETS[target][1]
    if runs is not None and runs.exists() and any(runs.iterdir()):
        raise SystemExit(f"--runs {runs} is not empty: the timing starts from an empty runs "
                         "folder (name a new one)")
    with tempfile.TemporaryDirectory(prefix="uqbench-demo-") as tmp:
        env = {**os.environ, "UQBENCH_RUNS": str(runs.resolve()) if runs else f"{tmp}/runs"}
        if not keep_compile_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/compile-cache"
        out = tables or Path(tmp) / "tables"
        start = time.perf_counter()
        subprocess.run([make, target, f"DEMO_TABLES={out}", f"P1_TEXT_TABLES={out}"], env=env,
                       check=True)
        seconds = round(time.perf_counter() - start, 1)
    return {"figure": figure if not keep_compile_cache else
            figure.replace(" and compile-cache folders", " folder, the compile cache kept"),
            "seconds": seconds, "minutes": round(seconds / 60, 2),
            "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "commit": _commit()}


def with_previous(record: dict[str, object], path: Path) -> list[dict[str, object]]:
    """The records of ``path`` with ``record`` in place of its figure's measurement, which
    stays as that figure's previous one (``<figure>, the measurement before``); the records
    of other figures are kept as they are."""
    if not path.exists():
        return [record]
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise SystemExit(f"{path} is not JSON; move it away to start a new record") from None
    figure = str(record["figure"])
    before = previous(figure)
    kept = [r for r in old if isinstance(r, dict) and r.get("figure") not in (figure, before)]
    replaced = [r for r in old if isinstance(r, dict) and r.get("figure") == figure]
    return [record] + [{**r, "figure": before} for r in replaced[:1]] + kept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m uqbench.bench.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tables"),
                        help="folder of demo.json (tables/)")
    parser.add_argument("--make", default="make", help="the make command (make)")
    parser.add_argument("--keep-compile-cache", action="store_true",
                        help="reuse the machine's torch compile cache instead of an empty one")
    parser.add_argument("--target", choices=sorted(TARGETS), default="demo",
                        help="the make target timed (demo)")
    parser.add_argument("--tables", type=Path, default=None,
                        help="keep the timed run's tables in this folder (default: discarded)")
    parser.add_argument("--runs", type=Path, default=None,
                        help="keep the timed run's runs in this new or empty folder (default: "
                             "discarded)")
    args = parser.parse_args(argv)
    record = time_demo(args.make, args.keep_compile_cache, args.target, args.tables, args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / TARGETS[args.target][0]
    path.write_text(json.dumps(with_previous(record, path), indent=2) + "\n")
    print(f"make {args.target}: {record['minutes']} min → {path}")


if __name__ == "__main__":
    main()
