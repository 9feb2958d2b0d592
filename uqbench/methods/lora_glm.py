"""Laplace-LoRA's linearised (GLM) predictive from one forward and C backward passes per batch.

The predictive's moments are f_MAP (B, C) and J P⁻¹ Jᵀ (B, C, C), J the per-example Jacobian
of the C logits with respect to the LoRA weights. For an adapter y = W x + s · B (A x) the
Jacobian is a sum over the layer's positions n (tokens, patches) of outer products:
∂f_c/∂B = s Σ_n g_cn (A x_n)ᵀ and ∂f_c/∂A = s Σ_n (Bᵀ g_cn) x_nᵀ, g_cn = ∂f_c/∂y_n. So one
forward pass that keeps each adapter's input, and one backward pass per class that returns
the gradients g at every adapter's output (:class:`LoRAPasses`), give the Jacobians of a
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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class AdapterCall:
    """One call of an adapter in the forward pass: its input x (B, N, in) and h = A x
    (B, N, r), in the adapter's dtype, and its output (which the backward passes reach)."""

    layer: Any  # a MapLoRALinear (its lora_A, lora_B and scaling)
    x: torch.Tensor
    h: torch.Tensor
    out: torch.Tensor


class LoRAPasses:
    """One forward pass of ``model`` at ``inputs`` that keeps every call of each adapter of
    ``layers``: the logits ``f`` (B, C), then :meth:`per_class` the backward passes."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], inputs: Any) -> None:
        self.calls: list[AdapterCall] = []

        def keep(layer: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if not out.requires_grad:  # frozen weights: the output starts the graph
                out.requires_grad_(True)
            weight = layer.lora_A.weight.detach()
            x = args[0].detach().to(weight.dtype)
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            with torch.autocast(x.device.type, enabled=False):  # h in the weights' dtype
                self.calls.append(AdapterCall(layer, x, x @ weight.T, out))

        hooks = [layer.register_forward_hook(keep) for layer in layers]
        try:
            with torch.enable_grad():
                self._f = model(inputs)
        finally:
            for hook in hooks:
                hook.remove()
        self.f = self._f.detach()

    def per_class(self) -> Iterator[list[torch.Tensor]]:
        """For each class c, one backward pass of the whole batch: s · ∂f_c/∂y (B, N, out) at
        every call's output y, in the adapter's dtype (one class's gradients alive at a time;
        the graph is freed after the last)."""
        outputs = [call.out for call in self.calls]
        classes = self.f.shape[-1]
        for c in range(classes):
            onehot = torch.zeros_like(self._f)
            onehot[:, c] = 1
            grads = torch.autograd.grad(self._f, outputs, onehot, retain_graph=c < classes - 1,
                                        allow_unused=True)
            yield [call.layer.scaling * (torch.zeros_like(call.out) if g is None else g)
                   .reshape(call.x.shape[0], -1, call.out.shape[-1]).to(call.x.dtype)
                   for g, call in zip(grads, self.calls, strict=True)]


def _summed(blocks: dict[int, list[list[torch.Tensor]]], key: int,
            pair: list[torch.Tensor]) -> None:
    """Append one call's ``pair`` of blocks (one class's) to ``key``'s, in the order of the
    backward passes, then of the calls."""
    lists = blocks.setdefault(key, [[], []])
    for kept, block in zip(lists, pair, strict=True):
        kept.append(block)


def _stacked(blocks: dict[int, list[list[torch.Tensor]]], calls: dict[int, int]
             ) -> list[torch.Tensor]:
    """Each key's blocks (B, C, ·), its calls' shares summed, keys in order."""
    out = []
    for key in sorted(blocks):
        for kept in blocks[key]:
            n = calls[key]  # class c's share of call i is kept[c · n + i]
            per_call = [torch.stack(kept[i::n], 1) for i in range(n)]
            out.append(torch.stack(per_call).sum(0) if len(per_call) > 1 else per_call[0])
    return out


def lora_jacobians(passes: LoRAPasses, layers: Sequence[nn.Module]) -> torch.Tensor:
    """J (B, C, P) over every adapter's A and B weights in the order of ``layers`` (A before
    B: laplace-torch's flat layout of their parameters), summed over an adapter's calls."""
    blocks: dict[int, list[list[torch.Tensor]]] = {}
    keys = [layers.index(call.layer) for call in passes.calls]
    for gds in passes.per_class():
        for key, call, gd in zip(keys, passes.calls, gds, strict=True):
            # ∂f_c/∂A = Σ_n (Bᵀ gd_n) x_nᵀ (B, r, in); ∂f_c/∂B = Σ_n gd_n h_nᵀ (B, out, r)
            d_a = torch.bmm((gd @ call.layer.lora_B.weight.detach()).transpose(1, 2), call.x)
            _summed(blocks, key, [d_a.flatten(1), torch.bmm(gd.transpose(1, 2),
                                                            call.h).flatten(1)])
    calls = {key: keys.count(key) for key in keys}
    return torch.cat(_stacked(blocks, calls), dim=-1)


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

    def __init__(self, passes: LoRAPasses, layers: Sequence[nn.Module],
                 precision: Any) -> None:
        vectors = precision.eigenvectors
        keys = [2 * layers.index(call.layer) for call in passes.calls]
        sides = []
        for key, call in zip(keys, passes.calls, strict=True):
            (qa1, qa2), (_, qb2) = vectors[key], vectors[key + 1]
            # block A: M = Q₁ᵀ (Σ_n Bᵀ gd_n x_nᵀ) Q₂ = Σ_n ((B Q₁)ᵀ gd_n)(Q₂ᵀ x_n)ᵀ; block B:
            # Mᵀ = Q₂ᵀ (Σ_n h_n gd_nᵀ) Q₁, the r × out side first
            sides.append((call.layer.lora_B.weight.detach() @ qa1, call.x @ qa2,
                          (call.h @ qb2).transpose(1, 2), vectors[key + 1][0]))
        blocks: dict[int, list[list[torch.Tensor]]] = {}
        for gds in passes.per_class():
            for key, (bq, xq, hq, qb1), gd in zip(keys, sides, gds, strict=True):
                m_a = torch.bmm((gd @ bq).transpose(1, 2), xq)                  # (B, r, in)
                m_bt = torch.bmm(hq, gd) @ qb1                                  # (B, r, out)
                _summed(blocks, key, [m_a.flatten(1), m_bt.flatten(1)])
        calls = {key: keys.count(key) for key in keys}
        self.blocks = _stacked(blocks, calls)

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
