"""The claims table: each paper claim, its measurement and verdict, from results files.

The fixtures write results.json files by hand. Every expected interval is computed here from
its definition, mean ± t_{(1+c)/2, n−1} · sd/√n, with the t quantile from scipy.stats.t (and,
for the first case, checked against the printed t table), never by the code under test."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from scipy import stats

from uqbench.report import claims as C
from uqbench.report.tables import main as tables_main
from uqbench.report.validation import InvalidResults, check_spec

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"key": "settings.backbone.width", "title": "width"},
        {"key": "settings.method.variance", "title": "variance"}]


def hand_interval(d: list[float], confidence: float = 0.90) -> tuple[float, float, float]:
    """(mean, lo, hi) from the definition, written out."""
    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


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


def paired(diffs: list[float], width: int = 4) -> list[dict]:
    """Runs whose test NLL, learned − embedded, is ``diffs[s]`` in seed s (embedded: 0.5 +
    0.1·s, so its mean over three seeds is 0.6)."""
    runs = [run(width, "embedded", s, 0.5 + 0.1 * s) for s in range(len(diffs))]
    return runs + [run(width, "learned", s, 0.5 + 0.1 * s + d) for s, d in enumerate(diffs)]


def verdict(spec_claim: dict, runs: list[dict]) -> str:
    C.check_claims([spec_claim], ["width", "variance"])
    return C.evaluate(spec_claim, runs, ROWS)["verdict"]


def test_the_interval_is_the_student_t_interval_of_the_mean_paired_difference():
    d = [0.1, 0.2, 0.05]
    res = C.evaluate(claim("greater"), paired(d), ROWS)
    mean, lo, hi = hand_interval(d)
    # the printed t table: t_{0.95, 2} = 2.919986; the sample sd of d is 0.076376
    assert lo == pytest.approx(0.116667 - 2.919986 * 0.076376 / math.sqrt(3), abs=1e-5)
    assert (res["mean"], res["lo"], res["hi"]) == pytest.approx((mean, lo, hi), abs=1e-12)
    assert res["seeds"] == 3 and res["value"] == "0.117" and res["interval"] == "[-0.012, 0.245]"
    assert res["verdict"] == C.UNCLEAR  # every seed is > 0, yet the interval reaches below 0
    wider = C.evaluate(claim("greater"), paired(d), ROWS, confidence=0.95)
    assert (wider["lo"], wider["hi"]) == pytest.approx(hand_interval(d, 0.95)[1:], abs=1e-12)


def test_seeds_pair_and_a_difference_of_keys():
    # seed 2 of the learned model is missing: only seeds 0 and 1 pair
    runs = [run(4, "embedded", s, 0.1, **{"ood/nll": 1.0 + s}) for s in range(3)]
    runs += [run(4, "learned", s, 0.1, **{"ood/nll": 3.0 + s + 0.1 * s}) for s in range(2)]
    res = C.evaluate(claim("greater", key=["metrics.ood/nll", "metrics.test/nll"]), runs, ROWS)
    assert res["seeds"] == 2  # d = (3 + 1.1 s − 0.1) − (1 + s − 0.1) = 2 + 0.1 s
    assert (res["mean"], res["lo"], res["hi"]) == pytest.approx(hand_interval([2.0, 2.1]))
    assert res["verdict"] == C.HOLDS


@pytest.mark.parametrize("diffs, margin, expected", [
    ([0.10, 0.12, 0.11], None, C.HOLDS),        # [0.093, 0.127]: above 0
    ([-0.10, -0.12, -0.11], None, C.FAILS),     # [−0.127, −0.093]: at most 0
    ([0.05, -0.02, 0.08], None, C.UNCLEAR),     # [−0.050, 0.123]: straddles 0
    ([0.10, 0.12, 0.11], 0.05, C.HOLDS),        # above the margin 0.05
    ([0.10, 0.12, 0.11], 0.10, C.UNCLEAR),      # straddles 0.1
    ([0.10, 0.12, 0.11], 0.20, C.FAILS),        # wholly below 0.2
])
def test_greater(diffs, margin, expected):
    _, lo, hi = hand_interval(diffs)
    m = margin or 0.0
    assert expected == (C.HOLDS if lo > m else C.FAILS if hi <= m else C.UNCLEAR)
    extra = {} if margin is None else {"margin": margin}
    assert verdict(claim("greater", **extra), paired(diffs)) == expected


@pytest.mark.parametrize("diffs, expected", [
    ([0.005, -0.004, 0.001], C.HOLDS),     # d = −diffs: [−0.0069, 0.0083], above −0.02
    ([0.05, 0.06, 0.07], C.FAILS),         # d: [−0.077, −0.043], at most −0.02
    ([-0.015, 0.03, -0.01], C.UNCLEAR),    # d: [−0.040, 0.043], straddles −0.02
])
def test_not_worse_with_lower_is_better(diffs, expected):
    # "learned's NLL is not worse than embedded's by more than 0.02": d = embedded − learned
    c = claim("not_worse", better="lower", margin=0.02)
    _, lo, hi = hand_interval([-x for x in diffs])
    assert expected == (C.HOLDS if lo > -0.02 else C.FAILS if hi <= -0.02 else C.UNCLEAR)
    res = C.evaluate(c, paired(diffs), ROWS)
    assert res["verdict"] == expected and res["margin"] == "> -0.020"
    assert (res["lo"], res["hi"]) == pytest.approx((lo, hi))


def test_the_orientation_decides_not_worse():
    worse = paired([0.05, 0.06, 0.07])  # learned's NLL 0.06 higher
    assert verdict(claim("not_worse", better="lower", margin=0.02), worse) == C.FAILS
    assert verdict(claim("not_worse", margin=0.02), worse) == C.HOLDS  # if higher were better


def test_alike_with_seeds_of_both_signs_does_not_hold_when_the_interval_is_beyond_the_margin():
    d = [1.0, 1.1, 0.9, 1.05, -0.01]  # one seed disagrees in sign
    _, lo, _ = hand_interval(d)
    assert lo == pytest.approx(0.3664, abs=1e-4) and lo >= 0.1
    assert verdict(claim("alike", margin=0.1), paired(d)) == C.FAILS


@pytest.mark.parametrize("diffs, extra, expected", [
    ([0.15, -0.05, 0.12, 0.02], {"margin": 0.1}, C.UNCLEAR),  # [−0.048, 0.168]: mixed signs
    ([-0.005, 0.004, -0.001], {"margin": 0.02}, C.HOLDS),     # [−0.0083, 0.0069]: inside
    ([-0.15, -0.14, -0.16], {"margin": 0.1}, C.FAILS),        # [−0.167, −0.133]: below −0.1
    ([0.02, 0.03, 0.025], {"relative_margin": 0.1}, C.HOLDS),   # inside ±0.06 (10 % of 0.6)
    ([0.02, 0.03, 0.025], {"relative_margin": 0.02}, C.FAILS),  # [0.0166, 0.0334] ≥ 0.012
])
def test_alike(diffs, extra, expected):
    m = extra.get("margin", 0.6 * extra.get("relative_margin", 0))
    _, lo, hi = hand_interval(diffs)
    assert expected == (C.HOLDS if -m < lo and hi < m else C.FAILS if lo >= m or hi <= -m
                        else C.UNCLEAR)
    res = C.evaluate(claim("alike", **extra), paired(diffs), ROWS)
    assert res["verdict"] == expected
    if "relative_margin" in extra:  # measured, and as the grid's key gives it
        assert res["margin"] == f"inside ±{m:.3f} ({extra['relative_margin']:.0%} of |b|)"
        assert C.bound_text(claim("alike", **extra)) == (
            f"inside ±{extra['relative_margin']:.0%} of |b|")


@pytest.mark.parametrize("values, below, above", [
    ([0.8, 0.9, 0.85], C.HOLDS, C.FAILS),      # [0.766, 0.934]
    ([0.95, 1.05, 1.0], C.UNCLEAR, C.UNCLEAR),  # [0.916, 1.084]
    ([1.2, 1.3, 1.25], C.FAILS, C.HOLDS),      # [1.166, 1.334]
])
def test_below_and_above_a_number(values, below, above):
    runs = [run(4, "learned", s, 0.1, **{"test/noise_std_ratio": v})
            for s, v in enumerate(values)]
    mean, lo, hi = hand_interval(values)
    for kind, expected in (("below", below), ("above", above)):
        c = claim(kind, key="metrics.test/noise_std_ratio", than=1.0)
        del c["b"]
        res = C.evaluate(c, runs, ROWS)
        assert res["verdict"] == expected, kind
        # the value's own mean and interval are shown
        assert (res["mean"], res["lo"], res["hi"]) == pytest.approx((mean, lo, hi))
        assert res["margin"] == ("< 1.000" if kind == "below" else "> 1.000")


def test_one_seed_is_unclear_and_no_seed_is_not_measured():
    for kind, extra in (("greater", {}), ("alike", {"margin": 10.0})):
        res = C.evaluate(claim(kind, **extra), paired([0.3]), ROWS)
        assert res["verdict"] == C.UNCLEAR and res["interval"] == C.ONE_SEED
        assert res["seeds"] == 1 and res["value"] == "0.300"
    nowhere = claim("greater", a={"width": 64, "variance": "learned"},
                    b={"width": 64, "variance": "embedded"})
    res = C.evaluate(nowhere, paired([0.3, 0.2]), ROWS)
    assert res["verdict"] == C.MISSING and res["seeds"] == 0


def test_ratio_of_counts():
    params = [run(4, v, 0, 0.1) for v in ("embedded", "learned")]  # 13 vs 18 parameters
    res = C.evaluate(claim("ratio", key="params.trainable", range=[0.32, 0.36]), params, ROWS)
    assert res["value"] == "+38.5%" and res["verdict"] == C.FAILS  # 18/13 − 1
    res = C.evaluate(claim("ratio", key="params.trainable", range=[0.30, 0.40]), params, ROWS)
    assert res["verdict"] == C.HOLDS and res["interval"] == "–"


def test_a_side_that_several_runs_of_one_seed_match_is_refused():
    runs = paired([0.1, 0.2]) + paired([0.3, 0.1], width=8)
    loose = claim("greater", a={"variance": "learned"}, b={"variance": "embedded"})
    with pytest.raises(C.InvalidClaims, match="more than one run of seed 0.*claims_by"):
        C.evaluate(loose, runs, ROWS)


@pytest.mark.parametrize("bad, words", [
    ([{"claim": "x", "kind": "bigger", "key": "k", "a": {"width": 4}, "b": {"width": 4}}],
     "kind 'bigger' is not one of"),
    ([{"claim": "x", "kind": "greater", "key": "k", "a": {"depth": 4}, "b": {"width": 4}}],
     "['depth'], which are not row titles"),
    ([{"claim": "x", "kind": "below", "key": "k", "a": {"width": 4}}], "needs than"),
    ([{"claim": "x", "kind": "ratio", "key": "k", "a": {"width": 4}, "b": {"width": 4},
       "range": [0.4, 0.3]}], "range"),
    ([claim("alike")], "table.claims[0] (alike) needs a margin"),
    ([claim("not_worse", better="lower")], "table.claims[0] (not_worse) needs a margin"),
    ([claim("alike", margin=0.0)], "margin 0.0 is not a number > 0"),
    ([claim("greater", margin=-0.1)], "margin -0.1 is not a number >= 0"),
    ([claim("alike", margin=0.1, relative_margin=0.1)], "both margin and relative_margin"),
    ([claim("alike", tolerance=0.1)], "a tolerance relative to b is written relative_margin"),
    ([claim("greater", short="ID"), claim("ratio", short="ID", range=[0, 1])],
     "short titles ['ID'] name more than one claim"),
    ([claim("greater", better="smaller")], "better 'smaller' is not one of ('higher', 'lower')"),
    ([claim("below", than=1.0, margin=0.1)], "(below) does not read ['b', 'margin']"),
    ([claim("greater", fmt="%d")], "fmt '%d' is not a number format"),
])
def test_bad_claims_spec_is_named(bad, words):
    with pytest.raises(C.InvalidClaims) as err:
        C.check_claims(bad, ["width", "variance"])
    assert words in str(err.value)


@pytest.mark.parametrize("confidence", [1.5, 0, "high", True])
def test_a_bad_confidence_is_refused_with_the_table(confidence):
    spec = {"rows": ROWS, "columns": [{"key": "metrics.test/nll", "title": "NLL"}],
            "claims": [claim("greater")], "confidence": confidence}
    with pytest.raises(InvalidResults, match="table.confidence .* is not a number between 0 "
                                             "and 1"):
        check_spec(spec)


def _write(root: Path, runs: list[dict], spec: dict) -> None:
    for i, r in enumerate(runs):
        path = root / f"run{i}" / "results.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(r | {"table": spec}))


def _cells(md: str) -> set[tuple[str, ...]]:
    return {tuple(c.strip() for c in line.strip("|").split("|"))
            for line in md.splitlines() if line.startswith("|")}


def test_uqbench_tables_writes_the_claims_table_and_the_grid(tmp_path, capsys):
    spec = {"title": "P2x", "rows": ROWS,
            "columns": [{"key": "metrics.test/nll", "title": "test NLL"}],
            "claims": [claim("greater") | {"claim": "embedded fits better at width 4",
                                           "short": "ID @4", "measure": "NLL diff"},
                       claim("ratio", key="params.trainable", range=[0.30, 0.40])
                       | {"claim": "about a third more parameters", "short": "params"}]}
    runs = paired([0.05, 0.15, 0.10])  # 0.100 [0.016, 0.184] (hand_interval)
    _write(tmp_path / "runs", runs, spec)
    tables_main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t")])
    md = (tmp_path / "t" / "p2x_claims.md").read_text()
    cells = _cells(md)
    assert ("claim", "measurement", "mean", "interval", "margin", "seeds", "failed",
            "verdict") in cells
    assert ("embedded fits better at width 4", "NLL diff", "0.100", "[0.016, 0.184]", "> 0.000",
            "3", "", "holds") in cells
    assert ("about a third more parameters", "", "+38.5%", "–", "in [+30.0%, +40.0%]", "3",
            "", "holds") in cells
    assert "two-sided 90% Student-t confidence interval" in md
    frame = pd.read_csv(tmp_path / "t" / "p2x_claims.csv")
    assert list(frame["verdict"]) == ["holds", "holds"]
    assert list(frame["interval"]) == ["[0.016, 0.184]", "–"]
    assert "embedded fits better at width 4" in capsys.readouterr().out  # printed too

    # a spec's confidence: 0.99 widens the interval past 0 (t_{0.995, 2} = 9.925: ± 0.287)
    _write(tmp_path / "runs99", runs, spec | {"confidence": 0.99})
    tables_main(["--runs", str(tmp_path / "runs99"), "--out", str(tmp_path / "t99"), "--quiet"])
    md = (tmp_path / "t99" / "p2x_claims.md").read_text()
    _, lo, hi = hand_interval([0.05, 0.15, 0.10], 0.99)
    assert ("embedded fits better at width 4", "NLL diff", "0.100", f"[{lo:.3f}, {hi:.3f}]",
            "> 0.000", "3", "", "unclear") in _cells(md)
    assert "two-sided 99% Student-t" in md

    # by setup: the second setup flips the first claim; a third has one seed
    grid_spec = spec | {"rows": [{"key": "variant", "title": "setup"}, *ROWS],
                        "claims_by": "variant"}
    flipped = [r | {"variant": "other"} for r in paired([-0.1, -0.1, -0.1])]
    single = [r | {"variant": "one"} for r in paired([0.2])]
    base = [r | {"variant": "default"} for r in runs]
    _write(tmp_path / "runs2", base + flipped + single, grid_spec)
    tables_main(["--runs", str(tmp_path / "runs2"), "--out", str(tmp_path / "t2"), "--quiet"])
    grid = pd.read_csv(tmp_path / "t2" / "p2x_claims.csv")
    assert list(grid["variant"]) == ["default", "one", "other"]
    assert list(grid["ID @4"]) == ["✓ 0.100 [0.016, 0.184]", "~ 0.200 (one seed)",
                                   "✗ -0.100 [-0.100, -0.100]"]
    md = (tmp_path / "t2" / "p2x_claims.md").read_text()
    assert "Each cell: mean [90% interval]" in md
    # numeric setups (widths) in numeric order, before any named one
    by_width = [r | {"variant": w} for w, r in zip((256, 4, 16, 64), base, strict=False)]
    by_width += [r | {"variant": "named"} for r in runs[:1]]
    _write(tmp_path / "runs4", by_width, grid_spec)
    tables_main(["--runs", str(tmp_path / "runs4"), "--out", str(tmp_path / "t4"), "--quiet"])
    grid = pd.read_csv(tmp_path / "t4" / "p2x_claims.csv", dtype=str)
    assert list(grid["variant"]) == ["4", "16", "64", "256", "named"]
    # the cells have no room for the claim and its margin: a key under the grid gives them
    assert "- **ID @4**: embedded fits better at width 4. NLL diff; margin: > 0.000" in md

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


def test_claims_a_loose_side_cannot_evaluate_are_left_out_with_a_warning(tmp_path, capsys):
    spec = {"rows": ROWS, "columns": [{"key": "metrics.test/nll", "title": "test NLL"}],
            "claims": [claim("greater", a={"variance": "learned"}, b={"variance": "embedded"})]}
    _write(tmp_path / "runs", paired([0.1, 0.2]) + paired([0.1, 0.2], width=8), spec)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "p2x_claims.md").write_text("an older claims table")
    tables_main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t"), "--quiet"])
    assert "p2x: no claims table" in capsys.readouterr().err
    assert (tmp_path / "t" / "p2x.md").exists()
    assert not (tmp_path / "t" / "p2x_claims.md").exists()


# --- the packaged claims specs ------------------------------------------------------------------

def _yaml(path: str) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def test_p2s_claims_fit_the_experiments_that_take_them():
    claims = _yaml("conf/claims/p2.yaml")
    alike = [c for c in claims["claims"] if c["kind"] == "alike"]
    assert alike and all(c["relative_margin"] == 0.1 for c in alike)
    for exp in ("p2_width_sweep", "p2_claims"):
        table = _yaml(f"conf/experiment/{exp}.yaml")["table"]
        check_spec({k: v for k, v in table.items() if k in ("rows", "columns")} | claims)


P1_METHODS = {  # per method: acc, ece, nll, auroc_mi, trainable parameters (job=params counts)
    "single": (0.900, 0.060, 0.350, 0.800, 147650),
    "mc_dropout_t4": (0.905, 0.050, 0.330, 0.820, 147650),
    "deep_ensemble": (0.930, 0.030, 0.250, 0.900, 590600),
    "lora_ensemble": (0.925, 0.035, 0.270, 0.880, 66056),
    "sve": (0.935, 0.025, 0.255, 0.900, 11784),
    "svf": (0.910, 0.050, 0.300, 0.850, 147650),
}
LEVELS = {"random": 0.41, "weak": 0.78, "strong": 0.93}  # level: probe accuracy


def p1_runs() -> list[dict]:
    """Runs shaped like experiment=p1_digits results: 3 levels × 6 methods × 3 seeds.

    Every metric moves by at most ±0.002 between seeds, so a paired difference d_s lies
    within 0.004 of the difference of the two methods' levels above; its mean does too, and
    its sd is at most 0.577 · 0.008 (three points in a range of 0.008), so the 90 % interval
    reaches at most 0.004 + 2.92 · 0.0046 / √3 ≈ 0.012 from that difference. Every gap to a
    bound below is at least 0.015, so every verdict is known by hand. On the random backbone
    SVE is 5 points less accurate than above, in every seed."""
    runs = []
    for level, probe in LEVELS.items():
        for i, (method, (acc, ece, nll, auroc, n)) in enumerate(P1_METHODS.items()):
            members = 1 if method in ("single", "svf") else 4
            if level == "random" and method == "sve":
                acc -= 0.05
            for seed in range(3):
                noise = 0.002 * math.sin(1 + 3 * i + 7 * seed)
                runs.append({
                    "experiment": "p1x", "seed": seed, "method": method,
                    "settings": {"backbone": {"level": level, "probe_acc": probe},
                                 "method": {"members": members}},
                    "params": {"trainable": n},
                    "metrics": {"test/acc": acc + noise, "test/ece": ece + noise,
                                "test/nll": nll + noise, "test/brier": 0.1 + noise,
                                "ood/auroc_mi": auroc + noise,
                                "test_c/mean/acc": acc - 0.2 + noise}})
    return runs


def test_the_p1_spec_evaluates_every_claim_per_backbone_level(tmp_path):
    claims = _yaml("conf/claims/p1.yaml")
    table = _yaml("conf/experiment/p1_digits_first.yaml")["table"]
    spec = ({k: table[k] for k in ("title", "rows", "columns")} | claims
            | {"claims_by": "settings.backbone.level"})
    check_spec(spec)
    assert claims["confidence"] == 0.90
    # each side names a method the benchmark runs, as its runs record it (the config option)
    swept = _yaml("conf/experiment/p1_digits_first.yaml")["hydra"]["sweeper"]["params"]["method"]
    named = {c[side]["method"] for c in claims["claims"] for side in ("a", "b")}
    assert named <= set(swept.split(",")) and set(P1_METHODS) == set(swept.split(","))
    shorts = [c["short"] for c in claims["claims"]]
    assert len(set(shorts)) == len(shorts) == 10
    kinds = {c["short"]: (c["kind"], c.get("better", "higher"), c.get("margin"))
             for c in claims["claims"]}
    assert kinds["ACC vs DE"] == ("not_worse", "higher", 0.01)
    assert kinds["ECE vs LoRA-E"] == ("not_worse", "lower", 0.01)
    assert kinds["OOD vs DE"] == ("not_worse", "higher", 0.02)
    assert kinds["NLL vs DE"] == ("not_worse", "lower", 0.02)
    assert kinds["NLL vs single"] == ("greater", "lower", None)

    _write(tmp_path / "runs", p1_runs(), spec)
    tables_main(["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t"), "--quiet"])
    grid = pd.read_csv(tmp_path / "t" / "p1x_claims.csv").set_index("level")
    assert list(grid.index) == ["random", "strong", "weak"] and list(grid.columns) == shorts
    marks = grid.map(lambda cell: cell.split()[0])
    assert not (marks == C.MARKS[C.MISSING]).any().any()  # every claim measured
    for level in ("strong", "weak"):  # SVE as the spec's claims say: all hold
        assert (marks.loc[level] == C.MARKS[C.HOLDS]).all(), grid.loc[level]
    # on the random backbone SVE is 4.5 points below DE and 4 below LoRA-Ensemble: each
    # interval lies within 0.012 of that, wholly below −0.01; the other claims still hold
    assert marks.loc["random", "ACC vs DE"] == marks.loc["random", "ACC vs LoRA-E"] == "✗"
    assert (marks.loc["random"].drop(["ACC vs DE", "ACC vs LoRA-E"]) == "✓").all()
    assert grid.loc["strong", "params vs LoRA-E"] == "✓ -82.2%"  # 11784 / 66056 − 1
    assert grid.loc["strong", "params vs DE"] == "✓ -98.0%"  # 11784 / 590600 − 1
    md = (tmp_path / "t" / "p1x_claims.md").read_text()
    assert ("- **ECE vs DE**: SVE is at least as well calibrated as the Deep Ensemble. test "
            "ECE, DE − SVE (SVE not worse by more than 1 point); margin: > -0.010") in md

    # without claims_by, a side such as {method: sve} matches one run per level and seed
    flat = {k: v for k, v in spec.items() if k != "claims_by"}
    with pytest.raises(C.InvalidClaims, match="more than one run of seed"):
        C.claims_table(p1_runs(), flat)


def test_a_bar_in_a_cell_or_header_cannot_split_a_markdown_row():
    frame = pd.DataFrame({"claim": ["σ(x)"], "measure |m|": ["mean |σ − true σ| / mean σ"],
                          "margin": ["inside ±10% of |b|"], "n": [3]})
    lines = C.markdown_table(frame).splitlines()
    # a row's cells are separated by the bars that are not escaped: 4 cells, 5 bars
    assert [len(line.replace("\\|", "")) - len(line.replace("\\|", "").replace("|", ""))
            for line in lines] == [5, 5, 5]
    assert "mean \\|σ − true σ\\| / mean σ" in lines[2] and "measure \\|m\\|" in lines[0]


# --- failures and multiplicity ------------------------------------------------------------

def test_holm_adjusts_by_hand():
    # sorted 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 → step-down max 0.06
    adjusted = C.holm([0.01, 0.04, 0.03, 0.005, math.nan])
    assert adjusted[:4] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and math.isnan(adjusted[4])


@pytest.mark.parametrize("kind, margin", [("greater", 0.0), ("greater", 0.05),
                                          ("not_worse", 0.05)])
def test_the_p_values_are_scipys_one_sided_t_tests_and_agree_with_the_interval(kind, margin):
    """p_hold is scipy's one-sample t-test of d against the bound (alternative='greater'),
    p_fail its opposite; uncorrected, p_hold < 5 % exactly where the 90 % interval clears the
    bound and p_fail <= 5 % exactly where it lies wholly short of it (200 random draws)."""
    rng = __import__("numpy").random.default_rng(0)
    bound = margin if kind == "greater" else -margin
    for _ in range(200):
        d = rng.normal(rng.uniform(-0.2, 0.2), rng.uniform(0.01, 0.2), size=5)
        p_hold, p_fail = C.p_values(d, kind, margin)
        assert p_hold == pytest.approx(stats.ttest_1samp(d - bound, 0.0,
                                                         alternative="greater").pvalue)
        assert p_fail == pytest.approx(stats.ttest_1samp(d - bound, 0.0,
                                                         alternative="less").pvalue)
        _, lo, hi = hand_interval(list(d))
        assert (p_hold < 0.05) == (lo > bound) and (p_fail <= 0.05) == (hi <= bound)


def three_claims(multiplicity: str) -> dict:
    """Three claims on three widths, of which width 4's clears its bound uncorrected
    (p_hold ≈ 0.03) but not after Holm's correction over the three."""
    c = [claim("greater", a={"width": w, "variance": "learned"},
               b={"width": w, "variance": "embedded"}) | {"claim": f"w{w}", "short": f"w{w}"}
         for w in (4, 16, 64)]
    return {"title": "P2x", "rows": ROWS, "columns": [{"key": "metrics.test/nll",
                                                       "title": "NLL"}],
            "claims": c, "multiplicity": multiplicity}


