"""Experiment trackers behind one small interface; runs never need a network to succeed.

The runner describes each run once (:func:`run_labels`): a stable id derived from the run
folder, a group that gathers a setting's seeds, the job type, tags from the chosen config
options and flat keys to filter by. A tracker files the run under those labels; the run folder
stays the record (tables never read a tracker).

Longer than uqbench's other modules because every run stores the class paths of its tracker
(``logger._target_: uqbench.records.loggers.WandbLogger`` in config.yaml) and jobs that
continue, score or combine finished runs build it from there: the W&B logger stays beside the
interface it implements, under the path those runs name.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlparse

log = logging.getLogger("uqbench")

Mode = Literal["online", "offline", "disabled"]
MODES: tuple[Mode, ...] = ("online", "offline", "disabled")
# W&B refuses these in a project name; entities (users, teams) are letters, digits, - and _
PROJECT_FORBIDDEN = set('/\\#?%:')
ENTITY_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
NAME_LIMIT, TAG_LIMIT = 128, 64  # W&B's limits on a run name/group and on a tag
UNTAGGED = ("logger", "paths")  # config groups that say where things go, not what ran
SEED_FOLDER = re.compile(r"seed-?\d+")
# Keys a researcher filters by, as top-level config entries: {flat key: dotted config path}
FLAT_KEYS = {"experiment": "experiment_name", "variant": "variant", "seed": "seed",
             "lr": "trainer.optimizer.lr", "epochs": "trainer.epochs",
             "batch_size": "dataset.batch_size", "precision": "trainer.precision"}


@dataclass(frozen=True)
class RunLabels:
    """What a tracker files a run under.

    name: the run folder below the runs folder; id: derived from it, so a re-run, a resume or
    ``overwrite=true`` updates one tracker run; group: the run folder without its seed (the
    setting whose seeds a dashboard's group view aggregates); job_type: train | params | eval
    | combine | tables; tags: the chosen config options; flat: top-level keys to filter by.
    """

    name: str
    id: str
    group: str
    job_type: str
    tags: tuple[str, ...] = ()
    flat: dict[str, Any] = field(default_factory=dict)


def stable_id(folder: str) -> str:
    """A tracker run id for a run folder: 16 hex digits of its SHA-1 (the same folder, the same
    id, on any machine)."""
    return hashlib.sha1(folder.encode()).hexdigest()[:16]


def _fit(text: str, limit: int) -> str:
    """``text`` if it fits the tracker's limit, else its head and a hash of the whole."""
    if len(text) <= limit:
        return text
    return f"{text[:limit - 9]}~{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def flatten(config: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"method.rank": 8, …}: nested dicts joined with ``sep`` (dots: the override syntax)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{name}{sep}", sep)
        else:
            flat[name] = value
    return flat


def members(config: dict[str, Any]) -> int:
    """Predictive members: ensemble members, MC-Dropout's test-time passes, else 1."""
    method = config.get("method") or {}
    for key in ("members", "samples"):
        if isinstance(method.get(key), int):
            return int(method[key])
    return 1


def run_labels(config: dict[str, Any], choices: dict[str, str], job: str, folder: str,
               setting: str | None = None) -> RunLabels:
    """The labels of one job. ``folder``: its folder below the runs folder (the id's source);
    ``setting``: the training run's folder, whose parent without the seed is the group (for a
    scoring job, the run it scores); ``choices``: the option chosen in each config group."""
    setting = setting or folder
    parts = setting.split("/")
    group = "/".join(parts[:-1]) if len(parts) > 1 and SEED_FOLDER.fullmatch(parts[-1]) \
        else setting
    settings = flatten(config)
    flat = {k: settings.get(path) for k, path in FLAT_KEYS.items()}
    flat |= {g: choices.get(g) for g in ("method", "backbone", "dataset")}
    flat |= {"members": members(config), "job": job, "run": folder}
    tags = [f"{g}:{v}" for g, v in sorted(choices.items())
            if v and g not in UNTAGGED and "/" not in g and "@" not in g]
    tags += [f"job:{job}"] + ([f"variant:{flat['variant']}"] if flat["variant"] else [])
    return RunLabels(name=_fit(folder, NAME_LIMIT), id=stable_id(folder),
                     group=_fit(group, NAME_LIMIT), job_type=job,
                     tags=tuple(dict.fromkeys(_fit(t, TAG_LIMIT) for t in tags)), flat=flat)


def summary_of(results: dict[str, Any]) -> dict[str, Any]:
    """Every number a table reads from a results.json, keyed as the tables key it: metrics
    (``test/nll``), ``params/…``, ``time/…``, ``cost/…``, ``memory/…`` and ``train/…``
    (selected epoch, steps)."""
    summary = dict(results.get("metrics") or {})
    for section in ("params", "time", "cost", "memory", "train"):
        for key, value in flatten(results.get(section) or {}, f"{section}/", "/").items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                summary[key] = value
    return summary


