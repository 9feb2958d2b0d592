"""The backbone-levels table: probe beside full fine-tuning, foundation grade and spacing, on
hand-made runs whose expected numbers are computed here by hand."""

from __future__ import annotations

import pytest

from uqbench.report.levels import InvalidLevels, levels_table, write_levels

SPEC = {"by": "settings.backbone.level", "order": ["random", "foundation"],
        "probe": "settings.backbone.probe_acc",
        "reference": {"method": "single", "key": "metrics.val/acc"},
        "foundation_margin": 0.02, "min_spacing": 0.02}


def run(level: str, method: str, seed: int, probe: float, val_acc: float) -> dict:
    return {"method": method, "seed": seed, "metrics": {"val/acc": val_acc},
            "settings": {"backbone": {"level": level, "probe_acc": probe}}}


RUNS = [
    # random: probes 0.78, 0.80 (mean 0.79); single 0.90, 0.92 (mean 0.91): gap 12 points
    run("random", "single", 0, 0.78, 0.90), run("random", "single", 1, 0.80, 0.92),
    run("random", "sve_m4", 0, 0.78, 0.50),  # another method: its val acc is not the reference
    # foundation: probes 0.95, 0.97 (0.96); single 0.97, 0.99 (0.98): gap 2.0 ≤ 2 → grade
    run("foundation", "single", 0, 0.95, 0.97), run("foundation", "single", 1, 0.97, 0.99),
]


def test_levels_table_by_hand():
    table = levels_table(RUNS, SPEC).set_index("level")
    assert table.loc["random", "probe (val)"] == "79.0 ± 1.4"  # std of (78, 80) = √2
    assert table.loc["random", "single (val)"] == "91.0 ± 1.4"
    assert table.loc["random", "gap"] == "12.0"
    assert table.loc["random", "foundation-grade (gap ≤ 2)"] == "no"
    assert table.loc["foundation", "foundation-grade (gap ≤ 2)"] == "yes"
    assert table.loc["foundation", "above the level below (≥ 2)"] == "✓ +17.0"
    assert table.loc["random", "above the level below (≥ 2)"] == "–"
    assert list(table["seeds"]) == [2, 2]


def test_levels_too_close_and_not_foundation_grade():
    close = [run("random", "single", 0, 0.80, 0.90), run("foundation", "single", 0, 0.81, 0.90)]
    table = levels_table(close, SPEC).set_index("level")
    assert table.loc["foundation", "above the level below (≥ 2)"] == "✗ +1.0"
    assert table.loc["foundation", "foundation-grade (gap ≤ 2)"] == "no"  # gap 9


def test_bad_levels_spec_is_refused_naming_the_field(tmp_path):
    with pytest.raises(InvalidLevels, match="reference"):
        levels_table(RUNS, {k: v for k, v in SPEC.items() if k != "reference"})
    paths = write_levels(RUNS, {"levels": SPEC, "title": "t"}, tmp_path, "exp")
    assert [p.name for p in paths] == ["exp_levels.md", "exp_levels.csv"]
    assert "foundation-grade" in paths[0].read_text()
