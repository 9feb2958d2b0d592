"""The training engine: checkpoints and bit-exact resume after a real SIGKILL, SIGTERM stops with
a checkpoint, DDP over two CPU processes and gradient accumulation against one process,
bf16-mixed on the CPU, job=eval from a checkpoint, and the errors of each."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from tests.helpers import ROOT, run_cli
from uqbench.contracts import Shard
from uqbench.data.base import MicroBatchSampler

pytestmark = pytest.mark.usefixtures("one_thread")

# A regression run long enough to be interrupted: 3 steps an epoch, a checkpoint every 4 steps
# (so some checkpoints fall inside an epoch), evaluated on every split.
BNN = ["trainer.epochs=8", "dataset.n_train=300", "trainer.checkpoint_every=4",
       "trainer.progress=false", "plot=false", "device=cpu", "torch_threads=1"]
# A classification run over a DataLoader (tokenised text, collated per batch), with dropout.
TEXT = ["backbone=tiny_bert", "dataset=fake_text", "method=sve", "trainer=p1",
        "trainer.epochs=3", "trainer.warmup_epochs=1", "trainer.checkpoint_every=2",
        "trainer.progress=false", "plot=false", "device=cpu", "torch_threads=1"]
# A tiny ViT without dropout: one process, two, or accumulation compute the same steps.
VIT = ["backbone=tiny_vit", "backbone.model_kwargs.proj_drop_rate=0", "dataset=fake_images",
       "method=sve", "trainer=p1", "trainer.epochs=2", "trainer.warmup_epochs=1",
       "trainer.progress=false", "plot=false", "device=cpu", "torch_threads=1"]


def results(runs: Path) -> dict:
    [path] = [p for p in runs.rglob("results.json") if "eval" not in p.parts]
    return json.loads(path.read_text())


def one(runs: Path, pattern: str) -> Path:
    [path] = list(runs.rglob(pattern))
    return path


# --- micro-batches -------------------------------------------------------------------------------

def test_micro_batches_cut_each_step_over_processes_and_accumulation():
    n = 11
    pieces = [Shard(r, 2, 2).slices(n) for r in range(2)]
    assert pieces == [[(0, 2), (2, 5)], [(5, 8), (8, 11)]]  # 11 // 4 cuts, in order, no overlap
    assert Shard(0, 1, 3).slices(2) == [(0, 1), (1, 2)]     # an empty micro-batch is skipped
    assert Shard(0, 2, 1).steps(23, 5) == [5, 5, 5, 5, 3]
    assert Shard(0, 2, 2).steps(23, 5) == [5, 5, 5, 5]      # 3 < 2 × 2: dropped for every rank
    assert Shard().steps(23, 5) == [5, 5, 5, 5, 3]          # one process keeps every example


def test_the_default_sampler_is_exactly_a_shuffled_dataloader():
    data = TensorDataset(torch.arange(23))
    torch.manual_seed(3)
    expected = [b[0].tolist() for b in DataLoader(data, batch_size=5, shuffle=True)]
    after = torch.rand(2)
    torch.manual_seed(3)
    got = [b[0].tolist() for b in DataLoader(
        data, batch_sampler=MicroBatchSampler(RandomSampler(data), 5, Shard()))]
    assert got == expected
    assert torch.equal(torch.rand(2), after)  # the same random numbers were drawn
    ranks = []
    for r in range(2):  # each process starts from the run's seed
        torch.manual_seed(3)
        ranks.append([b[0].tolist() for b in DataLoader(
            data, batch_sampler=MicroBatchSampler(RandomSampler(data), 5, Shard(r, 2, 1)))])
    for step, batch in enumerate(expected[:4]):  # each step's batch is split, rank 0 first
        assert ranks[0][step] + ranks[1][step] == batch


def test_skipping_steps_reads_nothing_and_calls_back_once():
    seen, calls = [], []

    class Spy(TensorDataset):
        def __getitem__(self, i):
            seen.append(i)
            return super().__getitem__(i)

    data = Spy(torch.arange(20))
    sampler = MicroBatchSampler(RandomSampler(data), 5, Shard(), skip=3,
                                on_skip=lambda: calls.append(len(seen)))
    batches = list(DataLoader(data, batch_sampler=sampler))
    assert len(batches) == 1 and len(seen) == 5 and calls == [0]


# --- checkpoints and resume ---------------------------------------------------------------------

@pytest.fixture
def uninterrupted(cfg, tmp_path):
    """``uninterrupted(overrides)``: the results of a run made in this process, start to end."""
    from uqbench.runner.cli import run

    def go(overrides: list[str], name: str = "whole") -> dict:
        return run(cfg(*overrides, f"paths.runs_dir={tmp_path / name}"))

    return go


@pytest.mark.slow
@pytest.mark.parametrize("overrides,kill_at", [(BNN, 8), (TEXT, 2)], ids=["tensors", "loader"])
def test_a_sigkilled_run_resumes_from_its_checkpoint_with_the_same_metrics(
        tmp_path, uninterrupted, overrides, kill_at):
    """UQBENCH_KILL_AT=checkpoint:<step> SIGKILLs the job right after that checkpoint (inside an
    epoch); the same command then continues from it and ends exactly as an uninterrupted run."""
    whole = uninterrupted(overrides)
    runs = tmp_path / "runs"
    env = {**os.environ, "UQBENCH_KILL_AT": f"checkpoint:{kill_at}"}
    proc = subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *overrides,
                           f"paths.runs_dir={runs}"], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert not list(runs.rglob("results.json"))
    state = torch.load(one(runs, "last.ckpt"), weights_only=False)
    assert state["global_step"] == kill_at and not state["epoch_done"]
    run_cli(*overrides, f"paths.runs_dir={runs}")
    resumed = results(runs)
    assert resumed["train"]["resumed_at"]["global_step"] == kill_at
    assert resumed["train"]["steps_run"] < whole["train"]["steps_run"]  # less work
    assert resumed["metrics"] == whole["metrics"]                       # bit-exact
    assert not list(runs.rglob("last.ckpt"))       # the finished run dropped its resume state
    assert one(runs, "checkpoint.ckpt").is_file()  # and keeps its trained parameters


def terminated_after_first_checkpoint(overrides: list[str], runs: Path) -> tuple[int, str]:
    """Start a run, SIGTERM it once its first checkpoint exists, check it stopped as a
    preempted job does; returns that checkpoint's optimiser step and the job's stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "uqbench.runner.cli", *overrides,
                             f"paths.runs_dir={runs}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(runs.rglob("last.ckpt")) and time.time() < deadline:
        time.sleep(0.1)
    first = torch.load(one(runs, "last.ckpt"), weights_only=False)["global_step"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    return first, err


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_the_same_command_finishes_the_run(tmp_path,
                                                                           uninterrupted):
    overrides = [o for o in BNN if not o.startswith("trainer.epochs")] + [
        "trainer.epochs=150", "trainer.checkpoint_every=null"]
    runs = tmp_path / "runs"
    first, err = terminated_after_first_checkpoint(overrides, runs)
    assert "stopped" in err and "the same command continues the run" in err
    state = torch.load(one(runs, "last.ckpt"), weights_only=False)
    assert state["global_step"] >= first
    assert not list(runs.rglob("results.json"))
    run_cli(*overrides, f"paths.runs_dir={runs}")
    resumed = results(runs)
    assert resumed["train"]["resumed_at"]["global_step"] == state["global_step"]
    assert resumed["metrics"] == uninterrupted(overrides)["metrics"]


@pytest.mark.slow
def test_sigterm_reaches_spawned_ddp_processes_and_the_run_resumes_exactly(tmp_path):
    """The parent passes SIGTERM on to its two processes, which stop at the same step; rank 0's
    checkpoint comes back, and the same command finishes as an uninterrupted DDP run."""
    overrides = [o for o in VIT if not o.startswith("trainer.epochs")] + [
        "trainer.epochs=12", "trainer.checkpoint_every=null", "trainer.devices=2"]
    runs = tmp_path / "runs"
    terminated_after_first_checkpoint(overrides, runs)
    state = torch.load(one(runs, "last.ckpt"), weights_only=False)
    run_cli(*overrides, f"paths.runs_dir={runs}")
    resumed = results(runs)
    assert resumed["train"]["resumed_at"]["global_step"] == state["global_step"] > 0
    whole = tmp_path / "whole"
    run_cli(*overrides, f"paths.runs_dir={whole}")
    assert resumed["metrics"] == results(whole)["metrics"]


def killed_at_step_4(runs: Path) -> Path:
    """Run folder runs/r of a BNN run SIGKILLed right after its checkpoint at step 4."""
    env = {**os.environ, "UQBENCH_KILL_AT": "checkpoint:4"}
    subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *BNN, "run_name=r",
                    f"paths.runs_dir={runs}"], env=env, capture_output=True, cwd=ROOT,
                   timeout=600)
    return one(runs, "last.ckpt")


