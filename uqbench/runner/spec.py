"""The run spec: a job's Hydra config, checked once at the entry point and held as typed fields.

The runner's Hydra main turns the composed config into a :class:`RunSpec` (:meth:`RunSpec.of`)
before anything is read, built or written: every buildable group's types and choices against
its constructor's annotations, the top-level keys, the job, the seeds, the method's own
refusals and the objective. Code below the entry point reads the spec's fields (``spec.seed``,
``spec.run_dir``, ``spec.method.settings``) and builds a group with ``spec.method.build()``;
nothing below it reads the config by path.

``spec.config`` is the resolved config: what config.yaml stores and what makes two runs the
same run (:mod:`uqbench.identity`). Building a spec changes no run's identity. A job that needs
a variant of its spec (a stacked member's seed, the recipe's batch put into the dataset) asks
for one with :meth:`RunSpec.derive`, which re-resolves the composed config with those values,
so that the run folder and every interpolation follow.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from uqbench.configs import build, check_types, check_value
from uqbench.runner import objective
from uqbench.runner.engine.fabric import resolve_device
from uqbench.runner.jobs import job_of

#: the config groups a job builds objects from, in the order they are checked
GROUPS = ("backbone", "method", "dataset", "task", "trainer", "logger")


@dataclass(frozen=True)
class Part:
    """One buildable config group (``backbone``, ``method``, …): its resolved fields
    (``fields``, Hydra's instantiation keys included), the class it builds (``target``), and
    the node as composed, which :meth:`build` instantiates. A group the config lacks is an
    empty part."""

    group: str
    fields: Mapping[str, Any]
    node: DictConfig = field(repr=False, compare=False)

    @property
    def settings(self) -> dict[str, Any]:
        """The group's resolved fields without Hydra's keys (what results.json records)."""
        return {k: v for k, v in self.fields.items() if not k.startswith("_")}

    @property
    def target(self) -> str | None:
        target = self.fields.get("_target_")
        return None if target is None else str(target)

    @property
    def name(self) -> str:
        """The option's name (``bnn_embedded``), or the group's where it has none."""
        return str(self.settings.get("name", self.group))

    @property
    def present(self) -> bool:
        return bool(self.fields)

    def get(self, key: str, default: Any = None) -> Any:
        """A resolved field of the group (``spec.dataset.get("batch_size")``)."""
        return self.settings.get(key, default)

    def build(self) -> Any:
        """The object the group configures (Hydra-instantiated, its user errors as they are)."""
        return build(self.node)

    def hook(self, name: str) -> Any:
        """The classmethod ``name`` of the group's class, or None (no class, no such hook)."""
        from hydra.utils import get_object

        if not self.target:
            return None
        found = getattr(get_object(self.target), name, None)
        return found if callable(found) else None


def _part(cfg: DictConfig, group: str) -> Part:
    node = cfg.get(group)
    if not isinstance(node, DictConfig):
        return Part(group, {}, OmegaConf.create({}))
    fields = OmegaConf.to_container(node, resolve=True)
    assert isinstance(fields, dict)
    return Part(group, {str(k): v for k, v in fields.items()}, node)


@dataclass(frozen=True)
class RunSpec:
    """One job of the runner, as its config asks and checked: the top-level settings as typed
    fields, a :class:`Part` per buildable group, and the resolved ``config``."""

    job: str                             # train | params | eval
    seed: int
    stack_seeds: tuple[int, ...] | None  # seeds trained side by side in this job
    device: str                          # as asked: auto | cpu | cuda[:N] | mps
    torch_threads: int | None
    run_dir: Path
    run_subdir: str                      # the run folder below the runs folder
    experiment: str
    variant: str | None
    overwrite: bool
    skip_existing: bool
    resume: bool
    save_predictions: bool
    plot: bool
    eval_splits: tuple[str, ...] | None  # None: every split the dataset declares
    eval_run: Path | None                # job=eval: the run scored (None: run_dir)
    objective: str | None
    overhead: Mapping[str, Any] | None   # job=params' options
    backbone: Part
    method: Part
    dataset: Part
    task: Part
    trainer: Part
    logger: Part
    config: Mapping[str, Any] = field(repr=False)  # resolved: config.yaml, the run's identity
    choices: Mapping[str, str] = field(repr=False)  # the option chosen in each group
    overrides: tuple[str, ...] = field(repr=False)  # the command line's, as results.json keeps
    composed: DictConfig = field(repr=False, compare=False)  # what derive() starts from

    @classmethod
    def of(cls, cfg: DictConfig, *, check: bool = True,
           hydra: tuple[Mapping[str, str], tuple[str, ...]] | None = None) -> RunSpec:
        """The spec of a composed config; with ``check`` (the entry point's) every check that
        can fail on the user's input runs first (:func:`check_config`). ``hydra``: the group
        choices and command-line overrides to keep (a spec rebuilt where Hydra is not running,
        e.g. in a spawned process); else read from Hydra, where it runs."""
        if check:
            check_config(cfg)
        parts = {group: _part(cfg, group) for group in GROUPS}
        config: dict[str, Any] = {}
        for key in cfg:
            if key == "hydra":  # a resolver's root holds Hydra's own node: never the run's
                continue
            value = cfg[key]
            config[str(key)] = (OmegaConf.to_container(value, resolve=True)
                                if OmegaConf.is_config(value) else value)
        choices, overrides = hydra if hydra is not None else _hydra_context(parts)
        splits, threads = config.get("eval_splits"), config.get("torch_threads")
        eval_run = config.get("eval_run")
        stacked = stacked_seeds(config.get("stack_seeds"), config.get("seed", 0))
        return cls(
            job=job_of(config), seed=int(config.get("seed", 0)),
            stack_seeds=None if stacked is None else tuple(stacked),
            device=str(config.get("device", "auto")),
            torch_threads=None if threads is None else int(threads),
            run_dir=Path(str(config.get("run_dir"))), run_subdir=str(config.get("run_subdir")),
            experiment=str(config.get("experiment_name")), variant=config.get("variant"),
            overwrite=bool(config.get("overwrite", False)),
            skip_existing=bool(config.get("skip_existing", False)),
            resume=bool(config.get("resume", True)),
            save_predictions=bool(config.get("save_predictions", True)),
            plot=bool(config.get("plot", True)),
            eval_splits=None if splits is None else tuple(str(s) for s in splits),
            eval_run=Path(str(eval_run)).expanduser() if eval_run else None,
            objective=config.get("objective"), overhead=config.get("overhead"),
            **parts, config=config, choices=dict(choices), overrides=tuple(overrides),
            composed=cfg)

    def derive(self, values: Mapping[str, Any]) -> RunSpec:
        """This spec with config keys set (``{"seed": 2, "stack_seeds": None}``), composed
        again: the run folder and every interpolation follow. The keys were checked with the
        rest; the values are the runner's own."""
        node = copy.deepcopy(self.composed)
        with open_dict(node):
            for key, value in values.items():
                OmegaConf.update(node, key, value, force_add=True)
        return RunSpec.of(node, check=False, hydra=(self.choices, self.overrides))

    def plain(self) -> dict[str, Any]:
        """The spec as plain data (its resolved config, choices and overrides): what a
        spawned process, which has no Hydra context, rebuilds the same run from
        (:meth:`from_plain`)."""
        return {"config": dict(self.config), "choices": dict(self.choices),
                "overrides": list(self.overrides)}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> RunSpec:
        """The spec :meth:`plain` describes, over its resolved config."""
        return cls.of(OmegaConf.create(dict(plain["config"])), check=False,
                      hydra=(dict(plain["choices"]), tuple(plain["overrides"])))

    def at(self, path: str) -> Any:
        """The resolved value at a dotted path of the config (None where absent): for the
        keys a command names by path, such as a scoring's ``dataset.<key>=…``."""
        return value_at(self.config, path)

    @property
    def scored_folder(self) -> Path:
        """The run a scoring job scores: ``eval_run``, or the folder the command names."""
        return self.eval_run if self.eval_run is not None else self.run_dir

    def header(self) -> dict[str, Any]:
        """The keys every results.json starts with: experiment, run folder, choices, seed,
        variant (the setup's label within its experiment, or None), overrides."""
        return {"experiment": self.experiment, "run": self.run_subdir,
                "dataset": self.choices["dataset"], "method": self.choices["method"],
                "backbone": self.choices["backbone"], "seed": self.seed,
                "variant": self.variant, "overrides": list(self.overrides)}


def value_at(tree: Any, path: str | list[str]) -> Any:
    """The value at a dotted path (or a list of keys) of nested mappings (a resolved config,
    a results dict), None where absent."""
    for key in path.split(".") if isinstance(path, str) else path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _hydra_context(parts: Mapping[str, Part]) -> tuple[dict[str, str], list[str]]:
    """The option chosen in each config group (Hydra's runtime choices when it runs, else each
    group's name) and the command line's overrides (none outside the CLI)."""
    from hydra.core.hydra_config import HydraConfig

    choices: dict[str, str] = {}
    overrides: list[str] = []
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        choices = {k: v for k, v in hc.runtime.choices.items()
                   if v is not None and not k.startswith("hydra")}
        overrides = list(hc.overrides.task)
    for group in ("backbone", "method", "dataset"):
        choices.setdefault(group, str(parts[group].settings.get("name", group)))
    return choices, overrides


# --- the checks, run once at the entry point -------------------------------------------------

def check_config(cfg: DictConfig) -> None:
    """Types and choices of the whole config, before anything is read, built or written: every
    buildable group against its constructor's annotations, and the top-level keys."""
    for group in GROUPS:
        if isinstance(cfg.get(group), DictConfig):
            check_types(cfg[group], group)
    method, trainer = _part(cfg, "method"), _part(cfg, "trainer")
    if trainer.present and (checker := method.hook("check_trainer")) is not None:
        # a method class may refuse a trainer setting it cannot serve (the Laplace methods
        # and half-precision weights)
        checker(dict(trainer.settings), dict(method.settings))
    check_value("seed", cfg.seed, int)
    check_value("torch_threads", cfg.get("torch_threads"), int | None)
    if cfg.get("torch_threads") is not None and cfg.torch_threads < 1:
        raise ValueError(f"torch_threads must be >= 1 or null, got {cfg.torch_threads}")
    resolve_device(str(cfg.device))
    job = job_of(cfg)  # an unknown job: its one-line error, before anything is built
    check_eval_splits(cfg.get("eval_splits"))
    stacked_seeds(cfg.get("stack_seeds"), cfg.seed)
    overhead = cfg.get("overhead")
    if overhead is not None and not isinstance(overhead, DictConfig):
        shown = OmegaConf.to_container(overhead) if OmegaConf.is_config(overhead) else overhead
        raise ValueError(f"overhead must be a mapping of options, got {shown!r}")
    if job == "train":
        if (metric := cfg.get("objective")) is not None:  # the metric a sweeper reads
            objective.check(str(metric), build(cfg.task), _part(cfg, "dataset").name,
                            cfg.get("eval_splits"))
        if (checker := method.hook("check_train")) is not None:
            # an option that only scores trained weights (the BNN's covariance: mixture)
            checker(dict(method.settings))
    if isinstance(cfg.get("logger"), DictConfig):
        build(cfg.logger)  # a tracker's settings are checked as it is built (cheap, offline)


def check_eval_splits(value: Any) -> None:
    """``eval_splits`` is null or a non-empty list of split names; the names are checked
    against the dataset once its data is set up (:func:`uqbench.runner.parts.build_parts`)."""
    if value is None:
        return
    names = list(value) if isinstance(value, ListConfig | list | tuple) else []
    if not names or not all(isinstance(n, str) and n for n in names):
        shown = list(value) if isinstance(value, ListConfig) else value
        raise ValueError(f"eval_splits must be null (every split the dataset declares) or a "
                         f"non-empty list of split names such as [val], got {shown!r}")


def stacked_seeds(given: Any, seed: Any) -> list[int] | None:
    """The seeds of ``stack_seeds``, checked (distinct integers, the job's ``seed`` one of
    them); None when the job trains its one ``seed``."""
    if given is None:
        return None
    if not isinstance(given, list | tuple | ListConfig) or not given:
        raise ValueError(f"stack_seeds must be a non-empty list of seeds, e.g. [0,1,2], or "
                         f"null; got {given!r}")
    bad = [s for s in given if isinstance(s, bool) or not isinstance(s, int)]
    if bad:
        raise ValueError(f"stack_seeds holds {bad[0]!r}, not an integer seed")
    seeds = [int(s) for s in given]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"stack_seeds {seeds} names a seed twice")
    if int(seed) not in seeds:
        raise ValueError(f"seed={seed} is not one of stack_seeds {seeds}: the job's log and "
                         f"Hydra folder are its seed's run folder; set seed={seeds[0]}")
    return seeds
