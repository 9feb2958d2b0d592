"""`make bench`: the measuring helpers, the records it writes, and every figure on tiny shapes.

No timing is asserted (timings belong to the benchmark, not to tests): the tests check what is
measured and written, with expected values computed by hand from the shapes.
"""

from __future__ import annotations

import json
import math
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from uqbench.bench import parse, report, timing
from uqbench.bench.timing import (
    ALLOCATOR,
    Measured,
    ensure_allocator,
    median_interval,
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


def test_side_by_side_times_each_call_after_its_own_warm_calls(monkeypatch):
    """warm=1: every timed call follows an untimed call of the same callable, in the alternating
    order, and only the timed one is counted: on a fake clock each callable's untimed calls take
    1 s and its timed ones 2⁻¹⁰ s, so the medians are 2⁻¹⁰ s exactly."""
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    order = []

    def call(name):
        def f():
            order.append(name)
            now[0] += 1.0 if sum(c == name for c in order) % 2 else 2.0 ** -10
        return f

    t = side_by_side({"a": call("a"), "b": call("b")}, CPU, repeats=4, warmup=0, rounds=2,
                     warm=1)
    assert "".join(order) == "aabb" "bbaa" "aabb" "bbaa"
    assert t["a"] == t["b"] == 2.0 ** -10


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


def test_measured_ratios_pair_the_rounds_and_keep_their_range():
    ours, plain = Measured([2.0, 3.0, 9.0]), Measured([1.0, 1.0, 3.0])
    ratio = ours / plain                                   # rounds 2, 3, 3
    assert ratio.rounds == (2.0, 3.0, 3.0) and float(ratio) == 3.0
    assert ratio.interval == (2.0, 3.0)                    # not 2/3 … 9/1 from unpaired rounds
    third = (plain / 3).rounds
    assert third == pytest.approx((1 / 3, 1 / 3, 1.0))
    assert float(ours) == 3.0 and f"{ours:.3g}" == "3"     # still a number to format
    with pytest.raises(ValueError, match="rounds"):
        ours / Measured([1.0, 2.0])


def test_side_by_side_times_in_rounds():
    calls = []
    t = side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, CPU,
                     repeats=10, warmup=1, rounds=5)
    assert len(calls) == 2 * 11 and len(t["a"].rounds) == 5 and len(t["b"].rounds) == 5
    t = side_by_side({"a": lambda: None}, CPU, repeats=3, warmup=0, rounds=5)
    assert len(t["a"].rounds) == 3                        # never more rounds than repeats


def test_the_interval_is_a_confidence_interval_for_the_median():
    """Order statistics: the k-th smallest to the k-th largest round, k the largest with
    coverage 1 − 2·P(Bin(n, ½) < k) ≥ 90 %: by hand, n = 5 → k = 1 (1 − 2/32 = 93.75 %;
    k = 2 would give 1 − 12/32), n = 10 → k = 2 (1 − 22/1024 = 97.9 %; k = 3: 89.1 %)."""
    five = [1.0, 1.4, 1.1, 1.3, 1.2]
    assert median_interval(five) == (1.0, 1.4)                         # the range
    ten = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 9.0]          # one stray round
    assert median_interval(ten) == (1.1, 1.8)
    assert median_interval([2.0, 1.0]) == (1.0, 2.0)                   # too few: the range
    # its coverage, by simulation: the true median of a skewed distribution lies inside
    torch.manual_seed(0)
    draws = torch.distributions.Exponential(1.0).sample((4000, 10))
    lo_hi = [median_interval(row.tolist()) for row in draws]
    inside = sum(lo <= math.log(2) <= hi for lo, hi in lo_hi) / len(lo_hi)
    assert 0.96 < inside < 0.995                                       # 97.9 % by the binomial


def test_one_stray_round_of_ten_does_not_decide_a_verdict():
    rounds = [2.6, 2.7, 2.7, 2.8, 2.8, 2.8, 2.9, 2.9, 2.9, 3.6]        # one round above 3
    assert report.verdict(Measured(rounds), 3.0) == "met"
    assert report.verdict(Measured(rounds[:5] + [3.6]), 3.0) == "unclear"  # 6 rounds: range


