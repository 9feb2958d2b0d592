"""A small multilayer perceptron, the backbone of the regression benchmarks.

Like every backbone it is a description; :meth:`MLP.build` makes the network. Its input width
is set by the data, so ``build`` takes it: ``build(in_features)`` returns the deterministic
feature network, (B, in_features) → (B, feature_dim). Methods add their own output layer; the
variational BNN builds this network and converts it layer by layer into its Bayesian twin.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from uqbench.backbones.base import Backbone
from uqbench.contracts import one_of

Activation = Literal["leaky_relu", "relu"]


class MLP(Backbone):
    """``depth`` hidden layers of ``width`` units, each followed by a (leaky-)ReLU.

    A tabular backbone with no pretrained weights: ``targets`` and ``attention_targets`` are
    empty (adapter methods have nothing to wrap) and ``pretrained`` is false.
    """

    modality = "tabular"

    def __init__(self, name: str = "mlp", width: int = 16, depth: int = 1,
                 activation: Activation = "leaky_relu", slope: float = 0.1) -> None:
        if int(width) < 1:
            raise ValueError(f"backbone.width must be a positive integer, got {width}")
        if int(depth) < 1:
            raise ValueError(f"backbone.depth must be a positive integer, got {depth}")
        one_of("backbone.activation", activation, Activation)
        if activation == "leaky_relu" and not 0 <= slope < 1:
            raise ValueError(f"backbone.slope must lie in [0, 1), got {slope}")
        super().__init__(name, targets=(), attention_targets=(), pretrained=False)
        self.width, self.depth = int(width), int(depth)
        self.activation = activation
        self.slope = float(slope) if activation == "leaky_relu" else 0.0

    # A tabular backbone's input width is the data's, so its build takes it.
    def build(self, in_features: int) -> nn.Sequential:  # type: ignore[override]
        """Deterministic feature network (B, in_features) → (B, width): ``depth`` times
        nn.Linear then the activation (nn.LeakyReLU(slope) or nn.ReLU)."""
        layers: list[nn.Module] = []
        d = int(in_features)
        for _ in range(self.depth):
            act = nn.LeakyReLU(self.slope) if self.activation == "leaky_relu" else nn.ReLU()
            layers += [nn.Linear(d, self.width), act]
            d = self.width
        return nn.Sequential(*layers)

    @property
    def feature_dim(self) -> int:
        return self.width
