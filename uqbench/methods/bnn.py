"""Sampling-free variational Bayesian network with embedded or learned variance.

The network is the backbone's own: a tabular backbone (the MLP) builds its deterministic
feature network, (B, in) → (B, feature_dim), and the BNN converts it layer by layer into its
moment-propagating twin (nn.Linear → GaussianLinear, nn.LeakyReLU / nn.ReLU → MomentLeakyReLU)
and adds a Gaussian output layer.

``variance: embedded`` — one output per target; its propagated variance *is* the total predictive
variance (aleatoric noise is absorbed by the parameter variances).
``variance: learned`` — a second output per target, a₂, gives the aleatoric variance through
``variance_link`` (softplus | exp); total variance = that + the propagated variance of the first
output. Moment inference takes E[link(a₂)] under a₂'s propagated Gaussian (exact for that
Gaussian, :func:`~uqbench.methods.moments.links.expected_link`); Monte Carlo averages link(a₂)
over the sampled weight sets, so both estimate the same quantity.

The loss is the negative ELBO: Σ_batch GaussianNLL(y; mean, var) + β·KL(q ‖ prior), with
β = kl_scale / batches per epoch unless ``kl_weight`` sets it, and the prior N(0, prior_std²) per
weight (``prior: fixed``) or N(0, prior_std²/fan_in) (``prior: fan_in``). ``training: moments``
takes mean and var from one analytic pass; ``training: sampling`` estimates them from
``train_samples`` reparameterised weight draws (the same ELBO, only how its moments are obtained
differs). Prediction uses ``inference: moments`` or ``inference: mc`` (S sampled weight sets).
:meth:`BayesianMLP.diagnostics` compares the two inferences on a run's test inputs.

How the analytic pass is computed (:meth:`BayesianMLP.moment_pass`) changes its speed, not its
numbers (they agree to rounding, gradients included): ``fused: true`` evaluates the same closed
forms with fewer passes over memory (``forward_fused`` of :mod:`uqbench.methods.moments.layers`),
``fused: false`` runs the reference layers; ``compile: true`` also runs it through torch.compile:
the training loss of ``training: moments`` with the diagonal pass (the fused pass, the KL, the
variance head and the NLL, with their backward, as one compiled graph shared by every network of
the same depth and variance) and inference passes. A P2
training step of a hundred rows is a few hundred small operations, which compiled code runs
as a few loops; the compilation takes seconds (tens cold) once per process and structure.

``covariance: diagonal`` (default, P2's) treats a layer's units as independent; ``full`` carries
their covariances from layer to layer as deterministic variational inference does (Wu et al.,
ICLR 2019; :mod:`uqbench.methods.moments.covariance`), for the loss's and predictions' moments.
``covariance``, ``inference``, ``mc_samples`` and ``check_samples`` are how trained weights
predict, not what they learned: a scoring job (``job=eval``) may set them (``scoring_options``).

Longer than most modules: the two variance heads, the two training estimates, the inference
options and the checks against Monte Carlo share one class and its validation of options.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from uqbench.backbones.mlp import MLP
from uqbench.configs import options_with
from uqbench.contracts import Batch, DataInfo, RegressionOutput
from uqbench.methods.base import Method
from uqbench.methods.moments.compiling import compile_dynamic
from uqbench.methods.moments.inference import compiled_inference, eager_inference
from uqbench.methods.moments.layers import (
    FULL_RULES,
    PRIORS,
    GaussianLinear,
    MomentLeakyReLU,
    MomentModule,
    MomentReLU,
    MomentSequential,
    full_pass,
)
from uqbench.methods.moments.links import LINKS, apply_link, expected_link
from uqbench.methods.moments.mixture import LinkSplit, last_activation, mix, mixture_moments
from uqbench.methods.moments.step import Plan, fusable, fused_plan, planned_moments_and_kl

VARIANCES = ("embedded", "learned")
INFERENCES = ("moments", "mc")
TRAININGS = ("moments", "sampling")
COVARIANCES = ("diagonal", "full", "mixture")
CONVERTS = "nn.Linear (with a bias), nn.LeakyReLU, nn.ReLU"
PASS_COST_ROUNDS = 3  # diagnostics: rounds of the full-vs-diagonal pass timing (median)
CHECK_CHUNK_ELEMENTS = 2**22  # diagnostics: drawn weights + activations per MC chunk (cache-sized)
CHECK_GROUPS = 20  # diagnostics: groups of draws for the jackknife error of mc_std_ratio


def check_options(variance: str = "embedded", inference: str = "moments",
                  variance_link: str = "softplus", prior: str = "fixed",
                  training: str = "moments", mc_samples: int = 200, train_samples: int = 16,
                  check_samples: int = 2000, prior_std: float = 1.0, kl_scale: float = 1.0,
                  kl_weight: float | None = None, fused: bool = True, compile: bool = False,
                  covariance: str = "diagonal", mixture_modes: int = 2, mixture_nodes: int = 8,
                  mixture_link_nodes: int = 8, **_: Any) -> None:
    """Refuse a setting the BNN cannot use, naming the value and the valid choices; the
    runner calls it (through :meth:`BayesianMLP.check_settings`) before anything is built."""
    for key, value, choices in (("variance", variance, VARIANCES),
                                ("inference", inference, INFERENCES),
                                ("variance_link", variance_link, LINKS),
                                ("prior", prior, PRIORS),
                                ("training", training, TRAININGS),
                                ("covariance", covariance, COVARIANCES)):
        if value not in choices:
            raise ValueError(f"method.{key} '{value}' is not one of {choices}")
    if covariance != "diagonal" and training != "moments":
        raise ValueError(f"method.covariance: {covariance} propagates the loss's moments "
                         f"analytically; "
                         f"method.training '{training}' draws weights instead. Set "
                         f"method.training: moments, or method.covariance: diagonal")
    if not (prior_std > 0 and math.isfinite(prior_std)):
        raise ValueError(f"method.prior_std must be a positive number, got {prior_std}")
    if mc_samples < 2:
        raise ValueError(f"method.mc_samples must be >= 2, got {mc_samples}")
    if train_samples < 2:  # the predictive variance needs a sample variance
        raise ValueError(f"method.train_samples must be >= 2, got {train_samples}")
    if check_samples != 0 and check_samples < 2:
        raise ValueError(f"method.check_samples must be 0 (off) or >= 2, got {check_samples}")
    if not (kl_scale >= 0 and math.isfinite(kl_scale)):
        raise ValueError(f"method.kl_scale must be a finite number >= 0, got {kl_scale}")
    if kl_weight is not None and kl_weight < 0:
        raise ValueError(f"method.kl_weight must be >= 0 or null, got {kl_weight}")
    for key, flag in (("fused", fused), ("compile", compile)):
        if not isinstance(flag, bool):
            raise ValueError(f"method.{key} must be true or false, got {flag!r}")
    if compile and not fused:
        raise ValueError("method.compile: true compiles the fused moment pass; set "
                         "method.fused: true, or method.compile: false for the reference path")
    if compile and covariance != "diagonal":
        raise ValueError(f"method.compile: true compiles the diagonal moment pass only; with "
                         f"method.covariance: {covariance} set method.compile: false")
    for key, count in (("mixture_modes", mixture_modes), ("mixture_nodes", mixture_nodes)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"method.{key} must be an integer >= 1, got {count!r}")
    if isinstance(mixture_link_nodes, bool) or not isinstance(mixture_link_nodes, int) \
            or mixture_link_nodes < 0:
        raise ValueError(f"method.mixture_link_nodes must be an integer >= 0 (0: a₂ closed as "
                         f"one Gaussian), got {mixture_link_nodes!r}")


def tabular_backbones() -> str:
    """The backbone configs the BNN builds on: the MLPs, the only ones with a hidden width."""
    return ", ".join(options_with("backbone", "width")) or "<no MLP backbone configs found>"


def moment_twin(module: nn.Module, prior_std: float, rho_init: float,
                prior: str = "fixed") -> MomentModule | None:
    """The moment-propagating twin of one deterministic layer, with fresh μ and ρ, or None.

    nn.Linear(in, out) → GaussianLinear(in, out): moments (B, in) → (B, out);
    nn.LeakyReLU(a) → MomentLeakyReLU(a), nn.ReLU → MomentReLU: elementwise, shape kept.
    """
    if isinstance(module, nn.Linear) and module.bias is not None:
        return GaussianLinear(module.in_features, module.out_features, prior_std, rho_init,
                              prior)
    if isinstance(module, nn.LeakyReLU):
        return MomentLeakyReLU(module.negative_slope)
    if isinstance(module, nn.ReLU):
        return MomentReLU()
    return None


class BayesianMLP(Method):
    """A mean-field Gaussian twin of the backbone's network plus a Gaussian output layer.

    Moments (B, in) → (B, feature_dim) through the converted backbone layers, then
    (B, out) or, learned variance, (B, 2·out) through the output layer. Every parameter trains.

    ``fused`` (default true): the moment pass uses the fused formulas, equal to the reference
    layers' to rounding, gradients included, and faster at every size measured; false: the
    reference layers. ``compile`` (default false; needs ``fused``): the training loss and the
    inference passes run through torch.compile (module docstring); worth it for a run of
    thousands of steps, not for a short one, whose compilation (seconds, tens of seconds cold)
    would outweigh what it saves.
    """

    task = "regression"
    speed_options: tuple[str, ...] = ("fused", "compile")  # not part of a run's identity
    scoring_options: tuple[str, ...] = ("covariance", "mixture_modes", "mixture_nodes",
                                        "mixture_link_nodes",
                                        "inference", "mc_samples", "check_samples")

    def __init__(self, backbone: MLP, info: DataInfo, name: str = "bnn",
                 variance: str = "embedded", inference: str = "moments", mc_samples: int = 200,
                 prior_std: float = 1.0, rho_init: float = -2.0, kl_weight: float | None = None,
                 min_var: float = 1e-8, variance_link: str = "softplus", prior: str = "fixed",
                 kl_scale: float = 1.0, training: str = "moments", train_samples: int = 16,
                 check_samples: int = 2000, fused: bool = True, compile: bool = False,
                 covariance: str = "diagonal", mixture_modes: int = 2,
                 mixture_nodes: int = 8, mixture_link_nodes: int = 8) -> None:
        super().__init__()
        check_options(variance=variance, inference=inference, variance_link=variance_link,
                      prior=prior, training=training, mc_samples=mc_samples,
                      train_samples=train_samples, check_samples=check_samples,
                      prior_std=prior_std, kl_scale=kl_scale, kl_weight=kl_weight,
                      fused=fused, compile=compile, covariance=covariance,
                      mixture_modes=mixture_modes, mixture_nodes=mixture_nodes,
                      mixture_link_nodes=mixture_link_nodes)
        modality = getattr(backbone, "modality", None)
        if modality != "tabular":
            raise ValueError(
                f"method '{name}' propagates moments through a tabular backbone's network; "
                f"'{getattr(backbone, 'name', backbone)}' has modality {modality!r}. Pick one of: "
                f"{tabular_backbones()}")
        self.name = name
        self.variance, self.inference = variance, inference
        self.variance_link, self.prior = variance_link, prior
        self.training_mode = training  # not `training`: nn.Module's train/eval flag
        self.mc_samples = int(mc_samples)
        self.train_samples, self.check_samples = int(train_samples), int(check_samples)
        self.kl_scale = float(kl_scale)
        self.kl_weight = (self.kl_scale / info.num_train_batches if kl_weight is None
                          else float(kl_weight))
        self.min_var = float(min_var)
        # speed only: the same moments to rounding (not `compile`: nn.Module's own method)
        self.fused, self.compiled = fused, compile
        self.covariance = covariance
        self.mixture_modes, self.mixture_nodes = int(mixture_modes), int(mixture_nodes)
        self.mixture_link_nodes = int(mixture_link_nodes)
        self.out_dim = int(info.out_dim or 1)
        outputs = self.out_dim * (2 if variance == "learned" else 1)
        # The deterministic network only describes the layers: on the meta device it holds no
        # memory and draws no random numbers, so the twin's initialisation is all that does.
        with torch.device("meta"):
            net = backbone.build(int(info.in_dim or 1))
        if not isinstance(net, nn.Sequential):
            raise ValueError(f"method '{name}' converts an nn.Sequential layer by layer; backbone "
                             f"'{backbone.name}' built a {type(net).__name__}. Backbones that "
                             f"work: {tabular_backbones()}")
        layers: list[MomentModule] = []
        for child, module in net.named_children():
            twin = moment_twin(module, prior_std, rho_init, prior)
            if twin is None:
                raise ValueError(
                    f"method '{name}' cannot convert layer {child} ({module!r}) of backbone "
                    f"'{backbone.name}' into a moment-propagating layer; it converts "
                    f"{CONVERTS}. Backbones that work: {tabular_backbones()}")
            layers.append(twin)
        layers.append(GaussianLinear(backbone.feature_dim, outputs, prior_std, rho_init, prior))
        if covariance != "diagonal" and (
                bad := [type(m).__name__ for m in layers if not m.full_rule]):
            raise ValueError(f"method.covariance: {covariance} needs a covariance rule in every "
                             f"layer; "
                             f"{bad[0]} has none (those with one: {FULL_RULES})")
        self.net = MomentSequential(*layers)
        self._one_node = fusable(self.net)  # the training loss's moments and KL in one node

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """The choices and ranges of the config, before anything is read, built or written."""
        check_options(**settings)

    @classmethod
    def check_train(cls, settings: dict[str, Any]) -> None:
        """A training job's refusals: ``covariance: mixture`` scores trained weights only (its
        eigendecomposition has no gradient where a layer's covariance has repeated
        eigenvalues); it is run by ``job=eval`` on weights trained with full or diagonal."""
        if settings.get("covariance") == "mixture":
            raise ValueError("method.covariance: mixture is a scoring option, not a training "
                             "one: train with method.covariance: full (or diagonal), then score "
                             "with job=eval method.covariance=mixture eval_run=<the run>")

    def settings(self) -> dict[str, Any]:
        return {"variance": self.variance, "inference": self.inference,
                "variance_link": self.variance_link, "prior": self.prior,
                "kl_scale": self.kl_scale, "kl_weight": self.kl_weight,
                "training": self.training_mode, "train_samples": self.train_samples,
                "check_samples": self.check_samples, "covariance": self.covariance,
                # the mixture's sizes act only with it
                **({"mixture_modes": self.mixture_modes, "mixture_nodes": self.mixture_nodes}
                   if self.covariance == "mixture" else {}),
                # and the noise term's split only with a learned variance
                **({"mixture_link_nodes": self.mixture_link_nodes}
                   if self.covariance == "mixture" and self.variance == "learned" else {})}

    # -- moments: one analytic pass ----------------------------------------------------------
    def moment_pass(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance (B, outputs) of the network's output for inputs x (B, in), as
        ``fused`` and ``compile`` choose to compute them (every choice gives the same moments
        to rounding); no min_var, no link: the raw moment propagation. ``covariance: full``
        carries the covariances between units through the hidden layers; ``mixture`` also
        splits the last activation's input into a Gaussian mixture
        (:mod:`~uqbench.methods.moments.mixture`), whose moments are mixed here."""
        if self.covariance == "mixture":
            return mix(*self._components(x)[:3])
        if self.covariance == "full":
            return self.net.forward_full(x, fused=self.fused)[:2]
        if not self.fused:
            return self.net(x, torch.zeros_like(x))  # deterministic input: v = 0
        if self.compiled and not torch.is_grad_enabled():
            if fusable(self.net):
                return compiled_inference(self.net, x)
            # a copy, not a view: a view's base (a split's tensor) would enter the graph's
            # guards, and the next split's size would compile the pass again
            return _compiled_fused_pass()(self.net, x.clone())
        return eager_inference(self.net, x)

    def _moments(self, x: torch.Tensor) -> RegressionOutput:
        if self.covariance == "mixture":
            return self._mixed_head(*self._components(x))
        return self._head(*self.moment_pass(x))

    def _components(self, x: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``covariance: mixture``: the output moments per component (B, N, outputs), the
        components' weights (N,), and (learned variance, ``mixture_link_nodes`` > 0) the noise
        term E[link(a₂)] (B, out) by the split along a₂'s direction, else None."""
        link = (LinkSplit(self.out_dim, self.variance_link, self.mixture_link_nodes)
                if self.variance == "learned" and self.mixture_link_nodes > 0 else None)
        return mixture_moments(list(self.net), x, self.mixture_modes, self.mixture_nodes,
                               fused=self.fused, link=link)

    def _mixed_head(self, mean: torch.Tensor, var: torch.Tensor, weights: torch.Tensor,
                    noise: torch.Tensor | None = None) -> RegressionOutput:
        """The predictive moments of a mixture's components (B, N, outputs), weights (N,): the
        first d outputs' mean and variance mixed (law of total variance), and (learned) the
        noise term: ``noise`` (B, d) where the split computed it, else the weighted mean over
        the components of E[link(a₂)] under each one's Gaussian."""
        d = self.out_dim
        mu, epistemic = mix(mean[..., :d], var[..., :d], weights)
        if self.variance == "embedded":
            return RegressionOutput(mu, epistemic + self.min_var)
        if noise is None:
            noise = (weights.view(1, -1, 1) * expected_link(
                self.variance_link, mean[..., d:], var[..., d:])).sum(1)
        aleatoric = noise + self.min_var
        return RegressionOutput(mu, epistemic + aleatoric, aleatoric)

    def _head(self, mean: torch.Tensor, var: torch.Tensor) -> RegressionOutput:
        """The predictive moments from the raw output moments (B, outputs)."""
        return _predictive(mean, var, self.out_dim, self.variance, self.variance_link,
                           self.min_var)

    # -- Monte Carlo: S sampled weight sets ------------------------------------------------
    def _draws(self, x: torch.Tensor, samples: int) -> torch.Tensor:
        """(B, in) → (S, B, outputs): the network under S independent weight draws
        (reparameterised: gradients reach μ and ρ)."""
        return self.net.forward_sampled(x.expand(samples, *x.shape))

    def _from_draws(self, out: torch.Tensor, unbiased: bool) -> RegressionOutput:
        """Predictive moments (B, out) from draws (S, B, outputs): mean and variance over the
        draws of output 1, plus (learned) the mean over the draws of link(output 2)."""
        d = self.out_dim
        mean, epistemic = out[..., :d].mean(0), out[..., :d].var(0, unbiased=unbiased)
        if self.variance == "embedded":
            return RegressionOutput(mean, epistemic + self.min_var)
        aleatoric = apply_link(self.variance_link, out[..., d:]).mean(0) + self.min_var
        return RegressionOutput(mean, epistemic + aleatoric, aleatoric)

    def _sampled(self, x: torch.Tensor) -> RegressionOutput:
        return self._from_draws(self._draws(x, self.mc_samples), unbiased=False)

    def forward(self, x: torch.Tensor, inference: str | None = None) -> RegressionOutput:
        """(B, in) → predictive mean and variances of shape (B, out)."""
        mode = inference or (self.inference if not self.training else "moments")
        return self._sampled(x) if mode == "mc" else self._moments(x)

    loss_sums_examples = True  # the ELBO of a batch: its NLL summed, plus β·KL once

    def loss(self, batch: Batch, share: float = 1.0) -> torch.Tensor:
        """Σ NLL over the batch + β·KL; a micro-batch that is ``share`` of its optimiser step
        adds that share of β·KL, so the micro-batches of a step add up to the step's ELBO.

        The NLL's mean and var come from one moment pass (``training: moments``) or from
        ``train_samples`` weight draws (``training: sampling``; unbiased sample variance)."""
        x, y = batch
        if self._fused_loss():
            # the fused pass and the KL as one autograd node: the same numbers, fewer ops
            elbo = _compiled_elbo_terms() if self.compiled else _elbo_terms
            nll, kl = elbo(x, y, *fused_plan(self.net), self.out_dim, self.variance,
                           self.variance_link, self.min_var)
        else:
            out = (self._from_draws(self._draws(x, self.train_samples), unbiased=True)
                   if self.training_mode == "sampling" else self._moments(x))
            nll, kl = _nll(out, y), self.net.kl()
        return nll + self.kl_weight * share * kl

    def _fused_loss(self) -> bool:
        """Whether the training loss takes the fused node (moments and KL in one)."""
        return (self.training_mode == "moments" and self.covariance == "diagonal"
                and self.fused and self._one_node)

    @classmethod
    def stack_refusal(cls, settings: dict[str, Any]) -> str | None:
        training = settings.get("training", "moments")
        if training != "moments":
            return (f"method.training={training} draws weights at every step, so side-by-side "
                    f"runs would draw other numbers than their own jobs; stack runs of "
                    f"method.training=moments")
        return None

    @staticmethod
    def trains_stacked(members: Sequence[Method]) -> bool:
        """Members of one structure whose loss takes the fused node, each parameter of which
        is one of the node's (in the node's order): one batched network can hold them."""
        nets = [m for m in members if isinstance(m, BayesianMLP) and m._fused_loss()]
        if len(nets) < len(members):
            return False
        plans = [fused_plan(m.net) for m in nets]
        kinds = {(plan, tuple(p.shape for p in params), m.out_dim, m.variance,
                  m.variance_link, m.min_var, m.compiled)
                 for (plan, params), m in zip(plans, nets, strict=True)}
        return len(kinds) == 1 and all(
            [id(p) for p in m.parameters()] == [id(p) for p in params]
            for (_, params), m in zip(plans, nets, strict=True))

    @staticmethod
    def stacked_losses(members: Sequence[Method], batches: Sequence[Batch],
                       stacked: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """The members' ELBOs, (R,). Members that :meth:`trains_stacked` run as one batched
        network (:mod:`~uqbench.methods.moments.step`: the operations of one network for all
        of them), compiled when they are, from ``stacked`` (given only for members that
        :meth:`trains_stacked`, checked once by the caller rather than at every step) or their
        own parameters stacked here; others one by one."""
        if stacked is None:  # checked here; a caller that passes ``stacked`` checked once
            shapes = {tuple(t.shape for t in b) for b in batches}
            if len(shapes) > 1 or not BayesianMLP.trains_stacked(members):
                return Method.stacked_losses(members, batches)
        nets = [m for m in members if isinstance(m, BayesianMLP)]
        first = nets[0]
        params = (list(stacked) if stacked is not None else
                  [torch.stack(own) for own in zip(*(m.parameters() for m in nets), strict=True)])
        elbo = _compiled_batched_elbo() if first.compiled else _batched_elbo
        return elbo(torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]),
                    fused_plan(first.net)[0], params, tuple(m.kl_weight for m in nets),
                    first.out_dim, first.variance, first.variance_link, first.min_var)

    # -- moments vs Monte Carlo ----------------------------------------------------------------
    @torch.no_grad()
    def diagnostics(self, inputs: torch.Tensor) -> dict[str, float]:
        """How far moment inference is from Monte Carlo over ``check_samples`` weight draws, on
        ``inputs`` (B, in) (the runner hands over the first 256 test inputs); {} when
        check_samples is 0.

        mc_mean_gap: mean over inputs and targets of |μ_moments − μ_MC| / σ_MC; mc_std_ratio:
        mean of σ_moments / σ_MC (total predictive σ); mc_std_ratio_se: its Monte Carlo standard
        error, by the jackknife over CHECK_GROUPS groups of the draws (S ≥ 4; the draws are
        shared by every input, so their errors are not independent across inputs and the
        error of the mean is not a per-input error over √B), and mc_std_ratio_z, the ratio's
        distance from 1 in those errors (|z| ≤ 2: moments and Monte Carlo agree within Monte
        Carlo's error); mc_samples: S. Learned variance,
        the two parts of the total apart: mc_epistemic_std_ratio, the same ratio for the spread
        of the mean output alone (its σ over weight draws), and mc_aleatoric_ratio, the mean of
        E[link(a₂)] by moments over its Monte Carlo mean (the predicted noise variance), and
        mc_link_closure_ratio, the same for a₂ closed at Monte Carlo's own two moments
        (:meth:`_link_closure`), and mc_link_last_layer_ratio, the same with the layers below
        the last hidden layer exact (Monte Carlo's draws of its input) and only that layer's
        sum closed (:class:`_LinkGiven`). The draws come from a fixed seed and the global
        random state is restored afterwards, so the hook neither depends on nor changes what
        the run draws elsewhere. With
        ``covariance: full`` also pass_cost_vs_diagonal: :meth:`pass_cost`, and
        mc_closure_std_ratio: :meth:`_closure_bound`, from the same draws.
        """
        if self.check_samples == 0:
            return {}
        mom = self._moments(inputs)
        shift = mom.mean.double()
        groups = min(CHECK_GROUPS, self.check_samples // 2)
        # the full pass's check also taps the last activation's input, and a learned
        # variance's the output, on the same draws
        tap = self._closure_tap() if self.covariance != "diagonal" else None
        output = _Tap(len(self.net)) if self.variance == "learned" else None
        below = self._link_tap() if self.variance == "learned" else None
        with _private_rng(inputs.device, seed=0):
            sums = self._mc_sums(inputs, self.check_samples, shift, groups,
                                 [t for t in (tap, output, below) if t is not None])
        mean, epistemic, aleatoric = _parts_from_sums([t.sum(0) for t in sums], shift)
        sd_mom = mom.var.double().sqrt()

        def std_ratio(part: tuple[torch.Tensor, ...]) -> float:
            _, epi, alea = _parts_from_sums(part, shift)
            return (sd_mom / (epi + alea + self.min_var).sqrt()).mean().item()

        sd_mc = (epistemic + aleatoric + self.min_var).sqrt()
        found = {"mc_mean_gap": ((mom.mean.double() - mean).abs() / sd_mc).mean().item(),
                 "mc_std_ratio": (sd_mom / sd_mc).mean().item(),
                 "mc_samples": self.check_samples}
        if groups >= 2:  # S ≥ 4: every group left out leaves at least two draws
            se = _jackknife_se(std_ratio, sums)
            found["mc_std_ratio_se"] = se
            found["mc_std_ratio_z"] = (found["mc_std_ratio"] - 1.0) / se if se > 0 else math.nan
        if self.variance == "learned" and mom.var_aleatoric is not None:
            noise = mom.var_aleatoric.double()  # E[link(a₂)] + min_var, by moments
            found["mc_epistemic_std_ratio"] = (
                (mom.var.double() - noise).sqrt() / epistemic.sqrt()).mean().item()
            found["mc_aleatoric_ratio"] = ((noise - self.min_var) / aleatoric).mean().item()
        if output is not None:
            found["mc_link_closure_ratio"] = self._link_closure(output, aleatoric)
        if below is not None:
            found["mc_link_last_layer_ratio"] = (below.mean() / aleatoric).mean().item()
        if self.covariance != "diagonal":
            found["pass_cost_vs_diagonal"] = self.pass_cost(inputs)
        if tap is not None:
            found["mc_closure_std_ratio"] = self._closure_bound(tap, sd_mc)
        return found

    def _link_closure(self, output: _Tap, aleatoric: torch.Tensor) -> float:
        """mc_link_closure_ratio: E[link(a₂)] for a₂ the Gaussian with Monte Carlo's own mean
        and variance of a₂ (``output``'s, over the draws), over Monte Carlo's E[link(a₂)]
        (``aleatoric``, (B, out)), averaged over inputs: what the noise term of any pass that
        gets a₂'s two moments exactly right and closes a₂ as a Gaussian reads. Far from 1, the
        noise term rests on a₂'s shape (its upper tail, where a₂ is far below the link's bend
        and spread wide), which no Gaussian closure of a₂ carries."""
        mean, cov = output.moments()
        d = self.out_dim
        a_mean = mean[..., d:]
        a_var = cov.diagonal(dim1=-2, dim2=-1)[..., d:].clamp_min(0)
        closed = expected_link(self.variance_link, a_mean, a_var)
        return (closed / aleatoric).mean().item()

    def _link_tap(self) -> _LinkGiven | None:
        """mc_link_last_layer_ratio's tap: at the input of the last hidden layer (the Gaussian
        linear layer before the last activation), the noise term given that input
        (:class:`_LinkGiven`); None without a hidden activation."""
        last = self._last_activation()
        if last is None:
            return None
        at = max(i for i in range(last) if isinstance(self.net[i], GaussianLinear))
        return _LinkGiven(at, list(self.net)[at:], self.out_dim, self.variance_link)

    def _last_activation(self) -> int | None:
        """The index of the network's last activation, or None without a hidden activation."""
        return last_activation(list(self.net))

    def _closure_tap(self) -> _Tap | None:
        """A tap at the last activation's input (the last hidden layer's pre-activation), or
        None without a hidden activation."""
        last = self._last_activation()
        return None if last is None else _Tap(last)

    def _closure_bound(self, tap: _Tap, sd_mc: torch.Tensor) -> float:
        """mc_closure_std_ratio: the σ ratio to Monte Carlo (``sd_mc``, (B, out)) when the
        moment pass starts from Monte Carlo's own mean and covariance of the last activation's
        input (``tap``'s, over the same draws), so that the Gaussian closure of that
        activation, and of the variance link after it, is the only approximation left: what
        any pass that carries exact Gaussian moments up to there gets. The covariance estimated
        from S draws adds an error of its own, O(1/√S) per entry."""
        mean, cov = tap.moments()
        dtype = next(m for m in self.net if isinstance(m, GaussianLinear)).weight_mu.dtype
        mean_t, var_t, _ = full_pass(
            list(self.net)[tap.layer:],
            (mean.to(dtype), cov.diagonal(dim1=-2, dim2=-1).clamp_min(0).to(dtype),
             cov.to(dtype)), fused=self.fused)
        return (self._head(mean_t, var_t).var.double().sqrt() / sd_mc).mean().item()

    @torch.no_grad()
    def pass_cost(self, inputs: torch.Tensor, rounds: int = PASS_COST_ROUNDS) -> float:
        """The time of this network's moment pass on ``inputs`` over the diagonal pass's (fused,
        not compiled: the default), measured side by side: in each of ``rounds`` rounds one pass
        of each, the diagonal one repeated until it has taken as long as the other (at most
        1000 times) and averaged; the median of the rounds' ratios. A pass of a second or more
        (a mixture's, on a wide layer) is timed in one round: its own time swamps the noise."""
        def timed(fn: Callable[[], object], times: int = 1) -> float:
            if inputs.device.type == "cuda":
                torch.cuda.synchronize(inputs.device)
            start = time.perf_counter()
            for _ in range(times):
                fn()
            if inputs.device.type == "cuda":
                torch.cuda.synchronize(inputs.device)
            return (time.perf_counter() - start) / times

        ratios = []
        for _ in range(rounds):
            own = timed(lambda: self.moment_pass(inputs))
            once = timed(lambda: eager_inference(self.net, inputs))
            times = int(min(1000, max(1, own / max(once, 1e-9))))
            ratios.append(own / timed(lambda: eager_inference(self.net, inputs), times))
            if own >= 1.0:
                break
        return float(sorted(ratios)[len(ratios) // 2])

    def _mc_moments(self, x: torch.Tensor, samples: int,
                    shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predictive mean and total variance (B, out), float64, over ``samples`` weight draws
        (:meth:`_mc_parts`, the parts added up)."""
        mean, epistemic, aleatoric = self._mc_parts(x, samples, shift)
        return mean, epistemic + aleatoric + self.min_var

    def _mc_parts(self, x: torch.Tensor, samples: int, shift: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predictive mean, the variance of the mean output over the draws (epistemic) and the
        mean of link(a₂) (aleatoric; zeros for embedded variance), each (B, out), float64,
        over ``samples`` weight draws (:meth:`_mc_sums`, added up over its groups)."""
        sums = self._mc_sums(x, samples, shift, groups=1)
        return _parts_from_sums([t.sum(0) for t in sums], shift)

    def _mc_sums(self, x: torch.Tensor, samples: int, shift: torch.Tensor, groups: int,
                 taps: Sequence[_Tap | _LinkGiven] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sums over ``samples`` weight draws, split into ``groups`` consecutive groups of
        draws (as equal as the count allows): each (groups, B, out), float64, of the mean
        output around ``shift`` (B, out; a close guess of the mean, so Σy² − (Σy)²/S does not
        cancel), of its square and of link(a₂) (zeros for embedded variance), and the number
        of draws per group (groups, 1, 1). The draws are taken in chunks of at most
        CHECK_CHUNK_ELEMENTS drawn weights and activations, so memory stays bounded whatever S
        and the width; how they are grouped does not change which draws are taken. Each of
        ``taps`` also collects one layer's input, or the output, over the same draws
        (:class:`_Tap`)."""
        d = self.out_dim
        layers = [m for m in self.net if isinstance(m, GaussianLinear)]
        per_draw = sum(m.weight_mu.numel() + m.bias_mu.numel() + x.shape[0] * m.out_features
                       for m in layers)
        chunk = max(1, min(samples, CHECK_CHUNK_ELEMENTS // per_draw))
        bounds = [round(g * samples / groups) for g in range(groups + 1)]
        total = shift.new_zeros((groups, *shift.shape))
        square, link = torch.zeros_like(total), torch.zeros_like(total)
        for start in range(0, samples, chunk):
            n = min(chunk, samples - start)
            out = _tapped_draws(self.net, x.expand(n, *x.shape), taps).double()  # (s, B, outputs)
            y = out[..., :d] - shift
            noise = apply_link(self.variance_link, out[..., d:]) if self.variance == "learned" \
                else None
            for g in range(groups):  # the part of this chunk in group g
                lo = max(bounds[g], start) - start
                hi = min(bounds[g + 1], start + out.shape[0]) - start
                if hi <= lo:
                    continue
                total[g] += y[lo:hi].sum(0)
                square[g] += (y[lo:hi] * y[lo:hi]).sum(0)
                if noise is not None:
                    link[g] += noise[lo:hi].sum(0)
        counts = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
                              dtype=total.dtype, device=total.device).view(groups, 1, 1)
        return total, square, link, counts


class _Tap:
    """Running sums, float64, of the input of layer ``layer`` over sampled passes (``layer`` =
    the network's length: its output): its mean (B, d) and covariance (B, d, d) over the draws,
    around the first chunk's mean (against cancellation)."""

    def __init__(self, layer: int) -> None:
        self.layer, self.count = layer, 0
        self.centre: torch.Tensor | None = None
        self.first: torch.Tensor | None = None
        self.outer: torch.Tensor | None = None

    def add(self, a: torch.Tensor) -> None:
        """Adds draws (S, B, d) of the tapped input to the sums."""
        a = a.double()
        self.centre = a.mean(0) if self.centre is None else self.centre
        c = a - self.centre
        part, outer = c.sum(0), torch.einsum("sbi,sbj->bij", c, c)
        self.first = part if self.first is None else self.first + part
        self.outer = outer if self.outer is None else self.outer + outer
        self.count += a.shape[0]

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tapped input's mean and unbiased covariance over the draws (two or more)."""
        assert self.centre is not None and self.first is not None and self.outer is not None
        mean = self.first / self.count
        cov = (self.outer - self.count * mean.unsqueeze(-1) * mean.unsqueeze(-2)) / (self.count - 1)
        return self.centre + mean, 0.5 * (cov + cov.transpose(-1, -2))


class _LinkGiven:
    """Running sum, float64, over sampled passes of E[link(a₂) | x], x the input of layer
    ``layer`` (the last hidden layer's): given x, that layer's units are independent Gaussians
    (their weights are), so the diagonal rules carry x through the ``rest`` of the network
    (that layer, the last activation, the output layer) to a₂'s exact mean and variance given
    x, and a₂ is closed as the Gaussian of those. Averaged over Monte Carlo's draws of x, it is
    the noise term with everything below the last hidden layer exact: its error is that of the
    last hidden layer's sum alone, which no closure of the layers below can remove."""

    def __init__(self, layer: int, rest: Sequence[MomentModule], out_dim: int, link: str) -> None:
        self.layer, self.rest, self.out_dim, self.link = layer, list(rest), out_dim, link
        self.total: torch.Tensor | None = None
        self.count = 0

    def add(self, a: torch.Tensor) -> None:
        """Adds draws (S, B, d) of the tapped input to the sum. At layer 0 the input is the
        network's own, the same in every draw: its term is computed once and counted S times
        (with one hidden layer, S times less work for the same sum)."""
        draws = a.shape[0]
        fixed = self.layer == 0
        mean = a[:1] if fixed else a
        var = torch.zeros_like(mean)
        for m in self.rest:
            mean, var = m(mean, var)
        d = self.out_dim
        part = expected_link(self.link, mean[..., d:].double(),
                             var[..., d:].double().clamp_min(0)).sum(0)
        if fixed:
            part = part * draws
        self.total = part if self.total is None else self.total + part
        self.count += draws

    def mean(self) -> torch.Tensor:
        """E[link(a₂) | x] averaged over the draws (B, out)."""
        assert self.total is not None
        return self.total / self.count


def _tapped_draws(net: MomentSequential, x: torch.Tensor,
                  taps: Sequence[_Tap | _LinkGiven]) -> torch.Tensor:
    """``net.forward_sampled(x)`` (the same draws, in the same order), adding each tapped
    layer's input (S, B, d), or the output, to its taps' sums on the way."""
    at: dict[int, list[_Tap | _LinkGiven]] = {}
    for t in taps:
        at.setdefault(t.layer, []).append(t)
    for i, m in enumerate(net):
        for t in at.get(i, ()):
            t.add(x)
        x = m.forward_sampled(x)
    for t in at.get(len(net), ()):
        t.add(x)
    return x


def _parts_from_sums(sums: Sequence[torch.Tensor], shift: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, epistemic variance (unbiased) and mean link(a₂) from the sums (total, square,
    link, count) over ``count`` draws (:meth:`BayesianMLP._mc_sums`, one group's or added)."""
    total, square, link, count = sums
    epistemic = ((square - total * total / count) / (count - 1)).clamp_min(0)
    return shift + total / count, epistemic, link / count


def _jackknife_se(stat: Callable[[tuple[torch.Tensor, ...]], float],
                  sums: tuple[torch.Tensor, ...]) -> float:
    """The jackknife standard error of a statistic of the draws' sums over their groups:
    ``stat`` of the sums without each group in turn, √((G − 1)/G Σ (θ₋g − θ̄)²)."""
    whole = tuple(t.sum(0) for t in sums)
    groups = sums[0].shape[0]
    left_out = torch.tensor([stat(tuple(w - t[g] for w, t in zip(whole, sums, strict=True)))
                             for g in range(groups)], dtype=torch.float64)
    return float(((groups - 1) / groups * ((left_out - left_out.mean()) ** 2).sum()).sqrt())


def _predictive(mean: torch.Tensor, var: torch.Tensor, d: int, variance: str, link: str,
                min_var: float) -> RegressionOutput:
    """The predictive moments from the raw output moments (B, outputs): embedded, the output's
    own; learned, the first d outputs' plus E[link(a₂)] of the other d."""
    if variance == "embedded":
        return RegressionOutput(mean, var + min_var)
    # E[link(a₂)] under a₂'s propagated Gaussian: what MC inference estimates by sampling
    aleatoric = expected_link(link, mean[..., d:], var[..., d:]) + min_var
    return RegressionOutput(mean[..., :d], var[..., :d] + aleatoric, aleatoric)


def _nll(out: RegressionOutput, y: torch.Tensor) -> torch.Tensor:
    """Σ over the batch of the Gaussian NLL of y under (out.mean, out.var)."""
    return 0.5 * (torch.log(2 * math.pi * out.var) + (y - out.mean) ** 2 / out.var).sum()


def _elbo_terms(x: torch.Tensor, y: torch.Tensor, plan: Plan, params: list[torch.Tensor],
                d: int, variance: str, link: str, min_var: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ELBO's NLL (summed over the batch) and KL by the fused training node, from the
    network's plan and parameters (no module: compiled once for every network of a plan)."""
    mean, var, kl = planned_moments_and_kl(x, plan, params)
    return _nll(_predictive(mean, var, d, variance, link, min_var), y), kl


def _batched_elbo(x: torch.Tensor, y: torch.Tensor, plan: Plan, params: list[torch.Tensor],
                  weights: tuple[float, ...], d: int, variance: str, link: str,
                  min_var: float) -> torch.Tensor:
    """Each member's NLL (summed over its batch) + β·KL, (R,), for R networks of one plan
    side by side: inputs x, y (R, B, ·) and every parameter (R, …), member r's at [r]."""
    mean, var, kl = planned_moments_and_kl(x, plan, params)
    out = _predictive(mean, var, d, variance, link, min_var)
    nll = 0.5 * (torch.log(2 * math.pi * out.var) + (y - out.mean) ** 2 / out.var)
    return nll.flatten(1).sum(1) + kl * kl.new_tensor(weights)


# Python floats (slopes, prior stds) compiled in as constants: traced as symbolic numbers they
# trip a guard that dynamo itself reports as its bug. A compilation that fails (no C++ compiler
# on the machine, say) runs the same function eagerly, with torch's warning, instead of failing.
# Parameters of other shapes and layers of other sizes (the widths of a sweep in one worker
# process) share the graph with dynamic sizes rather than one graph per width, which would
# reach dynamo's recompile limit (8) within one sweep and run the rest eagerly.
_COMPILE_CONFIG = {"specialize_float": True, "suppress_errors": True,
                   "force_parameter_static_shapes": False,
                   "allow_unspec_int_on_nn_module": True}


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` through torch.compile, traced and run under :data:`_COMPILE_CONFIG`, with
    dynamic sizes from the first call: one compilation serves every width and batch, the same
    graph in every worker process of a sweep (so the compile cache serves the second)."""
    return compile_dynamic(fn, **_COMPILE_CONFIG)


@functools.cache
def _compiled_elbo_terms() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_elbo_terms` through :func:`_compile`, built on first use."""
    return _compile(_elbo_terms)


@functools.cache
def _compiled_batched_elbo() -> Callable[..., torch.Tensor]:
    """:func:`_batched_elbo` through :func:`_compile`, built on first use."""
    return _compile(_batched_elbo)


@functools.cache
def _compiled_fused_pass() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """MomentSequential.forward_fused through :func:`_compile`, built on first use. One for all
    networks: it takes the network as an argument, and nets of the same structure share code."""
    return _compile(MomentSequential.forward_fused)


@contextlib.contextmanager
def _private_rng(device: torch.device, seed: int) -> Iterator[None]:
    """Random draws inside come from ``seed`` on the CPU's generator and ``device``'s; the
    global random state of both is restored on exit."""
    accelerator = device.type in ("cuda", "mps")
    with torch.random.fork_rng(devices=[device] if accelerator else [],
                               device_type=device.type if accelerator else "cuda"):
        torch.random.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device's generator only
        elif device.type == "mps":
            torch.mps.manual_seed(seed)
        yield
