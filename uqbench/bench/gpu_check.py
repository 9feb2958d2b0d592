"""`make gpu-check`: the GPU paths, run once on a GPU, each check one PASS, FAIL or SKIP line.

``python -m uqbench.bench.gpu_check [--cpu] [--out [FILE]]`` runs, on fake data in a temporary
folder:

1. every classification method, a few steps of P1's recipe and its scoring, on a ViT-S/16 and
   a BERT-base with random weights (GPU) or the tiny ViT and BERT (CPU), under precision 32,
   bf16-mixed and bf16-true (GPU) or 32 and bf16-true (CPU): finite losses and metrics,
   results.json written (:mod:`.gpu_runs`);
2. DDP and FSDP with ``trainer.devices=1`` (GPU), a run stopped by SIGTERM and resumed to the
   metrics of an uninterrupted one, and ``job=eval`` of the result (:mod:`.gpu_runs`);
3. SVE's evaluation cache of the member weights and its free-memory rule (GPU): the same
   outputs with and without the cache, and the layers that do not fit a quarter of the free
   memory left uncached;
4. the BNN's fused and compiled moment passes against the reference layers (CPU, and CUDA);
5. MC-Dropout's fast masks and ``nn.Dropout``: the keep rate within 4 binomial standard errors
   of 1 − p on the device, in float32 and bfloat16;
6. (GPU) how to run ``make bench`` there.

The command checks, it does not benchmark: a GPU run takes a few minutes, the CPU subset
(``--cpu``, or no CUDA device) about a minute. It prints a summary and exits with status 1 if
any check failed; ``--out`` also writes the report as JSON (``tables/gpu_check.json`` when
given no file).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from uqbench.bench.gpu_runs import BACKBONES, layouts, method_matrix, resume
from uqbench.bench.gpu_sweep import Context, Outcome, OutOfTime

PRECISIONS = {"cuda": ["32", "bf16-mixed", "bf16-true"], "cpu": ["32", "bf16-true"]}
DEFAULT_OUT = Path("tables/gpu_check.json")
_print_lock = threading.Lock()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m uqbench.bench.gpu_check",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="the CPU subset even where CUDA exists")
    p.add_argument("--out", type=Path, nargs="?", const=DEFAULT_OUT, default=None,
                   help=f"write the JSON report (no file given: {DEFAULT_OUT})")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: every "
                   "classification method)")
    p.add_argument("--precisions", default=None, help="comma-separated trainer.precision "
                   "values (default: 32,bf16-mixed,bf16-true on a GPU; 32,bf16-true on a CPU)")
    p.add_argument("--jobs", type=int, default=None, help="uqbench processes at once "
                   "(default: 6 on a GPU, 2 on a CPU)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting checks after "
                   "this many seconds (default: 480 on a GPU, 600 on a CPU)")
    return p.parse_args(argv)


def show(outcome: Outcome) -> Outcome:
    with _print_lock:
        print(outcome.line(), flush=True)
    return outcome


def guarded(name: str, check: Callable[[], list[Outcome]]) -> list[Outcome]:
    """A check's outcomes, or one FAIL naming the error it raised (or the spent budget)."""
    start = time.monotonic()
    try:
        outcomes = check()
    except OutOfTime as err:
        outcomes = [Outcome(name, "FAIL", str(err))]
    except Exception as err:  # a check that breaks is a failed check, never a crash
        outcomes = [Outcome(name, "FAIL", f"{type(err).__name__}: {err}"[:600])]
    for outcome in outcomes:
        outcome.seconds = outcome.seconds or time.monotonic() - start
        show(outcome)
    return outcomes


# --- 3. SVE's cache of the member weights ---------------------------------------------------------

