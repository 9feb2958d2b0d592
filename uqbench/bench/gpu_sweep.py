"""Running ``uqbench`` for the checks of ``make gpu-check`` (:mod:`.gpu_check`).

A check's verdict is an :class:`Outcome`, one ``PASS|FAIL|SKIP <name>: <detail>`` line. The
``uqbench`` command runs in a subprocess, as a user runs it, until the check's deadline. A sweep
(:func:`sweep`) records every job's start and end through :class:`JobRecorder`, a Hydra
callback, and errors reach Hydra (``UQBENCH_TRACEBACK=1``): a failing job names its error while
the others still run; a job that ends the whole process is named, and the jobs after it are
swept again.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

# every run: no progress bar (one line per epoch, which the loss check reads), no figure, no
# predictions, no tracker
QUIET = ["trainer.progress=lines", "plot=false", "save_predictions=false", "logger=none"]


@dataclass
class Outcome:
    """One check's verdict: ``PASS|FAIL|SKIP <name>: <detail>``, with its numbers."""

    name: str
    status: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


@dataclass
class Context:
    """Where the checks run: ``device`` (cuda | cpu), a temporary ``folder``, torch threads
    per process, and the ``deadline`` (time.monotonic()) after which nothing new starts."""

    device: str
    folder: Path
    threads: int
    deadline: float

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def common(self) -> list[str]:
        return [*QUIET, f"device={self.device}", f"torch_threads={self.threads}"]

    def env(self) -> dict[str, str]:
        # UQBENCH_RUNS: the default runs folder is the check's own, so that nothing of a check
        # (a sweep's record where the sweep varies paths.runs_dir) lands where it was started
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "UQBENCH_RUNS": str(self.folder / "runs")}
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            env.setdefault(key, "1")
        return env


class OutOfTime(Exception):
    """The time budget was spent before a command could finish."""


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "uqbench.runner.cli", *args]


