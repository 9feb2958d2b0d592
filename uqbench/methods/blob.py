"""BLoB: Bayesian Low-Rank Adaptation by Backpropagation (Wang et al., NeurIPS 2024, "BLoB:
Bayesian Low-Rank Adaptation by Backpropagation for Large Language Models").

Each targeted frozen linear layer gets a LoRA update whose A has a diagonal Gaussian posterior
and whose B is deterministic: y = W x + b + γ·B (A x), A ~ q(A) = N(μ_A, σ_A²) elementwise,
σ_A = G² (G trained), γ = alpha / rank. The prior is N(0, prior_std²) on every entry of A. At
initialisation B = 0, so every draw reproduces the pretrained layer.

Samples as members. The posterior draws take the place of an ensemble's members: the batch is
repeated once per draw at the stem (member-major, ``uqbench.methods.member_layers``) and block s of
every layer's rows uses its own A_s = μ_A + σ_A ∘ ε_s, ε_s ~ N(0, I), shared by all examples
and tokens of the block, so each block is one network drawn from q. Training runs
``train_samples`` blocks, evaluation ``samples``; logits (S, B, C) from one shared head, and
the task averages the S softmaxes like members' probabilities.

Loss: (1/S) Σ_s CE(z_s, y), the mean over the batch, + kl_weight · π · KL(q ‖ p), with KL in
closed form, Σ [log(σ_p/σ) + (σ² + μ²)/(2σ_p²) − ½] over every entry of every layer's A, and
π as the reference code: ``constant`` π = 1/M, M = batches per epoch (the BNN's
``info.num_train_batches``); ``reweighted`` π_i = 2^i / (2^(M+1) − 1) for the i-th step of each
cycle of M (i = 1 … M; the weights of a cycle sum to about 1).

Follows the reference implementation (github.com/Wang-ML-Lab/bayesian-peft,
``modelwrappers/blob.py``, its arguments and scripts) in: rank 8, alpha 16 (γ = 2), μ_A
started as peft's LoRA A (U(±1/√in)), B = 0, σ = G² with G ~ U(ε/√2, ε) (``init_std`` = ε² =
0.0025, i.e. σ₀ in [ε²/2, ε²]), prior std 0.2 (``--bayes-beta``), one sample in training, 10 at
test, flipout sign vectors in training passes, no LoRA dropout. Differs in:

- Optimisation: the reference steps μ_A and B with AdamW on the mean NLL, then every
  parameter with a second optimiser, SGD at ``--bayes-kllr`` (0.01 LLaMA, 0.002 RoBERTa;
  warm-up and linear decay), on π·KL; G, made after the AdamW optimiser, moves by that SGD
  alone, on NLL + π·KL. Here one loss, NLL + weighted KL, is minimised by the training
  recipe's one optimiser for every parameter.
- π: the reference's scripts set ``--bayes-datasetrescaling``, M = 100·N^(3.1416/γ)/(batch
  · processes) with γ = 8 and N training examples, and ``--bayes-klreweighting``; uqbench
  defaults to M = batches per epoch (the reference's value without that flag), π constant (its
  default without the other). ``kl_weight`` (ours, 1 = the reference's weighting) scales it.
  ``reweighted`` counts this method's training calls of ``loss``: with gradient accumulation
  or several processes the cycle runs over micro-batches, and a resumed run starts a new cycle.
- KL numerics: the reference adds 10⁻⁶ to σ, σ_p and 2σ_p²; here the exact form, in float64.
- Flipout: the reference flips signs per token (rows of (B, T, ·)), in training and at test;
  here per example, in training only (``flipout``); evaluation draws one A per sample block.
- ``train_samples`` > 1: the reference averages the samples' logits before its NLL; here the
  samples' cross-entropies are averaged (the same at the default 1).
- Targets: the reference adapts q and v (``query``, ``value`` / ``q_proj``, ``v_proj``) and,
  in its scripts, puts a BLoB adapter on the classification head too; uqbench's default is
  ``attention`` (q, k, v and the attention output, as LoRA-Ensemble) with a deterministic
  trained linear head. A list gives the reference's layers on BERT or LLaMA; a ViT's fused qkv
  has no q-and-v-only choice (``qkv: split`` adapts q, k and v apart, ``fused`` the 3d × d
  matrix as one).
- The reference's mean-only prediction (``--bayes-inference-notsample``) is not offered.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import Batch, DataInfo
from uqbench.methods.ensemble import EnsembleMethod, positive_int
from uqbench.methods.member_layers import (
    Inputs,
    MemberLinear,
    Qkv,
    Targets,
    check_qkv,
    fused_qkv,
    repeat_members,
    replace_linears,
    resolve_targets,
    split_members,
)

KLSchedule = Literal["constant", "reweighted"]
KL_SCHEDULES: tuple[str, ...] = get_args(KLSchedule)


def _positive(value: Any, field: str, hint: str, allow_zero: bool = False) -> float:
    """``value`` as a finite float > 0 (>= 0 with ``allow_zero``), or a ValueError naming it."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = number and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{field} must be a finite number {bound}{hint}, got {value!r}")
    return float(value)