def log_results(logger: Logger, results: dict[str, Any], run_dir: Path,
                images: Sequence[Path] = ()) -> None:
    """Hand a published run to its tracker and close it: the summary a table reads
    (:func:`summary_of`), the figures (paths relative to ``run_dir``), the predictions folder;
    failed if a metric is not finite."""
    bad = sorted(k for k, v in (results.get("metrics") or {}).items()
                 if isinstance(v, float) and not math.isfinite(v))
    if bad:
        log.warning("non-finite metrics (%s): the tracker marks this run failed",
                    ", ".join(bad[:5]) + (" …" if len(bad) > 5 else ""))
    logger.log_summary(summary_of(results))
    for image in images:
        logger.log_image(image.with_suffix("").as_posix(), run_dir / image)
    logger.log_files(f"predictions-{results.get('run', 'run')}", "predictions",
                     run_dir / "predictions")
    logger.finish(failed=bool(bad))


class Logger:
    """Interface: start → log_metrics (per epoch) → log_summary / log_image / log_table /
    log_files → finish. A tracker's failure never fails a run."""

    def check(self) -> None:
        """Refuse settings that cannot work, before any expensive work (a clear error)."""

    def start(self, run_dir: Path, labels: RunLabels, config: dict[str, Any],
              resume: bool = False) -> None:
        """``resume``: the run continues from a checkpoint (a tracker continues its record)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_summary(self, metrics: dict[str, Any]) -> None:
        pass

    def log_image(self, key: str, path: Path) -> None:
        pass

    def log_table(self, key: str, frame: Any) -> None:
        """``frame``: a pandas DataFrame."""

    def log_files(self, name: str, kind: str, folder: Path) -> None:
        """A folder of files as one versioned artifact (e.g. per-example predictions)."""

    def finish(self, failed: bool = False) -> None:
        pass


class NullLogger(Logger):
    """Logs nothing; results still land in the run folder."""


class WandbLogger(Logger):
    """Weights & Biases: config, per-epoch metrics, the summary a table reads, figures.

    mode: ``offline`` by default (files under ``<dir>/wandb``; sync later with ``wandb sync``),
    ``online`` where the machine has a network, or ``disabled``. An online run that cannot
    reach the server (no network, no login) says so once and records offline instead.
    dir: where the tracker's files go (default: the run folder). log_predictions: the run's
    per-example predictions as an artifact. tags: added to the chosen config options.
    """

    def __init__(self, project: str = "uqbench", entity: str | None = None,
                 mode: str = "offline", tags: list[str] | None = None,
                 dir: str | None = None, log_predictions: bool = False,
                 timeout_s: float = 30.0, group: str | None = None) -> None:
        self.project, self.entity, self.mode = str(project), entity, str(mode)
        self.tags, self.dir = [str(t) for t in (tags or [])], dir
        self.log_predictions, self.timeout_s = bool(log_predictions), float(timeout_s)
        self.group = group  # None: the run folder without its seed (run_labels)
        self._run: Any = None
        self._reported = False
        self.check()

    # --- settings ---------------------------------------------------------------------------

    def check(self) -> None:
        if self.mode not in MODES:
            hint = " (WANDB_MODE sets the default)" if os.environ.get("WANDB_MODE") else ""
            raise ValueError(f"logger.mode '{self.mode}' is not one of {', '.join(MODES)}"
                             f"{hint}")
        bad = sorted(PROJECT_FORBIDDEN & set(self.project))
        if not self.project.strip() or bad or len(self.project) > NAME_LIMIT:
            raise ValueError(
                f"logger.project '{self.project}' is not a W&B project name: it must be 1 to "
                f"{NAME_LIMIT} characters without any of {' '.join(sorted(PROJECT_FORBIDDEN))}"
                + (f" (found {' '.join(bad)})" if bad else ""))
        if self.entity is not None and not ENTITY_PATTERN.fullmatch(str(self.entity)):
            raise ValueError(f"logger.entity '{self.entity}' is not a W&B user or team name: "
                             f"use letters, digits, '-' and '_' (or null for your default "
                             f"entity)")
        if self.timeout_s <= 0:
            raise ValueError(f"logger.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.dir is not None and self.mode != "disabled":
            _check_writable(Path(str(self.dir)).expanduser(), "logger.dir")

    # --- the run ----------------------------------------------------------------------------

    def start(self, run_dir: Path, labels: RunLabels, config: dict[str, Any],
              resume: bool = False) -> None:
        """Open (or, with the same id, continue) the tracker's run of this folder."""
        if self.mode == "disabled":
            return
        root = Path(str(self.dir)).expanduser() if self.dir is not None else run_dir
        _check_writable(root, "the W&B folder (logger.dir)")
        (root / "wandb").mkdir(parents=True, exist_ok=True)
        mode = self.mode
        if mode == "online" and (why := _unreachable(self.timeout_s)):
            self._report(f"W&B is unreachable ({why}); this run is recorded offline under "
                         f"{root / 'wandb'}: sync it later with `wandb sync`")
            mode = "offline"
        # the whole config in the override syntax (the table layout and the lookup tables are
        # not settings: the values a run read from a lookup table are in its settings)
        flat = flatten({k: v for k, v in config.items() if k not in ("table", "hydra", "lookup")})
        kwargs = dict(project=self.project, entity=self.entity, group=self.group or labels.group,
                      job_type=labels.job_type, tags=[*labels.tags, *self.tags],
                      name=labels.name, id=labels.id, resume="allow", dir=str(root),
                      config={**flat, **labels.flat}, reinit="finish_previous")
        self._run = self._init(mode, kwargs)
        if self._run is None and mode == "online":
            self._report(f"W&B could not start online; this run is recorded offline under "
                         f"{root / 'wandb'}")
            self._run = self._init("offline", kwargs)
        if self._run is not None:
            self._guard(lambda: self._run.define_metric("*", step_metric="epoch"))

    def _init(self, mode: str, kwargs: dict[str, Any]) -> Any:
        import wandb

        try:
            return wandb.init(mode=cast(Mode, mode), settings=wandb.Settings(  # check()ed
                init_timeout=self.timeout_s, silent=True, console="off"), **kwargs)
        except Exception as err:  # noqa: BLE001 - a tracker never fails a run
            self._report(f"W&B did not start in {mode} mode ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''})")
            return None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        # Plotted against the ``epoch`` entry (define_metric), not W&B's own step counter: a
        # resumed or re-run job logs epochs the record may already hold without being dropped.
        self._guard(lambda: self._run.log(dict(metrics)))

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self._guard(lambda: self._run.summary.update(metrics))

    def log_image(self, key: str, path: Path) -> None:
        def log_it() -> None:
            import wandb

            self._run.log({key: wandb.Image(str(path))})
        self._guard(log_it)

    def log_table(self, key: str, frame: Any) -> None:
        def log_it() -> None:
            import wandb

            table = wandb.Table(dataframe=frame.astype(object).where(frame.notna(), None))
            self._run.log({key: table})
        self._guard(log_it)

    def log_files(self, name: str, kind: str, folder: Path) -> None:
        if not self.log_predictions or not folder.is_dir():
            return

        def log_it() -> None:
            import wandb

            artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9._-]", "-", name)[:128], type=kind)
            artifact.add_dir(str(folder))
            self._run.log_artifact(artifact)
        self._guard(log_it)

    def finish(self, failed: bool = False) -> None:
        """Close the run, marked failed (exit code 1) when the job failed or its metrics
        hold a NaN; a second call does nothing."""
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1 if failed else 0)
            except Exception as err:  # noqa: BLE001
                self._report(f"W&B did not close its run ({type(err).__name__}: {err})")

    # --- failures ---------------------------------------------------------------------------

    def _guard(self, action: Any) -> None:
        """Run a tracker call; on failure say so once and stop tracking (the run goes on)."""
        if self._run is None:
            return
        try:
            action()
        except Exception as err:  # noqa: BLE001 - a tracker never fails a run
            self._report(f"W&B logging failed ({type(err).__name__}: {err}); the run goes on "
                         f"without it and its results land in the run folder")
            run, self._run = self._run, None
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass

    def _report(self, message: str) -> None:
        if not self._reported:
            log.warning("%s", message)
        self._reported = True