def test_resuming_refuses_another_configuration_and_keeps_the_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    ckpt = killed_at_step_4(runs)
    before = ckpt.read_bytes()
    proc = run_cli(*BNN, "run_name=r", "trainer.optimizer.lr=0.5", f"paths.runs_dir={runs}",
                   check=False)
    assert proc.returncode == 1
    assert "unfinished run of another configuration" in proc.stderr
    assert "trainer.optimizer.lr: 0.01 (stored) → 0.5 (requested)" in proc.stderr
    assert ckpt.read_bytes() == before


def test_a_truncated_checkpoint_is_refused_named_and_kept(tmp_path):
    runs = tmp_path / "runs"
    ckpt = killed_at_step_4(runs)
    ckpt.write_bytes(ckpt.read_bytes()[:200])
    proc = run_cli(*BNN, "run_name=r", f"paths.runs_dir={runs}", check=False)
    assert proc.returncode == 1
    assert f"the checkpoint {ckpt} cannot be read" in proc.stderr and "kept" in proc.stderr
    assert ckpt.stat().st_size == 200 and not list(runs.rglob("results.json"))


# --- processes, accumulation, precision ----------------------------------------------------------

@pytest.mark.slow
def test_ddp_over_two_cpu_processes_and_accumulation_match_one_process(tmp_path,
                                                                       uninterrupted):
    """The same global batch of 16: one process; one process in 2 micro-batches; 2 processes
    (gloo) of 8 each. Only float summation order differs (stated tolerance: 1e-4 relative)."""
    single = uninterrupted(VIT)
    assert single["train"]["steps_run"] == 8 and single["train"]["updated_weights"]
    accumulated = uninterrupted([*VIT, "trainer.accumulate=2"], "acc")
    runs = tmp_path / "ddp"
    run_cli(*VIT, "trainer.devices=2", "trainer.strategy=ddp", f"paths.runs_dir={runs}")
    ddp = results(runs)
    assert ddp["train"]["world_size"] == 2 and ddp["train"]["strategy"] == "DDPStrategy"
    assert accumulated["train"]["accumulate"] == 2
    for other in (accumulated, ddp):
        assert other["metrics"].keys() == single["metrics"].keys()
        for key, value in single["metrics"].items():
            if "/cp" not in key:  # conformal sets: thresholds that summation order can cross
                assert other["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_bf16_mixed_runs_on_the_cpu_under_autocast(cfg, tmp_path):
    from hydra.utils import instantiate

    from uqbench.tasks.classification import ClassificationTask

    c = cfg(*VIT, "trainer.precision=bf16-mixed", f"paths.runs_dir={tmp_path}")
    trainer = instantiate(c.trainer)
    data = instantiate(c.dataset)
    backbone = instantiate(c.backbone)
    data.setup(backbone)
    method = instantiate(c.method)(backbone=backbone, info=data.info)
    dtypes = set()
    layer = next(m for n, m in method.named_modules() if n.endswith("attn.qkv"))
    layer.register_forward_hook(lambda m, i, o: dtypes.add(
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        if m.training else None)
    start = [p.detach().clone() for p in method.parameters() if p.requires_grad]
    trainer.fit(method, data, ClassificationTask())
    assert dtypes == {torch.bfloat16}
    after = [p for p in method.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in after)  # mixed: the weights stay fp32
    assert any(not torch.equal(a, b) for a, b in zip(start, after, strict=True))


# --- job=eval -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_job_eval_reproduces_the_test_metrics_and_never_touches_the_run(tmp_path,
                                                                        uninterrupted):
    runs = tmp_path / "runs"
    trained = uninterrupted(VIT, "runs")
    run_dir = one(runs, "results.json").parent
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and
             p.name != "uqbench.log"}
    run_cli("job=eval", f"eval_run='{run_dir}'", f"paths.runs_dir={runs}")
    scored = json.loads((run_dir / "eval" / "fake_images" / "results.json").read_text())
    assert scored["job"] == "eval" and scored["of_run"] == str(run_dir)
    assert scored["metrics"] == trained["metrics"]
    # another dataset's splits (here: the same generator at another seed and signal)
    run_cli("job=eval", f"eval_run='{run_dir}'", "dataset=fake_images", "dataset.seed=5",
            "dataset.signal=0.5", f"paths.runs_dir={runs}")
    other = json.loads((run_dir / "eval" / "fake_images,dataset.seed=5,dataset.signal=0.5"
                        / "results.json").read_text())
    assert other["metrics"]["test/nll"] != trained["metrics"]["test/nll"]
    assert {p: p.read_bytes() for p in files} == files  # the training files are untouched


