"""The digits ViTs' design is chosen by code on the validation probe and read from its recipe
file; a candidate never leaks into the module's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from uqbench.backbones import digits_vit
from uqbench.backbones.digits_vit import (
    ARCHITECTURE,
    DESIGN_FILE,
    DESIGN_GRID,
    RECIPES,
    designed,
    pretrain_settings,
)
from uqbench.runner.jobs.pretrain_design import choose_design, write_design

# hand-made probes per candidate (pool, augment) and seed
PROBES = {("avg", True): [0.90, 0.92], ("avg", False): [0.85, 0.87],
          ("token", True): [0.91, 0.91], ("token", False): [0.80, 0.80]}


def fake_build(level, cache_dir, seed, threads, log):
    """What pretrain() returns, with the probe of the candidate in force."""
    key = (ARCHITECTURE["global_pool"], RECIPES["other"]["augment"])
    return SimpleNamespace(meta={"probe": {"acc": PROBES[key][seed]}})


def test_the_highest_mean_validation_probe_wins_and_ties_go_to_the_first(tmp_path):
    recipe = choose_design(fake_build, tmp_path, seeds=(0, 1))
    # means: avg/aug 0.91, avg/no 0.86, token/aug 0.91, token/no 0.80 → a tie, the first wins
    assert recipe["choices"] == {"global_pool": "avg", "augment": True}
    assert recipe["provenance"]["ties"] == [{"global_pool": "token", "augment": True}]
    scores = {(c["global_pool"], c["augment"]): c["probe_mean"]
              for c in recipe["provenance"]["candidates"]}
    assert scores == pytest.approx({k: sum(v) / 2 for k, v in PROBES.items()})
    assert recipe["provenance"]["grid"] == DESIGN_GRID
    assert "validation" in recipe["provenance"]["metric"]
    path = tmp_path / "design.yaml"
    write_design(recipe, path)
    assert yaml.safe_load(path.read_text())["choices"] == recipe["choices"]


def test_a_candidate_changes_the_fingerprint_and_is_undone_afterwards():
    before = pretrain_settings("other")
    with designed({"global_pool": "token", "augment": False}):
        inside = pretrain_settings("other")
        assert inside["architecture"]["global_pool"] == "token"
        assert inside["recipe"]["augment"] is False
    assert pretrain_settings("other") == before != inside
    with pytest.raises(ValueError, match=r"'depth'.*'augment', 'global_pool'"):
        with designed({"depth": 2}):
            pass


def test_the_backbone_reads_its_design_from_the_recipe_file():
    chosen = yaml.safe_load(DESIGN_FILE.read_text())["choices"]
    assert digits_vit.ARCHITECTURE["global_pool"] == chosen["global_pool"]
    assert all(r["augment"] == chosen["augment"] for r in RECIPES.values() if r)
