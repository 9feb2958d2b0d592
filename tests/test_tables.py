"""`uqbench-tables` on a runs folder with bad files: each is skipped with one warning, every
table is still written, and ``seeds`` counts distinct seeds."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from uqbench.errors import HINT
from uqbench.report.tables import main

SPEC = {
    "title": "toy",
    "rows": [{"key": "settings.method.variance", "title": "variance"}],
    "columns": [{"key": "metrics.test/nll", "title": "NLL", "fmt": ".3f"},
                {"key": "params.trainable", "title": "params", "fmt": ".0f"}],
    "figure": {"x": "params.trainable", "y": ["metrics.test/nll"],
               "hue": "settings.method.variance"},
}
# test NLL by variance and seed, chosen so that mean and sample std (ddof=1) are exact:
#   embedded 1, 2, 4:     mean 7/3, deviations -4/3, -1/3, 5/3 → variance (42/9) / 2 = 7/3
#   learned  0.5, 0.5, 1.1: mean 0.7, deviations -0.2, -0.2, 0.4 → variance 0.24 / 2 = 0.12
NLL = {"embedded": [1.0, 2.0, 4.0], "learned": [0.5, 0.5, 1.1]}
PARAMS = {"embedded": 100, "learned": 120}
EXPECTED = {"embedded": (7 / 3, math.sqrt(7 / 3)), "learned": (0.7, math.sqrt(0.12))}


def result(variance: str, seed: int, nll: float) -> dict:
    return {"experiment": "toy", "seed": seed, "settings": {"method": {"variance": variance}},
            "params": {"trainable": PARAMS[variance]}, "metrics": {"test/nll": nll},
            "table": SPEC}


def write(path: Path, obj: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """runs/toy/<variance>/seed<k>/results.json: 2 settings × 3 seeds, all valid."""
    root = tmp_path / "runs"
    for variance, values in NLL.items():
        for seed, nll in enumerate(values):
            write(root / "toy" / variance / f"seed{seed}" / "results.json",
                  result(variance, seed, nll))
    return root


def build(runs: Path, capsys: pytest.CaptureFixture[str]) -> tuple[pd.DataFrame, str, list[str]]:
    """Run `uqbench-tables`; (the CSV table by variance, the Markdown, stderr's lines)."""
    out = runs.parent / "tables"
    main(["--runs", str(runs), "--out", str(out), "--quiet"])
    csv = pd.read_csv(out / "toy.csv").set_index("variance")
    assert (out / "toy.tex").exists() and (out / "toy.png").exists()
    return csv, (out / "toy.md").read_text(), capsys.readouterr().err.splitlines()


def assert_expected_table(csv: pd.DataFrame) -> None:
    assert sorted(csv.index) == ["embedded", "learned"]
    for variance, (mean, std) in EXPECTED.items():
        assert csv.loc[variance, "NLL mean"] == pytest.approx(mean)
        assert csv.loc[variance, "NLL std"] == pytest.approx(std)
        assert csv.loc[variance, "params mean"] == PARAMS[variance]
        assert csv.loc[variance, "seeds"] == 3


def test_valid_runs_give_hand_computed_cells_and_no_warning(runs, capsys):
    csv, md, err = build(runs, capsys)
    assert_expected_table(csv)
    assert "2.333 ± 1.528" in md and "0.700 ± 0.346" in md  # sample std, ddof=1
    assert err == []


def _good(variance: str = "embedded", seed: int = 9) -> dict:
    return result(variance, seed, 1000.0)  # would move every mean if it were counted


def _without(key: str) -> dict:
    return {k: v for k, v in _good().items() if k != key}


# (what to put at runs/toy/embedded/bad/results.json, a phrase the warning must contain)
BAD: dict[str, tuple[Callable[[Path], None], str]] = {
    "null": (lambda p: p.write_text("null"), "holds null, not an object"),
    "array": (lambda p: p.write_text("[]"), "holds an array, not an object"),
    "not utf-8": (lambda p: p.write_bytes(json.dumps(_good()).encode().replace(b"toy", b"t\xf6y")),
                  "not UTF-8"),
    "truncated": (lambda p: p.write_text(json.dumps(_good())[:40]), "not valid JSON"),
    "empty": (lambda p: p.write_text(""), "not valid JSON"),
    "directory": (lambda p: p.mkdir(), "is a directory"),
    "no metrics": (lambda p: p.write_text(json.dumps(_without("metrics"))), "lacks metrics"),
    "no seed": (lambda p: p.write_text(json.dumps(_without("seed"))), "lacks seed"),
    "no experiment": (lambda p: p.write_text(json.dumps(_without("experiment"))),
                      "lacks experiment"),
    "metrics a list": (lambda p: p.write_text(json.dumps(_good() | {"metrics": [1.0]})),
                       "metrics is an array, not an object"),
    "seed a string": (lambda p: p.write_text(json.dumps(_good() | {"seed": "9"})),
                      "seed is a string, not an integer"),
    "metric a string": (lambda p: p.write_text(json.dumps(_good() | {"metrics": {
        "test/nll": "low"}})), "metrics.test/nll is a string, not a number"),
    "setting an object": (lambda p: p.write_text(json.dumps(_good() | {"settings": {
        "method": {"variance": {"a": 1}}}})), "settings.method.variance is an object"),
    "table rows not a list": (lambda p: p.write_text(json.dumps(_good() | {"table": SPEC | {
        "rows": "variance"}})), "table.rows is not a list"),
    "bad fmt": (lambda p: p.write_text(json.dumps(_good() | {"table": SPEC | {
        "columns": [{"key": "metrics.test/nll", "title": "NLL", "fmt": "%.3f"}]}})),
        "table column 'NLL' has a bad fmt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_is_skipped_with_one_warning(runs, capsys, case):
    make, problem = BAD[case]
    bad = runs / "toy" / "embedded" / "bad" / "results.json"
    bad.parent.mkdir(parents=True)
    make(bad)
    csv, _, err = build(runs, capsys)
    assert_expected_table(csv)
    assert len(err) == 1, err
    assert err[0].startswith(f"warning: skipping {bad}: ") and problem in err[0]


def test_every_bad_file_at_once_each_named_once(runs, capsys):
    bad = []
    for i, (make, _) in enumerate(BAD.values()):
        bad.append(runs / "toy" / "learned" / f"bad{i:02d}" / "results.json")
        bad[-1].parent.mkdir(parents=True)
        make(bad[-1])
    csv, _, err = build(runs, capsys)
    assert_expected_table(csv)
    assert len(err) == len(BAD)
    for path in bad:
        assert sum(f"skipping {path}:" in line for line in err) == 1


def test_a_copied_run_counts_once_and_the_warning_names_both(runs, capsys):
    original = runs / "toy" / "embedded" / "seed1" / "results.json"
    copy = runs / "toy" / "embedded" / "seed1_copy" / "results.json"  # after it in path order
    copy.parent.mkdir()
    shutil.copy(original, copy)
    csv, _, err = build(runs, capsys)
    assert_expected_table(csv)
    assert len(err) == 1
    assert f"skipping {copy}:" in err[0] and str(original) in err[0] and "seed 1" in err[0]


def test_of_two_results_for_one_seed_the_first_in_path_order_is_kept(runs, capsys):
    """A differing result for embedded seed 0 in a folder that sorts first ("0_backup" <
    "toy") replaces the one under toy/: embedded NLL becomes 10, 2, 4."""
    first = write(runs / "0_backup" / "results.json", result("embedded", 0, 10.0))
    later = runs / "toy" / "embedded" / "seed0" / "results.json"
    csv, _, err = build(runs, capsys)
    # mean 16/3; deviations 14/3, -10/3, -4/3 → variance (312/9) / 2 = 52/3
    assert csv.loc["embedded", "NLL mean"] == pytest.approx(16 / 3)
    assert csv.loc["embedded", "NLL std"] == pytest.approx(math.sqrt(52 / 3))
    assert csv.loc["embedded", "seeds"] == 3 and csv.loc["learned", "seeds"] == 3
    assert len(err) == 1
    assert f"skipping {later}:" in err[0] and f"already in {first}" in err[0]


def test_a_run_without_the_figure_x_still_counts(runs, capsys):
    """params is optional: a fourth seed without it enters the NLL cell, not the params cell,
    and the figure is still drawn."""
    write(runs / "toy" / "learned" / "seed3" / "results.json",
          {k: v for k, v in result("learned", 3, 0.7).items() if k != "params"})
    csv, _, err = build(runs, capsys)
    # 0.5, 0.5, 1.1, 0.7: mean 0.7, squared deviations .04 + .04 + .16 + 0 → variance .24 / 3
    assert csv.loc["learned", "NLL mean"] == pytest.approx(0.7)
    assert csv.loc["learned", "NLL std"] == pytest.approx(math.sqrt(0.08))
    assert csv.loc["learned", "params mean"] == PARAMS["learned"]
    assert csv.loc["learned", "seeds"] == 4
    assert err == []


def test_an_experiment_with_only_bad_files_keeps_its_clear_error(runs, tmp_path, capsys):
    bad = write(runs / "other" / "seed0" / "results.json", _without("metrics") | {
        "experiment": "other"})
    with pytest.raises(SystemExit) as exit_:
        main(["--runs", str(runs), "--out", str(tmp_path / "tables"), "--experiment", "other"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert f"skipping {bad}: lacks metrics" in err[0]
    assert re.fullmatch(r"error: no valid results with a table for experiment 'other'.*"
                        r"experiments found: toy\)", err[1])
    assert err[2:] == [HINT]  # one warning, one error line, the hint: nothing else


def test_a_runs_folder_without_valid_results_says_so_and_writes_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "results.json").write_text("null")
    main(["--runs", str(runs), "--out", str(tmp_path / "tables")])  # returns: exit status 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: skipping {runs / 'a' / 'results.json'}: holds null, not an object",
                   f"no valid results with a table spec under {runs}"]
    assert not list((tmp_path / "tables").glob("*.md"))


def test_series_and_faceted_figures_are_drawn_and_checked(runs, capsys, monkeypatch):
    """A `series` figure draws one line through several keys (the mean over seeds at each),
    `facet` one row of panels per value; a series whose labels do not match is refused."""
    spec = {**SPEC, "figures": {"sev": {"series": ["metrics.test/nll", "params.trainable"],
                                        "labels": [0, 1], "hue": "settings.method.variance",
                                        "facet": "settings.method.variance"}}}
    for path in runs.rglob("results.json"):
        res = json.loads(path.read_text())
        write(path, {**res, "table": spec})
    drawn: list[tuple] = []

    def record(self, xs, means, **kwargs):  # every line drawn: (label, xs, means)
        drawn.append((kwargs.get("label"), list(xs), [round(m, 9) for m in means]))

    monkeypatch.setattr("matplotlib.axes.Axes.errorbar", record)
    build(runs, capsys)
    out = runs.parent / "tables"
    assert (out / "toy_sev.png").is_file() and (out / "toy.png").is_file()
    # series lines: (0, mean NLL), (1, params) per variance, hand-computed from NLL and PARAMS
    assert ("embedded", [0, 1], [round(7 / 3, 9), 100.0]) in drawn
    assert ("learned", [0, 1], [round(0.7, 9), 120.0]) in drawn
    bad = {**spec, "figures": {"sev": {**spec["figures"]["sev"], "labels": [0]}}}
    write(runs / "toy" / "embedded" / "seed0" / "results.json",
          {**result("embedded", 0, 1.0), "table": bad})
    _, _, warnings = build(runs, capsys)
    assert any("series and labels" in w for w in warnings)


def _scoring(variance: str, seed: int, nll: float, covariance: str = "full") -> dict:
    """A scoring job's results of one run (``job: eval``): the run's settings with a scoring
    option changed, no table of its own."""
    res = result(variance, seed, nll)
    res["settings"]["method"]["covariance"] = covariance
    return {k: v for k, v in res.items() if k != "table"} | {"job": "eval"}


def test_scorings_stay_out_of_a_table_unless_it_asks_and_then_are_rows(runs, capsys):
    """A scoring sorts before its run (eval/ < results.json): without ``scorings`` it is not a
    row (it used to be one, of "–" keys); with ``scorings: true`` and a row key whose
    ``default`` stands for the runs stored before the key existed, it is its own row."""
    for seed in range(3):
        write(runs / "toy" / "embedded" / f"seed{seed}" / "eval" / "full" / "results.json",
              _scoring("embedded", seed, 0.25 * (seed + 1)))
    csv, md, err = build(runs, capsys)
    assert_expected_table(csv)
    assert "–" not in md and err == []

    spec = SPEC | {"scorings": True, "rows": SPEC["rows"] + [
        {"key": "settings.method.covariance", "title": "covariance", "default": "diagonal"}]}
    for path in runs.rglob("results.json"):
        res = json.loads(path.read_text())
        if "table" in res:
            write(path, res | {"table": spec})
    out = runs.parent / "tables"
    main(["--runs", str(runs), "--out", str(out), "--quiet"])
    table = pd.read_csv(out / "toy.csv").set_index(["variance", "covariance"])
    assert sorted(table.index) == [("embedded", "diagonal"), ("embedded", "full"),
                                   ("learned", "diagonal")]
    assert table.loc[("embedded", "full"), "NLL mean"] == pytest.approx(0.5)  # 0.25, 0.5, 0.75
    assert table.loc[("embedded", "diagonal"), "NLL mean"] == pytest.approx(7 / 3)
    assert table.loc[("embedded", "full"), "params mean"] == PARAMS["embedded"]
    assert capsys.readouterr().err == ""


def test_a_scoring_that_changes_no_row_key_never_replaces_its_run(runs, capsys):
    """With ``scorings: true``, a scoring whose settings show the same row values as its run
    (another inference the rows do not tell apart) is skipped with a warning, not kept in
    the run's place although it comes first in path order."""
    for path in runs.rglob("results.json"):
        write(path, json.loads(path.read_text()) | {"table": SPEC | {"scorings": True}})
    scoring = write(runs / "toy" / "embedded" / "seed0" / "eval" / "mc" / "results.json",
                    _scoring("embedded", 0, 100.0, covariance="diagonal"))
    csv, _, err = build(runs, capsys)
    assert_expected_table(csv)
    assert len(err) == 1 and f"skipping {scoring}:" in err[0]


def test_scorings_must_be_true_or_false(runs, capsys):
    bad = write(runs / "toy" / "embedded" / "bad" / "results.json",
                _good() | {"table": SPEC | {"scorings": "yes"}})
    csv, _, err = build(runs, capsys)
    assert_expected_table(csv)
    assert err == [f"warning: skipping {bad}: table.scorings is not true or false"]


def test_a_verdict_column_judges_every_run_by_its_bound(runs, capsys):
    # |NLL| ≤ 1.5 by hand: embedded 1, 2, 4 → one of three runs within; learned 0.5, 0.5,
    # 1.1 → all three. With a bound of 0.9: learned has two of three, embedded none.
    spec = SPEC | {"columns": [*SPEC["columns"],
                               {"key": "metrics.test/nll", "title": "NLL ≤ 1.5",
                                "within": 1.5},
                               {"key": "metrics.test/nll", "title": "NLL ≤ 0.9",
                                "within": 0.9}]}
    for path in runs.rglob("results.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"table": spec}))
    csv, md, err = build(runs, capsys)
    assert csv.loc["embedded", "NLL ≤ 1.5"] == "1/3 ✓" and csv.loc["learned", "NLL ≤ 1.5"] == "✓"
    assert csv.loc["embedded", "NLL ≤ 0.9"] == "✗" and csv.loc["learned", "NLL ≤ 0.9"] == "2/3 ✓"
    assert "| 1/3 ✓" in md and err == []


@pytest.mark.parametrize("bound", [0, -2, "two", True])
def test_a_verdict_bound_that_is_no_positive_number_is_refused(runs, capsys, bound):
    spec = SPEC | {"columns": [{"key": "metrics.test/nll", "title": "NLL", "within": bound}]}
    path = write(runs / "toy" / "embedded" / "bad" / "results.json", _good() | {"table": spec})
    main(["--runs", str(runs), "--out", str(runs.parent / "tables"), "--quiet"])
    err = capsys.readouterr().err
    assert str(path) in err and "within" in err and "positive number" in err
