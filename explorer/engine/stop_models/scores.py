"""Scores of a decision model's predictions: ROC-AUC, precision and recall at a threshold, calibration, and the
threshold that best separates accepted from rejected tokens (pure functions of arrays; no models, no data files).

Labels: a drafted token's acceptance is a random event with probability ``soft = min(1, p/q)`` (one draft at a
node, Leviathan et al. 2023). Soft metrics count each token as accepted with weight ``soft`` and rejected with
weight ``1 - soft``, i.e. the expected value of the metric over the verifier's coin flips; the ``_greedy``
metrics use the greedy label (token == argmax p), the acceptance event of greedy decoding.
Metrics come from scikit-learn (weighted ``roc_auc_score``, ``roc_curve``, ``precision_score``, ``recall_score``).
"""

from __future__ import annotations

import numpy as np

N_BINS = 10


def _doubled(pred: np.ndarray, soft: np.ndarray):
    """Each token twice: label 1 with weight soft, label 0 with weight 1 - soft."""
    y = np.concatenate([np.ones_like(soft), np.zeros_like(soft)])
    return np.concatenate([pred, pred]), y, np.concatenate([soft, 1.0 - soft])


def choose_threshold(pred: np.ndarray, soft: np.ndarray, fnr_cost: float = 1.0) -> float:
    """The threshold minimising ``fpr + fnr_cost * fnr`` on soft labels; with ``fnr_cost`` 1 (default) that is the
    largest Youden's J (TPR - FPR): the score that best separates tokens the target accepts from those it rejects.
    Returned in [0, 1]."""
    # here, not at the top: scikit-learn takes about 2 s to import; runs and the CLI's start need none of it
    from sklearn.metrics import roc_curve

    s, y, w = _doubled(pred, soft)
    fpr, tpr, thr = roc_curve(y, s, sample_weight=w)
    best = int(np.argmin(fpr - fnr_cost * tpr))  # fpr + c * (1 - tpr) less its constant: exact Youden at c = 1
    return float(np.clip(thr[best], 0.0, 1.0))


def score_metrics(pred, soft, greedy, threshold: float) -> dict:
    """Metrics of predictions ``pred`` (n,) against soft labels ``soft`` (n,) and greedy labels ``greedy`` (n,).

    Returns a dict: records, bce (mean binary cross-entropy on soft labels, nats), roc_auc, roc_auc_greedy,
    threshold, precision / recall (soft) and precision_greedy / recall_greedy of "predicted >= threshold",
    ece (expected calibration error against the soft label, 10 equal-width bins) and the bins themselves.
    """
    # here, not at the top: scikit-learn takes about 2 s to import; runs and the CLI's start need none of it
    from sklearn.metrics import precision_score, recall_score, roc_auc_score

    pred = np.asarray(pred, dtype=np.float64)
    soft = np.asarray(soft, dtype=np.float64)
    greedy = np.asarray(greedy, dtype=np.int64)
    eps = 1e-7
    clipped = np.clip(pred, eps, 1 - eps)
    bce = float(-np.mean(soft * np.log(clipped) + (1 - soft) * np.log(1 - clipped)))
    s, y, w = _doubled(pred, soft)
    keep = (s >= threshold).astype(np.int64)
    has_both = 0 < greedy.sum() < len(greedy)
    bins = []
    edges = np.linspace(0.0, 1.0, N_BINS + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (pred >= lo) & ((pred < hi) if hi < 1.0 else (pred <= hi))
        if inside.any():
            mp, ms = float(pred[inside].mean()), float(soft[inside].mean())
            ece += inside.mean() * abs(mp - ms)
            bins.append({"lo": float(lo), "hi": float(hi), "n": int(inside.sum()), "mean_pred": mp, "mean_soft": ms})
    return {
        "records": len(pred),
        "bce": bce,
        "roc_auc": float(roc_auc_score(y, s, sample_weight=w)),
        "roc_auc_greedy": float(roc_auc_score(greedy, pred)) if has_both else None,
        "threshold": float(threshold),
        "precision": float(precision_score(y, keep, sample_weight=w, zero_division=0)),
        "recall": float(recall_score(y, keep, sample_weight=w, zero_division=0)),
        "precision_greedy": float(precision_score(greedy, pred >= threshold, zero_division=0)),
        "recall_greedy": float(recall_score(greedy, pred >= threshold, zero_division=0)),
        "mean_pred": float(pred.mean()),
        "mean_soft": float(soft.mean()),
        "accept_rate_greedy": float(greedy.mean()),
        "ece": float(ece),
        "calibration": bins,
    }
