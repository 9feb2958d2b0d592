"""Out-of-distribution detection: per-sample scores of the members' probabilities or mean
logits (higher = more likely OOD) and how well a score separates OOD from in-distribution
samples (AUROC, AUPR, FPR at 95 % TPR)."""

from __future__ import annotations

import math

import torch

from uqbench.metrics.probabilities import Aggregation, aggregate, entropy

OOD_SCORES = ("msp", "entropy", "mi")
# scores of the members' mean logits z̄ (N, C), for methods whose predictions keep them
LOGIT_SCORES = ("energy", "max_logit")


def ood_scores(member_probs: torch.Tensor, aggregation: Aggregation = "mean_probs"
               ) -> dict[str, torch.Tensor]:
    """Per-sample OOD scores (N,), each oriented so that higher means more likely OOD.

    msp: −max_c p̄_c (negative maximum softmax probability), p̄ under ``aggregation``.
    entropy: H(p̄), the predictive entropy, p̄ under ``aggregation``.
    mi: H((1/M) Σ_m p_m) − (1/M) Σ_m H(p_m), the members' mutual information (BALD), always
    on the mixture whatever the aggregation: it is ≥ 0 by the concavity of H, and 0 for a
    single member. (The entropy of the normalised geometric mean minus the mean member
    entropy, its ``mean_logits`` look-alike, is no mutual information and goes negative.)
    """
    mean = aggregate(member_probs, aggregation)
    mixture = mean if aggregation == "mean_probs" else aggregate(member_probs, "mean_probs")
    return {
        "msp": -mean.double().max(-1).values,
        "entropy": entropy(mean),
        "mi": entropy(mixture) - entropy(member_probs).mean(0),
    }


def logit_scores(mean_logits: torch.Tensor, temperature: float = 1.0
                 ) -> dict[str, torch.Tensor]:
    """Per-sample OOD scores (N,) of the members' mean logits z̄ (N, C), higher = more OOD.

    energy: −T·logsumexp(z̄/T), the free energy (Liu et al., 2020); OOD inputs have higher.
    max_logit: −max_c z̄_c (Hendrycks et al., 2022); temperature leaves its order unchanged.
    """
    z = mean_logits.double()
    return {"energy": -temperature * torch.logsumexp(z / temperature, dim=-1),
            "max_logit": -z.max(-1).values}


def fpr_at_tpr(id_score: torch.Tensor, ood_score: torch.Tensor, tpr: float = 0.95) -> float:
    """The share of in-distribution samples flagged as OOD at the highest threshold that still
    flags at least ``tpr`` of the OOD samples (OOD the positive class, score higher = more OOD):
    a sample is flagged when its score is at or above the threshold."""
    ood = torch.sort(ood_score.double(), descending=True).values
    threshold = ood[max(math.ceil(tpr * len(ood) - 1e-9), 1) - 1]
    return float((id_score.double() >= threshold).double().mean())


def ood_detection(id_score: torch.Tensor, ood_score: torch.Tensor) -> dict[str, float]:
    """AUROC and AUPR of separating OOD from in-distribution samples by a score.

    The score must be oriented so that higher = more OOD.
    auroc: OOD is the positive class.
    aupr_in: in-distribution is the positive class, ranked by −score.
    aupr_out: OOD is the positive class, ranked by score.
    AUPR is scikit-learn's average precision (step-wise, no interpolation).
    fpr95: the in-distribution samples flagged at 95 % of the OOD samples detected
    (:func:`fpr_at_tpr`).
    """
    from sklearn.metrics import average_precision_score, roc_auc_score

    score = torch.cat([id_score, ood_score]).double().cpu().numpy()
    is_ood = torch.cat([torch.zeros(len(id_score)), torch.ones(len(ood_score))]).numpy()
    return {
        "auroc": float(roc_auc_score(is_ood, score)),
        "aupr_in": float(average_precision_score(1 - is_ood, -score)),
        "aupr_out": float(average_precision_score(is_ood, score)),
        "fpr95": fpr_at_tpr(id_score, ood_score, 0.95),
    }
