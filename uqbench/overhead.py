"""The parameter job (``job=params``): count a method's parameters on a backbone, no training.

The backbone is built from its config without weights (``pretrained`` forced off) on the
``meta`` device by default, so even LLaMA-2-7B with a 16-member Deep Ensemble costs no memory
and seconds of time. The method is built exactly as in training (same layer replacement, same
heads), so the counts are those of the real run. ``experiment=p1_overhead`` uses this job to
reproduce P1's parameter-overhead figures; see the README.

Options (top-level config key ``overhead``, all optional):
    device: meta (default) | cpu | cuda …  where to build the model.
    num_classes: 2 (default) — width of the heads (heads are reported apart from ``added``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from uqbench.configs import build
from uqbench.contracts import DataInfo
from uqbench.results import group_settings

log = logging.getLogger("uqbench")
DEFAULTS = {"device": "meta", "num_classes": 2}


def params_job(cfg: DictConfig) -> dict[str, Any]:
    """Build backbone + method without weights; return the results pieces.

    Returns ``{"params": method.param_counts(), "settings": {...}, "metrics": {}}``; params holds
    base, added, heads, total, trainable, overhead_pct and the memory in bytes (base_bytes,
    param_bytes, buffer_bytes, memory_bytes) at the dtypes the backbone config uses.
    """
    opts = DEFAULTS | dict(OmegaConf.to_container(cfg.get("overhead") or {}, resolve=True))
    num_classes = int(opts["num_classes"])
    if num_classes < 2:
        raise ValueError(f"overhead.num_classes must be >= 2, got {num_classes}")
    backbone_cfg = OmegaConf.to_container(cfg.backbone, resolve=True)
    if "pretrained" in backbone_cfg:
        backbone_cfg["pretrained"] = False  # the architecture only: never read weights here
    backbone = build(backbone_cfg)
    factory = build(cfg.method)
    method_task = getattr(getattr(factory, "func", factory), "task", None)
    if method_task != "classification":
        raise ValueError(f"job=params counts the classification ensembles; method "
                         f"'{cfg.method.name}' solves {method_task}")
    info = DataInfo(task="classification", num_classes=num_classes)
    with torch.device(str(opts["device"])):
        method = factory(backbone=backbone, info=info)
    params = method.param_counts()
    log.info("%s on %s: base %.2fM, added %.3fM (%.3f %%), memory %.2f GB", method.name,
             backbone.name, params["base"] / 1e6, params["added"] / 1e6, params["overhead_pct"],
             params["memory_bytes"] / 1e9)
    return {
        "params": params,
        "settings": {"method": group_settings(cfg.method) | method.settings(),
                     "backbone": {k: v for k, v in backbone_cfg.items() if not k.startswith("_")},
                     "overhead": opts},
        "metrics": {},
    }