@pytest.mark.parametrize("ours, target, expected", [
    ([0.8, 0.9, 0.95], 1.0, "met"),                        # the whole interval under it
    ([0.9, 1.0, 1.0], 1.0, "met"),                         # at the target counts as under
    ([0.9, 1.05, 1.1], 1.0, "unclear"),                    # the interval straddles it
    ([1.01, 1.2, 1.3], 1.0, "missed"),                     # wholly above
    # a target timed in the same rounds (an anchor's): ours / target round by round
    ([0.8, 0.9, 1.0], [0.9, 1.2, 1.5], "met"),             # 0.89, 0.75, 0.67: every round under
    ([1.0, 1.3, 1.4], [1.1, 1.2, 1.5], "unclear"),         # 0.91, 1.08, 0.93
    ([1.6, 1.7, 1.8], [0.9, 1.2, 1.5], "missed"),          # 1.78, 1.42, 1.2
    (2.0, 1.0, "missed"), (1.0, 1.0, "met"),               # counted figures: points
    ([0.5, 0.6], None, None), (None, 1.0, None),           # no target, not measured
])
def test_verdicts_by_the_one_rule(ours, target, expected):
    def fig(v):
        return Measured(v) if isinstance(v, list) else v
    assert report.verdict(fig(ours), fig(target)) == expected
    row = report.Record("r", fig(ours), "×", "cpu", target=fig(target))
    assert row.to_json()["verdict"] == expected


def test_the_json_records_intervals_rounds_and_the_rule(tmp_path):
    anchor = Measured([3.0, 3.3, 3.9])
    row = report.Record("x / y", Measured([0.9, 1.0, 1.2]), "×", "cpu", anchor="z",
                        anchor_value=anchor, target=anchor / 3, target_rule="anchor / 3")
    report.write([row], tmp_path, CPU)
    data = json.loads((tmp_path / "bench.json").read_text())[0]
    assert data["ours_interval"] == [0.9, 1.2] and data["anchor_interval"] == [3.0, 3.9]
    assert data["target_interval"] == pytest.approx([1.0, 1.3]) and data["rounds"] == 3
    # paired by round: 0.9 / 1.0, 1.0 / 1.1, 1.2 / 1.3, all under 1, although the intervals
    # of ours and of the target overlap
    assert data["to_target_interval"] == pytest.approx([0.9, 12 / 13])
    assert data["verdict"] == "met" and data["met"] is True
    assert data["verdict_rule"] == report.VERDICT_RULE and data["ours"] == 1.0
    assert "1.00× [0.90×, 1.20×]" in (tmp_path / "bench.md").read_text()


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


@pytest.mark.slow  # the quick P2 rows still compile and time the training step
def test_moment_figures_quick_and_missing_anchor_skipped(monkeypatch):
    from uqbench.bench import moment_costs as bnn

    _block(monkeypatch, "fastbnns", "fastbnns.bnn", "fastbnns.bnn.base")
    rows = bnn.run(CPU, repeats=2, quick=True)
    speed = [r for r in rows if r.figure.startswith("moment pass / plain forward")]
    assert speed and all(r.ours > 0 and r.anchor_value is None for r in speed)
    anchored = [r for r in speed if r.anchor]
    assert anchored and all("fastbnns not installed" in r.note for r in anchored)
    full = [r for r in rows if r.section == bnn.SECTION_FULL]
    assert len(full) == 4 and all(r.ours > 0 for r in full)
    assert all("unit pairs per activation and call" in r.note for r in full[:2] + full[3:])
    # the training run: seconds re-projected from each stretch of epochs, around the wall time
    (training,) = [r for r in rows if r.section == bnn.SECTION_TRAINING]
    assert training.unit == "s" and len(training.ours.rounds) >= 2
    wall = float(training.note.split("run wall time ")[1].split(" s")[0])
    assert 0.5 * wall < training.ours < 2 * wall
    err = {r.figure: r.ours for r in rows if r.unit == "%"}
    # Monte Carlo's variance error shrinks with S (about 1/√S): 10 draws are far worse than 1000
    body = "Var error, one Leaky-ReLU unit, body |μ/σ| ≤ 3: "
    assert err[body + "Monte Carlo S = 10"] > 3 * err[body + "Monte Carlo S = 1000"]
    # the closed form is exact: its error is the 2·10⁴-draw reference's own (≈ 1 %)
    assert err[body + "uqbench moments"] < 3.0


