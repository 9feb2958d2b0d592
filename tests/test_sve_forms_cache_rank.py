"""SVE's fast paths against plain references: the training-time choice of form, the
inference cache of the member weights, and top-k SVE (``method.rank``).

References are written out here with torch's own ops on the pretrained weight: its SVD
(torch.linalg.svd in float32, as P1 decomposes, so float64 layers compare to rounding),
W_m = U diag(s_m) Vᵀ (or W + U_k diag(s_m − s) V_kᵀ) and plain autograd through
x W_mᵀ + b_m, never the layer's own code path.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.helpers import build_method as build
from uqbench.identity import differences
from uqbench.methods.sve_layers import SplitSVELinear, SVELinear

M, N_IN, N_OUT, ROWS = 3, 6, 12, 5  # out = 12: q, k, v of 4 each when split
# float64 agrees to rounding; float32 sums ~N_IN products per entry at ≈ 6e-8 each
TOL = {torch.float64: {"atol": 1e-10, "rtol": 1e-10}, torch.float32: {"atol": 1e-5, "rtol": 1e-4}}


def factors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """U, s, Vᵀ of w from a float32 SVD, in w's dtype."""
    return tuple(t.to(w.dtype) for t in torch.linalg.svd(w.float(), full_matrices=False))


def member_weights_by_hand(W: torch.Tensor, s: torch.Tensor, split: bool) -> torch.Tensor:
    """W_m = U diag(s_m) Vᵀ from the SVD of W (per q, k, v block when split):
    s (M, r) or (M, 3, r) → (M, out, in)."""
    blocks = W.chunk(3) if split else [W]
    out = []
    for j, w in enumerate(blocks):
        U, _, Vh = factors(w)
        sj = s[:, j] if split else s
        out.append((U * sj[:, None, :]) @ Vh)
    return torch.cat(out, dim=1)


def make_layer(kind: type, bias: bool, clamp: bool, dtype: torch.dtype, **kw) -> SVELinear:
    torch.manual_seed(0)
    base = nn.Linear(N_IN, N_OUT, bias=bias).to(dtype)
    layer = kind(copy.deepcopy(base), members=M, sigma_init=0.3, clamp=clamp, **kw).to(dtype)
    with torch.no_grad():  # some singular values negative: the clamp has something to do
        layer.sve_s[0, ..., 0] = -0.5
        layer.sve_s[1, ..., -1] = -0.1
    layer.base = base  # the pretrained layer, for the references
    return layer


