"""The shared training loop's schedule, its config checks and its model selection."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import TensorDataset

from tests.helpers import quick_trainer
from uqbench.configs import build
from uqbench.contracts import RegressionOutput
from uqbench.data.base import DataModule
from uqbench.data.polynomial import PolynomialData
from uqbench.methods.base import Method
from uqbench.records.loggers import NullLogger
from uqbench.runner.engine.loop import Trainer, lr_factor
from uqbench.tasks.classification import ClassificationTask
from uqbench.tasks.regression import RegressionTask


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
    trainer = quick_trainer(3, lr=1.0, optimizer="torch.optim.SGD", val_every=100,
                            warmup_epochs=2, warmup_steps=4)
    trainer.fit(method, data, RegressionTask(), NullLogger())
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0] + [1.0] * 8)


@pytest.mark.parametrize("field,value,match", [("epochs", -1, "epochs"),
                                               ("schedule", "linear", "schedule"),
                                               ("select", "first", "select"),
                                               ("select_metric", "f1", "select_metric"),
                                               ("grad_clip", 0.0, "grad_clip"),
                                               ("warmup_steps", -5, "warmup_steps")])
def test_bad_trainer_settings_are_named(field, value, match):
    """The trainer checks itself when built: from Python and through the runner's build."""
    settings = {"epochs": 1, "grad_clip": None, "warmup_epochs": 0, "warmup_steps": None,
                "schedule": "constant", "select": "last", field: value}
    with pytest.raises(ValueError, match=match):
        Trainer(optimizer=torch.optim.SGD, **settings)
    node = OmegaConf.create({"_target_": "uqbench.runner.engine.loop.Trainer", **settings,
                             "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True}})
    with pytest.raises(ValueError, match=match):
        build(node)  # the error itself, not Hydra's InstantiationException around it


def test_trainer_needs_an_optimizer_factory():
    with pytest.raises(ValueError, match="trainer.optimizer"):
        Trainer(optimizer="adam")


# --- per-member gradient clipping -------------------------------------------------------------

def _reference_clip(grads: list[torch.Tensor], max_norm: float) -> list[torch.Tensor]:
    """torch's own clip_grad_norm_ on independent copies of one member's gradients."""
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for c, g in zip(copies, grads, strict=True):
        c.grad = g.detach().clone()
    torch.nn.utils.clip_grad_norm_(copies, max_norm)
    return [c.grad for c in copies]


def _ensemble(method: str, *overrides: str):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from uqbench.contracts import DataInfo

    GlobalHydra.instance().clear()
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        c = compose("config", overrides=["backbone=tiny_vit", f"method={method}", *overrides])
    GlobalHydra.instance().clear()
    torch.manual_seed(0)
    return instantiate(c.method)(backbone=instantiate(c.backbone),
                                 info=DataInfo(task="classification", num_classes=3))


def _member_grads(m, k: int) -> list[torch.Tensor]:
    """Member k's gradients, read from the parameter names (independent of the declaration):
    slice k of every adapter and head tensor, and encoder copy k of a Deep Ensemble."""
    out = []
    for name, p in m.named_parameters():
        if p.grad is None:
            continue
        if name.startswith("de_encoders."):
            if name.split(".")[1] == str(k):
                out.append(p.grad)
        else:  # head.*, sve_*, lora_*, de_params.*: member k is slice k of dim 0
            out.append(p.grad[k])
    return out


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("method,overrides", [
    ("sve", ["method.sigma_init=0.1"]), ("lora_ensemble", []), ("deep_ensemble", []),
    ("deep_ensemble", ["method.vectorize=true"]), ("deep_ensemble_lp", [])])
def test_each_members_gradient_is_clipped_as_if_it_were_alone(method, overrides):
    from uqbench.runner.engine.gradients import clip_groups, clip_per_member_

    m = _ensemble(method, "method.members=3", *overrides)
    m.train()
    m.loss((torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0]))).backward()
    with torch.no_grad():  # member 1's gradient ×1000: it alone must be clipped hard
        for g in _member_grads(m, 1):
            g.mul_(1000.0)
    before = [[g.clone() for g in _member_grads(m, k)] for k in range(3)]
    norms = [torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs])) for gs in before]
    max_norm = float(norms[0] + norms[2]) / 2 + 1e-3  # between: clips 1, leaves 0 or 2 alone
    assert norms[1] > 100 * max_norm
    params = [p for p in m.parameters() if p.requires_grad]
    clip_per_member_(clip_groups(m, params), max_norm)
    for k in range(3):
        expected = _reference_clip(before[k], max_norm)
        for got, want in zip(_member_grads(m, k), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    unclipped = min(range(3), key=lambda k: norms[k])  # below max_norm: left exactly as it was
    assert all(torch.equal(g, b) for g, b in zip(_member_grads(m, unclipped), before[unclipped],
                                                 strict=True))


def test_one_model_is_clipped_jointly_exactly_as_before():
    """Single, MC-Dropout, SVF (one group of whole tensors): torch's clip_grad_norm_ itself."""
    from uqbench.runner.engine.gradients import clip_groups, clip_per_member_

    for method in ("single", "mc_dropout", "svf"):
        m = _ensemble(method)
        m.train()
        torch.manual_seed(1)
        m.loss((torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0]))).backward()
        params = [p for p in m.parameters() if p.requires_grad]
        expected = _reference_clip([p.grad for p in params], 1e-3)
        groups = clip_groups(m, params)
        assert len(groups) == 1 and [p for p, _ in groups[0]] == params
        clip_per_member_(groups, 1e-3)
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))


