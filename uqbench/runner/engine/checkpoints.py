"""Checkpoints: the state a run needs to continue, written atomically, read back with checks.

A checkpoint is one ``torch.save`` file. It is written beside its final name, flushed to disk,
then renamed over it, so a kill at any moment leaves the previous checkpoint or the new one,
never half a file. A file that cannot be read is never deleted or replaced silently: the job
refuses it, names it and keeps it.

Bit-exact continuation needs every random stream where it was: Python's, NumPy's, torch's CPU
generator and every CUDA generator (:func:`rng_state` / :func:`set_rng_state`).
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 1
RESUME = "resume/last.ckpt"        # an unfinished run's state, inside its run folder
FINAL = "checkpoint.ckpt"          # a finished run's, published with its results


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or of another run."""


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (write, flush, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        torch.save({"format": FORMAT, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if os.environ.get("UQBENCH_KILL_AT") == f"checkpoint:{state.get('global_step')}":
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection for the tests


def load(path: Path) -> dict[str, Any]:
    """The state in ``path``; a clear error (and the file left as it is) if it is unreadable."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        # our own file: it holds RNG states (tuples, NumPy arrays) besides tensors. Memory-
        # mapped: reading a large checkpoint's config and position costs no copy of it
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # truncated, corrupted, not a torch file
        raise CheckpointError(
            f"the checkpoint {path} cannot be read ({type(err).__name__}: {err}); it was kept "
            f"as it is. Move it away to start this run over, or restore a good copy") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a uqbench checkpoint (format {FORMAT}); it was "
                              f"kept as it is")
    return state
