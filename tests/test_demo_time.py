"""`make demo-time` (uqbench.bench.demo): the demo runs in fresh folders and its time is kept."""

from __future__ import annotations

import json
import os
import stat

import pytest

from uqbench.bench.demo import FIGURE, main, previous


def test_the_demo_runs_in_fresh_folders_and_its_wall_time_is_recorded(tmp_path):
    seen = tmp_path / "seen.txt"
    make = tmp_path / "fake-make"  # stands in for make: records what it was given, then waits
    make.write_text("#!/bin/sh\n"
                    f'echo "$@|$UQBENCH_RUNS|$TORCHINDUCTOR_CACHE_DIR" > {seen}\n'
                    "sleep 0.3\n")
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    main(["--out", str(tmp_path / "tables"), "--make", str(make)])
    args, runs, cache = seen.read_text().strip().split("|")
    assert args.startswith("demo DEMO_TABLES=") and args.endswith("/tables")
    assert runs.endswith("/runs") and cache.endswith("/compile-cache")
    assert not os.path.exists(runs.rsplit("/", 1)[0])  # the temporary folder is gone
    [record] = json.loads((tmp_path / "tables" / "demo.json").read_text())
    assert 0.3 <= record["seconds"] < 30
    assert record["minutes"] == round(record["seconds"] / 60, 2)
    assert record["cpus"] == os.cpu_count()
    assert record["figure"] == FIGURE
    main(["--out", str(tmp_path / "tables"), "--make", str(make), "--keep-compile-cache"])
    assert seen.read_text().strip().split("|")[2] == os.environ.get("TORCHINDUCTOR_CACHE_DIR",
                                                                    "")


def test_a_new_measurement_keeps_the_one_before_and_the_other_figures(tmp_path):
    make = tmp_path / "fake-make"
    make.write_text("#!/bin/sh\nsleep 0.1\n")
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "tables"
    path = out / "demo.json"
    main(["--out", str(out), "--make", str(make)])
    [first] = json.loads(path.read_text())
    main(["--out", str(out), "--make", str(make), "--keep-compile-cache"])
    [kept_cache, again] = json.loads(path.read_text())
    assert again == first and kept_cache["figure"] != FIGURE
    path.write_text(json.dumps([{**first, "seconds": 999.0}, kept_cache]))  # an older figure
    main(["--out", str(out), "--make", str(make)])
    records = json.loads(path.read_text())
    assert [r["figure"] for r in records] == [FIGURE, previous(FIGURE), kept_cache["figure"]]
    assert records[0]["seconds"] < 30 and records[1]["seconds"] == 999.0
    assert records[2] == kept_cache
    main(["--out", str(out), "--make", str(make)])  # the oldest goes: one measurement before
    records = json.loads(path.read_text())
    assert [r["figure"] for r in records] == [FIGURE, previous(FIGURE), kept_cache["figure"]]
    assert records[1]["seconds"] < 30


def test_p1_text_is_timed_the_same_way_and_its_tables_can_be_kept(tmp_path):
    seen = tmp_path / "seen.txt"
    make = tmp_path / "fake-make"  # writes a table where make p1-text would
    make.write_text("#!/bin/sh\n"
                    f'echo "$@|$UQBENCH_RUNS" > {seen}\n'
                    'for a in "$@"; do case "$a" in P1_TEXT_TABLES=*) d="${a#*=}";; esac; done\n'
                    'mkdir -p "$d" && echo table > "$d/p1_text.md"\n')
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    kept = tmp_path / "again"
    main(["--out", str(tmp_path / "tables"), "--make", str(make), "--target", "p1-text",
          "--tables", str(kept)])
    args, runs = seen.read_text().strip().split("|")
    assert args.split()[0] == "p1-text" and f"P1_TEXT_TABLES={kept}" in args.split()
    assert runs.endswith("/runs") and not os.path.exists(runs.rsplit("/", 1)[0])
    assert (kept / "p1_text.md").read_text() == "table\n"  # kept for a comparison
    [record] = json.loads((tmp_path / "tables" / "p1_text_time.json").read_text())
    assert record["figure"] == "make p1-text after setup, from an empty runs folder"
    assert not (tmp_path / "tables" / "demo.json").exists()


def test_the_timed_runs_can_be_kept_in_an_empty_folder_and_a_full_one_is_refused(tmp_path):
    seen = tmp_path / "seen.txt"
    make = tmp_path / "fake-make"  # writes a run where make p1-text would
    make.write_text("#!/bin/sh\n"
                    f'echo "$UQBENCH_RUNS" > {seen}\n'
                    'mkdir -p "$UQBENCH_RUNS/p1_text" && echo run > "$UQBENCH_RUNS/p1_text/r"\n')
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    runs = tmp_path / "kept_runs"
    main(["--out", str(tmp_path / "tables"), "--make", str(make), "--target", "p1-text",
          "--runs", str(runs)])
    assert seen.read_text().strip() == str(runs.resolve())
    assert (runs / "p1_text" / "r").read_text() == "run\n"  # kept, not a temporary folder
    seen.unlink()
    with pytest.raises(SystemExit, match="kept_runs is not empty"):  # a second timing refused
        main(["--out", str(tmp_path / "tables"), "--make", str(make), "--target", "p1-text",
              "--runs", str(runs)])
    assert not seen.exists() and (runs / "p1_text" / "r").read_text() == "run\n"
