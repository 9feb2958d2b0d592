"""Configs to objects, and what the config store offers.

``build(node)`` instantiates a config node the way the runner does; ``group_options(group)``
lists a config group's options for error messages.

Errors that tell a user which backbones, methods or datasets exist read them here, so they list
exactly what ``conf/`` holds (plus any folder added to Hydra's search path) and never go stale.
Imports nothing of uqbench but its error kinds (:mod:`uqbench.errors`) and what makes two runs
the same run (:mod:`uqbench.identity`).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from uqbench.errors import USER_ERRORS
from uqbench.identity import kept_apart_override, speed_options

# --- run identity: the run folder ------------------------------------------------------------
# What makes two runs the same run is defined in uqbench.identity; the folder's path shows it.


def _name_fields(root: DictConfig) -> set[str]:
    """Keys the method, backbone and dataset names interpolate (``bnn_${method.variance}``):
    their values are already in the run folder's path."""
    import re

    fields = set()
    for group in ("method", "backbone", "dataset"):
        node = root.get(group)
        name = node._get_node("name") if isinstance(node, DictConfig) and "name" in node else None
        if name is not None:
            raw = str(name._value())  # unresolved: bnn_${method.variance}
            fields |= set(re.findall(r"\$\{([\w.]+)\}", raw))
    return fields


def identity_overrides(overrides: list[str], root: DictConfig) -> list[str]:
    """The command-line (or sweep) overrides that change a run's result and that its path does
    not already show, sorted: each makes the run a different one."""
    shown = _name_fields(root)
    method = root.get("method")
    speed = speed_options({"method": {"_target_": method.get("_target_")}}
                          if isinstance(method, DictConfig) else {})
    keep = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if override.lstrip("+") in ("job=eval", "job=train"):
            # scoring names the run it scores (no folder of its own), and train is the default
            # job: `-m job=train,eval` trains the run that its scoring then finds
            continue
        # hydra/launcher=joblib → hydra.launcher
        if key in shown or key.endswith(".name") or kept_apart_override(key.replace("/", "."),
                                                                        speed):
            continue
        keep.append(override.lstrip("+"))
    return sorted(keep)


def _run_subdir(run_name: Any, experiment: Any, dataset: Any, method: Any, backbone: Any,
                seed: Any, *, _root_: DictConfig) -> str:
    """The run folder below paths.runs_dir: <run_name>, or
    <experiment>/<dataset>/<method>/<backbone>[/<overrides>]/seed<seed>, where <overrides> are
    the job's identity overrides (e.g. ``trainer.optimizer.lr=0.01``) joined by commas."""
    from hydra.core.hydra_config import HydraConfig

    if run_name not in (None, "", "None", "null"):
        return str(run_name)
    path = f"{experiment}/{dataset}/{method}/{backbone}"
    if HydraConfig.initialized():  # a job of the CLI, or a composed config given its Hydra node
        extra = identity_overrides(list(HydraConfig.get().overrides.task), _root_)
        if extra:
            path += "/" + ",".join(extra).replace("/", "_")
    return f"{path}/seed{seed}"


