"""One training loop for every method: the method supplies the loss, the task the validation."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm.auto import tqdm

from uqbench.data.base import DataModule
from uqbench.loggers import Logger
from uqbench.methods.base import Method
from uqbench.tasks.base import Task, to_device

SCHEDULES = ("constant", "cosine")
SELECTIONS = ("last", "best")


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; no results are written."""


def check_trainer(cfg: DictConfig) -> None:
    """Validate the trainer config before any expensive work."""
    if int(cfg.epochs) < 0:
        raise ValueError(f"trainer.epochs must be >= 0, got {cfg.epochs}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"trainer.schedule '{cfg.schedule}' is not one of {SCHEDULES}")
    if cfg.select not in SELECTIONS:
        raise ValueError(f"trainer.select '{cfg.select}' is not one of {SELECTIONS}")
    if cfg.grad_clip is not None and cfg.grad_clip <= 0:
        raise ValueError(f"trainer.grad_clip must be > 0 or null, got {cfg.grad_clip}")
    if cfg.get("warmup_steps") is not None and int(cfg.warmup_steps) < 0:
        raise ValueError(f"trainer.warmup_steps must be >= 0 or null, got {cfg.warmup_steps}")


def lr_factor(step: int, total: int, warmup: int, schedule: str) -> float:
    """Linear warm-up over ``warmup`` steps, then constant or cosine decay to 0."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def fit(method: Method, data: DataModule, task: Task, cfg: DictConfig, device: torch.device,
        logger: Logger) -> dict[str, Any]:
    """Train ``method`` for ``cfg.epochs``; return timing and model-selection facts."""
    params = [p for p in method.parameters() if p.requires_grad]
    if not params and cfg.epochs > 0:
        raise ValueError(f"method '{method.name}' has no trainable parameters")
    start = time.perf_counter()
    epochs = int(cfg.epochs)
    if epochs == 0:
        return {"epochs": 0, "train_s": 0.0, "selected_epoch": 0}
    optimizer = instantiate(cfg.optimizer)(params=params)
    loader = data.loader("train", train=True)
    total = epochs * len(loader)
    # warm-up in optimiser steps when given (LoRA-Ensemble's recipe), else in epochs
    steps = cfg.get("warmup_steps")
    warmup = int(steps) if steps is not None else int(cfg.warmup_epochs) * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, warmup, cfg.schedule))
    best = {"loss": math.inf, "epoch": epochs, "state": None}
    bar = tqdm(range(1, epochs + 1), desc=f"train {method.name}", disable=not cfg.progress,
               dynamic_ncols=True, leave=False)
    for epoch in bar:
        method.train()
        running, n = 0.0, 0
        for step, batch in enumerate(loader):
            batch = to_device(batch, device)
            loss = method.loss(batch)
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"the training loss became {loss.item()} at epoch {epoch}, step {step} "
                    f"(lr {scheduler.get_last_lr()[0]:.3g}); lower trainer.optimizer.lr, set "
                    f"trainer.grad_clip, or check the data. No results were written.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            running += loss.item()
            n += 1
        log = {"train/loss": running / n, "epoch": epoch, "lr": scheduler.get_last_lr()[0]}
        if data.has_val and (epoch % int(cfg.val_every) == 0 or epoch == epochs):
            preds = task.predict(method, data.loader("val"), device)
            val = task.metrics("val", preds)
            log.update(val)
            val_loss = task.val_loss(preds)
            if cfg.select == "best" and val_loss < best["loss"]:
                best = {"loss": val_loss, "epoch": epoch, "state": method.trainable_state()}
        logger.log_metrics(log, step=epoch)
        bar.set_postfix(loss=f"{log['train/loss']:.4g}")
    if best["state"] is not None:
        method.load_trainable_state(best["state"])
    return {"epochs": epochs, "train_s": time.perf_counter() - start,
            "selected_epoch": best["epoch"]}
