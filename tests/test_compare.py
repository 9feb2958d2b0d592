"""uqbench-compare: two folders of tables, cell by cell, on hand-written tables whose margins
are computed by hand, and on tables uqbench-tables itself writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from uqbench.report.compare import compare_folders, display_unit, main
from uqbench.report.tables import main as tables_main

HEADER = "method,M,ACC mean,ACC std,NLL mean,NLL std,seeds"
MD_HEADER = "| method | M | ACC | NLL | seeds |\n|:--|:--|:--|:--|:--|"
# Side A: SVE over 3 seeds with spreads; DE from one seed (no spread)
A_CSV = ["sve,4,95.0,1.2,0.2004,0.0001,3", "de,4,94.04,,0.3,,1"]
A_MD = ["| sve | 4 | 95.0 ± 1.2 | 0.200 ± 0.000 | 3 |", "| de | 4 | 94.0 | 0.300 | 1 |"]


def write(folder: Path, csv_rows: list[str], md_rows: list[str], name: str = "toy",
          header: str = HEADER, md_header: str = MD_HEADER) -> Path:
    """``<name>.csv`` and ``<name>.md`` as uqbench-tables lays them out."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.csv").write_text("\n".join([header, *csv_rows]) + "\n")
    (folder / f"{name}.md").write_text(f"## {name}\n\n" + "\n".join([md_header, *md_rows])
                                       + "\n")
    return folder


def run(capsys, a: Path, b: Path, *flags: str) -> tuple[int, str]:
    """uqbench-compare's exit status and output."""
    try:
        main([str(a), str(b), *flags])
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    return code, capsys.readouterr().out


def test_the_display_unit_is_one_unit_of_the_last_digit_shown():
    assert display_unit("95.0") == pytest.approx(0.1)
    assert display_unit("95.0 ± 1.2") == pytest.approx(0.1)
    assert display_unit("0.200") == pytest.approx(0.001)
    assert display_unit("12") == 1
    assert display_unit("1.2e+03") == pytest.approx(100)
    assert display_unit("–") == 0


def test_agreeing_tables(tmp_path, capsys):
    """SVE ACC 95.0 ± 1.2 against 96.5 ± 1.0 over 3 seeds: allowed 2·sqrt((1.2² + 1.0²)/3) =
    1.8037 ≥ |Δ| = 1.5. NLL 0.2004 against 0.2013 (std 0.0001): 2·SE = 0.00016, but both show
    three decimals, so up to 0.001 is rounding: |Δ| = 0.0009 agrees. DE (one seed): 94.04 and
    93.96 both show 94.0, equal as shown."""
    a = write(tmp_path / "a", A_CSV, A_MD)
    b = write(tmp_path / "b", ["sve,4,96.5,1.0,0.2013,0.0001,3", "de,4,93.96,,0.3,,1"],
              ["| sve | 4 | 96.5 ± 1.0 | 0.201 ± 0.000 | 3 |", "| de | 4 | 94.0 | 0.300 | 1 |"])
    code, out = run(capsys, a, b)
    assert code == 0
    assert "toy: 2 rows × 3 columns, 6 cells: 6 agree, 0 disagree" in out
    assert out.rstrip().endswith("AGREE: every cell of 1 experiment")


def test_a_difference_beyond_two_standard_errors_disagrees(tmp_path, capsys):
    """ACC 95.0 ± 1.2 against 97.0 ± 1.0 (3 seeds): |Δ| = 2.0 > 1.8037 allowed; NLL 0.2004
    against 0.2016: |Δ| = 0.0012 > 0.001, the display unit (2·SE 0.00016 is smaller)."""
    a = write(tmp_path / "a", A_CSV, A_MD)
    b = write(tmp_path / "b", ["sve,4,97.0,1.0,0.2016,0.0001,3", A_CSV[1]],
              ["| sve | 4 | 97.0 ± 1.0 | 0.202 ± 0.000 | 3 |", A_MD[1]])
    code, out = run(capsys, a, b)
    assert code == 1
    allowed = 2 * math.sqrt((1.2**2 + 1.0**2) / 3)
    assert f"{allowed:.4g}" == "1.804"
    assert ("[method=sve, M=4] ACC: A 95.0 ± 1.2, B 97.0 ± 1.0: |Δ| 2 > allowed 1.804"
            in out)
    assert "[method=sve, M=4] NLL: A 0.200 ± 0.000, B 0.202 ± 0.000: |Δ| 0.0012 > allowed " \
           "0.001" in out
    assert "toy: 2 rows × 3 columns, 6 cells: 4 agree, 2 disagree" in out
    assert "DIFFER: 1 of 1 experiments (toy)" in out
    [cell] = [c for c in compare_folders(a, b)[0].disagreeing if c.column == "ACC"]
    assert cell.allowed == pytest.approx(allowed) and cell.difference == pytest.approx(2.0)


