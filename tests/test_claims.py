"""The claims table: each paper claim, its measurement and verdict, from results files.

The fixture writes results.json files by hand; every expected value below is computed by hand
from the numbers in the fixture."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from uqbench.report import claims as C
from uqbench.report.tables import main as tables_main

ROWS = [{"key": "settings.backbone.width", "title": "width"},
        {"key": "settings.method.variance", "title": "variance"}]


def claim(kind: str, key: str = "metrics.test/nll", a: dict | None = None,
          b: dict | None = None, **extra) -> dict:
    return {"claim": f"{kind} claim", "kind": kind, "key": key,
            "a": a or {"width": 4, "variance": "learned"},
            "b": b or {"width": 4, "variance": "embedded"}, **extra}


def run(width: int, variance: str, seed: int, nll: float, variant: str | None = None,
        **metrics: float) -> dict:
    return {"experiment": "p2x", "seed": seed, "variant": variant,
            "settings": {"backbone": {"width": width}, "method": {"variance": variance}},
            "params": {"trainable": 3 * width + 1 + (width + 1 if variance == "learned" else 0)},
            "metrics": {"test/nll": nll, **metrics}}


def test_greater_verdicts_and_values_by_hand():
    base = [0.5, 0.6, 0.7]
    cases = {  # learned − embedded per seed → verdict
        C.HOLDS: [0.1, 0.2, 0.05],     # every seed agrees
        C.UNCLEAR: [0.1, -0.05, 0.1],  # mean 0.05 > 0, one seed disagrees
        C.FAILS: [-0.1, -0.2, 0.05],   # mean < 0
    }
    for verdict, diffs in cases.items():
        runs = [run(4, "embedded", s, base[s]) for s in range(3)]
        runs += [run(4, "learned", s, base[s] + diffs[s]) for s in range(3)]
        res = C.evaluate(claim("greater"), runs, ROWS)
        assert res["verdict"] == verdict, (verdict, res)
        assert res["seeds"] == 3
    # the value of the first case: mean 0.11667, sample std 0.07638 (by hand)
    runs = [run(4, "embedded", s, base[s]) for s in range(3)]
    runs += [run(4, "learned", s, base[s] + cases[C.HOLDS][s]) for s in range(3)]
    res = C.evaluate(claim("greater"), runs, ROWS)
    assert res["value"] == "0.117 ± 0.076"
    assert res["mean"] == pytest.approx(0.116667, abs=1e-6)
    assert res["std"] == pytest.approx(0.076376, abs=1e-6)


def test_seeds_pair_and_a_difference_of_keys():
    # seed 2 of the learned model is missing: only seeds 0 and 1 pair
    runs = [run(4, "embedded", s, 0.1, **{"ood/nll": 1.0 + s}) for s in range(3)]
    runs += [run(4, "learned", s, 0.1, **{"ood/nll": 3.0 + s}) for s in range(2)]
    res = C.evaluate(claim("greater", key=["metrics.ood/nll", "metrics.test/nll"]), runs, ROWS)
    assert res["seeds"] == 2 and res["mean"] == pytest.approx(2.0)  # (3+s−0.1) − (1+s−0.1)
    assert res["verdict"] == C.HOLDS


def test_alike_below_ratio_and_missing():
    runs = [run(1024, "embedded", s, 1.0) for s in range(3)]
    runs += [run(1024, "learned", s, 1.0 + d) for s, d in enumerate([0.01, -0.01, 0.02])]
    at_1024 = {"a": {"width": 1024, "variance": "learned"},
               "b": {"width": 1024, "variance": "embedded"}}
    assert C.evaluate(claim("alike", **at_1024), runs, ROWS)["verdict"] == C.HOLDS  # mixed sign
    far = [run(1024, "embedded", s, 1.0) for s in range(3)]
    far += [run(1024, "learned", s, 1.0 + d) for s, d in enumerate([0.5, 0.6, 0.4])]
    assert C.evaluate(claim("alike", **at_1024), far, ROWS)["verdict"] == C.FAILS  # 0.5 > 0.1
    near = [run(1024, "embedded", s, 1.0) for s in range(3)]
    near += [run(1024, "learned", s, 1.05) for s in range(3)]  # same sign, within 10 %
    assert C.evaluate(claim("alike", **at_1024), near, ROWS)["verdict"] == C.HOLDS

    ratios = [run(4, "learned", s, 0.1, **{"test/noise_std_ratio": r})
              for s, r in enumerate([0.8, 0.9, 0.85])]
    below = claim("below", key="metrics.test/noise_std_ratio", than=1.0)
    res = C.evaluate(below, ratios, ROWS)
    assert res["verdict"] == C.HOLDS and res["value"] == "0.850 ± 0.050"
    res = C.evaluate(claim("above", key="metrics.test/noise_std_ratio", than=1.0), ratios, ROWS)
    assert res["verdict"] == C.FAILS

    params = [run(4, v, 0, 0.1) for v in ("embedded", "learned")]  # 13 vs 18 parameters
    res = C.evaluate(claim("ratio", key="params.trainable", range=[0.32, 0.36]), params, ROWS)
    assert res["value"] == "+38.5%" and res["verdict"] == C.FAILS  # 18/13 − 1
    res = C.evaluate(claim("ratio", key="params.trainable", range=[0.30, 0.40]), params, ROWS)
    assert res["verdict"] == C.HOLDS

    nowhere = claim("greater", a={"width": 64, "variance": "learned"},
                    b={"width": 64, "variance": "embedded"})
    assert C.evaluate(nowhere, runs, ROWS)["verdict"] == C.MISSING


@pytest.mark.parametrize("bad, words", [
    ([{"claim": "x", "kind": "bigger", "key": "k", "a": {"width": 4}, "b": {"width": 4}}],
     "kind 'bigger' is not one of"),
    ([{"claim": "x", "kind": "greater", "key": "k", "a": {"depth": 4}, "b": {"width": 4}}],
     "['depth'], which are not row titles"),
    ([{"claim": "x", "kind": "below", "key": "k", "a": {"width": 4}}], "needs than"),
    ([{"claim": "x", "kind": "ratio", "key": "k", "a": {"width": 4}, "b": {"width": 4},
       "range": [0.4, 0.3]}], "range"),
])
def test_bad_claims_spec_is_named(bad, words):
    with pytest.raises(C.InvalidClaims, match=None) as err:
        C.check_claims(bad, ["width", "variance"])
    assert words in str(err.value)


def _write(root: Path, runs: list[dict], spec: dict) -> None:
    for i, r in enumerate(runs):
        path = root / f"run{i}" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(r | {"table": spec}))


def test_uqbench_tables_writes_the_claims_table_and_the_grid(tmp_path, capsys):
    spec = {"title": "P2x", "rows": ROWS,
            "columns": [{"key": "metrics.test/nll", "title": "test NLL"}],
            "claims": [claim("greater") | {"claim": "embedded fits better at width 4",
                                           "short": "ID @4", "measure": "NLL diff"},
                       claim("ratio", key="params.trainable", range=[0.30, 0.40])
                       | {"claim": "about a third more parameters", "short": "params"}]}
    runs = [run(4, "embedded", s, 0.5) for s in range(3)]
    runs += [run(4, "learned", s, 0.5 + d) for s, d in enumerate([0.1, 0.2, 0.05])]
    _write(tmp_path / "runs", runs, spec)
    tables_main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t")])
    md = (tmp_path / "t" / "p2x_claims.md").read_text()
    cells = {tuple(c.strip() for c in line.strip("|").split("|"))
             for line in md.splitlines() if line.startswith("|")}
    assert ("embedded fits better at width 4", "NLL diff", "0.117 ± 0.076", "3", "holds") in cells
    assert ("about a third more parameters", "", "+38.5%", "3", "holds") in cells
    frame = pd.read_csv(tmp_path / "t" / "p2x_claims.csv")
    assert list(frame["verdict"]) == ["holds", "holds"]
    assert "embedded fits better at width 4" in capsys.readouterr().out  # printed too

    # by setup: the second setup flips the first claim
    grid_spec = spec | {"rows": [{"key": "variant", "title": "setup"}, *ROWS],
                        "claims_by": "variant"}
    flipped = [run(4, "embedded", s, 0.5, variant="other") for s in range(3)]
    flipped += [run(4, "learned", s, 0.4, variant="other") for s in range(3)]
    base = [r | {"variant": "default"} for r in runs]
    _write(tmp_path / "runs2", base + flipped, grid_spec)
    tables_main(["--runs", str(tmp_path / "runs2"), "--out", str(tmp_path / "t2"), "--quiet"])
    grid = pd.read_csv(tmp_path / "t2" / "p2x_claims.csv")
    assert list(grid["variant"]) == ["default", "other"]
    assert grid.loc[0, "ID @4"].startswith("✓ 0.117")
    assert grid.loc[1, "ID @4"].startswith("✗ -0.100")

    # the spec drops its claims: the old claims file goes, it would pass for the new spec's
    no_claims = {k: v for k, v in spec.items() if k != "claims"}
    _write(tmp_path / "runs3", runs, no_claims)
    tables_main(["--runs", str(tmp_path / "runs3"), "--out", str(tmp_path / "t"), "--quiet"])
    assert not (tmp_path / "t" / "p2x_claims.md").exists()


def test_a_results_file_with_a_bad_claims_spec_is_skipped_with_a_warning(tmp_path, capsys):
    spec = {"rows": ROWS, "columns": [{"key": "metrics.test/nll", "title": "test NLL"}],
            "claims": [claim("greater", a={"depth": 2})]}
    _write(tmp_path / "runs", [run(4, "embedded", 0, 0.5)], spec)
    tables_main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t"), "--quiet"])
    err = capsys.readouterr().err
    assert "skipping" in err and "not row titles" in err
