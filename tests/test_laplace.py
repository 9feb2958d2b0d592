"""Laplace-LoRA and last-layer Laplace: the posterior laplace-torch builds inside the methods
against the closed form of the generalised Gauss-Newton posterior, computed here by hand from
per-example Jacobians (torch.func), and the methods end to end from the command line."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import build_method as build
from tests.helpers import run_cli
from uqbench.methods.laplace import MapLoRALinear

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyData:
    """Random 16×16 images with 3 classes: train and val loaders, as a dataset object gives."""

    name, has_val = "tiny", True

    def __init__(self, n_train: int = 24, n_val: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.splits = {split: (torch.randn(n, 3, 16, 16, generator=g),
                               torch.randint(3, (n,), generator=g))
                       for split, n in (("train", n_train), ("val", n_val))}

    def loader(self, split: str) -> DataLoader:
        return DataLoader(TensorDataset(*self.splits[split]), batch_size=8)


def ggn_precision(logits_of, params: list[torch.Tensor], x: torch.Tensor,
                  prior_precision: float) -> torch.Tensor:
    """Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n + τ I over the examples of ``x``: the GGN posterior
    precision of softmax cross-entropy, J_n = ∂ logits(x_n) / ∂ params (flattened, in order)."""
    from torch.func import functional_call, jacrev  # noqa: F401  (jacrev over a flat vector)

    flat = torch.cat([p.detach().flatten() for p in params]).double()
    shapes = [p.shape for p in params]

    def logits(vector: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        chunks, start = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            chunks.append(vector[start:start + n].view(shape).float())
            start += n
        return logits_of(chunks, xi[None])[0].double()

    precision = prior_precision * torch.eye(len(flat), dtype=torch.float64)
    for xi in x:
        J = jacrev(logits)(flat, xi)                                            # (C, P)
        p = torch.softmax(logits(flat, xi), -1)
        precision += J.T @ (torch.diag(p) - torch.outer(p, p)) @ J
    return precision


def test_last_layer_posterior_is_the_closed_form_ggn(cfg):
    m, _ = build(cfg, "tiny_vit", "last_layer_laplace", "method.hessian=full",
              "method.finetune=false", "method.prior_grid=[-1,1,3]")
    data = TinyData()
    with torch.no_grad():  # a trained head: not the initial one
        m.head.weight.normal_(0, 1.0)
    posthoc = m.fit_posthoc(data, torch.device("cpu"))["laplace"]
    assert posthoc["weights"] == 3 * 16 + 3 and posthoc["hessian"] == "full"
    tau = posthoc["prior_precision"]
    assert min(abs(np.log10(tau) - g) for g in (-1, 0, 1)) < 1e-6      # a point of the grid
    m.eval()
    with torch.no_grad():
        features = m.encoder(data.splits["train"][0])                  # (N, D), frozen

    def logits_of(chunks, phi):                                        # the head on features
        weight, bias = chunks
        return phi @ weight.T + bias

    expected = ggn_precision(logits_of, [m.head.weight[0], m.head.bias[0]], features, tau)
    got = m.posterior.posterior_precision.double()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_laplace_lora_posterior_covers_exactly_the_lora_weights(cfg):
    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.hessian=full", "method.rank=2",
              "method.prior_grid=[-1,1,3]")
    data = TinyData(n_train=10)
    with torch.no_grad():  # trained adapters: B ≠ 0, so the Jacobian of A is not 0
        for layer in (x for x in m.modules() if isinstance(x, MapLoRALinear)):
            layer.lora_B.weight.normal_(0, 0.5)
    m.eval()
    _, covered = m.laplace_model()
    posthoc = m.fit_posthoc(data, torch.device("cpu"))["laplace"]
    assert posthoc["weights"] == sum(p.numel() for p in covered) > 0
    layers = [x for x in m.modules() if isinstance(x, MapLoRALinear)]
    # a functional copy of the model: its adapters' weights replaced by the given tensors
    twin = copy.deepcopy(m).eval()
    twin.posterior = None
    twin_layers = [x for x in twin.modules() if isinstance(x, MapLoRALinear)]

    def logits_of(chunks, x):
        for layer, a, b in zip(twin_layers, chunks[0::2], chunks[1::2], strict=True):
            del layer.lora_A.weight, layer.lora_B.weight
            layer.lora_A.weight, layer.lora_B.weight = a, b
        return twin.logits(x)[0]

    params = [p for layer in layers for p in (layer.lora_A.weight, layer.lora_B.weight)]
    expected = ggn_precision(logits_of, params, data.splits["train"][0],
                             posthoc["prior_precision"])
    torch.testing.assert_close(m.posterior.posterior_precision.double(), expected,
                               rtol=2e-3, atol=1e-4)


def test_map_lora_starts_as_the_pretrained_model_and_draws_differ_after_the_fit(cfg):
    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.prior_grid=[-1,1,3]")
    reference = copy.deepcopy(m.encoder).eval()
    for name, module in list(reference.named_modules()):                # unwrap the adapters
        if isinstance(module, MapLoRALinear):
            parent, _, child = name.rpartition(".")
            setattr(reference.get_submodule(parent) if parent else reference, child,
                    module.base_layer)
    m.eval()
    x = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(m(x), m.head(reference(x)[None]))    # B = 0: the backbone
    with torch.no_grad():
        for layer in (x for x in m.modules() if isinstance(x, MapLoRALinear)):
            layer.lora_B.weight.normal_(0, 0.5)
    m.fit_posthoc(TinyData(), torch.device("cpu"))
    draws = m(x)                                                         # (S, B, C) log-probs
    assert draws.shape == (16, 5, 3)
    torch.testing.assert_close(draws.exp().sum(-1), torch.ones(16, 5))
    assert draws.exp().std(0).mean() > 1e-4                              # the draws differ
    m.train()
    assert m(x).shape == (1, 5, 3)                                       # training: the MAP


@pytest.mark.parametrize("method", ["laplace_lora", "last_layer_laplace"])
def test_prior_search_and_predictive_are_laplace_torchs_own(cfg, method):
    """The validation NLL at every grid point equals laplace-torch's ``validate`` (what its
    gridsearch minimises) and the draws equal its ``predictive_samples``, on the same posterior:
    only the Jacobians are computed another way (one example at a time, once per batch)."""
    from laplace.utils import RunningNLLMetric, validate

    from uqbench.methods.laplace import _Batches

    m, _ = build(cfg, "tiny_vit", method, "method.prior_grid=[-3,3,7]",
                 "method.finetune=false" if method == "last_layer_laplace" else "method.rank=2")
    with torch.no_grad():
        for layer in (x for x in m.modules() if isinstance(x, MapLoRALinear)):
            layer.lora_B.weight.normal_(0, 0.5)
        m.head.weight.normal_(0, 1.0)
    data = TinyData(n_train=16, n_val=20)
    posthoc = m.fit_posthoc(data, torch.device("cpu"))["laplace"]
    la, chosen = m.posterior, m.prior_precision
    cpu = torch.device("cpu")
    expected = []
    for prior in torch.logspace(-3, 3, 7):
        la.prior_precision = prior
        expected.append(validate(la, _Batches(data.loader("val"), cpu), RunningNLLMetric(),
                                 pred_type="glm", link_approx="probit"))
    np.testing.assert_allclose(posthoc["grid_val_nll"], expected, rtol=1e-5)
    assert chosen == pytest.approx(10 ** (-3 + int(np.argmin(expected))), rel=1e-5)
    assert len(set(np.round(expected, 6))) > 1                 # the prior does move the NLL
    la.prior_precision = chosen
    m.eval()
    x = data.splits["val"][0][:8]
    with torch.no_grad():
        ours = m(x).exp()
    theirs = la.predictive_samples(x, pred_type="glm", n_samples=m.samples,
                                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    assert ours.std(0).mean() > 1e-4                             # draws that differ


@pytest.mark.parametrize("method", ["laplace_lora", "last_layer_laplace"])
def test_absent_answer_choices_get_no_probability_on_the_llama_arc_path(cfg, tmp_path, method):
    """ARC-Easy as a causal-LM prompt (answer letters' rows as the head): the posterior's draws
    give absent choices probability exactly 0, and the present ones draws that differ."""
    from hydra.utils import instantiate

    from tests.fixtures.datasets import write_arc_easy
    from uqbench.data.arc import ARCEasyData

    write_arc_easy(tmp_path)
    c = cfg("backbone=tiny_llama", f"method={method}", "method.prior_grid=[-2,2,3]")
    torch.manual_seed(0)
    backbone = instantiate(c.backbone)
    data = ARCEasyData(root=tmp_path, format="causal_lm", batch_size=8)
    data.setup(backbone)
    m = instantiate(c.method)(backbone=backbone, info=data.info)
    with torch.no_grad():
        for layer in (x for x in m.modules() if isinstance(x, MapLoRALinear)):
            layer.lora_B.weight.normal_(0, 0.5)
    m.fit_posthoc(data, torch.device("cpu"))
    m.eval()
    inputs, _ = next(iter(data.loader("train")))
    mask = inputs["choice_mask"]
    assert (~mask).any()                                   # the fixture has 3- to 5-choice rows
    with torch.no_grad():
        probs = m(inputs).exp()                                                  # (S, B, 5)
    assert torch.all(probs[:, ~mask] == 0) and torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:2]))
    assert probs[:, mask].std(0).mean() > 1e-5


@pytest.mark.parametrize("override,message", [
    ("method.hessian=bogus", "bogus"), ("method.samples=0", "samples"),
    ("method.prior_grid=[1,0,3]", "prior_grid")])
def test_bad_options_are_refused(cfg, override, message):
    with pytest.raises(ValueError, match=message):
        build(cfg, "tiny_vit", "laplace_lora", override)


def test_runs_end_to_end_with_the_posterior_recorded(tmp_path):
    run_cli("-m", "backbone=tiny_vit", "dataset=fake_images",
            "method=map_lora,laplace_lora,last_layer_laplace", "++method.prior_grid=[-2,2,3]",
            f"paths.runs_dir={tmp_path}", "trainer.epochs=1", "trainer.progress=false",
            "logger=none")
    for name, members in (("map_lora_r8", 1), ("laplace_lora_r8", 16),
                          ("last_layer_laplace", 16)):
        run = next((tmp_path / "default/fake_images" / name / "tiny_vit").glob("*/seed0"))
        res = json.loads((run / "results.json").read_text())
        assert np.isfinite(res["metrics"]["test/nll"]) and "ood/auroc_msp" in res["metrics"]
        probs = np.load(run / "predictions/test.npz")["member_probs"]
        assert probs.shape[0] == members
        if members > 1:
            laplace = res["posthoc"]["laplace"]
            assert min(abs(np.log10(laplace["prior_precision"]) - g) for g in (-2, 0, 2)) < 1e-6
            assert laplace["selected_by"] == "val/nll" and laplace["hessian"] == "kron"
        else:
            assert res["posthoc"] == {}


@pytest.mark.slow
def test_laplace_lora_runs_on_a_text_backbone(tmp_path):
    run_cli("backbone=tiny_bert", "dataset=fake_text", "method=laplace_lora",
            "method.prior_grid=[-2,2,3]", f"paths.runs_dir={tmp_path}", "trainer.epochs=1",
            "trainer.progress=false", "logger=none")
    run = next((tmp_path / "default/fake_text/laplace_lora_r8/tiny_bert").glob("*/seed0"))
    res = json.loads((run / "results.json").read_text())
    assert res["posthoc"]["laplace"]["weights"] > 0 and np.isfinite(res["metrics"]["test/nll"])
    assert np.load(run / "predictions/test.npz")["member_probs"].shape[0] == 16


def test_half_precision_weights_are_refused_before_anything_is_built(tmp_path):
    proc = run_cli("backbone=tiny_vit", "dataset=fake_images", "method=laplace_lora",
                   "trainer.precision=bf16-true", f"paths.runs_dir={tmp_path}", check=False)
    assert proc.returncode != 0 and "bf16-true" in proc.stderr and "32 or bf16-mixed" in proc.stderr
    assert not any(tmp_path.rglob("results.json"))


def _trained_adapters(m) -> None:
    """B ≠ 0 (a trained adapter's), so that the Jacobians of A are not zero."""
    with torch.no_grad():
        for layer in (x for x in m.modules() if isinstance(x, MapLoRALinear)):
            layer.lora_B.weight.normal_(0, 0.5)


def _tokens(n: int, length: int = 6) -> dict[str, torch.Tensor]:
    """Token ids with a padded tail on every other row (the attention mask matters)."""
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[::2, length // 2:] = 0
    return {"input_ids": torch.randint(5, 100, (n, length), generator=g),
            "attention_mask": mask}


@pytest.mark.parametrize("backbone", ["tiny_vit", "tiny_bert"])
def test_lora_jacobians_are_laplace_torchs_batch_jacobians(cfg, backbone):
    """One forward and one backward pass per class of the whole batch give the per-example
    Jacobians laplace-torch takes of the batch's logits (torch.func's jacrev of the whole
    (B, C) output, which costs B·C backward passes), in its (B, C, P) layout, on images and on
    padded text alike."""
    from laplace.curvature import CurvlinopsGGN

    from uqbench.methods.laplace import plain_attention
    from uqbench.methods.lora_glm import LoRAPasses, lora_jacobians

    m, _ = build(cfg, backbone, "laplace_lora", "method.rank=2")
    _trained_adapters(m)
    m.eval()
    model, covered = m.laplace_model()
    model.requires_grad_(False)
    for p in covered:
        p.requires_grad_(True)
    inputs = (_tokens(5) if backbone == "tiny_bert"
              else torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(3)))
    layers = [x for x in m.modules() if isinstance(x, MapLoRALinear)]
    with plain_attention(m):
        expected, f_expected = CurvlinopsGGN(model, "classification").jacobians(inputs)
        passes = LoRAPasses(model, layers, inputs)
    js, f = lora_jacobians(passes, layers), passes.f
    assert js.shape == expected.shape == (5, 3, sum(p.numel() for p in covered))
    assert expected.abs().max() > 1e-2                       # Jacobians that are not zero
    torch.testing.assert_close(js, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f, f_expected, rtol=1e-5, atol=1e-6)


class _Twice(torch.nn.Module):
    """One adapter applied twice to tokens (B, N, 4): its Jacobian is the sum of both calls'."""

    def __init__(self) -> None:
        super().__init__()
        self.lora = MapLoRALinear(torch.nn.Linear(4, 4), rank=2, scaling=0.5)
        self.head = torch.nn.Linear(4, 3)
        self.lora.base_layer.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.lora(torch.tanh(self.lora(x)))).mean(1))