def test_a_cell_without_spread_must_be_equal_as_shown(tmp_path, capsys):
    """DE from one seed: 94.04 against 94.06 shows 94.0 both (agrees); 94.04 against 94.12
    shows 94.0 and 94.1: |Δ| = 0.08 is less than a unit shown, yet it disagrees."""
    a = write(tmp_path / "a", A_CSV, A_MD)
    same = write(tmp_path / "same", [A_CSV[0], "de,4,94.06,,0.3,,1"], A_MD)
    shifted = write(tmp_path / "b", [A_CSV[0], "de,4,94.12,,0.3,,1"],
                    [A_MD[0], "| de | 4 | 94.1 | 0.300 | 1 |"])
    assert run(capsys, a, same)[0] == 0
    code, out = run(capsys, a, shifted)
    assert code == 1
    assert "[method=de, M=4] ACC: A 94.0, B 94.1: not equal (no spread: equal as shown)" in out


def test_a_row_or_column_on_one_side_only_fails(tmp_path, capsys):
    a = write(tmp_path / "a", A_CSV, A_MD)
    b = write(tmp_path / "b", A_CSV[:1], A_MD[:1])
    code, out = run(capsys, a, b)
    assert code == 1
    assert "toy: 1 rows × 3 columns, 3 cells: 3 agree, 0 disagree; 1 rows and 0 columns on " \
           "one side only" in out
    assert "row [method=de, M=4] only in A" in out
    wider = tmp_path / "c"  # one more column, ECE, before seeds
    wider.mkdir()
    (wider / "toy.csv").write_text(
        "method,M,ACC mean,ACC std,NLL mean,NLL std,ECE mean,ECE std,seeds\n"
        "sve,4,95.0,1.2,0.2004,0.0001,3.0,0.5,3\nde,4,94.04,,0.3,,2.0,,1\n")
    (wider / "toy.md").write_text(
        "## toy\n\n| method | M | ACC | NLL | ECE | seeds |\n|:--|:--|:--|:--|:--|:--|\n"
        "| sve | 4 | 95.0 ± 1.2 | 0.200 ± 0.000 | 3.0 ± 0.5 | 3 |\n"
        "| de | 4 | 94.0 | 0.300 | 2.0 | 1 |\n")
    code, out = run(capsys, a, wider)
    assert code == 1 and "column 'ECE' only in B" in out
    assert run(capsys, a, wider, "--ignore", "ECE")[0] == 0


def test_missing_values_seeds_and_experiments(tmp_path, capsys):
    """"–" agrees only with "–"; a row over other seeds disagrees in its seeds cell; a table
    in one folder only fails; --experiment compares only the one named."""
    a = write(tmp_path / "a", A_CSV, A_MD)
    write(tmp_path / "a", ["sve,4,,,0.2,,1"], ["| sve | 4 | – | 0.200 | 1 |"], name="other")
    b = write(tmp_path / "b", [A_CSV[0], "de,4,,,0.3,,1"],
              [A_MD[0], "| de | 4 | – | 0.300 | 1 |"])
    code, out = run(capsys, a, b)
    assert code == 1
    assert "[method=de, M=4] ACC: A 94.0, B –: not equal (a value on one side only)" in out
    assert "other: only in A" in out
    code, out = run(capsys, a, b, "--experiment", "other")
    assert code == 1 and out.splitlines()[0] == "other: only in A"
    fewer = write(tmp_path / "c", ["sve,4,95.0,1.2,0.2004,0.0001,2", A_CSV[1]],
                  ["| sve | 4 | 95.0 ± 1.2 | 0.200 ± 0.000 | 2 |", A_MD[1]])
    code, out = run(capsys, a, fewer, "--experiment", "toy")
    assert code == 1 and "[method=sve, M=4] seeds: A 3, B 2: not equal" in out


def test_bad_folders_and_experiments_are_named(tmp_path, capsys):
    a = write(tmp_path / "a", A_CSV, A_MD)
    try:
        main([str(a), str(tmp_path / "nowhere")])
    except SystemExit as exit_:
        assert exit_.code == 1
    assert "tables folder" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        compare_folders(a, tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"no table of p9 .*tables there: toy"):
        compare_folders(a, a, ["p9"])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "toy.csv").write_text("method,ACC\nsve,95\n")
    (tmp_path / "bad" / "toy.md").write_text("| method | ACC |\n|:--|:--|\n| sve | 95 |\n")
    with pytest.raises(ValueError, match="is not a table of uqbench-tables"):
        compare_folders(a, tmp_path / "bad")


