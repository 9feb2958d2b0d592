"""Run folders never lie: one job per folder, all-or-nothing publishing, recovery after kills."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.helpers import ROOT
from uqbench.records import runfolder

SMALL = ["trainer.epochs=2", "trainer.progress=false", "dataset.n_train=100", "dataset.n_val=20",
         "dataset.n_test=20", "dataset.n_ood=20", "plot=false"]


def _cli(*args: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("UQBENCH_KILL_AT", None)
    if kill_at:
        env["UQBENCH_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished run (with predictions) to copy: its folder and its results.json bytes."""
    runs = tmp_path_factory.mktemp("runs")
    proc = _cli(*SMALL, f"paths.runs_dir={runs}", "run_name=base")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return runs / "base"


@pytest.mark.slow
@pytest.mark.parametrize("point,survivor", [("staged", "old"), ("swapped", "new"),
                                            ("carried", "new")])
def test_a_kill_while_publishing_leaves_one_complete_folder(tmp_path, finished, point,
                                                            survivor):
    run_dir = tmp_path / "k"
    shutil.copytree(finished, run_dir)
    before = (run_dir / "results.json").read_bytes()
    # the new attempt keeps no predictions, so old and new folders are told apart by them
    proc = _cli(*SMALL, f"paths.runs_dir={tmp_path}", "run_name=k", "overwrite=true",
                "save_predictions=false", kill_at=point)
    assert proc.returncode == -signal.SIGKILL
    now = (run_dir / "results.json").read_bytes()
    has_predictions = (run_dir / "predictions" / "test.npz").is_file()
    assert (now == before, has_predictions) == ((True, True) if survivor == "old"
                                                else (False, False))
    assert (run_dir / "config.yaml").is_file()
    # the next job in the folder mends what the kill left, and reuses the survivor as is
    proc = _cli(*SMALL, f"paths.runs_dir={tmp_path}", "run_name=k", "skip_existing=true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "results.json").read_bytes() == now
    log = (run_dir / "uqbench.log").read_text()  # every attempt's lines, the first run's too
    assert log.count("wrote ") >= 1 and "skip: " in log
    assert log.index("wrote ") < log.index("skip: ")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".k.lock"]


def test_an_interrupted_fallback_swap_is_restored(tmp_path, finished, monkeypatch):
    """Without an atomic exchange the old folder is renamed aside first; a job cut between the
    two renames leaves no folder in place, and the next job restores the old one."""
    run_dir = tmp_path / "k"
    shutil.copytree(finished, run_dir)
    before = (run_dir / "results.json").read_bytes()
    stage = runfolder.new_stage(run_dir)
    (stage / "results.json").write_text("{}")
    monkeypatch.setattr(runfolder, "_exchange", lambda a, b: False)
    renames = []

    def cut_after_first(src, dst):
        if renames:
            raise KeyboardInterrupt  # the job dies between the two renames
        renames.append(src)
        os.replace(src, dst)

    monkeypatch.setattr(runfolder.os, "rename", cut_after_first)
    with pytest.raises(KeyboardInterrupt):
        runfolder.publish(stage, run_dir)
    monkeypatch.undo()
    assert not run_dir.exists() and list(tmp_path.glob(".replaced-k-*"))
    run_dir.mkdir()  # the next job's log folder, as Hydra makes it
    (run_dir / "uqbench.log").write_text("next job\n")
    removed = runfolder.recover(run_dir)
    assert (run_dir / "results.json").read_bytes() == before
    assert (run_dir / "predictions" / "test.npz").is_file()
    log = (run_dir / "uqbench.log").read_text()  # the old folder's log, then the next job's
    assert log.endswith("next job\n") and log.index("wrote ") < log.index("next job")
    assert not list(tmp_path.glob(".replaced-*")) and not list(tmp_path.glob(".staging-*"))
    assert any(p.name.startswith(".staging-k-") for p in removed)