def uqbench(ctx: Context, *args: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """Run the ``uqbench`` command to its end (at most until the deadline)."""
    if ctx.left() <= 0:
        raise OutOfTime("the time budget was spent before it started")
    try:
        return subprocess.run(command(*args), env={**ctx.env(), **(env or {})},
                              capture_output=True, text=True, timeout=ctx.left())
    except subprocess.TimeoutExpired as err:
        raise OutOfTime("still running when the time budget ran out") from err


def tail(text: str | None, lines: int = 2) -> str:
    """The last error lines of a command's output, on one line ("" if it holds none)."""
    kept = [s.strip() for s in (text or "").splitlines()
            if re.search(r"\berror\b|Error|Exception|Traceback|Killed", s)
            and "Warning" not in s]
    return " | ".join(kept[-lines:])[-600:]


# --- a sweep and its jobs ------------------------------------------------------------------------

class ExitCalled(RuntimeError):
    """A job called ``exit()``, which would end the whole process with status 0."""


def _exit_called(code: object = None) -> None:
    called = "exit()" if code is None else f"exit({code!r})"
    raise ExitCalled(f"the job called {called}, which ends the process (status "
                     f"{code if isinstance(code, int) else 0 if code is None else 1}) without "
                     f"an error and without results")


class JobRecorder(Callback):
    """Hydra callback (``hydra.callbacks.<key>._target_``): appends one JSON line per job start
    and end to ``path``, with the job's overrides, run folder, status and error. While a job
    runs, ``exit()`` (the interactive builtin, which a library may call on a failure) raises
    :class:`ExitCalled` instead of ending the sweep, so the job fails with that reason."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._exit: Any = None

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")

    def on_job_start(self, config: Any, *, task_function: Any, **kwargs: Any) -> None:
        import builtins

        from hydra.core.hydra_config import HydraConfig

        self._exit = getattr(builtins, "exit", None)
        setattr(builtins, "exit", _exit_called)  # noqa: B010  (mypy: builtins.exit is a Quitter)
        self._write({"event": "start", "time": time.time(),
                     "overrides": list(HydraConfig.get().overrides.task)})

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        import builtins

        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobStatus

        setattr(builtins, "exit", self._exit)  # noqa: B010
        failed = job_return.status != JobStatus.COMPLETED
        error = job_return._return_value if failed else None  # .return_value re-raises it
        self._write({"event": "end", "time": time.time(),
                     "overrides": list(HydraConfig.get().overrides.task),
                     "folder": HydraConfig.get().runtime.output_dir,
                     "status": job_return.status.name,
                     "error": None if error is None else f"{type(error).__name__}: {error}"})


def choice(overrides: Sequence[str], key: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), "")


Job = tuple[str, ...]  # one job's values of the swept keys, in the keys' order


def launches(keys: Sequence[str], pending: list[Job]) -> list[str]:
    """The sweep overrides for the pending jobs: all of them when they are every combination of
    their values (a fresh sweep), else those that share the first one's values of every key but
    the first (the rest of a sweep that was cut short)."""
    values = [list(dict.fromkeys(job[i] for job in pending)) for i in range(len(keys))]
    if math.prod(len(v) for v in values) != len(pending):
        rest = pending[0][1:]
        values = [[job[0] for job in pending if job[1:] == rest], *([v] for v in rest)]
    return [f"{key}={','.join(v)}" for key, v in zip(keys, values, strict=True)]


def sweep(ctx: Context, label: str, keys: Sequence[str], jobs: list[Job], fixed: list[str],
          judge: Callable[[Job, dict[str, Any]], Outcome]) -> list[Outcome]:
    """Run ``jobs`` (values of ``keys``) as Hydra sweeps over ``fixed`` overrides and judge each
    by its record (``judge(job, record)``). Errors reach Hydra (``UQBENCH_TRACEBACK=1``), so a
    failing job does not stop the sweep; a job that ends the process is a FAIL and the jobs
    after it are swept again."""
    outcomes: list[Outcome] = []
    pending = list(jobs)
    while pending:
        log = ctx.folder / f"{label.replace('/', '_')}-{uuid.uuid4().hex[:8]}.jobs.jsonl"
        recorder = [f"+hydra.callbacks.gpu_check._target_={__name__}.JobRecorder",
                    f"+hydra.callbacks.gpu_check.path={log}"]
        try:
            proc = uqbench(ctx, "-m", *launches(keys, pending), *fixed, *recorder,
                           env={"UQBENCH_TRACEBACK": "1"})
            status, stderr = proc.returncode, proc.stderr
        except OutOfTime as err:
            status, stderr = None, str(err)
        records = ([json.loads(s) for s in log.read_text().splitlines()] if log.is_file()
                   else [])

        def job_of(record: dict[str, Any]) -> Job:
            return tuple(choice(record["overrides"], key) for key in keys)

        started = [r for r in records if r["event"] == "start"]
        ended = {job_of(r): r for r in records if r["event"] == "end"}
        for record in started:
            job = job_of(record)
            if job in ended:
                outcome = judge(job, {**ended[job], "start": record["time"]})
            else:
                why = ("the time budget ran out during this job" if status is None else
                       f"the process ended with status {status} during this job, and no "
                       f"error reached Hydra")
                outcome = Outcome(f"{label}/{'/'.join(job)}", "FAIL",
                                  f"{why}; {tail(stderr) or 'stderr names no error'}",
                                  seconds=time.time() - record["time"])
            outcomes.append(outcome)
            if job in pending:  # (a job of no pending value cannot start; kept safe anyway)
                pending.remove(job)
        if not started:  # nothing ran: the command itself failed, or no time was left
            reason = (stderr if status is None else tail(stderr)) or f"status {status}"
            outcomes += [Outcome(f"{label}/{'/'.join(job)}", "FAIL", f"not run: {reason}")
                         for job in pending]
            break
    return outcomes