# --- tables as uqbench-tables writes them ----------------------------------------------------

SPEC = {"title": "toy", "rows": [{"key": "settings.method.name", "title": "method"}],
        "columns": [{"key": "metrics.test/acc", "title": "ACC", "fmt": ".1f", "scale": 100},
                    {"key": "metrics.test/nll", "title": "NLL", "fmt": ".3f"}]}


def write_runs(root: Path, acc: dict[str, list[float]]) -> Path:
    for method, values in acc.items():
        for seed, value in enumerate(values):
            path = root / "toy" / method / f"seed{seed}" / "results.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps({"experiment": "toy", "seed": seed, "table": SPEC,
                                        "settings": {"method": {"name": method}},
                                        "metrics": {"test/acc": value, "test/nll": 0.5}}))
    return root


def test_tables_from_uqbench_tables(tmp_path, capsys):
    """Accuracies (×100) over 3 seeds, A: sve 90, 92, 94 (92.0 ± 2.0); B: sve 91, 93, 95
    (93.0 ± 2.0): |Δ| = 1.0 ≤ 2·sqrt((2² + 2²)/3) = 3.27. de: 90 in every seed against 80 (no
    spread: 90.0 against 80.0) disagrees."""
    tables = {}
    for side, acc in (("a", {"sve": [0.90, 0.92, 0.94], "de": [0.9] * 3}),
                      ("b", {"sve": [0.91, 0.93, 0.95], "de": [0.8] * 3})):
        runs = write_runs(tmp_path / side / "runs", acc)
        tables_main(["--runs", str(runs), "--out", str(tmp_path / side / "tables"), "--quiet"])
        tables[side] = tmp_path / side / "tables"
    capsys.readouterr()
    code, out = run(capsys, tables["a"], tables["b"])
    assert code == 1
    assert "toy: 2 rows × 3 columns, 6 cells: 5 agree, 1 disagree" in out
    assert "[method=de] ACC: A 90.0, B 80.0: not equal (no spread: equal as shown)" in out
    sve = [c for c in compare_folders(tables["a"], tables["b"])[0].cells
           if c.row == ("sve",) and c.column == "ACC"][0]
    assert sve.agree and sve.allowed == pytest.approx(2 * math.sqrt(8 / 3), rel=1e-9)
    assert run(capsys, tables["a"], tables["a"])[0] == 0


def test_a_verdict_or_failure_column_is_compared_as_shown(tmp_path, capsys):
    """A verdict (✓/✗, written as text in the CSV) and the failed count have no mean: a
    rerun that flips a verdict disagrees, one that keeps it agrees."""
    header = "method,M,ACC mean,ACC std,within,seeds,failed"  # failed after seeds, as written
    md_header = "| method | M | ACC | within | seeds | failed |\n|:--|:--|:--|:--|:--|:--|"
    a = write(tmp_path / "a", ["sve,4,95.0,1.2,✓,3,0"], ["| sve | 4 | 95.0 ± 1.2 | ✓ | 3 | 0 |"],
              header=header, md_header=md_header)
    same = write(tmp_path / "same", ["sve,4,95.1,1.2,✓,3,0"],
                 ["| sve | 4 | 95.1 ± 1.2 | ✓ | 3 | 0 |"], header=header, md_header=md_header)
    code, out = run(capsys, a, same)
    assert code == 0 and "1 rows × 4 columns, 4 cells: 4 agree" in out
    flipped = write(tmp_path / "flipped", ["sve,4,95.0,1.2,2/3 ✓,3,1"],
                    ["| sve | 4 | 95.0 ± 1.2 | 2/3 ✓ | 3 | 1 |"], header=header,
                    md_header=md_header)
    code, out = run(capsys, a, flipped)
    assert code == 1
    assert "within: A ✓, B 2/3 ✓" in out and "failed: A 0, B 1" in out


def test_a_table_that_ends_otherwise_is_refused(tmp_path, capsys):
    header = "method,M,ACC mean,ACC std,seeds,notes"
    md_header = "| method | M | ACC | seeds | notes |\n|:--|:--|:--|:--|:--|"
    a = write(tmp_path / "a", ["sve,4,95.0,1.2,3,x"], ["| sve | 4 | 95.0 ± 1.2 | 3 | x |"],
              header=header, md_header=md_header)
    code, out = run(capsys, a, a)
    assert code != 0
