"""Launcher presets (conf/hydra/launcher/): what a SLURM sweep asks the cluster for, and that
sweeps run by joblib and by submitit land in their run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate


def uqbench(*args: str) -> None:
    """Run the installed ``uqbench`` command. Not ``python -m uqbench.runner.cli``: launchers
    pickle the
    task function, and one defined in ``__main__`` does not pickle."""
    command = Path(sys.executable).with_name("uqbench")
    proc = subprocess.run([str(command), *args], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"uqbench {' '.join(args)}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"


class Submitted(Exception):
    """Raised instead of calling sbatch: carries the script submitit would submit."""


def sbatch_script(compose_cfg, monkeypatch, tmp_path: Path, *overrides: str) -> str:
    """The sbatch script the composed launcher writes for a sweep of three seeds, built by
    submitit's own code; only the final sbatch call is replaced."""
    from submitit.slurm.slurm import SlurmExecutor

    def submit(self, command):
        raise Submitted(self._make_submission_file_text(command, "uid"))

    monkeypatch.setattr(SlurmExecutor, "_submit_command", submit)
    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # "srun exists"
    cfg = compose_cfg([*overrides, f"paths.runs_dir={tmp_path}"], return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    with pytest.raises(Submitted) as submitted:
        launcher.launch([["seed=0"], ["seed=1"], ["seed=2"]], initial_job_idx=0)
    return str(submitted.value)


def sbatch_flags(script: str) -> dict[str, str]:
    """``#SBATCH --key=value`` lines as {key: value}."""
    lines = [line.removeprefix("#SBATCH --") for line in script.splitlines()
             if line.startswith("#SBATCH --")]
    return dict(line.split("=", 1) if "=" in line else (line, "") for line in lines)


def test_slurm_gpu_follows_the_trainers_devices(compose_cfg):
    cfg = compose_cfg(["hydra/launcher=slurm_gpu", "trainer.devices=4", "trainer.num_nodes=2"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (4, 4, 2)
    # the warning must come early enough for submitit to requeue, and a timed-out job be requeued
    assert launcher.signal_delay_s >= 60 and launcher.max_num_timeout >= 1
    cfg = compose_cfg(["hydra/launcher=slurm_gpu", "hydra.launcher.gpus_per_node=2"],
                      return_hydra_config=True)
    assert (cfg.hydra.launcher.gpus_per_node, cfg.hydra.launcher.tasks_per_node) == (2, 2)


def test_slurm_gpu_sbatch_asks_for_gpus_and_a_warning_signal(compose_cfg, monkeypatch,
                                                              tmp_path):
    script = sbatch_script(compose_cfg, monkeypatch, tmp_path, "hydra/launcher=slurm_gpu",
                           "hydra.launcher.partition=gpu", "trainer.devices=4")
    flags = sbatch_flags(script)
    assert flags["gpus-per-node"] == "4" and flags["ntasks-per-node"] == "4"
    assert flags["nodes"] == "1" and flags["partition"] == "gpu"
    assert flags["job-name"] == "uqbench-default"
    assert flags["signal"] == "USR2@300"  # submitit requeues on USR2
    assert flags["time"] == "720" and flags["cpus-per-task"] == "8" and flags["mem"] == "64GB"
    assert flags["array"] == "0-2%3"  # three jobs, all at once (at most 32)
    assert "export OMP_NUM_THREADS=8" in script.splitlines()
    assert f"{tmp_path}/.sweeps/default-" in flags["output"]  # logs beside the sweep record


def test_slurm_cpu_sbatch_asks_for_one_cpu_and_no_gpu(compose_cfg, monkeypatch, tmp_path):
    script = sbatch_script(compose_cfg, monkeypatch, tmp_path, "hydra/launcher=slurm_cpu")
    flags = sbatch_flags(script)
    assert not any("gpu" in key or key == "gres" for key in flags), flags
    assert flags["ntasks-per-node"] == "1" and flags["cpus-per-task"] == "1"
    assert "partition" not in flags  # the cluster's default
    assert flags["signal"].startswith("USR2@")
    assert "export OMP_NUM_THREADS=1" in script.splitlines()


def seed_results(runs: Path) -> dict[int, dict]:
    """results.json of the two tiny jobs below, by seed, from their deterministic folders."""
    folder = runs / "default/polynomial/bnn_embedded/mlp_w16/trainer.epochs=2"
    return {seed: json.loads((folder / f"seed{seed}/results.json").read_text())
            for seed in (0, 1)}


TINY_SWEEP = ("-m", "dataset=polynomial", "method=bnn", "trainer.epochs=2", "seed=0,1",
              "trainer.progress=false", "plot=false")


@pytest.mark.slow
def test_local_preset_runs_each_job_on_one_thread(tmp_path, monkeypatch):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # a shell's setting would be kept
        monkeypatch.delenv(var, raising=False)
    uqbench(*TINY_SWEEP, "hydra/launcher=local", f"paths.runs_dir={tmp_path}")
    results = seed_results(tmp_path)
    assert [r["seed"] for r in results.values()] == [0, 1]
    assert [r["environment"]["torch_threads"] for r in results.values()] == [1, 1]


@pytest.mark.slow
def test_submitit_jobs_land_in_their_run_folders(tmp_path):
    """submitit runs each job in a fresh process from its pickle; the sweep's subdir
    (../../<run folder>) must still put the runs beside, not inside, the sweep record."""
    uqbench(*TINY_SWEEP, "hydra/launcher=submitit_local", f"paths.runs_dir={tmp_path}")
    results = seed_results(tmp_path)
    assert [r["run"] for r in results.values()] == [
        f"default/polynomial/bnn_embedded/mlp_w16/trainer.epochs=2/seed{s}" for s in (0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".sweeps", "default"]
    sweep, = (tmp_path / ".sweeps").iterdir()
    assert (sweep / "multirun.yaml").is_file()
    logs = sorted(p.name for p in sweep.glob(".submitit/*/*_log.out"))
    assert len(logs) == 2, logs