def sve_cache(ctx: Context) -> list[Outcome]:
    """On CUDA: SVE on ViT-S/16 (M = 4, random weights), evaluated with its weight cache off and
    on (materialised forward, float32 and bfloat16): identical outputs, every layer cached; then
    with the free memory reported as 4× the attention's qkv cache: exactly the layers whose M
    member weights fit a quarter of it cache, the outputs are still identical. Auto forward:
    equal to rounding."""
    name = "sve/weight_cache"
    if not ctx.gpu:
        return [Outcome(name, "SKIP", "the free-memory rule reads CUDA's free memory; on the "
                                      "CPU every layer caches (the tests cover that)")]
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    import uqbench.configs  # noqa: F401  (registers the config resolvers)
    from uqbench.contracts import DataInfo

    with initialize_config_module("uqbench.conf", version_base="1.3"):
        c = compose("config", overrides=["backbone=vits16_random", "method=sve"])
    torch.manual_seed(0)
    method = instantiate(c.method)(backbone=instantiate(c.backbone),
                                   info=DataInfo(task="classification", num_classes=10))
    method = method.to(ctx.device).eval()
    layers = method.layers()
    numbers: dict[str, Any] = {"layers": len(layers)}
    problems = []

    def forward(x: torch.Tensor, cache: bool, mode: str) -> torch.Tensor:
        for layer in layers:
            layer.cache_weights, layer.forward_mode, layer._cached = cache, mode, None
        with torch.no_grad():
            method(x)  # the first call builds the cache, the second one reads it
            return method(x)

    def need(layer: Any, dtype: torch.dtype) -> int:
        return layer.members * layer.out_features * layer.in_features * dtype.itemsize

    for dtype in (torch.float32, torch.bfloat16):
        method.to(dtype)
        x = torch.randn(8, 3, 224, 224, device=ctx.device, dtype=dtype)
        plain, cached = forward(x, False, "materialized"), forward(x, True, "materialized")
        n_cached = sum(layer._cached is not None for layer in layers)
        if not torch.equal(plain, cached) or n_cached != len(layers):
            problems.append(f"{dtype}: cache on/off equal {torch.equal(plain, cached)}, "
                            f"{n_cached} of {len(layers)} layers cached")
        qkv = next(layer for layer in layers if layer.out_features == 3 * layer.in_features)
        free = 4 * need(qkv, dtype)
        fits = {id(layer) for layer in layers if need(layer, dtype) <= free // 4}
        reported = (free, torch.cuda.mem_get_info(x.device)[1])
        with mock.patch.object(torch.cuda, "mem_get_info", return_value=reported):
            tight = forward(x, True, "materialized")
        held = {id(layer) for layer in layers if layer._cached is not None}
        if held != fits or not torch.equal(plain, tight) or len(fits) in (0, len(layers)):
            problems.append(f"{dtype} with {free} B free: {len(held)} layers cached, the rule "
                            f"allows {len(fits)}; outputs equal {torch.equal(plain, tight)}")
        auto = (forward(x, False, "auto").float() - forward(x, True, "auto").float()).abs().max()
        if not auto <= (1e-4 if dtype == torch.float32 else 3e-2) * plain.abs().max().float():
            problems.append(f"{dtype} auto forward: cache on/off differ by {float(auto):.3g}")
        numbers[str(dtype)] = {"cached_layers": n_cached, "fit_at_tight_free": len(fits),
                               "cached_at_tight_free": len(held), "auto_max_diff": float(auto)}
    detail = "; ".join(problems) or (
        f"{len(layers)} layers: identical outputs with and without the cache in float32 and "
        f"bfloat16; with free memory 4× the qkv cache, "
        f"{numbers['torch.float32']['cached_at_tight_free']} of {len(layers)} layers cached "
        f"as the ≤ 1/4 rule says, outputs still identical")
    return [Outcome(name, "FAIL" if problems else "PASS", detail, numbers)]


# --- 4. the BNN's moment passes -------------------------------------------------------------------

def moments(device: str) -> list[Outcome]:
    """The fused pass (moments, loss and every gradient) and the compiled pass (inference)
    against the reference layers, float32, inputs up to ±30 (deep in the tails)."""
    from uqbench.backbones.mlp import MLP
    from uqbench.contracts import DataInfo
    from uqbench.methods.bnn import BayesianMLP

    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    models = {"fused": BayesianMLP(MLP(width=16, depth=2), info, variance="learned"),
              "reference": BayesianMLP(MLP(width=16, depth=2), info, variance="learned",
                                       fused=False),
              "compiled": BayesianMLP(MLP(width=16, depth=2), info, variance="learned",
                                      compile=True)}
    for model in models.values():
        model.load_state_dict(models["fused"].state_dict())
        model.to(device)
    x = torch.linspace(-30, 30, 4096 if device == "cuda" else 256, device=device)[:, None]
    y = torch.sin(x)
    outs = {}
    for kind in ("fused", "reference"):
        xg = x.clone().requires_grad_()
        mean, var = models[kind].moment_pass(xg)
        loss = models[kind].loss((xg, y))
        grads = torch.autograd.grad(loss, (xg, *models[kind].parameters()))
        outs[kind] = (mean, var, loss, *grads)
    fused_diff = max(_rel(a, b) for a, b in zip(outs["fused"], outs["reference"], strict=True))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    start = time.monotonic()
    with torch.no_grad():
        compiled = models["compiled"].moment_pass(x)
        reference = models["reference"].moment_pass(x)
    compile_s = time.monotonic() - start
    compiled_diff = max(_rel(a, b) for a, b in zip(compiled, reference, strict=True))
    ran = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    return [
        Outcome(f"moments/fused[{device}]", "PASS" if fused_diff <= 2e-4 else "FAIL",
                f"moments, loss and {len(outs['fused']) - 3} gradients vs the reference "
                f"layers: max diff {fused_diff:.2g} of scale (≤ 2e-4)", {"max_diff": fused_diff}),
        Outcome(f"moments/compiled[{device}]",
                "PASS" if compiled_diff <= 2e-5 and ran else "FAIL",
                f"torch.compile of the fused pass vs the reference: max diff "
                f"{compiled_diff:.2g} of scale (≤ 2e-5), graph compiled: {ran}, "
                f"{compile_s:.1f} s with compilation",
                {"max_diff": compiled_diff, "compiled": ran, "compile_s": compile_s})]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over (1 + max |b|): the tests' absolute-and-relative tolerance in one."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / (1 + b.abs().max()))


# --- 5. MC-Dropout's masks ------------------------------------------------------------------------

def dropout_rate(device: str) -> list[Outcome]:
    """Keep rates of FastDropout (``masks: fast``) and nn.Dropout in training mode over 2²²
    elements, p = 0.1 and 0.5, float32 and bfloat16: each within 4 binomial standard errors of
    its expected rate (fast: 1 − the quantised p), the two within 4 standard errors of their
    difference (plus the quantisation), and the fast kept values scaled by 65536/k exactly."""
    from torch import nn

    from uqbench.methods.dropout import LEVELS, FastDropout, kept_levels, quantised_rate

    torch.manual_seed(0)
    n, problems, numbers = 1 << 22, [], {}
    for p in (0.1, 0.5):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(n, device=device, dtype=dtype)
            with torch.no_grad():
                fast = FastDropout(p).train()(x)
                plain = nn.Dropout(p).train()(x)
            kept_fast = float((fast != 0).double().mean())
            kept_plain = float((plain != 0).double().mean())
            se = math.sqrt(p * (1 - p) / n)
            q = 1 - quantised_rate(p)
            scale = torch.tensor(LEVELS / kept_levels(p), dtype=dtype)
            scaled = bool((fast[fast != 0].cpu() == scale).all())
            key = f"p={p},{str(dtype).removeprefix('torch.')}"
            numbers[key] = {"fast": kept_fast, "torch": kept_plain, "se": se}
            if abs(kept_fast - q) > 4 * se or abs(kept_plain - (1 - p)) > 4 * se or \
                    abs(kept_fast - kept_plain) > 4 * math.sqrt(2) * se + abs(q - (1 - p)):
                problems.append(f"{key}: keep rate fast {kept_fast:.5f}, nn.Dropout "
                                f"{kept_plain:.5f}, expected {1 - p} (4 SE = {4 * se:.1e})")
            if not scaled:
                problems.append(f"{key}: fast kept values are not 65536/k = {float(scale)}")
    worst = max(abs(v["fast"] - v["torch"]) / v["se"] for v in numbers.values())
    detail = "; ".join(problems) or (
        f"keep rates at p = 0.1, 0.5 (float32, bfloat16, 2^22 elements) within 4 SE of 1 − p; "
        f"largest fast − nn.Dropout gap {worst:.2f} SE")
    return [Outcome(f"dropout/keep_rate[{device}]", "FAIL" if problems else "PASS", detail,
                    numbers)]


# --- the run ------------------------------------------------------------------------------------

def in_process(ctx: Context) -> list[Outcome]:
    devices = ["cpu", "cuda"] if ctx.gpu else ["cpu"]
    outcomes = guarded("sve/weight_cache", lambda: sve_cache(ctx))
    for device in devices:
        outcomes += guarded(f"moments[{device}]", partial(moments, device))
    outcomes += guarded(f"dropout/keep_rate[{ctx.device}]", lambda: dropout_rate(ctx.device))
    bench = ("run `make bench` on this GPU for the speed and memory rows (tables/bench.md, "
             ".json; out of scope here)" if ctx.gpu else "GPU only")
    outcomes += [show(Outcome("bench", "SKIP", bench))]
    return outcomes


def skipped(name: str, why: str) -> list[Outcome]:
    return [Outcome(name, "SKIP", why)]


def device_name(ctx: Context) -> str:
    if ctx.gpu:
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from uqbench.configs import options_where

    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    methods = (args.methods.split(",") if args.methods
               else options_where("method", "task", "classification"))
    precisions = args.precisions.split(",") if args.precisions else PRECISIONS[device]
    jobs = args.jobs or (6 if device == "cuda" else 2)
    budget = args.budget_s or (480.0 if device == "cuda" else 600.0)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="uqbench-gpu-check-") as tmp:
        ctx = Context(device, Path(tmp), 2 if device == "cuda" else 1, start + budget)
        torch.set_num_threads(ctx.threads)
        print(f"gpu-check on {device_name(ctx)}: {len(methods)} methods × "
              f"{len(BACKBONES[device])} backbones × precisions {', '.join(precisions)}; "
              f"{jobs} processes at once", flush=True)
        tasks: list[tuple[str, Callable[[], list[Outcome]]]] = [
            ("engine/resume_sigterm", lambda: resume(ctx))]
        if ctx.gpu:
            tasks.append(("engine/layouts", lambda: layouts(ctx)))
        else:
            why = ("GPU only (FSDP needs CUDA; DDP with one CPU process is the plain run the "
                   "other checks make)")
            tasks += [(f"engine/{s}_devices1", partial(skipped, f"engine/{s}_devices1", why))
                      for s in ("ddp", "fsdp")]
        # a sweep per backbone and precision on a GPU machine (its cores run them at once),
        # per backbone on a CPU (fewer process starts)
        groups = [[p] for p in precisions] if ctx.gpu else [precisions]
        tasks += [(f"methods/{b}", partial(method_matrix, ctx, methods, b, group))
                  for group in groups for b in BACKBONES[device]]
        with ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(guarded, name, task) for name, task in tasks]
            outcomes = in_process(ctx)
            for future in futures:
                outcomes += future.result()
    wall = time.monotonic() - start
    counts = {s: sum(o.status == s for o in outcomes) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} "
          f"skipped in {wall:.0f} s on {device_name(ctx)}")
    for outcome in outcomes:
        if outcome.status == "FAIL":
            print(f"  {outcome.line()}")
    if args.out is not None:
        report = {"device": device_name(ctx), "kind": device,
                  "date": datetime.now(UTC).isoformat(timespec="seconds"),
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "precisions": precisions, "methods": methods, "wall_s": round(wall, 1),
                  "summary": counts, "checks": [vars(o) for o in outcomes]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
