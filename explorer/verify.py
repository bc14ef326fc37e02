"""Verifiers: given a draft tree, the target's distributions p and the draft's distributions q, decide which path
is committed and which token follows it.

Inputs (float32 on one device):

* ``p_rows``: indexable by row (a ``(N + 1, vocab)`` tensor or a lazy ``sampling.RowDists``); row 0 is the
  target's processed distribution at the anchor (for the anchor's children), row ``i + 1`` at tree node ``i``.
* ``q_rows``: ``{row: (vocab,)}``: the draft's processed distribution each node's children were drafted from
  (sampling only; greedy verification does not read q).

A verifier walks down from the anchor. At each node a *node rule* looks at the node's children (in draft order)
and either accepts one of them (the walk descends into it) or returns the distribution the next token must be drawn
from (the bonus token when the walk ends at a leaf: p itself). Node rules (GUIDE.md section 1):

* ``greedy``: accept the child equal to ``argmax p``.
* ``rrs`` (MCSD, Yang et al. 2024, arXiv 2401.06706): recursive rejection sampling *without replacement*; children
  drafted without replacement (``drafting.sample_without_replacement``). For each child x: accept with probability
  ``min(1, p(x)/q(x))``; on rejection ``p <- norm(max(p - q, 0))``, ``q[x] <- 0``, ``q <- norm(q)``.
* ``rrs-replacement`` (SpecInfer, Miao et al. 2024): the same with q left unchanged; children drafted i.i.d.
* ``mcns`` (naive multi-candidate sampling): draw ``y ~ p``; accept the child equal to y, else emit y.
* ``spechub`` (Sun et al. 2024, arXiv 2411.05289): two drafts per node, one of them always the hub token
  ``a = argmax q``; a small transport plan decides (see ``spechub_node``). Nodes with one child use ``rrs``.
* ``longest-branch``: the seed paper's rule (Lu et al. 2024): each target-sampled root's branch is walked on its
  own with ``rrs`` (or ``greedy``) and the branch with the most accepted draft tokens is committed. **Lossy.**

Free children (prompt lookup, Token Recycling: ``methods.FREE_SOURCES``) are deterministic proposals, q a point
mass. After the node rule rejects the draft-model children, each free child faces ``point_stage``: the step of
SpecInfer's multi-step speculative sampling for a proposal of its own (accept x with ``min(1, p'(x) / q_x(x))``,
else ``p' <- norm(max(p' - q_x, 0))``), which for ``q_x = delta_x`` accepts with probability ``p'(x)`` and removes
x from p'. Every stage, given the proposals, leaves the next token distributed as the p' it was handed, so any mix
of model and free children stays lossless.

All but the last are lossless: the committed tokens are distributed exactly as sampling from the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import VERIFIERS
from .drafting import sample_one
from .methods import FREE_SOURCES
from .tree import DraftTree

RESIDUAL_TOP = 5


class VerifierError(ValueError):
    """A verifier cannot serve this tree (e.g. SpecHub with more than two children per node)."""


@dataclass
class NodeDecision:
    """Why a node was accepted or rejected. ``u`` is the uniform draw of its test (None for greedy / MCNS);
    ``ratio`` the acceptance probability's argument (p/q, or its SpecHub analogue); ``residual_top`` after a
    rejection: ``[(token_id, prob), ...]`` of the distribution the next sibling (or the replacement token) faces."""

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
        next_row: p row after the committed path (lossy greedy roots come from its raw logits).
    """

    path: list[int]
    bonus: int | None
    decisions: dict[int, NodeDecision]
    branch_accepted: dict[int, int]
    chosen_branch: int | None
    next_dist: torch.Tensor | None = None
    next_row: int | None = None


def normalize(x: torch.Tensor) -> torch.Tensor | None:
    """``x / x.sum()``, or None when the sum is not positive."""
    s = x.sum()
    return x / s if s > 0 else None


