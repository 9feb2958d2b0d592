"""The parameter job (``job=params``): count a method's parameters on a backbone, no training.

The backbone is built from its config without weights (``pretrained`` forced off) on the
``meta`` device by default, so even LLaMA-2-7B with a 16-member Deep Ensemble costs no memory
and seconds of time. The method is built exactly as in training (same layer replacement, same
heads), so the counts are those of the real run. ``experiment=p1_overhead`` uses this job to
reproduce P1's parameter-overhead figures; see the README.

The job also estimates the training memory per device (``memory`` in results.json,
:mod:`uqbench.runner.engine.memory`) for the trainer's engine settings (``trainer.precision``,
``strategy``,
``devices`` × ``num_nodes``, ``accumulate``, ``activation_checkpointing``), its optimiser and
batch (``trainer.batch_size``, else ``dataset.batch_size``; no estimate without either), with
the tokens per example the backbone implies (a text dataset's ``max_length`` replaces the
backbone's).

Options (top-level config key ``overhead``, all optional):
    device: meta (default) | cpu | cuda …  where to build the model.
    num_classes: 2 (default) — width of the heads (heads are reported apart from ``added``).
    layouts: {name: {engine setting: value}} — more engine layouts to estimate the memory for,
        each the trainer's settings with these replaced (``memory.layouts.<name>``), e.g.
        ``{fsdp8: {strategy: fsdp, devices: 8}}``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from uqbench.configs import build
from uqbench.contracts import DataInfo
from uqbench.runner.engine.memory import Engine, estimate, optimizer_states
from uqbench.runner.parts import seed_everything
from uqbench.runner.spec import RunSpec

log = logging.getLogger("uqbench")
DEFAULTS: dict[str, Any] = {"device": "meta", "num_classes": 2, "layouts": {}}
ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(Engine))


def params_job(spec: RunSpec) -> dict[str, Any]:
    """Build backbone + method without weights; return the results pieces.

    Returns ``{"params": method.param_counts(), "settings": {...}, "metrics": {}}``; params holds
    base, added, heads, total, trainable, overhead_pct and the memory in bytes (base_bytes,
    param_bytes, buffer_bytes, memory_bytes) at the dtypes the backbone config uses; SVE adds
    targeted_bytes, the memory of its wrapped layers (full rank or top-k, ``method.rank``).
    """
    opts = DEFAULTS | dict(spec.overhead or {})  # a mapping: the spec checked it
    num_classes = int(opts["num_classes"])
    if num_classes < 2:
        raise ValueError(f"overhead.num_classes must be >= 2, got {num_classes}")
    backbone_cfg = dict(spec.backbone.fields)
    if "pretrained" in backbone_cfg:
        backbone_cfg["pretrained"] = False  # the architecture only: never read weights here
    backbone = build(backbone_cfg)
    factory = spec.method.build()
    method_task = getattr(getattr(factory, "func", factory), "task", None)
    if method_task != "classification":
        raise ValueError(f"job=params counts the classification ensembles; method "
                         f"'{spec.method.name}' solves {method_task}")
    info = DataInfo(task="classification", num_classes=num_classes)
    with torch.device(str(opts["device"])):
        method = factory(backbone=backbone, info=info)
    params = method.param_counts()
    log.info("%s on %s: base %.2fM, added %.3fM (%.3f %%), memory %.2f GB", method.name,
             backbone.name, params["base"] / 1e6, params["added"] / 1e6, params["overhead_pct"],
             params["memory_bytes"] / 1e9)
    memory = training_memory(spec, method, backbone, opts["layouts"])
    return {
        "params": params,
        "memory": memory,
        "settings": {"method": dict(spec.method.settings) | method.settings(),
                     "backbone": {k: v for k, v in backbone_cfg.items() if not k.startswith("_")},
                     "overhead": opts},
        "metrics": {},
    }


def engine_of(trainer: Mapping[str, Any], replace: dict[str, Any] | None = None) -> Engine:
    """The trainer's engine settings (defaults where a recipe lacks one), ``replace`` applied."""
    settings: dict[str, Any] = {k: trainer.get(k) for k in ENGINE_KEYS
                                if trainer.get(k) is not None}
    settings |= dict(replace or {})
    unknown = sorted(set(settings) - set(ENGINE_KEYS))
    if unknown:
        raise ValueError(f"overhead.layouts: {unknown} are not engine settings; use "
                         f"{', '.join(ENGINE_KEYS)}")
    if isinstance(settings.get("devices"), list | tuple):  # device ids: their number counts
        settings["devices"] = len(settings["devices"])
    for key in ("devices", "num_nodes", "accumulate"):
        if key in settings and not isinstance(settings[key], int):
            raise ValueError(f"trainer.{key} must be an integer for the memory estimate, got "
                             f"{settings[key]!r}")
    return Engine(**{**settings, "precision": str(settings.get("precision", "32"))})


