"""Where an experiment's table layout comes from: its config, so editing it redraws finished runs.

The layout is the ``table:`` of ``conf/experiment/<name>.yaml`` (the configs packaged as
``uqbench.conf``, plus a config folder the caller names), composed and resolved as a run of the
experiment resolves it, when the tables are built. A table layout is no part of a run's
identity (:mod:`uqbench.identity`), so the runs stay reusable when it changes. An experiment
without a config (renamed, removed, or someone else's) keeps the spec its runs copied into
results.json, the last in path order, and a log line says so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from uqbench.configs import group_options
from uqbench.report.validation import InvalidResults, Run, check_spec, warn

log = logging.getLogger("uqbench")


def experiments(configs: Path | None = None) -> set[str]:
    """The experiments that have a config: the packaged ones and those under ``configs``."""
    names = set(group_options("experiment"))
    if configs is not None:
        names |= {p.stem for p in (configs / "experiment").glob("*.yaml")}
    return names


def _compose(experiment: str, configs: Path | None) -> DictConfig:
    """The experiment's config as a run composes it (no job: no run folder is needed)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"experiment={experiment}"]
    if configs is not None:
        overrides.append(f"hydra.searchpath=[file://{configs.resolve()}]")
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its search path counts
        return compose("config", overrides=overrides)
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        return compose("config", overrides=overrides)


def configured(experiment: str, configs: Path | None = None) -> dict[str, Any] | None:
    """The table spec the experiment's config declares, resolved ({} when it declares none);
    None when the experiment has no config."""
    if experiment not in experiments(configs):
        return None
    node = _compose(experiment, configs).get("table")
    return OmegaConf.to_container(node, resolve=True) if node else {}  # type: ignore[return-value]


def stored(runs: list[Run]) -> dict[str, Any] | None:
    """The table spec the last of ``runs`` (in path order) stored, None if none stored one."""
    return next((run["table"] for run in reversed(runs) if run.get("table")), None)


def layout(experiment: str, runs: list[Run], configs: Path | None = None
           ) -> dict[str, Any] | None:
    """The table spec of ``experiment``: its config's, else the one its runs stored; None
    (no table) when neither has one or the config's cannot be read or used (a warning)."""
    where = f"conf/experiment/{experiment}.yaml"
    try:
        spec = configured(experiment, configs)
    except (HydraException, OmegaConfBaseException) as err:
        warn(where, f"its table cannot be composed ({str(err).splitlines()[0]})")
        return None
    if spec is None:
        log.info("%s: no %s; its table is laid out as its runs stored it in results.json",
                 experiment, where)
        return stored(runs)
    if not spec:
        return None
    try:
        check_spec(spec)
    except InvalidResults as err:
        warn(where, str(err))
        return None
    return spec