def _check_writable(folder: Path, what: str) -> None:
    """``folder`` exists and is writable, or can be made where its nearest existing parent
    is writable (a clear error otherwise)."""
    existing = next((p for p in [folder, *folder.absolute().parents] if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{what} {folder}: {existing} is a file, not a folder")
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {folder} is not writable ({existing} is not); set "
                              f"logger.dir to a folder you can write, or logger=none")


def _unreachable(timeout_s: float) -> str | None:
    """Why the W&B server cannot be reached (None when a connection opens), in at most
    ``timeout_s`` seconds: a machine without a network fails here at once instead of
    stalling the run in W&B's retries."""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or _default_base_url())
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=min(timeout_s, 5.0)):
            return None
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"


def _default_base_url() -> str:
    try:
        import wandb

        return str(wandb.Settings().base_url)
    except Exception:  # noqa: BLE001
        return "https://api.wandb.ai"


def log_experiment_table(logger: Logger, folder: Path, experiment: str, frames: dict[str, Any],
                         figures: list[Path], command: str) -> None:
    """One ``tables`` run per experiment (id from ``<experiment>/tables``, so a rebuild updates
    it): each of ``frames`` ({key: DataFrame}) as a table, each figure as an image, and the
    command that built them in its config. ``folder``: where the tracker's folder goes."""
    labels = RunLabels(name=f"{experiment}/tables", id=stable_id(f"{experiment}/tables"),
                       group=experiment, job_type="tables",
                       tags=(f"experiment:{experiment}", "job:tables"),
                       flat={"experiment": experiment, "job": "tables"})
    logger.start(folder, labels, {"command": command})
    for key, frame in frames.items():
        logger.log_table(key, frame)
    for figure in figures:
        logger.log_image(f"figures/{figure.stem}", figure)
    logger.finish()
