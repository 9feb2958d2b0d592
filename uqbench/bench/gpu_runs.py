"""The checks of ``make gpu-check`` that run the ``uqbench`` command itself.

Every classification method trains and is scored under each precision, the engine's layouts
run (DDP and FSDP on one GPU), a run stopped by SIGTERM resumes, and ``job=eval`` scores it.
Each runs in a subprocess, as a user would, on fake data in a temporary folder
(:mod:`.gpu_sweep`).
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uqbench.bench.gpu_sweep import (
    Context,
    Job,
    Outcome,
    OutOfTime,
    choice,
    command,
    sweep,
    tail,
)

# a few steps of P1's recipe on small fake splits: 2 epochs of 2 steps at batch 16
SMALL = ["dataset.n_train=32", "dataset.n_val=16", "dataset.n_test=16", "dataset.n_ood=16"]
RECIPE = ["trainer=p1", "trainer.epochs=2", "trainer.warmup_epochs=1"]
# the backbones (with their data) of the method matrix: GPU, CPU
BACKBONES = {"cuda": {"vits16_random": ["dataset=fake_images"],
                      "bert_base": ["backbone.pretrained=false", "dataset=fake_text"]},
             "cpu": {"tiny_vit": ["dataset=fake_images"], "tiny_bert": ["dataset=fake_text"]}}
# the run that is stopped by SIGTERM and resumed: a tiny ViT without dropout, whose CPU run
# is bit-reproducible, long enough to be stopped after its first epoch's checkpoint; named
# (run_name), so that a sweep's job=train and job=eval name the same folder
RESUMED = ["run_name=resumed", "backbone=tiny_vit", "backbone.model_kwargs.proj_drop_rate=0",
           "dataset=fake_images", "method=sve", "trainer.epochs=60", "trainer.val_every=30",
           "trainer.checkpoint_every=null", *SMALL]


def finite(*values: Any) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


def losses(run: Path) -> list[float]:
    """The training loss of every epoch, from the run's log (``epoch k/n train/loss x``)."""
    log = run / "uqbench.log"
    text = log.read_text() if log.is_file() else ""
    return [float(v) for v in re.findall(r"epoch \d+/\d+ train/loss (\S+)", text)]


def results(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())


def judge_run(ctx: Context, label: str, epochs: int) -> Callable[[Job, dict[str, Any]], Outcome]:
    """A finished job passes when results.json holds finite val and test NLL and accuracy
    for the precision and device asked, and every epoch's training loss is finite."""

    def judge(job: Job, record: dict[str, Any]) -> Outcome:
        name, seconds = f"{label}/{'/'.join(job)}", record["time"] - record["start"]
        if record["status"] != "COMPLETED":
            return Outcome(name, "FAIL", str(record["error"])[:600], seconds=seconds)
        run = Path(record["folder"])
        if not (run / "results.json").is_file():
            return Outcome(name, "FAIL", f"no results.json in {run}", seconds=seconds)
        res, loss = results(run), losses(run)
        m, train = res["metrics"], res["train"]
        numbers = {"train_loss": loss, "test_nll": m.get("test/nll"),
                   "test_acc": m.get("test/acc"), "val_nll": m.get("val/nll"),
                   "precision": train["precision"], "device": train["device"],
                   "strategy": train["strategy"], "steps": train["steps_run"]}
        problems = [f"{k} is {numbers[k]}" for k in ("test_nll", "test_acc", "val_nll")
                    if not finite(numbers[k])]
        if len(loss) != epochs or not finite(*loss):
            problems.append(f"training losses {loss} (expected {epochs} finite values)")
        asked = choice(res["overrides"], "trainer.precision") or "32"
        if train["precision"] != asked:
            problems.append(f"results.json says precision {train['precision']}, not {asked}")
        if not str(train["device"]).startswith(ctx.device):
            problems.append(f"results.json says device {train['device']}")
        shown = (f"train/loss {' → '.join(f'{v:.4g}' for v in loss)}, test/nll "
                 f"{numbers['test_nll']:.4g}, test/acc {numbers['test_acc']:.3g}, "
                 f"{train['steps_run']} steps, {seconds:.1f} s" if not problems else
                 "; ".join(problems))
        return Outcome(name, "FAIL" if problems else "PASS", shown, numbers, seconds)

    return judge


