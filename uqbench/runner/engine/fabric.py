"""Where the training loop runs: Lightning Fabric, set up from ``device=`` and the trainer's
engine settings (``conf/trainer/engine/default.yaml``).

Fabric keeps our own loop (:class:`uqbench.runner.engine.loop.Trainer`) and supplies what a loop
needs to
scale: precision plugins, DDP and FSDP, multi-node process groups, and cluster detection (SLURM,
torchrun). Two choices are ours:

- Processes that nobody else started are **spawned** for the job's function (not re-launched
  from the command line, as Fabric does by default): a re-launched ``uqbench … -m`` would start
  a whole sweep in every process. Under SLURM (one task per GPU) or torchrun the processes
  exist already and each runs the job.
- Everything about the device is checked here, before any data is read or any model is built.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from typing import Any, Literal

import torch

log = logging.getLogger("uqbench")

DEVICES = "auto, cpu, cuda, cuda:<index>, mps"


class EngineError(ValueError):
    """A device, precision or strategy that this machine cannot run."""


def resolve_device(name: str) -> tuple[torch.device, str | None]:
    """The torch device for ``device=`` and, where ``auto`` fell back to the CPU, why.

    auto picks CUDA, then MPS, then the CPU."""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise EngineError(f"device '{name}' is not one of uqbench's devices: {DEVICES}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), None
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps"), None
        return torch.device("cpu"), ("device=auto found no GPU (CUDA: not available, MPS: not "
                                     "available) and runs on the CPU")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise EngineError(f"device '{name}' was asked for but CUDA is not available; use "
                              f"device=cpu or device=auto")
        index = int(name.split(":")[1]) if ":" in name else None
        if index is not None and index >= torch.cuda.device_count():
            raise EngineError(f"device '{name}' does not exist: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s), cuda:0 … "
                              f"cuda:{torch.cuda.device_count() - 1}")
    return torch.device(name), None


def external_processes() -> bool:
    """True when a cluster manager started this job's processes itself (SLURM with one task
    per device, torchrun, LSF): each process then runs the whole job."""
    from lightning_fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment,
                                        LSFEnvironment))


def check(device: torch.device, trainer: Any) -> None:
    """Refuse a layout the device cannot run, naming what it can."""
    precision, strategy = trainer.precision, trainer.strategy
    if device.type == "cuda" and not external_processes():
        available = torch.cuda.device_count()
        if device.index is not None and trainer.devices > 1:
            raise EngineError(f"device={device} names one GPU but trainer.devices="
                              f"{trainer.devices}; use device=cuda (or auto) to run on "
                              f"{trainer.devices} GPUs")
        if trainer.devices > available:
            raise EngineError(f"trainer.devices={trainer.devices} but this machine has "
                              f"{available} CUDA device(s); set trainer.devices<={available}")
    if device.type == "cpu" and trainer.devices > 1 and not external_processes():
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        if trainer.devices > cores:
            raise EngineError(f"trainer.devices={trainer.devices} CPU processes but this "
                              f"machine has {cores} cores; set trainer.devices<={cores}")
    if device.type == "cuda" and precision.startswith("bf16") and \
            not torch.cuda.is_bf16_supported():
        raise EngineError(f"trainer.precision={precision}: {torch.cuda.get_device_name(device)} "
                          f"has no bfloat16; use 16-mixed or 32")
    if device.type == "cpu" and precision == "16-mixed":
        raise EngineError("trainer.precision=16-mixed needs a GPU (float16 autocast with a "
                          "gradient scaler); on the CPU use bf16-mixed, bf16-true or 32")
    if device.type == "mps" and (trainer.world_size > 1 or strategy != "auto"):
        raise EngineError(f"device=mps runs one process; trainer.devices={trainer.devices}, "
                          f"num_nodes={trainer.num_nodes}, strategy={strategy} need CUDA or "
                          f"the CPU")
    if strategy == "fsdp" and device.type != "cuda":
        raise EngineError(f"trainer.strategy=fsdp needs CUDA devices (device={device}); use "
                          f"strategy=ddp or auto on the {device.type}")
    if trainer.grad_clip is not None and strategy == "fsdp":
        raise EngineError("trainer.grad_clip clips each member's gradient on its own, which "
                          "needs whole parameters; under strategy=fsdp they are sharded. Set "
                          "trainer.grad_clip=null, or use strategy=ddp")


def fabric(device: torch.device, trainer: Any) -> Any:
    """A Fabric for ``device`` and the trainer's precision, strategy, devices and nodes."""
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    check(device, trainer)
    accelerator = {"cuda": "cuda", "cpu": "cpu", "mps": "mps"}[device.type]
    devices: Any = [device.index] if device.index is not None else trainer.devices
    # a config string: Fabric checks it (a value it cannot run raises below)
    precision: Any = "32-true" if trainer.precision == "32" else trainer.precision
    start: Literal["popen", "spawn"] = "popen" if external_processes() else "spawn"
    if trainer.world_size == 1 and trainer.strategy != "fsdp":
        strategy: Any = "auto"
    elif trainer.strategy == "fsdp":
        from uqbench.runner.engine.fsdp import SpawnableFSDP

        strategy = SpawnableFSDP(spawn=start == "spawn", use_orig_params=True,
                                 state_dict_type="full")
    else:
        strategy = DDPStrategy(start_method=start,
                               process_group_backend="gloo" if accelerator == "cpu" else None)
    try:
        return Fabric(accelerator=accelerator, strategy=strategy, devices=devices,
                      num_nodes=trainer.num_nodes, precision=precision)
    except (ValueError, RuntimeError, TypeError) as err:
        raise EngineError(f"the engine cannot run trainer.precision={trainer.precision}, "
                          f"strategy={trainer.strategy}, devices={trainer.devices}, num_nodes="
                          f"{trainer.num_nodes} on {device}: {err}") from err


