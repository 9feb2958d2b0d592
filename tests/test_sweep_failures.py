"""Sweeps that survive their own failures (uqbench/runner/outcomes.py): a run that fails once
its work started is recorded as failed (failed.json, never a results.json), the other jobs go
on, the sweep ends with a summary and status 1, and the same command again retrains only the
failed and missing runs. Faults are injected into the real command, run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

# tiny BNN runs on the polynomial data: a couple of seconds each
TINY = ("trainer.epochs=2", "trainer.progress=false", "dataset.n_train=64", "dataset.n_val=32",
        "dataset.n_test=32", "dataset.n_ood=32", "backbone.width=4", "method.check_samples=0",
        "plot=false", "save_predictions=false", "torch_threads=1")

# Imported before the command runs: the job whose overrides contain FAIL_WHEN fails while it
# scores (after training), by FAIL_HOW: an exception, or a library's exit().
INJECT = textwrap.dedent("""
    import os
    from uqbench.runner import train_job

    scored = train_job._score

    def _score(built, device):
        from hydra.core.hydra_config import HydraConfig

        if os.environ["FAIL_WHEN"] in HydraConfig.get().job.override_dirname:
            if os.environ["FAIL_HOW"] == "exit":
                exit(0)  # as laplace-torch may: status 0, no results
            raise RuntimeError("injected: the scoring broke")
        return scored(built, device)

    train_job._score = _score
""")


def uqbench(tmp_path: Path, *args: str, fail_when: str = "never", fail_how: str = "raise"
            ) -> subprocess.CompletedProcess:
    (tmp_path / "inject.py").write_text(INJECT)
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import inject; "
            f"from uqbench.runner import cli; cli.main()")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAIL_WHEN": fail_when, "FAIL_HOW": fail_how}
    return subprocess.run([sys.executable, "-c", code, *args, f"paths.runs_dir={tmp_path}/runs",
                           *TINY], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def folders(tmp_path: Path) -> dict[str, Path]:
    """seed → run folder of the sweep's runs."""
    return {p.name: p for p in (tmp_path / "runs" / "default").rglob("seed*") if p.is_dir()}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.name != "uqbench.log"}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_one_failing_job_of_four_is_recorded_and_the_others_finish(tmp_path, how):
    proc = uqbench(tmp_path, "-m", "seed=0,1,2,3", fail_when="seed=2", fail_how=how)
    assert proc.returncode == 1, proc.stderr[-2000:]
    runs = folders(tmp_path)
    assert sorted(runs) == ["seed0", "seed1", "seed2", "seed3"]
    for seed in ("seed0", "seed1", "seed3"):
        assert (runs[seed] / "results.json").is_file() and not (runs[seed] / "failed.json").exists()
    failed = runs["seed2"]
    assert not (failed / "results.json").exists() and not (failed / "config.yaml").exists()
    record = json.loads((failed / "failed.json").read_text())
    expected = "RuntimeError: injected: the scoring broke" if how == "raise" else "SystemExit(0)"
    assert record["status"] == "failed" and record["reason"].startswith(expected)
    assert "Traceback" in record["traceback"]
    assert "Traceback" in (failed / "uqbench.log").read_text()
    assert "sweep: 4 runs: 3 done, 0 reused, 1 failed" in proc.stderr
    assert f"FAILED {failed}: {expected}" in proc.stderr

    # the same command again, the fault gone: the three finished runs are reused untouched,
    # the failed one trains, and its record goes with its published results
    kept = {seed: snapshot(runs[seed]) for seed in ("seed0", "seed1", "seed3")}
    again = uqbench(tmp_path, "-m", "seed=0,1,2,3")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "sweep: 4 runs: 1 done, 3 reused, 0 failed" in again.stderr
    assert {seed: snapshot(runs[seed]) for seed in kept} == kept
    assert (failed / "results.json").is_file() and not (failed / "failed.json").exists()


@pytest.mark.slow
def test_a_diverged_run_beside_a_finished_one(tmp_path):
    """The issue's own example: two learning rates, one of which diverges."""
    proc = uqbench(tmp_path, "-m", "trainer.optimizer.lr=0.01,1e12")
    assert proc.returncode == 1
    runs = sorted(p for p in (tmp_path / "runs" / "default").rglob("seed0") if p.is_dir())
    done = [r for r in runs if (r / "results.json").is_file()]
    failed = [r for r in runs if (r / "failed.json").is_file()]
    assert len(done) == 1 and "lr=0.01" in str(done[0])
    assert len(failed) == 1 and "lr=1000000000000.0" in str(failed[0])
    reason = json.loads((failed[0] / "failed.json").read_text())["reason"]
    assert reason.startswith("NonFiniteLossError: the training loss became nan")
    before = snapshot(done[0])
    again = uqbench(tmp_path, "-m", "trainer.optimizer.lr=0.01,1e12")
    assert again.returncode == 1 and "sweep: 2 runs: 0 done, 1 reused, 1 failed" in again.stderr
    assert snapshot(done[0]) == before


@pytest.mark.slow
def test_a_single_run_that_fails_exits_1_with_its_record(tmp_path):
    proc = uqbench(tmp_path, fail_when="", fail_how="raise")  # "" is in every override list
    assert proc.returncode == 1
    run, = folders(tmp_path).values()
    assert json.loads((run / "failed.json").read_text())["error"] == "RuntimeError"
    assert "FAILED" in proc.stderr and "sweep:" not in proc.stderr


def test_a_mistake_found_before_any_work_still_stops_the_sweep_at_once(tmp_path):
    proc = uqbench(tmp_path, "-m", "seed=0,1", "eval_splits=[nope]")
    assert proc.returncode == 1
    assert "'nope' is not a split" in proc.stderr and "sweep:" not in proc.stderr
    assert not list((tmp_path / "runs").rglob("failed.json"))
    assert not list((tmp_path / "runs").rglob("results.json"))


@pytest.mark.slow
def test_train_and_eval_in_one_multirun_score_the_runs_they_trained(tmp_path):
    proc = uqbench(tmp_path, "-m", "job=train,eval", "seed=0,1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = folders(tmp_path)
    assert sorted(runs) == ["seed0", "seed1"]  # no job=train level in the path
    for run in runs.values():
        assert "job=" not in str(run)
        assert (run / "results.json").is_file()
        assert len(list((run / "eval").glob("polynomial*/results.json"))) == 1
    assert "sweep: 4 runs: 4 done, 0 reused, 0 failed" in proc.stderr
    again = uqbench(tmp_path, "-m", "job=train,eval", "seed=0,1")
    assert again.returncode == 0 and "sweep: 4 runs: 0 done, 4 reused, 0 failed" in again.stderr