@pytest.mark.slow
def test_a_second_job_into_the_same_folder_is_refused_and_a_dead_ones_lock_is_not(tmp_path):
    args = [sys.executable, "-m", "uqbench.runner.cli", *SMALL, "trainer.epochs=100000",
            f"paths.runs_dir={tmp_path}", "run_name=busy"]
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    lock = tmp_path / ".busy.lock"
    try:
        deadline = time.time() + 120
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert time.time() < deadline and first.poll() is None, "the first job never locked"
            time.sleep(0.2)
        second = _cli(*SMALL, f"paths.runs_dir={tmp_path}", "run_name=busy")
        assert second.returncode == 1
        assert f"another job (pid {first.pid}) is writing" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.kill()
        first.wait()
    assert not (tmp_path / "busy" / "results.json").exists()
    # Under load the killed job may have reached an epoch end and left its checkpoint, which
    # the next job rightly refuses as another configuration's; what is tested here is the lock
    leftover = tmp_path / "busy" / "resume"
    if leftover.exists():
        refused = _cli(*SMALL, f"paths.runs_dir={tmp_path}", "run_name=busy")
        assert refused.returncode == 1 and "another job" not in refused.stderr
        assert "trainer.epochs: 100000 (stored) → 2 (requested)" in refused.stderr
        shutil.rmtree(leftover)
    third = _cli(*SMALL, f"paths.runs_dir={tmp_path}", "run_name=busy")  # the lock died with it
    assert third.returncode == 0, third.stderr[-2000:]
    assert (tmp_path / "busy" / "results.json").is_file()


# --- the RunFolder transaction, on its own ---------------------------------------------------

def _folder_with(run_dir, results: str, config: dict) -> None:
    """A finished run folder as a job leaves it: config, results, predictions and its log."""
    (run_dir / "predictions").mkdir(parents=True)
    (run_dir / "predictions" / "test.npz").write_bytes(b"old")
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "results.json").write_text(results)
    (run_dir / "uqbench.log").write_text("first job\n")


def test_a_second_holder_of_a_run_folder_is_refused_until_the_first_lets_go(tmp_path):
    run_dir = tmp_path / "r"
    with runfolder.RunFolder(run_dir):
        with pytest.raises(runfolder.RunLockedError, match=f"pid {os.getpid()}"):
            runfolder.RunFolder(run_dir).__enter__()
        # an eval folder is guarded by the lock of the run it scores
        with pytest.raises(runfolder.RunLockedError, match=f"pid {os.getpid()}"):
            runfolder.RunFolder(run_dir / "eval" / "d", lock_on=run_dir).__enter__()
        # a process that trains beside the writer (rank > 0) takes no lock
        with runfolder.RunFolder(run_dir, writer=False):
            pass
        # a copy sent to a spawned process does not hold the lock: its launcher still does
        pickle.loads(pickle.dumps(runfolder.RunFolder(run_dir))).__exit__(None, None, None)
        with pytest.raises(runfolder.RunLockedError):
            runfolder.RunFolder(run_dir).__enter__()
    with runfolder.RunFolder(run_dir):  # released on exit
        pass


def _free(folder) -> bool:
    """Whether a job could take ``folder``'s lock now (it is taken and let go at once)."""
    try:
        with runfolder.RunLock(folder):
            return True
    except runfolder.RunLockedError:
        return False


def test_scorings_of_one_run_go_side_by_side_and_keep_the_run_from_being_written(tmp_path):
    """Two scorings of a run into different eval folders hold their locks at once; a second
    scoring into the same folder is refused, and so is a job writing the run itself while
    either holds it; a scoring is refused while such a job holds the run; and a scoring refused
    on its own folder leaves the run's shared lock as it found it."""
    run_dir = tmp_path / "r"
    full = runfolder.RunFolder(run_dir / "eval" / "full", lock_on=run_dir)
    mixture = runfolder.RunFolder(run_dir / "eval" / "mixture", lock_on=run_dir)
    with full, mixture:
        with pytest.raises(runfolder.RunLockedError, match="is writing or scoring"):
            runfolder.RunFolder(run_dir / "eval" / "full", lock_on=run_dir).__enter__()
        with pytest.raises(runfolder.RunLockedError, match=f"pid {os.getpid()}"):
            runfolder.RunFolder(run_dir).__enter__()
    assert _free(run_dir) and _free(run_dir / "eval" / "full")
    with mixture:
        with pytest.raises(runfolder.RunLockedError):  # refused on its own folder ...
            runfolder.RunFolder(run_dir / "eval" / "mixture", lock_on=run_dir).__enter__()
    assert _free(run_dir)  # ... its shared lock on the run went with the refusal
    with runfolder.RunFolder(run_dir):
        with pytest.raises(runfolder.RunLockedError, match="is writing "):
            runfolder.RunFolder(run_dir / "eval" / "full", lock_on=run_dir).__enter__()
        assert _free(run_dir / "eval" / "full")  # the folder's own lock was let go


