"""FSDP for uqbench's engine (:mod:`uqbench.runner.engine.fabric`), kept apart so that
importing the engine does not import Lightning; a module-level class, so that spawned processes
can unpickle it."""

from __future__ import annotations

from typing import Any

from lightning_fabric.strategies import FSDPStrategy
from lightning_fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher


class SpawnableFSDP(FSDPStrategy):
    """FSDP whose processes, when nobody else started them, are spawned for the job's function
    instead of re-launching the command line (a re-launched sweep would run in every process)."""

    def __init__(self, spawn: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._spawn = spawn

    def _configure_launcher(self) -> None:
        if self._spawn:
            self._launcher = _MultiProcessingLauncher(self, start_method="spawn")
        else:
            super()._configure_launcher()
