"""What every job of the runner builds from its spec (:mod:`uqbench.runner.spec`): the seeds,
the environment and the recipe entries a run records, and the method, data, task and backbone,
checked against each other (and the splits it scores against the data) before anything
expensive is read or built.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from uqbench.configs import options_where
from uqbench.contracts import to_device
from uqbench.methods.base import Method
from uqbench.runner.engine.evaluation import Splits, chosen_splits
from uqbench.runner.spec import RunSpec, value_at

DIAGNOSTIC_INPUTS = 256  # test inputs handed to Method.diagnostics


def environment() -> dict[str, Any]:
    """What decides whether a run is bit-reproducible: thread count and library versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {"torch_threads": torch.get_num_threads(),
                           "python": platform.python_version(), "machine": platform.machine()}
    for package in ("uqbench", "torch", "numpy", "timm", "transformers", "scikit-learn"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    env["cuda"] = torch.version.cuda if torch.cuda.is_available() else None
    return env


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_and_threads(spec: RunSpec) -> None:
    """A job's process as its spec asks, before anything is built: the seeds, then the
    thread count where ``torch_threads`` sets one (the same float reductions as the run)."""
    seed_everything(spec.seed)
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


def check_tasks_agree(spec: RunSpec, method_factory: Any, data: Any, task: Any) -> None:
    """The dataset, the task scoring it and the method must all mean the same problem."""
    if task.name != data.task:
        raise ValueError(
            f"dataset '{spec.dataset.name}' is a {data.task} dataset but task={task.name} was "
            f"chosen; drop the task override (each dataset selects its own task)")
    method_task = getattr(getattr(method_factory, "func", method_factory), "task", None)
    if method_task is not None and method_task != data.task:
        raise ValueError(
            f"method '{spec.method.name}' solves {method_task} but dataset '{spec.dataset.name}' "
            f"is a {data.task} task; pick a {data.task} method (one of: "
            f"{', '.join(options_where('method', 'task', data.task))}) or another dataset")



def build_parts(spec: RunSpec, device: torch.device, activation_checkpointing: bool = False
                ) -> tuple[Any, Any, Any, Any, Splits]:
    """Method, data, task and backbone of ``spec`` on ``device``, and the splits the run scores
    (``eval_splits``): cheap things first, checked against each other before anything expensive
    is read or built (a split name the data lacks fails before any model is built)."""
    method_factory = spec.method.build()
    data = spec.dataset.build()
    task = spec.task.build()
    check_tasks_agree(spec, method_factory, data, task)
    data.check()  # missing or partial data fails here, before any model is built
    backbone = spec.backbone.build()
    data.setup(backbone)
    splits = chosen_splits(data, spec.eval_splits)
    backbone.device = device  # methods decompose and copy pretrained weights where they run
    if activation_checkpointing and not backbone.supports_activation_checkpointing:
        backbone.enable_activation_checkpointing(None)  # refuses, naming the backbones that can
    method = method_factory(backbone=backbone, info=data.info).to(device)
    if activation_checkpointing:
        backbone.enable_activation_checkpointing(method)
    return method, data, task, backbone, splits


def first_inputs(loader: Any, n: int) -> Any:
    """The inputs of a loader's first batches, up to ``n`` rows: a tensor (n, …), or, for
    inputs that are not one tensor (a dict of token tensors), the first batch's as they are."""
    parts, rows = [], 0
    for inputs, _ in loader:
        if not isinstance(inputs, torch.Tensor):
            return inputs
        parts.append(inputs)
        rows += len(inputs)
        if rows >= n:
            break
    return torch.cat(parts)[:n]


def method_diagnostics(method: Method, data: Any, device: torch.device,
                       split: str = "test", scored: Sequence[str] | None = None
                       ) -> dict[str, float]:
    """The method's own diagnostics (:meth:`Method.diagnostics`) on the first
    DIAGNOSTIC_INPUTS inputs of ``split``, as ``<split>/<name>``; {} without reading any data
    for a method that has none, or when the run does not score that split (``scored``: the
    eval splits it scores; None: all the data declares)."""
    scored = data.eval_splits if scored is None else scored
    if type(method).diagnostics is Method.diagnostics or split not in scored:
        return {}
    # a loader's iterator draws its base seed from the CPU generator: keep the run's stream
    with torch.random.fork_rng(devices=[]):
        inputs = first_inputs(data.loader(split), DIAGNOSTIC_INPUTS)
    found = method.diagnostics(to_device(inputs, device))
    return {f"{split}/{name}": value for name, value in found.items()}


def recipes_used(config: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """The recipe entries a run used, for results.json's ``recipe`` (no part of its identity):
    for each lookup table that is a recipe file (``provenance`` and ``choices``, as
    ``uqbench-select --write`` makes them), the entry of the run's group (the values at the
    recipe's ``provenance.group_by`` paths of ``results``), when the run's settings hold every
    value chosen there: the recipe's file, the group, the chosen values and the keys chosen
    at the edge of their grid (tables mark those rows). A run that set its own value did not
    use the entry."""
    used: dict[str, Any] = {}
    for name, table in (config.get("lookup") or {}).items():
        if not (isinstance(table, dict) and isinstance(table.get("provenance"), dict)
                and isinstance(table.get("choices"), dict)):
            continue
        provenance = table["provenance"]
        group = [str(value_at(results, key)) for key in provenance.get("group_by") or []]
        chosen = value_at(table["choices"], group)
        keys = provenance.get("keys") or {}
        if not isinstance(chosen, dict) or not chosen or any(
                value_at(results, ["settings", *str(keys.get(k, k)).split(".")]) != v
                for k, v in chosen.items()):
            continue
        details = value_at(table.get("groups") or {}, group)
        edge = details.get("edge") if isinstance(details, dict) else None
        used[name] = {"file": provenance.get("file"), "group": group, "choices": chosen,
                      "edge": list(edge or [])}
    return used
