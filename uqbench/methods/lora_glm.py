"""Laplace-LoRA's linearised (GLM) predictive from one forward and C backward passes per batch.

The predictive's moments are f_MAP (B, C) and J P⁻¹ Jᵀ (B, C, C), J the per-example Jacobian
of the C logits with respect to the LoRA weights. For an adapter y = W x + s · B h, h = A x,
the Jacobian is a sum over the layer's positions n (tokens, patches) of outer products:
∂f_c/∂B = s Σ_n g_cn h_nᵀ and ∂f_c/∂A = Σ_n d_cn x_nᵀ, with g_cn = ∂f_c/∂y_n and
d_cn = ∂f_c/∂h_n = s Bᵀ g_cn. So one forward pass that keeps each adapter's input and the
adapter's two outputs (y, and h inside it), and one backward pass per class that returns the
gradients at both (:class:`LoRAPasses`; the backward pass computes d on its way to the
adapter's input anyway), give the Jacobians of a whole batch: the examples of a batch are
independent in evaluation mode (no batch statistics), so the gradient of Σ_b f_bc at example
b's positions is example b's own. The C backward passes stay separate: batched into one
(autograd's ``is_grads_batched``, a vmap over the cotangents) they do the same arithmetic and
take longer.

With laplace-torch's Kronecker-factored posterior (``hessian: kron``), each adapter weight's
precision block is (Q₁ ⊗ Q₂)(Λ₁ ⊗ Λ₂ + δ)(Q₁ ⊗ Q₂)ᵀ (eigendecomposed once, when it is
fitted; the prior precision δ added), so J P⁻¹ Jᵀ = Σ_blocks Σ_ij M_ci,j M_c'i,j / (λ₁ᵢ λ₂ⱼ + δ)
with M = Q₁ᵀ J Q₂. The weights 1/(λ₁ᵢ λ₂ⱼ + δ) do not factor into a Kronecker product (only
laplace-torch's damped form (λ₁ᵢ + √δ)(λ₂ⱼ + √δ) would), so the exact form needs M itself.
:class:`RotatedJacobians` computes M once per batch with the rotations folded into the sums
over positions (x Q₂ before the outer products; Q₁ on the small side first: d Q₁ for A, and
for B each class's r × out sums, rotated by one matrix product of the batch's rows), and the
variance of any prior precision from it: the prior's grid search reuses one batch's M for
every point. The rotation of B's output side (r · out² per example and class) is the largest
part of it. laplace-torch's own ``functional_variance`` computes the same quadratic form from
the flat Jacobians, rotating them there and back; the other Hessians (diag, full) use it on
:func:`lora_jacobians`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

# one call's gradients for one class: ∂f_c/∂y (B, N, out) and ∂f_c/∂h (B, N, r)
Grads = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AdapterCall:
    """One call of an adapter in the forward pass: its input x (B, N, in) and h = A x
    (B, N, r), in the adapter's dtype, and its output y and h as the forward pass computed
    them (which the backward passes reach)."""

    layer: Any  # a MapLoRALinear (its lora_A, lora_B and scaling)
    x: torch.Tensor
    h: torch.Tensor
    out: torch.Tensor
    inner: torch.Tensor


def _leaf(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a node the backward passes reach: frozen weights make it a leaf, then it
    starts the graph."""
    if not out.requires_grad:
        out.requires_grad_(True)
    return out


