"""Verifiers: given a draft tree, the target's distributions p and the draft's distributions q, decide which path
is committed and which token follows it.

Inputs (all float32 on one device):

* ``p_rows``: indexable by row (a ``(N + 1, vocab)`` tensor or a lazy ``sampling.RowDists``); row 0 is the
  target's processed distribution at the anchor (for the anchor's children), row ``i + 1`` at tree node ``i``.
* ``q_rows``: ``{row: (vocab,)}``: the draft's processed distribution each node's children were drafted from
  (sampling only; greedy verification does not read q).

Rules implemented (GUIDE.md section 1):

* ``greedy``: accept the child equal to ``argmax p``; the bonus token is ``argmax p`` at the end of the path.
* ``rrs`` / ``rrs-replacement``: recursive rejection sampling. For each child x in draft order accept with
  probability ``min(1, p(x)/q(x))``; on rejection ``p <- norm(max(p - q, 0))`` and, *without replacement* (MCSD,
  Yang et al. 2024), ``q[x] <- 0, q <- norm(q)``; *with replacement* (SpecInfer, Miao et al. 2024) q stays.
  When every child fails the token is drawn from the current (residual) p. Lossless.
* ``longest-branch``: the seed paper's rule (Lu et al. 2024): each target-sampled root's branch is walked on its
  own and the branch with the most accepted draft tokens is committed. **Lossy.**
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .drafting import sample_one
from .tree import DraftTree

RESIDUAL_TOP = 5


@dataclass
class NodeDecision:
    """Why a node was accepted or rejected. ``u`` is None for greedy; ``residual_top`` after a rejection:
    ``[(token_id, prob), ...]`` of the distribution that the next sibling (or the replacement token) faces."""

    accepted: bool
    ratio: float
    u: float | None = None
    residual_top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        path: tree indices of the committed nodes, root first (for lossy rules the target-sampled root included).
        bonus: the token drawn after the path (from p, or the residual after a rejection); None for the lossy rule,
            which instead hands ``next_dist`` (``(vocab,)``) to the next step's roots.
        decisions: per verified node.
        branch_accepted: per branch (index among the anchor's children) the accepted draft tokens in that branch.
        chosen_branch: the branch the committed path runs through, or None when no child was accepted.
    """

    path: list[int]
    bonus: int | None
    decisions: dict[int, NodeDecision]
    branch_accepted: dict[int, int]
    chosen_branch: int | None
    next_dist: torch.Tensor | None = None
    next_row: int | None = None  # p row whose raw logits seed the next roots (lossy greedy)


def _normalize(x: torch.Tensor) -> torch.Tensor | None:
    s = x.sum()
    return x / s if s > 0 else None


def _top(dist: torch.Tensor, k: int = RESIDUAL_TOP) -> list[tuple[int, float]]:
    v, i = torch.topk(dist, k)
    return [(int(t), float(p)) for t, p in zip(i.tolist(), v.tolist()) if p > 0]


def _walk_greedy(tree: DraftTree, p_rows: torch.Tensor, start: int, decisions: dict) -> tuple[list[int], int]:
    """Follow children equal to argmax p from node ``start`` (-1 = anchor). Returns (path below start, last row)."""
    path, node = [], start
    while True:
        best = int(p_rows[node + 1].argmax())
        nxt = None
        for c in tree.children(node):
            ok = tree.token[c] == best
            decisions[c] = NodeDecision(accepted=ok, ratio=1.0 if ok else 0.0)
            if ok:
                nxt = c
                break
        if nxt is None:
            return path, node + 1
        path.append(nxt)
        node = nxt