def family_runs() -> list[dict]:
    return paired([0.10, 0.25, 0.0, 0.2, 0.05], 4) + paired([-0.1, 0.1, 0.0, 0.05, -0.05], 16) \
        + paired([0.0, 0.01, -0.02, 0.03, -0.01], 64)


def test_holm_turns_a_cell_that_clears_its_bound_alone_into_unclear():
    d = [0.10, 0.25, 0.0, 0.2, 0.05]
    p = stats.ttest_1samp(d, 0.0, alternative="greater").pvalue
    assert 0.05 / 3 < p < 0.05  # clears α = 5 % alone, not α / 3
    alone = C.claims_table(family_runs(), three_claims("none"))
    fixed = C.claims_table(family_runs(), three_claims("holm"))
    assert alone["verdict"].tolist()[0] == C.HOLDS and fixed["verdict"].tolist()[0] == C.UNCLEAR
    assert float(fixed["p (Holm)"][0]) == pytest.approx(3 * p, abs=5e-4)  # smallest of three
    assert "Holm-corrected" in C.legend(three_claims("holm"))
    assert "uncorrected" in C.legend(three_claims("none"))
    with pytest.raises(C.InvalidClaims, match="multiplicity 'bonferoni'"):
        C.claims_table(family_runs(), three_claims("bonferoni"))