def check_options(samples: Any = 10, train_samples: Any = 1, rank: Any = 8, alpha: Any = 16.0,
                  prior_std: Any = 0.2, init_std: Any = 0.0025, kl_weight: Any = 1.0,
                  kl_schedule: Any = "constant", flipout: Any = True, qkv: Any = "split",
                  **_: Any) -> None:
    """Refuse a setting BLoB cannot use, naming the value and the valid range; the runner calls
    it (``BLoB.check_settings``) before anything is read or built, and so does the method."""
    positive_int(samples, "method.samples", " (posterior draws at test time; the paper: 10)")
    positive_int(train_samples, "method.train_samples", " (draws per training step; the "
                 "paper: 1)")
    positive_int(rank, "method.rank", " (the reference: 8)")
    _positive(alpha, "method.alpha", " (scaling alpha / rank; the reference: 16)")
    _positive(prior_std, "method.prior_std", " (σ of the N(0, σ²) prior; the reference: 0.2)")
    _positive(init_std, "method.init_std", " (largest initial posterior σ; the reference: 0.0025)")
    _positive(kl_weight, "method.kl_weight", " (0 drops the KL term; 1: the reference)",
              allow_zero=True)
    if kl_schedule not in KL_SCHEDULES:
        raise ValueError(f"method.kl_schedule {kl_schedule!r} is not one of: "
                         f"{', '.join(KL_SCHEDULES)}")
    if not isinstance(flipout, bool):
        raise ValueError(f"method.flipout must be true or false, got {flipout!r}")
    check_qkv(qkv)


def kl_factor(schedule: str, batches: int, call: int) -> float:
    """The KL's weight π at the ``call``-th training step (from 0), M = ``batches``: 1/M
    (constant), or 2^i / (2^(M+1) − 1) with i = call mod M + 1 (reweighted)."""
    M = batches
    if schedule == "constant":
        return 1.0 / M
    i = call % M + 1
    return 2.0 ** (i - M - 1) / (1.0 - 2.0 ** (-M - 1))  # no overflow for large M