def test_ensemble_figures_tiny_vit(monkeypatch):
    from uqbench.bench import ensembles

    monkeypatch.setattr(ensembles, "_tu", lambda: None)
    rows = ensembles.time_rows(ensembles.MODELS["tiny_vit"], 2, 4, CPU, repeats=6, anchors=True,
                               baselines=True)
    figures = {r.figure: r for r in rows}
    # the targeted pairs get every round asked for, the rows without a target fewer
    rounds = {len(r.ours.rounds) for r in rows if isinstance(r.ours, Measured)}
    assert {len(r.ours.rounds) for r in rows if r.target is not None
            and isinstance(r.ours, Measured)} == {6}
    assert rounds == {6, ensembles.OTHER_ROUNDS} and ensembles.OTHER_ROUNDS < 6
    for figure in ("BatchEnsemble M = 2 training step / single (batch 4)",
                   "BLoB inference, 2 draws / single (batch 4)",
                   "MAP LoRA (Laplace-LoRA's training) step / single (batch 4)"):
        assert figures[figure].ours > 0 and figures[figure].target is None
    assert figures["SVE M = 2 training step / Deep Ensemble M = 2 step (batch 4)"].ours > 0
    # SVE's inference claims a Deep Ensemble's work: that work plus a tenth
    sve = figures["SVE M = 2 inference / Deep Ensemble M = 2 inference (batch 4)"]
    assert sve.target == pytest.approx(1.1) and len(sve.ours.rounds) == 6
    # an ensemble over the work it is made of (T single inferences, timed as long): no target
    mcd = figures["MC-Dropout T = 2 inference / 2 single inferences (batch 4)"]
    assert mcd.target is None and mcd.anchor_value is None
    assert "torch-uncertainty not installed" in mcd.note
    de = figures["Deep Ensemble M = 2 training step / 2 single steps (batch 4)"]
    assert de.target is None and len(de.ours.rounds) == ensembles.OTHER_ROUNDS
    state = figures["SVE M = 2 trainable state / Deep Ensemble M = 2's (batch 4)"]
    assert 0 < state.ours < 100


def test_laplace_evaluation_row_quick(monkeypatch):
    """Laplace-LoRA's and MAP LoRA's predictions of every digits split are timed side by side
    on one thread, each round pairing the two, against 3× MAP LoRA's; the figure names the
    splits and images the dataset's config gives (test, 4 corruptions × 5 severities, OOD,
    val; 8 images each in the quick run)."""
    from uqbench.bench import laplace_costs

    timed = laplace_costs.side_by_side
    seen: dict[str, object] = {}

    def spy(fns, *args, **kwargs):
        seen["threads"] = torch.get_num_threads()

        def keeping(name, fn):            # what each timed call returned, kept by name
            return lambda: seen.__setitem__(name, fn())
        return timed({k: keeping(k, fn) for k, fn in fns.items()}, *args, **kwargs)

    monkeypatch.setattr(laplace_costs, "side_by_side", spy)
    (row,) = laplace_costs.run(CPU, rounds=2, quick=True)
    assert seen["threads"] == 1
    assert row.figure == ("Laplace-LoRA evaluation / MAP LoRA evaluation (digits ViT, 23 splits, "
                          "184 images in 23 batches of at most 256, 16 draws)")
    assert row.target == 3.0 and isinstance(row.ours, Measured) and len(row.ours.rounds) == 2
    assert row.ours > 0 and row.verdict in ("met", "missed", "unclear")
    laplace, map_lora = seen["laplace"], seen["map"]          # what was timed: predictions
    assert isinstance(laplace, dict) and isinstance(map_lora, dict)
    assert laplace["test_c/fog/3"]["member_probs"].shape == (16, 8, 5)      # the draws
    assert map_lora["test_c/fog/3"]["member_probs"].shape == (1, 8, 5)      # the MAP model
    assert sorted(laplace) == sorted(map_lora) and len(laplace) == 23
    # one forward and 5 backward passes, each about a forward's products, before the rotation
    products = re.search(r"(\d+\.\d)× MAP LoRA's floating-point operations", row.note)
    assert products is not None and float(products.group(1)) > 5


def test_ensemble_timings_run_on_one_thread_and_say_so(monkeypatch):
    """On a CPU every ensemble figure is timed on one thread (the section's title says it), and
    the caller's thread count is back afterwards."""
    from uqbench.bench import ensembles

    seen: list[int] = []
    timed = ensembles.side_by_side

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return timed(*args, **kwargs)

    monkeypatch.setattr(ensembles, "side_by_side", spy)
    monkeypatch.setattr(ensembles, "_tu", lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = ensembles.run(CPU, 1, [2], ["tiny_vit"], batch=2, topk=(1,))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 1, 1, 1]  # training steps, inference calls: targeted pairs, the others
    sections = {r.section for r in rows if "training step" in r.figure}
    assert sections == {"Ensembles: time (tiny ViT, 16 px, one thread)"}


