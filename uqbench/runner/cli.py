"""The runner: the single Hydra entry point (`uqbench`).

Builds backbone, dataset and method from the config, trains, evaluates every split the dataset
declares, and writes the run folder (:mod:`uqbench.runner.jobs.train`); ``job=params`` counts
parameters instead, ``job=eval`` scores a finished run on other data
(:mod:`uqbench.runner.jobs.score`). Every check that can fail on the user's input runs before any
expensive work, and a user's mistake prints as one line (:mod:`uqbench.errors`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from uqbench.errors import traceback_wanted, user_errors
from uqbench.runner import objective, outcomes
from uqbench.runner.engine import fabric as engine
from uqbench.runner.engine.loop import NonFiniteLossError, Preempted
from uqbench.runner.jobs import job_of, runner
from uqbench.runner.jobs import score as _score  # noqa: F401  registers Hydra's uq.log_dir
from uqbench.runner.jobs.stacked import stacked_job
from uqbench.runner.outcomes import RunFailed
from uqbench.runner.spec import RunSpec, check_config

__all__ = ["check_config", "main", "run", "run_summary"]

log = logging.getLogger("uqbench")


def run(cfg: DictConfig | RunSpec) -> dict[str, Any] | list[dict[str, Any]]:
    """Train and evaluate one configuration (or count its parameters: ``job=params``, or score
    a finished one: ``job=eval``); return the results dict (also written to disk). With
    ``stack_seeds``, the seeds train side by side and each member's results come back, in
    order (:mod:`uqbench.runner.jobs.stacked`). A composed config becomes its checked spec
    here (:meth:`RunSpec.of`), once."""
    spec = cfg if isinstance(cfg, RunSpec) else RunSpec.of(cfg)
    if spec.stack_seeds is not None:
        return stacked_job(spec)
    return runner(spec.job)(spec)


def _drop_log_only_folder(cfg: DictConfig) -> None:
    """A job refused before it wrote anything leaves no folder behind: Hydra made the run
    folder (a scoring's: ``<run>/eval/<name>/``) for its log, so the folder and the parents it
    made, up to the runs folder (a scoring's: up to its run), go when the log is all they
    hold. A folder with anything else in it is never touched."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    folder = Path(hc.runtime.output_dir)
    if not folder.is_dir() or {p.name for p in folder.iterdir()} - {f"{hc.job.name}.log"}:
        return
    (folder / f"{hc.job.name}.log").unlink(missing_ok=True)
    # the folders Hydra may have made: below the runs folder, or a scoring's below its run
    bounds = [Path(str(cfg.paths.runs_dir)).resolve()]
    if job_of(cfg) == "eval":  # the spec may be what failed: the composed config's folders
        bounds.insert(0, Path(str(cfg.get("eval_run") or cfg.run_dir)).expanduser().resolve())
    root = next((b for b in bounds if b in folder.resolve().parents), bounds[-1])
    for path in [folder.resolve(), *folder.resolve().parents]:
        if path == root or root not in path.parents:
            break
        try:
            path.rmdir()  # only while empty: a parent other jobs use stays
        except OSError:
            break



@hydra.main(config_path="pkg://uqbench.conf", config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    """One job; returns its validation objective (``objective``) for a sweeper that reads it.
    The config becomes the job's spec here, checked once; nothing below reads the config."""
    with _stops(cfg), user_errors(on_error=lambda: _drop_log_only_folder(cfg)):
        spec = RunSpec.of(cfg)
        stored = _stored_results(spec)
        try:
            outcome = run(spec)
        except RunFailed as failed:
            return _failed(failed)
        except NonFiniteLossError as err:
            return _diverged(err)
        runs = outcome if isinstance(outcome, list) else [outcome]
        reused = stored is not None and stored == _stored_results(spec)
        for results in runs:
            outcomes.record("reused" if reused else "done", results.get("run", spec.run_dir))
        # a stacked job's objective: its members' mean
        values = ([objective.value(spec.objective, results) for results in runs]
                  if spec.job == "train" else [])
        known = [v for v in values if v is not None]
        value = sum(known) / len(known) if known and len(known) == len(values) else None
    for results in runs:
        print(run_summary(results))
    return value


def run_summary(results: dict[str, Any], width: int = 100) -> str:
    """A finished run on one screen: its folder, then its test and OOD metrics (those of one
    level, ``test/nll``), a line per split, wrapped at ``width``."""
    lines = [f"{results['run']}:"]
    for split in ("test", "ood"):
        shown = [f"{k}={round(v, 4)}" for k, v in results["metrics"].items()
                 if k.split("/")[0] == split and k.count("/") == 1 and isinstance(v, float | int)]
        line = " "
        for item in shown:
            if len(line) + len(item) + 2 > width and line.strip():
                lines.append(line)
                line = " "
            line += " " + item
        if line.strip():
            lines.append(line)
    return "\n".join(lines)


def _stored_results(spec: RunSpec) -> int | None:
    """The modification time (ns) of the results.json this job writes (a scoring's in its own
    folder, Hydra's output folder of the job), or None: tells a reused run from a new one."""
    from hydra.core.hydra_config import HydraConfig

    try:
        folder = (HydraConfig.get().runtime.output_dir if HydraConfig.initialized()
                  else spec.run_dir)
        return (Path(str(folder)) / "results.json").stat().st_mtime_ns
    except (OSError, ValueError, KeyError):
        return None


def _failed(failed: RunFailed) -> float | None:
    """A run that failed after its work started: its folder gets failed.json and its log the
    traceback, its sweep records it and goes on. A single run's failure is the command's: one
    line, status 1. A diverged trial of a sweep that reads the objective reports the worst
    value (:func:`_diverged`)."""
    if traceback_wanted():
        raise failed.cause
    path = outcomes.write_failed(failed)
    log.error("run failed: %s (record: %s)", failed, path)
    _to_log_file(failed.trace)
    outcomes.record("failed", failed.run_dir, outcomes.reason(failed.cause))
    if isinstance(failed.cause, NonFiniteLossError) and objective.sweeper_direction():
        return _diverged(failed.cause)
    print(f"FAILED {failed} (record: {path})", file=sys.stderr)
    if outcomes.sweep_dir() is None:
        sys.exit(1)
    return None


def _to_log_file(text: str) -> None:
    """``text`` into the job's log file only (the console keeps its one line per failure)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            handler.acquire()
            try:
                handler.stream.write(text)
                handler.flush()
            finally:
                handler.release()


def _diverged(err: NonFiniteLossError) -> float:
    """A diverged trial of a sweep is an outcome of tuning, not the end of the study: it
    reports the worst value (the sweeper cannot take NaN), and the study goes on. Outside a
    sweep that reads the objective, the error stands."""
    direction = objective.sweeper_direction()
    if direction is None:
        raise err
    log.error("%s: %s", type(err).__name__, err)
    return float("inf") if direction == "minimize" else float("-inf")


@contextmanager
def _stops(cfg: DictConfig) -> Iterator[None]:
    """A stop request (SIGTERM, SLURM's USR2: the checkpoint is written) hands the signal's
    exit status on; Ctrl-C prints one line and leaves the folder as a kill leaves it."""
    try:
        yield
    except Preempted as stopped:
        log.warning("%s", stopped)
        print(str(stopped), file=sys.stderr)
        sys.exit(engine.hand_on(stopped.signum))
    except KeyboardInterrupt:
        if traceback_wanted():
            raise
        log.error("interrupted: no results were written for %s", cfg.run_dir)
        print(f"interrupted: no results were written for {cfg.run_dir}", file=sys.stderr)
        sys.exit(130)


def main() -> None:
    """The ``uqbench`` command. Hydra's own errors (an unknown option, a config that does not
    resolve) print in the same one-line format as uqbench's: Hydra is asked to raise them."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    with user_errors(catch=(Exception,)):
        _hydra_main()


if __name__ == "__main__":
    # `python -m uqbench.runner.cli`: run the importable module's main, so that launchers and
    # spawned processes pickle the job's functions as uqbench.runner.cli's, not as __main__'s
    import importlib

    importlib.import_module("uqbench.runner.cli").main()