def test_a_nan_seed_counts_against_its_method_and_is_named():
    """Width 4's learned model (the claim's a) diverges in seed 1: the claim does not hold,
    however good the other seeds; the embedded model (b) failing leaves its seed out."""
    spec = three_claims("holm")
    runs = paired([0.3, 0.3, 0.31, 0.29, 0.3], 4) + paired([0.3, 0.3, 0.31, 0.29, 0.3], 16)
    runs += paired([0.3, 0.3, 0.31, 0.29, 0.3], 64)
    for r in runs:
        if r["seed"] == 1 and r["settings"]["backbone"]["width"] == 4 \
                and r["settings"]["method"]["variance"] == "learned":
            r["metrics"]["test/nll"] = float("nan")
        if r["seed"] == 3 and r["settings"]["backbone"]["width"] == 16 \
                and r["settings"]["method"]["variance"] == "embedded":
            r["metrics"]["test/nll"] = float("inf")
    table = C.claims_table(runs, spec)
    assert table["verdict"].tolist() == [C.FAILS, C.HOLDS, C.HOLDS]
    assert table["failed"].tolist() == ["a failed 1", "b failed 1", ""]
    assert table["seeds"].tolist() == [4, 4, 5]
    grid = C.claims_grid([r | {"variant": "x"} for r in runs], spec | {"claims_by": "variant"})
    assert grid["w4"][0].startswith("✗") and grid["w4"][0].endswith("(a failed 1)")