class LoRAPasses:
    """One forward pass of ``model`` at ``inputs`` that keeps every call of each adapter of
    ``layers``: the logits ``f`` (B, C), then :meth:`per_class` the backward passes."""

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], inputs: Any) -> None:
        self.calls: list[AdapterCall] = []
        inner: dict[int, torch.Tensor] = {}

        def keep_inner(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            inner[id(module)] = _leaf(out)  # h of the call whose output hook comes next

        def keep(layer: Any, args: tuple[Any, ...], out: torch.Tensor) -> None:
            weight = layer.lora_A.weight.detach()
            x = args[0].detach().to(weight.dtype)
            x = x.reshape(x.shape[0], -1, x.shape[-1])
            with torch.autocast(x.device.type, enabled=False):  # h in the weights' dtype
                self.calls.append(AdapterCall(layer, x, x @ weight.T, _leaf(out),
                                              inner.pop(id(layer.lora_A))))

        hooks = [hook for layer in layers
                 for hook in (cast(Any, layer).lora_A.register_forward_hook(keep_inner),
                              layer.register_forward_hook(keep))]
        try:
            with torch.enable_grad():
                self._f = model(inputs)
        finally:
            for hook in hooks:
                hook.remove()
        self.f = self._f.detach()

    def per_class(self) -> Iterator[list[Grads]]:
        """For each class c, one backward pass of the whole batch: for every call,
        ∂f_c/∂y (B, N, out) at its output y and ∂f_c/∂h = s Bᵀ ∂f_c/∂y (B, N, r), in the
        adapter's dtype (one class's gradients alive at a time; the graph is freed after the
        last)."""
        outputs = [t for call in self.calls for t in (call.out, call.inner)]
        classes = self.f.shape[-1]
        for c in range(classes):
            onehot = torch.zeros_like(self._f)
            onehot[:, c] = 1
            grads = torch.autograd.grad(self._f, outputs, onehot, retain_graph=c < classes - 1,
                                        allow_unused=True)
            yield [(_shaped(grads[2 * i], call.out, call), _shaped(grads[2 * i + 1], call.inner,
                                                                 call))
                   for i, call in enumerate(self.calls)]


def _shaped(grad: torch.Tensor | None, like: torch.Tensor, call: AdapterCall) -> torch.Tensor:
    """A gradient at ``like`` (zero where the output was unused) as (B, N, ·) in the
    adapter's dtype."""
    g = torch.zeros_like(like) if grad is None else grad
    return g.reshape(call.x.shape[0], -1, like.shape[-1]).to(call.x.dtype)


def _sums(passes: LoRAPasses, layers: Sequence[nn.Module], inputs: list[torch.Tensor],
          outputs: list[torch.Tensor], rotations: Sequence[tuple[torch.Tensor, torch.Tensor]]
          | None = None) -> list[torch.Tensor]:
    """Each called adapter's two blocks (B, C, ·), in the order of ``layers``, A's then B's,
    summed over its calls: for call i, A's Σ_n d_n inputs[i]_nᵀ (B, C, r · in) and B's Σ_n
    outputs[i]_n g_nᵀ (B, C, r · out) (``outputs[i]`` (B, r, N)), with d and g rotated by the
    adapter's ``rotations`` (Q₁ of A (r, r), Q₁ of B (out, out)) if given. B's sums are
    filled class by class into one buffer (C, B, ·), rotated by one product of the batch's
    B · r rows; the d of all classes (C · r columns, small) are kept for one product per
    call."""
    keys = [layers.index(call.layer) for call in passes.calls]
    first = {key: keys.index(key) for key in keys}
    batch, classes = passes.f.shape
    b_sums = {key: inputs[i].new_empty(classes, batch, outputs[i].shape[1],
                                       passes.calls[i].out.shape[-1])
              for key, i in first.items()}
    kept_d: list[list[torch.Tensor]] = [[] for _ in keys]
    for c, grads in enumerate(passes.per_class()):
        kept: dict[int, torch.Tensor] = {}
        for i, (key, (g, d)) in enumerate(zip(keys, grads, strict=True)):
            kept_d[i].append(d)
            b = torch.bmm(outputs[i], g)
            kept[key] = b if key not in kept else kept[key] + b
        for key, b in kept.items():
            rows, out = b.reshape(-1, b.shape[-1]), b_sums[key][c].view(-1, b.shape[-1])
            if rotations is None:
                out.copy_(rows)
            else:
                torch.mm(rows, rotations[key][1], out=out)
    a_sums: dict[int, torch.Tensor] = {}
    for i, (key, ds) in enumerate(zip(keys, kept_d, strict=True)):
        d = torch.stack(ds, 2)                                                  # (B, N, C, r)
        if rotations is not None:
            d = d @ rotations[key][0]
        a = torch.bmm(d.flatten(2).transpose(1, 2), inputs[i])                 # (B, C · r, in)
        a_sums[key] = a if key not in a_sums else a_sums[key] + a
    return [t for key in sorted(first)
            for t in (a_sums[key].view(batch, classes, -1),
                      b_sums[key].flatten(2).transpose(0, 1))]


def lora_jacobians(passes: LoRAPasses, layers: Sequence[nn.Module]) -> torch.Tensor:
    """J (B, C, P) over every adapter's A and B weights in the order of ``layers`` (A before
    B: laplace-torch's flat layout of their parameters), summed over an adapter's calls."""
    # ∂f_c/∂A = Σ_n d_n x_nᵀ (B, r, in); ∂f_c/∂B = Σ_n g_n (s h_n)ᵀ, summed here as its
    # transpose (B, r, out)
    blocks = _sums(passes, layers, [call.x for call in passes.calls],
                   [(call.layer.scaling * call.h).transpose(1, 2) for call in passes.calls])
    called = sorted({layers.index(call.layer) for call in passes.calls})
    for i, key in enumerate(called):
        r = cast(Any, layers[key]).lora_B.weight.shape[1]
        blocks[2 * i + 1] = blocks[2 * i + 1].unflatten(-1, (r, -1)).transpose(-1, -2).flatten(2)
    return torch.cat(blocks, dim=-1)


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
        calls = list(zip(keys, passes.calls, strict=True))
        # block A: M = Q₁ᵀ (Σ_n d_n x_nᵀ) Q₂ = Σ_n (Q₁ᵀ d_n)(Q₂ᵀ x_n)ᵀ; block B:
        # Mᵀ = Q₂ᵀ (Σ_n s h_n g_nᵀ) Q₁ = Σ_n (Q₂ᵀ s h_n)(Q₁ᵀ g_n)ᵀ
        self.blocks = _sums(
            passes, layers, [call.x @ vectors[k][1] for k, call in calls],
            [(call.layer.scaling * call.h @ vectors[k + 1][1]).transpose(1, 2)
             for k, call in calls],
            [(vectors[2 * j][0], vectors[2 * j + 1][0]) for j in range(len(layers))])

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
