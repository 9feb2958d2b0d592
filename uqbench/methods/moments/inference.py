"""The diagonal moment pass for inference: eagerly in blocks of rows that stay in cache
(:func:`eager_inference`), and under torch.compile (``method.compile: true``) from a plan of the
network and its weight means and variances instead of the module (:func:`compiled_inference`).

Eagerly on the CPU without autograd, a batch whose widest layer holds more than two blocks of
:data:`~.fused.CHUNK` numbers runs through the whole network in blocks of rows of about that
size: each row's moments depend on that row alone, so every layer's temporaries, its outputs
included, stay in cache instead of each (batch, width) tensor going out to memory and back
(at 1024 rows and width 1024 that is 4 MB a tensor, written and read by every operation of
the layer). The operations are the module's own on fewer rows, in blocks of a multiple of
:data:`BLOCK_ROWS` rows (the last also holds the remainder), so that ATen's vectorised loops
cover each row as they do over the whole batch and the activations give the same numbers bit
for bit; a matrix product may group a block's last rows otherwise than the whole batch's
(MKL's, here: an output layer's mean in float64 moved by one unit in the last place in one
case of the tests), so the pass equals the unblocked one to rounding
(``tests/test_moments_inference.py``).

Under torch.compile, ``MomentSequential.forward_fused`` with the module as its argument
recomputes each layer's σ_W² = softplus(ρ)² and μ_W² + σ_W² in every call and guards every
parameter, and with all sizes dynamic the last activation's loop splits where it meets the
output layer's sum over units (√v and the erfcx computed twice). Here the same pass takes each
Gaussian linear layer's μ_W, μ_b and its variances as the layer keeps them (computed once per
parameter version, ``GaussianLinear._variances``), and compiles with the widths fixed and the
batch dynamic: each activation after the first is one loop
(:func:`~.fused.leaky_relu_moments_compiled`), every layer with more than one input a matrix
product, and multiply-adds are contracted into fused ones (inductor's
``cpp.enable_floating_point_contract_flag``: a rounding less per pair, not more). The first
activation, fed by the outer product of a one-input layer, still runs as three loops (inductor
does not merge its broadcast reads with the contiguous ones). A network of other widths in the
same process compiles once more, with dynamic widths (dynamo's automatic dynamic), so a width
sweep compiles about twice a process (and once more for a batch of one row), and the on-disk
cache serves later processes. Each call takes the plan and tensors kept on the network
(:func:`kept_plan`) while its layers and parameters are unchanged. The numbers are the eager
pass's to rounding
(``tests/test_moment_pass_values.py`` pins them against the stored values).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable

import torch

from uqbench.methods.moments import fused
from uqbench.methods.moments.compiling import compile_specialised
from uqbench.methods.moments.fused import leaky_relu_moments_compiled, linear_moments
from uqbench.methods.moments.layers import GaussianLinear, MomentLeakyReLU, MomentSequential

# a block's rows are a multiple of this (the last block also holds the remainder), so that each
# elementwise kernel's vectorised loop falls on the rows as it does over the whole batch
BLOCK_ROWS = 64

# per layer: None for a Gaussian linear layer, the slope for a Leaky-ReLU
InferencePlan = tuple[float | None, ...]

# inductor's options for the compiled pass: multiply-adds contracted into fused ones
COMPILE_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}
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


Activation = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


def planned_pass(x: torch.Tensor, plan: InferencePlan, tensors: list[torch.Tensor],
                 activation: Activation = leaky_relu_moments_compiled
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output mean and variance (B, out) for deterministic inputs x (B, in) from
    :func:`inference_plan`'s plan and tensors: ``MomentSequential.forward_fused``'s closed
    forms (what is compiled; eagerly it gives them too, to rounding). ``activation`` (mean,
    var, slope) → (mean, var) stands for each Leaky-ReLU (the bench's compiled floor puts its
    own there)."""
    mean, var = x, None
    it = iter(tensors)
    for slope in plan:
        if slope is not None:
            mean, var = activation(mean, torch.zeros_like(mean) if var is None else var, slope)
            continue
        mean, var = linear_moments(mean, var, *(next(it) for _ in range(5)))
    return mean, torch.zeros_like(mean) if var is None else var