def test_the_single_model_is_timed_as_m_consecutive_calls(monkeypatch):
    """Beside an M-member ensemble, each round (and the warm-up) of the rows without a target
    calls the single model M times in a row, the others once; the targeted pairs (SVE, the
    Deep Ensemble) do not call it."""
    from uqbench.bench import ensembles

    calls: dict[str, list[str]] = {"train": [], "infer": []}
    for kind, attr in (("train", "train_step"), ("infer", "infer")):
        original = getattr(ensembles.PlainStepper, attr)

        def counted(self, fn=original, kind=kind):
            calls[kind].append(self.method.name)
            return fn(self)
        monkeypatch.setattr(ensembles.PlainStepper, attr, counted)
    monkeypatch.setattr(ensembles, "_tu", lambda: None)
    monkeypatch.setattr(ensembles, "peak_bytes", lambda *a, **k: 1)  # no extra steps
    ensembles.time_rows(ensembles.MODELS["tiny_vit"], 3, 2, CPU, repeats=2, anchors=True)
    rounds = ensembles.WARMUP + 2                        # both blocks: 2 ≤ OTHER_ROUNDS rounds
    assert calls["train"].count("single") == 3 * rounds
    assert calls["infer"].count("single") == 3 * rounds
    assert calls["infer"].count("mcdo_t3_p0.1") == rounds
    # the Deep Ensemble's step in both blocks (against SVE, and against its M single steps);
    # its inference against SVE's only
    assert calls["train"].count("de_m3") == 2 * rounds + 1   # + the step before its peak
    assert calls["infer"].count("de_m3") == rounds


def test_targeted_layer_bytes_lora_by_hand():
    from uqbench.bench import ensembles
    from uqbench.methods.member_layers import wrapped_bytes

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


def test_one_top_k_memory_row_carries_the_target():
    """The claim is that some k reaches LoRA-Ensemble's memory on the same layers: one top-k
    row, the smallest such k of the list (the largest where none does), has the target; the
    other k appear in its note."""
    from uqbench.bench.ensembles import MODELS, layer_memory

    rows = layer_memory(MODELS["tiny_vit"], 4, CPU, topk=[1, 2, 8])
    layer_rows = [r for r in rows if "targeted layers" in r.figure]
    assert len(layer_rows) == 2 and len(rows) == 4                    # full SVE + one top-k
    full, top = layer_rows
    assert full.target is None and top.target == 1.0
    ratios = {int(k): float(v) for k, v in re.findall(r"k = (\d+): ([\d.e+-]+)×", top.note)}
    assert sorted(ratios) == [1, 2, 8]
    reaching = [k for k in (1, 2, 8) if ratios[k] <= 1.0]
    claimed = reaching[0] if reaching else 8
    assert f"(k = {claimed})" in top.figure
    assert top.verdict == ("met" if reaching else "missed")
    # top-k keeps W and k directions: memory grows with k
    assert ratios[1] < ratios[2] < ratios[8]


def _rec(figure: str, verdict: str | None, target: float | None = 1.0,
         span: tuple[float, float] = (0.9, 0.95)) -> dict:
    return {"figure": figure, "target": target, "verdict": verdict,
            "to_target_interval": list(span), "date": "2026-12-01"}


def test_two_runs_verdicts_compared_row_by_row():
    from uqbench.bench import repeat

    before = [_rec("a", "met"), _rec("b", "met"), _rec("gone", "missed"),
              _rec("plain", None, target=None)]
    now = [_rec("a", "met"), _rec("b", "unclear", span=(0.97, 1.02)), _rec("new", "met"),
           _rec("plain", None, target=None)]
    rows = repeat.compare(before, now)
    by = {r["figure"]: r for r in rows}
    assert "plain" not in by                                # untargeted rows are not compared
    assert by["a"]["repeated"] == "yes" and by["b"]["repeated"] == "no"
    assert by["b"]["previous_verdict"] == "met" and by["b"]["to_target_interval"] == [0.97, 1.02]
    assert by["new"]["repeated"] == "this run only" and not by["new"]["compared"]
    assert by["gone"]["repeated"] == "previous run only"
    assert rows[-1] == {"figure": repeat.SUMMARY, "rows": 2, "repeated": 1,
                        "date": "2026-12-01", "previous_date": "2026-12-01"}
    md = repeat.markdown(rows)
    assert "1 of 2 targeted rows" in md and "| b | met | [0.900, 0.950] | unclear |" in md


