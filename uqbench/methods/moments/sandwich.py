"""The full-covariance pass's linear step, M Σ Mᵀ for a batch of symmetric covariances Σ
(B, in, in) and one mean weight matrix M (out, in), with its gradients in three products (one
where Σ is diagonal: :func:`diagonal_sandwich`).

Forward: ΣMᵀ (one product over the batch folded into its rows), M(ΣMᵀ), and the result
symmetrised, ½(S + Sᵀ), so that it is symmetric to the last bit. Backward, with G the output's
gradient, Ĝ = ½(G + Gᵀ) (the symmetrisation's) and Σ symmetric:
    ∂/∂Σ = Mᵀ Ĝ M,    ∂/∂M = Σ_b (Ĝ M Σᵀ + Ĝᵀ M Σ) = 2 Σ_b (MᵀĜ)ᵀ Σ,
sharing MᵀĜ: three products (MᵀĜ, (MᵀĜ)M, and (MᵀĜ)ᵀΣ over the folded batch), where autograd
through the two forward products runs four and sums a (B, out, in) matrix over the batch.
∂/∂Σ takes autograd's two products in its order; ∂/∂M is the same sum in another order
(float rounding: 4e-8 relative in float32 on the depth-3, width-64 network's gradients).

A Gaussian Linear adds its weights' own variance terms e on the output's diagonal and hands
that diagonal on as the output variances v (:func:`sandwich_and_variances`): both are
outputs of the same node, and its backward folds v's gradient G_v into Ĝ's diagonal, Ĝ =
½(G + Gᵀ) + diag(G_v), with ∂/∂e = diag(G) + G_v. Autograd through a diagonal view and an
in-place add would build a zero matrix with G_v on its diagonal and a copy of G, and add
them: two more (B, out, out) matrices per layer and the same numbers.

Speed only: from :data:`COMPILE_ENTRIES` entries of the (B, out, out) output on, each pass
(forward, backward) runs as one compiled program: the products stay ATen's (the same numbers,
bit for bit), and the symmetrisation's transposed read, slow in eager code (a (B, d, d)
transpose-add costs four times a plain add), becomes a tiled loop; a training step of P2's
depth-3, width-64 full-covariance network runs two of these layers per pass.
"""

from __future__ import annotations

from typing import Any

import torch

from uqbench.methods.moments.compiling import Programs

COMPILE_ENTRIES = 2 ** 18  # B·out² from which both passes run compiled (a width-64 batch of 64)


def symmetric_part(x: torch.Tensor) -> torch.Tensor:
    """½(X + Xᵀ) over the last two axes: symmetric to the last bit (the symmetrisation's
    gradient is the same map of the output's)."""
    return 0.5 * (x + x.transpose(-1, -2))


