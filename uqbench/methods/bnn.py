"""Sampling-free variational Bayesian network with embedded or learned variance (METHODS.md §2).

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

from uqbench.backbones.mlp import MLP
from uqbench.contracts import Batch, DataInfo, RegressionOutput
from uqbench.methods.base import Method
from uqbench.methods.moments import GaussianLinear, MomentLeakyReLU, MomentSequential

VARIANCES = ("embedded", "learned")
INFERENCES = ("moments", "mc")


class BayesianMLP(Method):
    task = "regression"

    def __init__(self, backbone: MLP, info: DataInfo, name: str = "bnn",
                 variance: str = "embedded", inference: str = "moments", mc_samples: int = 200,
                 prior_std: float = 1.0, rho_init: float = -2.0, kl_weight: float | None = None,
                 min_var: float = 1e-8) -> None:
        super().__init__()
        if variance not in VARIANCES:
            raise ValueError(f"method.variance '{variance}' is not one of {VARIANCES}")
        if inference not in INFERENCES:
            raise ValueError(f"method.inference '{inference}' is not one of {INFERENCES}")
        if not isinstance(backbone, MLP):
            raise ValueError(f"method '{name}' needs backbone=mlp, got {type(backbone).__name__}")
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
        layers: list[torch.nn.Module] = []
        d = int(info.in_dim or 1)
        for h in backbone.hidden:
            layers += [GaussianLinear(d, h, prior_std, rho_init), MomentLeakyReLU(backbone.slope)]
            d = h
        layers.append(GaussianLinear(d, outputs, prior_std, rho_init))
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

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        out = self._moments(x)
        nll = 0.5 * (torch.log(2 * math.pi * out.var) + (y - out.mean) ** 2 / out.var).sum()
        return nll + self.kl_weight * self.net.kl()