@pytest.mark.slow
def test_job_eval_without_a_checkpoint_says_why(tmp_path):
    runs = tmp_path / "runs"
    run_cli(*VIT, "trainer.epochs=1", "trainer.keep_checkpoint=none", f"paths.runs_dir={runs}")
    run_dir = one(runs, "results.json").parent
    proc = run_cli("job=eval", f"eval_run='{run_dir}'", f"paths.runs_dir={runs}", check=False)
    assert proc.returncode == 1
    assert "has no checkpoint.ckpt" in proc.stderr and "keep_checkpoint=none" in proc.stderr
    assert not (run_dir / "eval").exists()


def test_the_final_checkpoint_holds_only_what_was_trained(tmp_path):
    runs = tmp_path / "runs"
    run_cli(*VIT, "trainer.epochs=1", f"paths.runs_dir={runs}")
    state = torch.load(one(runs, "checkpoint.ckpt"), weights_only=False)
    counts = results(runs)["params"]
    trained = sum(t.numel() for t in state["trainable"].values())
    assert trained == counts["trainable"] < counts["total"]
    assert "optimizer" not in state and "resume" not in state


# --- devices --------------------------------------------------------------------------------------

def test_layouts_the_machine_cannot_run_fail_before_any_work(cfg, monkeypatch):
    from hydra.utils import instantiate

    from uqbench.runner.engine import fabric as engine

    def trainer(*overrides):
        return instantiate(cfg(*overrides).trainer)

    with pytest.raises(engine.EngineError, match="16-mixed needs a GPU"):
        engine.check(torch.device("cpu"), trainer("trainer.precision=16-mixed"))
    with pytest.raises(engine.EngineError, match="fsdp needs CUDA"):
        engine.check(torch.device("cpu"), trainer("trainer.strategy=fsdp"))
    many = (os.cpu_count() or 1) + 1
    with pytest.raises(engine.EngineError, match=f"trainer.devices={many} CPU processes"):
        engine.check(torch.device("cpu"), trainer(f"trainer.devices={many}"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(engine, "external_processes", lambda: False)
    with pytest.raises(engine.EngineError, match="trainer.devices=4 but this machine has 2"):
        engine.check(torch.device("cuda"), trainer("trainer.devices=4"))
    with pytest.raises(engine.EngineError, match="names one GPU but trainer.devices=2"):
        engine.check(torch.device("cuda:1"), trainer("trainer.devices=2"))


def test_cli_refuses_a_bad_precision_and_names_the_choices(tmp_path):
    proc = run_cli(*VIT, "trainer.precision=fp8", f"paths.runs_dir={tmp_path}", check=False)
    assert proc.returncode == 1
    assert "trainer.precision 'fp8' is not one of" in proc.stderr and "bf16-mixed" in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))


