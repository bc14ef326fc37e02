"""What a verification rule implies about acceptance: per drafted node the probability that it passes, and from
those the number of tokens a step is expected to commit (for the "expected against realised acceptance" instrument).

Every node gets two probabilities, both computed from the step's own p (target) and q (draft) rows:

* ``accept_prob``: the probability that the node's test accepts *this* token, given that its parent is on the
  committed path and the siblings tested before it were rejected. For ``rrs`` it is ``min(1, p'(x) / q'(x))`` with
  p', q' the residuals left by the earlier siblings; ``greedy`` 1 or 0; ``mcns`` ``p'(x)``; SpecHub its transport
  plan's alpha or beta; a free (deterministic) child ``p'(x)``, or 1 / 0 when greedy. Multiplied down the tree they
  give the law of the committed length *for the drafted tree*, so the expected tokens per step differs from the
  realised ones only by the verifier's own coin flips (``expected_tokens``).
* ``slot_prob``: the same averaged over the token the draft could have proposed in this slot, e.g.
  ``sum_x min(p'(x), q'(x))`` for ``rrs`` (one draft: ``1 - TV(p, q)``, Leviathan et al. 2023, section 3.1). Its
  mean over the nodes tested at a (depth, sibling rank) is an unbiased estimate of that slot's acceptance rate,
  with less noise than counting accepts: the acceptance vector Sequoia's tree search takes (Chen et al. 2024).

Each verifier's odds rule (``node_rules``, held by ``registry``) applies the residual updates of its own node rule
(``engine/verify/residuals.py``), and for ``greedy``, ``rrs`` and ``rrs-replacement`` the verifier walks on these
very odds (``verify.ODDS_RULES``); nothing here draws a random number, and the values stay on the device until
one transfer at the end (a host synchronisation on a GPU).
Tensors: ``p_rows`` / ``q_rows`` as in ``engine/verify/rules.py`` (float32 ``(vocab,)`` rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...trace.records import FREE_SOURCES
from ..tree import DraftTree
from .registry import VERIFIER_REGISTRY, view
from .residuals import fetch


@dataclass(frozen=True)
class NodeOdds:
    """One node's test, as the rule implies: see the module docstring. ``order`` is its place among the
    siblings in test order (0 = tested first); ``ratio`` the test's argument as the trace shows it (``p'(x) /
    q'(x)`` for ``rrs``, possibly above 1 or inf; ``p'(x)`` for a free child and for ``mcns``; SpecHub's alpha
    or beta; 1 or 0 when greedy)."""

    accept_prob: float
    slot_prob: float
    order: int
    ratio: float | None = None


def _point_masses(tokens, p) -> torch.Tensor:
    """Deterministic children's ``p(x_j)`` and ``sum(p)``, ``(len(tokens) + 1,)`` on the device (``_point_odds``
    turns them into odds once they are on the host). Indexed token by token: an index tensor built from the list
    would be a host-to-device copy, which synchronises on a GPU too."""
    return torch.stack([p[x] for x in tokens] + [p.sum()])


def _point_odds(masses: list[float]) -> list[tuple[int, float, float]]:
    """Deterministic children tested in turn: child j passes with its probability under ``p`` with the earlier
    children removed and the rest renormalised (as the verifier's point-mass stage after each rejection), i.e.
    ``p(x_j) / (sum(p) - p(x_0) - ... - p(x_{j-1}))``."""
    *px, left = masses
    out = []
    for j, mass in enumerate(px):
        if not left > 0:  # nothing else had mass: the walk stops here
            break
        odds = min(1.0, mass / left)  # rounding in the running remainder must not make it a probability above 1
        out.append((j, odds, odds))
        left -= mass
    return out


ODDS_RULES = view(lambda v: v.odds_rule, keep=lambda v: v.odds_rule is not None)
"""Verifier name -> its odds rule (``node_rules``): a read-only view of ``registry``."""


def node_odds(tree: DraftTree, p_rows, q_rows, verifier: str, greedy: bool = False) -> dict[int, NodeOdds]:
    """Each tested node's odds (tree index -> NodeOdds) under ``verifier`` (a ``verify.run_verifier`` name).

    Every node that can be tested gets odds, including nodes the walk never reached (below a rejection): what
    their test would have been. Target-sampled roots of the lossy rule are not tested and get none. The values
    are computed on the device and reach the host in one transfer (greedy: none, the best tokens are there
    already); ``engine/verify/rules.py`` walks the tree with them. A registered rule without an odds rule gives no
    odds at the nodes with model-drafted children (what its test implies is unknown here).
    Raises KeyError for an unknown verifier (one ``registry`` does not hold).
    """
    if verifier == "greedy" or (verifier == "longest-branch" and greedy):
        return _greedy_odds(tree, p_rows)
    rule = VERIFIER_REGISTRY[verifier].odds_rule  # longest-branch: rrs's, branch by branch
    tests = []  # (node, ratio, slot probability, order) of the model-drafted children, values maybe on the device
    points = []  # (free children, their p(x) and sum(p) on the device, order of the first)
    for node in [-1] + list(range(len(tree))):
        kids = tree.children(node)
        kids = [c for c in kids if tree.source[c] != "target"]
        if not kids:
            continue
        p = p_rows[node + 1]
        model = [c for c in kids if tree.source[c] not in FREE_SOURCES]
        free = [c for c in kids if tree.source[c] in FREE_SOURCES]
        tested = []
        if model and rule is None:  # a registered rule without an odds rule: its decisions only, no odds here
            continue
        if model:
            tested, p = rule([tree.token[c] for c in model], p, q_rows.get(node + 1))
            tests += [(model[j], r, slot, order) for order, (j, r, slot) in enumerate(tested)]
        if free:
            points.append((free, _point_masses([tree.token[c] for c in free], p), len(tested)))
    host = iter(fetch([v for _, r, slot, _ in tests for v in (r, slot)] + [m for _, m, _ in points]))
    out: dict[int, NodeOdds] = {}
    for node, _, _, order in tests:
        r, slot = next(host), next(host)
        out[node] = NodeOdds(min(1.0, r), slot, order, r)
    for free, masses, first in points:
        masses = [next(host) for _ in range(len(free) + 1)]
        for j, accept, slot in _point_odds(masses):
            out[free[j]] = NodeOdds(accept, slot, first + j, accept)
    return out


def best_token(p_rows, row: int) -> int:
    """Greedy: the best token of a p row (the lowest id among exact ties, as ``argmax``), from the batched top-k
    pass verification already made when ``p_rows`` is a ``sampling.RowDists`` (no read for a batched row unless its
    top two tie), else the processed row's argmax."""
    return p_rows.argmax(row) if hasattr(p_rows, "top_ids") else int(p_rows[row].argmax())


def _greedy_odds(tree: DraftTree, p_rows) -> dict[int, NodeOdds]:
    """Greedy: a child passes when it is its parent's argmax; one best token per parent row."""
    out: dict[int, NodeOdds] = {}
    for node in [-1] + list(range(len(tree))):
        kids = [c for c in tree.children(node) if tree.source[c] != "target"]
        if not kids:
            continue
        best = best_token(p_rows, node + 1)
        model = [c for c in kids if tree.source[c] not in FREE_SOURCES]
        for order, c in enumerate(model + [c for c in kids if tree.source[c] in FREE_SOURCES]):
            hit = float(tree.token[c] == best)
            out[c] = NodeOdds(hit, hit, order, hit)
    return out


def accepted_length_laws(tree: DraftTree, odds: dict[int, NodeOdds]) -> dict[int, np.ndarray]:
    """For every node (and -1, the anchor): the law of the number of nodes accepted below it, given the walk
    reaches it; ``law[k]`` = P(k accepted), float64 ``(max depth below + 1,)``. Children are tried in test order;
    the first accepted one is descended into."""
    laws: dict[int, np.ndarray] = {}
    for node in list(range(len(tree) - 1, -1, -1)) + [-1]:
        kids = sorted((c for c in tree.children(node) if c in odds), key=lambda c: odds[c].order)
        law = np.zeros(1 + max((len(laws[c]) for c in kids), default=0))
        none_yet = 1.0
        for c in kids:
            take = none_yet * odds[c].accept_prob
            law[1: 1 + len(laws[c])] += take * laws[c]
            none_yet *= 1.0 - odds[c].accept_prob
        law[0] += none_yet
        laws[node] = law
    return laws


def tested_probs(tree: DraftTree, odds: dict[int, NodeOdds]) -> dict[int, float]:
    """For every node with odds: the probability that the verifier's walk tests it, i.e. that its parent is on the
    committed path and every sibling tested before it was rejected (greedy: 1 along the accepted path and at the
    first rejected node, 0 below). A node without odds (a target-sampled root of the lossy mode) is passed through
    as kept."""
    on_path = {-1: 1.0}
    tested: dict[int, float] = {}
    for node in [-1] + list(range(len(tree))):  # parents come before their children
        reach = on_path.get(node)
        if reach is None:
            continue
        for c in sorted(tree.children(node), key=lambda c: odds[c].order if c in odds else -1):
            if c not in odds:
                on_path[c] = on_path[node]
                continue
            tested[c] = reach
            on_path[c] = reach * odds[c].accept_prob
            reach *= 1.0 - odds[c].accept_prob
    return tested


def expected_tokens(tree: DraftTree, odds: dict[int, NodeOdds], lossy: bool = False) -> float:
    """Expected tokens the step commits before any truncation (EOS, max new tokens), the bonus token included.

    Lossless rules: ``1 + E[accepted length]``. The lossy longest-branch rule commits one target-sampled root plus
    the longest accepted continuation below any root (no bonus token): ``1 + E[max_b length_b]``, branches walked
    independently.
    """
    laws = accepted_length_laws(tree, odds)
    if not lossy:
        law = laws[-1]
        return 1.0 + float(np.dot(np.arange(len(law)), law))
    roots = tree.children(-1)
    if not roots:
        return 0.0
    size = max(len(laws[r]) for r in roots)
    cdf = np.ones(size)
    for r in roots:  # P(max <= k) = prod_b P(length_b <= k)
        law = np.zeros(size)
        law[: len(laws[r])] = laws[r]
        cdf *= np.cumsum(law)
    return 1.0 + float(np.sum(1.0 - cdf[:-1]))  # E[max] = sum_k P(max > k)
