"""How long ``make demo`` takes after setup (``make demo-time``) → ``tables/demo.json``.

Runs the Makefile's ``demo`` target with its runs in an empty temporary folder
(``UQBENCH_RUNS``), its tables there too (``DEMO_TABLES``), and torch's compile cache empty
(``TORCHINDUCTOR_CACHE_DIR``; ``--keep-compile-cache`` keeps the machine's), so that nothing
earlier runs left is reused and nothing in runs/ or tables/ is touched; then writes the wall
time, with the machine's CPU count and the date, as one record that the README cites (a list
of records, as bench.json, for ``uqbench-docs``).
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


def time_demo(make: str = "make", keep_compile_cache: bool = False) -> dict[str, object]:
    """Run ``make demo`` in fresh folders and return its record."""
    with tempfile.TemporaryDirectory(prefix="uqbench-demo-") as tmp:
        env = {**os.environ, "UQBENCH_RUNS": f"{tmp}/runs"}
        if not keep_compile_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/compile-cache"
        start = time.perf_counter()
        subprocess.run([make, "demo", f"DEMO_TABLES={tmp}/tables"], env=env, check=True)
        seconds = round(time.perf_counter() - start, 1)
    return {"figure": FIGURE if not keep_compile_cache else
            FIGURE.replace(" and compile-cache folders", " folder, the compile cache kept"),
            "seconds": seconds, "minutes": round(seconds / 60, 2),
            "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m uqbench.bench.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tables"),
                        help="folder of demo.json (tables/)")
    parser.add_argument("--make", default="make", help="the make command (make)")
    parser.add_argument("--keep-compile-cache", action="store_true",
                        help="reuse the machine's torch compile cache instead of an empty one")
    args = parser.parse_args(argv)
    record = time_demo(args.make, args.keep_compile_cache)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "demo.json"
    path.write_text(json.dumps([record], indent=2) + "\n")
    print(f"make demo: {record['minutes']} min → {path}")


if __name__ == "__main__":
    main()
