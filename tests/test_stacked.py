"""Seeds trained side by side in one job (``stack_seeds``, :mod:`uqbench.runner.jobs.stacked`): each
member's run folder holds what its own job writes; what cannot be stacked is refused first."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers import run_cli
from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.base import Method
from uqbench.methods.bnn import BayesianMLP

TINY = ["trainer.epochs=4", "trainer.val_every=2", "trainer.progress=false",
        "dataset.n_train=300", "dataset.n_val=50", "dataset.n_test=100", "dataset.n_ood=100",
        "logger=none", "backbone.width=8", "method.check_samples=50"]


def _folders(root):
    return {p.parent.name: p.parent for p in root.rglob("results.json")}


def test_stacked_seeds_write_what_their_own_jobs_write(tmp_path):
    """Seeds 1 and 2 in one stacked job against each in its own job (the ordinary loop):
    the same folders, config.yaml, metrics and predictions, to float rounding."""
    run_cli("-m", *TINY, f"paths.runs_dir={tmp_path / 'own'}", "method.variance=learned",
            "seed=1,2")
    run_cli(*TINY, f"paths.runs_dir={tmp_path / 'stacked'}", "method.variance=learned",
            "seed=1", "stack_seeds=[1,2]")
    own, stacked = _folders(tmp_path / "own"), _folders(tmp_path / "stacked")
    assert sorted(own) == sorted(stacked) == ["seed1", "seed2"]
    assert ([p.relative_to(tmp_path / "own") for p in own.values()]
            == [p.relative_to(tmp_path / "stacked") for p in stacked.values()])
    for seed in ("seed1", "seed2"):
        config = [(f[seed] / "config.yaml").read_text() for f in (own, stacked)]
        assert config[0].replace("own", "stacked") == config[1]
        a, b = (json.loads((f[seed] / "results.json").read_text()) for f in (own, stacked))
        assert a["seed"] == b["seed"] == int(seed[-1])
        assert a["train"]["stacked_with"] is None and b["train"]["stacked_with"] == [1, 2]
        assert a["train"]["steps_run"] == b["train"]["steps_run"] == 4 * 3
        assert set(a["metrics"]) == set(b["metrics"])
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        for split in ("test", "ood"):
            p, q = (np.load(f[seed] / "predictions" / f"{split}.npz") for f in (own, stacked))
            np.testing.assert_allclose(q["mean"], p["mean"], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(q["var"], p["var"], rtol=1e-4, atol=1e-7)
    # the two seeds did train differently (their own data orders and initialisations)
    s1, s2 = (json.loads((stacked[s] / "results.json").read_text())["metrics"]["test/nll"]
              for s in ("seed1", "seed2"))
    assert s1 != s2


@pytest.mark.slow  # two CLI runs, the second a stacked job
def test_a_finished_member_is_reused_and_the_rest_train(tmp_path):
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "seed=0")
    done = next(iter(_folders(tmp_path).values())) / "results.json"
    before = done.read_bytes()
    proc = run_cli(*TINY, f"paths.runs_dir={tmp_path}", "stack_seeds=[0,3]",
                   "skip_existing=true")
    assert done.read_bytes() == before  # reused, not retrained
    assert sorted(_folders(tmp_path)) == ["seed0", "seed3"]
    stacked = json.loads((_folders(tmp_path)["seed3"] / "results.json").read_text())
    assert stacked["train"]["stacked_with"] == [3]
    assert proc.stdout.count("test/nll=") == 2  # both members' results are reported


@pytest.mark.parametrize(("override", "expected"), [
    (["stack_seeds=[1,2]"], "seed=0 is not one of stack_seeds [1, 2]"),
    (["stack_seeds=[0,0]"], "names a seed twice"),
    (["stack_seeds=[]"], "non-empty list"),
    (["stack_seeds=[0,1]", "method.training=sampling"], "method.training=sampling draws"),
    (["stack_seeds=[0,1]", "trainer.select=best"], "trainer.select=best"),
    (["stack_seeds=[0,1]", "trainer.grad_clip=1.0"], "trainer.grad_clip=1.0"),
    (["stack_seeds=[0,1]", "method=mc_dropout", "dataset=fake_images", "backbone=tiny_vit"],
     "does not declare that its runs can train side by side"),
])
def test_what_cannot_train_side_by_side_is_refused_before_anything_is_written(
        tmp_path, override, expected):
    tiny = TINY if "method=mc_dropout" not in override else ["logger=none"]
    proc = run_cli(*tiny, f"paths.runs_dir={tmp_path}", *override, check=False)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


def _member(seed: int, variance: str) -> BayesianMLP:
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(seed)
    model = BayesianMLP(MLP(width=8, depth=2, slope=0.1), info, variance=variance)
    with torch.no_grad():  # away from the initial values: ρ of every sign, μ of every size
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model.double()


# compiled: two cold compiles of the stacked graph (about 50 s), in the slow suite
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("variance", ["embedded", "learned"])
def test_members_side_by_side_give_each_its_own_loss_and_gradients(variance, compiled):
    """The BNN's stacked loss (the members as one batched network; compiled: one graph)
    against each member's own loss, one network at a time: the same values, and each member's
    parameters get its own loss's gradient."""
    from torch._dynamo.utils import counters

    members = [_member(seed, variance) for seed in (0, 1, 2)]
    batches = [(torch.randn(20, 1, dtype=torch.float64) * 1.5,
                torch.randn(20, 1, dtype=torch.float64)) for _ in members]
    want = [m.loss(b) for m, b in zip(members, batches, strict=True)]
    want_grads = [torch.autograd.grad(w, list(m.parameters()))
                  for w, m in zip(want, members, strict=True)]
    for m in members:
        m.compiled = compiled  # what method.compile sets
    before = counters["stats"]["unique_graphs"]
    losses = BayesianMLP.stacked_losses(members, batches)
    # the compiled graph is what ran, or nothing was compiled
    assert (counters["stats"]["unique_graphs"] > before) == compiled
    got_grads = torch.autograd.grad(losses.sum(), [p for m in members for p in m.parameters()])
    torch.testing.assert_close(losses, torch.stack(want), rtol=1e-10, atol=0)
    flat_want = [g for grads in want_grads for g in grads]
    for g, w in zip(got_grads, flat_want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)
    # the default (any method): each member's own loss, stacked
    torch.testing.assert_close(Method.stacked_losses(members, batches), losses, rtol=1e-10,
                               atol=0)
    # trained as (R, …) tensors (what a stacked job optimises): member r's gradient at [r]
    assert BayesianMLP.trains_stacked(members)
    leaves = [torch.stack([p.detach() for p in ps]).requires_grad_()
              for ps in zip(*(m.parameters() for m in members), strict=True)]
    from_leaves = BayesianMLP.stacked_losses(members, batches, leaves)
    torch.testing.assert_close(from_leaves, torch.stack(want), rtol=1e-10, atol=0)
    for leaf, grad in zip(leaves, torch.autograd.grad(from_leaves.sum(), leaves), strict=True):
        for r, grads in enumerate(want_grads):
            want_leaf = grads[next(i for i, p in enumerate(leaves) if p is leaf)]
            torch.testing.assert_close(grad[r], want_leaf, rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="from their own parameters"):
        Method.stacked_losses(members, batches, leaves)


def test_members_of_other_structures_or_batches_are_taken_one_by_one():
    """Members the batched network cannot hold together (other variance heads, batches of
    other sizes) still get their own losses."""
    members = [_member(0, "embedded"), _member(1, "learned")]
    batches = [(torch.randn(n, 1, dtype=torch.float64), torch.randn(n, 1, dtype=torch.float64))
               for n in (20, 20)]
    want = torch.stack([m.loss(b) for m, b in zip(members, batches, strict=True)])
    assert not BayesianMLP.trains_stacked(members)
    torch.testing.assert_close(BayesianMLP.stacked_losses(members, batches), want)
    same = [_member(0, "embedded"), _member(1, "embedded")]
    uneven = [batches[0], (batches[1][0][:15], batches[1][1][:15])]
    want = torch.stack([m.loss(b) for m, b in zip(same, uneven, strict=True)])
    torch.testing.assert_close(BayesianMLP.stacked_losses(same, uneven), want)