def training_memory(spec: RunSpec, method: Any, backbone: Any,
                    layouts: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The per-device training-memory estimate (:func:`uqbench.runner.engine.memory.estimate`)
    for the trainer's engine settings, with ``layouts`` (name → engine settings replaced) under
    ``layouts``; None without a batch size."""
    trainer, dataset = spec.trainer.settings, spec.dataset.settings
    batch = trainer.get("batch_size") or dataset.get("batch_size")
    if batch is None:
        log.warning("job=params: no trainer.batch_size or dataset.batch_size, so no training "
                    "memory estimate (set trainer.batch_size=<n>)")
        return None
    optimizer = trainer.get("optimizer") or {}
    name = str(optimizer.get("_target_", "torch.optim.Adam")).split(".")[-1]  # default recipe
    states = optimizer_states(name, float(optimizer.get("momentum", 0) or 0))
    dims = backbone.transformer_dims()
    if dims is not None and dataset.get("max_length"):
        dims = dataclasses.replace(dims, tokens=int(dataset["max_length"]))
    trained = list(method.trainable_parameters().values())
    ids = {id(p) for p in trained}
    frozen = [p for p in method.parameters() if id(p) not in ids]
    # bytes per pretrained weight: a float32 encoder computes in 32 bit under precision 32
    base_width = getattr(method, "base_bytes", 4) / max(1, getattr(method, "base_params", 1))

    def one(engine: Engine) -> dict[str, Any]:
        wide = engine.precision == "32" and base_width >= 4
        return estimate(frozen=frozen, trained=trained, buffers=list(method.buffers()),
                        engine=engine, states=states, batch_size=int(batch),
                        passes=method.training_passes(), dims=dims,
                        wrapper_values=lambda rows: sum(
                            m.saved_values(rows) for m in method.modules()
                            if callable(getattr(m, "saved_values", None))),
                        value_bytes=4 if wide else 2)

    memory = one(engine_of(trainer))
    memory["optimizer"] = name
    memory["layouts"] = {name: one(engine_of(trainer, dict(replace)))
                         for name, replace in layouts.items()}
    log.info("training memory per device (%s, %s × %d, batch %d): %.2f GB", memory["precision"],
             memory["strategy"], memory["world_size"], memory["batch_size"],
             memory["gb"]["total"])
    return memory


def params_run(spec: RunSpec) -> dict[str, Any]:
    """``job=params``: count the parameters of one configuration, no data, no training, and
    publish them as its run folder (reused like any finished run); return the results dict
    (also written to disk)."""
    from uqbench.records.runfolder import RunFolder
    from uqbench.runner.engine.fabric import rank
    from uqbench.runner.jobs.train import _labels as labels
    from uqbench.runner.jobs.train import publish_run, reuse

    with RunFolder(spec.run_dir, writer=rank() == 0) as folder:
        if (existing := reuse(spec, folder)) is not None:
            return existing
        seed_everything(spec.seed)
        results = {**spec.header(), "job": "params", **params_job(spec),
                   "table": spec.config.get("table")}
        logger = spec.logger.build()
        logger.start(folder.run_dir, labels(spec, "params"), dict(spec.config))
        try:
            publish_run(spec, folder, results, {}, logger=logger)
        finally:
            logger.finish(failed=True)  # a no-op after log_results closed it
        return results
