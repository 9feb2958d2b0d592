"""Ensembles over a pretrained backbone, side by side (`make bench`).

On ViT-S/16 at 224 px (random weights: speed does not depend on them; batch 4 at M = 4, M·batch
kept for larger M) and BERT-base at length 128 (batch 2), float32, uqbench's methods are built
from their configs exactly as a run builds them, then timed together on one CPU thread (over
the rounds of one process, a call's time at two threads ranged over about a third of it, at
one thread over about a tenth, for the same seconds per call at half the batch), in rounds of
one training step (forward, backward, AdamW step) and one inference call (no grad) per method
after one untimed call: the figures with a target (SVE against the Deep Ensemble) in
``repeats`` rounds of their own, the others apart in :data:`OTHER_ROUNDS`. Figures are
ratios: SVE / Deep Ensemble, Deep Ensemble / M single steps and MC-Dropout (T passes) / T
single inferences (the single model's M or T consecutive calls: the work they are made of,
timed as long as the figure it divides; reported without a target),
LoRA-Ensemble / single,
with torch-uncertainty's Deep-Ensemble and MC-Dropout wrappers on the same network as
anchors. Memory: the peak of a training step, the trainable state (parameters +
gradients + optimiser state) and the memory of the targeted layers (SVE, its top-k form and
LoRA-Ensemble), the last also for LLaMA-2-7B's shapes, counted on the meta device. At the
first M of the first model (ViT-S/16), the methods P1 compares against (BatchEnsemble, BLoB,
MAP LoRA) are timed in the same rounds, against the single model.

Longer than most modules: one side-by-side measurement per M holds every method's steppers, so
that each ratio's two figures come from the same rounds.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from torch import nn

from uqbench.bench.report import Record
from uqbench.bench.timing import (
    Measured,
    one_thread,
    peak_bytes,
    side_by_side,
    trainable_state_bytes,
)
from uqbench.contracts import DataInfo
from uqbench.methods.base import Method
from uqbench.methods.ensemble import EnsembleMethod
from uqbench.methods.mc_dropout import MCDropout
from uqbench.methods.member_layers import wrapped_bytes

CLASSES = 10
TOPK_KEY = "method.rank"  # SVE's top-k option: only the k largest singular directions adapt
SECTION_TIME = "Ensembles: time ({model}{threads})"
# where uqbench claims the same work as something else (SVE's inference, a Deep Ensemble's), the
# target is that work plus 10 %: a claim of equality has no margin to be met by
SAME_WORK = 1.1
WARMUP = 1  # untimed calls of each callable before its rounds (the first builds optimiser state)
OTHER_ROUNDS = 3  # rounds of the rows without a target (the targeted pairs get ``repeats``)
SECTION_MEMORY = "Ensembles: memory ({model})"
SECTION_LAYERS = "Memory of the targeted layers"


@dataclass
class Model:
    """A backbone to benchmark: its config and a batch of inputs for it."""

    label: str
    backbone: str
    overrides: tuple[str, ...]
    inputs: Callable[[int, torch.device], Any]


def _images(size: int) -> Callable[[int, torch.device], Any]:
    return lambda b, device: torch.randn(b, 3, size, size, device=device)


def _tokens(length: int, vocab: int) -> Callable[[int, torch.device], Any]:
    def make(b: int, device: torch.device) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (b, length), generator=g)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device)}
    return make


MODELS = {
    "vit": Model("ViT-S/16, 224 px", "vits16_random", (), _images(224)),
    "bert": Model("BERT-base, length 128", "bert_base", ("backbone.pretrained=false",),
                  _tokens(128, 30522)),
    # GPU only: LLaMA-2-7B's layer shapes (2 of its 32 blocks, bf16; M = 16 is P1's setting)
    "llama": Model("LLaMA-2-7B shapes, 2 of 32 blocks, length 256", "llama2_7b",
                   ("backbone.pretrained=false", "backbone.config.num_hidden_layers=2"),
                   _tokens(256, 32000)),
    # the same code paths on tiny shapes (tests, --quick)
    "tiny_vit": Model("tiny ViT, 16 px", "tiny_vit", (), _images(16)),
    "tiny_bert": Model("tiny BERT, length 16", "tiny_bert", (), _tokens(16, 30522)),
    "tiny_llama": Model("tiny LLaMA, length 16", "tiny_llama", (), _tokens(16, 30522)),
}


def build(model: Model, method: str, device: torch.device, *overrides: str) -> Method:
    """uqbench's method on the model's backbone, built from the real configs."""
    with initialize_config_module("uqbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"backbone={model.backbone}", f"method={method}",
                                           *model.overrides, *overrides])
    torch.manual_seed(0)
    backbone = instantiate(cfg.backbone)
    info = DataInfo(task="classification", num_classes=CLASSES)
    return instantiate(cfg.method)(backbone=backbone, info=info).to(device)


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, foreach=True)


class PlainStepper:
    """One training step and one inference call of a plain network returning logits (M·B, C)
    (torch-uncertainty's wrappers and the bare backbone + head) on a fixed batch: the loss is
    the members' mean cross-entropy."""

    def __init__(self, method: nn.Module, inputs: Any, labels: torch.Tensor) -> None:
        self.method, self.inputs, self.labels = method, inputs, labels
        self.params = [p for p in method.parameters() if p.requires_grad]
        self.optimizer = _optimizer(self.params)

    def loss(self) -> torch.Tensor:
        logits = self.method(self.inputs)
        return F.cross_entropy(logits, self.labels.repeat(logits.shape[0] // len(self.labels)))

    def train_step(self) -> None:
        self.method.train()
        loss = self.loss()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    @torch.no_grad()
    def infer(self) -> None:
        self.method.eval()
        self.method(self.inputs)

    def state_bytes(self) -> int:
        return trainable_state_bytes(self.params, self.optimizer)

    def peak(self, device: torch.device) -> int | None:
        self.train_step()  # the optimiser state exists before the measured step
        return peak_bytes(self.train_step, device, track=(self.method, self.optimizer))


class Stepper(PlainStepper):
    """The same for a uqbench method: the loss is the method's own."""

    method: Method

    def __init__(self, method: Method, inputs: Any, labels: torch.Tensor) -> None:
        super().__init__(method, inputs, labels)

    def loss(self) -> torch.Tensor:
        return self.method.loss((self.inputs, self.labels))


class _Headed(nn.Module):
    """encoder + head. A text encoder takes token ids (B, T) alone (torch-uncertainty's
    wrappers repeat one tensor), all attended."""

    def __init__(self, encoder: nn.Module, head: nn.Module, text: bool) -> None:
        super().__init__()
        self.encoder, self.head, self.text = encoder, head, text

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        encoded = (self.encoder({"input_ids": inputs, "attention_mask": torch.ones_like(inputs)})
                   if self.text else self.encoder(inputs))
        return self.head(encoded)


def plain_network(single: EnsembleMethod, text: bool) -> nn.Module:
    """A copy of uqbench's single model as a bare encoder + head (what a user would write)."""
    return _Headed(copy.deepcopy(single.encoder), nn.Linear(single.head.weight.shape[-1], CLASSES),
                   text).to(next(single.parameters()).device)


def _repeat(fn: Callable[[], None], times: int) -> Callable[[], None]:
    """``fn`` called ``times`` times in a row, as one callable."""
    def repeated() -> None:
        for _ in range(times):
            fn()
    return repeated


def _tu() -> Any:
    try:
        from torch_uncertainty.methods import deep_ensembles, mc_dropout
    except ImportError:
        return None
    return deep_ensembles, mc_dropout


def time_rows(model: Model, members: int, batch: int, device: torch.device, repeats: int,
              anchors: bool, baselines: bool = False) -> list[Record]:
    """Training-step and inference ratios, and memory, at M = ``members`` (the single model is
    timed again beside every M, so each ratio comes from one side-by-side measurement).
    ``baselines``: also BatchEnsemble (M members), BLoB (M draws at inference) and MAP LoRA
    (Laplace-LoRA's training step), against the single model, without targets."""
    dev = str(device)
    section = SECTION_TIME.format(model=model.label,
                                  threads=", one thread" if device.type == "cpu" else "")
    inputs, labels = model.inputs(batch, device), torch.randint(0, CLASSES, (batch,),
                                                                device=device)
    m = f"method.members={members}"
    steppers: dict[str, PlainStepper] = {
        "single": Stepper(build(model, "single", device), inputs, labels),
        "sve": Stepper(build(model, "sve", device, m), inputs, labels),
        "de": Stepper(build(model, "deep_ensemble", device, m), inputs, labels),
        "lora": Stepper(build(model, "lora_ensemble", device, m), inputs, labels),
        "mcd": Stepper(build(model, "mc_dropout", device, f"method.samples={members}"),
                       inputs, labels),
    }
    if baselines:
        steppers |= {
            "be": Stepper(build(model, "batch_ensemble", device, m), inputs, labels),
            "blob": Stepper(build(model, "blob", device, f"method.samples={members}"), inputs,
                            labels),
            "map_lora": Stepper(build(model, "map_lora", device), inputs, labels)}
    tu = _tu() if anchors else None
    if tu:
        deep_ensembles, mc_dropout = tu
        text = isinstance(inputs, dict)
        ids = inputs["input_ids"] if text else inputs
        single = steppers["single"].method
        assert isinstance(single, EnsembleMethod)  # what the single config builds
        steppers["plain"] = PlainStepper(plain_network(single, text), ids, labels)
        steppers["tu_de"] = PlainStepper(deep_ensembles(plain_network(single, text),
                                                        num_estimators=members), ids, labels)
        mcd = copy.deepcopy(steppers["mcd"].method)
        assert isinstance(mcd, MCDropout)  # what the mc_dropout config builds
        tu_net = _Headed(mcd.encoder, nn.Sequential(mcd.mc_dropout, nn.Linear(
            mcd.head.weight.shape[-1], CLASSES)), text).to(device)
        steppers["tu_mcd"] = PlainStepper(mc_dropout(tu_net, num_estimators=members,
                                                     on_batch=True), ids, labels)
    # the figures with a target (SVE against the Deep Ensemble) are timed in rounds of their
    # own, short ones, so that each ratio's two figures are close in time; the rows without a
    # target are timed apart, in OTHER_ROUNDS rounds, against the single model's M (T)
    # consecutive calls (the work a Deep Ensemble or MC-Dropout is made of: a denominator as
    # long as the figures it divides), with the Deep Ensemble timed there again
    claimed = {"train": ("sve", "de"), "infer": ("sve", "de")}
    untargeted = {"train": ("de", "lora", "be", "blob", "map_lora", "plain", "tu_de"),
                  "infer": ("mcd", "lora", "be", "blob", "plain", "tu_mcd")}
    few = max(1, min(OTHER_ROUNDS, repeats))
    t: dict[str, Measured] = {}
    for kind in ("train", "infer"):
        calls = {k: s.train_step if kind == "train" else s.infer for k, s in steppers.items()}
        blocks = (("", {k: calls[k] for k in claimed[kind]}, repeats),
                  ("other_", {"single_work": _repeat(calls["single"], members)}
                   | {k: calls[k] for k in untargeted[kind] if k in calls}, few))
        for prefix, fns, rounds in blocks:
            t |= {f"{kind}_{prefix}{k}": v for k, v in side_by_side(
                fns, device, repeats=rounds, warmup=WARMUP, rounds=rounds).items()}
        t[f"{kind}_single"] = t[f"{kind}_other_single_work"] / members  # one call's share
    tag = f"M = {members}"
    at = f" (batch {batch})"
    skipped = "" if tu else ("torch-uncertainty not installed: anchor skipped" if anchors
                             else "anchors: on ViT-S/16 at the first M only (time, memory)")

    def copies(figure: str, kind: str, ours: str, wrapper: str, note: str) -> Record:
        """An ensemble over the M (T) consecutive single calls it is made of, beside
        torch-uncertainty's wrapper over M (T) calls of the bare network: no target (a Deep
        Ensemble is M copies by construction; what uqbench claims of it is SVE's rows)."""
        return Record(f"{figure}{at}", t[f"{kind}_other_{ours}"] / t[f"{kind}_other_single_work"],
                      "×", dev, anchor=f"torch-uncertainty {wrapper}",
                      anchor_value=(t[f"{kind}_other_tu_{ours}"]
                                    / (t[f"{kind}_other_plain"] * members) if tu else None),
                      section=section, note=(skipped + "; " if skipped else "") + note)

    rows = [
        Record(f"SVE {tag} training step / Deep Ensemble {tag} step{at}",
               t["train_sve"] / t["train_de"], "×", dev, target=1.0, section=section,
               note=f"SVE {t['train_sve']:.3g} s, Deep Ensemble {t['train_de']:.3g} s"),
        Record(f"SVE {tag} inference / Deep Ensemble {tag} inference{at}",
               t["infer_sve"] / t["infer_de"], "×", dev, target=SAME_WORK,
               target_rule=f"the same work: {SAME_WORK}", section=section,
               note=f"SVE {t['infer_sve']:.3g} s, Deep Ensemble {t['infer_de']:.3g} s (the "
                    f"members' cached weights: a Deep Ensemble's work)"),
        copies(f"Deep Ensemble {tag} training step / {members} single steps", "train", "de",
               "deep_ensembles", f"a single step {t['train_single']:.3g} s, timed as {members} "
                                 f"consecutive steps"),
        Record(f"LoRA-Ensemble {tag} training step / single{at}",
               t["train_other_lora"] / t["train_single"], "×", dev, section=section),
        Record(f"LoRA-Ensemble {tag} inference / single{at}",
               t["infer_other_lora"] / t["infer_single"], "×", dev, section=section),
        copies(f"MC-Dropout T = {members} inference / {members} single inferences", "infer",
               "mcd", "mc_dropout", f"a single inference {t['infer_single'] * 1e3:.3g} ms, "
                                    f"timed as {members} consecutive calls"),
    ]
    if baselines:
        rows += [
            Record(f"BatchEnsemble {tag} training step / single{at}",
                   t["train_other_be"] / t["train_single"], "×", dev, section=section),
            Record(f"BatchEnsemble {tag} inference / single{at}",
                   t["infer_other_be"] / t["infer_single"], "×", dev, section=section),
            Record(f"BLoB training step (1 draw) / single{at}",
                   t["train_other_blob"] / t["train_single"], "×", dev, section=section),
            Record(f"BLoB inference, {members} draws / single{at}",
                   t["infer_other_blob"] / t["infer_single"], "×", dev, section=section),
            Record(f"MAP LoRA (Laplace-LoRA's training) step / single{at}",
                   t["train_other_map_lora"] / t["train_single"], "×", dev, section=section,
                   note="Laplace-LoRA's inference (one forward and one backward pass per "
                        "class of a batch for the GLM predictive's Jacobians) is timed on the "
                        "digits benchmark, against MAP LoRA's (uqbench.bench.laplace_costs)")]
    msection = SECTION_MEMORY.format(model=model.label)
    state = {k: s.state_bytes() for k, s in steppers.items()
             if k in ("sve", "de", "lora", "single", "be", "blob", "map_lora")}
    others = "".join(f", {label} {state[k] / 1e6:.3g} MB" for k, label in (
        ("be", "BatchEnsemble"), ("blob", "BLoB"), ("map_lora", "MAP LoRA")) if k in state)
    rows.append(Record(f"SVE {tag} trainable state / Deep Ensemble {tag}'s{at}",
                       100 * state["sve"] / state["de"], "%", dev, target=2.0, section=msection,
                       note=f"parameters + gradients + AdamW state: SVE "
                            f"{state['sve'] / 1e6:.3g} MB, Deep Ensemble "
                            f"{state['de'] / 1e6:.4g} MB, LoRA-Ensemble "
                            f"{state['lora'] / 1e6:.3g} MB{others}"))
    measured = {k: steppers[k].peak(device) for k in ("sve", "de", "lora")}
    peaks = {k: p for k, p in measured.items() if p is not None}
    if len(peaks) == len(measured):
        rows.append(Record(f"SVE {tag} training-step peak memory / Deep Ensemble's{at}",
                           peaks["sve"] / peaks["de"], "×", dev, section=msection,
                           note=f"SVE {peaks['sve'] / 1e9:.3g} GB, Deep Ensemble "
                                f"{peaks['de'] / 1e9:.3g} GB, LoRA-Ensemble "
                                f"{peaks['lora'] / 1e9:.3g} GB"))
    else:
        rows.append(Record(f"SVE {tag} training-step peak memory / Deep Ensemble's{at}", None, "×",
                           dev, section=msection, note="the memory tracker could not follow "
                                                       "a step"))
    del steppers
    gc.collect()  # the next M builds its models only after these are gone
    return rows


def layer_memory(model: Model, members: int, device: torch.device, topk: list[int],
                 dtype_note: str = "") -> list[Record]:
    """SVE's memory over LoRA-Ensemble's: on the same targeted layers (LoRA-Ensemble on every
    linear of a block, as SVE), and for the whole model with each method's default targets
    (LoRA-Ensemble: attention only, P1's baseline); full SVE, and ONE top-k row, where the
    claim is: the smallest k of ``topk`` whose targeted layers take no more memory than
    LoRA-Ensemble's (the largest k where none does; its verdict is then missed). The other
    k are measured too and listed in that row's note."""
    dev = "counted, no device" if device.type == "meta" else str(device)
    m = f"method.members={members}"
    where = f"({model.label}, M = {members})"
    lora_all = wrapped_bytes(build(model, "lora_ensemble_all", device, m))
    lora = build(model, "lora_ensemble", device, m).param_counts()["memory_bytes"]
    layers, whole = {}, {}
    for k in [None, *topk]:
        sve = build(model, "sve", device, m, *(() if k is None else (f"{TOPK_KEY}={k}",)))
        layers[k], whole[k] = wrapped_bytes(sve), sve.param_counts()["memory_bytes"]
        del sve

    def rows_for(k: int | None, note: str = "") -> list[Record]:
        name = "SVE" if k is None else f"SVE top-k (k = {k})"
        return [
            Record(f"{name} memory of the targeted layers / LoRA-Ensemble's on the same layers "
                   f"{where}", layers[k] / lora_all, "×", dev, section=SECTION_LAYERS,
                   note=f"{name} {layers[k] / 1e9:.4g} GB, LoRA-Ensemble r = 8 "
                        f"{lora_all / 1e9:.4g} GB{dtype_note}{note}"),
            Record(f"{name} model memory / LoRA-Ensemble's (attention adapters) {where}",
                   whole[k] / lora, "×", dev, anchor="P1: ~10× less memory overhead than "
                   "LoRA-Ensemble", section=SECTION_LAYERS,
                   note=f"{name} {whole[k] / 1e9:.4g} GB, LoRA-Ensemble r = 8 "
                        f"{lora / 1e9:.4g} GB{dtype_note}")]

    rows = rows_for(None)
    if topk:
        claimed = min((k for k in topk if layers[k] <= lora_all), default=max(topk))
        every = ", ".join(f"k = {k}: {layers[k] / lora_all:.3g}×" for k in topk)
        top = rows_for(claimed, f"; every k measured: {every}")
        top[0].target, top[0].target_rule = 1.0, "the smallest k measured that reaches it"
        rows += top
    return rows


def run(device: torch.device, repeats: int, members: list[int], models: list[str],
        batch: int = 4, anchors: bool = True, topk: tuple[int, ...] = (8, 64),
        text_members: list[int] | None = None, text_batch: int | None = None,
        done: Callable[[list[Record]], None] = lambda rows: None) -> list[Record]:
    """Every model's time and memory rows at each M, then its targeted-layer memory.

    ``batch`` is the batch at the first M; larger M get a batch that keeps M·B rows per step
    (a 16-member Deep Ensemble of ViT-S/16 at batch 8 needs more than 24 GB to train), so
    each ratio compares methods at one batch. Text models use ``text_members`` and
    ``text_batch``; torch-uncertainty's anchors run on image models at the first M. ``done``
    is called with the rows of each M as they are measured. On a CPU every figure is timed on
    one thread (:func:`~uqbench.bench.timing.one_thread`)."""
    records: list[Record] = []
    for key in models:
        model = MODELS[key]
        text = key in ("bert", "llama", "tiny_bert", "tiny_llama")
        sizes = text_members if text and text_members else members
        first = text_batch if text and text_batch else batch
        for i, m in enumerate(sizes):
            with one_thread(device):
                rows = time_rows(model, m, max(1, first * sizes[0] // m), device, repeats,
                                 anchors and i == 0 and not text,
                                 baselines=i == 0 and key == models[0])
            records += rows
            done(rows)
        rows = layer_memory(model, sizes[0], device, list(topk))
        records += rows
        done(rows)
    return records


def llama_layer_memory(topk: tuple[int, ...] = (64, 256), members: int = 16) -> list[Record]:
    """LLaMA-2-7B's targeted-layer memory (bf16, M = 16, P1's setting), counted on the meta
    device: no weights, no memory, any machine."""
    model = Model("LLaMA-2-7B", "llama2_7b", ("backbone.pretrained=false",), _tokens(8, 32000))
    with torch.device("meta"):
        return layer_memory(model, members, torch.device("meta"), list(topk),
                            dtype_note=" (bf16, counted without weights)")
