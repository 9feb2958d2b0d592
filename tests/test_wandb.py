"""Weights & Biases without a network: what an offline run holds, read back with wandb's own
reader (``wandb leet inspect``), how runs are labelled, failures, and bad settings."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import ROOT, run_cli
from uqbench.records.loggers import WandbLogger, run_labels, summary_of

WANDB = Path(sys.executable).with_name("wandb")
REGRESSION = ["trainer.epochs=3", "trainer.progress=false", "trainer.val_every=1",
              "dataset.n_train=200", "dataset.n_val=50", "dataset.n_test=100",
              "dataset.n_ood=100", "logger=wandb", "logger.mode=offline", "device=cpu",
              "torch_threads=1", "experiment_name=wbt", "run_name=wbt/embedded_w16/seed0"]
CLASSIFICATION = ["backbone=tiny_vit", "dataset=fake_images", "method=sve", "trainer=p1",
                  "trainer.epochs=2", "trainer.warmup_epochs=0", "trainer.progress=false",
                  "logger=wandb", "logger.mode=offline", "logger.log_predictions=true",
                  "device=cpu", "torch_threads=1", "run_name=cls/seed0",
                  "experiment_name=clsexp"]


def _offline_runs(folder: Path) -> list[Path]:
    return sorted(folder.rglob("offline-run-*"))


def _inspect(run: Path, summary: bool) -> dict | list[dict]:
    """wandb's own reader of an offline run: --summary gives state, config and summary;
    without it, every record of the transaction log."""
    args = [str(WANDB), "leet", "inspect", "--json", *(["--summary"] if summary else []),
            str(run)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out) if summary else [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def regression_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    run_cli(*REGRESSION, f"paths.runs_dir={runs}")
    (result,) = runs.rglob("results.json")
    (offline,) = _offline_runs(runs)
    # an experiment's runs share one W&B folder, runs/<experiment>/wandb
    assert offline.parent == runs / "wbt" / "wandb"
    return json.loads(result.read_text()), offline


def test_offline_run_holds_config_history_and_summary(regression_run):
    results, offline = regression_run
    state = _inspect(offline, summary=True)
    assert state["state"] == "finished" and state["exit_code"] == 0
    assert state["run_id"] == hashlib.sha1(results["run"].encode()).hexdigest()[:16]
    config = state["config"]
    # flat keys to filter by, and the whole config in the override syntax
    assert (config["method"], config["backbone"], config["dataset"]) == ("bnn", "mlp",
                                                                         "polynomial")
    assert (config["seed"], config["members"], config["experiment"]) == (0, 1, "wbt")
    assert config["job"] == "train" and config["method.variance"] == "embedded"
    assert config["backbone.width"] == results["settings"]["backbone"]["width"]
    summary = state["summary"]
    # everything a table shows: metrics, parameter counts, times, the selected epoch
    for key, value in results["metrics"].items():
        assert summary[key] == pytest.approx(value), key
    assert summary["params/trainable"] == results["params"]["trainable"]
    assert summary["time/train_s"] == pytest.approx(results["time"]["train_s"])
    assert summary["train/selected_epoch"] == results["train"]["selected_epoch"]
    assert summary["figure"]["_type"] == "image-file"
    # one history row per epoch, plotted against the epoch
    history = [r["history"]["item"] for r in _inspect(offline, summary=False)
               if r.get("type") == "history"]
    assert [row["epoch"] for row in history if "train/loss" in row] == [1, 2, 3]
    assert all("val/nll" in row for row in history if "train/loss" in row)


def test_runs_are_grouped_by_setting_with_tags(regression_run):
    results, offline = regression_run
    (record,) = [r["run"] for r in _inspect(offline, summary=False) if r.get("type") == "run"]
    assert record["run_group"] == results["run"].rsplit("/", 1)[0]  # the folder less the seed
    assert results["run"].rsplit("/", 1)[1] == "seed0"
    assert record["job_type"] == "train"
    assert {"method:bnn", "dataset:polynomial", "backbone:mlp", "job:train"} <= set(
        record["tags"])
    assert not any(t.startswith(("logger:", "paths:")) for t in record["tags"])


def test_labels_of_a_long_folder_fit_wandb_limits():
    folder = "exp/data/method/backbone/" + ",".join(f"key{i}=value{i}" for i in range(30)) \
        + "/seed3"
    labels = run_labels({"seed": 3, "method": {"members": 8}}, {"method": "sve"}, "train",
                        folder)
    assert len(labels.name) <= 128 and len(labels.group) <= 128
    assert labels.flat["members"] == 8 and labels.flat["seed"] == 3
    # two folders that differ past the limit still get different names, ids and groups
    other = run_labels({}, {}, "train", folder.replace("value29", "other"))
    assert (other.name, other.id, other.group) != (labels.name, labels.id, labels.group)
    assert labels.id == hashlib.sha1(folder.encode()).hexdigest()[:16]


def test_summary_flattens_every_number_a_table_reads():
    results = {"metrics": {"test/acc": 0.5}, "params": {"trainable": 10, "by": {"head": 4}},
               "time": {"train_s": 1.5}, "train": {"selected_epoch": 7, "device": "cpu",
                                                    "updated_weights": True}}
    assert summary_of(results) == {"test/acc": 0.5, "params/trainable": 10,
                                   "params/by/head": 4, "time/train_s": 1.5,
                                   "train/selected_epoch": 7}


@pytest.mark.slow
def test_classification_run_logs_diagrams_and_predictions(tmp_path):
    run_cli(*CLASSIFICATION, f"paths.runs_dir={tmp_path}")
    run_dir = tmp_path / "cls" / "seed0"
    assert (run_dir / "figures" / "reliability.png").stat().st_size > 0
    assert (run_dir / "figures" / "ood_scores.png").stat().st_size > 0
    (offline,) = _offline_runs(tmp_path / "clsexp" / "wandb")
    state = _inspect(offline, summary=True)
    assert state["summary"]["figures/reliability"]["_type"] == "image-file"
    assert state["summary"]["figures/ood_scores"]["_type"] == "image-file"
    assert state["config"]["members"] == 4 and state["config"]["method"] == "sve"
    records = _inspect(offline, summary=False)
    artifacts = [r["artifact"] for r in records if r.get("type") == "artifact"]
    assert [a["type"] for a in artifacts] == ["predictions"]
    names = {e["path"] for e in artifacts[0]["manifest"]["contents"]}
    assert names == {p.name for p in (run_dir / "predictions").iterdir()}
    # scored again (job=eval): a run of job type eval in the same group and W&B folder
    run_cli("job=eval", f"eval_run={run_dir}", "logger=wandb", "logger.mode=offline",
            f"paths.runs_dir={tmp_path}", "device=cpu")
    scored = json.loads((run_dir / "eval" / "fake_images" / "results.json").read_text())
    (evaluated,) = set(_offline_runs(tmp_path / "clsexp" / "wandb")) - {offline}
    (record,) = [r["run"] for r in _inspect(evaluated, summary=False) if r.get("type") == "run"]
    assert (record["job_type"], record["run_group"]) == ("eval", "cls")
    summary = _inspect(evaluated, summary=True)["summary"]
    assert summary["test/nll"] == pytest.approx(scored["metrics"]["test/nll"])


def test_a_failed_run_is_marked_failed(tmp_path):
    """A NaN loss stops the run with an error; its W&B record says failed, not finished."""
    proc = run_cli(*REGRESSION, f"paths.runs_dir={tmp_path}", "trainer.optimizer.lr=1e30",
                   "method.rho_init=30", check=False)
    assert proc.returncode == 1 and "loss became nan" in proc.stderr
    (offline,) = _offline_runs(tmp_path)
    state = _inspect(offline, summary=True)
    assert state["exit_code"] == 1 and state["state"] != "finished"


def test_online_without_a_network_records_offline_within_seconds(tmp_path):
    """A closed port stands for a server that cannot be reached: the run says so once and
    writes its results and an offline record instead of waiting on W&B's retries."""
    env = {**os.environ, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "a" * 40}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *REGRESSION,
                           "logger.mode=online", f"paths.runs_dir={tmp_path}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(tmp_path.rglob("results.json"))) == 1
    assert len(_offline_runs(tmp_path)) == 1
    said = (proc.stdout + proc.stderr).count("W&B is unreachable")
    assert said == 1, proc.stderr[-2000:]
    assert elapsed < 60  # W&B's own retries alone take 90 s


