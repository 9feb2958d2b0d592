"""What became of each job of a sweep: a failed run's record, and the summary at the sweep's end.

A training job that fails once its work has started (an exception while training, scoring or
publishing, a diverged loss, a library's ``exit()``) is a failed run, not a user's mistake: its
folder gets ``failed.json`` (the error's type, a one-line reason, the traceback, the time; the
traceback is in the folder's ``uqbench.log`` too; and ``run``: results.json's header, settings
and table layout, without metrics, so that tables count it as a failure of its cell) and never a
results.json, W&B marks the run failed, and a sweep goes on with its other jobs. A scoring
(``job=eval``) that fails is recorded the same way in its own folder. A later job into the
folder (the same command again) trains it afresh; publishing its results drops the record.
Checks that fail before any work (a bad value, a missing file, another run's folder) still stop
at once, with their one line.

Every job of a multirun appends its outcome (done, reused or failed, with the run folder and the
reason) to ``<sweep dir>/outcomes.jsonl``, one JSON line per job, so that jobs in other
processes (``hydra/launcher=local``) report too. At the sweep's end :class:`SweepSummary` (a
Hydra callback, conf/config.yaml) prints one screen: the counts and each failed run's folder and
reason; the command then exits with status 1 if any run failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from uqbench.records.runfolder import FAILED

OUTCOMES = "outcomes.jsonl"
STATUSES = ("done", "reused", "failed")


class RunFailed(Exception):
    """A run failed after its work started; ``cause`` is what stopped it, ``run`` what its
    results.json would have said of it besides metrics (None: unknown)."""

    def __init__(self, run_dir: Path, cause: BaseException,
                 run: dict[str, Any] | None = None) -> None:
        self.run_dir, self.cause, self.run = Path(run_dir), cause, run
        self.trace = "".join(traceback.format_exception(cause))
        super().__init__(f"{run_dir}: {reason(cause)}")


def reason(err: BaseException) -> str:
    """One line: the error's type and the first line of its message."""
    if isinstance(err, SystemExit):
        return f"SystemExit({err.code!r}): the run called exit() before it finished"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def write_failed(failed: RunFailed) -> Path:
    """``failed.json`` in the run folder (written whole, then renamed into place)."""
    path = failed.run_dir / FAILED
    record: dict[str, Any] = {"status": "failed", "error": type(failed.cause).__name__,
                              "reason": reason(failed.cause), "traceback": failed.trace,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if failed.run is not None:
        record["run"] = failed.run | {"metrics": {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{FAILED}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def sweep_dir() -> Path | None:
    """The running multirun's folder (``hydra.sweep.dir``); None outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    return Path(str(hc.sweep.dir)) if hc.mode == RunMode.MULTIRUN else None


def record(status: str, run_dir: Path | str, why: str = "") -> None:
    """Append one job's outcome to its multirun's ``outcomes.jsonl`` (nothing outside one)."""
    folder = sweep_dir()
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"status": status, "run": str(run_dir), "reason": why}) + "\n"
    with open(folder / OUTCOMES, "a", encoding="utf-8") as f:  # one short append per job
        f.write(line)


def read(folder: Path) -> list[dict[str, Any]]:
    """The outcomes a multirun's jobs recorded, in the order they ended."""
    path = folder / OUTCOMES
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(outcomes: list[dict[str, Any]]) -> str:
    """The end-of-sweep screen: counts, then every failed run's folder and reason."""
    counts = {s: sum(o["status"] == s for o in outcomes) for s in STATUSES}
    lines = [f"sweep: {len(outcomes)} runs: {counts['done']} done, {counts['reused']} reused, "
             f"{counts['failed']} failed"]
    for o in outcomes:
        if o["status"] == "failed":
            lines.append(f"  FAILED {o['run']}: {o['reason']}")
    if counts["failed"]:
        lines.append("  each failed folder holds failed.json (the traceback is in its "
                     "uqbench.log); the same command again retrains only the failed and "
                     "missing runs")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Prints :func:`summary` when a multirun ends; exits with status 1 if a run failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        outcomes = read(Path(str(config.hydra.sweep.dir)))
        if not outcomes:
            return
        print(summary(outcomes), file=sys.stderr)
        if any(o["status"] == "failed" for o in outcomes):
            sys.exit(1)