class _Stacked(Method):
    """Three members' parameters stacked (3, 2); member m's loss gradient is c_m · v."""

    task = "regression"
    name = "stacked"
    SCALE = torch.tensor([1.0, 1000.0, 0.01])

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, 2))

    def member_parameters(self):
        from uqbench.methods.base import MemberParameters

        return MemberParameters(3, stacked=[self.w])

    def forward(self, x):
        return RegressionOutput(x * 0 + self.w.sum(), torch.ones_like(x))

    def loss(self, batch):
        return (self.SCALE[:, None] * torch.tensor([3.0, 4.0]) * self.w).sum()


def test_trainer_fit_clips_per_member():
    """One SGD step (lr 1, grad_clip 1): member gradients 5·c_m · (0.6, 0.8) with c = (1, 1000,
    0.01) become (0.6, 0.8)·min(1, 1/(5·c_m + 1e-6))·5·c_m: members 0 and 1 clipped to norm 1,
    member 2 (norm 0.05) untouched — a joint clip would have shrunk it ~1000-fold."""
    data = PolynomialData(n_train=100, batch_size=100)
    data.setup()
    method = _Stacked()
    Trainer(optimizer=lambda params: torch.optim.SGD(params, lr=1.0), epochs=1, grad_clip=1.0,
            val_every=100, progress=False).fit(method, data, RegressionTask(),
                                               NullLogger())
    unit = torch.tensor([0.6, 0.8])
    expected = torch.stack([-unit * 5 / (5 + 1e-6), -unit * 5000 / (5000 + 1e-6),
                            -unit * 0.05])
    torch.testing.assert_close(method.w.detach(), expected, rtol=1e-6, atol=1e-8)


def test_undeclared_or_twice_declared_parameters_are_named():
    from uqbench.methods.base import MemberParameters
    from uqbench.runner.engine.gradients import clip_groups

    method = _Stacked()
    method.extra = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(RuntimeError, match="'extra' is not declared"):
        clip_groups(method, list(method.parameters()))
    method.member_parameters = lambda: MemberParameters(3, stacked=[method.w],
                                                        shared=[method.w, method.extra])
    with pytest.raises(RuntimeError, match="'w' is declared more than once"):
        clip_groups(method, list(method.parameters()))
    method.member_parameters = lambda: MemberParameters(2, stacked=[method.w])
    with pytest.raises(RuntimeError, match=r"shape \(3, 2\), not \(2, …\)"):
        clip_groups(method, [method.w])


class _Push(Method):
    """One parameter w (starting at 2) with loss −w: the gradient is −1 at every step."""

    task = "regression"
    name = "push"

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1,), 2.0))

    def forward(self, x):
        return RegressionOutput(self.w.expand_as(x), torch.ones_like(x))

    def loss(self, batch):
        return -self.w.sum()


@pytest.mark.parametrize("decay_to,expected", [
    # SGD lr 0.1, weight decay 0.5, gradient −1, 4 steps (400 points, batch 100), by hand:
    # toward init: w ← w + 0.1, then w ← w − 0.1·0.5·(w − 2): the excess over 2 follows
    #   e ← 0.95·(e + 0.1): 0.095, 0.18525, 0.2709875, 0.352438125
    ("init", 2.352438125),
    # toward zero (SGD's own coupled decay): w ← w − 0.1·(−1 + 0.5·w) = 0.95·w + 0.1:
    #   2.0, 2.0, 2.0, 2.0 (2 is its fixed point)
    ("zero", 2.0),
])
def test_weight_decay_toward_the_initial_values(decay_to, expected):
    data = PolynomialData(n_train=400, batch_size=100)  # 4 steps per epoch
    data.setup()
    method = _Push()
    trainer = Trainer(optimizer=functools.partial(torch.optim.SGD, lr=0.1, weight_decay=0.5),
                      epochs=1, decay_to=decay_to, progress=False, val_every=100)
    trainer.fit(method, data, RegressionTask(), NullLogger())
    assert method.w.item() == pytest.approx(expected, abs=1e-6)


def test_an_unknown_decay_target_is_named():
    with pytest.raises(ValueError, match="trainer.decay_to 'pretrained'.*zero.*init"):
        Trainer(optimizer=torch.optim.SGD, decay_to="pretrained")


# --- model selection: which validated epoch's weights are kept --------------------------------