@pytest.mark.parametrize("override, expected", [
    ("logger.mode=onlin", "logger.mode 'onlin' is not one of online, offline, disabled"),
    ("logger.project=team/proj", "logger.project 'team/proj' is not a W&B project name"),
    ("logger.entity='my team'", "logger.entity 'my team' is not a W&B user or team name"),
])
def test_bad_wandb_settings_fail_before_training(tmp_path, override, expected):
    proc = run_cli(*REGRESSION, f"paths.runs_dir={tmp_path}", override, check=False)
    assert proc.returncode == 1
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.rglob("results.json")) and not _offline_runs(tmp_path)


def test_an_unwritable_wandb_folder_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        WandbLogger(dir=str(blocker / "wandb"))
    proc = run_cli(*REGRESSION, f"paths.runs_dir={tmp_path}", f"logger.dir={blocker}/wandb",
                   check=False)
    assert proc.returncode == 1 and f"logger.dir {blocker}/wandb" in proc.stderr
    assert not list(tmp_path.rglob("results.json"))


def test_readme_sync_command_finds_every_offline_run_in_plain_bash(tmp_path):
    """The `wandb sync` line of docs/usage.md, run by a default bash (no globstar) with a
    stand-in `wandb` that prints its arguments, names every experiment's offline runs."""
    readme = (ROOT / "docs" / "usage.md").read_text()
    (line,) = [ln.split("#")[0].strip() for ln in readme.splitlines()
               if ln.startswith("wandb sync ")]
    runs = tmp_path / "runs"
    wanted = {runs / "p2_width_sweep/wandb/offline-run-20260101_000000-a1",
              runs / "p2_width_sweep/wandb/offline-run-20260101_000001-b2",
              runs / "default/wandb/offline-run-20260101_000002-c3"}
    for folder in wanted:
        (folder / "files").mkdir(parents=True)
    (runs / "p2_width_sweep/wandb/latest-run").symlink_to(sorted(wanted)[0])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "wandb").write_text('#!/bin/sh\nfor a in "$@"; do echo "ARG $a"; done\n')
    (bin_dir / "wandb").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    args = [a[4:] for a in out.splitlines() if a.startswith("ARG ")]
    assert args[0] == "sync"
    assert {tmp_path / a for a in args[1:]} == wanted


