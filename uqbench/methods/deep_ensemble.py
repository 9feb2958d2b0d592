"""Deep Ensemble: M members, each with its own full backbone weights and head.

Fine-tuned (``finetune: true``, the honest, expensive baseline): M copies of the pretrained
encoder, all trainable, no weight shared; member diversity comes from the independently
initialised heads and the stochastic mini-batches. Linear-probed (``finetune: false``): the
frozen copies would be identical, so ONE frozen encoder is kept and its features feed M heads
(the parameter counts report exactly that).

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
from uqbench.methods.ensemble import EnsembleMethod, Inputs


def _key(name: str) -> str:
    return name.replace(".", "__")  # parameter and buffer names cannot contain dots


class DeepEnsemble(EnsembleMethod):
    """M independent (encoder copy, head) pairs; logits (M, B, C), member m from copy m.

    Parameters of the copies are named ``de_encoders.<m>.…`` (or, vectorised,
    ``de_params.<name with __ for .>`` of shape (M, …)), the heads ``head.…``. Fine-tuned, it
    trains the copies and the heads; linear-probed, the heads only.
    """

    def __init__(self, backbone: Any, info: DataInfo, members: int = 4, finetune: bool = True,
                 vectorize: bool = False, name: str = "deep_ensemble") -> None:
        super().__init__(backbone, info, members, name)
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
            "finetune": self.finetune, "vectorize": self.vectorize,
            "targets": "full backbone" if self.finetune else "heads only"}