def rank() -> int:
    """This process's global rank before Fabric exists (0 unless a cluster started it)."""
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if key in os.environ and external_processes():
            return int(os.environ[key])
    return 0


class StopRequest:
    """``with StopRequest() as stop:`` — SIGTERM (SLURM preemption) and SIGUSR2 (submitit's
    timeout and preemption signal) no longer kill the process; ``stop()`` tells the loop that
    one came, so that it writes a checkpoint at the next step and ends. The previous handlers
    come back on exit; :func:`hand_on` then gives the signal to them (submitit requeues the
    job) or ends the process as the signal would have. With ``forward=True`` (a process that
    spawned the training processes) the signal is passed on to the children."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self, forward: bool = False) -> None:
        self.forward = forward
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        log.warning("received %s: stopping at the next step with a checkpoint",
                    signal.Signals(signum).name)
        if self.forward:
            import multiprocessing

            for child in multiprocessing.active_children():
                if child.pid is not None:  # None only before it starts
                    os.kill(child.pid, signum)

    def __call__(self) -> bool:
        return self.signum is not None

    def __exit__(self, *exc: Any) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


def hand_on(signum: int | None) -> int:
    """After a stop on ``signum``: let the handler installed before ours act on it (submitit
    requeues the job and exits), else return the exit status the signal would have given."""
    if signum is not None and callable(signal.getsignal(signum)):
        os.kill(os.getpid(), signum)
    return 128 + (signum or signal.SIGTERM)


# --- state that FSDP shards ----------------------------------------------------------------------
# Under FSDP each process holds a shard of every parameter and of the optimiser state, so the
# trained parameters are gathered (a collective: every process calls these) into full tensors
# on the CPU with torch.distributed.checkpoint's state-dict API; elsewhere they are the method's
# own tensors. These paths need CUDA devices and are not exercised by the CPU test suite.

def sharded(fabric: Any) -> bool:
    from lightning_fabric.strategies import FSDPStrategy

    return isinstance(fabric.strategy, FSDPStrategy)


def _clean(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def trainable_state(fabric: Any, model: Any, method: Any) -> dict[str, torch.Tensor]:
    """A copy of the trained parameters (whole tensors; under FSDP on rank 0, {} elsewhere)."""
    if not sharded(fabric):
        return method.trainable_state()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model._forward_module, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    names = {_clean(n) for n in method.trainable_parameters()}
    return {n: t for n, t in full.items()
            if _clean(n) in names and isinstance(t, torch.Tensor)}  # parameters: all tensors


def load_trainable_state(fabric: Any, model: Any, method: Any,
                         state: dict[str, torch.Tensor]) -> None:
    if not sharded(fabric):
        method.load_trainable_state(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        ValueType,
        set_model_state_dict,
    )

    full: dict[str, ValueType] = dict(state)
    set_model_state_dict(model._forward_module, full, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=False))


def optimizer_state(fabric: Any, model: Any, optimizer: Any) -> dict[str, Any]:
    if not sharded(fabric):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(model._forward_module, optimizer.optimizer,
                                    options=StateDictOptions(full_state_dict=True,
                                                             cpu_offload=True))


def load_optimizer_state(fabric: Any, model: Any, optimizer: Any, state: dict) -> None:
    if not sharded(fabric):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(model._forward_module, optimizer.optimizer, state,
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
