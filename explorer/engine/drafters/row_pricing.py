"""Free drafts are free to draft, not to verify: each one is a target row. Where rows cost time, keep the ones
that pay for theirs.

A free drafter fills the same slots step after step (Token Recycling: its static tree template's nodes).
``RowPricing`` measures, per slot, how often its token continues the committed text given that its parent's did
(the slot's *conditional acceptance*), and keeps the prefix of the slots, best first, that maximises the step's
expected tokens per millisecond:

    (1 + sum of kept slots' path acceptance) / (one_row_ms + jump_ms + kept * row_ms)

One committed token per step is certain (the bonus token); ``one_row_ms`` is a plain step, and a tree's first
extra row may cost more than the others (``jump_ms``). Keeping no slot makes the step a plain one. A slot's path
acceptance is the product of the conditional acceptances along its path, so a child never ranks above its parent
and every prefix is a tree. This is SmartSpec's goodput rule (Liu et al. 2024, arXiv 2406.14066) applied to the rows
of one tree instead of to the number of draft steps; Sequoia sizes its trees from the same ratio of accepted tokens
to verification cost.

Every offered slot is observed, kept or not, once the committed text reaches its depth (often a few steps later):
whether its token continues the text there given that its parent's did. Greedy, that is exactly whether it would
have been accepted (the committed text is the target's greedy continuation whatever the tree); sampling, it is a
draw with its chance of being accepted as a point-mass draft. So a dropped slot, however deep, comes back as soon
as it starts matching. The estimates are exponential moving averages over observations (``decay``) from an even
prior (each slot's token continues the text half the time).

The tree shape depends only on earlier steps' tokens and the measured row cost, never on this step's draws: the
output law is unchanged (the audit checks it). ``rewind`` forgets the measurements with the drafter's own state,
so a rewound run retraces its steps.
"""

from __future__ import annotations

from dataclasses import replace

from .base import FreeNode

MAX_PENDING = 64
"""Steps whose offered nodes wait for the committed text to reach them; older ones are dropped unobserved."""


