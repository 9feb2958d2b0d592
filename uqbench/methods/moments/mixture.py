"""A Gaussian-sum closure for the full-covariance pass: the last activation's input as a mixture.

The full pass (:meth:`MomentSequential.forward_full`) closes every activation's input as one
Gaussian with the propagated mean and covariance. That input is exact for the first activation
(the weights are Gaussian and the network's input is fixed) and close to Gaussian for the
next, but from the third on it is a Gaussian *mixed over* the activations below it: the
units of a layer share a few common modes (with one input, most of a layer's spread moves
its units together), and a mode passed through an activation and summed by the next layer
is skewed, not Gaussian. Its Gaussian closure then misses the spread of the output by up to
15 % where Monte Carlo agrees with itself within 1–2 %, even with every covariance carried.

The mixture keeps the Gaussian closure where it is good, at the input a of the network's
second-to-last activation, with mean μ and covariance Σ, and splits it along its ``modes``
leading principal directions: with Σ's eigenpairs (λ_j, u_j), λ₁ ≥ λ₂ ≥ …,

    a = μ + Σ_{j ≤ r} √λ_j z_j u_j + e,   z ~ N(0, I_r),   e ~ N(0, Σ − Σ_{j ≤ r} λ_j u_j u_jᵀ),

exactly (the residual covariance is what the r directions leave, positive semi-definite). The
z are integrated by a tensor Gauss–Hermite rule of ``nodes`` points per direction, so the
mixture has N = nodes^modes components, component n the Gaussian N(μ + U √Λ z_n, Σ_res) with
weight w_n. Each component runs through the rest of the network by the full pass: the closure
at the last activation is now taken given z, where the common modes are fixed, so each part
is close to Gaussian. The output's moments mix by the law of total variance,

    E[y] = Σ w_n m_n,    Var[y] = Σ w_n (v_n + m_n²) − E[y]²,

and E[link(a₂)] of a learned variance mixes as Σ w_n E[link(a₂) | n] (the head's job,
:func:`mix`). One component (``nodes`` 1 and z = 0) is *not* the plain full pass: it drops
the r directions' spread; the rule converges to the Gaussian-at-a answer as ``nodes`` grows,
and to the exact one as ``modes`` reaches the width as well.

The noise term of a learned variance needs more. E[link(a₂)] is an expectation over a₂'s
upper tail, and a₂ is the output layer's sum over the last activation's units, weighted by
random weights: even where the last activation's input z is close to Gaussian, that sum is
not (a₂ is skewed, its upper tail lighter than a Gaussian's), and a₂ closed as one Gaussian
at its exact mean and variance can be off by a factor of two or more. So the components'
Gaussians at z are collapsed to one per input (their mixture's mean and covariance), and
E[link(a₂)] splits that z along a₂'s own direction: with z ~ N(M, C), g = μ_w ⊙ E[f'(z)]
(a₂'s mean weights times the activation's mean slope, its statistical linearisation) and
k = C g / √(gᵀ C g), z = M + t k + e with t ~ N(0, 1) and e ~ N(0, C − k kᵀ) (exactly: by
Stein's lemma k is the direction along which z carries a₂'s linear part), t integrated by
``link_nodes`` Gauss–Hermite nodes, each node's Gaussian run through the last activation and
the output layer by the full pass, a₂ closed given the node, E[link(a₂)] mixed over the nodes
(:func:`link_split`). It changes only the noise term; ``link_nodes`` 0 closes a₂ as one
Gaussian per component, as the plain full pass does. The collapse is what it costs little
for (one split per input, not per component), and where z is far from one Gaussian (a narrow
network whose components spread apart) it is what misses.

Cost: N times the rest of the network's full pass, taken over the components of a chunk of
inputs at a time (:data:`CHUNK_ELEMENTS` of covariance entries), plus one eigendecomposition of
each input's (d, d) Σ; the pass up to the split takes the inputs in chunks of as many
covariance entries too, so memory stays a few such chunks whatever the batch. A network with
one hidden activation has nothing to split (its only activation's input is exactly Gaussian):
the plain full pass.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from uqbench.methods.moments.layers import (
    GaussianLinear,
    MomentLeakyReLU,
    MomentModule,
    full_pass,
)
from uqbench.methods.moments.links import expected_link

CHUNK_ELEMENTS = 2**24  # covariance entries (components × inputs × d²) taken through at once


@cache
def hermite_grid(modes: int, nodes: int) -> tuple[tuple[tuple[float, ...], ...], tuple[float, ...]]:
    """The tensor Gauss–Hermite rule for E[f(z)], z ~ N(0, I_modes): nodes^modes points
    (each a tuple of ``modes`` coordinates) and their weights (summing to 1)."""
    z, w = np.polynomial.hermite_e.hermegauss(nodes)  # weight exp(−z²/2): normalise by √(2π)
    w = w / w.sum()
    points = tuple(itertools.product(z.tolist(), repeat=modes))
    weights = tuple(math.prod(p) for p in itertools.product(w.tolist(), repeat=modes))
    return points, weights


def split_point(layers: Sequence[MomentModule]) -> int | None:
    """The index of the network's second-to-last activation (the layer whose input the mixture
    splits), or None with fewer than two activations."""
    acts = [i for i, m in enumerate(layers) if not isinstance(m, GaussianLinear)]
    return acts[-2] if len(acts) >= 2 else None


def components(mean: torch.Tensor, cov: torch.Tensor, modes: int, nodes: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixture of N(mean, cov) (mean (B, d), cov (B, d, d)) along its leading ``modes``
    directions (at most d): component means (B, N, d), the residual covariance (B, d, d)
    shared by the components of an input, and the weights (N,)."""
    d = mean.shape[-1]
    r = min(modes, d)
    lam, vec = torch.linalg.eigh(cov)                        # ascending eigenvalues
    lam_r, vec_r = lam[..., d - r:].clamp_min(0), vec[..., d - r:]
    scaled = vec_r * lam_r.sqrt().unsqueeze(-2)              # U √Λ: (B, d, r)
    residual = cov - scaled @ scaled.transpose(-1, -2)
    residual = 0.5 * (residual + residual.transpose(-1, -2))
    points, weights = hermite_grid(r, nodes)
    z = mean.new_tensor(points)                              # (N, r)
    means = mean.unsqueeze(-2) + torch.einsum("bdr,nr->bnd", scaled, z)
    return means, residual, mean.new_tensor(weights)