def test_a_scoring_that_fails_to_lock_its_folder_lets_go_of_the_run(tmp_path, monkeypatch):
    """Any failure while taking the eval folder's lock (here the file system's) gives back the
    run's shared lock it took first."""
    run_dir = tmp_path / "r"
    real = runfolder.RunLock.__enter__

    def enter(lock):
        if not lock.shared:
            raise OSError("no space left on device")
        return real(lock)
    monkeypatch.setattr(runfolder.RunLock, "__enter__", enter)
    with pytest.raises(OSError, match="no space"):
        runfolder.RunFolder(run_dir / "eval" / "d", lock_on=run_dir).__enter__()
    monkeypatch.setattr(runfolder.RunLock, "__enter__", real)
    assert _free(run_dir)


def test_the_stage_is_removed_on_an_exception_and_nothing_is_published(tmp_path):
    run_dir = tmp_path / "r"
    with pytest.raises(KeyError):
        with runfolder.RunFolder(run_dir) as folder, folder.staging() as stage:
            (stage / "results.json").write_text("{}")
            assert stage.parent == tmp_path  # beside the folder: the swap is a rename
            raise KeyError("a failing job")
    assert not stage.exists() and not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.lock"]


def test_publish_swaps_the_staged_folder_in_and_keeps_the_folders_log(tmp_path):
    run_dir = tmp_path / "r"
    _folder_with(run_dir, '{"old": 1}', {"seed": 0})
    with runfolder.RunFolder(run_dir) as folder, folder.staging() as stage:
        (stage / "results.json").write_text('{"new": 1}')
        (stage / "config.yaml").write_text(yaml.safe_dump({"seed": 0}))
        staged_inode = os.stat(stage).st_ino
        folder.publish(stage)
        assert not stage.exists()  # swapped in, not copied
    assert os.stat(run_dir).st_ino == staged_inode
    assert (run_dir / "results.json").read_text() == '{"new": 1}'
    assert not (run_dir / "predictions").exists()  # the old attempt's files went with it
    assert (run_dir / "uqbench.log").read_text() == "first job\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.lock", "r"]


def test_entering_mends_leftovers_and_reuse_follows_the_configuration(tmp_path):
    run_dir = tmp_path / "r"
    _folder_with(run_dir, '{"metrics": {"test/nll": 0.5}}', {"seed": 0, "device": "cpu"})
    leftover = runfolder.new_stage(run_dir)  # a killed job's staging
    (leftover / "results.json").write_text("{}")
    with runfolder.RunFolder(run_dir) as folder:
        assert not leftover.exists()
        same = {"seed": 0, "device": "cuda"}  # bookkeeping keys aside: the same run
        assert folder.reuse(same, overwrite=False, skip_existing=True) == {
            "metrics": {"test/nll": 0.5}}
        assert folder.reuse(same, overwrite=True, skip_existing=False) is None
        with pytest.raises(runfolder.RunExistsError, match="overwrite=true"):
            folder.reuse(same, overwrite=False, skip_existing=False)
        with pytest.raises(runfolder.ConfigMismatchError, match=r"seed: 0 \(stored\) → 1"):
            folder.reuse({"seed": 1}, overwrite=True, skip_existing=True)
