"""The `uqbench` CLI end to end on the polynomial benchmark, and `uqbench-tables`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.stats import norm

from tests.helpers import run_cli
from uqbench.report.tables import main as tables_main

TINY = ["trainer.epochs=3", "trainer.progress=false", "dataset.n_train=200",
        "dataset.n_val=50", "dataset.n_test=100", "dataset.n_ood=100", "logger=none"]
# TINY's overrides that change a result (logger and progress do not), sorted: one more level
TINY_DIR = ("dataset.n_ood=100,dataset.n_test=100,dataset.n_train=200,dataset.n_val=50,"
            "trainer.epochs=3")


def _results(run_dir):
    return json.loads((run_dir / "results.json").read_text())


def test_run_writes_results_and_predictions_that_recompute(tmp_path):
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "backbone.width=4", "method.variance=learned",
            "seed=3")
    run_dir = (tmp_path / "default/polynomial/bnn_learned/mlp_w4" / TINY_DIR / "seed3")
    res = _results(run_dir)
    assert (res["dataset"], res["method"], res["backbone"], res["seed"]) == (
        "polynomial", "bnn", "mlp", 3)
    assert res["settings"]["method"]["variance"] == "learned"
    assert res["settings"]["backbone"]["width"] == 4
    assert res["params"] == {"total": 36, "trainable": 36}
    assert "method.variance=learned" in res["overrides"]
    assert res["time"]["train_s"] > 0 and res["time"]["eval_s"] >= 0
    # a moment layer runs 3 matrix products (mean; var from v and from m²), 2 FLOPs per
    # multiply-add: 4→2 (mean and variance outputs) costs 3·2·4·2 per example; the first layer
    # has one input, an outer product computed elementwise (no matrix product to count)
    assert res["cost"]["forward_flops_per_example"] == 3 * 2 * 4 * 2
    assert res["cost"]["peak_memory_bytes"] > 10**6
    assert "val/nll" in res["metrics"]  # the validation split is scored too
    # split-conformal intervals at 90 %: q is the ⌈(n + 1)·0.9⌉-th smallest validation score
    # |y − μ|/σ (n = 50: the 46th), recomputed here from the saved validation predictions
    v = np.load(run_dir / "predictions" / "val.npz")
    scores = np.sort(np.abs(v["y"] - v["mean"]).ravel() / np.sqrt(v["var"]).ravel())
    q = scores[math.ceil(51 * 0.9) - 1]
    assert res["calibration"]["conformal_normalized"] == pytest.approx(q, rel=1e-6)
    assert "val/cp/coverage" not in res["metrics"]  # fitted there: not a measurement
    assert (run_dir / "config.yaml").exists() and (run_dir / "figure.png").exists()
    for split in ("test", "ood"):
        p = np.load(run_dir / "predictions" / f"{split}.npz")
        assert set(p.files) == {"x", "y", "mean", "var", "var_aleatoric", "noise_std"}
        # the data's true noise at these inputs: σ(x) = 0.05 + 0.3|x| (the dataset's default)
        np.testing.assert_allclose(p["noise_std"], 0.05 + 0.3 * np.abs(p["x"]), rtol=1e-6)
        assert p["y"].shape == p["mean"].shape == (100, 1)
        assert np.all(p["var"] >= p["var_aleatoric"])
        y, mu, sd = p["y"].astype(np.float64), p["mean"], np.sqrt(p["var"].astype(np.float64))
        m = res["metrics"]
        # recomputed with scipy / numpy, independently of uqbench.metrics
        assert m[f"{split}/nll"] == pytest.approx(-norm.logpdf(y, mu, sd).mean(), rel=1e-5)
        assert m[f"{split}/rmse"] == pytest.approx(math.sqrt(((y - mu) ** 2).mean()), rel=1e-5)
        assert m[f"{split}/coverage_2sigma"] == pytest.approx(
            (np.abs(y - mu) <= 2 * sd).mean(), abs=1e-9)
        assert m[f"{split}/mean_std"] == pytest.approx(sd.mean(), rel=1e-5)
        assert m[f"{split}/cp/coverage"] == pytest.approx((np.abs(y - mu) <= q * sd).mean())
        assert m[f"{split}/cp/width"] == pytest.approx(2 * q * sd.mean(), rel=1e-5)
        true = p["noise_std"].astype(np.float64)
        assert m[f"{split}/noise_std_ratio"] == pytest.approx(sd.mean() / true.mean(), rel=1e-5)
        assert m[f"{split}/noise_std_error"] == pytest.approx(
            np.abs(sd - true).mean() / true.mean(), rel=1e-5)
    if (run_dir / "predictions" / "test.npz").exists():
        x = np.load(run_dir / "predictions" / "ood.npz")["x"]
        assert np.all(np.abs(x) > 1.5)


@pytest.mark.slow
def test_existing_results_are_kept_unless_asked(tmp_path):
    args = [*TINY, f"paths.runs_dir={tmp_path}", "run_name=mine"]
    run_cli(*args)
    path = tmp_path / "mine" / "results.json"
    before = path.read_text()
    proc = run_cli(*args, check=False)
    assert proc.returncode != 0
    assert "already exists" in proc.stderr and "overwrite=true" in proc.stderr
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "checkpoint.ckpt", "config.yaml", "figure.png", "predictions", "results.json",
        "uqbench.log"]
    run_cli(*args, "skip_existing=true")
    assert path.read_text() == before
    run_cli(*args, "overwrite=true")                      # same configuration: replaced
    assert path.read_text() != before and _results(path.parent)["seed"] == 0
    # another configuration in the same folder is refused, whatever the flags, with the diff
    replaced = path.read_text()
    for flag in ("overwrite=true", "skip_existing=true"):
        proc = run_cli(*args, flag, "seed=5", "trainer.optimizer.lr=0.001", check=False)
        assert proc.returncode == 1 and "another configuration" in proc.stderr
        assert "seed: 0 (stored) → 5 (requested)" in proc.stderr
        assert "trainer.optimizer.lr: 0.01 (stored) → 0.001 (requested)" in proc.stderr
        assert path.read_text() == replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]


@pytest.mark.slow
@pytest.mark.parametrize("override,expected", [
    ("method=nope", ["method", "bnn"]),          # Hydra lists the group's options
    ("backbone.width=0", ["backbone.width", "0"]),
    ("dataset.train_range=[1.0,1.0]", ["train_range", "empty"]),
    ("method.prior_std=-1", ["prior_std", "-1"]),
    ("method=sve", ["solves classification", "one of: bnn"]),  # methods of the data's task
    ("task=classification", ["regression dataset", "task=classification"]),
    ("trainer.schedule=linear", ["trainer.schedule", "linear"]),  # the trainer checks itself
    # types, checked against the constructors' annotations before anything is built
    ("backbone.width=2.5", ["backbone.width must be an integer", "2.5"]),
    ("trainer.epochs=2.5", ["trainer.epochs must be an integer", "2.5"]),
    ("trainer.epochs=abc", ["trainer.epochs must be an integer", "'abc'"]),
    ("trainer.optimizer.lr=fast", ["trainer.optimizer.lr must be a number", "'fast'"]),
    ("dataset.batch_size=nan", ["dataset.batch_size must be a finite number", "nan"]),
    ("seed=abc", ["seed must be an integer", "'abc'"]),
    ("method.rho_init=inf", ["method.rho_init must be a finite number", "inf"]),
    ("method.prior_std=nan", ["method.prior_std must be a finite number", "nan"]),
    ("device=tpu", ["device 'tpu'", "auto, cpu, cuda, cuda:<index>, mps"]),
    ("torch_threads=0", ["torch_threads must be >= 1"]),
    ("paths.runs_dir=", ["paths.runs_dir is empty"]),          # would write at the root
])
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path, override, expected):
    proc = run_cli(*TINY, f"paths.runs_dir={tmp_path}", override, check=False)
    assert proc.returncode != 0
    for word in expected:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    # one format for Hydra's errors (method=nope) and uqbench's
    assert "error: " in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert "(set UQBENCH_TRACEBACK=1 for the full traceback)" in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


@pytest.mark.slow
def test_an_untrained_model_is_evaluated_but_marked(tmp_path):
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "trainer.epochs=0", "run_name=untrained")
    res = _results(tmp_path / "untrained")
    assert res["train"]["updated_weights"] is False and res["train"]["epochs"] == 0
    run_cli(*TINY, f"paths.runs_dir={tmp_path}", "trainer.optimizer.lr=0", "run_name=lr0")
    assert _results(tmp_path / "lr0")["train"]["updated_weights"] is False
    env = _results(tmp_path / "lr0")["environment"]
    assert env["torch_threads"] >= 1 and env["torch"] and env["numpy"]


def test_nan_loss_leaves_no_results(tmp_path):
    proc = run_cli(*TINY, f"paths.runs_dir={tmp_path}", "trainer.optimizer.lr=1e12",
                   "trainer.epochs=50", check=False)
    assert proc.returncode != 0
    assert "epoch" in proc.stderr and "step" in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


@pytest.mark.slow
def test_multirun_then_tables(tmp_path, capsys):
    run_cli("experiment=p2_width_sweep", *TINY, f"paths.runs_dir={tmp_path}",
            "backbone.width=4,8", "stack_seeds=[0,1]")
    assert len(list(tmp_path.rglob("results.json"))) == 2 * 2 * 2
    out = tmp_path / "tables"
    tables_main(["--runs", str(tmp_path), "--out", str(out)])
    md = (out / "p2_width_sweep.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("|") and "---" not in line]
    assert len(rows) == 1 + 4  # header + widths × variances
    assert " width " in rows[0] and "test NLL" in rows[0]
    # the table's cell is the mean over seeds of the runs' values
    nll = [_results(p.parent)["metrics"]["test/nll"] for p in
           tmp_path.rglob("bnn_embedded/mlp_w4/**/results.json")]
    emb4 = next(r for r in rows if r.split("|")[1].strip() == "4" and "embedded" in r)
    assert emb4.split("|")[4].strip().startswith(f"{np.mean(nll):.3f}")
    assert (out / "p2_width_sweep.tex").exists() and (out / "p2_width_sweep.csv").exists()
    assert (out / "p2_width_sweep.png").exists()