def method_matrix(ctx: Context, methods: list[str], backbone: str, precisions: list[str]
                  ) -> list[Outcome]:
    """Check 1: every method on one backbone under the given precisions, as one sweep."""
    label = f"methods/{backbone}"
    runs = ctx.folder / "runs" / label / "+".join(precisions)
    fixed = [f"backbone={backbone}", *BACKBONES[ctx.device][backbone], *RECIPE, *SMALL,
             *ctx.common(), f"paths.runs_dir={runs}"]
    refused = {(p, m): why for p in precisions for m in methods
               if (why := _refusal(m, p)) is not None}
    jobs: list[Job] = [(p, m) for p in precisions for m in methods if (p, m) not in refused]
    skipped = [Outcome(f"{label}/{p}/{m}", "SKIP", f"the method refuses it up front: {why}")
               for (p, m), why in refused.items()]
    return skipped + sweep(ctx, label, ("trainer.precision", "method"), jobs, fixed,
                           judge_run(ctx, label, 2))


def _refusal(method: str, precision: str) -> str | None:
    """The message with which a method's class refuses a trainer precision before anything is
    built (its ``check_trainer``), or None where it takes it."""
    from hydra.utils import get_class

    from uqbench.configs import _packaged

    settings = _packaged("method", method)
    target = settings.get("_target_")
    checker = getattr(get_class(target), "check_trainer", None) if target else None
    try:
        if callable(checker):
            checker({"precision": precision}, settings)
    except ValueError as err:
        return str(err)
    return None


def judge_eval(ctx: Context, name: str, record: dict[str, Any]) -> Outcome:
    """A ``job=eval`` of a finished run scores its own data as the training job did: the same
    metrics, exactly on the CPU and to 1e-4 relative on a GPU."""
    seconds = record["time"] - record["start"]
    if record["status"] != "COMPLETED":
        return Outcome(name, "FAIL", str(record["error"])[:600], seconds=seconds)
    # Hydra's folder of a scoring job is the scoring's own: <run>/eval/<dataset>[,<overrides>]/
    run = Path(record["folder"]).parent.parent
    scorings = sorted(run.glob("eval/*/results.json"))
    if len(scorings) != 1 or not (run / "results.json").is_file():
        return Outcome(name, "FAIL", f"expected the run's results.json and one scoring in "
                                     f"{run}/eval/, found {len(scorings)}", seconds=seconds)
    worst = max_relative(json.loads(scorings[0].read_text())["metrics"],
                         results(run)["metrics"])
    ok = worst == 0.0 if not ctx.gpu else worst <= 1e-4
    return Outcome(name, "PASS" if ok else "FAIL", f"the run's checkpoint scored again: its "
                   f"metrics vs the training job's: max rel. diff {worst:.2g}",
                   {"max_rel_diff": worst}, seconds)


def layouts(ctx: Context) -> list[Outcome]:
    """Check 2 (GPU): DDP and FSDP with trainer.devices=1 (FSDP clips no gradient: the
    per-member clip needs whole parameters), each run and then scored by ``job=eval`` from its
    checkpoint (FSDP's is gathered from the shards)."""
    fixed = ["run_name=layout-${trainer.strategy}", "backbone=vits16_random",
             "dataset=fake_images", "method=sve", *RECIPE, *SMALL, "trainer.grad_clip=null",
             "trainer.devices=1", *ctx.common(),
             f"paths.runs_dir={ctx.folder / 'runs' / 'engine'}"]
    judged = judge_run(ctx, "engine", 2)
    expect = {"ddp": "Single", "fsdp": "FSDP"}  # DDP over one process is one plain process

    def judge(job: Job, record: dict[str, Any]) -> Outcome:
        strategy, kind = job
        if kind == "eval":
            return judge_eval(ctx, f"engine/{strategy}_devices1_eval", record)
        outcome = judged(job, record)
        outcome.name = f"engine/{strategy}_devices1"
        if outcome.status == "PASS":
            outcome.detail += f", strategy {outcome.numbers['strategy']}"
            if expect[strategy] not in str(outcome.numbers["strategy"]):
                outcome.status = "FAIL"
                outcome.detail += f" (expected a {expect[strategy]} strategy)"
        return outcome

    jobs: list[Job] = [(s, j) for s in ("ddp", "fsdp") for j in ("train", "eval")]
    return sweep(ctx, "engine", ("trainer.strategy", "job"), jobs, fixed, judge)


