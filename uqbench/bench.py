"""Speed benchmarks (`make bench`): moment propagation vs Monte Carlo inference of one BNN.

Times, per hidden width, one training step (moments, batch 100) and inference over 1000 inputs
with one analytic pass vs S sampled weight sets, and reports how far the MC estimate is from
the moments (relative difference of the predictive std). Prints a Markdown table; with
``--out`` also writes it to a file. Timings are medians over repeats, on whatever device runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from uqbench.backbones.mlp import MLP
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _bench_width(width: int, samples: int, repeats: int, device: torch.device) -> dict:
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    x_train, y_train = torch.randn(100, 1, device=device), torch.randn(100, 1, device=device)
    x_eval = torch.linspace(-2, 2, 1000, device=device).unsqueeze(1)
    torch.manual_seed(0)
    method = BayesianMLP(MLP(width=width), info, mc_samples=samples).to(device)
    opt = torch.optim.Adam(method.parameters(), lr=1e-3, foreach=True)

    def step():
        loss = method.loss((x_train, y_train))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    t_step = _median_ms(step, repeats, device)
    method.eval()
    with torch.no_grad():
        t_mom = _median_ms(lambda: method(x_eval, inference="moments"), repeats, device)
        t_mc = _median_ms(lambda: method(x_eval, inference="mc"), repeats, device)
        mom, mc = method(x_eval, inference="moments"), method(x_eval, inference="mc")
    gap = ((mc.var.sqrt() - mom.var.sqrt()).abs() / mom.var.sqrt()).mean().item()
    return {"width": width, "params": method.param_counts()["trainable"],
            "train step ms": round(t_step, 3), "moments ms": round(t_mom, 3),
            f"MC (S={samples}) ms": round(t_mc, 3), "MC / moments": round(t_mc / t_mom, 1),
            "mean |σ_MC − σ_mom| / σ_mom": round(gap, 4)}


def bench_bnn(widths: list[int], samples: int, repeats: int, device: torch.device) -> pd.DataFrame:
    return pd.DataFrame([_bench_width(w, samples, repeats, device) for w in widths])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m uqbench.bench", description=__doc__)
    parser.add_argument("--widths", default="4,16,64,256,1024")
    parser.add_argument("--samples", type=int, default=100, help="MC weight samples S")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    df = bench_bnn([int(w) for w in args.widths.split(",")], args.samples, args.repeats, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU, {torch.get_num_threads()} threads")
    text = (f"## BNN inference: moment propagation vs Monte Carlo ({name}, torch "
            f"{torch.__version__})\n\n" + df.to_markdown(index=False) + "\n")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