def _walk_rrs(tree: DraftTree, p_rows: torch.Tensor, q_rows: torch.Tensor, start: int, replacement: bool,
              generator: torch.Generator, decisions: dict) -> tuple[list[int], torch.Tensor]:
    """Recursive rejection sampling down from ``start``. Returns (path below start, distribution for the next token)."""
    path, node = [], start
    while True:
        p = p_rows[node + 1]
        kids = tree.children(node)
        q = q_rows[node + 1] if kids else None
        nxt = None
        for c in kids:
            x = tree.token[c]
            px, qx = float(p[x]), float(q[x])
            ratio = px / qx if qx > 0 else (float("inf") if px > 0 else 0.0)
            u = float(torch.rand((), generator=generator, device=p.device))
            if u <= ratio:
                decisions[c] = NodeDecision(accepted=True, ratio=ratio, u=u)
                nxt = c
                break
            residual = _normalize((p - q).clamp_(min=0))
            if residual is not None:  # None only when p == q numerically: then rejection had probability 0
                p = residual
            if not replacement:
                q = q.clone()
                q[x] = 0
                q = _normalize(q)
                if q is None:
                    q = torch.zeros_like(p)
            decisions[c] = NodeDecision(accepted=False, ratio=ratio, u=u, residual_top=_top(p))
        if nxt is None:
            return path, p
        path.append(nxt)
        node = nxt


def _branch_counts(tree: DraftTree, path: list[int]) -> dict[int, int]:
    counts = {b: 0 for b in range(len(tree.children(-1)))}
    drafted = [i for i in path if tree.source[i] == "draft"]
    if path:
        counts[tree.branch_of(path[0])] = len(drafted)
    return counts


def verify_greedy(tree: DraftTree, p_rows: torch.Tensor, q_rows=None, generator=None, **_) -> VerifyResult:
    decisions: dict[int, NodeDecision] = {}
    path, last_row = _walk_greedy(tree, p_rows, -1, decisions)
    bonus = int(p_rows[last_row].argmax())
    return VerifyResult(path, bonus, decisions, _branch_counts(tree, path),
                        tree.branch_of(path[0]) if path else None)


def verify_rrs(tree: DraftTree, p_rows: torch.Tensor, q_rows: torch.Tensor, generator: torch.Generator,
               replacement: bool = False, **_) -> VerifyResult:
    decisions: dict[int, NodeDecision] = {}
    path, dist = _walk_rrs(tree, p_rows, q_rows, -1, replacement, generator, decisions)
    bonus = sample_one(dist, generator)
    return VerifyResult(path, bonus, decisions, _branch_counts(tree, path),
                        tree.branch_of(path[0]) if path else None)


def verify_longest_branch(tree: DraftTree, p_rows: torch.Tensor, q_rows: torch.Tensor, generator: torch.Generator,
                          greedy: bool = False, replacement: bool = False, **_) -> VerifyResult:
    """The seed's rule (lossy): walk every root's subtree on its own, commit the root with the longest accepted
    draft continuation (ties: the first root). The next step's roots are drawn from the residual at the failure
    point of that branch (or from p after its last node)."""
    decisions: dict[int, NodeDecision] = {}
    best = None
    counts: dict[int, int] = {}
    for b, root in enumerate(tree.children(-1)):
        if greedy:
            below, row = _walk_greedy(tree, p_rows, root, decisions)
            dist = p_rows[row]
        else:
            below, dist = _walk_rrs(tree, p_rows, q_rows, root, replacement, generator, decisions)
            row = (below[-1] if below else root) + 1
        counts[b] = len(below)
        if best is None or len(below) > len(best[1]):
            best = (root, below, dist, row, b)
    assert best is not None, "the lossy rule needs at least one root"
    root, below, dist, row, b = best
    return VerifyResult([root] + below, None, decisions, counts, b, next_dist=dist, next_row=row)


VERIFIERS = {
    "greedy": verify_greedy,
    "rrs": verify_rrs,
    "rrs-replacement": lambda *a, **k: verify_rrs(*a, **{**k, "replacement": True}),
    "longest-branch": verify_longest_branch,
}
LOSSY_VERIFIERS = {"longest-branch"}