class _Scripted(Method):
    """Member logits scripted per epoch: one parameter w with loss −w (SGD lr 1, one step an
    epoch) counts the epochs, and at w = k the prediction for validation example i is
    ``script[k - 1][:, i]`` (M, C) logits."""

    task = "classification"
    name = "scripted"

    def __init__(self, script: list[list[list[list[float]]]]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.script = torch.tensor(script)                                 # (E, M, N, C)

    def forward(self, x):
        epoch = int(round(self.w.item()))
        return self.script[epoch - 1][:, x.long()]                         # (M, B, C)

    def loss(self, batch):
        return -self.w


class _Examples(DataModule):
    """One training example (one step an epoch) and validation examples 0 … N−1 with labels."""

    def __init__(self, labels: list[int]):
        super().__init__(batch_size=1, eval_batch_size=len(labels))
        self._splits = {"train": TensorDataset(torch.zeros(1), torch.zeros(1, dtype=torch.long)),
                        "val": TensorDataset(torch.arange(len(labels)).float(),
                                             torch.tensor(labels))}

    def dataset(self, split):
        return self._splits[split]


def _logits(p0: float) -> list[float]:
    """Two-class logits whose softmax is (p0, 1 − p0)."""
    return [math.log(p0), math.log(1 - p0)]


# One member, two validation examples, both of class 0; p(class 0) at each epoch:
#   epoch 1: 0.60, 0.60  → acc 1.0, nll −ln 0.6                   = 0.511
#   epoch 2: 0.99, 0.45  → acc 0.5, nll −(ln 0.99 + ln 0.45) / 2 = 0.404 (the lowest)
#   epoch 3: 0.55, 0.55  → acc 1.0, nll −ln 0.55                  = 0.598
# Accuracy peaks at epochs 1 and 3 (the earlier wins), the NLL at epoch 2.
ACC_VS_NLL = [[[_logits(0.60), _logits(0.60)]],
              [[_logits(0.99), _logits(0.45)]],
              [[_logits(0.55), _logits(0.55)]]]


@pytest.mark.parametrize("select,metric,epoch,value", [
    ("last", "nll", 3, None),
    ("best", "nll", 2, -(math.log(0.99) + math.log(0.45)) / 2),
    ("best", "acc", 1, 1.0),
])
def test_best_epoch_by_nll_or_accuracy(select, metric, epoch, value):
    method = _Scripted(ACC_VS_NLL)
    trainer = quick_trainer(3, lr=1.0, optimizer="torch.optim.SGD", val_every=1,
                            select=select, select_metric=metric)
    out = trainer.fit(method, _Examples([0, 0]), ClassificationTask(), NullLogger())
    assert out["selected_epoch"] == epoch
    assert method.w.item() == epoch  # the kept epoch's weights are the ones left in the model
    assert out["selected_by"] == ("last" if select == "last" else f"val/{metric}")
    if value is None:
        assert out["selected_value"] is None
    else:
        assert out["selected_value"] == pytest.approx(value, rel=1e-6)


# Three members, one validation example of class 0; member logits (a, 0), p(class 0) = σ(a):
#   epoch 1: a = (2.4, −1, −1)   mean_probs  nll −ln((σ(2.4) + 2σ(−1)) / 3) = 0.724
#                                mean_logits nll −ln σ(0.4 / 3)             = 0.628
#   epoch 2: a = (0.1, 0.1, 0.1) both        nll −ln σ(0.1)                 = 0.644
# so the lowest validation NLL is epoch 2's under mean_probs and epoch 1's under mean_logits.
def _members(*a: float) -> list[list[list[float]]]:
    return [[[x, 0.0]] for x in a]


@pytest.mark.parametrize("aggregation,epoch", [("mean_probs", 2), ("mean_logits", 1)])
def test_the_selection_loss_uses_the_tasks_aggregation(aggregation, epoch):
    sigma = lambda a: 1 / (1 + math.exp(-a))  # noqa: E731
    nll = {"mean_probs": [-math.log((sigma(2.4) + 2 * sigma(-1)) / 3), -math.log(sigma(0.1))],
           "mean_logits": [-math.log(sigma(0.4 / 3)), -math.log(sigma(0.1))]}[aggregation]
    method = _Scripted([_members(2.4, -1.0, -1.0), _members(0.1, 0.1, 0.1)])
    trainer = quick_trainer(2, lr=1.0, optimizer="torch.optim.SGD", val_every=1, select="best")
    out = trainer.fit(method, _Examples([0]), ClassificationTask(aggregation=aggregation),
                      NullLogger())
    assert out["selected_epoch"] == epoch
    assert out["selected_value"] == pytest.approx(nll[epoch - 1], rel=1e-5)


def test_a_selection_metric_the_task_lacks_is_named():
    trainer = quick_trainer(1, select="best", select_metric="acc")
    with pytest.raises(ValueError, match="select_metric 'acc' is not a metric of the "
                                         r"regression task.*\('nll',\)"):
        trainer.fit(_Constant(), PolynomialData(n_train=10, batch_size=10), RegressionTask(),
                    NullLogger())
    with pytest.raises(ValueError, match="select_metric 'loss' is not one of"):
        Trainer(optimizer=torch.optim.SGD, select_metric="loss")
