"""The SLURM path on one machine: a sweep through hydra-submitit-launcher with submitit's local
executor (``hydra/launcher=submitit_local``), which is the code ``slurm_gpu`` runs up to
``sbatch`` (the launcher, the pickled job, the sweep's ``subdir``, submitit's USR2 handler and
its requeue), and the sbatch script ``slurm_gpu`` writes for 2 nodes of 4 GPUs, against its
config and docs/usage.md.

Submitit's local executor requeues for real: on USR2 its job environment checkpoints the
pickled job and exits with status 144, and the local controller then starts the same command
again (``submitit.local.local.Controller.run``), as SLURM's requeue does on a cluster. Nothing
is emulated here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from tests.helpers import ROOT
from tests.test_launchers import sbatch_flags, sbatch_script

pytestmark = pytest.mark.slow

# Two jobs (seeds 0 and 1) of a tiny ViT long enough to be signalled after its first epoch's
# checkpoint; one torch thread each, so that a CPU run is bit-reproducible.
SWEEP = ["backbone=tiny_vit", "dataset=fake_images", "method=single", "trainer.epochs=60",
         "trainer.val_every=30", "trainer.checkpoint_every=null", "dataset.n_train=32",
         "dataset.n_val=16", "dataset.n_test=16", "dataset.n_ood=16", "trainer.progress=lines",
         "plot=false", "save_predictions=false", "torch_threads=1"]


def run_folder(compose_cfg, runs: Path, seed: int) -> Path:
    """Where the sweep's ``subdir`` puts job ``seed=<seed>``: the sweep folder joined with the
    resolved ``hydra.sweep.subdir``, for a job whose task overrides are the sweep's own."""
    overrides = [*SWEEP, f"seed={seed}", f"paths.runs_dir={runs}"]
    cfg = compose_cfg(overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # the job's Hydra node: its overrides name the run
    try:
        sweep_dir = Path(str(cfg.hydra.sweep.dir))
        subdir = str(cfg.hydra.sweep.subdir)
        run_dir = Path(str(cfg.run_dir))
    finally:
        HydraConfig.instance().cfg = None  # type: ignore[assignment]
    assert subdir.startswith("../../")  # it climbs out of runs/.sweeps/<sweep>/
    landed = Path(os.path.normpath(sweep_dir / subdir))
    assert landed == run_dir  # the sweep's job lands where a single run of it would
    return landed


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def submitit_task(sweeps: Path, holder: int) -> int:
    """The pid of the submitit task running the job whose run folder lock ``holder`` holds: a
    job's folder in ``.submitit/`` is named by its id, which for the local executor is the pid
    of the controller that starts (and restarts) the task; the task is the process below it
    that runs ``submitit.core._submit``."""
    tasks = {}
    for folder in sweeps.glob("*/.submitit/[0-9]*"):
        for pid in descendants(int(folder.name)):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"submitit.core._submit" in cmdline:
                tasks[pid] = folder
    assert holder in tasks, (holder, tasks)  # the lock's holder is one of submitit's tasks
    return holder


def test_a_submitit_sweep_lands_in_its_run_folders_and_a_usr2_job_is_requeued_and_resumes(
        tmp_path, compose_cfg):
    runs = tmp_path / "runs"
    folders = {seed: run_folder(compose_cfg, runs, seed) for seed in (0, 1)}
    assert folders[0].relative_to(runs).parts[:4] == ("default", "fake_images", "single",
                                                      "tiny_vit")
    command = Path(sys.executable).with_name("uqbench")  # a launcher pickles the task function
    sweep = subprocess.Popen(
        [str(command), "-m", *SWEEP, "seed=0,1", "hydra/launcher=submitit_local",
         f"paths.runs_dir={runs}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ckpt = folders[0] / "resume" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.is_file() and sweep.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert ckpt.is_file(), sweep.communicate()[1][-3000:]
    holder = int((folders[0].parent / f".{folders[0].name}.lock").read_text().strip("\0 \n"))
    os.kill(submitit_task(runs / ".sweeps", holder), signal.SIGUSR2)
    out, err = sweep.communicate(timeout=600)
    assert sweep.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"

    # the jobs landed where the sweep's subdir says, the sweep's record beside them
    assert sorted(p.name for p in runs.iterdir()) == [".sweeps", "default"]
    [record] = (runs / ".sweeps").iterdir()
    assert (record / "multirun.yaml").is_file()
    results = {s: json.loads((folders[s] / "results.json").read_text()) for s in (0, 1)}
    assert [results[s]["run"] for s in (0, 1)] == [
        str(folders[s].relative_to(runs)) for s in (0, 1)]

    # job 0: USR2 → a checkpoint after the current step → submitit requeued it → it resumed
    log = (folders[0] / "uqbench.log").read_text()
    assert "received SIGUSR2: stopping at the next step with a checkpoint" in log
    assert "the checkpoint is written: the same command continues the run" in log
    resumed_at = results[0]["train"]["resumed_at"]
    assert resumed_at is not None and resumed_at["global_step"] > 0
    assert results[1]["train"]["resumed_at"] is None  # the other job ran through
    job_logs = {job.name: "".join(p.read_text() for p in sorted(job.glob("*_0_log.*")))
                for job in record.glob(".submitit/[0-9]*")}  # submitit's log: .out and .err
    assert len(job_logs) == 2
    [requeued] = [text for text in job_logs.values() if "Requeued job" in text]
    assert "Caught signal SIGUSR2" in requeued and "this job is preempted" in requeued
    assert requeued.count("Starting with JobEnvironment") == 2  # the same task, started again
    assert not (folders[0] / "resume").exists()  # finished: the resume state is dropped

    # and it ends with the metrics of an uninterrupted run of the same seed
    from uqbench.runner.cli import run

    whole = run(compose_cfg([*SWEEP, "seed=0", f"paths.runs_dir={tmp_path / 'whole'}"]))
    assert results[0]["metrics"]["test/nll"] == whole["metrics"]["test/nll"]
    assert results[0]["metrics"] == whole["metrics"]
    assert results[0]["train"]["steps_run"] == (whole["train"]["steps_run"]
                                                - resumed_at["global_step"])


# --- the sbatch script of slurm_gpu for 2 nodes × 4 GPUs ----------------------------------------

def test_slurm_gpu_sbatch_for_two_nodes_of_four_gpus_matches_its_config_and_the_docs(
        compose_cfg, monkeypatch, tmp_path):
    """The script submitit would hand to sbatch (built by the plugin and submitit's own code,
    only the sbatch call replaced) holds what conf/hydra/launcher/slurm_gpu.yaml asks for and
    what docs/usage.md says slurm_gpu asks for."""
    preset = yaml.safe_load((ROOT / "conf/hydra/launcher/slurm_gpu.yaml").read_text())
    script = sbatch_script(compose_cfg, monkeypatch, tmp_path, "hydra/launcher=slurm_gpu",
                           "trainer.devices=4", "trainer.num_nodes=2")
    flags = sbatch_flags(script)

    # the preset: GPUs, nodes and tasks follow the trainer, one process per GPU
    assert preset["nodes"] == "${trainer.num_nodes}"
    assert preset["gpus_per_node"] == "${trainer.devices}"
    assert preset["tasks_per_node"] == "${.gpus_per_node}"
    assert flags["nodes"] == "2"
    assert flags["gpus-per-node"] == "4" and flags["ntasks-per-node"] == "4"
    assert flags["cpus-per-task"] == str(preset["cpus_per_task"])
    assert flags["mem"] == f"{preset['mem_gb']}GB"
    assert flags["time"] == str(preset["timeout_min"])
    assert flags["signal"] == f"USR2@{preset['signal_delay_s']}"
    assert f"export OMP_NUM_THREADS={preset['cpus_per_task']}" in script.splitlines()
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1 and "submitit.core._submit" in srun[0]  # one task per GPU, by srun

    # docs/usage.md: the launcher table's slurm_gpu row and the preemption paragraph
    usage = (ROOT / "docs/usage.md").read_text()
    [row] = [line for line in usage.splitlines() if line.startswith("| `slurm_gpu` |")]
    assert "`trainer.devices` GPUs (one process per GPU)" in row
    assert "each of `trainer.num_nodes` nodes" in row
    cpus, mem, hours = (int(re.search(pattern, row).group(1)) for pattern in
                        (r"(\d+) CPUs per process", r"(\d+) GB per node", r"(\d+) h\b"))
    assert (cpus, mem, hours * 60) == (preset["cpus_per_task"], preset["mem_gb"],
                                       preset["timeout_min"])
    delay = re.search(r"\((\d+) for\s+`slurm_gpu`\)", usage)
    assert delay is not None and int(delay.group(1)) == preset["signal_delay_s"]
    requeues = re.search(r"`max_num_timeout` \((\d+)\)", usage)
    assert requeues is not None and int(requeues.group(1)) == preset["max_num_timeout"]
    cfg = compose_cfg(["hydra/launcher=slurm_gpu"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["max_num_timeout"] == preset["max_num_timeout"]  # the preset is what runs