class BLoBLinear(MemberLinear):
    """A Bayesian LoRA update on a frozen linear layer, one A drawn per sample block.

    Input (S·B, …, in) in member-major order, S = ``members`` (set by the method before each
    pass), output (S·B, …, out) = base_layer(x) + scaling · [x A_sjᵀ B_jᵀ]_j for block s, with
    A_sj = μ_j + σ_j ∘ ε_sj. J = ``splits`` output blocks of width o = out / J, each with its own
    adapter (J = 3: q, k and v of a fused layer; else 1). Parameters (float32, the
    ``adapter_names``): blob_A_mu (J, r, in), U(±1/√in) as peft's LoRA A; blob_A_g (J, r, in),
    σ = G², G ~ U(√(init_std/2), √init_std); blob_B (J, o, r), zeros.

    ``flipout`` and training: every block shares one ε_s, and example n sees it through random
    signs, A_n = μ + σ ∘ ε_s ∘ (s_n r_nᵀ) (s_n ∈ {±1}^r, r_n ∈ {±1}^in, per example), so the
    examples of a batch get decorrelated draws of the same marginal N(μ, σ²).
    """

    adapter_names = ("blob_A_mu", "blob_A_g", "blob_B")

    def __init__(self, base_layer: nn.Linear, members: int, rank: int, scaling: float,
                 prior_std: float, init_std: float, flipout: bool = True, splits: int = 1,
                 name: str = "") -> None:
        super().__init__(base_layer, members)
        if self.out_features % splits:
            raise ValueError(f"method.qkv=split: layer '{name}' has {self.out_features} "
                             f"outputs, not q, k and v of equal width (a multiple of {splits}); "
                             f"use method.qkv=fused or fix backbone.fused_qkv")
        self.rank, self.scaling, self.splits = rank, scaling, splits
        self.prior_std, self.init_std, self.flipout = prior_std, init_std, flipout
        J, o, device = splits, self.out_features // splits, base_layer.weight.device
        bound = 1.0 / math.sqrt(self.in_features)
        self.blob_A_mu = nn.Parameter(
            torch.empty(J, rank, self.in_features, device=device).uniform_(-bound, bound))
        self.blob_A_g = nn.Parameter(torch.empty(J, rank, self.in_features, device=device)
                                     .uniform_(math.sqrt(init_std / 2), math.sqrt(init_std)))
        self.blob_B = nn.Parameter(torch.zeros(J, o, rank, device=device))

    def sigma(self) -> torch.Tensor:
        """The posterior standard deviations of A, G² (J, r, in)."""
        return self.blob_A_g ** 2

    def kl(self) -> torch.Tensor:
        """KL(q(A) ‖ p(A)) summed over every entry, in float64 (a scalar)."""
        mu, sigma, p = self.blob_A_mu.double(), self.blob_A_g.double() ** 2, self.prior_std
        return (math.log(p) - sigma.log() + (sigma ** 2 + mu ** 2) / (2 * p ** 2) - 0.5).sum()

    def saved_values(self, rows: int) -> int:
        """x A_sᵀ (S, N, J·r) for the gradient of B; with flipout also the sign-flipped input
        (S, N, in) and the noise path's (S, N, J·r)."""
        per_row = self.splits * self.rank
        if self.flipout:
            per_row += self.in_features + self.splits * self.rank
        return self.members * rows * per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)                                                   # (S·B, …, out)
        S, dtype = self.members, x.dtype
        xm = split_members(x, S)                                                 # (S, N, in)
        mu, B = self.blob_A_mu.to(dtype), self.blob_B.to(dtype)
        eps = torch.randn((S, *mu.shape), device=mu.device)                      # (S, J, r, in)
        noise = (self.sigma() * eps).to(dtype)
        if self.flipout and self.training:
            h = torch.einsum("sni,jri->snjr", xm, mu) + self._flipped(x, noise)
        else:
            h = torch.einsum("sni,sjri->snjr", xm, mu + noise)                  # (S, N, J, r)
        delta = torch.einsum("snjr,jor->snjo", h, B)                            # (S, N, J, o)
        return y + self.scaling * delta.reshape(y.shape)

    def _flipped(self, x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The noise path with per-example signs: ((x ∘ r_n) (σ∘ε_s)ᵀ) ∘ s_n, (S, N, J, r)."""
        rows, inner = x.shape[0], (1,) * (x.dim() - 2)
        J, r = self.splits, self.rank

        def signs(*shape: int) -> torch.Tensor:
            return torch.empty(shape, device=x.device, dtype=x.dtype).bernoulli_(0.5) * 2 - 1

        xs = split_members(x * signs(rows, *inner, self.in_features), self.members)
        h = torch.einsum("sni,sjri->snjr", xs, noise)                          # (S, N, J, r)
        return (h.reshape(*x.shape[:-1], J, r) * signs(rows, *inner, J, r)).reshape(h.shape)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling}, "
                f"splits={self.splits}, prior_std={self.prior_std}, flipout={self.flipout}")


class BLoB(EnsembleMethod):
    """Bayesian LoRA over one frozen backbone; posterior draws as members.

    Logits (train_samples, B, C) in training, (samples, B, C) in evaluation, from one shared
    head. samples: draws at test time (10, the paper). train_samples: draws per training step
    (1, the paper). rank: r (8). alpha: scaling alpha / rank (16, the reference's LLaMA runs).
    prior_std: the prior N(0, prior_std²) (0.2). init_std: σ₀ drawn in [init_std/2, init_std]
    (0.0025 = the reference's ε²). kl_weight: multiplies the KL's weight π (1). kl_schedule:
    constant (π = 1/M) | reweighted (2^i / (2^(M+1) − 1)). flipout: per-example sign flips of
    the noise in training (true, as the reference). targets, qkv: as LoRA-Ensemble. Trains
    every wrapped layer's blob_A_mu, blob_A_g, blob_B and the head.
    """

    shared_head = True  # the draws are samples of one model

    def __init__(self, backbone: Backbone, info: DataInfo, samples: int = 10,
                 train_samples: int = 1, rank: int = 8, alpha: float = 16.0,
                 prior_std: float = 0.2, init_std: float = 0.0025, kl_weight: float = 1.0,
                 kl_schedule: KLSchedule = "constant", flipout: bool = True,
                 targets: Targets = "attention", qkv: Qkv = "split", name: str = "blob") -> None:
        check_options(samples=samples, train_samples=train_samples, rank=rank, alpha=alpha,
                      prior_std=prior_std, init_std=init_std, kl_weight=kl_weight,
                      kl_schedule=kl_schedule, flipout=flipout, qkv=qkv)
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, int(samples), name)
        self.train_samples, self.rank = int(train_samples), int(rank)
        self.alpha, self.scaling = float(alpha), float(alpha) / int(rank)
        self.prior_std, self.init_std = float(prior_std), float(init_std)
        self.kl_weight, self.kl_schedule = float(kl_weight), kl_schedule
        self.flipout, self.qkv = flipout, qkv
        self.kl_batches = max(1, int(info.num_train_batches))  # M
        self.kl_calls = 0  # training calls of loss, for the reweighted schedule

        def wrap(n: str, layer: nn.Linear) -> BLoBLinear:
            splits = 3 if qkv == "split" and fused_qkv(backbone, n) else 1
            return BLoBLinear(layer, self.train_samples, self.rank, self.scaling,
                              self.prior_std, self.init_std, flipout, splits, n)

        self.targets = suffixes
        self.replaced = replace_linears(self.encoder, suffixes, wrap, name)
        self.train_declared()

    @classmethod
    def check_settings(cls, settings: dict[str, Any]) -> None:
        """The ranges of the config's options, before anything is read or built."""
        check_options(**settings)

    def layers(self) -> list[BLoBLinear]:
        return [m for m in self.modules() if isinstance(m, BLoBLinear)]

    def passes(self) -> int:
        """Posterior draws per call: train_samples in training, samples in evaluation."""
        return self.train_samples if self.training else self.members

    def training_passes(self) -> int:
        """train_samples encoder passes per example (0 when only the head trains)."""
        return self.train_samples if super().training_passes() else 0

    def features(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → draw-major features (S·B, D), S = passes(), one A per block."""
        passes = self.passes()
        for layer in self.layers():
            layer.members = passes
        return self.encoder(repeat_members(inputs, passes))

    def logits(self, inputs: Inputs) -> torch.Tensor:
        """inputs (B, …) → logits (S, B, C), S = passes()."""
        return self.head(split_members(self.features(inputs), self.passes()))

    def kl(self) -> torch.Tensor:
        """KL(q ‖ p) of every wrapped layer's A, summed (a float64 scalar)."""
        return torch.stack([layer.kl() for layer in self.layers()]).sum()

    def kl_factor(self, call: int) -> float:
        """π of the ``call``-th training call of loss (from 0); see :func:`kl_factor`."""
        return kl_factor(self.kl_schedule, self.kl_batches, call)

    def loss(self, batch: Batch) -> torch.Tensor:
        """(1/S) Σ_s CE(z_s, y) (mean over the batch) + kl_weight · π · KL(q ‖ p)."""
        ce = super().loss(batch)
        factor = self.kl_factor(self.kl_calls)
        if self.training:
            self.kl_calls += 1
        if self.kl_weight == 0 or factor == 0:
            return ce
        return ce + (self.kl_weight * factor * self.kl()).to(ce.dtype)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "samples": self.members, "train_samples": self.train_samples, "rank": self.rank,
            "alpha": self.alpha, "scaling": self.scaling, "prior_std": self.prior_std,
            "init_std": self.init_std, "kl_weight": self.kl_weight,
            "kl_schedule": self.kl_schedule, "kl_batches": self.kl_batches,
            "flipout": self.flipout, "targets": ",".join(self.targets),
            "replaced_layers": len(self.replaced), "qkv": self.qkv,
            "split_qkv_layers": sum(m.splits > 1 for m in self.layers())}
