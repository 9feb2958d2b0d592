"""Laplace-LoRA's linearised (GLM) predictive from one forward and C backward passes per batch.

The predictive's moments are f_MAP (B, C) and J P⁻¹ Jᵀ (B, C, C), J the per-example Jacobian
of the C logits with respect to the LoRA weights. For an adapter y = W x + s · B (A x) the
Jacobian is a sum over the layer's positions n (tokens, patches) of outer products:
∂f_c/∂B = s Σ_n g_cn (A x_n)ᵀ and ∂f_c/∂A = s Σ_n (Bᵀ g_cn) x_nᵀ, g_cn = ∂f_c/∂y_n. So one
forward pass that keeps each adapter's input, and one backward pass per class that returns
the gradients g at every adapter's output (:func:`lora_gradients`), give the Jacobians of a
whole batch: the examples of a batch are independent in evaluation mode (no batch
statistics), so the gradient of Σ_b f_bc at example b's positions is example b's own.

With laplace-torch's Kronecker-factored posterior (``hessian: kron``), each adapter weight's
precision block is (Q₁ ⊗ Q₂)(Λ₁ ⊗ Λ₂ + δ)(Q₁ ⊗ Q₂)ᵀ (eigendecomposed once, when it is
fitted; the prior precision δ added), so J P⁻¹ Jᵀ = Σ_blocks Σ_ij M_ci,j M_c'i,j / (λ₁ᵢ λ₂ⱼ + δ)
with M = Q₁ᵀ J Q₂. :class:`RotatedJacobians` computes M once per batch with the rotations
folded into the sums over positions (x Q₂ before the outer products; Q₁ on the small side
first), and the variance of any prior precision from it: the prior's grid search reuses one
batch's M for every point. laplace-torch's own ``functional_variance`` computes the same
quadratic form from the flat Jacobians, rotating them there and back; the other Hessians
(diag, full) use it on :func:`lora_jacobians`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class AdapterGradients:
    """One adapter's share of a batch: its input x (B, N, in) and, per class c, the gradients
    g_c (B, N, out) of the logits f[:, c] with respect to its output."""

    layer: Any  # a MapLoRALinear (its lora_A, lora_B and scaling)
    x: torch.Tensor
    g: list[torch.Tensor]

    def scaled(self) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(x, h = A x (B, N, r), [s · g_c]) in the adapters' dtype: what both weights'
        Jacobians are sums over positions of."""
        weight_a = self.layer.lora_A.weight.detach()
        x = self.x.to(weight_a.dtype)
        return x, x @ weight_a.T, [self.layer.scaling * g.to(weight_a.dtype) for g in self.g]


