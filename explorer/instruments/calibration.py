"""Stop-signal calibration: does a stop policy's score predict acceptance, and what would each threshold
have cost?

Over runs (traces: nothing here needs a model), every drafted node the verifier tested and the policy scored is a
point ``(score, accepted, accept_prob)``: the score is the learned decision model's predicted acceptance
(``NodeTrace.predicted_accept``; policies ``decision``, ``prune``, ``specdec++``) or the draft's probability of the
token (``confidence`` and ``none``: q(x)); ``accepted`` is the verifier's decision, ``accept_prob`` the probability
of acceptance given the token (``engine/verify/expectation.py``), a less noisy label for the same event.

* ``reliability``: predicted against realised acceptance in score bins (a calibrated score lies on the diagonal);
* ``roc``: the ROC curve of the score as a classifier of acceptance, its area, and the operating point of a
  threshold;
* ``threshold_costs``: per threshold, the draft levels, drafted tokens and committed tokens of the recorded steps
  had the policy used that threshold (``stopping.what_if``; exact under greedy verification, a bound otherwise).
"""

from __future__ import annotations

from ..engine.policies.stopping import LEARNED_POLICIES, score_threshold, what_if
from ..trace.records import ACCEPTED, FREE_SOURCES, REJECTED, RunTrace, StepTrace

THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(21))


def _steps(runs) -> list[StepTrace]:
    return [s for run in runs for s in (run.steps if isinstance(run, RunTrace) else [run])]


def policy_of(runs) -> str:
    """The stop policy the runs recorded (from their first stop signal; ``none`` without any)."""
    for s in _steps(runs):
        if s.stop_signals:
            return s.stop_signals[0].policy
    return "none"


def points(runs) -> list[tuple[float, int, float]]:
    """``(score, accepted 0/1, accept_prob)`` of every tested, scored draft-model node."""
    learned = policy_of(runs) in LEARNED_POLICIES
    out = []
    for s in _steps(runs):
        for n in s.nodes:
            if n.source in FREE_SOURCES or n.source in ("target", "context") or n.status not in (ACCEPTED, REJECTED):
                continue
            score = n.predicted_accept if learned else n.q
            if score is None:
                continue
            soft = n.accept_prob if n.accept_prob is not None else float(n.status == ACCEPTED)
            out.append((float(score), int(n.status == ACCEPTED), float(soft)))
    return out


def reliability(pts, bins: int = 10) -> list[dict]:
    """Per score bin ``[lo, hi)``: nodes, mean score, realised acceptance rate and mean ``accept_prob``."""
    rows = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [p for p in pts if lo <= p[0] < hi or (b == bins - 1 and p[0] == 1.0)]
        if inside:
            rows.append({"lo": lo, "hi": hi, "count": len(inside),
                         "predicted": sum(p[0] for p in inside) / len(inside),
                         "realised": sum(p[1] for p in inside) / len(inside),
                         "realised_soft": sum(p[2] for p in inside) / len(inside)})
    return rows


def roc(pts) -> dict:
    """ROC of the score against the accept decision: ``{"fpr", "tpr", "thresholds", "auc"}`` (``auc`` None when
    one class is missing). Ties in score move both rates at once."""
    pos = sum(p[1] for p in pts)
    neg = len(pts) - pos
    if not pos or not neg:
        return {"fpr": [], "tpr": [], "thresholds": [], "auc": None}
    order = sorted(pts, key=lambda p: -p[0])
    fpr, tpr, thr = [0.0], [0.0], [float("inf")]
    tp = fp = 0
    for i, (score, label, _) in enumerate(order):
        tp += label
        fp += 1 - label
        if i + 1 == len(order) or order[i + 1][0] != score:
            fpr.append(fp / neg)
            tpr.append(tp / pos)
            thr.append(score)
    auc = sum((fpr[i] - fpr[i - 1]) * (tpr[i] + tpr[i - 1]) / 2 for i in range(1, len(fpr)))
    return {"fpr": fpr, "tpr": tpr, "thresholds": thr, "auc": auc}


def operating_point(pts, threshold: float) -> dict:
    """True and false positive rates of "keep drafting when the score reaches ``threshold``" (score scale)."""
    pos = [p for p in pts if p[1]]
    neg = [p for p in pts if not p[1]]
    return {"threshold": threshold,
            "tpr": sum(p[0] >= threshold for p in pos) / len(pos) if pos else None,
            "fpr": sum(p[0] >= threshold for p in neg) / len(neg) if neg else None}


def threshold_costs(runs, thresholds=THRESHOLDS) -> list[dict]:
    """Per threshold (the policy's own setting: tau, or h for ``specdec++``): draft levels (draft forwards),
    drafted tokens and committed tokens over the recorded steps had the policy used it, the share of steps whose
    figures are exact (greedy, or the cut left the committed path alone) and the share where the threshold would
    have drafted deeper than the recording (there the figures are lower bounds: those scores were never
    computed)."""
    steps = [s for s in _steps(runs) if s.stop_signals]
    out = []
    for t in thresholds:
        rows = [what_if(s, t) for s in steps]
        out.append({"threshold": t, "draft_levels": sum(r["draft_levels"] for r in rows),
                    "drafted": sum(r["drafted"] for r in rows), "tokens": sum(r["tokens"] for r in rows),
                    "exact_share": sum(r["exact"] for r in rows) / len(rows) if rows else None,
                    "deeper_share": sum(r["deeper"] for r in rows) / len(rows) if rows else None})
    return out


def calibration_report(runs, bins: int = 10) -> dict:
    """Everything the calibration view shows, as plain data: ``policy``, ``threshold`` (the runs' setting) and
    ``score_threshold``, ``points``, ``brier`` (mean squared error of the score against the decision),
    ``reliability``, ``roc`` (with ``auc``), ``operating_point`` and ``threshold_costs``."""
    runs = list(runs)
    policy = policy_of(runs)
    setting = None
    for run in runs:
        if isinstance(run, RunTrace):
            setting = run.settings.get("method", {}).get("threshold")
            break
    pts = points(runs)
    at = score_threshold(policy, setting) if setting is not None else None
    return {"policy": policy, "threshold": setting, "score_threshold": at, "points": len(pts),
            "accepted": sum(p[1] for p in pts),
            "brier": sum((p[0] - p[1]) ** 2 for p in pts) / len(pts) if pts else None,
            "reliability": reliability(pts, bins), "roc": roc(pts),
            # goodput's threshold differs per level: no single operating point
            "operating_point": operating_point(pts, at) if at is not None and policy != "goodput" else None,
            "threshold_costs": threshold_costs(runs)}
