"""Moment propagation against a plain forward, Monte Carlo and fastbnns (`make bench`).

Figures, each on a Leaky-ReLU(0.1) MLP at batch 1024, float32, inference (except the training
step), timed on one CPU thread:
- one moment-propagation pass / one plain forward of the same network (nn.Linear +
  nn.LeakyReLU, the weight means), for 1→64→64→1 and 1→1024→1; the anchor is fastbnns on the
  same network: its analytic Leaky-ReLU propagator and its default (unscented) one; beside
  them the eager pass's floor (:func:`eager_floor`: its linear layers' products and one sqrt,
  exp and erfc per hidden unit) on the same scale;
- Monte Carlo inference with S = 10, 100, 1000 weight draws / one moment pass, with fastbnns'
  Monte Carlo propagator as the anchor at S = 10 and 100;
- P2's training step (moment pass, ELBO, backward, Adam; batch 100; timed where 300 training
  steps took the model, held there) / a plain MLP's Gaussian-NLL step of the same width, both
  variances, widths 4, 64 and 1024, compiled (``method.compile: true``) and eager (the default);
- the full-covariance pass as a scoring runs it (no gradient; its activations compiled once a
  call holds 2²⁰ unit pairs) / the diagonal pass of the same network, compiled and eager (the
  quadrature) and by the Mehler series (a training step's form), on 1→256→256→256→1 at 64
  inputs;
- a ``method.covariance: full`` training run of P2's depth-3, width-64 network with the default
  epochs, in seconds, against a 120 s goal;
- accuracy: the variance error of each inference against a 2·10⁵-draw Monte Carlo reference,
  for one Leaky-ReLU unit across μ/σ from −40 to 40 (body |μ/σ| ≤ 3, tails beyond) and for the
  1→64→64→1 network's predictive σ.

Longer than most modules: each figure's networks, anchors and side-by-side timing sit together,
so that what is compared is built in one place.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.backbones.mlp import MLP
from uqbench.bench.report import Record
from uqbench.bench.timing import ROUNDS, Measured, one_thread, side_by_side
from uqbench.contracts import DataInfo
from uqbench.methods.bnn import BayesianMLP
from uqbench.methods.moments import covariance, inference, mehler
from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.compiling import compile_specialised
from uqbench.methods.moments.layers import GaussianLinear

SLOPE = 0.1
NETS = {"1→64→64→1": (64, 2), "1→1024→1": (1024, 1)}
SECTION_SPEED = "Moment propagation: speed (Leaky-ReLU MLP, batch 1024, inference, one thread)"
SECTION_STEP = "P2 training step against a plain MLP's (batch 100, one thread)"
STEP_WIDTHS = (4, 64, 1024)  # P2's narrowest, middle and widest hidden layers
STEP_TARGET = 3.0            # BNN step / plain step: the goal for both variances
SETTLE_STEPS = 300           # training steps before the timed ones (which then hold still)
FAST_ROUNDS = 10             # rounds of the figures whose calls take milliseconds
REPEATS = 50                 # the moment pass's timed repeats (the training step's: 4×)
PAIR_REPEATS, PAIR_ROUNDS = 4, 20  # the targeted moment pass and its anchor: 4× the repeats
MC_ANCHORED = (10, 100)    # fastbnns' Monte Carlo is timed at these S
SECTION_FULL = ("Full covariance between units: a scoring's pass against the diagonal pass "
                "(Leaky-ReLU MLP, no gradient, one thread)")
FULL_NET, FULL_INPUTS = (256, 3), 64  # 2·10⁶ unit pairs per activation and call: compiled
FULL_ROUNDS = 5                       # rounds of one call each: an eager call takes seconds
SECTION_ACCURACY = "Moment propagation vs Monte Carlo: accuracy (variance error vs 2·10⁵ draws)"


def build_bnn(width: int, depth: int, device: torch.device, fused: bool = True,
              compile: bool = False, covariance: str = "diagonal") -> BayesianMLP:
    """uqbench's BNN (embedded variance) on MLP(width, depth) with 1 input and 1 output, with
    the method's ``fused``, ``compile`` and ``covariance``. Seeded: every call gets the same
    weights."""
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    torch.manual_seed(0)
    return BayesianMLP(MLP(width=width, depth=depth, slope=SLOPE), info, fused=fused,
                       compile=compile, covariance=covariance).to(device).eval()


def plain_twin(bnn: BayesianMLP) -> nn.Sequential:
    """The deterministic network with the BNN's weight means: what a plain forward costs."""
    layers: list[nn.Module] = []
    for m in bnn.net:
        if isinstance(m, GaussianLinear):
            lin = nn.Linear(m.in_features, m.out_features)
            with torch.no_grad():
                lin.weight.copy_(m.weight_mu)
                lin.bias.copy_(m.bias_mu)
            layers.append(lin)
        else:
            layers.append(nn.LeakyReLU(SLOPE))
    return nn.Sequential(*layers).to(next(bnn.parameters()).device).eval()


