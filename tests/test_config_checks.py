"""A misspelt field or a value outside a field's choices is refused by name before anything is
built: one line naming the field, the bad value and what is valid.

Constructors that pass ``**kwargs`` on (every on-disk dataset) are followed up their class
hierarchy, so a field no class of it takes is refused as early as any other.
"""

from __future__ import annotations

from typing import Literal

import pytest

from tests.helpers import run_cli
from uqbench.configs import check_value


def _refusal(compose_cfg, *overrides: str) -> str:
    from uqbench.runner.cli import check_config

    cfg = compose_cfg(list(overrides))
    with pytest.raises(ValueError) as err:
        check_config(cfg)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_cli_refuses_a_misspelt_dataset_field_passed_on_through_kwargs(tmp_path):
    """CIFAR100Data takes val_fraction only through **kwargs (SplitDataModule's): the typo is
    refused before the (absent) data is read or any run folder is made."""
    runs = tmp_path / "runs"
    proc = run_cli("dataset=cifar100", "backbone=tiny_vit", "method=single",
                   "+dataset.val_fracton=0.1", f"paths.runs_dir={runs}",
                   f"paths.data_root={tmp_path / 'data'}", check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: dataset.val_fracton is not an option of dataset "
                               "'CIFAR100Data'")
    assert "val_fraction" in lines[0] and "batch_size" in lines[0]  # fields of the base classes
    assert "Traceback" not in proc.stderr and "TypeError" not in proc.stderr
    assert not runs.exists() or not any(runs.rglob("*"))


@pytest.mark.parametrize("overrides,field,valid", [
    (["method=sve", "+method.memebrs=8"], "method.memebrs", "members"),
    (["backbone=tiny_bert", "dataset=fake_text", "+backbone.max_lenght=32"],
     "backbone.max_lenght", "max_length"),
    (["+trainer.epoch=3"], "trainer.epoch", "epochs"),
    # sst2: TextDataModule → SplitDataModule → DataModule, each passing **kwargs on
    (["dataset=sst2", "backbone=tiny_bert", "+dataset.batch_sise=8"], "dataset.batch_sise",
     "batch_size"),
])
def test_a_misspelt_field_is_refused_with_the_valid_ones(compose_cfg, overrides, field, valid):
    message = _refusal(compose_cfg, *overrides)
    assert message.startswith(f"{field} is not an option of ")
    listed = message.split("(its options: ", 1)[1].rstrip(")").split(", ")
    assert valid in listed and field.split(".")[1] not in listed


def test_fields_of_the_base_classes_are_accepted(compose_cfg):
    from uqbench.runner.cli import check_config

    check_config(compose_cfg(["dataset=cifar100", "backbone=tiny_vit", "dataset.num_workers=0",
                              "dataset.val_fraction=0.2", "dataset.eval_batch_size=8"]))


@pytest.mark.parametrize("overrides,expected", [
    (["method=sve", "method.forward_mode=fatorized"],
     "method.forward_mode='fatorized' is not one of: auto, factorized, materialized"),
    (["method=mc_dropout", "method.masks=bits"], "method.masks='bits' is not one of: fast, torch"),
    (["method=sve", "method.qkv=separate"], "method.qkv='separate' is not one of: split, fused"),
    (["backbone=tiny_bert", "dataset=fake_text", "backbone.pooling=max"],
     "backbone.pooling='max' is not one of: cls, pooler, last, mean"),
    (["dataset=diabetes", "backbone=mlp", "method=bnn", "backbone.activation=tanh"],
     "backbone.activation='tanh' is not one of: leaky_relu, relu"),
    (["dataset=fake_images", "backbone=tiny_vit", "task.aggregation=vote"],
     "task.aggregation='vote' is not one of: mean_probs, mean_logits"),
])
def test_a_value_outside_a_literal_is_refused_with_the_choices(compose_cfg, overrides, expected):
    assert _refusal(compose_cfg, *overrides) == expected


def test_literal_checks_by_hand():
    choice = Literal["a", "b"]
    check_value("x", "a", choice)
    check_value("x", None, choice | None)  # null where the annotation allows it
    with pytest.raises(ValueError, match=r"^x=None is not one of: a, b$"):
        check_value("x", None, choice)
    with pytest.raises(ValueError, match=r"^x='c' is not one of: a, b, null$"):
        check_value("x", "c", choice | None)
    with pytest.raises(ValueError, match=r"^x='1' is not one of: 1, 2$"):
        check_value("x", "1", Literal[1, 2])  # a string is not the number it spells
    with pytest.raises(ValueError, match=r"^x=True is not one of: 1, 2$"):
        check_value("x", True, Literal[1, 2])  # nor is a boolean
    check_value("x", [1, 2], Literal["all"] | list[int] | None)  # mixed: the class decides


def test_objects_built_in_code_check_their_choices_in_the_same_words():
    from uqbench.backbones.mlp import MLP
    from uqbench.tasks.classification import ClassificationTask

    with pytest.raises(ValueError, match=r"^task.aggregation='vote' is not one of: mean_probs, "
                                         r"mean_logits$"):
        ClassificationTask(aggregation="vote")
    with pytest.raises(ValueError, match=r"^backbone.activation='tanh' is not one of: "
                                         r"leaky_relu, relu$"):
        MLP(activation="tanh")
    assert MLP(activation="relu").activation == "relu"