def test_reliability_bins_by_hand():
    import torch

    from uqbench import metrics as M

    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.55, 0.45], [0.2, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1])
    bins = M.reliability(probs, y, bins=2)  # (0, 0.5], (0.5, 1]: every confidence > 0.5
    assert bins["count"].tolist() == [0, 4]
    assert np.isnan(bins["confidence"][0].item())
    assert bins["confidence"][1].item() == pytest.approx((0.9 + 0.6 + 0.55 + 0.8) / 4)
    assert bins["accuracy"][1].item() == pytest.approx(3 / 4)
    assert M.ece(probs, y, 2).item() == pytest.approx(abs(3 / 4 - 2.85 / 4))



def test_a_nan_metric_marks_the_run_failed(tmp_path):
    """A run whose scoring gave a NaN is published (its files are the record) but its
    tracker run is closed as failed, with the summary a table reads."""
    from uqbench.records.loggers import Logger, log_results

    class Recorder(Logger):
        def __init__(self):
            self.summary, self.failed = None, None

        def log_summary(self, metrics):
            self.summary = metrics

        def finish(self, failed=False):
            self.failed = failed

    for metrics, failed in [({"test/nll": float("nan"), "test/acc": 0.5}, True),
                            ({"test/nll": 0.3, "test/acc": 0.5}, False)]:
        recorder = Recorder()
        log_results(recorder, {"run": "r", "metrics": metrics, "params": {"total": 3}},
                      tmp_path, [])
        assert recorder.failed is failed
        assert recorder.summary["params/total"] == 3 and recorder.summary["test/acc"] == 0.5


def test_tables_are_logged_as_one_wandb_run_per_experiment(tmp_path, capsys):
    """`uqbench-tables --wandb`: the experiment's table (the rows of the Markdown table) and
    numbers as W&B tables, its figures, in a `tables` run beside the experiment's runs."""
    import pandas as pd

    from tests.test_tables_output import write_runs
    from uqbench.report.tables import main as tables_main

    runs = write_runs(tmp_path / "runs")
    out = tmp_path / "tables"
    tables_main(["--runs", str(runs), "--out", str(out), "--quiet", "--wandb",
                 "--wandb-mode", "offline"])
    (offline,) = _offline_runs(runs / "toy" / "wandb")
    state = _inspect(offline, summary=True)
    assert state["run_id"] == hashlib.sha1(b"toy/tables").hexdigest()[:16]
    assert state["state"] == "finished"
    summary = state["summary"]
    assert summary["table"]["_type"] == "table-file"
    assert summary["figures/toy"]["_type"] == "image-file"
    logged = json.loads((offline / "files" / summary["numbers"]["path"]).read_text())
    csv = pd.read_csv(out / "toy.csv")
    assert logged["columns"] == list(csv.columns)
    assert len(logged["data"]) == len(csv) == 4
    mean = logged["columns"].index("NLL mean")
    assert [row[mean] for row in logged["data"]] == pytest.approx(csv["NLL mean"].tolist())
    (record,) = [r["run"] for r in _inspect(offline, summary=False) if r.get("type") == "run"]
    assert record["job_type"] == "tables" and record["run_group"] == "toy"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        tables_main(["--runs", str(runs), "--out", str(out), "--wandb", "--wandb-mode",
                     "onlin"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("error: --wandb-mode 'onlin' is not one of")