def test_auto_falling_back_to_the_cpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: device=auto does not fall back")
    runs = tmp_path / "runs"
    proc = run_cli(*[o for o in BNN if o != "device=cpu"], "trainer.epochs=1", "device=auto",
                   f"paths.runs_dir={runs}")
    note = results(runs)["train"]["device_note"]
    assert "found no GPU" in note and note in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """Killed and resumed, then trained again from the start: every attempt logs to the one
    W&B run id derived from the run folder, so a sync updates one run."""
    overrides = [*BNN, "logger=wandb", "logger.mode=offline", "run_name=wb",
                 f"paths.runs_dir={tmp_path}"]
    env = {**os.environ, "UQBENCH_KILL_AT": "checkpoint:8"}
    subprocess.run([sys.executable, "-m", "uqbench.runner.cli", *overrides], env=env, cwd=ROOT,
                   capture_output=True, timeout=600)
    run_cli(*overrides)
    wandb_dir = tmp_path / "default" / "wandb"  # the experiment's W&B folder
    ids = {p.name.rsplit("-", 1)[1] for p in wandb_dir.glob("offline-run-*")}
    assert len(list(wandb_dir.glob("offline-run-*"))) == 2
    assert ids == {hashlib.sha1(b"wb").hexdigest()[:16]}  # the run folder's (run_name=wb)
    run_cli(*overrides, "overwrite=true")  # trained again from the start: the same W&B run
    assert len(list(wandb_dir.glob("offline-run-*"))) == 3
    assert {p.name.rsplit("-", 1)[1] for p in wandb_dir.glob("offline-run-*")} == ids


def test_an_elbo_summed_over_examples_accumulates_to_the_whole_batch(uninterrupted):
    """The BNN's loss sums its NLL over the batch and adds β·KL once: in 3 micro-batches of
    34, 33 and 33 examples each adds a third of β·KL (its share), not the whole of it."""
    single = uninterrupted(BNN)
    accumulated = uninterrupted([*BNN, "trainer.accumulate=3"], "acc")
    assert accumulated["train"]["accumulate"] == 3
    for key, value in single["metrics"].items():
        if "/cp" not in key:  # conformal sets: thresholds that summation order can cross
            assert accumulated["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