def reference(layer: SVELinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s) with plain autograd: y = x W_mᵀ + b_m per member, s a leaf copy of sve_s."""
    s = layer.sve_s.detach().clone().requires_grad_(True)
    used = s.clamp_min(0) if layer.clamp else s
    W = member_weights_by_hand(layer.base.weight.detach(), used,
                               isinstance(layer, SplitSVELinear))
    y = x.view(M, -1, N_IN) @ W.transpose(1, 2)
    if layer.sve_bias is not None:
        y = y + layer.sve_bias.detach()[:, None, :]
    return y.reshape(*x.shape[:-1], N_OUT), s


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", [SVELinear, SplitSVELinear])
@pytest.mark.parametrize("mode", ["factorized", "materialized", "auto"])
@pytest.mark.parametrize("clamp", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_every_form_gives_the_plain_outputs_and_gradients(dtype, kind, mode, clamp, bias):
    layer = make_layer(kind, bias, clamp, dtype, forward_mode=mode)
    x = torch.randn(M * 2, ROWS, N_IN, dtype=dtype, requires_grad=True)        # (M·B, T, in)
    g = torch.randn(M * 2, ROWS, N_OUT, dtype=dtype)
    y = layer(x)
    y.backward(g)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref, s_ref = reference(layer, x_ref)
    y_ref.backward(g)
    tol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(layer.sve_s.grad, s_ref.grad, **tol)
    if bias:  # ∂/∂b_m = Σ over member m's rows of the output gradient
        torch.testing.assert_close(layer.sve_bias.grad, g.view(M, -1, N_OUT).sum(1), **tol)
    if clamp:  # clamped singular values get no gradient
        assert layer.sve_s.grad[0, ..., 0].abs().max() == 0


def test_a_training_call_counts_the_backward_pass_too():
    """ViT-S/16's shapes, N = 8 images × 197 tokens per member. Multiply-adds by hand: the
    factorised step 2·N·r·(in + out), the materialised 2·o·r·i + 3·N·i·o."""
    n = 8 * 197
    qkv = SVELinear(nn.Linear(384, 1152), members=4, sigma_init=0.0)             # r = 384
    assert qkv.flops(n, step=True) == {"factorized": 2 * n * 384 * 1536,
                                       "materialized": 2 * 1152 * 384 * 384 + 3 * n * 384 * 1152}
    assert qkv.flops(n) == {"factorized": n * 384 * 1536,                  # the forward alone
                            "materialized": 1152 * 384 * 384 + n * 384 * 1152}
    # fewer multiply-adds: materialised for the forward, factorised for a training step
    assert qkv.mode(n) == "materialized" and qkv.mode(n, step=True) == "factorized"
    proj = SVELinear(nn.Linear(384, 384), members=4, sigma_init=0.0)
    assert proj.mode(n, step=True) == "materialized"  # 2·N·r·2d > 2d³ + 3·N·d²
    # cached member weights cost nothing to build: N·i·o against N·r·(i + o)
    assert qkv.flops(n, cached=True)["materialized"] == n * 384 * 1152
    assert qkv.mode(n, cached=True) == "materialized"


# --- the inference cache ----------------------------------------------------------------------

def count_builds(layer: SVELinear) -> list[int]:
    calls = [0]
    build_weights = layer.member_weights

    def counted() -> torch.Tensor:
        calls[0] += 1
        return build_weights()

    layer.member_weights = counted
    return calls


@pytest.mark.parametrize("kind", [SVELinear, SplitSVELinear])
def test_evaluation_builds_the_member_weights_once_until_they_change(kind):
    layer = make_layer(kind, True, False, torch.float32, cache_weights=True,
                       forward_mode="materialized")
    builds = count_builds(layer)
    x = torch.randn(M * 2, N_IN)
    layer.eval()
    with torch.no_grad():
        first, again = layer(x), layer(x)
        assert builds[0] == 1
        torch.testing.assert_close(first, reference(layer, x)[0], **TOL[torch.float32])
        assert torch.equal(first, again)
        layer.sve_s.mul_(2)                        # an optimiser step changes s_m in place
        torch.testing.assert_close(layer(x), reference(layer, x)[0], **TOL[torch.float32])
        assert builds[0] == 2
        layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()} | {
            "sve_s": torch.zeros_like(layer.sve_s)})
        assert layer(x)[:, :].sub(layer.sve_bias.repeat_interleave(2, 0)).abs().max() == 0
        assert builds[0] == 3
    layer.train()                                  # training drops the cached weights
    assert layer._cached is None


def test_no_cache_while_training_with_gradients_or_when_switched_off():
    x = torch.randn(M * 2, N_IN)
    on = make_layer(SVELinear, True, False, torch.float32, cache_weights=True,
                    forward_mode="materialized")
    with torch.no_grad():
        on(x)                                      # training mode: nothing kept
    assert on._cached is None
    on.eval()
    on(x).sum().backward()                         # gradients needed: built per call, not kept
    assert on._cached is None and on.sve_s.grad is not None
    off = make_layer(SVELinear, True, False, torch.float32, cache_weights=False,
                     forward_mode="materialized").eval()
    builds = count_builds(off)
    with torch.no_grad():
        off(x), off(x)
    assert off._cached is None and builds[0] == 2


# --- top-k SVE --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [SVELinear, SplitSVELinear])
@pytest.mark.parametrize("bias", [True, False])
def test_top_k_at_full_rank_is_sve(kind, bias):
    """k = r: W + U diag(s_m − s) Vᵀ = U diag(s_m) Vᵀ up to W − U diag(s) Vᵀ, the float32
    SVD's reconstruction error (≈ 1e-6 of |W|), whatever the layer's dtype."""
    rank = 4 if kind is SplitSVELinear else 6                  # min(4, 6) per block; min(12, 6)
    full = make_layer(kind, bias, False, torch.float64)
    top = make_layer(kind, bias, False, torch.float64, rank=rank)
    assert top.rank == full.rank == rank
    torch.testing.assert_close(top.sve_s, full.sve_s, atol=0, rtol=0)  # the same draws
    x = torch.randn(M * 2, ROWS, N_IN, dtype=torch.float64, requires_grad=True)
    g = torch.randn(M * 2, ROWS, N_OUT, dtype=torch.float64)
    y_full = full(x)
    y_full.backward(g)
    gx, x.grad = x.grad, None
    y_top = top(x)
    y_top.backward(g)
    tol = TOL[torch.float32]
    torch.testing.assert_close(y_top, y_full, **tol)
    torch.testing.assert_close(x.grad, gx, **tol)
    torch.testing.assert_close(top.sve_s.grad, full.sve_s.grad, **tol)


@pytest.mark.parametrize("kind", [SVELinear, SplitSVELinear])
def test_top_k_adapts_only_the_k_largest_directions(kind):
    layer = make_layer(kind, True, False, torch.float64, rank=2)
    split = kind is SplitSVELinear
    assert layer.sve_s.shape == ((M, 3, 2) if split else (M, 2))
    assert layer.sve_U.shape == ((3, 4, 2) if split else (N_OUT, 2))
    W = layer.base.weight.detach()
    x = torch.randn(M * 2, N_IN, dtype=torch.float64)
    y = layer(x).view(M, 2, N_OUT)
    for m in range(M):  # W_m = W + U_k diag(s_mk − s_k) V_kᵀ, from the SVD of each block
        blocks = []
        for j, w in enumerate(W.chunk(3) if split else [W]):
            U, s, Vh = factors(w)
            sm = layer.sve_s[m, j] if split else layer.sve_s[m]
            blocks.append(w + U[:, :2] @ torch.diag(sm - s[:2]) @ Vh[:2])
        expected = x.view(M, 2, N_IN)[m] @ torch.cat(blocks).T + layer.sve_bias[m]
        torch.testing.assert_close(y[m], expected, atol=1e-10, rtol=1e-10)


def test_top_k_at_sigma_zero_reproduces_the_pretrained_layer():
    torch.manual_seed(0)
    base = nn.Linear(N_IN, N_OUT)
    layer = SVELinear(copy.deepcopy(base), members=M, sigma_init=0.0, rank=3,
                      release_pretrained=True)
    x = torch.randn(M * 2, N_IN)
    torch.testing.assert_close(layer(x), base(x).detach(), atol=1e-6, rtol=1e-5)
    assert layer.base_layer.bias is None and layer.released == N_OUT  # b_m replaces b


TINY = {"qkv": (48, 16), "proj": (16, 16), "fc1": (32, 16), "fc2": (16, 32)}  # (out, in), ×2


@pytest.mark.parametrize("rank", [None, 4])
def test_targeted_memory_follows_the_layer_shapes(cfg, rank):
    """Per layer, in float32 values: full SVE (out + in + 1)·r + M·(r + out); top-k
    out·in + (out + in + 1)·k + M·(k + out); tiny_vit has 2 blocks of these 4 layers."""
    m, _ = build(cfg, "tiny_vit", "sve", *([] if rank is None else [f"method.rank={rank}"]))
    values = 0
    for out, inp in TINY.values():
        r = min(out, inp) if rank is None else rank
        kept = 0 if rank is None else out * inp
        values += 2 * (kept + (out + inp + 1) * r + 4 * (r + out))
    counts = m.param_counts()
    assert counts["targeted_bytes"] == 4 * values
    per_member = sum(2 * ((min(o, i) if rank is None else rank) + o) for o, i in TINY.values())
    assert counts["trainable"] == 4 * per_member + 4 * (3 * 16 + 3)         # + the heads


@pytest.mark.parametrize("override,shown", [("method.rank=0", "rank=0"),
                                            ("method.rank=17", "rank=17"),
                                            ("method.rank=2.5", "rank=2.5")])
@pytest.mark.parametrize("method", ["sve", "sve_split"])
def test_a_rank_no_layer_has_fails_naming_the_range(cfg, method, override, shown):
    with pytest.raises(ValueError, match=rf"method\.{shown}: give an integer from 1 to 16 "):
        build(cfg, "tiny_vit", method, override)


def test_top_k_trains_and_its_members_stay_apart(cfg):
    m, _ = build(cfg, "tiny_vit", "sve", "method.rank=2", "method.sigma_init=0.1")
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    m.loss((x, y)).backward()
    for layer in m.layers():
        assert layer.sve_s.grad.abs().sum() > 0 and layer.base_layer.weight.grad is None
        assert not layer.sve_U.requires_grad and not layer.base_layer.weight.requires_grad


# --- run identity -----------------------------------------------------------------------------

def test_new_options_at_their_defaults_keep_finished_runs(compose_cfg):
    from omegaconf import OmegaConf

    new = OmegaConf.to_container(compose_cfg(["method=sve"]), resolve=True)
    old = copy.deepcopy(new)
    del old["method"]["rank"], old["method"]["cache_weights"]   # stored before the options
    assert differences(old, new) == []
    new["method"]["rank"] = 8
    assert differences(old, new) == ["method.rank: '<absent>' (stored) → 8 (requested)"]
