"""The layers of a moment-propagating network: (mean, var) → (mean, var).

Each layer maps the elementwise mean and variance of its input, (B, …), to those of its output.
Each also has ``forward_sampled(x)``: the same network with weights *sampled*, for Monte Carlo
inference. ``x`` has a leading sample axis (S, B, …) and every sample s uses its own weight
draw, so S forward passes run as one batched computation; ``forward_fused``, the moment
pass by :mod:`.fused`; and ``forward_full``, the moment pass that also carries the covariance
between the units of a layer (:mod:`.covariance`, Wu et al. 2019).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from uqbench.methods.moments.activations import leaky_relu_moments
from uqbench.methods.moments.covariance import leaky_relu_full_covariance
from uqbench.methods.moments.fused import leaky_relu_moments_fused, linear_moments
from uqbench.methods.moments.sandwich import (
    diagonal_sandwich_and_variances,
    sandwich_and_variances,
    symmetric_part,
)

# mean (B, d); variance (B, d) or None (deterministic); covariance (B, d, d) or None (independent)
FullMoments = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
PassMoments = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a pass's: var not None
FULL_RULES = "GaussianLinear, MomentLeakyReLU (relu, leaky_relu)"


class MomentModule(nn.Module):
    """A layer of a moment-propagating network: (mean, var) → (mean, var)."""

    def forward(self, mean: torch.Tensor,
                var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` by the fused path; var None means a deterministic input (v = 0). Layers
        without a fused form run their ``forward``."""
        return self(mean, torch.zeros_like(mean) if var is None else var)

    full_rule = False  # whether forward_full propagates covariances between units

    def forward_full(self, mean: torch.Tensor, var: torch.Tensor | None,
                     cov: torch.Tensor | None, full_out: bool = True,
                     fused: bool = True, symmetric: bool = False) -> FullMoments:
        """Moments with the covariance between units: mean (B, d), var (B, d) or None (a
        deterministic input), cov (B, d, d) or None (independent units) → the same for the
        output; ``full_out`` false leaves the output covariance out (None), ``fused`` picks the
        univariate rule's form; ``symmetric``: the caller's promise that cov is exactly
        symmetric, as every layer's output is. A layer without a rule refuses by name."""
        raise ValueError(f"{type(self).__name__} has no full-covariance rule; the layers with "
                         f"one: {FULL_RULES}")

    def kl(self) -> torch.Tensor:
        return torch.zeros(())


PRIORS = ("fixed", "fan_in")


def normal_kl(mu: torch.Tensor, sigma: torch.Tensor, prior_std: float) -> torch.Tensor:
    """KL(N(μ, σ²) ‖ N(0, prior_std²)) summed over the entries of μ and σ."""
    return (math.log(prior_std) - torch.log(sigma)
            + (sigma ** 2 + mu ** 2) / (2 * prior_std ** 2) - 0.5).sum()


