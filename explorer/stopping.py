"""Stop policies: after each draft level, decide whether drafting goes on.

A policy sees the newest level of the tree with one score per node and returns a ``StopSignal`` (plain data, kept
in the step trace). Scores are grouped per branch (the anchor's child a node descends from) and the branch score is
the best of its frontier nodes.

* ``none``: static depth, never stops early (MCSD baseline).
* ``confidence``: the draft's probability of each newest token; keep drafting while any branch's score reaches the
  threshold. This is the seed paper's rule "keep drafting while any branch's score > tau" with the draft's own
  confidence as the score (Hugging Face assisted generation stops a chain the same way, threshold 0.4); the
  learned decision models plug in here as other scores.
"""

from __future__ import annotations

from .trace import StopSignal
from .tree import DraftTree


class StopPolicy:
    """Interface: ``signal(tree, level, node_scores)`` -> StopSignal with ``keep_drafting``."""

    name = "base"

    def __init__(self, threshold: float = 0.0):
        if not (0.0 <= threshold <= 1.0):
            raise ValueError(f"stop threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    def keep(self, score: float) -> bool:
        raise NotImplementedError

    def signal(self, tree: DraftTree, level: int, node_scores: dict[int, float]) -> StopSignal:
        """``node_scores``: tree index -> score for the nodes of ``level`` (1-based)."""
        per_branch: dict[str, float] = {}
        for i in tree.level(level):
            b = str(tree.branch_of(i))
            per_branch[b] = max(per_branch.get(b, 0.0), float(node_scores.get(i, 0.0)))
        score = max(per_branch.values(), default=0.0)
        return StopSignal(level=level, scores=per_branch, score=score, threshold=self.threshold,
                          keep_drafting=self.keep(score), policy=self.name)


class NoStop(StopPolicy):
    name = "none"

    def keep(self, score: float) -> bool:
        return True


class ConfidenceStop(StopPolicy):
    name = "confidence"

    def keep(self, score: float) -> bool:
        return score >= self.threshold


STOP_POLICIES = {"none": NoStop, "confidence": ConfidenceStop}


def make_stop_policy(name: str, threshold: float) -> StopPolicy:
    try:
        return STOP_POLICIES[name](threshold)
    except KeyError:
        raise ValueError(f"unknown stop policy {name!r}; use one of {sorted(STOP_POLICIES)}") from None
