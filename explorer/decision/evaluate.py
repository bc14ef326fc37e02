"""How good a decision model is: ROC-AUC, precision and recall at its threshold, calibration.

Labels: a drafted token's acceptance is a random event with probability ``soft = min(1, p/q)`` (one draft at a
node, Leviathan et al. 2023). Soft metrics count each token as accepted with weight ``soft`` and rejected with
weight ``1 - soft``, i.e. the expected value of the metric over the verifier's coin flips; the ``_greedy``
metrics use the greedy label (token == argmax p), the acceptance event of greedy decoding.
Metrics come from scikit-learn (weighted ``roc_auc_score``, ``roc_curve``, ``precision_score``, ``recall_score``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

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


def evaluate_on(model_dir: str | Path, folders: list[str | Path]) -> dict:
    """Every model of ``model_dir`` on the data in ``folders``, leaving out prompts the models were trained or
    validated on (listed in their card): ``{"models": {kind: score_metrics}, "by_kind": {prompt kind: {"records",
    model kind: roc_auc}}, ...}``. Raises DataError / DecisionModelError for unusable inputs."""
    from .collect import DataError, load_data
    from .model import load_decision_model, read_card
    from .train import kind_inputs

    card = read_card(model_dir)
    meta, t, owners = load_data(folders)
    if meta["pair"].get("draft_id") != card.get("pair", {}).get("draft_id"):
        raise DataError(f"the data was collected with draft {meta['pair'].get('draft_id')}, the model was trained "
                        f"for {card.get('pair', {}).get('draft_id')}")
    seen = set(card.get("data", {}).get("train_prompts", [])) | set(card.get("data", {}).get("val_prompts", []))
    rows = np.array([o not in seen for o in owners])
    if not rows.any():
        raise DataError("every prompt of this data was used to train the model: evaluate on other prompts")
    prompts = sorted({o for o, r in zip(owners, rows) if r})
    report = {"model": str(model_dir), "data": [str(f) for f in folders], "prompts": len(prompts),
              "excluded_prompts": len({o for o in owners if o in seen}), "models": {}}
    idx = np.flatnonzero(rows)
    kind_of = meta["prompt_kinds"]
    prompt_kinds = np.array([kind_of.get(owners[i], "other") for i in idx])
    report["by_kind"] = {}
    for kind in card["models"]:
        model = load_decision_model(model_dir, kind)
        pred = model.predict(**{kind: kind_inputs(kind, t)[idx]}).numpy()
        soft, greedy = t["soft"][idx].numpy(), t["greedy"][idx].numpy()
        threshold = model.threshold if model.threshold is not None else 0.5
        report["models"][kind] = score_metrics(pred, soft, greedy, threshold)
        for pk in sorted(set(prompt_kinds)):  # per prompt kind, where both outcomes occur
            sel = prompt_kinds == pk
            if 0 < soft[sel].sum() < sel.sum():
                m = score_metrics(pred[sel], soft[sel], greedy[sel], threshold)
                report["by_kind"].setdefault(pk, {"records": int(sel.sum())})[kind] = m["roc_auc"]
    return report


def evaluate(args, load_pair) -> dict:
    """``decision eval``: collect features on ``args.prompt_file`` (or read ``args.data``) and score the models."""
    from ..prompts import range_spec, select_prompts
    from .collect import collect
    from .model import DecisionModelError, find_shipped

    if args.data:
        folders = args.data
        model_dir = args.model
        if model_dir is None:
            raise DecisionModelError("with --data, name the decision-model folder with --model")
        return evaluate_on(model_dir, folders)
    pair = load_pair()
    model_dir = args.model or find_shipped(pair.draft_id, pair.target_id)
    if model_dir is None:
        raise DecisionModelError(f"no decision model ships for {pair.name}: pass --model")
    prompts = select_prompts([range_spec(args.prompt_file, args.range)])
    temps = tuple(float(x) for x in args.temperatures.split(","))
    with tempfile.TemporaryDirectory(prefix="decision-eval-") as tmp:
        out = Path(args.keep_data) if args.keep_data else Path(tmp)
        collect(pair, prompts, out, max_new_tokens=args.max_new_tokens, temperatures=temps,
                chat_template=not args.no_chat_template, progress=not args.quiet)
        return evaluate_on(model_dir, [out])