def test_a_finished_run_keeps_the_one_it_replaces_and_compares_them(tmp_path):
    import uqbench.bench as bench
    from uqbench.bench.report import Record

    first = [Record("x", 0.5, "×", "cpu", target=1.0)]
    bench.report.write(first, tmp_path, CPU, stem=bench.PARTIAL)     # a run stopped midway …
    assert not (tmp_path / "bench.json").exists()                   # … replaces no whole run
    bench.finish(first, tmp_path, CPU)
    assert not list(tmp_path.glob("bench.partial.*"))
    assert not (tmp_path / "bench_repeat.json").exists()             # nothing to compare yet
    bench.finish([Record("x", 1.5, "×", "cpu", target=1.0)], tmp_path, CPU)
    assert json.loads((tmp_path / "bench_previous.json").read_text())[0]["verdict"] == "met"
    assert json.loads((tmp_path / "bench.json").read_text())[0]["verdict"] == "missed"
    summary = json.loads((tmp_path / "bench_repeat.json").read_text())[-1]
    assert summary["rows"] == 1 and summary["repeated"] == 0


def test_the_wall_time_is_a_figure_against_the_half_hour():
    import time

    import uqbench.bench as bench

    assert bench.wall_time(time.time() - 60 * 29, CPU).verdict == "met"
    late = bench.wall_time(time.time() - 60 * 31, CPU)
    assert late.verdict == "missed" and late.ours == pytest.approx(31, abs=0.1)


def test_comparing_a_file_that_is_not_a_bench_json_names_it(tmp_path, capsys):
    from uqbench.bench import repeat

    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(SystemExit):
        repeat.main([str(tmp_path / "x.json"), str(tmp_path / "x.json"), "--out", str(tmp_path)])
    assert "x.json: not a list of benchmark records" in capsys.readouterr().err


class _WideCalls(TorchDispatchMode):
    """Inside: the name of every operation whose output has ``shape`` (a hidden layer's)."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.shape, self.wide = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.wide.append(func.overloadpacket.__name__)
        return out


def test_eager_floor_keeps_the_pass_matrix_work_and_its_three_calls_per_unit():
    """The eager floor row's network: the same matrix products as the eager fused pass (torch's
    FLOP counter, which counts only them) and, beside the linear layers' own products, one
    sqrt, exp and erfc per hidden unit and nothing else at the hidden layers' size."""
    from torch.utils.flop_counter import FlopCounterMode

    from uqbench.bench import moment_costs as bnn

    net = bnn.build_bnn(16, 2, CPU)
    floor = bnn.eager_floor(net)
    x = torch.linspace(-2, 2, 32).unsqueeze(1)

    with torch.no_grad():
        flops = []
        for fn in (net.moment_pass, floor):
            with FlopCounterMode(display=False) as counter:
                mean, var = fn(x)
            flops.append(counter.get_total_flops())
            assert mean.shape == var.shape == (32, 1) and torch.isfinite(var).all()
        assert flops[0] == flops[1] > 0
        with _WideCalls((32, 16)) as calls:
            floor(x)
    elementwise = [c for c in calls.wide if c not in ("addmm", "addcmul", "mm", "mul")]
    assert sorted(elementwise) == sorted(["sqrt", "neg", "exp", "erfc"] * 2)


def test_compiled_floor_keeps_the_pass_matrix_work_and_its_three_operations_per_unit():
    """The compiled floor row's pass (run eagerly here: its compilation is the bench's): the
    same matrix products as the compiled pass (torch's FLOP counter) and, per hidden unit,
    one sqrt, division and exp, with only an abs and a negation beside them."""
    from torch.utils.flop_counter import FlopCounterMode

    from uqbench.bench import moment_costs as bnn
    from uqbench.methods.moments import inference

    net = bnn.build_bnn(16, 2, CPU)
    plan, tensors = inference.inference_plan(net.net)
    x = torch.linspace(-2, 2, 32).unsqueeze(1)

    with torch.no_grad():
        flops = []
        for fn in (inference.planned_pass, bnn._floor_pass):
            with FlopCounterMode(display=False) as counter:
                mean, var = fn(x, plan, tensors)
            flops.append(counter.get_total_flops())
            assert mean.shape == var.shape == (32, 1) and torch.isfinite(var).all()
        assert flops[0] == flops[1] > 0
        with _WideCalls((32, 16)) as calls:
            bnn._floor_pass(x, plan, tensors)
    elementwise = [c for c in calls.wide if c not in ("addmm", "addcmul", "mm", "mul", "t")]
    assert sorted(elementwise) == sorted(["sqrt", "div", "abs", "neg", "exp"] * 2)
