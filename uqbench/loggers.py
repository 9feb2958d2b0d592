"""Experiment trackers behind one small interface; runs never need a network to succeed."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any


class Logger:
    """Interface: start → log_metrics (per epoch) → log_summary / log_image → finish."""

    def start(self, run_dir: Path, name: str, config: dict[str, Any],
              resume: bool = False) -> None:
        """``resume``: the run continues from a checkpoint (a tracker continues its record)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_summary(self, metrics: dict[str, float]) -> None:
        pass

    def log_image(self, key: str, path: Path) -> None:
        pass

    def finish(self) -> None:
        pass


class NullLogger(Logger):
    """Logs nothing; results still land in the run folder."""


class WandbLogger(Logger):
    """Weights & Biases: config, per-epoch metrics, final metrics and the run's figure.

    ``mode`` is ``offline`` by default (files under <run_dir>/wandb, sync later with
    ``wandb sync``), ``online`` where the machine has a network, or ``disabled``.
    """

    def __init__(self, project: str = "uqbench", entity: str | None = None,
                 mode: str = "offline", group: str | None = None,
                 tags: list[str] | None = None) -> None:
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"logger.mode '{mode}' is not one of online, offline, disabled")
        self.project, self.entity, self.mode = project, entity, mode
        self.group, self.tags = group, list(tags or [])
        self._run = None

    def start(self, run_dir: Path, name: str, config: dict[str, Any],
              resume: bool = False) -> None:
        """A run continued from a checkpoint continues its W&B run (the id kept in
        ``<run_dir>/wandb/uqbench-run-id``), so a preempted job is one run in the dashboard;
        any other start is a new W&B run."""
        import wandb

        id_file = run_dir / "wandb" / "uqbench-run-id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]  # a W&B run id: letters and digits
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id)
        self._run = wandb.init(project=self.project, entity=self.entity, mode=self.mode,
                               group=self.group, tags=self.tags, name=name, config=config,
                               dir=str(run_dir), reinit="finish_previous", id=run_id,
                               resume="allow")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._run is not None:
            self._run.log(metrics, step=step)

    def log_summary(self, metrics: dict[str, float]) -> None:
        if self._run is not None:
            self._run.summary.update(metrics)

    def log_image(self, key: str, path: Path) -> None:
        if self._run is not None:
            import wandb

            self._run.log({key: wandb.Image(str(path))})

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