@dataclass(frozen=True)
class LinkSplit:
    """The noise term's split (module docstring): outputs ``out_dim`` … 2·out_dim − 1 are a₂,
    ``link`` their variance link, ``nodes`` the Gauss–Hermite nodes along each a₂'s direction."""

    out_dim: int
    link: str
    nodes: int


def mixture_moments(layers: Sequence[MomentModule], x: torch.Tensor, modes: int, nodes: int,
                    fused: bool = True, link: LinkSplit | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The network's output moments per component: means and variances (B, N, outputs) and the
    weights (N,), for inputs x (B, in) (module docstring), and with ``link`` the noise term
    E[link(a₂)] (B, out_dim) by :func:`link_split`, else None. Fewer than two activations: one
    component, the plain full pass."""
    layers = list(layers)
    at = split_point(layers)
    if at is None:
        if link is None:
            mean, var, _ = full_pass(layers, (x, None, None), fused=fused)
            return mean.unsqueeze(1), var.unsqueeze(1), x.new_ones(1), None
        last = _tail(layers)
        (mean, var), (m, c) = _through_tail(layers, 0, last, (x, None, None), fused)
        return (mean.unsqueeze(1), var.unsqueeze(1), x.new_ones(1),
                link_split(layers[last:], m, c, link, fused))
    # the part below the split carries a (d, d) covariance per input: inputs in chunks too
    widest = max(m.out_features for m in layers[:at] if isinstance(m, GaussianLinear))
    outer = max(1, CHUNK_ELEMENTS // (widest * widest))
    outs = [_split_and_finish(layers, at, x[lo:lo + outer], modes, nodes, fused, link)
            for lo in range(0, x.shape[0], outer)]
    weights = outs[0][2]
    noises = [o[3] for o in outs if o[3] is not None]
    return (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), weights,
            torch.cat(noises) if noises else None)


def last_activation(layers: Sequence[MomentModule]) -> int | None:
    """The index of the network's last activation (its input: the last hidden layer's
    pre-activation), or None without a hidden activation."""
    return next((i for i in reversed(range(len(layers)))
                 if not isinstance(layers[i], GaussianLinear)), None)


def _tail(layers: Sequence[MomentModule]) -> int:
    """The index of the last activation, which with the output layer after it makes the
    network's tail (the noise term's split needs exactly that: activation, Gaussian linear)."""
    last = last_activation(layers)
    tail = list(layers) if last is None else layers[last:]
    if last is None or len(tail) != 2 or not isinstance(tail[0], MomentLeakyReLU) \
            or not isinstance(tail[1], GaussianLinear):
        raise ValueError(f"the noise term's split needs the network to end in a Leaky-ReLU and "
                         f"a Gaussian linear layer; it ends in "
                         f"{[type(m).__name__ for m in tail]}")
    return last


def link_split(tail: Sequence[MomentModule], mean: torch.Tensor, cov: torch.Tensor,
               link: LinkSplit, fused: bool = True) -> torch.Tensor:
    """E[link(a₂)] (B, out_dim) with the last activation's input z ~ N(mean (B, D), cov
    (B, D, D)) split along each a₂'s own direction (module docstring): ``tail`` = that
    activation and the output layer. Inputs are taken in chunks of :data:`CHUNK_ELEMENTS`
    covariance entries (nodes × inputs × D²)."""
    step = max(1, CHUNK_ELEMENTS // (link.nodes * mean.shape[-1] ** 2))
    if mean.shape[0] > step:
        return torch.cat([link_split(tail, mean[lo:lo + step], cov[lo:lo + step], link, fused)
                          for lo in range(0, mean.shape[0], step)])
    act, out = tail
    assert isinstance(act, MomentLeakyReLU) and isinstance(out, GaussianLinear)
    b, dim = mean.shape
    sd = cov.diagonal(dim1=-2, dim2=-1).clamp_min(torch.finfo(cov.dtype).tiny).sqrt()
    slope = act.slope + (1 - act.slope) * torch.special.ndtr(mean / sd)  # E[f'(z)], (B, D)
    points, weights = hermite_grid(1, link.nodes)
    t_, w_ = mean.new_tensor(points).squeeze(-1), mean.new_tensor(weights)
    n, d = link.nodes, link.out_dim
    found = []
    for j in range(d):
        g = out.weight_mu[d + j].to(mean.dtype) * slope                 # (B, D)
        cg = torch.einsum("bij,bj->bi", cov, g)
        spread = (g * cg).sum(-1, keepdim=True)
        k = torch.where(spread > 0, cg / spread.clamp_min(torch.finfo(cov.dtype).tiny).sqrt(),
                        torch.zeros_like(cg))                          # (B, D)
        residual = cov - k.unsqueeze(-1) * k.unsqueeze(-2)
        residual = 0.5 * (residual + residual.transpose(-1, -2))
        means = mean.unsqueeze(1) + t_.view(1, -1, 1) * k.unsqueeze(1)  # (B, n, D)
        res = residual.unsqueeze(1).expand(b, n, dim, dim).reshape(b * n, dim, dim)
        om, ov, _ = full_pass(tail, (means.reshape(b * n, dim),
                                     res.diagonal(dim1=-2, dim2=-1).clamp_min(0), res),
                              fused=fused)
        given = expected_link(link.link, om[:, d + j], ov[:, d + j].clamp_min(0))
        found.append((given.reshape(b, n) * w_).sum(1))
    return torch.stack(found, dim=-1)


def _split_and_finish(layers: list[MomentModule], at: int, x: torch.Tensor, modes: int,
                      nodes: int, fused: bool, link: LinkSplit | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`mixture_moments` for one chunk of inputs: the full pass up to the split, then
    the components of a few inputs at a time (:data:`CHUNK_ELEMENTS` covariance entries)
    through the rest; with ``link``, the components' Gaussians at the last activation's input
    are collapsed to one per input (their mixture's mean and covariance), whose
    :func:`link_split` is the noise term."""
    mean, var, cov = full_pass(layers[:at], (x, None, None), full_out=True, fused=fused)
    if cov is None:
        cov = torch.diag_embed(var)
    b, d = mean.shape
    weights = mean.new_tensor(hermite_grid(min(modes, d), nodes)[1])
    n = weights.numel()
    step = max(1, CHUNK_ELEMENTS // (n * d * d))
    last = None if link is None else _tail(layers)
    outs = []
    for lo in range(0, b, step):
        means, residual, _ = components(mean[lo:lo + step], cov[lo:lo + step], modes, nodes)
        bb = means.shape[0]
        res = residual.unsqueeze(1).expand(bb, n, d, d).reshape(bb * n, d, d)
        start = (means.reshape(bb * n, d), res.diagonal(dim1=-2, dim2=-1).clamp_min(0), res)
        noise = None
        if last is None:
            out_mean, out_var, _ = full_pass(layers[at:], start, fused=fused)
        else:
            assert link is not None
            (out_mean, out_var), (m, c) = _through_tail(layers, at, last, start, fused)
            noise = link_split(layers[last:], *_collapse(m.reshape(bb, n, -1),
                                                         c.reshape(bb, n, *c.shape[-2:]),
                                                         weights), link, fused)
        outs.append((out_mean.reshape(bb, n, -1), out_var.reshape(bb, n, -1), noise))
    noises = [o[2] for o in outs if o[2] is not None]
    return (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), weights,
            torch.cat(noises) if noises else None)


