"""`make bench`: the measuring helpers, the records it writes, and every figure on tiny shapes.

No timing is asserted (timings belong to the benchmark, not to tests): the tests check what is
measured and written, with expected values computed by hand from the shapes.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from uqbench.bench import parse, report
from uqbench.bench.timing import (
    ALLOCATOR,
    ensure_allocator,
    peak_bytes,
    side_by_side,
    tensor_bytes,
    trainable_state_bytes,
)

CPU = torch.device("cpu")


def test_side_by_side_calls_each_warmup_plus_repeats_times():
    calls = {"a": 0, "b": 0}

    def bump(k):
        def f():
            calls[k] += 1
        return f

    t = side_by_side({"a": bump("a"), "b": bump("b")}, CPU, repeats=5, warmup=2)
    assert calls == {"a": 7, "b": 7}
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())


def test_peak_bytes_counts_what_is_alive_together():
    lin = nn.Linear(100, 50)  # 5050 float32 parameters: 20200 bytes, tracked from the start

    def two_alive():
        a = torch.empty(256, 1024)          # 1 MiB
        b = torch.empty(512, 1024)          # 2 MiB, while a is alive
        del a, b
        c = torch.empty(128, 1024)          # 0.5 MiB after both are freed
        del c

    peak = peak_bytes(two_alive, CPU, track=(lin,))
    assert peak == 20200 + 3 * 2**20


def test_tensor_bytes_counts_shared_storage_once():
    x = torch.zeros(1000)
    assert tensor_bytes([x, x[:10], x.view(10, 100), None]) == 4000


def test_trainable_state_bytes_adamw_by_hand():
    lin = nn.Linear(10, 5)                  # 55 parameters
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(3, 10)).sum().backward()
    opt.step()
    # parameters 220 B + gradients 220 B + exp_avg and exp_avg_sq 440 B + two float32 steps 8 B
    assert trainable_state_bytes(list(lin.parameters()), opt) == 888


def test_ensure_allocator_is_a_no_op_when_set(monkeypatch):
    for k, v in ALLOCATOR.items():
        monkeypatch.setenv(k, v)
    ensure_allocator(["--quick"])  # would replace this process otherwise


def test_records_json_and_markdown(tmp_path):
    rows = [report.Record("a / b", 0.5, "×", "cpu", anchor="x", anchor_value=2.0, target=1.0),
            report.Record("c / d", 3.0, "×", "cpu", target=1.0, note="why | it\nmissed"),
            report.Record("e", None, "%", "cpu", note="skipped: y not installed"),
            report.Record("f", 2.0, "×", "cpu")]
    report.write(rows, tmp_path, CPU)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [d["met"] for d in data] == [True, False, None, None]
    for d in data:
        assert set(report.KEYS) <= set(d)
    md = (tmp_path / "bench.md").read_text()
    assert "| c / d | 3.00× |" in md and "**missed**" in md and "not measured" in md
    assert "why \\| it missed" in md  # one table cell, whatever the note holds
    assert "torch" in md and "Device: CPU" in md


@pytest.mark.parametrize("argv, bad", [(["--parts", "bnn,gpu"], "gpu"),
                                       (["--members", "1,4"], "'1,4'"),
                                       (["--text-members", "four"], "'four'"),
                                       (["--models", "resnet"], "resnet")])
def test_bad_arguments_name_the_value(argv, bad, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert bad in capsys.readouterr().err


def _block(monkeypatch, *modules):
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)  # import raises ImportError


def test_moment_figures_quick_and_missing_anchor_skipped(monkeypatch):
    from uqbench.bench import bnn

    _block(monkeypatch, "fastbnns", "fastbnns.bnn", "fastbnns.bnn.base")
    rows = bnn.run(CPU, repeats=2, quick=True)
    speed = [r for r in rows if r.figure.startswith("moment pass / plain forward")]
    assert speed and all(r.ours > 0 and r.anchor_value is None for r in speed)
    anchored = [r for r in speed if r.anchor]
    assert anchored and all("fastbnns not installed" in r.note for r in anchored)
    err = {r.figure: r.ours for r in rows if r.unit == "%"}
    # Monte Carlo's variance error shrinks with S (about 1/√S): 10 draws are far worse than 1000
    body = "Var error, one Leaky-ReLU unit, body |μ/σ| ≤ 3: "
    assert err[body + "Monte Carlo S = 10"] > 3 * err[body + "Monte Carlo S = 1000"]
    # the closed form is exact: its error is the 2·10⁴-draw reference's own (≈ 1 %)
    assert err[body + "uqbench moments"] < 3.0


def test_ensemble_figures_tiny_vit(monkeypatch):
    from uqbench.bench import ensembles

    monkeypatch.setattr(ensembles, "_tu", lambda: None)
    rows = ensembles.time_rows(ensembles.MODELS["tiny_vit"], 2, 4, CPU, repeats=1, anchors=True)
    figures = {r.figure: r for r in rows}
    assert figures["SVE M = 2 training step / Deep Ensemble M = 2 step (batch 4)"].ours > 0
    mcd = figures["MC-Dropout T = 2 inference / single (batch 4)"]
    assert mcd.target == pytest.approx(2.2) and mcd.anchor_value is None
    assert "torch-uncertainty not installed" in mcd.note
    state = figures["SVE M = 2 trainable state / Deep Ensemble M = 2's (batch 4)"]
    assert 0 < state.ours < 100


def test_targeted_layer_bytes_lora_by_hand():
    from uqbench.bench import ensembles
    from uqbench.methods.layers import wrapped_bytes

    lora = ensembles.build(ensembles.MODELS["tiny_vit"], "lora_ensemble", CPU,
                           "method.members=2")
    # tiny ViT: width 16, 2 blocks; LoRA r = 8 on qkv (split into q, k, v) and proj, M = 2
    qkv = 48 * 16 + 48 + 3 * (2 * 8 * 16 + 2 * 16 * 8)   # W, b, and A, B per q, k, v
    proj = 16 * 16 + 16 + (2 * 8 * 16 + 2 * 16 * 8)
    assert wrapped_bytes(lora) == 4 * 2 * (qkv + proj)


def test_the_llama_rows_run_on_a_tiny_llama():
    """The GPU-only LLaMA-2-7B rows go through the causal-LM backbone: the same code, tiny."""
    from uqbench.bench import ensembles

    rows = ensembles.time_rows(ensembles.MODELS["tiny_llama"], 2, 2, CPU, repeats=1,
                               anchors=False)
    figures = {r.figure: r for r in rows}
    assert figures["SVE M = 2 training step / Deep Ensemble M = 2 step (batch 2)"].ours > 0
    assert all(r.ours is not None for r in rows)
