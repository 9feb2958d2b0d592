"""Gradients per ensemble member: the groups whose norms are clipped apart, the clipping, and
weight decay toward the values training started from. Used by :class:`Trainer`'s steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # types only: the method is built by the runner
    from uqbench.methods.base import Method

# A gradient group: (parameter, member index into its dim 0, or None for the whole tensor).
Group = list[tuple[torch.nn.Parameter, int | None]]


def clip_groups(method: Method, params: list[torch.nn.Parameter]) -> list[Group]:
    """The groups whose gradient norms are clipped apart: one per member, then one of the
    shared parameters (``method.member_parameters()``), each in the order of ``params``.

    Raises if a trained parameter belongs to no group or to two, or if a stacked parameter's
    dim 0 is not the number of members.
    """
    layout = method.member_parameters()
    M = int(layout.members)
    if layout.owned and len(layout.owned) != M:
        raise RuntimeError(f"method '{method.name}' declares {len(layout.owned)} lists of "
                           f"member-owned parameters for {M} members")
    places: dict[int, list[tuple[int | None, int | None]]] = {}  # id → [(group, index)]
    declared: dict[int, int] = {}  # id → how many declarations name it
    for p in layout.stacked:
        if p.dim() == 0 or p.shape[0] != M:
            raise RuntimeError(f"method '{method.name}': a stacked member parameter has shape "
                               f"{tuple(p.shape)}, not ({M}, …)")
        places.setdefault(id(p), []).extend((m, m) for m in range(M))
        declared[id(p)] = declared.get(id(p), 0) + 1
    for group, plist in [*enumerate(layout.owned), (None, layout.shared)]:
        for p in plist:
            places.setdefault(id(p), []).append((group, None))
            declared[id(p)] = declared.get(id(p), 0) + 1
    names = {id(p): n for n, p in method.named_parameters()}
    groups: list[Group] = [[] for _ in range(M + 1)]  # the members', then the shared group
    for p in params:
        if declared.get(id(p), 0) != 1:
            how = "not declared" if id(p) not in declared else "declared more than once"
            raise RuntimeError(f"method '{method.name}': trained parameter "
                               f"'{names.get(id(p), '?')}' is {how} in member_parameters() "
                               f"(stacked, owned by a member, or shared)")
        for group, index in places[id(p)]:
            groups[M if group is None else group].append((p, index))
    return [g for g in groups if g]


def clip_per_member_(groups: list[Group], max_norm: float) -> list[torch.Tensor]:
    """Clip each group's gradient to 2-norm ``max_norm`` on its own, as
    ``torch.nn.utils.clip_grad_norm_`` clips a whole model (factor min(1, max / (norm + 1e-6)));
    returns the norms before clipping. One group of whole tensors IS that call."""
    if len(groups) == 1 and all(index is None for _, index in groups[0]):
        return [torch.nn.utils.clip_grad_norm_([p for p, _ in groups[0]], max_norm)]
    norms = []
    for group in groups:
        grads = [p.grad if index is None else p.grad[index] for p, index in group
                 if p.grad is not None]                       # views: scaling them scales p.grad
        if not grads:
            continue
        norm = torch.nn.utils.get_total_norm(grads)
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(factor.to(g.device))
        norms.append(norm)
    return norms


@torch.no_grad()
def decay_toward_(optimizer: torch.optim.Optimizer, anchors: list[torch.Tensor],
                  decay: float) -> None:
    """p ← p − lr·decay·(p − p₀) for every parameter, at its group's current learning rate;
    ``anchors`` are the p₀ in the optimiser's parameter order."""
    params = [(p, group["lr"]) for group in optimizer.param_groups for p in group["params"]]
    for (p, lr), anchor in zip(params, anchors, strict=True):
        p.sub_(p - anchor, alpha=lr * decay)
