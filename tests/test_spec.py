"""The run spec (uqbench.runner.spec): the composed config as typed fields, checked once."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from uqbench.runner.spec import RunSpec

FAST = ["backbone=tiny_vit", "dataset=fake_images", "method=single", "trainer.epochs=1",
        "eval_splits=[val,test]", "torch_threads=1"]


def test_the_spec_holds_the_config_as_typed_fields(compose_cfg, tmp_path):
    cfg = compose_cfg([*FAST, f"paths.runs_dir={tmp_path}", "seed=4"])
    spec = RunSpec.of(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert spec.config == resolved  # the identity: what config.yaml stores
    assert (spec.job, spec.seed, spec.torch_threads) == ("train", 4, 1)
    assert spec.eval_splits == ("val", "test") and spec.stack_seeds is None
    assert isinstance(spec.run_dir, Path) and spec.run_dir == Path(resolved["run_dir"])
    assert spec.run_dir.name == "seed4" and spec.run_subdir == resolved["run_subdir"]
    for group in ("backbone", "method", "dataset", "task", "trainer"):
        part = getattr(spec, group)
        assert part.settings == {k: v for k, v in resolved[group].items()
                                 if not k.startswith("_")}
        assert part.target == resolved[group]["_target_"]
    assert spec.method.name == "single" and spec.at("trainer.epochs") == 1
    assert spec.at("trainer.no_such_key") is None


def test_a_derived_spec_composes_again_and_leaves_its_source_alone(compose_cfg, tmp_path):
    spec = RunSpec.of(compose_cfg([*FAST, f"paths.runs_dir={tmp_path}"]))
    member = spec.derive({"seed": 7, "dataset.batch_size": 3})
    assert member.seed == 7 and member.run_dir == spec.run_dir.parent / "seed7"
    assert member.dataset.get("batch_size") == 3 != spec.dataset.get("batch_size")
    assert spec.seed == 0 and spec.run_dir.name == "seed0"
    again = RunSpec.from_plain(member.plain())  # a spawned process: the same run
    assert again.config == member.config and again.choices == member.choices


@pytest.mark.parametrize("override,message", [
    ("seed=abc", "seed"),
    ("stack_seeds=[1,2]", "seed=0 is not one of stack_seeds [1, 2]"),
    ("job=fit", "job 'fit' is not one of: train, params, eval"),
    ("eval_splits=[]", "eval_splits must be null"),
])
def test_a_bad_value_is_refused_as_the_spec_is_built(compose_cfg, tmp_path, override, message):
    cfg = compose_cfg([*FAST, f"paths.runs_dir={tmp_path}", override])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunSpec.of(cfg)
    assert not any(tmp_path.iterdir())  # nothing written
