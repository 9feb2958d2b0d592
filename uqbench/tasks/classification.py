"""Classification: member probabilities, the ensemble's metrics and OOD detection.

Every classification method returns member logits of shape (M, B, C); the task softmaxes them,
keeps the per-member probabilities (so that any aggregation and the mutual information can be
recomputed from ``predictions/<split>.npz``) and computes the metrics defined in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader

from uqbench import metrics as M
from uqbench.contracts import one_of, to_device
from uqbench.metrics import conformal as CP
from uqbench.tasks.base import Predictions, Task

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def join_members(parts: list[Predictions]) -> Predictions:
    """The predictions of separately predicted members as one ensemble's: member_probs joined
    in member order, the mean logits averaged with each part's member count as weight (kept
    only where every part has them), everything else (labels) from the first part."""
    counts = [len(p["member_probs"]) for p in parts]
    joined = dict(parts[0]) | {"member_probs": np.concatenate([p["member_probs"] for p in parts])}
    if all("mean_logits" in p for p in parts):
        weighted = np.stack([n * p["mean_logits"].astype(np.float64)
                             for n, p in zip(counts, parts, strict=True)])
        joined["mean_logits"] = (weighted.sum(0) / sum(counts)).astype(np.float32)
    else:
        joined.pop("mean_logits", None)
    return joined


def check_alpha(alpha: float | None) -> float | None:
    """task.conformal_alpha: a miscoverage level in (0, 1), or None (no conformal sets)."""
    if alpha is None:
        return None
    if not 0 < float(alpha) < 1:
        raise ValueError(f"task.conformal_alpha must be in (0, 1) (0.1: sets that cover 90 % "
                         f"of labels) or null (none), got {alpha}")
    return float(alpha)


class ClassificationTask(Task):
    """Metrics of an M-member predictive distribution.

    ece_bins: equal-width ECE bins (15 default, 10 as in LoRA-Ensemble).
    aggregation: mean_probs (the mixture, default) | mean_logits (softmax of mean logits).
    conformal_alpha: split-conformal prediction sets fitted on the validation split, for a
    coverage of 1 − α (null: none); conformal: their scores (thr, aps, raps).
    """

    name = "classification"
    METRICS = {"acc": "maximize", "nll": "minimize", "brier": "minimize", "ece": "minimize",
               "ece_adaptive": "minimize", "ece_classwise": "minimize", "aurc": "minimize",
               "risk_cov80": "minimize", "risk_cov90": "minimize"}

    def __init__(self, ece_bins: int = 15, aggregation: M.Aggregation = "mean_probs",
                 conformal_alpha: float | None = 0.1,
                 conformal: Sequence[CP.ClassScore] = ("thr", "aps")) -> None:
        if int(ece_bins) < 1:
            raise ValueError(f"task.ece_bins must be a positive integer (15 or 10 are usual), "
                             f"got {ece_bins}")
        self.ece_bins = int(ece_bins)
        self.aggregation = one_of("task.aggregation", aggregation, M.Aggregation)
        self.conformal_alpha = check_alpha(conformal_alpha)
        self.conformal = tuple(one_of("task.conformal", str(c), CP.ClassScore)
                               for c in conformal or ())

    @torch.no_grad()
    def predict(self, method: torch.nn.Module, loader: DataLoader,
                device: torch.device) -> Predictions:
        """member_probs (M, N, C) float32, the members' mean logits (N, C) float32 (the
        energy and max-logit scores; probabilities lose each member's logit offset) and
        labels (N,) int64 over the whole loader."""
        method.eval()
        probs, mean_logits, labels = [], [], []
        for inputs, y in loader:
            logits = method(to_device(inputs, device)).float()                # (M, B, C)
            probs.append(torch.softmax(logits, dim=-1).cpu())
            mean_logits.append(logits.mean(0).cpu())
            labels.append(y.cpu())
        return {"member_probs": torch.cat(probs, dim=1).numpy().astype(np.float32),
                "mean_logits": torch.cat(mean_logits).numpy().astype(np.float32),
                "labels": torch.cat(labels).numpy().astype(np.int64)}

    @staticmethod
    def _tensors(preds: Predictions) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(preds["member_probs"]), torch.from_numpy(preds["labels"])

    def calibrate(self, val_preds: Predictions) -> dict[str, float]:
        """Post-hoc temperature scaling: the T minimising the validation NLL (LBFGS); and the
        conformal quantile of each conformal score on the validation split
        (``conformal_<score>``, with ``conformal_alpha``)."""
        member_probs, y = self._tensors(val_preds)
        fitted = {"temperature": M.fit_temperature(member_probs, y, self.aggregation)}
        if self.conformal_alpha is not None and self.conformal:
            probs = M.aggregate(member_probs, self.aggregation)
            fitted["conformal_alpha"] = self.conformal_alpha
            for method in self.conformal:
                scores = CP.class_scores(probs, y, method)
                fitted[f"conformal_{method}"] = CP.conformal_quantile(scores,
                                                                      self.conformal_alpha)
        return fitted

    def metrics(self, split: str, preds: Predictions,
                calibration: dict[str, float] | None = None) -> dict[str, float]:
        """``{split}/acc``, ``/nll``, ``/brier``, ``/ece`` (fractions); with a calibration, the
        same of the temperature-scaled predictions under ``{split}/ts/``."""
        member_probs, y = self._tensors(preds)
        out: dict[str, float] = {}
        for prefix, probs in self._variants(split, member_probs, calibration):
            values = M.classification_metrics(probs, y, self.ece_bins, self.aggregation)
            out |= {f"{prefix}/{k}": v for k, v in values.items()}
        if calibration and split != "val":  # the sets are fitted on val: scored elsewhere
            probs = M.aggregate(member_probs, self.aggregation)
            for method in self.conformal:
                if f"conformal_{method}" in calibration:
                    values = CP.set_metrics(probs, y, calibration[f"conformal_{method}"], method)
                    out |= {f"{split}/cp_{method}/{k}": v for k, v in values.items()}
        return out

    def ood_metrics(self, split: str, id_preds: Predictions, ood_preds: Predictions,
                    calibration: dict[str, float] | None = None) -> dict[str, float]:
        """Detection of ``split`` (OOD) against the in-distribution test predictions.

        Keys ``{split}/auroc_<score>``, ``{split}/aupr_in_<score>``, ``{split}/aupr_out_<score>``
        for the scores msp, entropy and mi (each oriented so that higher = more OOD), and the
        same under ``{split}/ts/`` with a calibration. AUROC and AUPR-Out take OOD as the
        positive class, AUPR-In the in-distribution samples.
        """
        if "member_probs" not in id_preds:
            raise ValueError(f"OOD split '{split}' needs the in-distribution 'test' split's "
                             f"predictions; the dataset must list 'test' in eval_splits")
        id_variants = self._variants(split, self._tensors(id_preds)[0], calibration)
        ood_variants = self._variants(split, self._tensors(ood_preds)[0], calibration)
        logits = "mean_logits" in id_preds and "mean_logits" in ood_preds
        out: dict[str, float] = {}
        for (prefix, id_probs), (_, ood_probs) in zip(id_variants, ood_variants, strict=True):
            id_scores = M.ood_scores(id_probs, self.aggregation)
            ood_scores = M.ood_scores(ood_probs, self.aggregation)
            if logits:
                t = calibration["temperature"] if prefix.endswith("/ts") and calibration else 1.0
                id_scores |= M.logit_scores(torch.from_numpy(id_preds["mean_logits"]), t)
                ood_scores |= M.logit_scores(torch.from_numpy(ood_preds["mean_logits"]), t)
            for score in id_scores:
                if score == "mi" and id_probs.shape[0] == 1:
                    continue  # one member: the mutual information is 0 for every input
                for key, value in M.ood_detection(id_scores[score], ood_scores[score]).items():
                    out[f"{prefix}/{key}_{score}"] = value
        return out

    @staticmethod
    def _variants(split: str, member_probs: torch.Tensor,
                  calibration: dict[str, float] | None) -> list[tuple[str, torch.Tensor]]:
        """(key prefix, member probabilities): as predicted, then temperature-scaled."""
        variants = [(split, member_probs)]
        if calibration is not None:
            variants.append((f"{split}/ts", M.temper(member_probs, calibration["temperature"])))
        return variants

    def metric_names(self, split: str) -> list[str]:
        """The metrics as predicted, then those after temperature scaling (``<split>/ts/``)."""
        return [*super().metric_names(split), *super().metric_names(f"{split}/ts")]

    def val_loss(self, preds: Predictions) -> float:
        """Validation NLL of the predictive distribution (model selection)."""
        return self.metrics("val", preds)["val/nll"]

    def figures(self, predictions: dict[str, Predictions], folder: Path,
                ood_splits: tuple[str, ...] | list[str] = ()) -> list[Path]:
        """``reliability.png`` (accuracy against confidence per ECE bin, on the test split)
        and, with OOD splits, ``ood_scores.png`` (each OOD score's histogram on the test split
        against each OOD split). The files written; none without a test split."""
        if "test" not in predictions:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        folder.mkdir(parents=True, exist_ok=True)
        member_probs, y = self._tensors(predictions["test"])
        probs = M.aggregate(member_probs, self.aggregation)
        bins = M.reliability(probs, y, self.ece_bins)
        ece = float(M.ece(probs, y, self.ece_bins))
        edges = np.linspace(0, 1, self.ece_bins + 1)
        fig, ax = plt.subplots(figsize=(4.2, 4.2))
        ax.bar(edges[:-1], np.nan_to_num(bins["accuracy"].numpy()), width=1 / self.ece_bins,
               align="edge", edgecolor="k", lw=0.5, color="tab:blue", label="accuracy")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence (top label)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"test: ECE {100 * ece:.2f} % ({self.ece_bins} bins, "
                     f"N = {len(y)})", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
        written = [self._save(fig, folder / "reliability.png")]
        ood = {s: M.ood_scores(self._tensors(predictions[s])[0], self.aggregation)
               for s in ood_splits if s in predictions}
        if ood:
            id_scores = M.ood_scores(member_probs, self.aggregation)
            fig, axes = plt.subplots(1, len(M.OOD_SCORES), figsize=(4 * len(M.OOD_SCORES), 3.4),
                                     squeeze=False)
            for ax, score in zip(axes[0], M.OOD_SCORES, strict=True):
                ax.hist(id_scores[score].numpy(), bins=30, alpha=0.55, density=True,
                        label="test (in-distribution)")
                aurocs = []
                for split, split_scores in ood.items():
                    scores = split_scores[score]
                    ax.hist(scores.numpy(), bins=30, alpha=0.55, density=True, label=split)
                    auroc = M.ood_detection(id_scores[score], scores)["auroc"]
                    aurocs.append(f"{split} {100 * auroc:.1f}")
                ax.set_title(f"AUROC: {', '.join(aurocs)}", fontsize=9)
                ax.set_xlabel(f"{score} (higher = more OOD)")
                ax.legend(fontsize=7)
            axes[0][0].set_ylabel("density")
            written.append(self._save(fig, folder / "ood_scores.png"))
        return written

    @staticmethod
    def _save(fig: Figure, path: Path) -> Path:
        import matplotlib.pyplot as plt

        fig.tight_layout()
        fig.savefig(path, dpi=100, metadata={"Software": None})
        plt.close(fig)
        return path