class _GaussianParams(MomentModule):
    """Mean-field Gaussian weight and bias: μ and ρ per entry, σ = softplus(ρ).

    The prior is N(0, prior_std²) on every weight and bias (``prior: fixed``) or
    N(0, prior_std²/fan_in) (``prior: fan_in``: the layer's std shrinks like its init range, so a
    wide layer's summed output keeps the same prior scale).
    """

    def __init__(self, weight_shape: tuple[int, ...], bias_size: int, fan_in: int,
                 prior_std: float, rho_init: float, prior: str = "fixed") -> None:
        super().__init__()
        if prior_std <= 0:
            raise ValueError(f"prior_std must be > 0, got {prior_std}")
        if prior not in PRIORS:
            raise ValueError(f"prior '{prior}' is not one of {PRIORS}")
        self.prior = prior
        self.prior_std = float(prior_std) / (math.sqrt(fan_in) if prior == "fan_in" else 1.0)
        bound = 1.0 / math.sqrt(fan_in)  # PyTorch's default nn.Linear init range
        self.weight_mu = nn.Parameter(torch.empty(weight_shape).uniform_(-bound, bound))
        self.weight_rho = nn.Parameter(torch.full(weight_shape, float(rho_init)))
        self.bias_mu = nn.Parameter(torch.empty(bias_size).uniform_(-bound, bound))
        self.bias_rho = nn.Parameter(torch.full((bias_size,), float(rho_init)))

    @property
    def weight_var(self) -> torch.Tensor:
        return F.softplus(self.weight_rho) ** 2

    @property
    def bias_var(self) -> torch.Tensor:
        return F.softplus(self.bias_rho) ** 2

    def kl(self) -> torch.Tensor:
        """KL(q ‖ N(0, prior_std²)) summed over every weight and bias (prior_std: this
        layer's, after any fan-in scaling)."""
        return (normal_kl(self.weight_mu, F.softplus(self.weight_rho), self.prior_std)
                + normal_kl(self.bias_mu, F.softplus(self.bias_rho), self.prior_std))

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n independent draws of (weight, bias): shapes (n, *weight_shape), (n, out)."""
        w = self.weight_mu + F.softplus(self.weight_rho) * torch.randn(
            (n, *self.weight_mu.shape), device=self.weight_mu.device)
        b = self.bias_mu + F.softplus(self.bias_rho) * torch.randn(
            (n, *self.bias_mu.shape), device=self.bias_mu.device)
        return w, b


class GaussianLinear(_GaussianParams):
    """Bayesian linear layer. Input and output moments are (B, in) → (B, out).

        mean = m μ_Wᵀ + μ_b
        var  = v (μ_W² + σ_W²)ᵀ + m² (σ_W²)ᵀ + σ_b²
    """

    def __init__(self, in_features: int, out_features: int, prior_std: float = 1.0,
                 rho_init: float = -2.0, prior: str = "fixed") -> None:
        super().__init__((out_features, in_features), out_features, in_features,
                         prior_std, rho_init, prior)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_var = self.weight_var
        out_mean = F.linear(mean, self.weight_mu, self.bias_mu)
        out_var = (F.linear(var, self.weight_mu ** 2 + w_var)
                   + F.linear(mean ** 2, w_var) + self.bias_var)
        return out_mean, out_var

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with fewer passes: (B, in) → (B, out) by
        :func:`~uqbench.methods.moments.fused.linear_moments` (var None: v = 0); under
        torch.compile an output of ≤ 2 units from more than one input is a sum over the inputs,
        so it fuses into the previous activation instead of writing (B, in) moments out."""
        w_var, w_second, b_var = self._variances()
        if self.in_features > 1 and torch.compiler.is_compiling() and self.out_features <= 2:
            m = mean.unsqueeze(1)                                           # (B, 1, in)
            out_mean = (m * self.weight_mu).sum(-1) + self.bias_mu
            out_var = (m * m * w_var).sum(-1) + b_var
            if var is not None:
                out_var = out_var + (var.unsqueeze(1) * w_second).sum(-1)
            return out_mean, out_var
        return linear_moments(mean, var, self.weight_mu, self.bias_mu, w_var, w_second, b_var)

    def _variances(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """σ_W², μ_W² + σ_W² and σ_b², as ``forward_fused`` reads them. Eagerly without
        autograd (inference) they are kept and reused while the parameters they come from are
        the same tensors, unchanged (each one's version counter, which every in-place update
        moves: an optimiser step, load_state_dict): the same numbers without recomputing them
        (softplus, squares, sums) at every call. With autograd or under torch.compile they are
        computed afresh."""
        params = (self.weight_mu, self.weight_rho, self.bias_rho)
        cacheable = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        if cacheable:
            cached = self.__dict__.get("_variances_cache")
            if cached is not None and all(_same(p, key) for p, key
                                          in zip(params, cached[0], strict=True)):
                return cached[1]
        w_var = self.weight_var
        out = (w_var, self.weight_mu ** 2 + w_var, self.bias_var)
        if cacheable:
            self.__dict__["_variances_cache"] = (tuple(_state(p) for p in params), out)
        return out

    full_rule = True

    def forward_full(self, mean: torch.Tensor, var: torch.Tensor | None,
                     cov: torch.Tensor | None, full_out: bool = True,
                     fused: bool = True, symmetric: bool = False) -> FullMoments:
        """(B, in) → (B, out) with covariances (Wu et al. 2019, eq. 3). y = Wx + b, with every
        W_ik ~ N(M_ik, V_ik) and b_i ~ N(b̄_i, v_i) independent and independent of x, whose
        mean is m and covariance Σ; E[W_ik W_jl] = M_ik M_jl + δ_ij δ_kl V_ik gives
            Cov(y_i, y_j) = Σ_kl M_ik M_jl Σ_kl + δ_ij [Σ_k V_ik (Σ_kk + m_k²) + v_i].
        var None: a deterministic input, whose outputs are independent (cov None); cov None:
        independent inputs, Σ = diag(var). ``full_out`` false: the variances only
        (B·out·in² multiply-adds instead of B·out²·in)."""
        w = self.weight_mu
        out_mean = F.linear(mean, w, self.bias_mu)
        second = mean * mean if var is None else var + mean * mean         # E[x_k²]
        extra = F.linear(second, self.weight_var) + self.bias_var          # (B, out)
        if var is None:
            return out_mean, extra, None
        if cov is None:
            if not full_out:
                return out_mean, F.linear(var, w * w) + extra, None
            # M diag(v) Mᵀ, symmetrised, + diag(extra), and its diagonal; 1 product back
            spread, out_var = diagonal_sandwich_and_variances(var, w, extra)
            return out_mean, out_var, spread
        if not full_out:
            cw = cov @ w.T                                                  # Σ Mᵀ: (B, in, out)
            return out_mean, (cw * w.T).sum(-2) + extra, None
        if symmetric or torch.equal(cov, cov.transpose(-1, -2)):   # every layer's output
            # M Σ Mᵀ, symmetrised, + diag(extra), and its diagonal; its backward in 3 products
            spread, out_var = sandwich_and_variances(cov, w, extra)
            return out_mean, out_var, spread
        spread = w @ (cov @ w.T)                                            # M Σ Mᵀ
        spread = symmetric_part(spread)
        out_var = spread.diagonal(dim1=-2, dim2=-1) + extra
        spread.diagonal(dim1=-2, dim2=-1).add_(extra)       # + diag(extra), in place
        return out_mean, out_var, spread

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        """(S, B, in) → (S, B, out), weights drawn once per sample s."""
        w, b = self.sample(x.shape[0])  # (S, out, in), (S, out)
        return torch.baddbmm(b.unsqueeze(1), x, w.transpose(1, 2))

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, prior_std={self.prior_std}"


def _state(p: torch.Tensor) -> tuple[torch.Tensor, int, torch.UntypedStorage, torch.dtype,
                                      torch.Size]:
    """What identifies a parameter's current values: the tensor, its version counter, its
    storage (held, so that no new storage can take its address while the key exists: a
    ``module.to()`` swaps a parameter's data without moving its counter), dtype and shape."""
    return p, p._version, p.untyped_storage(), p.dtype, p.shape


def _same(p: torch.Tensor, key: tuple) -> bool:
    q, version, storage, dtype, shape = key
    return (p is q and p._version == version and p.dtype == dtype and p.shape == shape
            and p.untyped_storage().data_ptr() == storage.data_ptr())


class MomentLeakyReLU(MomentModule):
    """Leaky-ReLU with slope a (ReLU: a = 0); moments by :func:`leaky_relu_moments`."""

    def __init__(self, slope: float = 0.0) -> None:
        super().__init__()
        self.slope = float(slope)

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return leaky_relu_moments(mean, var, self.slope)

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        var = torch.zeros_like(mean) if var is None else var
        return leaky_relu_moments_fused(mean, var, self.slope)

    full_rule = True

    def forward_full(self, mean: torch.Tensor, var: torch.Tensor | None,
                     cov: torch.Tensor | None, full_out: bool = True,
                     fused: bool = True, symmetric: bool = False) -> FullMoments:
        """Means and variances by the univariate rule (fused or reference: equal to rounding),
        covariances by :func:`~uqbench.methods.moments.covariance.leaky_relu_full_covariance`;
        independent inputs (cov None) give independent outputs."""
        rule = leaky_relu_moments_fused if fused else leaky_relu_moments
        out_mean, out_var = rule(mean, torch.zeros_like(mean) if var is None else var, self.slope)
        if cov is None or not full_out:
            return out_mean, out_var, None
        full = leaky_relu_full_covariance(mean, cov, out_var, self.slope, symmetric, var)
        return out_mean, out_var, full

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.slope)

    def extra_repr(self) -> str:
        return f"slope={self.slope}"


