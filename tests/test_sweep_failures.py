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

# Imported before the command runs: the job whose overrides contain FAIL_WHEN fails, by
# FAIL_HOW: while it scores after training, an exception ("raise") or a library's exit()
# ("exit"); while it writes its run folder's files ("write": a disk that fills up halfway); or
# while a scoring job (job=eval) predicts ("eval").
INJECT = textwrap.dedent("""
    import os
    from uqbench.runner.jobs import score as eval_job, train as train_job

    scored, staged, predicted = train_job._score, train_job.write_stage, eval_job._predict

    def _chosen(how):
        from hydra.core.hydra_config import HydraConfig

        return (os.environ["FAIL_HOW"] == how
                and os.environ["FAIL_WHEN"] in HydraConfig.get().job.override_dirname)

    def _score(built, device):
        if _chosen("exit"):
            exit(0)  # as laplace-torch may: status 0, no results
        if _chosen("raise"):
            raise RuntimeError("injected: the scoring broke")
        return scored(built, device)

    def write_stage(stage, config, results, predictions):
        if _chosen("write"):
            (stage / "config.yaml").write_text("half")
            raise OSError(28, "No space left on device")
        return staged(stage, config, results, predictions)

    def _predict(configs, device):
        if _chosen("eval"):
            raise RuntimeError("injected: the scoring job broke")
        return predicted(configs, device)

    train_job._score, train_job.write_stage, eval_job._predict = _score, write_stage, _predict
""")


def command(tmp_path: Path, *args: str, fail_when: str = "never", fail_how: str = "raise"
            ) -> tuple[list[str], dict[str, str]]:
    """The uqbench command line (with the fault injection imported first) and its env."""
    (tmp_path / "inject.py").write_text(INJECT)
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import inject; "
            f"from uqbench.runner import cli; cli.main()")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAIL_WHEN": fail_when, "FAIL_HOW": fail_how}
    # flags first; the test's own overrides after TINY's: one named twice takes its last value
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    return [sys.executable, "-c", code, *flags, f"paths.runs_dir={tmp_path}/runs", *TINY,
            *overrides], env


def uqbench(tmp_path: Path, *args: str, fail_when: str = "never", fail_how: str = "raise"
            ) -> subprocess.CompletedProcess:
    argv, env = command(tmp_path, *args, fail_when=fail_when, fail_how=fail_how)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


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


@pytest.mark.slow
def test_a_failing_scoring_job_is_recorded_in_its_own_folder(tmp_path):
    """job=eval fails for seed 1: its scoring folder gets the record (a scoring's, so a table
    of scorings counts it), the trained runs are untouched, the other scoring is published."""
    assert uqbench(tmp_path, "-m", "seed=0,1").returncode == 0
    runs = folders(tmp_path)
    trained = {seed: snapshot(run) for seed, run in runs.items()}
    proc = uqbench(tmp_path, "-m", "job=eval", "seed=0,1", fail_when="seed=1", fail_how="eval")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "sweep: 2 runs: 1 done, 0 reused, 1 failed" in proc.stderr
    (ok,), (bad,) = ([p.parent for p in (runs[s] / "eval").rglob("results.json")]
                     + [p.parent for p in (runs[s] / "eval").rglob("failed.json")]
                     for s in ("seed0", "seed1"))
    assert not (bad / "results.json").exists() and not (ok / "failed.json").exists()
    record = json.loads((bad / "failed.json").read_text())
    assert record["reason"] == "RuntimeError: injected: the scoring job broke"
    assert record["run"]["job"] == "eval" and record["run"]["seed"] == 1
    assert record["run"]["of_run"] == str(runs["seed1"]) and record["run"]["metrics"] == {}
    for seed, run in runs.items():  # the scorings' folders aside, the runs are as they were
        now = {k: v for k, v in snapshot(run).items() if not k.startswith("eval/")}
        assert now == {k: v for k, v in trained[seed].items() if not k.startswith("eval/")}
    again = uqbench(tmp_path, "-m", "job=eval", "seed=0,1")
    assert again.returncode == 0 and "sweep: 2 runs: 1 done, 1 reused, 0 failed" in again.stderr
    assert (bad / "results.json").is_file() and not (bad / "failed.json").exists()


