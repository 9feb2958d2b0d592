"""Regression: Gaussian predictive distributions, their metrics and the run's figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from uqbench.contracts import one_of, to_device
from uqbench.metrics import conformal as CP
from uqbench.metrics import noise_recovery, regression_metrics
from uqbench.tasks.base import Predictions, Task
from uqbench.tasks.classification import check_alpha


class RegressionTask(Task):
    """Metrics of a Gaussian predictive distribution (mean and total variance per output).

    conformal_alpha: split-conformal intervals fitted on the validation split, for a coverage
    of 1 − α (null: none); conformal_score: normalized (|y − μ|/σ: μ ± q·σ) | absolute
    (|y − μ|: μ ± q). Every output coordinate of every example is one score.
    """

    name = "regression"
    # the noise_std_* metrics only on data that knows its true noise (synthetic sets)
    METRICS = {"nll": "minimize", "rmse": "minimize", "coverage_1sigma": None,
               "coverage_2sigma": None, "mean_std": None, "noise_std_ratio": None,
               "noise_std_error": "minimize"}

    def __init__(self, conformal_alpha: float | None = 0.1,
                 conformal_score: CP.RegressionScore = "normalized") -> None:
        self.conformal_alpha = check_alpha(conformal_alpha)
        self.conformal_score = one_of("task.conformal_score", conformal_score,
                                      CP.RegressionScore)

    def calibrate(self, val_preds: Predictions) -> dict[str, float] | None:
        """The conformal quantile of the validation scores (``conformal_<score>``), or None
        without conformal intervals."""
        if self.conformal_alpha is None:
            return None
        t = self._flat(val_preds)
        scores = CP.regression_scores(t["y"], t["mean"], t["var"], self.conformal_score)
        return {"conformal_alpha": self.conformal_alpha,
                f"conformal_{self.conformal_score}": CP.conformal_quantile(
                    scores, self.conformal_alpha)}

    @staticmethod
    def _flat(preds: Predictions) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(preds[k]).double().flatten() for k in ("y", "mean", "var")}

    @torch.no_grad()
    def predict(self, method: torch.nn.Module, loader: DataLoader,
                device: torch.device) -> Predictions:
        """Arrays of shape (N, d): x, y, mean, var (total) and var_aleatoric where separated."""
        method.eval()
        parts: dict[str, list[torch.Tensor]] = {}
        for x, y in loader:
            out = method(to_device(x, device))
            cols = {"x": x, "y": y, "mean": out.mean, "var": out.var}
            if out.var_aleatoric is not None:
                cols["var_aleatoric"] = out.var_aleatoric
            for k, v in cols.items():
                parts.setdefault(k, []).append(v.detach().float().cpu())
        return {k: torch.cat(v).numpy() for k, v in parts.items()}

    def metrics(self, split: str, preds: Predictions,
                calibration: dict[str, float] | None = None) -> dict[str, float]:
        t = {k: torch.from_numpy(preds[k]).double() for k in ("y", "mean", "var")}
        values = regression_metrics(t["y"], t["mean"], t["var"])
        if "noise_std" in preds:  # the data knows its true noise: score its recovery
            values |= noise_recovery(t["var"].sqrt(), torch.from_numpy(preds["noise_std"]).double())
        qhat = (calibration or {}).get(f"conformal_{self.conformal_score}")
        if qhat is not None and split != "val":  # fitted on val: scored on the other splits
            f = self._flat(preds)
            values |= {f"cp/{k}": v for k, v in CP.interval_metrics(
                f["y"], f["mean"], f["var"], qhat, self.conformal_score).items()}
        return {f"{split}/{k}": v for k, v in values.items()}

    def ood_metrics(self, split: str, id_preds: Predictions, ood_preds: Predictions,
                    calibration: dict[str, float] | None = None) -> dict[str, float]:
        return self.metrics(split, ood_preds, calibration)

    def val_loss(self, preds: Predictions) -> float:
        return self.metrics("val", preds)["val/nll"]

    @torch.no_grad()
    def plot(self, path: Path, method: torch.nn.Module, data, device: torch.device,
             title: str = "") -> Path | None:
        """Data, predictive mean and ±2σ band over a range covering the OOD flanks."""
        if not hasattr(data, "plot_grid"):
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        method.eval()
        grid = data.plot_grid()
        out = method(grid.to(device))
        x = grid[:, 0].numpy()
        mean, std = out.mean[:, 0].cpu().numpy(), out.var[:, 0].sqrt().cpu().numpy()
        true_mean, true_std = (t[:, 0].numpy() for t in data.truth(grid))
        fig, ax = plt.subplots(figsize=(7, 4.2))
        train = data.dataset("train").tensors
        ax.scatter(train[0][:, 0], train[1][:, 0], s=3, c="0.6", alpha=0.5, label="train")
        ood = data.dataset("ood").tensors
        ax.scatter(ood[0][:, 0], ood[1][:, 0], s=3, c="tab:red", alpha=0.35, label="ood")
        ax.plot(x, true_mean, "k--", lw=1, label="true mean")
        ax.fill_between(x, true_mean - 2 * true_std, true_mean + 2 * true_std, color="k",
                        alpha=0.07, label="true ±2σ")
        ax.plot(x, mean, c="tab:blue", lw=1.5, label="predictive mean")
        ax.fill_between(x, mean - 2 * std, mean + 2 * std, color="tab:blue", alpha=0.25,
                        label="predictive ±2σ")
        if out.var_aleatoric is not None:
            ale = out.var_aleatoric[:, 0].sqrt().cpu().numpy()
            ax.plot(x, mean + 2 * ale, c="tab:orange", lw=0.8, label="aleatoric ±2σ")
            ax.plot(x, mean - 2 * ale, c="tab:orange", lw=0.8)
        lo, hi = data.train_range
        ax.axvspan(lo, hi, color="tab:green", alpha=0.05, label="train range")
        span = np.nanmax(np.abs(true_mean)) + 4 * np.nanmax(true_std)
        ax.set_ylim(-span, span)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
