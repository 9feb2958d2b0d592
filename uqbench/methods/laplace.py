"""Laplace approximations after a MAP fine-tune: Laplace-LoRA and last-layer Laplace.

Both train one model as usual (maximum a posteriori with the trainer's weight decay), then
fit a Gaussian posterior N(θ_MAP, P⁻¹) around part of its weights after training, with the
maintained laplace-torch library (Daxberger et al., 2021, "Laplace Redux"):

- **Laplace-LoRA** (Yang, Robeyns, Wang & Aitchison, ICLR 2024): a LoRA fine-tune of the
  frozen backbone (``MAP LoRA``), then a Laplace approximation over the LoRA parameters only,
  with a Kronecker-factored (KFAC) Hessian. The adapters are ``nn.Linear`` modules (as peft's),
  so the curvature backends see them as linear layers: y = W x + b + scaling · B(A x).
- **Last-layer Laplace** (the cheap post-hoc baseline): a single model (fine-tuned, or a linear
  probe), then a Laplace approximation over the classification head only.

The prior precision is chosen on the validation split by grid search over the NLL of the probit-
approximated linearised predictive (the objective of laplace-torch's ``gridsearch``), as the
papers tune it on held-out data. At evaluation the method returns ``samples`` draws of the
linearised (GLM) predictive, the logits f ~ N(f_MAP, J P⁻¹ Jᵀ), as members (S, B, C): the task
averages their softmax like an ensemble's. Before the posterior is fitted (training, and the
validation passes that choose the epoch) the method is the MAP model, logits (1, B, C).

The runner calls :meth:`LaplaceMethod.fit_posthoc` after training and after loading a
checkpoint (``job=eval``); the fit reads the training split once, so it is deterministic.

Longer than most modules: laplace-torch computes the Jacobians of the predictive for a whole
batch at once, at a cost that grows with the batch size squared; here the Jacobians of a batch
come from one forward and one backward pass per class (:mod:`uqbench.methods.lora_glm` for
Laplace-LoRA, laplace-torch's closed form for the last layer), once for every point of the
prior's grid search, with laplace-torch's own curvature and draws on top.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Literal, cast, get_args

import torch
from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import DataInfo, to_device
from uqbench.methods.ensemble import EnsembleMethod, positive_int
from uqbench.methods.lora_glm import LoRAPasses, RotatedJacobians, lora_jacobians
from uqbench.methods.member_layers import MemberLinear, Targets, replace_linears, resolve_targets
from uqbench.methods.multiple_choice import mask_absent

log = logging.getLogger("uqbench")

Hessian = Literal["kron", "diag", "full"]
HESSIANS: tuple[str, ...] = get_args(Hessian)


class MapLoRALinear(MemberLinear):
    """One low-rank adapter on a frozen linear layer, as ``nn.Linear`` modules (peft's form):
    y = base_layer(x) + scaling · lora_B(lora_A(x)), lora_A (r × in) Kaiming-uniform as
    ``nn.Linear``'s default, lora_B (out × r) zeros: the model starts as the pretrained one."""

    adapter_names = ("lora_A_weight", "lora_B_weight")

    def __init__(self, base_layer: nn.Linear, rank: int, scaling: float) -> None:
        super().__init__(base_layer, 1)
        self.rank, self.scaling = rank, scaling
        device = base_layer.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        nn.init.zeros_(self.lora_B.weight)

    @property
    def lora_A_weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.lora_A.weight)

    @property
    def lora_B_weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return self.base_layer(x) + self.scaling * delta.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling}"


@contextmanager
def plain_attention(module: nn.Module) -> Iterator[None]:
    """timm's attention layers run their plain form (softmax(q kᵀ/√d) v) instead of PyTorch's
    fused kernel inside the block: the fused kernel has no forward-mode derivative, and under
    ``vmap`` it runs example by example (no batching rule), where the plain form is batched."""
    fused = [m for m in module.modules() if getattr(m, "fused_attn", False)]
    for m in fused:
        setattr(m, "fused_attn", False)  # noqa: B010  (an attribute timm reads, untyped)
    try:
        yield
    finally:
        for m in fused:
            setattr(m, "fused_attn", True)  # noqa: B010