def max_relative(a: dict[str, float], b: dict[str, float]) -> float:
    """The largest relative difference over the metrics both hold (inf if a key is missing
    on one side or a value is not finite on one side only). Conformal sets' coverage and
    size (``…/cp…``) are left out: they are thresholds that last-bit differences can cross."""
    if set(a) != set(b):
        return math.inf
    worst = 0.0
    for key, x in a.items():
        if "/cp" in key:
            continue
        y = b[key]
        if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x)
                      and math.isnan(y)):
            continue
        worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
    return worst


def resume(ctx: Context) -> list[Outcome]:
    """Check 2: a run stopped by SIGTERM once its first checkpoint exists exits with 128 + 15
    and keeps resume/last.ckpt; the same configuration again continues from that checkpoint
    and ends with the metrics of an uninterrupted run (exactly on the CPU, to 1e-3 relative on
    a GPU); ``job=eval`` of the result reproduces its test metrics. The resumed job and its
    scoring, and the uninterrupted twin and its own, run as one sweep (one process start)."""
    name = "engine/resume_sigterm"
    stopped, whole = ctx.folder / "runs" / "resume", ctx.folder / "runs" / "whole"
    args = [*RESUMED, *ctx.common()]
    proc = subprocess.Popen(command("job=train", *args, f"paths.runs_dir={stopped}"),
                            env=ctx.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    ckpt = None
    while proc.poll() is None and ckpt is None and ctx.left() > 0:
        ckpt = next(iter(stopped.rglob("last.ckpt")), None)
        time.sleep(0.02)
    if ckpt is None:
        proc.kill()
        _, err = proc.communicate()
        return [Outcome(name, "FAIL", f"no checkpoint appeared (status {proc.returncode}): "
                                      f"{tail(err)}")]
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=max(ctx.left(), 1))
    except subprocess.TimeoutExpired as stuck:
        proc.kill()
        proc.communicate()
        raise OutOfTime("the stopped run was still running when the time budget ran out"
                        ) from stuck
    if proc.returncode != 128 + signal.SIGTERM or not ckpt.is_file():
        return [Outcome(name, "FAIL", f"after SIGTERM: status {proc.returncode} (expected "
                                      f"{128 + signal.SIGTERM}), checkpoint kept: "
                                      f"{ckpt.is_file()}; {tail(err)}")]
    import torch

    stopped_at = torch.load(ckpt, weights_only=False, map_location="cpu")["global_step"]
    records: dict[Job, dict[str, Any]] = {}

    def keep(job: Job, record: dict[str, Any]) -> Outcome:
        records[job] = record
        return Outcome("/".join(job), "PASS" if record["status"] == "COMPLETED" else "FAIL",
                       str(record["error"]))

    jobs: list[Job] = [(str(d), j) for d in (stopped, whole) for j in ("train", "eval")]
    ran = sweep(ctx, "engine/resume", ("paths.runs_dir", "job"), jobs, args, keep)
    failed = [o for o in ran if o.status == "FAIL"]
    if failed:
        return [Outcome(name, "FAIL", "; ".join(f"{o.name}: {o.detail}" for o in failed))]
    resumed, reference = (results(Path(records[(str(d), "train")]["folder"]))
                          for d in (stopped, whole))
    at = (resumed["train"]["resumed_at"] or {}).get("global_step")
    worst = max_relative(resumed["metrics"], reference["metrics"])
    numbers = {"stopped_at_step": stopped_at, "resumed_at_step": at,
               "steps_after_resume": resumed["train"]["steps_run"],
               "steps_uninterrupted": reference["train"]["steps_run"],
               "max_rel_diff_vs_uninterrupted": worst}
    ok = at == stopped_at and worst <= (1e-3 if ctx.gpu else 0.0)
    return [Outcome(name, "PASS" if ok else "FAIL",
                    f"stopped at step {stopped_at} (status 143), resumed at step {at}, "
                    f"{numbers['steps_after_resume']} of {numbers['steps_uninterrupted']} "
                    f"steps run again; metrics vs an uninterrupted run: max rel. diff "
                    f"{worst:.2g}", numbers),
            judge_eval(ctx, "engine/job_eval", records[(str(stopped), "eval")])]
