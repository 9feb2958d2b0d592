"""Sampling-free variational Bayesian network with embedded or learned variance.

The network is the backbone's own: a tabular backbone (the MLP) builds its deterministic
feature network, (B, in) → (B, feature_dim), and the BNN converts it layer by layer into its
moment-propagating twin (nn.Linear → GaussianLinear, nn.LeakyReLU / nn.ReLU → MomentLeakyReLU)
and adds a Gaussian output layer.

``variance: embedded`` — one output per target; its propagated variance *is* the total predictive
variance (aleatoric noise is absorbed by the parameter variances).
``variance: learned`` — a second output per target whose mean gives the aleatoric variance
(softplus); total variance = that + the propagated variance of the first output.

Training always propagates moments (one analytic pass, no sampling) and minimises the negative
ELBO: Σ_batch GaussianNLL(y; mean, var) + β·KL(q ‖ N(0, prior_std²)), β = 1/batches per epoch.
Prediction uses ``inference: moments`` or ``inference: mc`` (S sampled weight sets).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.configs import options_with
from uqbench.contracts import Batch, DataInfo, RegressionOutput
from uqbench.methods.base import Method
from uqbench.methods.moments import (
    GaussianLinear,
    MomentLeakyReLU,
    MomentModule,
    MomentReLU,
    MomentSequential,
)

VARIANCES = ("embedded", "learned")
INFERENCES = ("moments", "mc")
CONVERTS = "nn.Linear (with a bias), nn.LeakyReLU, nn.ReLU"


def tabular_backbones() -> str:
    """The backbone configs the BNN builds on: the MLPs, the only ones with a hidden width."""
    return ", ".join(options_with("backbone", "width")) or "<no MLP backbone configs found>"


def moment_twin(module: nn.Module, prior_std: float, rho_init: float) -> MomentModule | None:
    """The moment-propagating twin of one deterministic layer, with fresh μ and ρ, or None.

    nn.Linear(in, out) → GaussianLinear(in, out): moments (B, in) → (B, out);
    nn.LeakyReLU(a) → MomentLeakyReLU(a), nn.ReLU → MomentReLU: elementwise, shape kept.
    """
    if isinstance(module, nn.Linear) and module.bias is not None:
        return GaussianLinear(module.in_features, module.out_features, prior_std, rho_init)
    if isinstance(module, nn.LeakyReLU):
        return MomentLeakyReLU(module.negative_slope)
    if isinstance(module, nn.ReLU):
        return MomentReLU()
    return None


class BayesianMLP(Method):
    """A mean-field Gaussian twin of the backbone's network plus a Gaussian output layer.

    Moments (B, in) → (B, feature_dim) through the converted backbone layers, then
    (B, out) or, learned variance, (B, 2·out) through the output layer. Every parameter trains.
    """

    task = "regression"

    def __init__(self, backbone: Any, info: DataInfo, name: str = "bnn",
                 variance: str = "embedded", inference: str = "moments", mc_samples: int = 200,
                 prior_std: float = 1.0, rho_init: float = -2.0, kl_weight: float | None = None,
                 min_var: float = 1e-8) -> None:
        super().__init__()
        if variance not in VARIANCES:
            raise ValueError(f"method.variance '{variance}' is not one of {VARIANCES}")
        if inference not in INFERENCES:
            raise ValueError(f"method.inference '{inference}' is not one of {INFERENCES}")
        modality = getattr(backbone, "modality", None)
        if modality != "tabular":
            raise ValueError(
                f"method '{name}' propagates moments through a tabular backbone's network; "
                f"'{getattr(backbone, 'name', backbone)}' has modality {modality!r}. Pick one of: "
                f"{tabular_backbones()}")
        if prior_std <= 0 or not math.isfinite(prior_std):
            raise ValueError(f"method.prior_std must be a positive number, got {prior_std}")
        if mc_samples < 2:
            raise ValueError(f"method.mc_samples must be >= 2, got {mc_samples}")
        if kl_weight is not None and kl_weight < 0:
            raise ValueError(f"method.kl_weight must be >= 0 or null, got {kl_weight}")
        self.name = name
        self.variance, self.inference = variance, inference
        self.mc_samples = int(mc_samples)
        self.kl_weight = 1.0 / info.num_train_batches if kl_weight is None else float(kl_weight)
        self.min_var = float(min_var)
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
            twin = moment_twin(module, prior_std, rho_init)
            if twin is None:
                raise ValueError(
                    f"method '{name}' cannot convert layer {child} ({module!r}) of backbone "
                    f"'{backbone.name}' into a moment-propagating layer; it converts "
                    f"{CONVERTS}. Backbones that work: {tabular_backbones()}")
            layers.append(twin)
        layers.append(GaussianLinear(backbone.feature_dim, outputs, prior_std, rho_init))
        self.net = MomentSequential(*layers)

    def settings(self) -> dict[str, Any]:
        return {"variance": self.variance, "inference": self.inference,
                "kl_weight": self.kl_weight}

    # -- moments: one analytic pass ----------------------------------------------------------
    def _moments(self, x: torch.Tensor) -> RegressionOutput:
        mean, var = self.net(x, torch.zeros_like(x))  # deterministic input: v = 0
        d = self.out_dim
        if self.variance == "embedded":
            return RegressionOutput(mean, var + self.min_var)
        aleatoric = F.softplus(mean[:, d:]) + self.min_var
        return RegressionOutput(mean[:, :d], var[:, :d] + aleatoric, aleatoric)

    # -- Monte Carlo: S sampled weight sets ------------------------------------------------
    def _sampled(self, x: torch.Tensor) -> RegressionOutput:
        out = self.net.forward_sampled(x.expand(self.mc_samples, *x.shape))  # (S, B, outputs)
        d = self.out_dim
        mean, epistemic = out[..., :d].mean(0), out[..., :d].var(0, unbiased=False)
        if self.variance == "embedded":
            return RegressionOutput(mean, epistemic + self.min_var)
        aleatoric = F.softplus(out[..., d:]).mean(0) + self.min_var
        return RegressionOutput(mean, epistemic + aleatoric, aleatoric)

    def forward(self, x: torch.Tensor, inference: str | None = None) -> RegressionOutput:
        """(B, in) → predictive mean and variances of shape (B, out)."""
        mode = inference or (self.inference if not self.training else "moments")
        return self._sampled(x) if mode == "mc" else self._moments(x)

    loss_sums_examples = True  # the ELBO of a batch: its NLL summed, plus β·KL once

    def loss(self, batch: Batch, share: float = 1.0) -> torch.Tensor:
        """Σ NLL over the batch + β·KL; a micro-batch that is ``share`` of its optimiser step
        adds that share of β·KL, so the micro-batches of a step add up to the step's ELBO."""
        x, y = batch
        out = self._moments(x)
        nll = 0.5 * (torch.log(2 * math.pi * out.var) + (y - out.mean) ** 2 / out.var).sum()
        return nll + self.kl_weight * share * self.net.kl()
