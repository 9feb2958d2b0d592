"""`make gpu-check` (uqbench/bench/gpu_check.py): its CPU subset end to end, and the pieces
that decide how a sweep of checks is launched and judged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from uqbench.bench.gpu_check import DEFAULT_OUT, parse
from uqbench.bench.gpu_runs import max_relative
from uqbench.bench.gpu_sweep import launches, tail

# Failures the CPU subset finds today, each with the text its line must hold. An entry that
# starts to pass makes the test fail: remove it then.
KNOWN_FAILURES: dict[str, str] = {}
# Combinations a method refuses before anything is built (its check_trainer): SKIP lines
REFUSED = {f"methods/{b}/bf16-true/{m}" for b in ("tiny_vit", "tiny_bert")
           for m in ("laplace_lora", "last_layer_laplace")}
GPU_ONLY = {"engine/ddp_devices1", "engine/fsdp_devices1", "sve/weight_cache", "bench"}
LINE = re.compile(r"(PASS|FAIL|SKIP) (\S+): (.+)")


def test_a_cut_sweep_is_launched_again_with_what_is_left():
    jobs = [(p, m) for p in ("32", "bf16-true") for m in ("a", "b", "c")]
    assert launches(("trainer.precision", "method"), jobs) == [
        "trainer.precision=32,bf16-true", "method=a,b,c"]
    # cut after (bf16-true, a): the rest is not a full product; the jobs of one precision go
    assert launches(("trainer.precision", "method"), jobs[4:]) == [
        "trainer.precision=bf16-true", "method=b,c"]
    left = [("32", "c"), ("bf16-true", "a"), ("bf16-true", "b")]
    assert launches(("trainer.precision", "method"), left) == [
        "trainer.precision=32", "method=c"]
    assert launches(("method", "trainer.precision"), [("a", "32"), ("b", "32")]) == [
        "method=a,b", "trainer.precision=32"]


def test_metrics_are_compared_key_by_key_and_nan_equals_nan():
    a = {"test/nll": 1.0, "ood/auroc_mi": float("nan")}
    assert max_relative(a, dict(a)) == 0.0
    assert max_relative(a, {**a, "test/nll": 2.0}) == 0.5
    assert max_relative(a, {"test/nll": 1.0}) == float("inf")


def test_only_error_lines_are_kept_from_a_commands_output():
    err = ("UserWarning: there is a performance drop\n  return Variable._execution_engine\n"
           "error: Input type (float) and bias type (c10::BFloat16) should be the same\n"
           "(set UQBENCH_TRACEBACK=1 for the full traceback)\n")
    assert tail(err) == "error: Input type (float) and bias type (c10::BFloat16) should be the same"
    assert tail("all fine\n") == ""


def test_the_report_is_written_only_when_asked():
    assert parse([]).out is None
    assert parse(["--out"]).out == DEFAULT_OUT == Path("tables/gpu_check.json")
    assert parse(["--out", "r.json", "--cpu"]).out == Path("r.json")


@pytest.mark.slow
def test_the_cpu_subset_runs_every_check_and_reports_each_on_one_line(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "uqbench.bench.gpu_check", "--cpu", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu-check on CPU"), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = next(i for i, line in enumerate(lines) if line.startswith("gpu-check: "))
    checks = {}
    for line in lines[1:summary]:  # every check prints exactly one line
        match = LINE.fullmatch(line)
        assert match, line
        assert match.group(2) not in checks, f"{match.group(2)} reported twice"
        checks[match.group(2)] = (match.group(1), match.group(3))
    report = json.loads(out.read_text())
    assert {c["name"]: (c["status"], c["detail"]) for c in report["checks"]} == checks
    assert report["kind"] == "cpu" and report["precisions"] == ["32", "bf16-true"]
    assert report["summary"] == {s: sum(v[0] == s for v in checks.values())
                                 for s in ("PASS", "FAIL", "SKIP")}
    assert proc.returncode == (1 if report["summary"]["FAIL"] else 0)

    # every classification method on both tiny backbones under both precisions, and the rest
    from uqbench.configs import options_where

    methods = options_where("method", "task", "classification")
    matrix = {f"methods/{b}/{p}/{m}" for b in ("tiny_vit", "tiny_bert")
              for p in ("32", "bf16-true") for m in methods}
    others = {"engine/resume_sigterm", "engine/job_eval", "moments/fused[cpu]",
              "moments/compiled[cpu]", "dropout/keep_rate[cpu]"}
    assert set(checks) == matrix | others | GPU_ONLY
    assert {name for name, (status, _) in checks.items() if status == "SKIP"} == GPU_ONLY | REFUSED
    failed = {name: detail for name, (status, detail) in checks.items() if status == "FAIL"}
    assert set(failed) == set(KNOWN_FAILURES), failed
    for name, text in KNOWN_FAILURES.items():
        assert text in failed[name], failed[name]
    for name in matrix - set(KNOWN_FAILURES) - REFUSED:
        assert re.match(r"train/loss \S+ → \S+, test/nll \S+, test/acc \S+, 4 steps",
                        checks[name][1]), checks[name]