def lora_gradients(model: nn.Module, layers: Sequence[nn.Module], inputs: Any
                   ) -> tuple[torch.Tensor, list[AdapterGradients]]:
    """The logits f (B, C) of ``model`` at ``inputs`` and, for every call of each adapter of
    ``layers`` in the forward pass, its input and the gradient of every logit with respect to
    its output (one backward pass per class, each for the whole batch)."""
    calls: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []

    def keep(layer: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        if not out.requires_grad:  # frozen weights: the output starts the graph
            out.requires_grad_(True)
        calls.append((layer, args[0].detach(), out))

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    try:
        with torch.enable_grad():
            f = model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    outputs = [out for _, _, out in calls]
    classes = f.shape[-1]
    per_class = []
    for c in range(classes):
        onehot = torch.zeros_like(f)
        onehot[:, c] = 1
        grads = torch.autograd.grad(f, outputs, onehot, retain_graph=c < classes - 1,
                                    allow_unused=True)
        per_class.append([torch.zeros_like(out) if g is None else g
                          for g, out in zip(grads, outputs, strict=True)])
    return f.detach(), [
        AdapterGradients(layer, x.reshape(x.shape[0], -1, x.shape[-1]),
                         [grads[i].reshape(x.shape[0], -1, out.shape[-1]) for grads in per_class])
        for i, (layer, x, out) in enumerate(calls)]


def _summed(blocks: dict[int, list[torch.Tensor]], key: int, pair: list[torch.Tensor]) -> None:
    """Add one call's ``pair`` of blocks to ``key``'s (an adapter called more than once)."""
    old = blocks.get(key)
    blocks[key] = pair if old is None else [a + b for a, b in zip(old, pair, strict=True)]


def lora_jacobians(parts: list[AdapterGradients], layers: Sequence[nn.Module]) -> torch.Tensor:
    """J (B, C, P) over every adapter's A and B weights in the order of ``layers`` (A before
    B: laplace-torch's flat layout of their parameters), summed over an adapter's calls."""
    blocks: dict[int, list[torch.Tensor]] = {}
    for part in parts:
        x, h, gds = part.scaled()
        weight_b = part.layer.lora_B.weight.detach()
        # ∂f_c/∂A = Σ_n (Bᵀ gd_cn) x_nᵀ (B, r, in); ∂f_c/∂B = Σ_n gd_cn h_nᵀ (B, out, r)
        d_a = torch.stack([torch.bmm((gd @ weight_b).transpose(1, 2), x) for gd in gds], 1)
        d_b = torch.stack([torch.bmm(gd.transpose(1, 2), h) for gd in gds], 1)
        _summed(blocks, layers.index(part.layer), [d_a.flatten(2), d_b.flatten(2)])
    return torch.cat([j for k in range(len(layers)) for j in blocks[k]], dim=-1)


def _inverse(values: list[torch.Tensor], delta: torch.Tensor, damping: bool) -> torch.Tensor:
    """(λ₁ λ₂ᵀ + δ)⁻¹ (out, in) of one Kronecker block, as laplace-torch's
    ``KronDecomposed`` forms it (``damping``: (λ₁ + √δ)(λ₂ + √δ)ᵀ)."""
    l1, l2 = values
    if damping:
        return torch.pow(torch.outer(l1 + torch.sqrt(delta), l2 + torch.sqrt(delta)), -1)
    return torch.pow(torch.outer(l1, l2) + delta, -1)


class RotatedJacobians:
    """One batch's Jacobians in the eigenbases of a Kronecker-factored posterior precision
    (laplace-torch's ``KronDecomposed``, one two-factor block per adapter weight, A before B):
    M = Q₁ᵀ J Q₂ per block (B, C, out · in; block B's entries in (in, out) order, which the
    sum over entries does not see), from which :meth:`variance` gives J P⁻¹ Jᵀ at the
    posterior's current prior precision."""

    def __init__(self, parts: list[AdapterGradients], layers: Sequence[nn.Module],
                 precision: Any) -> None:
        vectors = precision.eigenvectors
        rotated: dict[int, list[torch.Tensor]] = {}
        for part in parts:
            k = 2 * layers.index(part.layer)
            (qa1, qa2), (qb1, qb2) = vectors[k], vectors[k + 1]
            x, h, gds = part.scaled()
            batch, _, out = gds[0].shape
            # block A: M = Q₁ᵀ (Σ_n Bᵀ gd_n x_nᵀ) Q₂ = Σ_n ((B Q₁)ᵀ gd_n)(Q₂ᵀ x_n)ᵀ
            bq, xq = part.layer.lora_B.weight.detach() @ qa1, x @ qa2
            m_a = torch.stack([torch.bmm((gd @ bq).transpose(1, 2), xq) for gd in gds], 1)
            # block B: Mᵀ = Q₂ᵀ (Σ_n h_n gd_nᵀ) Q₁, the r × out side first
            hq = (h @ qb2).transpose(1, 2)
            m_bt = torch.stack([torch.bmm(hq, gd) for gd in gds], 1) @ qb1      # (B, C, r, out)
            _summed(rotated, k, [m_a.flatten(2), m_bt.flatten(2)])
        self.blocks = [m for k in sorted(rotated) for m in rotated[k]]

    @staticmethod
    def fits(layers: Sequence[Any], precision: Any) -> bool:
        """Whether ``precision`` holds one two-factor block per adapter weight, shaped as the
        weight (out, in), A before B (what laplace-torch's KFAC makes of them)."""
        shapes = [tuple(w.shape) for layer in layers
                  for w in (layer.lora_A.weight, layer.lora_B.weight)]
        values = precision.eigenvalues
        return len(values) == len(shapes) and all(
            len(ls) == 2 and (len(ls[0]), len(ls[1])) == s
            for ls, s in zip(values, shapes, strict=True))

    def variance(self, precision: Any, diagonal: bool = False) -> torch.Tensor:
        """J P⁻¹ Jᵀ (B, C, C), or its diagonal (B, C), for ``precision`` (laplace-torch's
        ``posterior_precision``: its eigenvalues, prior precisions and damping)."""
        total: torch.Tensor | None = None
        for i, (m, values, delta) in enumerate(zip(self.blocks, precision.eigenvalues,
                                                   precision.deltas, strict=True)):
            inverse = _inverse(values, delta, precision.damping)
            weighted = m * (inverse if i % 2 == 0 else inverse.T).reshape(-1)
            term = ((weighted * m).sum(-1) if diagonal
                    else torch.bmm(weighted, m.transpose(1, 2)))
            total = term if total is None else total + term
        assert total is not None
        return total
