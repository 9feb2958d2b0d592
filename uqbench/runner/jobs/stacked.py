"""Several seeds of one configuration trained side by side in one job (``stack_seeds``).

A run of P2's width sweep trains a network of a few hundred parameters for 6,000 steps of a
hundred rows: a step's arithmetic is tiny and its time goes to per-step overhead (the loop's
Python, autograd, the optimiser). ``stack_seeds: [0, 1, 2]`` trains the three seeds in one job:

- each member is built as its own job builds it (seeded with its seed), and reads its own data
  order: each epoch's permutation is drawn from the member's own random stream, which starts
  where its own job's would;
- one step computes every member's loss on its own batch (the method's ``stacked_losses``; the
  BNN's compiled members in one compiled graph), sums them and differentiates once: each
  member's parameters get their own loss's gradient and no other's;
- one optimiser over every member's parameters: Adam (and SGD) update each parameter from its
  own gradient and state only, so this is each member's own update; one learning-rate
  schedule, the same for all. Where the method computes the losses from its members'
  parameters stacked side by side (``trains_stacked``: the BNN), the optimiser holds one
  (R, …) tensor per parameter, member r's at [r], copied into the members after each epoch.

Then each member is scored and its run folder written as its own job writes it: the same path,
config.yaml (``seed: <k>``, ``stack_seeds: null``) and results, to float rounding (a compiled
graph may order a sum differently). results.json says ``train.stacked_with: [seeds]``, and its
``time.train_s`` is the side-by-side fit's time over the number of members.

What a stacked job does not do: write a resume checkpoint while it trains (a killed job trains
its members again; no member's folder is touched before it is published), or hand the epochs'
metrics to the members' loggers as they happen (each member's are logged after the fit). It
needs a method whose training step draws no random numbers, one process, one micro-batch per
step, ``select: last``, no gradient clipping and no decay toward the start: anything else is
refused before anything is built. A member whose folder holds its results is reused
(``skip_existing``); one with an unfinished checkpoint continues on its own, as its own job.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from uqbench.contracts import to_device
from uqbench.records.runfolder import RunFolder
from uqbench.runner.engine import fabric as engine
from uqbench.runner.engine.checkpoints import rng_state, set_rng_state
from uqbench.runner.engine.loop import NonFiniteLossError, epoch_line, progress_mode, schedule
from uqbench.runner.jobs.train import (
    Built,
    _build,
    _labels,
    _launch,
    _start_process,
    check_batch,
    conclude,
    resume_point,
    reuse,
    trained_spec,
)
from uqbench.runner.spec import RunSpec

log = logging.getLogger("uqbench")


def check_stackable(spec: RunSpec, trainer: Any) -> None:
    """Refuse, before anything is built, a job whose members could not train side by side
    exactly as in their own jobs (the module's docstring)."""
    if spec.job != "train":
        raise ValueError(f"stack_seeds trains seeds side by side; job={spec.job} trains "
                         f"nothing: drop stack_seeds")
    refuse = spec.method.hook("stack_refusal")
    refusal: str | None = (refuse(dict(spec.method.settings)) if refuse is not None else
                           f"method '{spec.method.get('name')}' has no method class")
    layout = {"trainer.devices × num_nodes": (trainer.world_size, trainer.world_size == 1, 1),
              "trainer.accumulate": (trainer.accumulate, trainer.accumulate == 1, 1),
              "trainer.select": (trainer.select, trainer.select == "last", "last"),
              "trainer.grad_clip": (trainer.grad_clip, trainer.grad_clip is None, "null"),
              "trainer.decay_to": (trainer.decay_to, trainer.decay_to != "init", "null")}
    for key, (value, ok, needed) in layout.items():
        if refusal is None and not ok:
            refusal = f"{key}={value} (a stacked job needs {needed})"
    if refusal is None and trainer.epochs < 1:
        refusal = f"trainer.epochs={trainer.epochs}: nothing to train"
    if refusal is not None:
        raise ValueError(f"stack_seeds: these runs cannot train side by side: {refusal}. Drop "
                         f"stack_seeds (sweep seed=... instead) to train each in its own job")


def member_spec(spec: RunSpec, seed: int) -> RunSpec:
    """The spec of member ``seed``: its own job's (``seed: <k>``, ``stack_seeds: null``); the
    run folder follows from it."""
    return spec.derive({"seed": seed, "stack_seeds": None})


def stacked_job(spec: RunSpec) -> list[dict[str, Any]]:
    """Train and score the seeds of ``stack_seeds`` side by side (the module's docstring);
    return each member's results, in the order of ``stack_seeds``."""
    seeds = spec.stack_seeds
    assert seeds is not None  # the runner calls this for a stacked job only
    spec, trainer = trained_spec(spec)
    check_stackable(spec, trainer)
    check_batch(spec, trainer)
    device, fallback = engine.resolve_device(spec.device)
    engine.check(device, trainer)
    members = {seed: member_spec(spec, seed) for seed in seeds}
    results: dict[int, dict[str, Any]] = {}
    with contextlib.ExitStack() as held:
        folders = {seed: held.enter_context(RunFolder(m.run_dir)) for seed, m in
                   members.items()}
        todo = []
        for seed, member in members.items():
            folder = folders[seed]
            if (kept := reuse(member, folder)) is not None:
                results[seed] = kept
            elif resume_point(member, folder.run_dir) is not None:
                log.info("seed %s continues its unfinished run on its own", seed)
                results[seed] = _launch(member, folder)
            else:
                todo.append(seed)
        if todo:
            results |= _train_members({s: (members[s], folders[s]) for s in todo}, trainer,
                                      device, fallback)
    return [results[seed] for seed in seeds]


def _train_members(members: dict[int, tuple[RunSpec, RunFolder]], trainer: Any,
                   device: torch.device, fallback: str | None) -> dict[int, dict[str, Any]]:
    """Build each member under its seed, fit them side by side, then score and publish each
    from its own random state where its own job's fit would have left it."""
    fabric = engine.fabric(device, trainer)
    if fallback:
        log.warning("%s", fallback)
    built: dict[int, Built] = {}
    streams: dict[int, dict[str, Any]] = {}
    for seed, (member, _) in members.items():
        _start_process(member, fabric.device)
        built[seed] = _build(fabric, member, trainer)
        streams[seed] = rng_state()  # where the member's own job starts drawing data orders
    trainer.check_task(next(iter(built.values())).task)
    fit = _fit(fabric, trainer, built, streams)
    done = {}
    for seed, (member, folder) in members.items():
        set_rng_state(streams[seed])
        logger = member.logger.build()
        logger.start(folder.run_dir, _labels(member, "train"), dict(member.config))
        try:
            for epoch, metrics in fit["history"][seed]:
                logger.log_metrics(metrics, step=epoch)
            train = {"epochs": trainer.epochs, "train_s": fit["train_s"] / len(members),
                     "selected_epoch": trainer.epochs, "selected_by": "last",
                     "selected_value": None, "steps_run": fit["steps_run"],
                     "resumed_at": None, "stacked_with": list(members)}
            results = conclude(member, folder, member.header(), trainer, fabric, fallback,
                               built[seed], train, logger)
            assert results is not None  # one process: rank 0
            done[seed] = results
        finally:
            logger.finish(failed=True)  # a no-op after a published run closed it
    return done


def _fit(fabric: Any, trainer: Any, built: dict[int, Built],
         streams: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The side-by-side fit: every member's epochs in step. Returns each member's epoch
    metrics (train/loss, lr, and validation where due), the time and the steps run."""
    seeds = list(built)
    methods = [built[s].method for s in seeds]
    method = type(methods[0])
    own = [[p for p in m.parameters() if p.requires_grad] for m in methods]
    # One (R, …) tensor per parameter where the method computes the losses from them: the
    # optimiser's update is elementwise, so each member's slice is updated as its own job's.
    stacked = ([torch.nn.Parameter(torch.stack([p.detach() for p in ps]))
                for ps in zip(*own, strict=True)] if method.trains_stacked(methods) else None)
    optimizer = fabric.setup_optimizers(trainer.optimizer(
        params=stacked if stacked is not None else [p for ps in own for p in ps]))
    history: dict[int, list[tuple[int, dict[str, float]]]] = {s: [] for s in seeds}
    shown = progress_mode(trainer.progress)
    start, steps_run = time.perf_counter(), 0
    # the steps of an epoch: a loader's length draws no data order
    scheduler = schedule(optimizer, trainer, len(built[seeds[0]].data.loader("train", train=True)))
    bar = tqdm(range(1, trainer.epochs + 1), desc=f"train {methods[0].name} × {len(seeds)}",
               disable=shown != "bar", dynamic_ncols=True, leave=False)
    for epoch in bar:
        batches = []
        for s in seeds:  # each member's data order from its own random stream
            set_rng_state(streams[s])
            batches.append(list(built[s].data.loader("train", train=True)))
            streams[s] = rng_state()
        if len({len(b) for b in batches}) > 1:
            raise ValueError(f"the members' training splits differ in size "
                             f"({[len(b) for b in batches]} batches): stack seeds of one dataset")
        for m in methods:
            m.train()
        running = torch.zeros(len(seeds), dtype=torch.float64)
        for step in range(len(batches[0])):
            optimizer.zero_grad(set_to_none=True)
            inputs = [fabric.strategy.precision.convert_input(to_device(b[step], fabric.device))
                      for b in batches]
            with fabric.autocast():
                losses = method.stacked_losses(methods, inputs, stacked)
            finite = torch.isfinite(losses)
            if not bool(finite.all()):
                bad = [s for s, ok in zip(seeds, finite.tolist(), strict=True) if not ok]
                raise NonFiniteLossError(
                    f"the training loss of seed {bad[0]} became non-finite at epoch {epoch}, "
                    f"step {step} of the stacked seeds {seeds}; lower trainer.optimizer.lr or "
                    f"train the others without it (stack_seeds). No results were written.")
            fabric.backward(losses.sum())
            optimizer.step()
            scheduler.step()
            running += losses.detach().double().cpu()
            steps_run += 1
        _unstack(stacked, own)
        means = (running / len(batches[0])).tolist()
        for s, mean in zip(seeds, means, strict=True):
            b = built[s]
            metrics = {"train/loss": mean, "epoch": epoch, "lr": scheduler.get_last_lr()[0]}
            if b.data.has_val and trainer.validates(epoch):
                preds = b.task.predict(b.model, b.data.loader("val"), fabric.device)
                metrics.update(b.task.metrics("val", preds))
            history[s].append((epoch, metrics))
        if shown == "lines":
            log.info("%s", epoch_line(epoch, trainer.epochs, history[seeds[0]][-1][1],
                                      time.perf_counter() - start) + f" (seed {seeds[0]})")
    return {"history": history, "train_s": time.perf_counter() - start,
            "steps_run": steps_run}


@torch.no_grad()
def _unstack(stacked: list[torch.nn.Parameter] | None, own: list[list[torch.nn.Parameter]]
             ) -> None:
    """Each member's parameters from the (R, …) tensors that train them (nothing without)."""
    if stacked is None:
        return
    for r, params in enumerate(own):
        for p, s in zip(params, stacked, strict=True):
            p.copy_(s[r])