class RowPricing:
    """Per-slot acceptance of a free drafter's nodes, and the subset of a step's nodes worth their rows.

    Costs are those of ``forward_costs.row_prices``: a step of n >= 1 free nodes costs ``one_row_ms + jump_ms +
    n * row_ms``, a step of none ``one_row_ms`` (a plain step). They are used as prices in plain steps rounded to
    1 % (``row_price``, ``jump_price``), so that the few percent of timing noise between two runs' measurements
    rarely changes a tree.

    Args:
        one_row_ms: the target's one-row forward on this machine (ms).
        row_ms: its marginal cost per extra query row (ms).
        jump_ms: what the first extra row costs beyond ``row_ms`` (ms; a change of BLAS kernel).
        decay: weight of past observations per new one (0..1); 0.9 forgets over about ten steps.
        prior: (hits, misses) every slot starts from; (1, 1) is an even chance.

    Raises ValueError for a non-positive ``one_row_ms``, a negative ``row_ms`` or ``jump_ms``, or a ``decay``
    outside [0, 1).
    """

    def __init__(self, one_row_ms: float, row_ms: float, jump_ms: float = 0.0, decay: float = 0.9,
                 prior=(1.0, 1.0)):
        if not one_row_ms > 0 or not row_ms >= 0 or not jump_ms >= 0:
            raise ValueError("row pricing needs one_row_ms > 0, row_ms >= 0 and jump_ms >= 0 "
                             f"(got {one_row_ms}, {row_ms}, {jump_ms})")
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.one_row_ms, self.row_ms, self.jump_ms = float(one_row_ms), float(row_ms), float(jump_ms)
        self.row_price = round(self.row_ms / self.one_row_ms, 2)
        self.jump_price = round(self.jump_ms / self.one_row_ms, 2)
        self.decay = float(decay)
        self.prior = (float(prior[0]), float(prior[1]))
        self.reset()

    @classmethod
    def from_prices(cls, prices: dict | None) -> RowPricing | None:
        """Pricing at ``prices`` (``{"one_row_ms", "jump_ms", "row_ms"}``: ``forward_costs.row_prices``, or a
        trace's ``model["row_pricing"]``), or None where there are none (rows are not dear here). Raises KeyError,
        TypeError or ValueError for a malformed record."""
        if not prices:
            return None
        return cls(float(prices["one_row_ms"]), float(prices["row_ms"]), float(prices.get("jump_ms", 0.0)))

    def reset(self) -> None:
        """Forget every observation (a rewound run starts from the prior again)."""
        self.hits: dict = {}  # slot -> decayed count of observations where its token continued the text
        self.seen: dict = {}  # slot -> decayed count of observations
        # per offered step: (committed length it hung from, nodes, their depths, per-node state: None = waiting,
        # True / False = observed, "dead" = its parent did not continue the text)
        self._pending: list[tuple] = []

    @property
    def prices(self) -> dict:
        """The costs it prices with, as ``forward_costs.row_prices`` gives them (ms): what a trace records and
        a replay takes back (``factory.build_parts(..., follow=trace)``)."""
        return {"one_row_ms": round(self.one_row_ms, 3), "jump_ms": round(self.jump_ms, 3),
                "row_ms": round(self.row_ms, 3)}

    def conditional(self, slot) -> float:
        """The slot's measured chance that its token continues the text when its parent's did (0..1)."""
        a, b = self.prior
        return (self.hits.get(slot, 0.0) + a) / (self.seen.get(slot, 0.0) + a + b)

    def choose(self, nodes: list[FreeNode], at: int) -> tuple[list[FreeNode], dict]:
        """The nodes worth their rows, in their given order with parents re-indexed, and a record for the trace:
        ``{"offered", "kept", "expected_tokens", "row_ms", "jump_ms", "one_row_ms"}`` (expected tokens of the
        kept tree, the bonus token included; none kept: a plain step). ``at``: the committed length the tree hangs
        from (its depth-1 nodes propose the token at index ``at``). Nodes whose slot is None are kept (the drafter
        does not price them)."""
        path: list[float] = []
        depth: list[int] = []
        for node in nodes:
            depth.append(1 if node.parent < 0 else depth[node.parent] + 1)
            up = 1.0 if node.parent < 0 else path[node.parent]
            path.append(up if node.slot is None else up * self.conditional(node.slot))
        order = sorted(range(len(nodes)), key=lambda i: (nodes[i].slot is not None, -path[i], i))
        best_n, best_rate, gain = 0, 1.0, 0.0  # tokens per plain step's time: a plain step commits one
        for n, i in enumerate(order, start=1):
            gain += path[i]
            rate = (1.0 + gain) / (1.0 + self.jump_price + n * self.row_price)
            if rate > best_rate or nodes[i].slot is None:
                best_n, best_rate = n, rate
        if nodes:
            self._pending.append((int(at), list(nodes), depth, [None] * len(nodes)))
            del self._pending[:-MAX_PENDING]
        kept = sorted(order[:best_n])
        new_index = {i: k for k, i in enumerate(kept)}
        out = [replace(nodes[i], parent=-1 if nodes[i].parent < 0 else new_index[nodes[i].parent]) for i in kept]
        record = {"offered": len(nodes), "kept": len(out),
                  "expected_tokens": round(1.0 + sum(path[i] for i in kept), 3), **self.prices}
        return out, record

    def observe(self, committed: list[int]) -> None:
        """Learn from the committed text (token ids, prompt included) what the text now says about every node
        offered in earlier ``choose`` calls, kept or not: a node whose parent continued the text is observed
        once the text reaches its depth. Each node is observed once; a step's nodes are dropped when all are
        settled (or after ``MAX_PENDING`` later steps)."""
        still = []
        for entry in self._pending:
            at, nodes, depth, state = entry
            for i, node in enumerate(nodes):
                if state[i] is not None:
                    continue
                up = True if node.parent < 0 else state[node.parent]
                if up is None:
                    continue  # its parent waits for the text too
                if up is not True:
                    state[i] = "dead"  # its parent did not continue the text: no observation
                    continue
                pos = at + depth[i] - 1
                if pos >= len(committed):
                    continue
                hit = committed[pos] == node.token
                state[i] = hit
                if node.slot is not None:
                    self.hits[node.slot] = self.decay * self.hits.get(node.slot, 0.0) + float(hit)
                    self.seen[node.slot] = self.decay * self.seen.get(node.slot, 0.0) + 1.0
            if any(s is None for s in state):
                still.append(entry)
        self._pending = still
