"""What `uqbench-tables` writes besides the cells: the same bytes from the same runs, the
command that made each table, a warning for a key no run has, distinct seeds, and figure error
bars with the tables' std (sample std, ddof=1)."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from uqbench.report.building import build_table
from uqbench.report.tables import main

SPEC = {
    "title": "Toy — NLL vs width (σ, ±)",
    "rows": [{"key": "settings.backbone.width", "title": "width"},
             {"key": "settings.method.variance", "title": "variance"}],
    "columns": [{"key": "metrics.test/nll", "title": "NLL", "fmt": ".3f"},
                {"key": "params.trainable", "title": "params", "fmt": ".0f"}],
    "figure": {"x": "params.trainable", "y": ["metrics.test/nll"],
               "hue": "settings.method.variance", "facet": "settings.backbone.width",
               "xscale": "log"},
    "figures": {"series": {"series": ["metrics.test/nll", "metrics.ood/nll"],
                           "labels": [0, 1], "hue": ["settings.method.variance",
                                                     "settings.backbone.width"]}},
}
# NLL per (width, variance): three seeds each; OOD NLL is NLL + 1
NLL = {(4, "embedded"): [1.0, 2.0, 4.0], (4, "learned"): [0.5, 0.5, 1.1],
       (8, "embedded"): [0.25, 0.75, 0.5], (8, "learned"): [3.0]}


def result(width: int, variance: str, seed: int, nll: float, spec: dict = SPEC) -> dict:
    return {"experiment": "toy", "seed": seed,
            "settings": {"backbone": {"width": width}, "method": {"variance": variance}},
            "params": {"trainable": 10 * width + (2 if variance == "learned" else 0)},
            "metrics": {"test/nll": nll, "ood/nll": nll + 1}, "table": spec}


def write_runs(root: Path, spec: dict = SPEC) -> Path:
    for (width, variance), values in NLL.items():
        for seed, nll in enumerate(values):
            path = root / "toy" / f"w{width}" / variance / f"seed{seed}" / "results.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(result(width, variance, seed, nll, spec)))
    return root


def test_building_twice_writes_the_same_bytes(tmp_path, monkeypatch):
    """Two builds from the same runs, each into tables/ of its own folder (the command file
    names --out as given), give byte-identical files, figures included."""
    runs = write_runs(tmp_path / "runs")
    outs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        main(["--runs", str(runs), "--out", "tables", "--quiet"])
        outs.append(tmp_path / name / "tables")
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == ["toy.command", "toy.csv", "toy.md", "toy.png", "toy.tex",
                     "toy_series.png"]
    assert sorted(p.name for p in outs[1].iterdir()) == files
    for name in files:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    png = (outs[0] / "toy.png").read_bytes()
    assert b"matplotlib" not in png.lower()  # no software version in the PNG's text chunks


def test_the_command_file_rebuilds_the_same_files_and_lists_the_runs(tmp_path, monkeypatch):
    runs = write_runs(tmp_path / "runs", {k: v for k, v in SPEC.items() if k != "figures"})
    monkeypatch.chdir(tmp_path)
    main(["--runs", "runs", "--quiet"])  # every experiment, default --out
    text = Path("tables/toy.command").read_text().splitlines()
    assert text[1] == "uqbench-tables --runs runs --out tables --experiment toy"
    assert "toy.md, toy.tex, toy.csv, toy.png were made by" in text[0]
    listed = [line.removeprefix("#   ") for line in text[3:]]
    expected = sorted(p.relative_to(runs).as_posix() for p in runs.rglob("results.json"))
    assert listed == expected and len(listed) == 10 and "10 results.json under runs" in text[2]
    before = {p.name: p.read_bytes() for p in Path("tables").iterdir()}
    argv = shlex.split(text[1])
    assert argv[0] == "uqbench-tables"
    for path in Path("tables").iterdir():
        path.unlink()
    main([*argv[1:], "--quiet"])
    assert {p.name: p.read_bytes() for p in Path("tables").iterdir()} == before


def test_a_key_no_run_has_warns_with_close_matches_and_the_table_is_written(tmp_path, capsys):
    spec = {**{k: v for k, v in SPEC.items() if k != "figures"},
            "columns": [*SPEC["columns"],
                        {"key": "metrics.test/nl", "title": "NLL typo", "fmt": ".3f"},
                        {"key": "metrics.nothing/like_it", "title": "other"}],
            "figure": {**SPEC["figure"], "y": ["metrics.test/nll", "metrics.tset/nll"]},
            "figures": {"empty": {"x": "params.trainabel", "y": "metrics.test/nll",
                                  "hue": "settings.method.variance", "xscale": "log"}}}
    runs = write_runs(tmp_path / "runs", spec)
    out = tmp_path / "tables"
    main(["--runs", str(runs), "--out", str(out), "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(err) == 4, err
    typo = next(line for line in err if "'metrics.test/nl'" in line)
    assert typo.startswith("warning: toy: column 'NLL typo' reads 'metrics.test/nl', which no "
                           "run of the experiment has")
    assert "closest keys the runs have: metrics.test/nll" in typo and "show –" in typo
    figure = next(line for line in err if "'metrics.tset/nll'" in line)
    assert "toy: figure reads" in figure and "metrics.test/nll" in figure
    other = next(line for line in err if "'metrics.nothing/like_it'" in line)
    assert "no key of the runs comes close" in other
    md = (out / "toy.md").read_text()
    header, _, first = [line for line in md.splitlines() if line.startswith("|")][:3]
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [c.strip() for c in first.strip("|").split("|")], strict=True))
    assert cells["NLL typo"] == "–" and cells["other"] == "–" and cells["NLL"] == "2.333 ± 1.528"
    csv = pd.read_csv(out / "toy.csv")
    assert csv["NLL typo mean"].isna().all()
    empty = next(line for line in err if "'params.trainabel'" in line)
    assert "toy: figure 'empty' reads" in empty and "params.trainable" in empty
    assert (out / "toy.png").is_file() and (out / "toy.tex").is_file()
    assert (out / "toy_empty.png").is_file()  # drawn without a point, not a crash


def test_seeds_counts_distinct_seeds():
    """Two runs holding seed 0 (copies that reached build_table) count as one seed; the cell
    still averages the values it was given."""
    spec = {k: SPEC[k] for k in ("rows", "columns")}
    runs = [result(4, "embedded", 0, 1.0), result(4, "embedded", 0, 1.0),
            result(4, "embedded", 1, 4.0)]
    _, numeric = build_table(runs, spec)
    assert numeric.loc[0, "seeds"] == 2
    assert numeric.loc[0, "NLL mean"] == pytest.approx(2.0)  # (1 + 1 + 4) / 3


def test_figure_error_bars_are_the_sample_std_over_seeds(tmp_path, monkeypatch):
    calls: list[tuple] = []

    def record(self, xs, means, yerr=None, label=None, **kwargs):
        calls.append((self, label, tuple(xs), list(means), list(yerr)))

    monkeypatch.setattr("matplotlib.axes.Axes.errorbar", record)
    runs = write_runs(tmp_path / "runs")
    main(["--runs", str(runs), "--out", str(tmp_path / "tables"), "--quiet"])
    # (panel title, line label, xs) → (means, error bars); titles are set after the lines
    drawn = {(ax.get_title(), label, xs): (means, yerr) for ax, label, xs, means, yerr in calls}
    for (width, variance), values in NLL.items():
        # the main figure: one panel per width, one point per variance at its parameters
        means, yerr = drawn[(f"width = {width}", variance,
                             (10 * width + (2 if variance == "learned" else 0),))]
        assert means == pytest.approx([statistics.mean(values)])
        spread = statistics.stdev(values) if len(values) > 1 else 0.0  # none with one seed
        assert yerr == pytest.approx([spread])
        # the series figure: hue from two keys, points at labels 0 (NLL) and 1 (OOD NLL)
        means, yerr = drawn[("", f"{variance}, {width}", (0, 1))]
        assert means == pytest.approx([statistics.mean(values), statistics.mean(values) + 1])
        assert yerr == pytest.approx([spread, spread])
    # the data tell the conventions apart: population std (ddof=0) would fail above
    assert np.std([1.0, 2.0, 4.0]) != pytest.approx(statistics.stdev([1.0, 2.0, 4.0]))