def _top(dist: torch.Tensor, k: int = RESIDUAL_TOP) -> list[tuple[int, float]]:
    v, i = torch.topk(dist, min(k, dist.shape[-1]))
    return [(int(t), float(p)) for t, p in zip(i.tolist(), v.tolist()) if p > 0]


def _uniform(generator: torch.Generator, device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def accept_ratio(px: float, qx: float) -> float:
    """p(x) / q(x) of a draft x: its test accepts with probability ``min(1, ratio)`` (inf when q(x) = 0 < p(x))."""
    return px / qx if qx > 0 else (float("inf") if px > 0 else 0.0)


def without(dist: torch.Tensor, x: int) -> torch.Tensor | None:
    """``dist`` with token x removed and renormalised; None when nothing else had mass."""
    rest = dist.clone()
    rest[x] = 0
    return normalize(rest)


def rrs_rejected(p: torch.Tensor, q: torch.Tensor, x: int, replacement: bool = False) -> tuple:
    """RRS after draft x was rejected: ``p <- norm(max(p - q, 0))`` (kept when that is empty: the rejection had
    probability 0), and without replacement ``q <- q`` without x (zeros when nothing is left). Returns (p, q)."""
    residual = normalize((p - q).clamp(min=0))
    if residual is not None:
        p = residual
    if not replacement:
        q = without(q, x)
        if q is None:
            q = torch.zeros_like(p)
    return p, q


# ------------------------------------------------------------------------------------------------ node rules
# Each returns (index of the accepted child or None, distribution of the next token if none,
# {child index: NodeDecision} for the children it tested).


def greedy_node(tokens, p, q, generator):
    best = int(p.argmax())
    decisions = {}
    for j, x in enumerate(tokens):
        ok = x == best
        decisions[j] = NodeDecision(accepted=ok, ratio=1.0 if ok else 0.0)
        if ok:
            return j, None, decisions
    return None, p, decisions


def rrs_node(tokens, p, q, generator, replacement: bool = False):
    decisions = {}
    for j, x in enumerate(tokens):
        ratio = accept_ratio(float(p[x]), float(q[x]))
        u = _uniform(generator, p.device)
        if u <= ratio:
            decisions[j] = NodeDecision(accepted=True, ratio=ratio, u=u)
            return j, None, decisions
        p, q = rrs_rejected(p, q, x, replacement)
        decisions[j] = NodeDecision(accepted=False, ratio=ratio, u=u, residual_top=_top(p))
    return None, p, decisions


def rrs_replacement_node(tokens, p, q, generator):
    return rrs_node(tokens, p, q, generator, replacement=True)


def mcns_node(tokens, p, q, generator):
    y = sample_one(p, generator)
    decisions = {}
    for j, x in enumerate(tokens):
        ratio = accept_ratio(float(p[x]), float(q[x])) if q is not None else 0.0
        ok = x == y
        decisions[j] = NodeDecision(accepted=ok, ratio=ratio)
        if ok:
            return j, None, decisions
    return None, torch.nn.functional.one_hot(torch.tensor(y, device=p.device), p.shape[-1]).to(p), decisions


def spechub_plan(p: torch.Tensor, q: torch.Tensor) -> dict:
    """The SpecHub transport plan for one node (two drafts, hub ``a = argmax q``).

    Drafting (``drafting.hub_pair``) draws the ordered pair ``(i, a)`` with probability ``q(i)`` and ``(a, i)``
    with ``Q(a, i) = q(a) q(i) / (1 - q(a))``, for every non-hub i. Verification then captures, for each non-hub i,
    ``min(q(i), p(i))`` from pairs ``(i, a)`` (accept i w.p. ``alpha1 = min(1, p/q)``) and from the rest
    ``p1 = max(p - q, 0)`` as much as ``Q(a, i)`` allows (accept i w.p. ``alpha2 = min(1, p1/Q(a, i))``). The hub
    takes the mass left by rejected pairs ``(a, i)`` first (``beta2``) and then ``(i, a)`` (``beta1``), up to
    ``p(a)``. What no pair captured is the residual the replacement token is drawn from; since every pair's
    leftover mass equals the residual's total, the output is distributed exactly as p.
    """
    a = int(q.argmax())
    hub = torch.zeros_like(q, dtype=torch.bool)
    hub[a] = True
    qa = float(q[a])
    alpha1 = torch.where(q > 0, (p / q.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(p))
    p1 = (p - q).clamp(min=0)
    q_ai = q * qa / max(1.0 - qa, 1e-30)
    alpha2 = torch.where(q_ai > 0, (p1 / q_ai.clamp(min=1e-30)).clamp(max=1.0), torch.zeros_like(p))
    p2 = p1 - torch.minimum(q_ai, p1)
    alpha1[hub] = alpha2[hub] = 0.0
    r1 = float((q * (1 - alpha1))[~hub].sum())  # mass of pairs (i, a) whose i was rejected
    r2 = float((q_ai * (1 - alpha2))[~hub].sum())  # mass of pairs (a, i) whose i was rejected
    pa = float(p[a])
    beta2 = min(1.0, pa / r2) if r2 > 0 else 0.0
    pa -= beta2 * r2
    beta1 = min(1.0, pa / r1) if r1 > 0 else 0.0
    pa -= beta1 * r1
    residual = torch.where(hub, torch.zeros_like(p), p2)
    residual[a] = max(pa, 0.0)
    return {"hub": a, "alpha1": alpha1, "alpha2": alpha2, "beta1": beta1, "beta2": beta2, "residual": residual}


def spechub_node(tokens, p, q, generator):
    if len(tokens) == 1:
        return rrs_node(tokens, p, q, generator)
    if len(tokens) != 2:
        raise VerifierError(f"SpecHub verifies two drafts per node; this node has {len(tokens)}")
    plan = spechub_plan(p, q)
    a = plan["hub"]
    if tokens[1] == a:  # pair (i, a)
        order, alpha, beta = [(0, tokens[0]), (1, a)], plan["alpha1"], plan["beta1"]
    elif tokens[0] == a:  # pair (a, i)
        order, alpha, beta = [(1, tokens[1]), (0, a)], plan["alpha2"], plan["beta2"]
    else:
        raise VerifierError("SpecHub needs its hub drafting: one of the two children must be argmax q")
    decisions: dict[int, NodeDecision] = {}
    (j_i, i), (j_a, _) = order
    u = _uniform(generator, p.device)
    ok = u <= float(alpha[i])
    decisions[j_i] = NodeDecision(accepted=ok, ratio=float(alpha[i]), u=u)
    if ok:
        return j_i, None, decisions
    u = _uniform(generator, p.device)
    ok = u <= beta
    decisions[j_a] = NodeDecision(accepted=ok, ratio=beta, u=u)
    residual = normalize(plan["residual"])
    if residual is None:  # nothing left to capture: the rejection had probability 0
        residual = p
    if ok:
        return j_a, None, decisions
    decisions[j_a].residual_top = _top(residual)
    decisions[j_i].residual_top = _top(residual)
    return None, residual, decisions


def point_stage(tokens, p, generator, greedy: bool = False):
    """Deterministic children (q = a point mass each), tested one after another against ``p`` (the residual the
    draft-model children left). Greedy: accept the child equal to ``argmax p``. Sampling: accept x when
    ``u < p(x)`` (u ~ U[0, 1)), else set ``p(x) = 0`` and renormalise. Same return as the node rules."""
    decisions = {}
    best = int(p.argmax()) if greedy else None  # greedy never changes p: one read for all children
    for j, x in enumerate(tokens):
        if greedy:
            ok = x == best
            decisions[j] = NodeDecision(accepted=ok, ratio=1.0 if ok else 0.0)
        else:
            px = float(p[x])
            u = _uniform(generator, p.device)
            ok = u < px
            decisions[j] = NodeDecision(accepted=ok, ratio=px, u=u)
            if not ok:
                rest = without(p, x)
                if rest is not None:  # None only if p(x) == 1, where rejection had probability 0
                    p = rest
                decisions[j].residual_top = _top(p)
        if ok:
            return j, None, decisions
    return None, p, decisions


NODE_RULES = {"greedy": greedy_node, "rrs": rrs_node, "rrs-replacement": rrs_replacement_node,
              "mcns": mcns_node, "spechub": spechub_node}


# ------------------------------------------------------------------------------------------------ walks


def _walk(tree: DraftTree, p_rows, q_rows, start: int, rule, generator, decisions: dict):
    """Descend from node ``start`` (-1 = anchor) with ``rule``. Returns (accepted nodes below start, distribution
    of the next token, p row of the last node)."""
    path, node = [], start
    while True:
        kids = tree.children(node)
        dist = p_rows[node + 1]
        if not kids:
            return path, dist, node + 1
        accepted = None
        model = [c for c in kids if tree.source[c] not in FREE_SOURCES]
        free = [c for c in kids if tree.source[c] in FREE_SOURCES]
        if model:  # the rule's own children first, then the free ones against what they left
            idx, dist, decs = rule([tree.token[c] for c in model], dist, q_rows.get(node + 1), generator)
            decisions.update({model[j]: d for j, d in decs.items()})
            accepted = None if idx is None else model[idx]
        if accepted is None and free:
            idx, dist, decs = point_stage([tree.token[c] for c in free], dist, generator, greedy=rule is greedy_node)
            decisions.update({free[j]: d for j, d in decs.items()})
            accepted = None if idx is None else free[idx]
        if accepted is None:
            return path, dist, node + 1
        node = accepted
        path.append(node)


def _branch_counts(tree: DraftTree, path: list[int]) -> dict[int, int]:
    counts = {b: 0 for b in range(len(tree.children(-1)))}
    if path:
        counts[tree.branch_of(path[0])] = sum(1 for i in path if tree.source[i] != "target")
    return counts


def verify_tree(tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator, rule: str = "rrs",
                **_) -> VerifyResult:
    """Lossless verification of a tree hanging from the anchor with one node rule; then the bonus token."""
    decisions: dict[int, NodeDecision] = {}
    path, dist, _row = _walk(tree, p_rows, q_rows, -1, NODE_RULES[rule], generator, decisions)
    bonus = int(dist.argmax()) if rule == "greedy" else sample_one(dist, generator)
    return VerifyResult(path, bonus, decisions, _branch_counts(tree, path),
                        tree.branch_of(path[0]) if path else None)


def verify_longest_branch(tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator, greedy: bool = False,
                          **_) -> VerifyResult:
    """The seed's rule (lossy): walk every root's subtree on its own, commit the root with the longest accepted
    draft continuation (ties: the first root). The next step's roots are drawn from the distribution at that
    branch's end: the residual at its rejection, or p after its last node."""
    rule = NODE_RULES["greedy" if greedy else "rrs"]
    decisions: dict[int, NodeDecision] = {}
    best = None
    counts: dict[int, int] = {}
    for b, root in enumerate(tree.children(-1)):
        below, dist, row = _walk(tree, p_rows, q_rows, root, rule, generator, decisions)
        counts[b] = len(below)
        if best is None or len(below) > len(best[1]):
            best = (root, below, dist, row, b)
    if best is None:
        raise VerifierError("the lossy rule needs at least one root")
    root, below, dist, row, b = best
    return VerifyResult([root] + below, None, decisions, counts, b, next_dist=dist,
                        next_row=(below[-1] if below else root) + 1)


def run_verifier(name: str, tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator,
                 greedy: bool = False) -> VerifyResult:
    """Dispatch by name: ``greedy``, one of ``VERIFIERS``, or ``longest-branch``."""
    if name == "longest-branch":
        return verify_longest_branch(tree, p_rows, q_rows, generator, greedy=greedy)
    if name != "greedy" and name not in VERIFIERS:
        raise VerifierError(f"unknown verifier {name!r}; use one of greedy, {', '.join(VERIFIERS)}, longest-branch")
    return verify_tree(tree, p_rows, q_rows, generator, rule=name)
