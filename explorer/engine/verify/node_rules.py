"""What each verification rule does at one node, in two forms (a verifier in ``registry`` holds both):

* a *node rule* ``(tokens, p, q, generator) -> (index of the accepted child or None, distribution of the next token
  when none was, {child index: NodeDecision})`` tests a node's model-drafted children (``tokens``, draft order)
  against the target's ``p`` and the draft's ``q`` (float32 ``(vocab,)``), drawing as it tests;
* an *odds rule* ``(tokens, p, q) -> ([(child index, ratio, slot probability), ...] in test order, p after the last
  test)`` says, drawing nothing, what the test implies about each child (``expectation.NodeOdds``), values as 0-d
  device tensors or floats read in one transfer later.

``point_stage`` tests the deterministic (free) children after the node rule. The rules and their papers:
``engine/verify/rules.py``. This module imports no table of verifiers, so the registry can hold these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import sample_one
from .residuals import normalize_or, ratio, rrs_rejected, spechub_plan, without
from .residuals import ratio as accept_ratio  # where a node rule's local is named ratio

RESIDUAL_TOP = 5
"""Tokens of a residual distribution a rejection records (``NodeDecision.residual_top``)."""


class VerifierError(ValueError):
    """A verifier cannot serve this tree (e.g. SpecHub with more than two children per node), or ``registry``
    refuses a name (taken, unknown) or a drafting law."""


@dataclass
class NodeDecision:
    """Why a node was accepted or rejected. ``u`` is the uniform draw of its test (None for greedy / MCNS);
    ``ratio`` the acceptance probability's argument (p/q, or its SpecHub analogue); ``residual_top`` after a
    rejection: ``[(token_id, prob), ...]`` of the distribution the next sibling (or the replacement token) faces."""

    accepted: bool
    ratio: float
    u: float | None = None
    residual_top: list[tuple[int, float]] = field(default_factory=list)


def _top(dist: torch.Tensor, k: int = RESIDUAL_TOP) -> list[tuple[int, float]]:
    v, i = torch.topk(dist, min(k, dist.shape[-1]))
    return [(int(t), float(p)) for t, p in zip(i.tolist(), v.tolist()) if p > 0]


def _uniform(generator: torch.Generator, device) -> float:
    return float(torch.rand((), generator=generator, device=device))


# ------------------------------------------------------------------------------------------------ node rules
# Node by node (``mcns``, ``spechub``, and ``rrs`` for SpecHub's one-child nodes; ``rrs`` itself walks on its odds).


def rrs_node(tokens, p, q, generator, replacement: bool = False):
    """Recursive rejection sampling (MCSD, Yang et al. 2024; ``replacement``: SpecInfer, Miao et al. 2024)."""
    decisions = {}
    for j, x in enumerate(tokens):
        ratio = float(accept_ratio(p[x], q[x]))
        u = _uniform(generator, p.device)
        if u < ratio:  # P(u < r) = min(1, r) for u ~ U[0, 1); "<=" would pass a p(x) = 0 draft at u = 0
            decisions[j] = NodeDecision(accepted=True, ratio=ratio, u=u)
            return j, None, decisions
        p, q = rrs_rejected(p, q, x, replacement)
        decisions[j] = NodeDecision(accepted=False, ratio=ratio, u=u, residual_top=_top(p))
    return None, p, decisions


def mcns_node(tokens, p, q, generator):
    """Naive multi-candidate sampling: draw ``y ~ p``; accept the child equal to y, else emit y."""
    y = sample_one(p, generator)
    decisions = {}
    for j, x in enumerate(tokens):
        ratio = float(accept_ratio(p[x], q[x])) if q is not None else 0.0
        ok = x == y
        decisions[j] = NodeDecision(accepted=ok, ratio=ratio)
        if ok:
            return j, None, decisions
    return None, torch.nn.functional.one_hot(torch.tensor(y, device=p.device), p.shape[-1]).to(p), decisions


def spechub_node(tokens, p, q, generator):
    """SpecHub (Sun et al. 2024): a hub pair tested with its transport plan (``residuals.spechub_plan``)."""
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
    ok = u < float(alpha[i])
    decisions[j_i] = NodeDecision(accepted=ok, ratio=float(alpha[i]), u=u)
    if ok:
        return j_i, None, decisions
    u = _uniform(generator, p.device)
    ok = u < beta
    decisions[j_a] = NodeDecision(accepted=ok, ratio=beta, u=u)
    residual = normalize_or(plan["residual"], p)  # p when nothing was left to capture (probability 0)
    if ok:
        return j_a, None, decisions
    decisions[j_a].residual_top = _top(residual)
    decisions[j_i].residual_top = _top(residual)
    return None, residual, decisions


def point_stage(tokens, p, generator):
    """Deterministic children (q = a point mass each), tested one after another against ``p`` (the residual the
    draft-model children left): accept x when ``u < p(x)`` (u ~ U[0, 1)), else set ``p(x) = 0`` and renormalise.
    Same return as the node rules."""
    decisions = {}
    for j, x in enumerate(tokens):
        px = float(p[x])
        u = _uniform(generator, p.device)
        ok = u < px
        decisions[j] = NodeDecision(accepted=ok, ratio=px, u=u)
        if ok:
            return j, None, decisions
        p = without(p, x)  # p itself if p(x) == 1, where the rejection had probability 0
        decisions[j].residual_top = _top(p)
    return None, p, decisions


# ------------------------------------------------------------------------------------------------ odds rules
# What each node rule implies about a node's children, drawing nothing (``expectation.node_odds`` applies them to
# a whole tree; the verifier walks ``rrs``'s on the device).


def rrs_odds(tokens, p, q, replacement: bool = False):
    """Per child (in test order) its ratio and slot probability as 0-d device tensors: nothing is read here."""
    out = []
    for j, x in enumerate(tokens):
        out.append((j, ratio(p[x], q[x]), torch.minimum(p, q).sum()))
        p, q = rrs_rejected(p, q, x, replacement)  # the verifier's own residual update
    return out, p


def rrs_replacement_odds(tokens, p, q):
    """``rrs_odds`` with q left as it was after a rejection (i.i.d. drafts, SpecInfer)."""
    return rrs_odds(tokens, p, q, replacement=True)


def mcns_odds(tokens, p, q):
    """y ~ p; the first child equal to y is accepted. Given the earlier children were rejected, y ~ p without them."""
    out = []
    for j, x in enumerate(tokens):
        out.append((j, float(p[x]), float((q * p).sum()) if q is not None else float(p[x])))
        if not float(p.sum() - p[x]) > 0:  # nothing else had mass: the walk stops here
            break
        p = without(p, x)
        if q is not None:  # drafted without replacement: the next slot's draw excludes x
            q = without(q, x)
    return out, p


def spechub_odds(tokens, p, q):
    """Each child's alpha or beta of the transport plan; slot rates averaged over the pair kinds drawn."""
    if len(tokens) == 1:
        return rrs_odds(tokens, p, q)
    plan = spechub_plan(p, q)
    a = plan["hub"]
    qa = float(q[a])
    q_ai = q * qa / max(1.0 - qa, 1e-30)
    non_hub = torch.ones_like(q, dtype=torch.bool)
    non_hub[a] = False
    # The first test is the non-hub draft's, whichever of the two pair kinds was drawn.
    drawn = float(q[non_hub].sum() + q_ai[non_hub].sum())
    captured = float((q * plan["alpha1"])[non_hub].sum() + (q_ai * plan["alpha2"])[non_hub].sum())
    r1 = float((q * (1 - plan["alpha1"]))[non_hub].sum())
    r2 = float((q_ai * (1 - plan["alpha2"]))[non_hub].sum())
    hub_slot = (plan["beta1"] * r1 + plan["beta2"] * r2) / (r1 + r2) if r1 + r2 > 0 else 0.0
    first_slot = captured / drawn if drawn > 0 else 0.0
    if tokens[1] == a:
        out = [(0, float(plan["alpha1"][tokens[0]]), first_slot), (1, plan["beta1"], hub_slot)]
    else:
        out = [(1, float(plan["alpha2"][tokens[1]]), first_slot), (0, plan["beta2"], hub_slot)]
    return out, normalize_or(plan["residual"], p)
