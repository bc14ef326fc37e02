"""SpecTr's k-sequential selection (K-SEQ; Sun et al., NeurIPS 2023, arXiv 2310.15141) as the verifier ``spectr``.

At a node with k' model-drafted children, drawn i.i.d. from q (duplicates kept), the children are tested in draw
order, child x accepted with probability ``min(1, p(x) / (rho* q(x)))``. ``rho*`` in ``[1, k']`` is the smallest root
of ``1 - (1 - beta(r))^k' = r beta(r)`` with ``beta(r) = sum_x min(q(x), p(x) / r)`` (the chance that one draft
passes), found by bisection at every node with its own k'. Where every child is rejected, the next token comes from
``p_res(x) = [p(x) - min(q(x), p(x) / rho*) A / b] / (1 - b)^k'`` with ``b = beta(rho*)`` and
``A = 1 - (1 - b)^k'``, so that the committed token follows p exactly. ``rho = 1`` (``spectr-rho1``, registered by
the tests only) makes p_res negative where q > p and is lossy: the audit catches it.

A child's odds: its acceptance probability given that the walk reaches it, ``min(1, p(x) / (rho* q(x)))``, and its
slot's acceptance rate ``b`` (any i.i.d. draft passes with probability b).
"""

from __future__ import annotations

import numpy as np
import torch

from explorer.plugins import NodeDecision, register_verifier

BISECTIONS = 60
"""Bisection steps for rho* on [1, k']: 60 halvings leave an interval below float64's resolution."""


def _pass_rate(p: np.ndarray, q: np.ndarray):
    """``beta(r)`` as a function, exact for any r: tokens sorted by ``p / q``; below r each adds ``p / r``, from r
    on ``q`` (tokens where p or q is 0 add nothing)."""
    keep = (p > 0) & (q > 0)
    t = p[keep] / q[keep]
    order = np.argsort(t)
    t, pk, qk = t[order], p[keep][order], q[keep][order]
    below = np.concatenate([[0.0], np.cumsum(pk)])  # sum of p over the tokens with p/q < r
    above = np.concatenate([np.cumsum(qk[::-1])[::-1], [0.0]])  # sum of q over the tokens with p/q >= r

    def beta(r: float) -> float:
        j = int(np.searchsorted(t, r, side="left"))
        return float(below[j] / r + above[j])

    return beta


def optimal_rho(p: np.ndarray, q: np.ndarray, k: int) -> tuple[float, float]:
    """``(rho*, beta(rho*))`` for ``k`` i.i.d. drafts (module docstring): float64 ``p``, ``q`` of the vocabulary's
    size, each summing to 1. ``k = 1`` gives rho* = 1 (speculative decoding's test)."""
    beta = _pass_rate(p, q)
    lo, hi = 1.0, float(max(k, 1))

    def excess(r: float) -> float:  # > 0 where r is too small (p_res would go negative)
        b = beta(r)
        return 1.0 - (1.0 - b) ** k - r * b

    if excess(lo) <= 0.0:
        return lo, beta(lo)
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        if excess(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return hi, beta(hi)


def _residual(p: torch.Tensor, q: torch.Tensor, rho: float, b: float, k: int) -> torch.Tensor:
    """``p_res`` (module docstring) on the device, clipped at 0 (rounding) and renormalised; p itself where no
    mass is left. One draft (k = 1, rho = 1): A / b is 1 and p_res is speculative decoding's ``max(p - q, 0)``."""
    a = 1.0 - (1.0 - b) ** k
    left = torch.clamp(p - torch.minimum(q, p / rho) * (a / max(b, 1e-30)), min=0.0)
    total = left.sum()
    return torch.where(total > 0, left / torch.clamp(total, min=1e-30), p)


def _node(tokens, p: torch.Tensor, q: torch.Tensor, rho: float | None):
    """What the node rule and the odds rule both read at one node: each child's ``p(x)`` and ``q(x)`` (floats), the
    node's rho (``rho`` None: rho* for ``len(tokens)`` drafts) and ``beta(rho)``. One draft needs no sort: rho* is
    1 and beta(1) is ``sum min(p, q)``, summed on the device (the chains of a tree are most of its nodes)."""
    k = len(tokens)
    if rho is None and k == 1:
        return ([float(p[tokens[0]])], [float(q[tokens[0]])], 1.0,
                float(torch.minimum(p, q).sum(dtype=torch.float64)))
    host_p, host_q = p.double().cpu().numpy(), q.double().cpu().numpy()
    rho, b = optimal_rho(host_p, host_q, k) if rho is None else (rho, _pass_rate(host_p, host_q)(rho))
    return [float(host_p[x]) for x in tokens], [float(host_q[x]) for x in tokens], rho, b


def _scaled(px: float, qx: float, rho: float) -> float:
    """The test's argument ``p(x) / (rho q(x))``; inf where q(x) is 0."""
    return px / (rho * qx) if qx > 0 else float("inf")


def kseq(tokens, p, q, generator, rho: float | None = None):
    """K-SEQ at one node: test the children in draw order with ``min(1, p(x) / (rho q(x)))`` (``rho`` None: the
    node's rho*); the next token's distribution ``p_res`` where none passes. Returns the node rule's triple."""
    px, qx, rho, b = _node(tokens, p, q, rho)
    decisions = {}
    for j in range(len(tokens)):
        r = _scaled(px[j], qx[j], rho)
        u = float(torch.rand((), generator=generator, device=p.device))
        decisions[j] = NodeDecision(accepted=u < r, ratio=float(min(r, 1e30)), u=u)
        if u < r:
            return j, None, decisions
    return None, _residual(p, q, rho, b, len(tokens)), decisions


def kseq_odds(tokens, p, q, rho: float | None = None):
    """Each child's scaled ratio ``p(x) / (rho q(x))`` and its slot's pass rate ``beta(rho)``, then ``p_res``."""
    px, qx, rho, b = _node(tokens, p, q, rho)
    out = [(j, min(_scaled(px[j], qx[j], rho), 1e30), b) for j in range(len(tokens))]
    return out, _residual(p, q, rho, b, len(tokens))


register_verifier("spectr", kseq, kseq_odds, draws="with", label="SpecTr K-SEQ (i.i.d. drafts)")