def test_an_adapter_called_twice_sums_both_calls_jacobians():
    from torch.func import functional_call, jacrev, vmap

    from uqbench.methods.lora_glm import LoRAPasses, lora_jacobians

    torch.manual_seed(0)
    net = _Twice()
    torch.nn.init.normal_(net.lora.lora_B.weight)
    x = torch.randn(6, 5, 4)
    passes = LoRAPasses(net, [net.lora], x)
    assert len(passes.calls) == 2
    names = ["lora.lora_A.weight", "lora.lora_B.weight"]
    weights = {n: p.detach() for n, p in net.named_parameters() if n in names}

    def one(w, xi):
        return functional_call(net, w, (xi[None],))[0]

    per_example = vmap(jacrev(one), in_dims=(None, 0))(weights, x)            # by autograd
    expected = torch.cat([per_example[n].flatten(2) for n in names], dim=-1)
    torch.testing.assert_close(lora_jacobians(passes, [net.lora]), expected)
    torch.testing.assert_close(passes.f, net(x).detach())


@pytest.mark.parametrize("hessian", ["kron", "diag", "full"])
def test_the_predictive_is_laplace_torchs_on_its_own_batch_jacobians(cfg, hessian):
    """The draws at evaluation, f_MAP and J P⁻¹ Jᵀ equal laplace-torch's GLM predictive built
    from its own Jacobians of the whole batch (torch.func), its ``functional_variance`` and
    its ``normal_samples`` (what ``predictive_samples`` draws), to 1e-6 on the probabilities;
    with the KFAC posterior (the variance from the Jacobians rotated into its eigenbases)
    and with the others (laplace-torch's variance of the flat Jacobians)."""
    from laplace.utils import normal_samples

    from uqbench.methods.laplace import plain_attention

    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.rank=2", f"method.hessian={hessian}",
                 "method.prior_grid=[-1,1,3]")
    _trained_adapters(m)
    m.fit_posthoc(TinyData(n_train=16), torch.device("cpu"))
    m.eval()
    la = m.posterior
    x = torch.randn(7, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with plain_attention(m):
        js, f_expected = la.backend.jacobians(x)
    var_expected = la.functional_variance(js)
    assert var_expected.diagonal(dim1=1, dim2=2).min() > 1e-3       # variances that matter
    expected = torch.softmax(normal_samples(f_expected, var_expected, m.samples,
                                            torch.Generator().manual_seed(0)), dim=-1)
    with torch.no_grad():
        probs = m(x).exp()
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)
    f_mu, variance = m._linearised(x)
    torch.testing.assert_close(f_mu, f_expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(variance(False), var_expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(variance(True), var_expected.diagonal(dim1=1, dim2=2),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("damping", [False, True])
def test_rotated_variance_is_the_kfac_inverse_square_form(cfg, damping):
    """J P⁻¹ Jᵀ from the rotated Jacobians equals laplace-torch's ``inv_square_form`` of the
    flat Jacobians at every prior precision of a grid, with and without its damping."""
    from uqbench.methods.laplace import plain_attention
    from uqbench.methods.lora_glm import LoRAPasses, RotatedJacobians, lora_jacobians

    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.rank=2", "method.prior_grid=[-1,1,3]")
    _trained_adapters(m)
    m.fit_posthoc(TinyData(n_train=16), torch.device("cpu"))
    m.eval()
    la = m.posterior
    layers = [x for x in m.modules() if isinstance(x, MapLoRALinear)]
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(5))
    with plain_attention(m):  # each pass set is read once (its backward frees the graph)
        js = lora_jacobians(LoRAPasses(la.model, layers, x), layers)
        rotated = RotatedJacobians(LoRAPasses(la.model, layers, x), layers,
                                   la.posterior_precision)
    for prior in (1e-3, 1.0, 1e3):
        la.prior_precision = prior
        precision = la.posterior_precision
        precision.damping = damping
        expected = precision.inv_square_form(js)
        ours = rotated.variance(precision)
        assert not ours.requires_grad                          # no graph kept at evaluation
        torch.testing.assert_close(ours, expected.detach(), rtol=1e-5,
                                   atol=1e-6 * float(expected.abs().max()))


def test_mixed_precision_draws_stay_near_the_float32_ones(cfg):
    """Under bf16 autocast (a bf16-mixed run's evaluation) the forward and backward passes run
    in bfloat16 but the algebra on the Jacobians stays in float32: the draws are float32 and
    within bfloat16's error of the float32 draws (pinned above to laplace-torch's)."""
    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.rank=2", "method.prior_grid=[-1,1,3]")
    _trained_adapters(m)
    m.fit_posthoc(TinyData(n_train=16), torch.device("cpu"))
    m.eval()
    x = torch.randn(7, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = m(x).exp()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            probs = m(x).exp()
    assert probs.dtype == torch.float32 and torch.isfinite(probs).all()
    assert expected.std(0).mean() > 1e-2                     # draws that differ from the MAP
    torch.testing.assert_close(probs, expected, rtol=0, atol=5e-2)


def _dense_covariance(precision) -> torch.Tensor:
    """P⁻¹ (P, P) in float64, dense, of a Kronecker-factored precision in laplace-torch's
    ``KronDecomposed`` form: per weight (Q₁ ⊗ Q₂) diag(1 / (λ₁ ⊗ λ₂ + δ)) (Q₁ ⊗ Q₂)ᵀ (with
    ``damping``, 1 / ((λ₁ + √δ) ⊗ (λ₂ + √δ))), the blocks on the diagonal."""
    blocks = []
    for (q1, q2), (l1, l2), delta in zip(precision.eigenvectors, precision.eigenvalues,
                                         precision.deltas, strict=True):
        q = torch.kron(q1.double(), q2.double())
        l1, l2, delta = l1.double(), l2.double(), float(delta)
        values = (torch.outer(l1 + delta ** 0.5, l2 + delta ** 0.5) if precision.damping
                  else torch.outer(l1, l2) + delta).flatten()
        blocks.append(q @ torch.diag(1 / values) @ q.T)
    return torch.block_diag(*blocks).detach()


def _explicit_jacobians(m, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f_MAP (B, C) and J (B, C, P) in float64 by torch.func's jacrev of a float64 copy of the
    MAP model with respect to its adapters' weights (A before B, adapter by adapter)."""
    from torch.func import functional_call, jacrev

    posterior, m.posterior = m.posterior, None
    try:
        twin = copy.deepcopy(m).double().eval()
    finally:
        m.posterior = posterior
    names = [f"{name}.{part}.weight" for name, layer in twin.named_modules()
             if isinstance(layer, MapLoRALinear) for part in ("lora_A", "lora_B")]
    weights = {n: p.detach() for n, p in twin.named_parameters() if n in names}
    assert len(weights) == len(names)

    def logits(w):
        return functional_call(twin, w, (x.double(),))[0]                  # (B, C)

    per_weight = jacrev(logits)(weights)                                  # (B, C, *shape)
    js = torch.cat([per_weight[n].flatten(2) for n in names], dim=-1).detach()
    with torch.no_grad():
        return logits(weights), js


@pytest.mark.parametrize(("prior", "atol"), [(1e-2, 5e-6), (1.0, 1e-6), (1e2, 1e-6)])
def test_laplace_lora_predictive_is_the_explicit_jacobian_times_the_dense_kfac_covariance(
        cfg, prior, atol):
    """The draws at evaluation, and J P⁻¹ Jᵀ, against an independent float64 computation:
    the whole Jacobian of a float64 copy of the model by torch.func's jacrev, times the dense
    inverse of the Kronecker-factored precision built from the fitted factors themselves
    (F₁ ⊗ F₂ + δ I per weight), drawn as laplace-torch's predictive draws them; the
    probabilities to 1e-6 at three prior precisions."""
    from laplace.utils import normal_samples

    from uqbench.methods.laplace import plain_attention

    m, _ = build(cfg, "tiny_vit", "laplace_lora", "method.rank=2", "method.prior_grid=[-1,1,3]")
    _trained_adapters(m)
    m.fit_posthoc(TinyData(n_train=16), torch.device("cpu"))
    m.eval()
    la = m.posterior
    la.prior_precision = prior
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    with plain_attention(m):
        f_ref, js = _explicit_jacobians(m, x)
    var_ref = js @ _dense_covariance(la.posterior_precision) @ js.transpose(1, 2)  # (B, C, C)
    assert var_ref.diagonal(dim1=1, dim2=2).min() > 1e-3                # variances that matter
    f_mu, variance = m._linearised(x)
    torch.testing.assert_close(f_mu.double(), f_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(variance(False).double(), var_ref, rtol=1e-5,
                               atol=1e-6 * float(var_ref.abs().max()))
    torch.testing.assert_close(variance(True).double(), var_ref.diagonal(dim1=1, dim2=2),
                               rtol=1e-5, atol=1e-6 * float(var_ref.abs().max()))
    expected = torch.softmax(normal_samples(f_ref.float(), var_ref.float(), m.samples,
                                            torch.Generator().manual_seed(0)), dim=-1)
    with torch.no_grad():
        probs = m(x).exp()
    assert (expected.std(0) > 1e-2).any()                        # draws that differ from the MAP
    torch.testing.assert_close(probs, expected, rtol=0, atol=atol)


class _Precision:
    """A Kronecker-factored posterior precision in laplace-torch's ``KronDecomposed`` form
    (eigenvectors and eigenvalues of two factors per weight, one prior precision each),
    random: for the rotated Jacobians of a model laplace-torch does not fit."""

    damping = False

    def __init__(self, shapes: list[tuple[int, int]], delta: float) -> None:
        g = torch.Generator().manual_seed(8)
        self.eigenvectors = [[torch.linalg.qr(torch.randn(n, n, generator=g))[0] for n in s]
                             for s in shapes]
        self.eigenvalues = [[torch.rand(n, generator=g) * 3 for n in s] for s in shapes]
        self.deltas = torch.full((len(shapes),), delta)


def test_rotated_jacobians_of_an_adapter_called_twice_sum_both_calls():
    """J P⁻¹ Jᵀ from the rotated Jacobians of an adapter applied twice (both calls' shares of
    each block summed) equals torch.func's whole Jacobian times the dense covariance."""
    from torch.func import functional_call, jacrev, vmap

    from uqbench.methods.lora_glm import LoRAPasses, RotatedJacobians

    torch.manual_seed(0)
    net = _Twice()
    torch.nn.init.normal_(net.lora.lora_B.weight)
    x = torch.randn(6, 5, 4)
    names = ["lora.lora_A.weight", "lora.lora_B.weight"]
    weights = {n: p.detach() for n, p in net.named_parameters() if n in names}
    precision = _Precision([tuple(w.shape) for w in weights.values()], delta=0.5)

    def one(w, xi):
        return functional_call(net, w, (xi[None],))[0]

    per_example = vmap(jacrev(one), in_dims=(None, 0))(weights, x)            # by autograd
    js = torch.cat([per_example[n].flatten(2) for n in names], dim=-1).double()
    expected = js @ _dense_covariance(precision) @ js.transpose(1, 2)
    passes = LoRAPasses(net, [net.lora], x)
    assert len(passes.calls) == 2
    ours = RotatedJacobians(passes, [net.lora], precision).variance(precision)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)