def flat_variance(posterior: Any, js: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """J P⁻¹ Jᵀ (B, C, C) of flat Jacobians ``js`` (B, C, P) by laplace-torch's
    ``functional_variance`` at the posterior's prior precision (its diagonal (B, C) when
    ``diagonal``)."""
    f_var = posterior.functional_variance(js).detach()
    return f_var.diagonal(dim1=1, dim2=2) if diagonal else f_var


class _Part(nn.Module):
    """One part of the method as laplace-torch calls a model: inputs (B, …), or a mapping of
    input tensors (and ``labels``), → the MAP logits (B, C) (``part="logits"``) or the encoder
    features (B, D) (``part="features"``)."""

    def __init__(self, method: LaplaceMethod, part: str) -> None:
        super().__init__()
        self.method, self.part = method, part

    def forward(self, inputs: Any) -> torch.Tensor:
        if isinstance(inputs, MutableMapping):
            inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if self.part == "logits":
            out: torch.Tensor = self.method.map_logits(inputs)[0]
            return out
        return self.method.features(inputs)


def _choices(inputs: Any) -> torch.Tensor | None:
    """The batch's ``choice_mask`` (B, C) (false: an absent answer choice), or None."""
    return inputs.get("choice_mask") if isinstance(inputs, MutableMapping) else None


class _HeadAsLinear(nn.Module):
    """The single model as encoder features then an ``nn.Linear`` head that shares the head's
    storage (set 0): laplace-torch's last-layer approximation needs the last layer to be a
    linear module."""

    def __init__(self, method: LaplaceMethod) -> None:
        super().__init__()
        self.features = _Part(method, "features")
        weight, bias = method.head.weight[0], method.head.bias[0]
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device)
        self.linear.weight = nn.Parameter(weight, requires_grad=False)  # the same storage
        self.linear.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, inputs: Any) -> torch.Tensor:
        return self.linear(self.features(inputs))


