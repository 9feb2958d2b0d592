"""The heteroscedastic polynomial: uqbench's own default setup for the P2 benchmark.

P2 does not publish its polynomial, noise model or ranges; these defaults are ours:
    y = Σ_k c_k x^k + ε,   ε ~ N(0, σ(x)²),   σ(x) = noise_base + noise_scale · |x|^noise_power
with x uniform on the training interval, and an out-of-distribution split uniform on the two
flanks [ood_range[0], train_range[0]) ∪ (train_range[1], ood_range[1]].
Default: y = x³ − x, σ(x) = 0.05 + 0.3|x|, train on [−1.5, 1.5], OOD out to ±2.25.

Splits: train, val, test (in distribution) and ood. Inputs and targets are (N, 1) float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from uqbench.contracts import DataInfo, InputBackbone
from uqbench.data.base import DataModule

SPLITS = ("train", "val", "test", "ood")


class PolynomialData(DataModule):
    name = "polynomial"
    task = "regression"
    eval_splits = ("test",)
    ood_splits = ("ood",)

    def __init__(self, name: str = "polynomial",
                 coefficients: Sequence[float] = (0.0, -1.0, 0.0, 1.0),
                 noise_base: float = 0.05, noise_scale: float = 0.3, noise_power: float = 1.0,
                 train_range: tuple[float, float] = (-1.5, 1.5),
                 ood_range: tuple[float, float] = (-2.25, 2.25),
                 n_train: int = 2000, n_val: int = 500, n_test: int = 1000, n_ood: int = 1000,
                 seed: int = 0, batch_size: int = 100, eval_batch_size: int | None = 1000,
                 num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__(batch_size, eval_batch_size, num_workers, pin_memory)
        self.name = name
        self.coefficients = [float(c) for c in coefficients]
        if not self.coefficients:
            raise ValueError("dataset.coefficients is empty; give at least one coefficient")
        lo, hi = (float(v) for v in train_range)
        olo, ohi = (float(v) for v in ood_range)
        if not lo < hi:
            raise ValueError(f"dataset.train_range {list(train_range)} is empty: need lo < hi")
        if not (olo <= lo and hi <= ohi and (olo < lo or hi < ohi)):
            raise ValueError(f"dataset.ood_range {list(ood_range)} must enclose train_range "
                             f"{list(train_range)} and extend past it on at least one side")
        if noise_base < 0 or noise_scale < 0:
            raise ValueError(f"noise must be non-negative: noise_base={noise_base}, "
                             f"noise_scale={noise_scale}")
        if noise_base == 0 and noise_scale == 0:
            raise ValueError("noise_base and noise_scale are both 0: the noise σ(x) must be > 0")
        for key, n in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test),
                       ("n_ood", n_ood)):
            if int(n) < 1:
                raise ValueError(f"dataset.{key} must be >= 1, got {n}")
        self.noise = (float(noise_base), float(noise_scale), float(noise_power))
        self.train_range, self.ood_range = (lo, hi), (olo, ohi)
        self.sizes = {"train": int(n_train), "val": int(n_val), "test": int(n_test),
                      "ood": int(n_ood)}
        self.seed = int(seed)
        self._data: dict[str, TensorDataset] = {}

    # -- the generating process ------------------------------------------------------------
    def trend(self, x: torch.Tensor) -> torch.Tensor:
        terms = [c * x ** k for k, c in enumerate(self.coefficients)]
        return cast(torch.Tensor, sum(terms))  # a tensor: one term at least (checked above)

    def noise_std(self, x: torch.Tensor) -> torch.Tensor:
        base, scale, power = self.noise
        return base + scale * x.abs() ** power

    def _inputs(self, split: str, n: int, gen: torch.Generator) -> torch.Tensor:
        lo, hi = self.train_range
        if split != "ood":
            return lo + (hi - lo) * torch.rand(n, 1, generator=gen, dtype=torch.float64)
        olo, ohi = self.ood_range
        left, right = lo - olo, ohi - hi  # flank widths; sample a flank by its width
        u = (left + right) * torch.rand(n, 1, generator=gen, dtype=torch.float64)
        return torch.where(u < left, olo + u, hi + (u - left))

    def setup(self, backbone: InputBackbone | None = None) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        for split in SPLITS:
            x = self._inputs(split, self.sizes[split], gen)
            y = self.trend(x) + self.noise_std(x) * torch.randn(x.shape, generator=gen,
                                                                 dtype=torch.float64)
            self._data[split] = TensorDataset(x.float(), y.float())

    def dataset(self, split: str) -> Dataset:
        if not self._data:
            self.setup()
        if split not in self._data:
            raise KeyError(f"split '{split}' is not one of {SPLITS}")
        return self._data[split]

    @property
    def info(self) -> DataInfo:
        return DataInfo(task="regression", in_dim=1, out_dim=1,
                        num_train_batches=self.num_train_batches())

    def settings(self) -> dict[str, Any]:
        base, scale, power = self.noise
        return {"coefficients": self.coefficients, "noise": f"{base} + {scale}|x|^{power}",
                "train_range": list(self.train_range), "ood_range": list(self.ood_range),
                "sizes": self.sizes, "seed": self.seed}

    # -- drawing -----------------------------------------------------------------------------
    def plot_grid(self, n: int = 400) -> torch.Tensor:
        """Dense inputs (n, 1) over the whole OOD range, for figures."""
        olo, ohi = self.ood_range
        pad = 0.05 * (ohi - olo)
        return torch.linspace(olo - pad, ohi + pad, n).unsqueeze(1)

    def reference(self, split: str, x: np.ndarray) -> dict[str, np.ndarray]:
        """The true noise std σ(x) at a split's inputs (N, 1): the task scores how well a
        model's predicted σ recovers it."""
        return {"noise_std": self.noise_std(torch.from_numpy(x).double()).float().numpy()}

    def truth(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """True conditional mean and noise std at x."""
        return self.trend(x), self.noise_std(x)

    def expected_nll(self) -> float:
        """NLL of the true generating density on the training interval, for reference."""
        lo, hi = self.train_range
        x = torch.linspace(lo, hi, 10001, dtype=torch.float64)
        return float((0.5 * torch.log(2 * math.pi * self.noise_std(x) ** 2) + 0.5).mean())
