"""The distributions a verification rule leaves after a rejection, computed on the models' device without reading
a value into Python (each read is a host synchronisation on a GPU).

Tensors are float32 ``(vocab,)`` distributions; scalars stay 0-d tensors until the caller moves a whole step's
worth to the host at once (``expectation.node_odds``). ``engine/verify/rules.py`` and ``engine/verify/expectation.py``
share these so that the odds the trace shows are the very numbers the walk tests.
"""

from __future__ import annotations

import torch


def normalize_or(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``x / x.sum()``, or ``fallback`` where the sum is not positive (chosen on the device)."""
    s = x.sum()
    return torch.where(s > 0, x / s, fallback)  # where s = 0 the quotient is inf / nan, and not chosen


def without(dist: torch.Tensor, x: int) -> torch.Tensor:
    """``dist`` with token x removed and renormalised; ``dist`` itself when nothing else had mass (removing x
    then had probability 0). The point-mass proposal's residual: ``norm(max(p - delta_x, 0))``."""
    rest = dist.clone()
    rest[x] = 0
    return normalize_or(rest, dist)


def ratio(px: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """``p(x) / q(x)`` of a draft x (0-d float32): its test accepts with probability ``min(1, ratio)``; inf when
    q(x) = 0 < p(x), 0 when both are 0."""
    safe = torch.where(qx > 0, qx, torch.ones_like(qx))
    return torch.where(qx > 0, px / safe, torch.where(px > 0, torch.full_like(px, float("inf")), torch.zeros_like(px)))


def rrs_rejected(p: torch.Tensor, q: torch.Tensor, x: int, replacement: bool = False) -> tuple:
    """Recursive rejection sampling after draft x was rejected: ``p <- norm(max(p - q, 0))`` (p kept when that is
    empty: the rejection had probability 0), and without replacement ``q <- q`` without x (zeros when nothing is
    left). Returns (p, q)."""
    p = normalize_or((p - q).clamp(min=0), p)
    if not replacement:
        rest = q.clone()
        rest[x] = 0
        q = normalize_or(rest, torch.zeros_like(q))
    return p, q


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
    a = int(q.argmax())  # the plan's scalars are read on the host: SpecHub is not on the fast path
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


def fetch(values: list) -> list[float]:
    """Python floats of ``values`` (floats and 0-d or 1-d tensors, mixed; a 1-d tensor gives its entries in order,
    flattened into the result) in one device-to-host transfer (float64: token ids and probabilities exact)."""
    tensors = [v.reshape(-1).double() for v in values if isinstance(v, torch.Tensor)]
    host = iter(torch.cat([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    out: list[float] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.extend(next(host) for _ in range(v.numel()))
        else:
            out.append(float(v))
    return out