class _Batches:
    """A loader's (inputs, labels) batches on ``device``; a batch of dict inputs becomes one
    mapping with ``labels`` added, laplace-torch's form for inputs that are not one tensor.
    ``dataset`` is the loader's (laplace-torch reads N from it)."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader, self.device = loader, device
        # N, the number of examples: a DataLoader's dataset, or in-memory batches' tensors
        self.dataset = loader.dataset if hasattr(loader, "dataset") else loader.tensors[0]

    def __iter__(self) -> Iterator[Any]:
        for inputs, y in self.loader:
            inputs, y = to_device(inputs, self.device), y.to(self.device)
            yield {**inputs, "labels": y} if isinstance(inputs, dict) else (inputs, y)

    def __len__(self) -> int:
        return len(self.loader)


class LaplaceMethod(EnsembleMethod):
    """What both Laplace methods share: the MAP model until :meth:`fit_posthoc`, then
    ``samples`` GLM predictive draws (S, B, C).

    samples: draws of the linearised predictive at evaluation (the members). hessian: kron
    (KFAC, default) | diag | full. prior_grid: (log10 min, log10 max, points) of the prior
    precision's grid search on validation NLL.
    """

    subset = "all"  # laplace-torch's subset_of_weights: the weights that require grad

    def __init__(self, backbone: Backbone, info: DataInfo, name: str, samples: int,
                 hessian: Hessian, prior_grid: tuple[float, float, int] | list[float]) -> None:
        self.samples = positive_int(samples, "method.samples", " (draws of the predictive)")
        if hessian not in HESSIANS:
            raise ValueError(f"method.hessian '{hessian}' is not one of {HESSIANS} (kron: "
                             f"Kronecker-factored, as Laplace-LoRA)")
        self.hessian = hessian
        grid = list(prior_grid)
        if len(grid) != 3 or not grid[0] < grid[1] or int(grid[2]) < 2:
            raise ValueError(f"method.prior_grid must be [log10 min, log10 max, points] with "
                             f"min < max and at least 2 points, got {prior_grid}")
        self.prior_grid = (float(grid[0]), float(grid[1]), int(grid[2]))
        if info.multiple_choice:
            raise ValueError(f"method '{name}' does not take multiple-choice data in the "
                             f"encoder format yet (its (B, choices, tokens) inputs); use a "
                             f"classification dataset or ARC-Easy as a prompt "
                             f"(dataset.format=causal_lm)")
        super().__init__(backbone, info, members=1, name=name)
        self.posterior: Any = None
        self.prior_precision: float | None = None

    @classmethod
    def check_trainer(cls, trainer: dict[str, Any], method: dict[str, Any]) -> None:
        """The posterior's curvature and its eigendecomposition need float32 weights: training
        in half-precision weights (``*-true``) is refused before anything is built, unless no
        posterior is fitted (``laplace: false``, MAP LoRA)."""
        precision = str(trainer.get("precision", "32"))
        if precision.endswith("-true") and method.get("laplace", True):
            raise ValueError(f"trainer.precision={precision}: the Laplace methods fit their "
                             f"posterior on float32 weights; use 32 or bf16-mixed")

    def forward(self, inputs: Any) -> torch.Tensor:
        """MAP logits (1, B, C) until the posterior is fitted (and while training); after it,
        in evaluation mode, ``samples`` draws of the GLM predictive, log-probabilities
        (S, B, C) (their softmax is the draw's probabilities)."""
        if self.posterior is None or self.training:
            return self.map_logits(inputs)
        batch = inputs if not isinstance(inputs, dict) else dict(inputs)
        generator = torch.Generator(device=self.head.weight.device).manual_seed(0)
        from laplace.utils import normal_samples

        f_mu, variance = self._linearised(batch)
        f_var = variance(False)
        mask = _choices(batch)
        if mask is not None:  # absent choices have no variance; a unit one keeps the Cholesky
            f_var = f_var + torch.diag_embed((~mask.bool()).to(f_var.dtype))  # defined
        # laplace-torch's GLM predictive draws (its predictive_samples, on these moments)
        f = mask_absent(normal_samples(f_mu, f_var, self.samples, generator), mask)
        return torch.log_softmax(f, dim=-1)

    def map_logits(self, inputs: Any) -> torch.Tensor:
        """The MAP model's logits (1, B, C), absent answer choices masked: what training sees,
        and the model the posterior approximates."""
        return super().forward(inputs)

    def _linearised(self, batch: Any) -> tuple[torch.Tensor, Callable[[bool], torch.Tensor]]:
        """The linearised predictive at one batch: f_MAP (B, C), and a function giving
        J P⁻¹ Jᵀ (B, C, C) (its diagonal (B, C) when called with True) at the posterior's
        current prior precision, from Jacobians taken once for the batch (subclasses)."""
        raise NotImplementedError

    def laplace_model(self) -> tuple[nn.Module, list[nn.Parameter]]:
        """The model laplace-torch approximates (inputs → logits (B, C)) and the weights the
        posterior covers (subclasses)."""
        raise NotImplementedError

    def fit_posthoc(self, data: Any, device: torch.device) -> dict[str, Any]:
        """Fit the Laplace approximation at the trained weights on the training split and
        choose the prior precision on the validation split; returns what results.json records
        under ``posthoc``."""
        from laplace import Laplace

        if not getattr(data, "has_val", False):
            raise ValueError(f"method '{self.name}' chooses its prior precision on the "
                             f"validation split; dataset '{getattr(data, 'name', '?')}' has none")
        start = time.perf_counter()
        model, covered = self.laplace_model()
        trained = {id(p): p.requires_grad for p in model.parameters()}
        model.requires_grad_(False)
        for p in covered:
            p.requires_grad_(True)
        self.eval()
        # the full and diagonal curvature products use forward-mode differentiation, which
        # PyTorch's fused attention kernels lack: timm's attention runs its plain form then
        with plain_attention(self) if self.hessian != "kron" else nullcontext():
            try:
                la = Laplace(model, "classification", subset_of_weights=self.subset,
                             hessian_structure=self.hessian)
                # the batches are a loader's, in laplace-torch's form (any iterable with
                # .dataset)
                la.fit(cast(Any, _Batches(data.loader("train"), device)))
                self.posterior = la
                lo, hi, points = self.prior_grid
                grid = torch.logspace(lo, hi, points)
                grid_nll = self.grid_nll(_Batches(data.loader("val"), device), grid)
                la.prior_precision = grid[int(torch.argmin(grid_nll))]  # the first of least NLL
            finally:
                for p in model.parameters():
                    p.requires_grad_(trained[id(p)])
        self.prior_precision = float(la.prior_precision.flatten()[0])
        log10 = math.log10(self.prior_precision)
        edge = min(abs(log10 - lo), abs(log10 - hi)) < 1e-6
        if edge:
            log.warning("%s: the prior precision chosen on validation, %.3g, is at the edge of "
                        "method.prior_grid=%s; widen the grid", self.name,
                        self.prior_precision, list(self.prior_grid))
        return {"laplace": {"weights": sum(p.numel() for p in covered),
                            "hessian": self.hessian, "prior_precision": self.prior_precision,
                            "prior_grid": list(self.prior_grid), "selected_by": "val/nll",
                            "grid_val_nll": [float(v) for v in grid_nll],
                            "at_grid_edge": edge, "fit_s": time.perf_counter() - start}}

    def grid_nll(self, batches: Iterable[Any], grid: torch.Tensor) -> torch.Tensor:
        """The mean NLL over ``batches`` of the probit-approximated GLM predictive,
        softmax(κ f_MAP) with κ = (1 + π/8 diag(J P⁻¹ Jᵀ))^(-1/2), at each prior precision of
        ``grid`` (what laplace-torch's ``gridsearch`` minimises), with each batch's Jacobians
        computed once for the whole grid instead of once per point."""
        la = self.posterior
        nll = torch.zeros(len(grid), dtype=torch.float64)
        n = 0
        for batch in batches:
            x, y = (batch, batch["labels"]) if isinstance(batch, MutableMapping) else batch
            f_mu, variance = self._linearised(x)  # once (f_var below is the cheap part)
            f_mu = mask_absent(f_mu[None], _choices(x))[0]
            for i, prior in enumerate(grid):
                la.prior_precision = prior
                f_var = variance(True)
                probs = torch.softmax(f_mu / torch.sqrt(1.0 + math.pi / 8 * f_var), dim=-1)
                nll[i] += torch.nn.functional.nll_loss(probs.log(), y, reduction="sum").item()
            n += len(y)
        return nll / n

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"samples": self.samples, "hessian": self.hessian,
                                     "prior_grid": list(self.prior_grid)}


