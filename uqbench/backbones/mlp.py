"""A small multilayer perceptron, the backbone of the regression benchmarks.

The spec (depth, width, activation) is shared by every method: the deterministic methods build
it with :meth:`MLP.build`, the variational BNN builds its Bayesian twin from the same fields.
"""

from __future__ import annotations

from torch import nn

ACTIVATIONS = ("leaky_relu", "relu")


class MLP:
    """``depth`` hidden layers of ``width`` units with a (leaky-)ReLU between layers."""

    targets: tuple[str, ...] = ()  # no pretrained linear layers for adapter methods

    def __init__(self, name: str = "mlp", width: int = 16, depth: int = 1,
                 activation: str = "leaky_relu", slope: float = 0.1) -> None:
        if int(width) < 1:
            raise ValueError(f"backbone.width must be a positive integer, got {width}")
        if int(depth) < 1:
            raise ValueError(f"backbone.depth must be a positive integer, got {depth}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"backbone.activation '{activation}' is not one of {ACTIVATIONS}")
        if activation == "leaky_relu" and not 0 <= slope < 1:
            raise ValueError(f"backbone.slope must lie in [0, 1), got {slope}")
        self.name = name
        self.width, self.depth = int(width), int(depth)
        self.activation = activation
        self.slope = float(slope) if activation == "leaky_relu" else 0.0

    @property
    def hidden(self) -> list[int]:
        return [self.width] * self.depth

    def build(self, in_dim: int, out_dim: int) -> nn.Sequential:
        """Deterministic network (B, in_dim) → (B, out_dim)."""
        layers: list[nn.Module] = []
        d = in_dim
        for h in self.hidden:
            layers += [nn.Linear(d, h), nn.LeakyReLU(self.slope)]
            d = h
        layers.append(nn.Linear(d, out_dim))
        return nn.Sequential(*layers)
