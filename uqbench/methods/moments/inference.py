"""The diagonal moment pass for inference under torch.compile (``method.compile: true``), from a
plan of the network and its weight means and variances instead of the module.

``MomentSequential.forward_fused`` compiled with the module as its argument recomputes each
layer's σ_W² = softplus(ρ)² and μ_W² + σ_W² in every call and guards every parameter, and with
all sizes dynamic the last activation's loop splits where it meets the output layer's sum over
units (√v and the erfcx computed twice). Here the same pass takes each Gaussian linear layer's
μ_W, μ_b and its variances as the layer keeps them (computed once per parameter version,
``GaussianLinear._variances``), and compiles with the widths fixed and the batch dynamic: each
activation after the first is one loop (:func:`~.fused.leaky_relu_moments_compiled`), every
layer with more than one input a matrix product, and multiply-adds are contracted into fused
ones (inductor's ``cpp.enable_floating_point_contract_flag``: a rounding less per pair, not
more). The first activation, fed by the outer product of a one-input layer, still runs as
three loops (inductor does not merge its broadcast reads with the contiguous ones). A network
of other widths in the same process compiles once more, with dynamic widths (dynamo's
automatic dynamic), so a width sweep compiles about twice a process (and once more for a
batch of one row), and the on-disk cache serves later processes. The numbers are the eager
pass's to rounding (``tests/test_moment_pass_values.py`` pins them against the stored values).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from uqbench.methods.moments.compiling import compile_specialised
from uqbench.methods.moments.fused import leaky_relu_moments_compiled
from uqbench.methods.moments.layers import GaussianLinear, MomentLeakyReLU, MomentSequential

# per layer: None for a Gaussian linear layer, the slope for a Leaky-ReLU
InferencePlan = tuple[float | None, ...]

_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}
# Python floats (the slopes) compiled in as constants; a failed compilation runs eagerly
_CONFIG = {"specialize_float": True, "suppress_errors": True}


def inference_plan(net: MomentSequential) -> tuple[InferencePlan, list[torch.Tensor]]:
    """``net``'s plan and tensors: μ_W, μ_b, σ_W², μ_W² + σ_W², σ_b² of each Gaussian linear
    layer in order (its kept variances when called without autograd). ``net`` must be
    :func:`~.step.fusable`."""
    plan: list[float | None] = []
    tensors: list[torch.Tensor] = []
    for m in net:
        if isinstance(m, GaussianLinear):
            plan.append(None)
            tensors += [m.weight_mu, m.bias_mu, *m._variances()]
        elif isinstance(m, MomentLeakyReLU):
            plan.append(m.slope)
        else:
            raise ValueError(f"the compiled inference pass takes GaussianLinear and "
                             f"MomentLeakyReLU layers, got {type(m).__name__}")
    return tuple(plan), tensors


def planned_pass(x: torch.Tensor, plan: InferencePlan, tensors: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output mean and variance (B, out) for deterministic inputs x (B, in) from
    :func:`inference_plan`'s plan and tensors: ``MomentSequential.forward_fused``'s closed
    forms (what is compiled; eagerly it gives them too, to rounding)."""
    mean, var = x, None
    it = iter(tensors)
    for slope in plan:
        if slope is not None:
            mean, var = leaky_relu_moments_compiled(
                mean, torch.zeros_like(mean) if var is None else var, slope)
            continue
        w, b, w_var, w_second, b_var = (next(it) for _ in range(5))
        if w.shape[1] == 1:  # an outer product, fused into the next activation's loop
            out_mean = b + mean * w.T
            out_var = b_var + mean * mean * w_var.T
            if var is not None:
                out_var = out_var + var * w_second.T
        else:
            out_mean = F.linear(mean, w, b)
            out_var = torch.addmm(b_var, mean * mean, w_var.T)
            if var is not None:
                out_var = torch.addmm(out_var, var, w_second.T)
        mean, var = out_mean, out_var
    return mean, torch.zeros_like(mean) if var is None else var


@functools.cache
def _compiled() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`planned_pass` through torch.compile (module docstring), built on first use."""
    return compile_specialised(planned_pass, _OPTIONS, **_CONFIG)


def compiled_inference(net: MomentSequential, x: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``net``'s output mean and variance for inputs x by the compiled :func:`planned_pass`,
    the batch dynamic from the first call (evaluation splits differ in size)."""
    # a copy, not a view: a view's base (a split's tensor) would enter the graph's guards
    x = x.clone()
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return _compiled()(x, *inference_plan(net))