class LaplaceLoRA(LaplaceMethod):
    """MAP LoRA, then a Laplace approximation over its LoRA parameters (Laplace-LoRA).

    rank: r (8). alpha: null = scaling 1; a number = alpha / rank (peft's lora_alpha).
    targets: attention (default: q, k, v, o, the backbone's ``attention_targets``; the fused
    q/k/v layer of a timm ViT gets one adapter), all, or a list of module-name suffixes.
    laplace: false trains and scores the MAP LoRA model itself (the row both start from).
    """

    def __init__(self, backbone: Backbone, info: DataInfo, rank: int = 8,
                 alpha: float | None = None, targets: Targets = "attention",
                 laplace: bool = True, samples: int = 16, hessian: Hessian = "kron",
                 prior_grid: tuple[float, float, int] | list[float] = (-4.0, 8.0, 25),
                 name: str = "laplace_lora") -> None:
        rank = positive_int(rank, "method.rank", " (8 in Laplace-LoRA)")
        if alpha is not None and float(alpha) <= 0:
            raise ValueError(f"method.alpha must be > 0 or null (no scaling), got {alpha}")
        suffixes = resolve_targets(backbone, targets, name)
        super().__init__(backbone, info, name, samples, hessian, prior_grid)
        self.rank, self.alpha, self.laplace = rank, alpha, bool(laplace)
        self.scaling = 1.0 if alpha is None else float(alpha) / rank
        self.targets = suffixes
        self.replaced = replace_linears(
            self.encoder, suffixes, lambda n, layer: MapLoRALinear(layer, rank, self.scaling),
            name)
        self.train_declared()

    def laplace_model(self) -> tuple[nn.Module, list[nn.Parameter]]:
        return _Part(self, "logits"), [p for m in self.modules() if isinstance(m, MapLoRALinear)
                                  for p in m.adapters()]

    def fit_posthoc(self, data: Any, device: torch.device) -> dict[str, Any]:
        return super().fit_posthoc(data, device) if self.laplace else {}

    def _linearised(self, batch: Any) -> tuple[torch.Tensor, Callable[[bool], torch.Tensor]]:
        """From one forward and one backward pass per class for the whole batch
        (:class:`~uqbench.methods.lora_glm.LoRAPasses`, timm's attention in its plain form,
        as the fit's): with the Kronecker-factored posterior, the Jacobians rotated once into
        its eigenbases (:class:`~uqbench.methods.lora_glm.RotatedJacobians`), the variance of
        every prior precision from them; with the others, laplace-torch's
        ``functional_variance`` of the flat Jacobians."""
        la = self.posterior
        layers = [m for m in self.modules() if isinstance(m, MapLoRALinear)]
        with plain_attention(self):
            passes = LoRAPasses(la.model, layers, batch)
        f_mu = passes.f
        # the algebra on the Jacobians in the weights' float32, also under mixed precision
        exact = partial(torch.autocast, f_mu.device.type, enabled=False)
        if self.hessian == "kron" and RotatedJacobians.fits(layers, la.posterior_precision):
            with exact():
                rotated = RotatedJacobians(passes, layers, la.posterior_precision)

            def variance(diagonal: bool) -> torch.Tensor:
                with exact():
                    return rotated.variance(la.posterior_precision, diagonal)
            return f_mu.float(), variance
        with exact():
            js = lora_jacobians(passes, layers)

        def flat(diagonal: bool) -> torch.Tensor:
            with exact():
                return flat_variance(la, js, diagonal)
        return f_mu.float(), flat

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "rank": self.rank, "alpha": self.alpha, "scaling": self.scaling,
            "targets": ",".join(self.targets), "replaced_layers": len(self.replaced),
            "laplace": self.laplace}