def moment_pass(bnn: BayesianMLP) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """x (B, 1) → (mean, var) of the output by uqbench's moment propagation, as the BNN's
    ``fused`` and ``compile`` options compute it."""
    return bnn.moment_pass


def eager_floor(bnn: BayesianMLP) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """x (B, 1) → the part of the eager fused pass that no eager rewrite of its closed forms
    can drop: each Gaussian linear layer's own products (its fused forward: three matrix
    products for a hidden layer, against a plain forward's one) and, per hidden unit, the three
    ATen calls the closed forms need (sqrt for σ, exp for φ, erfc for Φ), without the ~20
    elementwise passes that combine them. What it computes is not a moment; its time is a
    floor for the eager pass."""
    layers = list(bnn.net)

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, var = x, None
        for layer in layers:
            if isinstance(layer, GaussianLinear):
                mean, var = layer.forward_fused(mean, var)
            else:  # one sqrt, exp and erfc per unit, bounded so that nothing overflows
                assert var is not None
                var = torch.exp(-var.sqrt())
                mean = torch.special.erfc(mean)
        assert var is not None
        return mean, var
    return run


def _floor_activation(mean: torch.Tensor, var: torch.Tensor, slope: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled floor's stand-in for a Leaky-ReLU: one square root, one division and one
    exponential per unit (r = μ/√v, then r and exp(−|r|), bounded)."""
    ratio = mean / var.sqrt()
    return ratio, torch.exp(-ratio.abs())


def _floor_pass(x: torch.Tensor, plan: inference.InferencePlan, tensors: list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled pass (:func:`~uqbench.methods.moments.inference.planned_pass`) with
    :func:`_floor_activation` at each hidden unit, fused by the compiler into one loop."""
    return inference.planned_pass(x, plan, tensors, activation=_floor_activation)


@functools.cache
def _compiled_floor_pass() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return compile_specialised(_floor_pass, inference.COMPILE_OPTIONS, specialize_float=True)


def compiled_floor(bnn: BayesianMLP
                   ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """x (B, 1) → what no exact compiled pass can drop: the compiled pass's matrix products
    (three for a hidden layer) and, per hidden unit, the square root and division that
    t = μ/σ needs and the exponential that φ needs, compiled as the pass is (the widths
    fixed, multiply-adds fused). An exact erfc costs a division or an exponential more (the
    pass's: the fitted erfcx's division), and its closed forms about forty multiply-adds,
    which this leaves out. What it computes is not a moment; its time is a floor for the
    compiled pass."""
    plan, tensors = inference.inference_plan(bnn.net)
    return functools.partial(_compiled_floor_pass(), plan=plan, tensors=tensors)


def _fastbnns() -> SimpleNamespace | None:
    """fastbnns' converter, propagators and moment type (None when it is not installed)."""
    try:
        from fastbnns.bnn import inference
        from fastbnns.bnn.base import BNN
        from fastbnns.bnn.types import MuVar
    except ImportError:
        return None
    return SimpleNamespace(inference=inference, BNN=BNN, MuVar=MuVar)


def _analytic(fb: SimpleNamespace, net: nn.Sequential) -> nn.Module:
    """fastbnns' conversion of ``net`` with its analytic Leaky-ReLU moment propagator."""
    return fb.BNN(copy.deepcopy(net), wrapper_kwargs_type={
        "LeakyReLU": {"moment_propagator": fb.inference.LeakyReLUa()}}).eval()


def fastbnns_models(plain: nn.Sequential) -> dict[str, Callable[[torch.Tensor], object]] | None:
    """fastbnns' conversions of ``plain`` (None when fastbnns is not installed):
    analytic (its Leaky-ReLU moment propagator), unscented (its default for Leaky-ReLU) and
    Monte Carlo factories keyed by S."""
    fb = _fastbnns()
    if fb is None:
        return None
    analytic = _analytic(fb, plain)
    unscented = fb.BNN(copy.deepcopy(plain)).eval()
    out: dict[str, Callable[[torch.Tensor], object]] = {
        "analytic": lambda x: analytic(fb.MuVar(x)), "unscented": lambda x: unscented(fb.MuVar(x))}
    for s in (10, 100, 1000):
        mc = fb.BNN(copy.deepcopy(plain), wrapper_kwargs_type={
            "Linear": {"moment_propagator": fb.inference.MonteCarlo(n_samples=s)},
            "LeakyReLU": {"moment_propagator": fb.inference.MonteCarlo(n_samples=s)}}).eval()
        out[f"mc{s}"] = (lambda m: lambda x: m(fb.MuVar(x)))(mc)
    return out


def speed(device: torch.device, repeats: int, batch: int = 1024, quick: bool = False
          ) -> list[Record]:
    """The speed figures for both networks, on one CPU thread: at two, the plain forward's
    own time differs up to 2× from one process to the next (the same 1→1024→1 forward took
    0.47 ms in one run and 1.2 ms in the next), and every ratio over it with it."""
    records: list[Record] = []
    with one_thread(device):
        for label, (width, depth) in ({"1→8→8→1": (8, 2)} if quick else NETS).items():
            records += _speed_one(label, width, depth, device, repeats, batch, quick)
    return records


def _speed_one(label: str, width: int, depth: int, device: torch.device, repeats: int,
               batch: int, quick: bool) -> list[Record]:
    dev = str(device)
    # the fastest path: compiled (quick runs skip the ~20 s compile and time the fused pass)
    bnn = build_bnn(width, depth, device, compile=not quick)
    plain = plain_twin(bnn)
    x = torch.linspace(-2, 2, batch, device=device).unsqueeze(1)
    calls: dict[str, Callable[[], object]] = {
        "plain": functools.partial(plain, x), "ours": functools.partial(bnn.moment_pass, x),
        "eager": functools.partial(build_bnn(width, depth, device).moment_pass, x),
        "reference": functools.partial(build_bnn(width, depth, device, fused=False).moment_pass,
                                       x),
        "floor": functools.partial(eager_floor(build_bnn(width, depth, device)), x)}
    if not quick:
        calls["compiled_floor"] = functools.partial(compiled_floor(bnn), x)
    anchors = fastbnns_models(plain)
    if anchors is not None:
        calls.update({k: functools.partial(anchors[k], x) for k in ("analytic", "unscented")})
    # the targeted passes (ours compiled and eager, and the analytic anchor, each over the
    # plain forward) in a block of their own, in more rounds than the untargeted passes, which
    # are timed after it; each timed call warm, after a call of itself (as a loop over batches
    # runs it), the untargeted ones cold, each after another pass
    pair = [k for k in ("plain", "ours", "eager", "analytic") if k in calls]
    with torch.no_grad():
        t = side_by_side({k: calls[k] for k in pair}, device, repeats=PAIR_REPEATS * repeats,
                         warmup=3, rounds=PAIR_ROUNDS, warm=1)
        rest = side_by_side({k: v for k, v in calls.items() if k not in ("analytic", "eager")},
                            device, repeats=repeats, warmup=3, rounds=FAST_ROUNDS)
    ratio = {k: v / t["plain"] for k, v in t.items()}
    rest_ratio = {k: v / rest["plain"] for k, v in rest.items()}  # rounds of the second block
    skipped = "fastbnns not installed: anchor skipped" if anchors is None else ""
    return [
        Record(f"moment pass / plain forward, {label}", ratio["ours"], "×", dev,
               anchor="fastbnns analytic", anchor_value=ratio.get("analytic"),
               target=None if anchors is None else ratio["analytic"] / 3,
               target_rule="fastbnns analytic / 3", section=SECTION_SPEED,
               note=skipped or f"method.compile: true (compile time excluded); plain forward "
                                f"{_ms(t['plain'])}"),
        Record(f"moment pass / plain forward, {label} (vs unscented)", rest_ratio["ours"], "×",
               dev, anchor="fastbnns unscented", anchor_value=rest_ratio.get("unscented"),
               section=SECTION_SPEED, note=skipped or "timed with the untargeted passes below, "
               "not in the targeted pair's block"),
        Record(f"moment pass / plain forward, {label}, fused without compile (default)",
               ratio["eager"], "×", dev, anchor="fastbnns analytic",
               anchor_value=ratio.get("analytic"),
               target=None if anchors is None else ratio["analytic"] / 3,
               target_rule="fastbnns analytic / 3", section=SECTION_SPEED,
               note=skipped or "method.fused: true, method.compile: false; timed in the "
                               "targeted block, beside the compiled pass and the anchor"),
        Record(f"moment pass / plain forward, {label}, reference layers",
               rest_ratio["reference"], "×", dev, section=SECTION_SPEED,
               note="method.fused: false"),
        Record(f"eager floor / plain forward, {label}: the linear layers' products and one "
               f"sqrt, exp and erfc per hidden unit", rest_ratio["floor"], "×", dev,
               section=SECTION_SPEED,
               note="what an eager pass that calls ATen's sqrt, exp and erfc once per unit "
                    "cannot go under (the fused eager pass: those calls and ~20 elementwise "
                    "passes); timed with the untargeted passes"),
        *([] if quick else [Record(
            f"compiled floor / plain forward, {label}: the compiled pass's matrix products and "
            f"one sqrt, division and exp per hidden unit in one loop", rest_ratio["compiled_floor"],
            "×", dev, section=SECTION_SPEED,
            note="what a compiled pass that needs σ, t = μ/σ and φ per unit cannot go under (the "
                 "compiled pass: those, the fitted erfc's division and about forty "
                 "multiply-adds per unit); timed with the untargeted passes")]),
        *mc_speed(bnn, x, anchors, label, device, quick)]


def _ms(t: Measured) -> str:
    """A time in ms with its interval over the rounds."""
    low, high = t.interval
    return f"{t * 1e3:.3g} ms [{low * 1e3:.3g}, {high * 1e3:.3g}]"


def mc_speed(bnn: BayesianMLP, x: torch.Tensor, anchors: dict | None, label: str,
             device: torch.device, quick: bool) -> list[Record]:
    """Monte Carlo inference with S draws / one moment pass, ours and fastbnns' (at S ≤ 100:
    its Monte Carlo draws in a Python loop, one call at S = 1000 takes seconds to tens of
    seconds, and S = 10 and 100 already give its ratio). One call per round: no target."""
    records = []
    ours = moment_pass(bnn)  # compiled: the figure above
    for s in (10, 100) if quick else (10, 100, 1000):
        anchor = anchors[f"mc{s}"] if anchors is not None and s in MC_ANCHORED else None
        fns: dict[str, Callable[[], object]] = {
            "moments": functools.partial(ours, x), "mc": functools.partial(bnn._draws, x, s)}
        if anchor is not None:
            fns["anchor"] = functools.partial(anchor, x)
        with torch.no_grad():
            t = side_by_side(fns, device, repeats=ROUNDS, warmup=1)
        note = ("fastbnns not installed" if anchors is None else "" if anchor is not None else
                f"fastbnns at S ≤ {max(MC_ANCHORED)} only (one call takes seconds here)")
        records.append(Record(
            f"Monte Carlo S = {s} / moment pass, {label}", t["mc"] / t["moments"], "×",
            str(device), anchor=f"fastbnns Monte Carlo S = {s}" if anchor is not None else None,
            anchor_value=t["anchor"] / t["moments"] if anchor is not None else None,
            section=SECTION_SPEED, note=note))
    return records


def _rel(est: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (est - ref).abs() / ref


def unit_accuracy(device: torch.device, reference: int = 200_000, trials: int = 20
                  ) -> list[Record]:
    """Relative error of Var[leaky_relu(z)], z ~ N(t, 1), against a ``reference``-draw Monte
    Carlo estimate, t = μ/σ over [−40, 40]: the median over t in the body (|t| ≤ 3) and the
    tails (3 < |t| ≤ 40). Monte Carlo with S draws: root-mean-square over ``trials`` repeats."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    t = torch.tensor([-40, -20, -10, -6, -4, -3, -2, -1, -0.5, 0, 0.5, 1, 2, 3, 4, 6, 10, 20, 40],
                     dtype=torch.float64)
    act = nn.LeakyReLU(SLOPE)
    z = t[:, None] + torch.randn(len(t), reference, generator=gen, dtype=torch.float64)
    ref = act(z).var(1)
    floor = math.sqrt(2 / reference)  # relative standard error of a Gaussian-like variance
    body, tails = t.abs() <= 3, t.abs() > 3
    errors: dict[str, torch.Tensor] = {}
    _, ours = leaky_relu_moments(t, torch.ones_like(t), SLOPE)
    errors["uqbench moments"] = _rel(ours, ref)
    anchor = _fastbnns_unit(t)
    if anchor is not None:
        errors["fastbnns analytic"] = _rel(anchor, ref)
    for s in (10, 100, 1000):
        draws = t[:, None, None] + torch.randn(len(t), trials, s, generator=gen,
                                               dtype=torch.float64)
        est = act(draws).var(-1)                                              # (T, trials)
        errors[f"Monte Carlo S = {s}"] = ((_rel(est, ref[:, None]) ** 2).mean(1)).sqrt()
    records = []
    for name, err in errors.items():
        for region, mask in (("body |μ/σ| ≤ 3", body), ("tails 3 < |μ/σ| ≤ 40", tails)):
            records.append(Record(
                f"Var error, one Leaky-ReLU unit, {region}: {name}",
                100 * err[mask].median().item(), "%", str(device), section=SECTION_ACCURACY,
                note=f"median over μ/σ; max {100 * err[mask].max().item():.3g} %; the "
                     f"reference's own error ≈ {100 * floor:.2g} %"))
    return records


def _fastbnns_unit(t: torch.Tensor) -> torch.Tensor | None:
    """fastbnns' analytic Leaky-ReLU variance for inputs N(t, 1) (None if not installed)."""
    fb = _fastbnns()
    if fb is None:
        return None
    with torch.no_grad():
        out = _analytic(fb, nn.Sequential(nn.LeakyReLU(SLOPE)))(fb.MuVar(t.clone(),
                                                                         torch.ones_like(t)))
    return out.var


def network_accuracy(device: torch.device, reference: int = 200_000, inputs: int = 64,
                     quick: bool = False) -> list[Record]:
    """Relative error of the 1→64→64→1 BNN's predictive σ (at initialisation, ρ₀ = −2) against
    ``reference`` weight draws, on ``inputs`` points in [−2, 2]: moments and Monte Carlo S."""
    width, depth = (8, 2) if quick else NETS["1→64→64→1"]
    bnn = build_bnn(width, depth, device)
    x = torch.linspace(-2, 2, inputs, device=device).unsqueeze(1)
    torch.manual_seed(1)
    with torch.no_grad():
        mom = bnn(x, inference="moments")
        _, ref_var = bnn._mc_moments(x, reference, mom.mean.double())
        ref_sd = ref_var.sqrt()
        errors = {"uqbench moments": _rel(mom.var.double().sqrt(), ref_sd)}
        for s in (10, 100, 1000):
            draws = bnn._draws(x, s).double()
            errors[f"Monte Carlo S = {s}"] = _rel(draws.std(0), ref_sd)
    label = f"1→{width}→{width}→1"
    return [Record(f"σ error, network {label}: {name}", 100 * err.median().item(), "%",
                   str(device), section=SECTION_ACCURACY,
                   note=f"median over {inputs} inputs; max {100 * err.max().item():.3g} %")
            for name, err in errors.items()]


def _stepper(model: nn.Module, loss: Callable[[], torch.Tensor], settle: int = 0
             ) -> Callable[[], None]:
    """One optimiser step as the runner takes it: Adam (the trainer's default, lr 1e-2,
    foreach), zeroed gradients, the loss's backward. ``settle`` > 0: first that many steps
    train the model, then the learning rate is set to 0, so that every timed step computes
    the same thing (Adam's arithmetic included) where training took the model; the learned
    head's expectation takes a different path once the predicted variance leaves the
    Gauss–Hermite range, and steps that kept training drift from one path to the other
    within the measurement (2.5× → 3.5× a plain step over 200 steps at width 4)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()
    if settle:
        for _ in range(settle):
            step()
        for group in opt.param_groups:
            group["lr"] = 0.0
    return step


def training_step(device: torch.device, repeats: int, quick: bool = False) -> list[Record]:
    """P2's training step (the ELBO's moments by one moment pass, its backward and Adam) over
    a plain MLP's Gaussian-NLL step of the same width (1→width→2, mean and softplus variance),
    batch 100 as P2's, on one CPU thread as P2's runs; both variances, side by side, compiled
    (``method.compile: true``, the targeted rows; compilation happens in the settling steps,
    untimed) and as the default runs them (eager)."""
    dev, settle = str(device), 20 if quick else SETTLE_STEPS
    batch = 100
    x = torch.linspace(-1.5, 1.5, batch, device=device).unsqueeze(1)
    y = x ** 3 - x
    info = DataInfo("regression", in_dim=1, out_dim=1, num_train_batches=20)
    records = []
    with one_thread(device):
        for width in (4, 16) if quick else STEP_WIDTHS:
            fns: dict[str, Callable[[], object]] = {}
            for variance, compiled in itertools.product(("embedded", "learned"), (True, False)):
                torch.manual_seed(0)
                bnn = BayesianMLP(MLP(width=width, depth=1, slope=SLOPE), info,
                                  variance=variance, compile=compiled).to(device).train()
                fns[variance + ("" if compiled else "_eager")] = _stepper(
                    bnn, functools.partial(bnn.loss, (x, y)), settle)
            torch.manual_seed(0)
            plain = nn.Sequential(nn.Linear(1, width), nn.LeakyReLU(SLOPE),
                                  nn.Linear(width, 2)).to(device)

            def plain_loss(plain: nn.Module = plain) -> torch.Tensor:
                out = plain(x)
                return F.gaussian_nll_loss(out[:, :1], y, F.softplus(out[:, 1:]), full=True,
                                           eps=1e-8, reduction="sum")
            fns["plain"] = _stepper(plain, plain_loss, settle)
            t = side_by_side(fns, device, repeats=repeats, warmup=10, rounds=FAST_ROUNDS)
            note = (f"batch {batch}, 1 thread, Adam; timed after {settle} training steps, held "
                    f"there; plain step {_ms(t['plain'])}")
            for variance in ("embedded", "learned"):
                records.append(Record(
                    f"P2 training step / plain MLP step, 1→{width}→1, {variance}",
                    t[variance] / t["plain"], "×", dev, target=STEP_TARGET,
                    target_rule="P2's step goal", section=SECTION_STEP,
                    note=f"method.compile: true (compile time excluded); {note}"))
            for variance in ("embedded", "learned"):
                records.append(Record(
                    f"P2 training step / plain MLP step, 1→{width}→1, {variance}, without "
                    f"compile (default)", t[f"{variance}_eager"] / t["plain"], "×", dev,
                    section=SECTION_STEP, note="method.compile: false"))
    return records


@contextlib.contextmanager
def _eager_full_covariance(series: bool = False) -> Iterator[None]:
    """Inside, the full-covariance activations leave the compiled quadrature, whatever a
    call's size: the quadrature runs eagerly, or (``series``) the Mehler series runs as a
    training step runs it (its pair terms compiled where the matrix is large and
    the largest of :data:`~uqbench.methods.moments.pair_terms.COMPILED_TERMS` terms suffices)."""
    saved = covariance.COMPILE_PAIRS, covariance.SERIES
    covariance.COMPILE_PAIRS, covariance.SERIES = 2**62, series
    try:
        yield
    finally:
        covariance.COMPILE_PAIRS, covariance.SERIES = saved


def full_covariance(device: torch.device, quick: bool = False) -> list[Record]:
    """The full-covariance pass (``method.covariance: full``, no gradient: a scoring's pass)
    over the diagonal pass (fused, the default) of the same network and inputs, with its
    activations compiled (as they run from :data:`~uqbench.methods.moments.covariance.
    COMPILE_PAIRS` unit pairs in a call; compile time excluded) and eagerly, side by side on
    one thread; and eager over compiled. 1→256→256→256→1 at 64 inputs (quick: 1→64→64→64→1
    at as many inputs as make a compiled call)."""
    dev = str(device)
    width, depth = (64, 3) if quick else FULL_NET
    inputs = -(-covariance.COMPILE_PAIRS // (width * (width - 1) // 2)) if quick else FULL_INPUTS
    x = torch.linspace(-2, 2, inputs, device=device).unsqueeze(1)
    full = build_bnn(width, depth, device, covariance="full")
    diagonal = build_bnn(width, depth, device)  # the same weights

    def eager(series: bool = False) -> object:
        with _eager_full_covariance(series):
            return full.moment_pass(x)
    with one_thread(device), torch.no_grad():
        t = side_by_side({"diagonal": functools.partial(diagonal.moment_pass, x),
                          "compiled": functools.partial(full.moment_pass, x), "eager": eager,
                          "series": functools.partial(eager, series=True)},
                         device, repeats=2 if quick else FULL_ROUNDS, warmup=1,
                         rounds=FULL_ROUNDS)
    label = f"1→{width}→{width}→{width}→1, {inputs} inputs"
    note = (f"{width * (width - 1) // 2 * inputs:,} unit pairs per activation and call; "
            f"diagonal pass {_ms(t['diagonal'])}")
    return [
        Record(f"full pass / diagonal pass, {label}, compiled (a scoring's default)",
               t["compiled"] / t["diagonal"], "×", dev, section=SECTION_FULL,
               note=f"compile time excluded; {note}"),
        Record(f"full pass / diagonal pass, {label}, eager", t["eager"] / t["diagonal"], "×",
               dev, section=SECTION_FULL, note=note),
        Record(f"full pass eager / compiled, {label}", t["eager"] / t["compiled"], "×", dev,
               section=SECTION_FULL, note=f"compiled pass {_ms(t['compiled'])}"),
        Record(f"full pass / diagonal pass, {label}, Mehler series (a training step's form)",
               t["series"] / t["diagonal"], "×", dev, section=SECTION_FULL,
               note=f"the curvature term by its series where |ρ| ≤ {mehler.MAX_RHO:g} (the "
                    f"quadrature beyond), as a training step runs it; {note}")]


SECTION_TRAINING = "Full covariance: a P2 training run (one thread)"
TRAINING_NET = (64, 3)          # width, depth: P2's depth-3 networks at width 64
TRAINING_TARGET = 120.0         # seconds for the run with the default epochs
WARMUP_EPOCHS = 10              # the warm-up run's: its series programs of both term counts
_EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+) .*elapsed ([\d.]+)s")


def full_training(device: torch.device, quick: bool = False) -> list[Record]:
    """A ``method.covariance: full`` training run of P2's depth-3, width-64 BNN (embedded
    variance, seed 0, the trainer's default epochs), as ``uqbench experiment=p2_depth_full``
    runs it (one thread, the final scoring with its Monte Carlo check included), in a
    subprocess with its runs in a temporary folder: its wall time in seconds. A
    :data:`WARMUP_EPOCHS`-epoch run of the same command goes first, so that the timed run
    finds its compiled programs in torch's on-disk cache, as every run after a machine's first
    does (the pair terms' programs of both term counts among them: the larger count's first
    call comes in the sixth epoch; the warm-up's own wall time, with any first compilation, is
    in the note). The rounds are the run's wall time with
    its epochs after the first re-projected from each stretch of epochs between the run's log
    lines (the stretch's seconds per epoch times those epochs, plus the rest of the run as
    measured: start, the first epoch, the last scoring), so the interval says how steady the
    epochs ran. Quick: a width-16 network for 20 epochs (no target)."""
    width, depth = (16, 3) if quick else TRAINING_NET
    extra = ["trainer.epochs=20", "trainer.log_every=4"] if quick else []
    warm = _training_run(width, depth, [f"trainer.epochs={WARMUP_EPOCHS}"])[0]
    wall, log = _training_run(width, depth, extra)
    lines = [tuple(map(float, m.groups())) for m in _EPOCH_LINE.finditer(log)]
    if len(lines) < 2:
        raise RuntimeError(f"the full-covariance training run logged {len(lines)} epoch lines, "
                           f"two or more needed:\n{log[-2000:]}")
    (first, epochs, start), last = lines[0], lines[-1]
    rest = wall - (last[2] - start)                 # start-up, epochs up to the first line, end
    rounds = [(b[2] - a[2]) / (b[0] - a[0]) * (epochs - first) + rest
              for a, b in itertools.pairwise(lines)]
    return [Record(
        f"full-covariance training, depth {depth}, width {width} (seconds)", Measured(rounds),
        "s", str(device), target=None if quick else TRAINING_TARGET,
        target_rule="a run within 120 s", section=SECTION_TRAINING,
        note=f"method.covariance: full, {int(epochs)} epochs of batch 100, one thread; run "
             f"wall time {wall:.0f} s, of which {rest:.0f} s before epoch {int(first)}'s end "
             f"and after the last; rounds: the run's time from each of its {len(rounds)} "
             f"stretches of epochs; after a {WARMUP_EPOCHS}-epoch run of the same command "
             f"({warm:.0f} s) that leaves its compiled programs in torch's on-disk cache")]


def _training_run(width: int, depth: int, extra: list[str]) -> tuple[float, str]:
    """``uqbench experiment=p2_depth_full`` at this width and depth (embedded variance, seed
    0, W&B off) in a subprocess with its runs in a temporary folder: its wall time and log."""
    with tempfile.TemporaryDirectory() as runs:
        command = [sys.executable, "-m", "uqbench.runner.cli", "experiment=p2_depth_full",
                   f"backbone.depth={depth}", f"backbone.width={width}",
                   "method.variance=embedded", "seed=0", "hydra.mode=RUN",
                   f"paths.runs_dir={runs}", f"hydra.run.dir={runs}/hydra",
                   "trainer.progress=lines", *extra]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              env={**os.environ, "WANDB_MODE": "disabled"})
        wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"the full-covariance training run failed ({done.returncode}):\n{tail}")
    return wall, done.stdout + done.stderr


def run(device: torch.device, repeats: int, quick: bool = False,
        done: Callable[[list[Record]], None] = lambda rows: None) -> list[Record]:
    """Every figure of this part; ``done`` is called with each group's rows as they are
    measured (the caller writes them, so a crash keeps them and the log shows the time)."""
    reference = 20_000 if quick else 200_000
    groups: list[Callable[[], list[Record]]] = [
        lambda: speed(device, repeats, batch=64 if quick else 1024, quick=quick),
        lambda: training_step(device, repeats=4 * repeats, quick=quick),
        lambda: full_covariance(device, quick=quick),
        lambda: full_training(device, quick=quick),
        lambda: unit_accuracy(device, reference=reference, trials=5 if quick else 20),
        lambda: network_accuracy(device, reference=reference, inputs=16 if quick else 64,
                                 quick=quick)]
    records: list[Record] = []
    for group in groups:
        rows = group()
        records += rows
        done(rows)
    return records