def _plus_diagonal(spread: torch.Tensor, extra: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``spread`` with ``extra`` (B, out) added to its diagonal in place (none: as it is), and
    that diagonal as a tensor of its own."""
    if extra is not None:
        spread.diagonal(dim1=-2, dim2=-1).add_(extra)
    return spread, spread.diagonal(dim1=-2, dim2=-1).clone()


def _symmetric_grad(grad: torch.Tensor, grad_var: torch.Tensor) -> torch.Tensor:
    """Ĝ with the output variances' gradients on its diagonal: ½(G + Gᵀ) + diag(G_v)."""
    g = symmetric_part(grad)
    g.diagonal(dim1=-2, dim2=-1).add_(grad_var)
    return g


def _spread(cov: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return _plus_diagonal(symmetric_part(w @ (cov @ w.T)), extra)          # M Σ Mᵀ, symmetrised


def _spread_grads(grad: torch.Tensor, grad_var: torch.Tensor, cov: torch.Tensor,
                  w: torch.Tensor, want_cov: bool, want_w: bool, want_extra: bool
                  ) -> tuple[torch.Tensor | None, ...]:
    left = w.T @ _symmetric_grad(grad, grad_var)                            # MᵀĜ: (B, in, out)
    d_cov = left @ w if want_cov else None
    d_w = None
    if want_w:
        b, n_in, n_out = left.shape
        d_w = 2 * (left.reshape(b * n_in, n_out).T @ cov.reshape(b * n_in, n_in))
    d_extra = grad.diagonal(dim1=-2, dim2=-1) + grad_var if want_extra else None
    return d_cov, d_w, d_extra


def _diagonal_spread(var: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = w * var.unsqueeze(1)                                   # M diag(v): (B, out, in)
    # one input (P2's first layer): each entry one product, as the product's sum of one term
    # is, in one elementwise pass (a matrix product with an inner size of 1 runs slowly)
    spread = scaled * w.T if w.shape[1] == 1 else scaled @ w.T              # M diag(v) Mᵀ
    return _plus_diagonal(symmetric_part(spread), extra)


def _diagonal_spread_grads(grad: torch.Tensor, grad_var: torch.Tensor, var: torch.Tensor,
                           w: torch.Tensor, want_var: bool, want_w: bool, want_extra: bool
                           ) -> tuple[torch.Tensor | None, ...]:
    gm = _symmetric_grad(grad, grad_var) @ w                                # ĜM: (B, out, in)
    d_var = (gm * w).sum(-2) if want_var else None
    d_w = (gm * var.unsqueeze(1)).sum(0).mul_(2) if want_w else None
    d_extra = grad.diagonal(dim1=-2, dim2=-1) + grad_var if want_extra else None
    return d_var, d_w, d_extra


PROGRAMS = Programs({"spread": _spread, "spread_grads": _spread_grads,
                     "diagonal_spread": _diagonal_spread,
                     "diagonal_spread_grads": _diagonal_spread_grads}, suppress_errors=True)
"""Both layers' passes, compiled with dynamic sizes (which gradients a backward pass takes
compiled in)."""


def _large(batch: int, w: torch.Tensor) -> bool:
    """Whether the (batch, out, out) output is large enough for the compiled passes."""
    return batch * w.shape[0] ** 2 >= COMPILE_ENTRIES


class _Sandwich(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cov: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cov, w)
        ctx.large = _large(cov.shape[0], w)
        return PROGRAMS("spread", ctx.large)(cov, w, extra)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_var: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        cov, w = ctx.saved_tensors
        return PROGRAMS("spread_grads", ctx.large)(grad, grad_var, cov, w, *ctx.needs_input_grad)


class _DiagonalSandwich(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, var: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(var, w)
        ctx.large = _large(var.shape[0], w)
        return PROGRAMS("diagonal_spread", ctx.large)(var, w, extra)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_var: torch.Tensor
                 ) -> tuple[torch.Tensor | None, ...]:
        var, w = ctx.saved_tensors
        return PROGRAMS("diagonal_spread_grads", ctx.large)(grad, grad_var, var, w,
                                                            *ctx.needs_input_grad)


def diagonal_sandwich(var: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`sandwich` for Σ = diag(``var``) (var: (B, in)): ½(S + Sᵀ), S = M diag(v) Mᵀ, with
    its gradients by one product, ĜM (module docstring's Ĝ): ∂/∂vₖ = Σᵢ Mᵢₖ(ĜM)ᵢₖ and
    ∂/∂M = 2 Σ_b (ĜM)_b diag(v_b), where autograd through the product and the scaling runs two
    products and two batch reductions of (B, out, in) matrices."""
    return _DiagonalSandwich.apply(var, w, None)[0]


def sandwich(cov: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """½(MΣMᵀ + (MΣMᵀ)ᵀ) (B, out, out) for Σ = ``cov`` (B, in, in), exactly symmetric (its
    gradient assumes so), and M = ``w`` (out, in) (module docstring)."""
    return _Sandwich.apply(cov, w, None)[0]


def sandwich_and_variances(cov: torch.Tensor, w: torch.Tensor, extra: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sandwich` + diag(``extra``) (B, out) (a Gaussian Linear's output covariance: the
    weights' own variance terms on the diagonal) and that diagonal, the output variances, as a
    tensor of its own: one autograd node whose backward takes both outputs' gradients into Ĝ's
    diagonal, where the same sum through a diagonal view and an in-place add builds and adds
    two more (B, out, out) matrices per layer (the same numbers: on the diagonal Ĝ's entry plus
    the variances' gradient, off it Ĝ's)."""
    return _Sandwich.apply(cov, w, extra)


def diagonal_sandwich_and_variances(var: torch.Tensor, w: torch.Tensor, extra: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sandwich_and_variances` for Σ = diag(``var``) (:func:`diagonal_sandwich`)."""
    return _DiagonalSandwich.apply(var, w, extra)