class LastLayerLaplace(LaplaceMethod):
    """A single model (fine-tuned, or the head alone over the frozen encoder: ``finetune``),
    then a Laplace approximation over its classification head."""

    subset = "last_layer"

    def __init__(self, backbone: Backbone, info: DataInfo, finetune: bool = True,
                 samples: int = 16, hessian: Hessian = "kron",
                 prior_grid: tuple[float, float, int] | list[float] = (-4.0, 8.0, 25),
                 name: str = "last_layer_laplace") -> None:
        super().__init__(backbone, info, name, samples, hessian, prior_grid)
        self.finetune = bool(finetune)
        if self.finetune:  # registered after the head, as the single model's (same order)
            self.encoder = self._modules.pop("encoder")  # type: ignore[assignment]  # set
        self.train_declared()

    def fine_tuned(self) -> list[nn.Module]:
        return [self.encoder] if self.finetune else []

    def _linearised(self, batch: Any) -> tuple[torch.Tensor, Callable[[bool], torch.Tensor]]:
        """laplace-torch's closed-form last-layer Jacobians (features ⊗ I) and its
        ``functional_variance``."""
        js, f_mu = self.posterior.backend.last_layer_jacobians(batch)
        return f_mu.detach(), partial(flat_variance, self.posterior, js.detach())

    def laplace_model(self) -> tuple[nn.Module, list[nn.Parameter]]:
        model = _HeadAsLinear(self)
        return model, list(model.linear.parameters())

    def settings(self) -> dict[str, Any]:
        return super().settings() | {"finetune": self.finetune}

