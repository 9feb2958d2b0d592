"""The text benchmark's pre-registered protocol, read from the real configs: every method gets
the same number of candidate settings, the selection sweep scores validation only, the result
sweep reads the recipe, and the claims name methods the sweep trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def sweep_params(experiment: str) -> dict[str, str]:
    path = ROOT / "conf" / "experiment" / f"{experiment}.yaml"
    return yaml.safe_load(path.read_text())["hydra"]["sweeper"]["params"]


def methods() -> list[str]:
    return sweep_params("p1_text_protocol")["method"].split(",")


def test_every_method_gets_the_same_three_candidates_and_validation_only(cfg):
    sizes = {}
    for method in methods():
        for k in ("low", "mid", "high"):
            c = cfg("experiment=p1_text_select", f"method={method}", f"grid_point={k}")
            grid = OmegaConf.to_container(c.lookup.grid, resolve=True)[c.method.name]
            assert c.trainer.optimizer.lr == grid[k]
            assert list(c.eval_splits) == ["val"] and c.seed == 0
        sizes[method] = len(grid)
    assert set(sizes.values()) == {3}, sizes
    assert sweep_params("p1_text_select")["grid_point"] == "low,mid,high"


def test_the_protocol_is_the_one_the_header_states(cfg):
    c = cfg("experiment=p1_text_select", "method=deep_ensemble_independent")
    assert c.backbone.name == "minilm" and c.backbone.frozen_blocks == 4
    assert c.backbone.max_length == 48 and c.dataset.name == "movie_sentences"
    assert (c.dataset.test_size, c.dataset.val_size, c.dataset.train_size,
            c.dataset.shift_size, c.dataset.neutral_band) == (600, 300, 400, 200, 0.5)
    assert c.method.data_order == "independent" and c.method.members == 4
    assert (c.trainer.epochs, c.trainer.select, c.trainer.val_every) == (2, "last", 0)
    assert cfg("experiment=p1_text_select", "method=blob_s4").method.samples == 4
    assert sweep_params("p1_text_protocol")["seed"] == "0,1,2,3,4"


def test_the_claims_are_holm_corrected_and_name_methods_the_sweep_trains():
    spec = yaml.safe_load((ROOT / "conf" / "claims" / "p1_text.yaml").read_text())
    assert spec["multiplicity"] == "holm" and spec["confidence"] == 0.90
    trained = set(methods())
    for claim in spec["claims"]:
        assert {claim["a"]["method"], claim["b"]["method"]} <= trained, claim["short"]
    assert sum(c["kind"] != "ratio" for c in spec["claims"]) == 8


@pytest.mark.skipif(not (ROOT / "conf" / "recipe" / "p1_text.yaml").exists(),
                    reason="conf/recipe/p1_text.yaml is written by make p1-text-select")
def test_the_result_sweep_reads_a_choice_from_each_methods_grid(cfg):
    for method in methods():
        c = cfg("experiment=p1_text", f"method={method}")
        grid = OmegaConf.to_container(cfg("experiment=p1_text_select", f"method={method}")
                                      .lookup.grid, resolve=True)[c.method.name]
        assert c.trainer.optimizer.lr in grid.values() and c.eval_splits is None