@functools.cache
def _compiled() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`planned_pass` through torch.compile (module docstring), built on first use."""
    return compile_specialised(planned_pass, COMPILE_OPTIONS, **_CONFIG)


def compiled_inference(net: MomentSequential, x: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``net``'s output mean and variance for inputs x by the compiled :func:`planned_pass`,
    the batch dynamic from the first call (evaluation splits differ in size)."""
    # a copy, not a view: a view's base (a split's tensor) would enter the graph's guards
    x = x.clone()
    torch._dynamo.maybe_mark_dynamic(x, 0)
    return _compiled()(x, *kept_plan(net))


def kept_plan(net: MomentSequential) -> tuple[InferencePlan, list[torch.Tensor]]:
    """:func:`inference_plan` of ``net``, kept on it without autograd while :func:`_plan_key`
    stays the same: the same layers with the same slopes, and the same parameter tensors, each
    with its version counter (which every in-place update moves: an optimiser step,
    load_state_dict) and data pointer (``module.to()``, a change of dtype or device included,
    swaps a tensor's data without moving its counter; the kept entry holds the storages, so no
    new one can take their addresses). One comparison of two tuples instead of walking the
    layers' attributes, whose Python costs about a tenth of the pass at width 64. With autograd
    the plan is made afresh."""
    if torch.is_grad_enabled():
        return inference_plan(net)
    key, layers, params = _plan_key(net)
    kept = net.__dict__.get("_kept_inference_plan")
    if kept is not None and kept[0] == key:
        return kept[1]
    made = inference_plan(net)
    # the layers, parameters and storages held, so that no other object takes their ids or
    # addresses while the key holds them
    net.__dict__["_kept_inference_plan"] = (key, made, layers, params,
                                            [p.untyped_storage() for p in params])
    return made


def _plan_key(net: MomentSequential
              ) -> tuple[tuple, tuple[torch.nn.Module, ...], list[torch.Tensor]]:
    """What :func:`kept_plan` compares (module and tensor identities as ids), and the layers
    and parameters it was made of."""
    layers = tuple(m for m in net._modules.values() if m is not None)
    params: list[torch.Tensor] = [p for m in layers for p in m._parameters.values()
                                  if p is not None]
    return ((*map(id, layers), *(m.__dict__.get("slope") for m in layers),
             *map(id, params), *map(_VERSION, params), *map(torch.Tensor.data_ptr, params)),
            layers, params)


_VERSION = operator.attrgetter("_version")


def eager_inference(net: MomentSequential, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``net.forward_fused(x)`` for deterministic inputs x (B, in); on the CPU without
    autograd, in blocks of rows where two blocks of :data:`~.fused.CHUNK` numbers in the widest
    Gaussian linear layer (inputs or outputs) fit in the batch (module docstring), the same
    numbers to rounding."""
    widest = max((max(m.in_features, m.out_features) for m in net
                  if isinstance(m, GaussianLinear)), default=0)
    rows = fused.CHUNK // max(widest, 1) // BLOCK_ROWS * BLOCK_ROWS
    n = x.shape[0] if x.dim() == 2 else 0
    if torch.is_grad_enabled() or x.device.type != "cpu" or rows == 0 or n < 2 * rows:
        return net.forward_fused(x)
    edges = [*range(0, n - rows + 1, rows), n]  # the last block takes the remainder too
    blocks = [net.forward_fused(x[a:b]) for a, b in itertools.pairwise(edges)]
    return torch.cat([m for m, _ in blocks]), torch.cat([v for _, v in blocks])
