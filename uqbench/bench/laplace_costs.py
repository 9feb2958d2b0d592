"""Laplace-LoRA's evaluation against MAP LoRA's on the digits benchmark (`make bench`).

Both are built from their configs on the digits ViT (``digits_vit_random``: speed does not
depend on the weights) and the digits dataset, with the same LoRA weights (B drawn at random,
as a trained adapter's, so the Jacobians are not zero). Laplace-LoRA's posterior is fitted
first, untimed (the runner fits it before its evaluation timer starts); then each method's
predictions of every split a run scores (test, its corruptions at every severity, OOD and
val, in ``dataset.eval_batch_size`` batches: the task's ``predict``, as the runner's
evaluation calls it) are timed side by side, interleaved, on one CPU thread, and the figure
is their ratio per round against the target of :data:`TARGET`. The metrics the runner
computes from the predictions after them are left out: they take the same few tens of
milliseconds for both. The row's note also gives the ratio of the two methods' floating-point
operations in matrix products on one batch (PyTorch's ``FlopCounterMode``): the arithmetic
the exact linearised predictive needs, which a time ratio below it could only reach by running
faster per operation than MAP LoRA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from torch.utils.flop_counter import FlopCounterMode

from uqbench.bench.report import Record
from uqbench.bench.timing import one_thread, side_by_side
from uqbench.contracts import to_device
from uqbench.methods.laplace import MapLoRALinear

TARGET = 3.0  # Laplace-LoRA's evaluation at most 3× MAP LoRA's
ROUNDS = 5    # interleaved rounds: each one evaluation of each method
SECTION = "Laplace-LoRA: evaluation (digits ViT{threads})"


def build(method: str, device: torch.device, *overrides: str) -> tuple[Any, Any, Any]:
    """(method, data set up, task) for the digits benchmark, from the real configs."""
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=["backbone=digits_vit_random", "dataset=digits",
                                           f"method={method}", *overrides])
    torch.manual_seed(0)
    backbone = instantiate(cfg.backbone)
    data = instantiate(cfg.dataset)
    data.setup(backbone)
    model = instantiate(cfg.method)(backbone=backbone, info=data.info).to(device)
    return model, data, instantiate(cfg.task)


def flops(method: Any, data: Any, split: str, device: torch.device) -> int:
    """Floating-point operations of the matrix products (PyTorch's ``FlopCounterMode``) in
    ``method``'s predictions of the first batch of ``split``."""
    inputs, _ = next(iter(data.loader(split)))
    method.eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        method(to_device(inputs, device))
    return int(counter.get_total_flops())


def run(device: torch.device, rounds: int = ROUNDS, quick: bool = False,
        done: Callable[[list[Record]], None] = lambda rows: None) -> list[Record]:
    """The Laplace-LoRA / MAP LoRA evaluation row (``quick``: 8 images per split, a 3-point
    prior grid)."""
    small = ("dataset.max_per_split=8", "method.prior_grid=[-2,2,3]") if quick else ()
    laplace, data, task = build("laplace_lora", device, *small)
    map_lora, _, _ = build("map_lora", device, *small)
    with torch.no_grad():  # a trained adapter's B (B = 0 would make every Jacobian of A zero)
        g = torch.Generator().manual_seed(1)
        for layer in (m for m in laplace.modules() if isinstance(m, MapLoRALinear)):
            weight = layer.lora_B.weight
            weight.copy_(0.1 * torch.randn(weight.shape, generator=g).to(weight))
    map_lora.load_state_dict(laplace.state_dict())
    splits = list(dict.fromkeys([*data.eval_splits, *data.ood_splits, "val"]))

    def predictions(method: Any) -> Callable[[], dict[str, Any]]:
        return lambda: {s: task.predict(method, data.loader(s), device) for s in splits}
    with one_thread(device):
        posthoc = laplace.fit_posthoc(data, device)["laplace"]
        t = side_by_side({"laplace": predictions(laplace), "map": predictions(map_lora)},
                         device, repeats=rounds, warmup=1, rounds=rounds)
        products = flops(laplace, data, splits[0], device) / flops(map_lora, data, splits[0],
                                                                    device)
    batches = sum(len(data.loader(s)) for s in splits)
    examples = sum(len(y) for s in splits for _, y in data.loader(s))
    classes, samples = data.info.num_classes, laplace.samples
    threads = ", one thread" if device.type == "cpu" else ""
    row = Record(
        f"Laplace-LoRA evaluation / MAP LoRA evaluation (digits ViT, {len(splits)} "
        f"splits, {examples} images in {batches} batches of at most "
        f"{data.eval_batch_size}, {samples} draws)",
        t["laplace"] / t["map"], "×", str(device), target=TARGET,
        target_rule=f"{TARGET:g}× MAP LoRA's", section=SECTION.format(threads=threads),
        note=f"Laplace-LoRA {float(t['laplace']):.3g} s, MAP LoRA {float(t['map']):.3g} s "
             f"per evaluation (the predictions of every split, without the metrics); "
             f"the Jacobians take one forward and {classes} backward passes (one per class) of "
             f"each batch, then their rotation into the KFAC posterior's eigenbases: "
             f"{products:.1f}× MAP LoRA's floating-point operations in matrix products "
             f"(counted on one batch); the posterior fitted untimed "
             f"({posthoc['fit_s']:.3g} s)")
    done([row])
    return [row]