def _run_dir(runs_dir: Any, subdir: str) -> str:
    """<runs_dir>/<subdir>, refusing a runs folder that would put runs somewhere unintended."""
    import os
    from pathlib import Path

    text = "" if runs_dir is None else str(runs_dir).strip()
    if not text:
        raise ValueError("paths.runs_dir is empty (is UQBENCH_RUNS set to an empty string?); "
                         "runs would land at the filesystem root. Set UQBENCH_RUNS=<folder> or "
                         "paths.runs_dir=<folder>")
    root = Path(text).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"paths.runs_dir {root} is a file, not a folder; set UQBENCH_RUNS or "
                         f"paths.runs_dir to a folder")
    existing = next((p for p in [root, *root.absolute().parents] if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"paths.runs_dir {root}: {existing} is not writable; set "
                         f"UQBENCH_RUNS or paths.runs_dir to a folder you can write")
    return f"{text}/{subdir}"


# Registered on import: anything that composes uqbench's configs imports this module.
OmegaConf.register_new_resolver("uq.run_subdir", _run_subdir, replace=True)
OmegaConf.register_new_resolver("uq.run_dir", _run_dir, replace=True)


def build(node: DictConfig | dict[str, Any]) -> Any:
    """Hydra-instantiate a config node; a user error raised by the constructor is re-raised
    as itself (Hydra wraps it in an InstantiationException) so that it prints as one line."""
    try:
        return instantiate(node)
    except InstantiationException as err:
        if isinstance(err.__cause__, USER_ERRORS):
            raise err.__cause__ from None
        raise


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` (e.g. ``backbone``), sorted.

    From Hydra's config loader when a Hydra app is running (so user search paths count),
    otherwise from the configs packaged with uqbench.
    """
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))
    folder = resources.files("uqbench.conf") / group
    if not folder.is_dir():
        return []
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir()
                  if p.name.endswith(".yaml"))


def _packaged(group: str, name: str) -> dict[str, Any]:
    """The YAML of a packaged option as a dict, with the options of the same group it extends
    through ``defaults:`` merged under it (empty if it is not a packaged file)."""
    path = resources.files("uqbench.conf") / group / f"{name}.yaml"
    own = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    merged: dict[str, Any] = {}
    for parent in own.pop("defaults", None) or []:
        if isinstance(parent, str) and parent != "_self_":  # e.g. svf extends sve
            merged |= _packaged(group, parent)
    return merged | own


def options_with(group: str, key: str) -> list[str]:
    """The packaged options of ``group`` whose YAML sets ``key`` to a non-empty value.

    E.g. ``options_with("backbone", "targets")``: the backbones whose layers an adapter method
    can wrap.
    """
    return [name for name in group_options(group) if _packaged(group, name).get(key)]


def options_where(group: str, attribute: str, value: Any) -> list[str]:
    """The packaged options of ``group`` whose ``_target_`` class has ``attribute == value``.

    E.g. ``options_where("backbone", "modality", "text")``: the backbones that take text. The
    classes are imported, not built.
    """
    from hydra.utils import get_class

    found = []
    for name in group_options(group):
        target = _packaged(group, name).get("_target_")
        if target and getattr(get_class(target), attribute, None) == value:
            found.append(name)
    return found


def choices_text(group: str) -> str:
    """``"a, b, c"``: the options of a group, for a message."""
    return ", ".join(group_options(group)) or f"<no {group} configs found>"


# --- types: a config node must fit the constructor it builds ----------------------------------

def _hints(target: Any) -> dict[str, Any]:
    """Parameter annotations of a class's constructors (whole MRO: subclasses often pass
    ``**kwargs`` on) or of a function; {} when they cannot be read."""
    import inspect
    import typing

    owners = ([vars(c)["__init__"] for c in reversed(target.__mro__) if "__init__" in vars(c)]
              if inspect.isclass(target) else [target])
    hints: dict[str, Any] = {}
    for fn in owners:
        try:
            hints |= {k: v for k, v in typing.get_type_hints(fn).items() if k != "return"}
        except Exception:  # unresolvable annotations (a library's private types): no checks
            continue
    return hints


def _kinds(annotation: Any) -> set[str]:
    """The scalar kinds an annotation allows: int, float, bool, none, choice (a ``Literal``),
    other (not checked)."""
    import types
    import typing

    if annotation is type(None) or annotation is None:
        return {"none"}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(annotation)))
    if typing.get_origin(annotation) is typing.Literal:
        return {"choice"}
    import torch

    # a tensor-valued option (torch.optim's lr) takes a number from a config
    return {{bool: "bool", int: "int", float: "float", torch.Tensor: "float"}.get(annotation,
                                                                                 "other")}


def _choices(annotation: Any) -> tuple[Any, ...]:
    """The values of every ``Literal`` in an annotation (``Literal["a", "b"] | None`` → a, b)."""
    import types
    import typing

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(c for a in typing.get_args(annotation) for c in _choices(a))
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return ()


def check_value(key: str, value: Any, annotation: Any) -> None:
    """Refuse a value the annotation does not allow: a non-integer or a string where an int is
    meant, a string or a non-finite number where a number is meant, a value a ``Literal`` does
    not list (``method.masks='bits' is not one of: fast, torch``)."""
    import math

    kinds = _kinds(annotation)
    if value is None and "none" in kinds:
        return
    if kinds == {"choice"} or kinds == {"choice", "none"}:
        choices = _choices(annotation)
        if not any(value == c and type(value) is type(c) for c in choices):  # "1" is not 1
            listed = ", ".join(map(str, choices)) + (", null" if "none" in kinds else "")
            raise ValueError(f"{key}={value!r} is not one of: {listed}")
        return
    if "other" in kinds or "choice" in kinds:
        return
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kinds & {"int", "float"} and number and not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number, got {value}")
    if kinds == {"bool"} or kinds == {"bool", "none"}:
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    elif "float" in kinds:
        if not number:
            raise ValueError(f"{key} must be a number, got {value!r}")
    elif "int" in kinds and not (number and isinstance(value, int)):
        hint = f" (e.g. {int(value)})" if number and float(value).is_integer() else ""
        raise ValueError(f"{key} must be an integer{hint}, got {value!r}")


def _accepted(target: Any) -> set[str] | None:
    """The keyword arguments one of uqbench's classes takes: its constructor's, and where that
    passes ``**kwargs`` on, those of the next constructor up the MRO, until one takes no
    ``**kwargs``. None for another library's class, a function, or ``**kwargs`` that reach a
    constructor outside uqbench (their fields cannot be listed)."""
    import inspect

    if not inspect.isclass(target) or not target.__module__.startswith("uqbench."):
        return None
    accepted: set[str] = set()
    for owner in (c for c in target.__mro__ if "__init__" in vars(c)):
        if owner is object:  # **kwargs passed on to object.__init__ take nothing more
            return accepted
        if not owner.__module__.startswith("uqbench."):
            return None
        try:
            init = vars(owner)["__init__"]
            params = list(inspect.signature(init).parameters.values())[1:]  # no self
        except (TypeError, ValueError):
            return None
        accepted |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return accepted
    return None


def _unknown_field(target: Any, key: str, field: str, accepted: set[str]) -> ValueError:
    """The error for a field the constructor does not take, listing the fields it takes and
    naming the options of the group that have it."""
    group = key.split(".")[0]
    having = ([name for name in group_options(group) if field in _packaged(group, name)]
              if "." not in key else [])
    hint = (f"; the {group} options that have it: {', '.join(having)}" if having
            else "; remove it or check its spelling")
    return ValueError(f"{key}.{field} is not an option of {key} '{target.__name__}'{hint} "
                      f"(its options: {', '.join(sorted(accepted))})")


def check_types(node: DictConfig, key: str) -> None:
    """Check every field of a buildable node (and of nested buildable nodes, e.g. the
    optimiser) against the annotations of the constructor it names, before anything is built:
    a field the constructor does not take is refused, and a class may add its own cross-field
    checks (a classmethod ``check_settings(settings: dict)``, e.g. a member index below the
    ensemble's size)."""
    from hydra.utils import get_object

    target = node.get("_target_")
    if target is None:
        return
    obj = get_object(target)
    hints, accepted = _hints(obj), _accepted(obj)
    for field in node:
        if str(field).startswith("_"):
            continue
        if accepted is not None and field not in accepted:
            raise _unknown_field(obj, key, str(field), accepted)
        value = node[field]
        if isinstance(value, DictConfig):
            check_types(value, f"{key}.{field!s}")
        elif field in hints:
            check_value(f"{key}.{field!s}", value, hints[field])
    checker = getattr(obj, "check_settings", None)
    if callable(checker):
        checker(OmegaConf.to_container(node, resolve=True))
