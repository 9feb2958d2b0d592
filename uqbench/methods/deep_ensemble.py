"""Deep Ensemble: M members, each with its own full backbone weights and head.

Fine-tuned (``finetune: true``, the honest, expensive baseline): M copies of the pretrained
encoder, all trainable, no weight shared. Linear-probed (``finetune: false``): the frozen
copies would be identical, so ONE frozen encoder is kept and its features feed M heads (the
parameter counts report exactly that).

What makes the members differ. M independent runs would differ by their head's random init,
their own dropout masks and their own data order. Trained together, the members see the same
mini-batches (each still draws its own dropout masks and, normally, its own random head), so
the head init carries the diversity. Heads that start from a causal LM's answer rows (ARC-Easy
as next-token scoring) are not random: there every member would be an exact copy of every
other for the whole run. So those heads are perturbed per member as SVE perturbs the pretrained
spectrum, W_m = rows ⊙ (1 + σ·ε_m), b_m = σ·N(0, I) with σ = ``sigma_init`` (0 = exact copies,
only when asked for). Giving each member its own data order instead was not chosen: permuting
the rows inside the shared batch leaves the mean loss and its gradient unchanged, and drawing a
batch per member needs M data loaders and M times the data reading.

``vectorize: true`` runs the M fine-tuned copies as one vmapped call (torch.func:
stack_module_state + functional_call + vmap) over stacked weights (M, …) instead of a Python
loop: the same numbers, fewer kernel launches on a GPU. Each member still owns its weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from uqbench.contracts import DataInfo
from uqbench.methods.base import MemberParameters
from uqbench.methods.ensemble import EnsembleMethod, Inputs, check_sigma


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter and buffer names cannot contain dots


class DeepEnsemble(EnsembleMethod):
    """M independent (encoder copy, head) pairs; logits (M, B, C), member m from copy m.

    Parameters of the copies are named ``de_encoders.<m>.…`` (or, vectorised,
    ``de_params.<name with __ for .>`` of shape (M, …)), the heads ``head.…``. Fine-tuned, it
    trains the copies and the heads; linear-probed, the heads only. sigma_init: σ of the
    per-member perturbation of heads started from a causal LM's answer rows (0.01, SVE's
    σ_init; 0 = exact copies); random heads differ anyway and are left as drawn.
    """

    def __init__(self, backbone: Any, info: DataInfo, members: int = 4, finetune: bool = True,
                 vectorize: bool = False, sigma_init: float = 0.01,
                 name: str = "deep_ensemble") -> None:
        sigma_init = check_sigma(sigma_init)
        super().__init__(backbone, info, members, name, head_sigma=sigma_init)
        self.sigma_init = sigma_init
        self.finetune = bool(finetune)
        self.vectorize = bool(vectorize) and self.finetune
        if self.finetune:
            self._copy_encoder()
        self.train_declared()

    def _copy_encoder(self) -> None:
        """Replace the one encoder by M copies (a loop over a ModuleList, or stacked weights)."""
        encoder = self.encoder
        del self.encoder
        copies = [encoder] + [copy.deepcopy(encoder) for _ in range(self.members - 1)]
        if not self.vectorize:
            self.de_encoders = nn.ModuleList(copies)
            return
        from torch.func import stack_module_state

        params, buffers = stack_module_state(copies)                             # (M, …) each
        self.de_params = nn.ParameterDict({_key(k): nn.Parameter(v) for k, v in params.items()})
        self._buffer_names = list(buffers)
        for k, v in buffers.items():
            self.register_buffer(f"de_buffer__{_key(k)}", v)
        self._skeleton = [encoder.to("meta")]  # a list: not a submodule, holds no memory

    def fine_tuned(self) -> list[nn.Module]:
        if not self.finetune:
            return []
        return [self.de_params] if self.vectorize else [self.de_encoders]

    def member_parameters(self) -> MemberParameters:
        """The heads (M, …) and, fine-tuned, encoder copy m owned by member m (or, vectorised,
        the stacked copies (M, …))."""
        layout = super().member_parameters()
        if self.finetune and self.vectorize:
            layout.stacked += list(self.de_params.values())
            layout.shared = []
        elif self.finetune:
            layout.owned = [list(enc.parameters()) for enc in self.de_encoders]
            layout.shared = []
        return layout

    def _stacked_features(self, inputs: Inputs) -> torch.Tensor:
        from torch.func import functional_call

        skeleton = self._skeleton[0].train(self.training)
        params = {k: self.de_params[_key(k)] for k, _ in skeleton.named_parameters()}
        buffers = {k: getattr(self, f"de_buffer__{_key(k)}") for k in self._buffer_names}

        def one(p, b, x):
            return functional_call(skeleton, (p, b), (x,))

        feats = torch.vmap(one, in_dims=(0, 0, None), randomness="different")(
            params, buffers, inputs)                                             # (M, B, D)
        return feats.reshape(-1, feats.shape[-1])

    def features(self, inputs: Inputs) -> torch.Tensor:
        """Member-major features (M·B, D): member m's rows come from encoder copy m."""
        if not self.finetune:
            f = self.encoder(inputs)                                             # (B, D)
            return f.repeat(self.members, 1)
        if self.vectorize:
            return self._stacked_features(inputs)
        return torch.cat([enc(inputs) for enc in self.de_encoders])              # (M·B, D)

    def settings(self) -> dict[str, Any]:
        return super().settings() | {
            "finetune": self.finetune, "vectorize": self.vectorize, "sigma_init": self.sigma_init,
            "targets": "full backbone" if self.finetune else "heads only"}