class MomentReLU(MomentLeakyReLU):
    def __init__(self) -> None:
        super().__init__(0.0)


class MomentSequential(MomentModule):
    """Chain of moment modules; ``kl`` sums the layers' KL terms.

    A MomentModule, not an nn.Sequential, since its forward takes and returns (mean, var); the
    layers are its children "0", "1", … as in an nn.Sequential, so state dicts keep their keys.
    """

    def __init__(self, *layers: MomentModule) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add_module(str(i), layer)

    def __iter__(self) -> Iterator[MomentModule]:
        # every child is a MomentModule: __init__ registers nothing else
        return iter(cast(dict[str, MomentModule], self._modules).values())

    def __getitem__(self, index: int) -> MomentModule:
        return list(self)[index]

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for layer in self:
            mean, var = layer(mean, var)
        return mean, var

    def forward_fused(self, mean: torch.Tensor,
                      var: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` by the fused path (equal to rounding, gradients included); var None: a
        deterministic input, v = 0."""
        for layer in self:
            mean, var = layer.forward_fused(mean, var)
        return mean, torch.zeros_like(mean) if var is None else var

    def forward_full(self, mean: torch.Tensor, var: torch.Tensor | None = None,
                     cov: torch.Tensor | None = None, full_out: bool = False,
                     fused: bool = True, symmetric: bool = False) -> PassMoments:
        """:func:`full_pass` over every layer: ``full_out`` applies to the last one only (the
        network's output needs its variances alone), the layers before it pass their full
        covariance on; the output's mean, variance and covariance (None unless full_out)."""
        return full_pass(list(self), (mean, var, cov), full_out=full_out, fused=fused,
                         symmetric=symmetric)

    def forward_sampled(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer.forward_sampled(x)
        return x

    def kl(self) -> torch.Tensor:
        return sum((layer.kl() for layer in self), torch.zeros(()))


def full_pass(layers: Sequence[MomentModule], moments: FullMoments, full_out: bool = False,
              fused: bool = True, symmetric: bool = False) -> PassMoments:
    """``layers``' ``forward_full`` in turn from ``moments`` (a network's or a part's): every
    layer but the last passes its full covariance on, the last only when ``full_out`` (an
    output needs its variances alone). Returns the mean, the variance (zeros for a
    deterministic input all through) and the covariance (None unless ``full_out``). Each
    layer after the first is told its input covariance is exactly symmetric (every layer's
    output is); ``symmetric``: the caller's promise for ``moments``' own."""
    mean, var, cov = moments
    for n, layer in enumerate(layers):
        mean, var, cov = layer.forward_full(mean, var, cov,
                                            full_out=full_out or n < len(layers) - 1,
                                            fused=fused, symmetric=symmetric or n > 0)
    return mean, torch.zeros_like(mean) if var is None else var, cov
