"""Every config in conf/ composes and resolves."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["backbone", "method", "dataset", "trainer", "logger", "paths"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes(compose_cfg, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved[group] is not None
    if group in ("backbone", "method", "logger") or (group == "dataset" and option != "none"):
        assert "_target_" in resolved[group]


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(compose_cfg, experiment):
    cfg = compose_cfg([f"experiment={experiment}"])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["experiment_name"] == experiment
    assert experiment in resolved["run_dir"]


def test_run_dir_is_deterministic_and_run_name_replaces_it(compose_cfg):
    cfg = compose_cfg(["backbone.width=8", "method.variance=learned", "seed=2"])
    assert cfg.run_dir == "runs/default/polynomial/bnn_learned/mlp_w8/seed2"
    cfg = compose_cfg(["run_name=my_run"])
    assert cfg.run_dir == "runs/my_run"