def test_the_table_counts_a_methods_failed_runs():
    from uqbench.report.building import build_table

    runs = paired([0.1, 0.2, 0.3])
    runs[4]["metrics"]["test/nll"] = float("nan")  # learned, seed 1
    spec = {"rows": ROWS, "columns": [{"key": "metrics.test/nll", "title": "NLL"}],
            "failed_key": "metrics.test/nll"}
    shown, numeric = build_table(runs, spec)
    assert shown["failed"].tolist() == [0, 1] and shown["seeds"].tolist() == [3, 3]
    assert numeric["NLL mean"][1] == pytest.approx((0.6 + 1.0) / 2, abs=1e-9)  # seeds 0, 2


def test_a_failed_run_record_counts_in_its_cell_and_against_its_claim(tmp_path):
    """A run that failed (failed.json with its record, no results.json) is a failure of its
    table cell and of its claim, read from disk as uqbench-tables reads a sweep."""
    from uqbench.report.tables import write_tables
    from uqbench.runner.outcomes import RunFailed, write_failed

    spec = three_claims("holm") | {"title": "fails"}
    runs = paired([0.3, 0.3, 0.31, 0.29, 0.3], 4) + paired([0.3, 0.3, 0.31, 0.29, 0.3], 16)
    runs += paired([0.3, 0.3, 0.31, 0.29, 0.3], 64)
    root = tmp_path / "runs"
    for i, r in enumerate(runs):
        folder = root / f"run{i}"
        folder.mkdir(parents=True)
        r = r | {"experiment": "fails", "table": spec}
        if r["seed"] == 2 and r["settings"]["backbone"]["width"] == 16 \
                and r["settings"]["method"]["variance"] == "learned":
            record = {k: v for k, v in r.items() if k != "metrics"}
            write_failed(RunFailed(folder, RuntimeError("diverged"), run=record))
        else:
            (folder / "results.json").write_text(json.dumps(r))
    md = write_tables(root, tmp_path / "tables", "fails")["fails"].read_text()
    rows = {c[0] + " " + c[1]: c for c in _cells(md) if c[0] in ("4", "16", "64")}
    header = next(c for c in _cells(md) if c[0] == "width")
    failed = header.index("failed")
    assert rows["16 learned"][failed] == "1" and rows["16 embedded"][failed] == "0"
    assert rows["16 learned"][header.index("seeds")] == "5"  # the failed seed is shown, counted
    claims = (tmp_path / "tables" / "fails_claims.md").read_text()
    w16 = next(c for c in _cells(claims) if c[0] == "w16")
    assert "does not hold" in " ".join(w16) and "a failed 1" in " ".join(w16)