def _through_tail(layers: list[MomentModule], start: int, last: int,
                  moments: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
                  fused: bool
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The full pass from layer ``start`` (its input ``moments``) to the output, stopping at
    the last activation (index ``last``) to keep its input's mean and covariance: the output's
    mean and variance, and that input's mean and covariance (for :func:`link_split`)."""
    m, v, c = full_pass(layers[start:last], moments, full_out=True, fused=fused)
    c = torch.diag_embed(v) if c is None else c
    mean, var, _ = full_pass(layers[last:], (m, v, c), fused=fused)
    return (mean, var), (m, c)


def _collapse(means: torch.Tensor, covs: torch.Tensor, weights: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gaussian per input from its components' means (B, N, D) and covariances
    (B, N, D, D): the mixture's mean and covariance (the law of total covariance)."""
    w = weights.view(1, -1, 1)
    mean = (w * means).sum(1)
    spread = means - mean.unsqueeze(1)
    cov = (weights.view(1, -1, 1, 1) * (covs + spread.unsqueeze(-1) * spread.unsqueeze(-2))).sum(1)
    return mean, 0.5 * (cov + cov.transpose(-1, -2))


def mix(mean: torch.Tensor, var: torch.Tensor, weights: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixture's mean and variance (B, k) from the components' (B, N, k) and weights (N,),
    by the law of total variance (the spread of the means taken around their mixture, not as
    E[m²] − E[m]², which cancels when the means are far from 0 against their spread)."""
    w = weights.view(1, -1, 1)
    total = (w * mean).sum(1)
    spread = mean - total.unsqueeze(1)
    return total, (w * (var + spread * spread)).sum(1)
