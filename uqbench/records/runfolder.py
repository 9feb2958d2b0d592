"""A run folder that never lies: one job at a time, published all at once, reused only as is.

- **One job per folder.** A job holds an exclusive ``flock`` on ``.<folder>.lock`` beside its run
  folder for its whole life; a second job into the same folder is refused at once. The kernel
  drops the lock when the process ends, however it ends, so a lock is never stale.
- **All-or-nothing publishing.** Everything a run produces (``config.yaml``, ``results.json``,
  ``predictions/``, ``figure.png``) is written into a staging folder beside the run folder, then
  swapped in with ONE atomic ``renameat2(RENAME_EXCHANGE)``: a reader (or a kill at any moment)
  sees either the old complete folder or the new complete one, never a mix. Files that belong to
  the folder rather than to one attempt (``uqbench.log``, ``wandb/``) are carried over. Where the
  exchange is not available (not Linux, or a filesystem without it), the old folder is renamed
  aside first and restored by the next job if the swap was cut short.
- **Reuse only the same configuration.** ``skip_existing`` and ``overwrite`` act only when the
  stored resolved config is the same run as the requested one (:mod:`uqbench.identity`);
  otherwise the job is refused with the difference.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from uqbench.identity import differences

FAILED = "failed.json"  # a failed run's record (uqbench.runner.outcomes writes it)
# what one attempt writes (a failed attempt: its failed.json), dropped when the next publishes
PUBLISHED = ("config.yaml", "results.json", "predictions", "figure.png", "checkpoint.ckpt", "eval",
             FAILED)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2

log = logging.getLogger("uqbench")


class RunLockedError(FileExistsError):
    """Another job is writing this run folder."""


class ConfigMismatchError(FileExistsError):
    """The run folder holds results of a different configuration."""


class RunExistsError(FileExistsError):
    """The run folder holds this configuration's results and neither reuse nor replacing them
    was asked for."""


# --- the transaction every job runs -------------------------------------------------------------

class RunFolder:
    """One job's transaction on a run folder: lock → recover → reuse → stage → publish.

    ``with RunFolder(run_dir) as folder:`` takes the folder's lock (held until the block ends,
    however it ends) and mends what a killed job left; ``folder.reuse(…)`` applies the rule for
    a folder that already holds results; ``with folder.staging() as stage:`` gives a fresh
    staging folder, removed on any exit, that ``folder.publish(stage)`` swaps in at once.

    ``lock_on``: the run folder this one lives in (a finished run's ``eval/<data>/`` folders):
    the job also holds that run's lock, shared, so that scorings of one run into different
    folders go side by side while nothing replaces the run under them (a job writing the run
    itself holds its lock exclusively). ``writer=False``: a process that trains beside the
    writer (ranks > 0 of a job a cluster manager started once per device) takes no lock and
    mends nothing. A copy sent to a spawned process never holds the lock: its launcher does.
    """

    def __init__(self, run_dir: Path, lock_on: Path | None = None, writer: bool = True) -> None:
        self.run_dir = run_dir
        self.writer = writer
        self._locks = ([] if not writer else
                       [RunLock(run_dir)] if lock_on is None else
                       [RunLock(lock_on, shared=True), RunLock(run_dir)])

    def __enter__(self) -> RunFolder:
        with ExitStack() as taken:  # a lock refused lets go of those taken
            for lock in self._locks:
                taken.enter_context(lock)
            taken.pop_all()  # all taken: held until __exit__
        if self._locks:
            for path in recover(self.run_dir):
                log.info("removed %s, left by an interrupted job", path)
        return self

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.__exit__()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_locks": []}  # the locks stay with the process that took them

    def reuse(self, requested: dict[str, Any], overwrite: bool, skip_existing: bool,
              flags: tuple[str, str, str] = ("overwrite=true", "skip_existing=true",
                                             "run_name=<name>")) -> dict[str, Any] | None:
        """The stored results to return instead of running, or None: run (:func:`reuse`)."""
        return reuse(self.run_dir, requested, overwrite, skip_existing, flags)

    @contextmanager
    def staging(self) -> Iterator[Path]:
        """An empty staging folder beside the run folder, removed on any exit of the block."""
        stage = new_stage(self.run_dir)
        try:
            yield stage
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def publish(self, stage: Path) -> None:
        """Swap the complete ``stage`` in as the run folder, in one step (:func:`publish`)."""
        publish(stage, self.run_dir)
        log.info("wrote %s", self.run_dir / "results.json")


# --- one job per folder ---------------------------------------------------------------------------

class RunLock:
    """Exclusive lock on a run folder (``with RunLock(run_dir): …``), released on any exit;
    ``shared=True``: a shared one, which any number of jobs hold together and which keeps out
    the exclusive one (scorings of a run, against a job that writes the run itself)."""

    def __init__(self, run_dir: Path, shared: bool = False) -> None:
        self.path = run_dir.parent / f".{run_dir.name}.lock"
        self.run_dir = run_dir
        self.shared = shared
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            what = "is writing" if self.shared else "is writing or scoring"
            raise RunLockedError(
                f"another job (pid {holder}) {what} {self.run_dir}; wait for it to finish, "
                f"or give this one its own folder (run_name=<name>)") from None
        os.ftruncate(fd, 0)  # the holder's pid for the message above (shared: the latest's)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


# --- all-or-nothing publishing --------------------------------------------------------------------

def new_stage(run_dir: Path) -> Path:
    """An empty staging folder beside ``run_dir`` (same filesystem, so the swap is a rename)."""
    stage = run_dir.parent / f".staging-{run_dir.name}-{uuid.uuid4().hex[:8]}"
    stage.mkdir(parents=True)
    return stage


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _kill_point(name: str) -> None:
    """Fault injection for the tests: ``UQBENCH_KILL_AT=<name>`` SIGKILLs the job here."""
    if os.environ.get("UQBENCH_KILL_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def publish(stage: Path, run_dir: Path) -> None:
    """Put the complete ``stage`` in place of ``run_dir`` in one step; keep the folder's log
    and tracker files; remove what the old folder published."""
    _kill_point("staged")
    if not run_dir.exists():
        os.rename(stage, run_dir)
        return
    if _exchange(stage, run_dir):
        old = stage                                       # the swap left the old folder here
    else:                                                 # two renames; recover() mends a cut
        old = run_dir.parent / f".replaced-{run_dir.name}-{uuid.uuid4().hex[:8]}"
        os.rename(run_dir, old)
        _kill_point("aside")
        os.rename(stage, run_dir)
    _kill_point("swapped")
    _carry(old, run_dir)                                  # uqbench.log, wandb/, …
    _kill_point("carried")
    shutil.rmtree(old, ignore_errors=True)


def _carry(old: Path, run_dir: Path) -> None:
    """Move what belongs to the folder rather than to one attempt (uqbench.log, wandb/, …) from
    a leftover folder into ``run_dir``. A log both hold is joined, older lines first, rewritten
    in place (the running job appends to it through an open handle)."""
    for entry in old.iterdir():
        if entry.name in PUBLISHED:
            continue
        target = run_dir / entry.name
        if not target.exists():
            os.rename(entry, target)
        elif entry.is_file() and target.is_file():
            with open(target, "r+b") as f:
                newer = f.read()
                f.seek(0)
                f.write(entry.read_bytes() + newer)
                f.truncate()


def recover(run_dir: Path) -> list[Path]:
    """Under the lock, before a job starts: restore a folder whose fallback swap was cut
    between its two renames, bring back the log a cut publish left behind, and delete the
    staging of killed jobs. Returns the leftover folders removed."""
    parent = run_dir.parent
    if not parent.is_dir():
        return []
    aside = sorted(parent.glob(f".replaced-{run_dir.name}-*"))
    if aside and not (run_dir / "results.json").exists():
        restored = aside.pop(0)
        run_dir.mkdir(exist_ok=True)  # holds the running job's log: files move in, not out
        for name in sorted(PUBLISHED, key=lambda n: n == "results.json"):  # results last
            if (restored / name).exists():
                target = run_dir / name
                if target.is_dir():
                    shutil.rmtree(target)  # a cut restore's partial copy
                os.replace(restored / name, target)
        _carry(restored, run_dir)
        shutil.rmtree(restored, ignore_errors=True)
    stale = aside + sorted(parent.glob(f".staging-{run_dir.name}-*"))
    stale += sorted(run_dir.glob(".staging-*")) if run_dir.is_dir() else []  # older layout
    for path in stale:
        if run_dir.is_dir() and path.parent != run_dir:
            _carry(path, run_dir)
        shutil.rmtree(path, ignore_errors=True)
    return stale


# --- reuse only the same configuration ------------------------------------------------------------

def reuse(run_dir: Path, requested: dict[str, Any], overwrite: bool, skip_existing: bool,
          flags: tuple[str, str, str] = ("overwrite=true", "skip_existing=true",
                                         "run_name=<name>")) -> dict[str, Any] | None:
    """The rule for a folder that already holds results: another configuration is refused with
    the differences, whatever the flags; the same one is returned with ``skip_existing``,
    replaced with ``overwrite`` (None: write the folder) and refused otherwise. ``flags``: how
    the caller spells overwrite, skip_existing and "another folder" in its messages."""
    import json

    results_path = run_dir / "results.json"
    if not results_path.exists():
        return None
    diff = stored_differences(run_dir, requested)
    replace, keep, elsewhere = flags
    if diff:
        raise ConfigMismatchError(
            f"{run_dir} holds the results of another configuration:\n  " + "\n  ".join(diff)
            + f"\n{keep.split('=')[0]} and {replace.split('=')[0]} act only on the same "
              f"configuration: give this run its own folder ({elsewhere}) or delete that one")
    if skip_existing and not overwrite:
        kept: dict[str, Any] = json.loads(results_path.read_text())
        return kept
    if not overwrite:
        raise RunExistsError(
            f"{results_path} already exists for this configuration. Pass {replace} to replace "
            f"it, {keep} to keep it and move on, or {elsewhere}.")
    return None


def stored_differences(run_dir: Path, requested: dict[str, Any]) -> list[str]:
    """How the folder's stored config differs from ``requested`` (:func:`differences`); a
    missing or unreadable config.yaml is a difference too."""
    stored = stored_config(run_dir)
    return (differences(stored, requested) if stored
            else ["config.yaml is missing or unreadable"])


def finished(run_dir: Path, unfinished: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """The stored config and the results of a finished run, or a FileNotFoundError naming
    what is missing (``unfinished`` ends the message when results.json is absent)."""
    import json

    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir} is not a run folder")
    if not (run_dir / "results.json").is_file():
        raise FileNotFoundError(f"{run_dir} holds no results.json{unfinished}")
    config = stored_config(run_dir)
    if config is None:
        raise FileNotFoundError(f"{run_dir}: config.yaml is missing or unreadable")
    return config, json.loads((run_dir / "results.json").read_text())


def stored_config(run_dir: Path) -> dict[str, Any] | None:
    """The resolved config a finished run stored, or None if it is missing or unreadable."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return config if isinstance(config, dict) else None
