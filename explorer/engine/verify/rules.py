"""Verifiers: given a draft tree, the target's distributions p and the draft's distributions q, decide which path
is committed and which token follows it.

Inputs (float32 on one device):

* ``p_rows``: indexable by row (a ``(N + 1, vocab)`` tensor or a lazy ``sampling.RowDists``); row 0 is the
  target's processed distribution at the anchor (for the anchor's children), row ``i + 1`` at tree node ``i``.
* ``q_rows``: ``{row: (vocab,)}``: the draft's processed distribution each node's children were drafted from
  (sampling only; greedy verification does not read q).

A verifier walks down from the anchor. At each node a *node rule* looks at the node's children (in draft order)
and either accepts one of them (the walk descends into it) or returns the distribution the next token must be drawn
from (the bonus token when the walk ends at a leaf: p itself). Node rules:

* ``greedy``: accept the child equal to ``argmax p``.
* ``rrs`` (MCSD, Yang et al. 2024, arXiv 2401.06706): recursive rejection sampling *without replacement*; children
  drafted without replacement (``drafting.sample_without_replacement``). For each child x: accept with probability
  ``min(1, p(x)/q(x))``; on rejection ``p <- norm(max(p - q, 0))``, ``q[x] <- 0``, ``q <- norm(q)``.
* ``rrs-replacement`` (SpecInfer, Miao et al. 2024): the same with q left unchanged; children drafted i.i.d.
* ``mcns`` (naive multi-candidate sampling): draw ``y ~ p``; accept the child equal to y, else emit y.
* ``spechub`` (Sun et al. 2024, arXiv 2411.05289): two drafts per node, one of them always the hub token
  ``a = argmax q``; a small transport plan decides (see ``spechub_node``). Nodes with one child use ``rrs``.
* ``longest-branch``: the rule of Lu et al. 2024: each target-sampled root's branch is walked on its
  own with ``rrs`` (or ``greedy``) and the branch with the most accepted draft tokens is committed. **Lossy.**

Free children (prompt lookup, Token Recycling: ``methods.FREE_SOURCES``) are deterministic proposals, q a point
mass. After the node rule rejects the draft-model children, each free child faces ``point_stage``: the step of
SpecInfer's multi-step speculative sampling for a proposal of its own (accept x with ``min(1, p'(x) / q_x(x))``,
else ``p' <- norm(max(p' - q_x, 0))``), which for ``q_x = delta_x`` accepts with probability ``p'(x)`` and removes
x from p'. Every stage, given the proposals, leaves the next token distributed as the p' it was handed, so any mix
of model and free children stays lossless.

All but the last are lossless: the committed tokens are distributed exactly as sampling from the target.

How the walk runs. ``greedy``, ``rrs``, ``rrs-replacement`` (and ``longest-branch`` on them) test a node with a
number that depends only on the tree: every node's acceptance probability is computed on the device for the whole
tree at once (``expectation.node_odds``) and the walk compares it with the node's own uniform draw on the host
(``ODDS_RULES``): a few host synchronisations per step however large the tree, where a read per tested node
stalled a GPU step dozens of times. ``mcns`` and ``spechub`` walk node by node (``NODE_RULES``).

The node rules and their odds live in ``node_rules``; the verifiers by name (label, drafting, node rule, odds rule)
in ``registry``, where ``register_verifier`` adds one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...trace.records import FREE_SOURCES
from ..drafting import sample_one, uniforms
from ..tree import DraftTree
from . import expectation
from .node_rules import RESIDUAL_TOP, NodeDecision, VerifierError, point_stage
from .node_rules import mcns_node, rrs_node, spechub_node  # noqa: F401  (re-exported: callers import them here)
from .registry import VERIFIER_REGISTRY, names, view
from .registry import register_verifier  # noqa: F401  (re-exported)
from .residuals import rrs_rejected, without
from .residuals import spechub_plan  # noqa: F401  (re-exported)


@dataclass
class VerifyResult:
    """Outcome of verifying one tree.

    Attributes:
        path: tree indices of the committed nodes, root first (for lossy rules the target-sampled root included).
        bonus: the token id drawn after the path (from p, or the residual after a rejection); None for the lossy
            rule, which instead hands ``next_dist`` (float32 ``(vocab,)``, on the device) to the next step's roots.
        decisions: tree index -> ``NodeDecision`` of every node whose test ran (accepted or not).
        branch_accepted: branch (index among the anchor's children) -> the accepted draft tokens in that branch.
        chosen_branch: the branch the committed path runs through, or None when no child was accepted.
        next_row: lossy rule only: the p row after the committed path (lossy greedy roots come from its raw
            logits); None otherwise.
    """

    path: list[int]
    bonus: int | None
    decisions: dict[int, NodeDecision]
    branch_accepted: dict[int, int]
    chosen_branch: int | None
    next_dist: torch.Tensor | None = None
    next_row: int | None = None


NODE_RULES = view(lambda v: v.node_rule, keep=lambda v: v.node_rule is not None)
"""Rules walked node by node, each drawing as it tests (the rules whose tests ``ODDS_RULES`` cannot precompute);
a read-only view of ``registry``."""


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
            idx, dist, decs = point_stage([tree.token[c] for c in free], dist, generator)
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


# ------------------------------------------------------------------------------------------------ walks on odds

ODDS_RULES = names(lambda v: v.node_rule is None and v.name != "longest-branch")
"""Rules whose test of a node depends only on the tree (given that the earlier siblings were rejected, which the
walk reaching it implies). Every node's acceptance probability is computed once, on the device, and reaches the host
in one transfer (``expectation.node_odds``, which the trace shows anyway); the walk then compares each tested node's
probability with its own uniform draw (``u < accept_prob``), all drawn at once. Afterwards only the residuals at
the nodes the walk visited are computed: the rejected nodes' for the trace, the last for the bonus token. Host
synchronisations per step: the odds, the uniforms, the residuals' top tokens, the bonus token, however
large the tree. A read-only view of ``registry`` (its verifiers without a node rule; ``longest-branch`` walks
on the same odds branch by branch)."""


def _uniforms(tree: DraftTree, generator: torch.Generator) -> list[float]:
    """One U[0, 1) draw (float64) per tree node, in one call and one transfer; a node's test uses its own."""
    return uniforms(generator, len(tree)).tolist() if len(tree) else []


def _odds_walk(tree: DraftTree, odds: dict, start: int, uniforms, decisions: dict) -> list[tuple[int, list[int]]]:
    """Descend from node ``start`` (-1 = anchor): test each node's children in test order; child c passes when
    ``uniforms[c] < accept_prob`` (greedy, ``uniforms`` None: when its accept_prob is 1, i.e. it is the argmax);
    the walk descends into the first that passes. Returns the visits: ``(node, its children rejected before one
    passed or none did)`` from ``start`` down; the last is where the walk stopped, and the accepted path is the
    nodes of the visits after the first."""
    visits, node = [], start
    while True:
        kids = sorted((c for c in tree.children(node) if c in odds), key=lambda c: odds[c].order)
        rejected, passed = [], None
        for c in kids:
            u = None if uniforms is None else uniforms[c]
            ok = odds[c].accept_prob >= 1.0 if u is None else u < odds[c].accept_prob
            decisions[c] = NodeDecision(accepted=ok, ratio=odds[c].ratio, u=u)
            if ok:
                passed = c
                break
            rejected.append(c)
        visits.append((node, rejected))
        if passed is None:
            return visits
        node = passed


def _residuals(tree: DraftTree, p_rows, q_rows, node: int, rejected: list[int], replacement: bool) -> list:
    """The distributions left at ``node`` after each of its children ``rejected`` (test order) was rejected, as
    its rule removes it (``rrs``'s residual for a model-drafted child, the point-mass residual for a free one), on
    the device. The last is the distribution the next token is drawn from when none of its children passed; no
    rejection leaves p there."""
    p, q = p_rows[node + 1], q_rows.get(node + 1)
    out = [p]
    for c in rejected:
        if tree.source[c] in FREE_SOURCES:
            p = without(p, tree.token[c])
        else:
            p, q = rrs_rejected(p, q, tree.token[c], replacement)
        out.append(p)
    return out


def _walk_end(tree: DraftTree, p_rows, q_rows, visits: list, replacement: bool) -> tuple:
    """After a sampled walk, on the device: the distribution it ends in (where the next token is drawn from), and
    every rejected node with the residual its rejection left (for the trace). Returns (dist, rejected, residuals)."""
    rejected, after = [], []
    for node, rej in visits:
        left = _residuals(tree, p_rows, q_rows, node, rej, replacement)
        rejected += rej
        after += left[1:]
    return left[-1], rejected, after


def _record_residual_tops(decisions: dict, rejected: list[int], after: list[torch.Tensor]) -> None:
    """Each rejected node's ``residual_top`` (the trace's view of what its rejection left), in one transfer."""
    if not rejected:
        return
    vals, ids = torch.topk(torch.stack(after), min(RESIDUAL_TOP, after[0].shape[-1]), dim=-1)
    host = torch.cat([ids.double(), vals.double()], 1).tolist()
    k = ids.shape[1]
    for c, line in zip(rejected, host):
        decisions[c].residual_top = [(int(t), p) for t, p in zip(line[:k], line[k:]) if p > 0]


def verify_tree(tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator, rule: str = "rrs",
                odds: dict | None = None, unfed_leaf: int | None = None, **_) -> VerifyResult:
    """Lossless verification of a tree hanging from the anchor with one node rule; then the bonus token.
    ``odds``: ``expectation.node_odds`` of this tree under ``rule`` when the caller has them (computed here if
    not; ``ODDS_RULES`` only). ``unfed_leaf``: a leaf with no p row of its own (PEARL's first new draft, which the
    target's forward could not read): tested from its parent's row, and when accepted the step ends there with no
    bonus token (``ODDS_RULES`` only). Raises VerifierError for an unfed leaf under a node-by-node rule."""
    decisions: dict[int, NodeDecision] = {}
    if rule not in ODDS_RULES:
        if unfed_leaf is not None:
            raise VerifierError(f"{rule} walks node by node and cannot end at a node without a target row; "
                                "use rrs or greedy")
        path, dist, _row = _walk(tree, p_rows, q_rows, -1, NODE_RULES[rule], generator, decisions)
        bonus = sample_one(dist, generator)
    else:
        odds = expectation.node_odds(tree, p_rows, q_rows, rule) if odds is None else odds
        greedy = rule == "greedy"
        visits = _odds_walk(tree, odds, -1, None if greedy else _uniforms(tree, generator), decisions)
        path = [node for node, _ in visits[1:]]
        if path and path[-1] == unfed_leaf:  # accepted with no row after it: no bonus token
            if not greedy:
                _, rejected, after = _walk_end(tree, p_rows, q_rows, visits[:-1], rule == "rrs-replacement")
                _record_residual_tops(decisions, rejected, after)
            bonus = None
        elif greedy:
            bonus = expectation.best_token(p_rows, visits[-1][0] + 1)
        else:
            dist, rejected, after = _walk_end(tree, p_rows, q_rows, visits, rule == "rrs-replacement")
            _record_residual_tops(decisions, rejected, after)
            bonus = sample_one(dist, generator)
    return VerifyResult(path, bonus, decisions, _branch_counts(tree, path),
                        tree.branch_of(path[0]) if path else None)


def verify_longest_branch(tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator, greedy: bool = False,
                          odds: dict | None = None, **_) -> VerifyResult:
    """Lu et al.'s rule (lossy): walk every root's subtree on its own (``rrs``, or ``greedy``), commit the root with
    the longest accepted draft continuation (ties: the first root). The next step's roots are drawn from the
    distribution at that branch's end: the residual at its rejection, or p after its last node."""
    odds = expectation.node_odds(tree, p_rows, q_rows, "longest-branch", greedy=greedy) if odds is None else odds
    uniforms = None if greedy else _uniforms(tree, generator)
    decisions: dict[int, NodeDecision] = {}
    walks = [_odds_walk(tree, odds, root, uniforms, decisions) for root in tree.children(-1)]
    if not walks:
        raise VerifierError("the lossy rule needs at least one root")
    counts = {b: len(visits) - 1 for b, visits in enumerate(walks)}
    b = max(counts, key=lambda i: (counts[i], -i))  # the longest; ties: the first root
    if greedy:
        next_dist = p_rows[walks[b][-1][0] + 1]
    else:  # every branch's rejections go into the trace (one transfer); the chosen branch's end is the next dist
        ends = [_walk_end(tree, p_rows, q_rows, visits, False) for visits in walks]
        _record_residual_tops(decisions, [c for _, rej, _ in ends for c in rej], [a for _, _, aft in ends for a in aft])
        next_dist = ends[b][0]
    path = [node for node, _ in walks[b]]
    return VerifyResult(path, None, decisions, counts, b, next_dist=next_dist, next_row=path[-1] + 1)


def run_verifier(name: str, tree: DraftTree, p_rows, q_rows: dict, generator: torch.Generator,
                 greedy: bool = False, odds: dict | None = None, unfed_leaf: int | None = None) -> VerifyResult:
    """Dispatch by name: a verifier of ``registry`` (``greedy``, one of ``config.VERIFIERS``, ``longest-branch``, or
    one ``register_verifier`` added). ``odds``: the tree's
    ``expectation.node_odds`` under this verifier, when the caller has computed them (the engine does, for the
    trace); otherwise they are computed here where the rule walks on them. ``unfed_leaf``: ``verify_tree``'s."""
    if name == "longest-branch":
        return verify_longest_branch(tree, p_rows, q_rows, generator, greedy=greedy, odds=odds)
    if name not in VERIFIER_REGISTRY:
        raise VerifierError(f"unknown verifier {name!r}; use one of {', '.join(VERIFIER_REGISTRY)}")
    return verify_tree(tree, p_rows, q_rows, generator, rule=name, odds=odds, unfed_leaf=unfed_leaf)
