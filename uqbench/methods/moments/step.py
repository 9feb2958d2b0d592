"""The training pass in one autograd node: the network's output moments and its KL together.

A training step of the BNN takes the output moments of one moment pass and the KL of every
weight and bias to the prior, then their gradients. Through autograd that is a few hundred small
operations on tensors of a hundred rows, most of the step's time spent per operation, not per
number. :func:`moments_and_kl` computes the same quantities in one :class:`torch.autograd.Function`
whose backward is written out in closed form, sharing σ = softplus(ρ) between the moments and
the KL and each activation's Φ and φ between its forward and backward:

    linear   M = m Wᵀ + b̄          V = m² Σᵀ + v (W² + Σ)ᵀ + s_b      (Σ = σ_W², s_b = σ_b²)
             ∂W = gMᵀ m + 2W ⊙ (gVᵀ v)     ∂Σ = gVᵀ (m² + v)     ∂b̄ = Σ_B gM     ∂s_b = Σ_B gV
             ∂m = gM W + 2m ⊙ (gV Σ)       ∂v = gV (W² + Σ)
             ∂ρ = ∂σ² · 2σ · sigmoid(ρ)     (σ = softplus(ρ))
    Leaky-ReLU: :func:`~uqbench.methods.moments.activations.leaky_relu_moments_vjp`
    KL       Σ log p − log σ + (σ² + μ²)/(2p²) − ½:  ∂μ = μ/p²,  ∂σ = σ/p² − 1/σ

The numbers are those of ``MomentSequential.forward_fused`` and ``MomentSequential.kl`` to
rounding, gradients included (``tests/test_moments_step.py``); the BNN uses it for the diagonal
pass's training loss (``training: moments``, ``fused: true``). Under torch.compile (``compile:
true``) the same closed forms run as plain operations instead (:func:`_traced_moments_and_kl`),
which the compiler fuses and its cache keeps.

R networks of one plan side by side (seeds trained in one job): inputs (R, B, in) and every
parameter stacked to (R, …) give the same closed forms per member through batched matrix
products, and the KL per member, (R,); the operations, and so the per-operation time, are
those of one network.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from uqbench.methods.moments.activations import leaky_relu_moments_vjp
from uqbench.methods.moments.fused import _leaky_relu_moments_fused
from uqbench.methods.moments.layers import (
    GaussianLinear,
    MomentLeakyReLU,
    MomentSequential,
    normal_kl,
)


def fusable(net: MomentSequential) -> bool:
    """Whether ``net`` is a chain this pass knows: Gaussian linear layers and Leaky-ReLUs,
    the first and the last layer linear."""
    layers = list(net)
    return (bool(layers) and isinstance(layers[0], GaussianLinear)
            and isinstance(layers[-1], GaussianLinear)
            and all(isinstance(m, (GaussianLinear, MomentLeakyReLU)) for m in layers))


class _MomentsAndKL(torch.autograd.Function):
    """(x, *params) → output mean, output variance, KL; params: μ_W, ρ_W, μ_b, ρ_b of each
    linear layer in order. ``plan``: per layer, ("linear", prior std p) or ("act", a)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: tuple[tuple[str, float], ...],
                *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mean: torch.Tensor = x
        var: torch.Tensor | None = None  # the data: deterministic
        saved: list[Any] = []
        sigmas: list[torch.Tensor] = []
        members = x.dim() == 3  # R networks side by side: x (R, B, in), parameters (R, …)
        kl = x.new_zeros(x.shape[:-2])  # (): one network's KL; (R,): each member's
        it = iter(params)
        for kind, value in plan:
            if kind == "act":
                mean, var, keep = _leaky_relu_moments_fused(
                    mean, torch.zeros_like(mean) if var is None else var, value, keep=True)
                saved.append(keep)
                continue
            w, w_rho, b, b_rho = next(it), next(it), next(it), next(it)
            w_sig, b_sig = F.softplus(w_rho), F.softplus(b_rho)
            w_var, b_var = w_sig * w_sig, b_sig * b_sig
            second = mean * mean
            out_mean = _addmm(b, mean, w)
            out_var = _addmm(b_var, second, w_var)
            if var is not None:
                out_var = _addmm(out_var, var, w * w + w_var)
            saved.append((mean, var, second, w_var))
            sigmas += [w_sig, b_sig]
            kl = kl + _kl(w, w_sig, value, members) + _kl(b, b_sig, value, members)
            mean, var = out_mean, out_var
        ctx.plan, ctx.saved = plan, saved
        ctx.save_for_backward(*params, *sigmas)
        return mean, torch.zeros_like(mean) if var is None else var, kl

    @staticmethod
    def backward(ctx: Any, g_mean: torch.Tensor, g_var: torch.Tensor,
                 g_kl: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        n_params = sum(4 for kind, _ in ctx.plan if kind == "linear")
        params, sigmas = tensors[:n_params], tensors[n_params:]
        grads: list[torch.Tensor] = [torch.empty(0)] * n_params
        layer = n_params // 4
        for (kind, value), saved in zip(reversed(ctx.plan), reversed(ctx.saved), strict=True):
            if kind == "act":
                g_mean, g_var = leaky_relu_moments_vjp(saved, value, g_mean, g_var)
                continue
            layer -= 1
            w, w_rho, b, b_rho = params[4 * layer: 4 * layer + 4]
            w_sig, b_sig = sigmas[2 * layer], sigmas[2 * layer + 1]
            mean, var, second, w_var = saved
            g_var_t = g_var.mT
            g_w = g_mean.mT @ mean
            g_w_var = g_var_t @ (second if var is None else second + var)
            if var is not None:
                g_w = g_w + 2 * w * (g_var_t @ var)
            g_b, g_b_var = g_mean.sum(-2), g_var.sum(-2)
            inv_p2 = 1.0 / value ** 2
            # the KL's gradient: one number, or one per member (R,) against (R, …) parameters
            kl_w, kl_b = (g_kl, g_kl) if g_kl.dim() == 0 else (g_kl[:, None, None],
                                                               g_kl[:, None])
            # ∂/∂σ of the moments' σ² and of the KL, then through σ = softplus(ρ)
            g_w_sig = 2 * w_sig * g_w_var + kl_w * (w_sig * inv_p2 - 1 / w_sig)
            g_b_sig = 2 * b_sig * g_b_var + kl_b * (b_sig * inv_p2 - 1 / b_sig)
            grads[4 * layer: 4 * layer + 4] = [
                g_w + kl_w * inv_p2 * w, g_w_sig * torch.sigmoid(w_rho),
                g_b + kl_b * inv_p2 * b, g_b_sig * torch.sigmoid(b_rho)]
            if layer > 0 or ctx.needs_input_grad[0]:  # the data's gradient: when asked for
                g_mean, g_var = (_mm(g_mean, w).addcmul_(mean, _mm(g_var, w_var), value=2),
                                 _mm(g_var, w * w + w_var) if var is not None else g_var)
        return (g_mean if ctx.needs_input_grad[0] else None, None, *grads)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (…, B, k) @ b (…, k, n); for k ≤ 2 (the output layer's one or two units) as k outer
    products: a CPU matrix product that thin takes about twice as long (measured at k = 2)."""
    if a.shape[-1] > 2:
        return a @ b
    out = a[..., :1] * b[..., :1, :]
    for k in range(1, a.shape[-1]):
        out.addcmul_(a[..., k:k + 1], b[..., k:k + 1, :])
    return out


def _addmm(c: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """c + a wᵀ for a layer's weight-shaped ``w`` (out, in), inputs a (B, in) and c (out,) or
    (B, out); or, R members side by side, w (R, out, in), a (R, B, in), c (R, out) or
    (R, B, out)."""
    if a.dim() == 2:
        return torch.addmm(c, a, w.T)
    return torch.baddbmm(c if c.dim() == 3 else c.unsqueeze(1), a, w.mT)


def _kl(mu: torch.Tensor, sigma: torch.Tensor, prior_std: float, members: bool
        ) -> torch.Tensor:
    """:func:`normal_kl` of one network's parameter, or with ``members`` each member's (R,)
    of an (R, …) one."""
    if not members:
        return normal_kl(mu, sigma, prior_std)
    return (math.log(prior_std) - torch.log(sigma)
            + (sigma ** 2 + mu ** 2) / (2 * prior_std ** 2) - 0.5).flatten(1).sum(1)


Plan = tuple[tuple[str, float], ...]


def fused_plan(net: MomentSequential) -> tuple[Plan, list[torch.Tensor]]:
    """What :func:`moments_and_kl` passes to its node for ``net``: per layer ("linear", prior
    std) or ("act", slope), and μ_W, ρ_W, μ_b, ρ_b of each linear layer in order. ``net`` must
    be :func:`fusable`."""
    plan: list[tuple[str, float]] = []
    params: list[torch.Tensor] = []
    for m in net:
        if isinstance(m, GaussianLinear):
            plan.append(("linear", m.prior_std))
            params += [m.weight_mu, m.weight_rho, m.bias_mu, m.bias_rho]
        elif isinstance(m, MomentLeakyReLU):
            plan.append(("act", m.slope))
        else:
            raise ValueError(f"moments_and_kl takes GaussianLinear and MomentLeakyReLU layers, "
                             f"got {type(m).__name__}")
    if not plan or plan[0][0] != "linear" or plan[-1][0] != "linear":
        raise ValueError("moments_and_kl needs a chain that starts and ends with a "
                         "GaussianLinear layer")
    return tuple(plan), params


def planned_moments_and_kl(x: torch.Tensor, plan: Plan, params: list[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moments_and_kl` from :func:`fused_plan`'s plan and parameters (no module in the
    arguments: what a compiled training loss traces). Eagerly the one autograd node; under
    torch.compile :func:`_traced_moments_and_kl`, the same closed forms as plain operations."""
    if torch.compiler.is_compiling():
        return _traced_moments_and_kl(x, plan, params)
    mean, var, kl = _MomentsAndKL.apply(x, plan, *params)
    return mean, var, kl


def _traced_moments_and_kl(x: torch.Tensor, plan: Plan, params: list[torch.Tensor]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:class:`_MomentsAndKL`'s numbers as plain tensor operations, for torch.compile.

    Compiled, the one autograd node costs as much as it saves: the compiler traces its forward
    and its backward apart, and its compile cache does not keep graphs that hold one, so every
    process compiles them again. Here the linear layers and the KL are ordinary operations
    (their gradients are autograd's), and each Leaky-ReLU is its closed-form value plus its
    closed-form Jacobian times the input's deviation from itself (:func:`_leaky_relu_traced`):
    the same values, and the same gradients as the node's backward. The graph has no custom
    node, so the compile cache serves every later process (a sweep's second worker)."""
    mean: torch.Tensor = x
    var: torch.Tensor | None = None  # the data: deterministic
    members = x.dim() == 3
    kl = x.new_zeros(x.shape[:-2])
    it = iter(params)
    for kind, value in plan:
        if kind == "act":
            mean, var = _leaky_relu_traced(
                mean, torch.zeros_like(mean) if var is None else var, value)
            continue
        w, w_rho, b, b_rho = next(it), next(it), next(it), next(it)
        w_sig, b_sig = F.softplus(w_rho), F.softplus(b_rho)
        w_var, b_var = w_sig * w_sig, b_sig * b_sig
        bias, bias_var = (b.unsqueeze(-2), b_var.unsqueeze(-2)) if members else (b, b_var)
        out_mean = _times_wt(mean, w) + bias
        out_var = _times_wt(mean * mean, w_var) + bias_var
        if var is not None:
            out_var = out_var + _times_wt(var, w * w + w_var)
        kl = kl + _kl(w, w_sig, value, members) + _kl(b, b_sig, value, members)
        mean, var = out_mean, out_var
    return mean, torch.zeros_like(mean) if var is None else var, kl


def _times_wt(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a wᵀ, a (…, B, in), w (…, out, in): one input or at most two outputs (P2's first and
    last layers) as products and a sum, which the compiler fuses with the activation beside
    them, and whose gradients are such products too (a CPU matrix product with an inner size
    of one or two, as autograd's would be, is several times slower); otherwise a matrix
    product."""
    if a.shape[-1] == 1:
        return a * w.mT
    if w.shape[-2] <= 2:
        return (a.unsqueeze(-2) * w.unsqueeze(-3)).sum(-1)
    return a @ w.mT


def _leaky_relu_traced(mean: torch.Tensor, var: torch.Tensor, a: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Leaky-ReLU's output moments with the gradients of
    :func:`~uqbench.methods.moments.activations.leaky_relu_moments_vjp`, as plain operations:
    M + J_Mμ·δμ + J_Mv·δv and V + J_Vμ·δμ + J_Vv·δv, where M, V and the Jacobian J come from
    the detached inputs and δ = input − detached input is zero (so the values are M and V) with
    the identity as its gradient (so the gradients are Jᵀ·g, the closed forms)."""
    m0, v0 = mean.detach(), var.detach()
    out_mean, out_var, (_, s, cdf, pdf, e_pos, _) = _leaky_relu_moments_fused(m0, v0, a,
                                                                             keep=True)
    ratio = pdf / s                                                      # φ/s
    dm_dmu = cdf * (1 - a) + a                                           # a + (1−a)Φ
    dm_dv = ratio * (0.5 * (1 - a))                                      # (1−a)φ/(2s)
    dv_dmu = ((1 + a - dm_dmu) * e_pos - a * m0 * cdf) * (2 * (1 - a))  # 2(1−a)[E₊(1−(1−a)Φ) − aμΦ]
    dv_dv = cdf * (1 - a * a) + a * a + (a - 1) * out_mean * ratio       # a² + (1−a²)Φ − (1−a)Mφ/s
    d_mean, d_var = mean - m0, var - v0
    return (out_mean + dm_dmu * d_mean + dm_dv * d_var,
            out_var + dv_dmu * d_mean + dv_dv * d_var)


def moments_and_kl(net: MomentSequential, x: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output mean and variance of ``net``'s fused moment pass for deterministic inputs
    x (B, in), and ``net.kl()``, as one autograd node (the module docstring's closed forms).
    ``net`` must be :func:`fusable`: its layers Gaussian linear and Leaky-ReLU, the last linear."""
    return planned_moments_and_kl(x, *fused_plan(net))
