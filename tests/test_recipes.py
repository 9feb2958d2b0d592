"""Every committed recipe file was written by code and says how; every selection sweep scores
the validation split only. Read from the repository's own conf/, so a hand-edited recipe or a
selection sweep that scores test fails here."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.helpers import ROOT

RECIPES = sorted((ROOT / "conf" / "recipe").glob("*.yaml"))
SELECT_SWEEPS = sorted((ROOT / "conf" / "experiment").glob("*_select.yaml"))


def test_there_are_recipes_and_selection_sweeps():
    assert {p.stem for p in RECIPES} >= {"p1_digits", "p1_digits_first", "digits_backbone"}
    assert {p.stem for p in SELECT_SWEEPS} >= {"p1_digits_select"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_records_how_it_was_chosen(path):
    recipe = yaml.safe_load(path.read_text())
    provenance, choices = recipe.get("provenance") or {}, recipe.get("choices")
    assert choices, f"{path.name}: no choices"
    assert str(provenance.get("command", "")).startswith(("uqbench-select", "uqbench-pretrain")), \
        f"{path.name}: not written by a selection command ({provenance.get('command')!r})"
    assert provenance.get("date") and provenance.get("seeds") is not None
    assert provenance.get("metric") and provenance.get("grid")
    if provenance["command"].startswith("uqbench-select"):
        assert provenance.get("sweep") and provenance.get("direction") in ("min", "max")
        assert str(provenance["metric"]).startswith("val/")  # chosen on validation
        _choices_are_the_best_candidates(recipe)


def _leaves(tree: dict, depth: int) -> dict[tuple, dict]:
    """{group path: mapping} at ``depth`` levels below ``tree``."""
    if depth == 0:
        return {(): tree}
    return {(k, *rest): leaf for k, v in tree.items() if isinstance(v, dict)
            for rest, leaf in _leaves(v, depth - 1).items()}


def _choices_are_the_best_candidates(recipe: dict) -> None:
    """Each group's choice is its best eligible candidate's values, by the recorded means."""
    depth = len(recipe["provenance"].get("group_by") or [])
    groups = _leaves(recipe["groups"], depth)
    choices = _leaves(recipe["choices"], depth)
    sign = 1 if recipe["provenance"]["direction"] == "min" else -1
    assert groups.keys() == choices.keys()
    for group, info in groups.items():
        eligible = [c for c in info["candidates"] if not c.get("excluded")]
        best = min(sign * c["mean"] for c in eligible if math.isfinite(c["mean"]))
        winners = [c for c in eligible if math.isclose(sign * c["mean"], best, rel_tol=1e-9)]
        chosen = choices[group]
        assert any(all(c["values"].get(k) == v for k, v in chosen.items()) for c in winners), \
            (group, chosen)


@pytest.mark.parametrize("path", SELECT_SWEEPS, ids=lambda p: p.stem)
def test_each_selection_sweep_scores_validation_only(path, compose_cfg):
    cfg = compose_cfg([f"experiment={path.stem}"])
    assert list(cfg.eval_splits) == ["val"]
