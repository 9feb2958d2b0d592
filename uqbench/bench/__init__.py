"""`make bench`: uqbench's speed and memory figures beside what a user would otherwise run.

``python -m uqbench.bench`` measures, in one process and side by side:
- moment propagation against a plain forward, Monte Carlo and fastbnns (:mod:`.bnn`);
- SVE, LoRA-Ensemble, Deep Ensemble, MC-Dropout and a single model on ViT-S/16 and BERT-base,
  with torch-uncertainty's wrappers as anchors, and the targeted layers' memory, LLaMA-2-7B's
  included (:mod:`.ensembles`);
- Laplace-LoRA's evaluation against MAP LoRA's on the digits benchmark (:mod:`.laplace_costs`);
and writes ``tables/bench.json`` (a list of records: figure, ours, anchor, anchor_value,
target, unit, device, …) and ``tables/bench.md`` when it has finished (while it measures, the
figures so far go to ``bench.partial.json`` / ``.md``, so a stopped run never replaces a whole
one). The run it replaces is kept as ``bench_previous.json``, and the two runs' verdicts are
compared in ``bench_repeat.json`` / ``.md`` (:mod:`.repeat`). The process's wall time is a
figure too, against the half-hour budget. The anchors come from the optional ``bench``
extra (``pip install -e ".[bench]"``, which ``make bench`` runs); a missing anchor is reported
as skipped. On CPU the process restarts itself once with glibc's allocator settings
(:data:`.timing.ALLOCATOR`), which apply to it alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from uqbench.bench import repeat, report
from uqbench.bench.timing import ensure_allocator

PARTS = ("bnn", "ensembles", "laplace", "layers")
BUDGET_MIN = 30.0  # `make bench` on two cores: at most half an hour
STARTED = "UQBENCH_BENCH_STARTED"  # the first process's start time, kept across the restart
PARTIAL = "bench.partial"  # the figures of a run still measuring (bench.json: finished runs)


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="uqbench-bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"any of {', '.join(PARTS)}")
    p.add_argument("--models", default=None, help="ensembles on: vit, bert, llama (LLaMA-2-7B "
                   "shapes, GPU); tiny_vit, tiny_bert, tiny_llama: the same code on tiny "
                   "shapes. Default: vit,bert (and llama on a GPU)")
    p.add_argument("--members", default="4,16", help="ensemble sizes M (the first one also "
                   "gets the anchors and the methods P1 compares against)")
    p.add_argument("--text-members", default="4", help="ensemble sizes for BERT and LLaMA "
                   "(a BERT-base step at batch 2 takes seconds per member on a CPU)")
    p.add_argument("--batch", type=int, default=4, help="image batch at the first M (larger M "
                   "keep M·batch rows per step)")
    p.add_argument("--text-batch", type=int, default=2, help="text batch at the first M")
    p.add_argument("--repeats", type=int, default=9, help="rounds of the ensembles' targeted "
                   "pairs, one call each (the rows without a target get ensembles.OTHER_ROUNDS; "
                   "the moment-propagation part has its own: bnn.REPEATS)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few repeats: checks "
                   "that every figure is produced, in seconds")
    p.add_argument("--out", type=Path, default=Path("tables"), help="folder for bench.json/.md")
    args = p.parse_args(argv)
    bad = [x for x in _csv(args.parts) if x not in PARTS]
    if bad:
        p.error(f"--parts {bad} not among {PARTS}")
    if args.models is None:
        args.models = "vit,bert,llama" if args.device.startswith("cuda") else "vit,bert"
    models = ("vit", "bert", "llama", "tiny_vit", "tiny_bert", "tiny_llama")
    bad = [x for x in _csv(args.models) if x not in models]
    if bad:
        p.error(f"--models {bad} not among {', '.join(models)}")
    for key in ("members", "text_members"):
        text = getattr(args, key)
        try:
            sizes = [int(m) for m in _csv(text)]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 2:
            p.error(f"--{key.replace('_', '-')} must be ensemble sizes >= 2 separated by commas, "
                    f"got {text!r}")
        setattr(args, key, sizes)
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here; use --device cpu")
    os.environ.setdefault(STARTED, repr(time.time()))  # before the restart: it is counted
    if device.type == "cpu":
        ensure_allocator(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    from uqbench.bench import ensembles, laplace_costs  # after the restart: imports take seconds
    from uqbench.bench import moment_costs as bnn  # the "bnn" part

    parts, records = _csv(args.parts), []
    start = time.perf_counter()

    def done(rows: list[report.Record]) -> None:  # written as measured: a crash keeps them
        records.extend(rows)
        report.write(records, args.out, device, stem=PARTIAL)
        _progress(f"{len(records)} figures", start)

    if "bnn" in parts:
        bnn.run(device, repeats=2 * args.repeats if args.quick else bnn.REPEATS,
                quick=args.quick, done=done)
    if "ensembles" in parts:
        ensembles.run(device, args.repeats, args.members, _csv(args.models), batch=args.batch,
                      text_members=args.text_members, text_batch=args.text_batch, done=done)
    if "laplace" in parts:
        laplace_costs.run(device, rounds=2 if args.quick else laplace_costs.ROUNDS,
                          quick=args.quick, done=done)
    if "layers" in parts and not args.quick:
        done(ensembles.llama_layer_memory())
    records.append(wall_time(float(os.environ[STARTED]), device))
    header = finish(records, args.out, device)
    print(report.markdown(records, header))
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'bench.md'} "
          f"({time.perf_counter() - start:.0f} s)")


def wall_time(started: float, device: torch.device) -> report.Record:
    """The benchmark's own wall time, from the first process's start (the restart with the
    allocator settings included), against :data:`BUDGET_MIN`: a counted point."""
    return report.Record("uqbench-bench wall time", (time.time() - started) / 60, "min",
                         str(device), target=BUDGET_MIN, target_rule="the half-hour budget",
                         section="This run", note="from the process's start to its last "
                         "figure; make bench's pip install of the anchors not included")


def finish(records: list[report.Record], out: Path, device: torch.device) -> dict[str, Any]:
    """The finished run becomes ``bench.json`` / ``.md``; the run it replaces is kept as
    ``bench_previous.json`` and compared with it (``bench_repeat.json`` / ``.md``); the
    partial files are removed."""
    current, previous = out / "bench.json", out / "bench_previous.json"
    if current.is_file():
        current.replace(previous)
    header = report.write(records, out, device)
    for suffix in (".json", ".md"):
        (out / f"{PARTIAL}{suffix}").unlink(missing_ok=True)
    if previous.is_file():
        repeat.write(json.loads(previous.read_text()), json.loads(current.read_text()), out)
    return header


def _progress(part: str, start: float) -> None:
    print(f"[bench] {part} done after {time.perf_counter() - start:.0f} s", file=sys.stderr,
          flush=True)