@pytest.mark.slow
def test_a_write_failure_while_publishing_leaves_the_finished_run_as_it_was(tmp_path):
    """overwrite=true retrains a finished run and the disk fills up while its files are
    written: nothing is published, the finished run's files are byte for byte what they were
    (the attempt's record and its resume checkpoint beside them), and no half-written file is
    in the folder."""
    assert uqbench(tmp_path).returncode == 0
    run, = folders(tmp_path).values()
    before = snapshot(run)
    proc = uqbench(tmp_path, "overwrite=true", fail_when="", fail_how="write")
    assert proc.returncode == 1 and "No space left on device" in proc.stderr
    after = snapshot(run)
    attempt = {"failed.json", "resume/last.ckpt"}  # the attempt's record and progress
    assert {k: v for k, v in after.items() if k not in attempt} == before
    assert set(after) - set(before) <= attempt
    assert json.loads(after["failed.json"])["reason"].startswith("OSError: [Errno 28]")
    assert [p.name for p in run.parent.iterdir() if p.name.startswith(".staging")] == []
    # a table reads the finished run, not the failed attempt
    from uqbench.report.validation import load_results

    loaded, = load_results(tmp_path / "runs")
    assert "failed" not in loaded and loaded["metrics"]


@pytest.mark.slow
def test_a_single_run_failing_to_write_publishes_nothing_and_its_retry_resumes(tmp_path):
    """Nothing is published but the record and the trained state; the same command again
    resumes from that state and publishes the metrics an uninterrupted run gets."""
    proc = uqbench(tmp_path, fail_when="", fail_how="write")
    assert proc.returncode == 1
    run, = folders(tmp_path).values()
    assert sorted(p.name for p in run.iterdir() if p.name != "uqbench.log") == ["failed.json",
                                                                                "resume"]
    again = uqbench(tmp_path)
    assert again.returncode == 0 and (run / "results.json").is_file()
    assert "resuming from" in (run / "uqbench.log").read_text()
    clean = tmp_path / "clean"
    clean.mkdir()
    assert uqbench(clean).returncode == 0
    (fresh,) = folders(clean).values()
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    assert metrics == json.loads((fresh / "results.json").read_text())["metrics"]


@pytest.mark.slow
def test_two_identical_sweeps_at_once_never_mix_their_runs(tmp_path):
    """The same sweep started twice at once: a run folder has one job at a time, so for each
    run one sweep trains it and the other reuses it or is refused naming the job that holds
    it; every run ends trained once, its results and config from one job."""
    argv, env = command(tmp_path, "-m", "seed=0,1,2")
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 or "another job (pid" in err, err[-2000:]
    assert any(p.returncode == 0 for p in procs)
    runs = folders(tmp_path)
    assert sorted(runs) == ["seed0", "seed1", "seed2"]
    trained = 0
    for run in runs.values():
        results = json.loads((run / "results.json").read_text())
        assert results["seed"] == int(run.name[4:]) and not (run / "failed.json").exists()
        trained += 1
    done = sum(int(line.split(" done")[0].rsplit(" ", 1)[1]) for _, err in outs
               for line in err.splitlines() if line.startswith("sweep:"))
    assert trained == 3 and done <= 3  # no run trained by both sweeps
    assert not [p for p in (tmp_path / "runs").rglob(".staging*")]


@pytest.mark.slow
def test_a_killed_sweep_worker_resumes_on_the_rerun_to_the_same_metrics(tmp_path):
    """SIGKILL one joblib worker of a two-job sweep mid-training (after its first resume
    checkpoint): the same command again resumes that run from its checkpoint and publishes the
    metrics of a run never interrupted; nothing of the other run is lost."""
    import signal
    import time

    long = ("trainer.epochs=3000", "trainer.checkpoint_every=100", "hydra/launcher=local",
            "hydra.launcher.n_jobs=2")
    argv, env = command(tmp_path, "-m", "seed=0,1", *long)
    sweep = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    checkpoint = None
    deadline = time.monotonic() + 300
    while checkpoint is None and time.monotonic() < deadline and sweep.poll() is None:
        found = list((tmp_path / "runs").rglob("seed1/resume/last.ckpt"))
        checkpoint = found[0] if found else None
        time.sleep(0.2)
    assert checkpoint is not None, "seed 1 wrote no resume checkpoint before the sweep ended"
    run = checkpoint.parents[1]
    pid = int((run.parent / f".{run.name}.lock").read_text())
    assert pid != sweep.pid  # a worker of the launcher, not the sweep itself
    os.kill(pid, signal.SIGKILL)
    _, err = sweep.communicate(timeout=600)
    assert not (run / "results.json").exists()  # killed before it published
    again = uqbench(tmp_path, "-m", "seed=0,1", *long)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming from" in (run / "uqbench.log").read_text()
    clean = tmp_path / "clean"
    clean.mkdir()
    assert uqbench(clean, "seed=1", "trainer.epochs=3000", "trainer.checkpoint_every=100"
                   ).returncode == 0
    (fresh,) = folders(clean).values()
    metrics = json.loads((run / "results.json").read_text())["metrics"]
    assert metrics == json.loads((fresh / "results.json").read_text())["metrics"]
    assert (folders(tmp_path)["seed0"] / "results.json").is_file()
