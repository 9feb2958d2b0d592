"""The shared training loop's schedule and its config checks."""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from uqbench.configs import build
from uqbench.contracts import RegressionOutput
from uqbench.data.polynomial import PolynomialData
from uqbench.loggers import NullLogger
from uqbench.methods.base import Method
from uqbench.tasks.regression import RegressionTask
from uqbench.training import Trainer, lr_factor


def test_warmup_then_cosine_by_hand():
    # 1000 steps, 500 linear warm-up steps, then half a cosine period down to 0
    assert lr_factor(0, 1000, 500, "cosine") == pytest.approx(1 / 500)
    assert lr_factor(499, 1000, 500, "cosine") == pytest.approx(1.0)
    assert lr_factor(750, 1000, 500, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(1000, 1000, 500, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(10, 100, 0, "constant") == 1.0


class _Constant(Method):
    """A one-parameter regression method: constant prediction, loss with a constant gradient."""

    task = "regression"
    name = "constant"

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return RegressionOutput(self.w.expand_as(x), torch.ones_like(x))

    def loss(self, batch):
        return self.w.sum()


def test_warmup_steps_override_warmup_epochs(monkeypatch):
    data = PolynomialData(n_train=400, batch_size=100)  # 4 steps per epoch
    data.setup()
    method = _Constant()
    seen: list[float] = []
    step = torch.optim.SGD.step

    def record(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", record)
    cfg = OmegaConf.create({"_target_": "uqbench.training.Trainer",
                            "epochs": 3, "grad_clip": None, "warmup_epochs": 2,
                            "warmup_steps": 4, "schedule": "constant", "select": "last",
                            "val_every": 100, "progress": False,
                            "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True,
                                          "lr": 1.0}})
    instantiate(cfg).fit(method, data, RegressionTask(), torch.device("cpu"), NullLogger())
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0] + [1.0] * 8)


@pytest.mark.parametrize("field,value,match", [("epochs", -1, "epochs"),
                                               ("schedule", "linear", "schedule"),
                                               ("select", "first", "select"),
                                               ("grad_clip", 0.0, "grad_clip"),
                                               ("warmup_steps", -5, "warmup_steps")])
def test_bad_trainer_settings_are_named(field, value, match):
    """The trainer checks itself when built: from Python and through the runner's build."""
    settings = {"epochs": 1, "grad_clip": None, "warmup_epochs": 0, "warmup_steps": None,
                "schedule": "constant", "select": "last", field: value}
    with pytest.raises(ValueError, match=match):
        Trainer(optimizer=torch.optim.SGD, **settings)
    node = OmegaConf.create({"_target_": "uqbench.training.Trainer", **settings,
                             "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True}})
    with pytest.raises(ValueError, match=match):
        build(node)  # the error itself, not Hydra's InstantiationException around it


def test_trainer_needs_an_optimizer_factory():
    with pytest.raises(ValueError, match="trainer.optimizer"):
        Trainer(optimizer="adam")
