"""How many of an EAGLE head's drawn nodes a step verifies, chosen online from measured acceptance and cost.

EAGLE-2's dynamic tree (``drafters/eagle.py``) draws ``top_k`` children under the best nodes of each level and keeps
the ``tokens`` best by cumulative draft probability. A fixed ``tokens`` fits one machine: on a GPU extra query rows
are nearly free and 16-64 nodes pay; on a 2-core CPU a 17-row target forward costs about 1.5 one-row forwards
(docs/heads.md: with the shipped head 8 nodes ran at 1.18x ``ar`` on the kinds set where 16 ran at 1.08x and 24 at
0.93x). And the best size moves from step to step: where the head is sure, a long chain pays; where it hesitates,
rows are spent on branches that are rarely accepted.

``TreeSizer`` picks each step's size from what the run measured (the goodput rule of Liu et al. 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput", arXiv 2406.14066: the speculation that
maximises expected tokens per unit of time):

* **acceptance by (depth, rank, q)**: for every verified node, its acceptance probability under the run's rule given
  that its parent was reached and its earlier-tested siblings were rejected (``NodeOdds.accept_prob``: 0 or 1 when
  greedy), averaged in cells of depth (1, 2, 3+), draw rank among siblings (0, 1, 2+) and the head's probability q
  of the token (``Q_EDGES``). A cell starts from ``PRIOR_N`` pseudo-observations at its q, EAGLE-2's observation
  that a draft's confidence approximates its acceptance;
* **what a step costs**: the target's forward by rows (``forward_costs.verification_cost``, measured once per pair)
  plus a running mean of the drafter's own milliseconds per step (the head's forwards and the host work around
  them, which do not depend on how many nodes are kept).

How deep the head drafts is chosen the same way (``deepen``): before each level past the first, the level's
expected tokens (the frontier nodes' chances that their paths are accepted, times the chance one of a node's
children is, from the acceptance measured at that depth by draw rank) are weighed against what a level cost so far
(a running mean of its milliseconds: the head's forward and the draws after it) at the last step's tokens per
millisecond; a level that adds less than it costs, and every level below it, is not drafted. On a 2-core CPU a level
costs about 5 ms of a 250 ms step; on a GPU, where the target's verification takes 5 ms, an eager level costs a good
part of it.

The kept nodes come best first, every prefix closed under parents and earlier-drawn siblings (``eagle._best_closed``),
so the size ``n`` keeps the first ``n``. Its expected tokens are 1 (the bonus token) plus, per kept node, the
chance its whole path is accepted (its parent's, times each earlier kept sibling's rejection, times its own
acceptance); the step drafts the ``n`` with the most expected tokens per modelled millisecond. The choice reads
only earlier steps and this step's draft probabilities, never the target's, so the output law is unchanged. It
reads wall times, so a replay takes the recorded sizes (``force``; ``factory._follow``).
"""

from __future__ import annotations

from bisect import bisect_right

from ..speedup import interpolate_ms

Q_EDGES = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)
"""Bin edges of the head's probability q of a node's token (8 bins)."""
DEPTHS, RANKS = 3, 3
"""Depth cells 1, 2, 3+ and rank cells 0, 1, 2+."""
PRIOR_N = 2.0
"""Pseudo-observations each cell starts from, at its bin's middle q."""
WARMUP = 4
"""Steps drafted with every kept node before the sizer trusts its measurements."""
DECAY = 0.8
"""Weight of the past in the running mean of the drafter's milliseconds per step."""


def _depth_rank(depth: int, rank: int) -> tuple[int, int]:
    """The (depth, rank) cell indices of a node at ``depth`` (>= 1; 3+ share one) drawn ``rank``-th (2+ share one)."""
    return min(max(int(depth), 1), DEPTHS) - 1, min(max(int(rank), 0), RANKS - 1)


def _bin_middles() -> list[float]:
    edges = (0.0, *Q_EDGES, 1.0)
    return [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]


class TreeSizer:
    """Picks how many of a head's drawn nodes a step verifies (module docstring).

    Args:
        target_ms: the target's forward milliseconds by query rows, ``{rows: ms}`` (at least one entry; keys may be
            strings, as a trace read back from JSON has them).
        most: the most nodes a step verifies (the config's ``head_tokens``), >= 1.
        warmup: steps with ``most`` nodes before choosing.

    Raises:
        ValueError: ``most`` < 1 or ``target_ms`` empty.
    """

    def __init__(self, target_ms: dict, most: int, warmup: int = WARMUP):
        if int(most) < 1 or not target_ms:
            raise ValueError(f"a tree sizer needs at least one node and the target's costs, got {most!r}, "
                             f"{target_ms!r}")
        self.target_ms = {int(r): float(ms) for r, ms in target_ms.items()}
        self.most, self.warmup = int(most), int(warmup)
        self._forced: list[int] | None = None
        self._forced_levels: list[int | None] | None = None
        self.reset()

    def reset(self) -> None:
        middles = _bin_middles()
        cells = DEPTHS * RANKS * len(middles)
        self.n = [PRIOR_N] * cells
        self.accepted = [PRIOR_N * middles[c % len(middles)] for c in range(cells)]
        self.steps = 0
        self.draft_ms: float | None = None
        self.level_ms: float | None = None
        self.rate: float | None = None  # expected tokens per modelled ms of the last step sized on measurements
        self.seen = [[1.0] * RANKS for _ in range(DEPTHS)]  # tested nodes by (depth, rank) cell, one prior at 0.5
        self.hits = [[0.5] * RANKS for _ in range(DEPTHS)]
        self.last: dict | None = None
        self._chosen = 0

    def force(self, sizes: list[int], levels: list[int | None] | None = None) -> None:
        """Take these sizes, one per sized step in order (a replay's recorded ones), instead of choosing; and these
        numbers of levels drafted (None for a step that recorded none: every level, as before the depth was chosen)."""
        self._forced = [int(s) for s in sizes]
        self._forced_levels = None if levels is None else [None if n is None else int(n) for n in levels]

    @staticmethod
    def cell(depth: int, rank: int, q: float) -> int:
        """The calibration cell of a node at ``depth`` (>= 1), drawn ``rank``-th among its siblings, with
        probability ``q`` under the head."""
        d, r = _depth_rank(depth, rank)
        return (d * RANKS + r) * (len(Q_EDGES) + 1) + bisect_right(Q_EDGES, float(q))

    def acceptance(self, depth: int, rank: int, q: float) -> float:
        """The measured chance a node is accepted, given that it is tested (module docstring)."""
        c = self.cell(depth, rank, q)
        return self.accepted[c] / self.n[c]

    def record(self, nodes: list[tuple[int, int, float]], accept: list[float], draft_ms: float | None) -> None:
        """What one verified step measured: ``nodes[i] = (depth, rank, q)`` of each verified head node and
        ``accept[i]`` its acceptance probability under the run's rule (``NodeOdds.accept_prob``); ``draft_ms`` the
        drafter's wall milliseconds that step (None: not measured)."""
        for (depth, rank, q), a in zip(nodes, accept):
            c = self.cell(depth, rank, q)
            self.n[c] += 1.0
            self.accepted[c] += float(a)
            d, r = _depth_rank(depth, rank)
            self.seen[d][r] += 1.0
            self.hits[d][r] += float(a)
        self.steps += 1
        if draft_ms is not None:
            ms = float(draft_ms)
            self.draft_ms = ms if self.draft_ms is None else DECAY * self.draft_ms + (1 - DECAY) * ms

    def record_level(self, ms: float) -> None:
        """One drafted level's wall milliseconds (the head's forward of the frontier and the draws after it)."""
        self.level_ms = float(ms) if self.level_ms is None else DECAY * self.level_ms + (1 - DECAY) * float(ms)

    def deepen(self, level: int, frontier: list[int], parent: list[int], depth: list[int], rank: list[int],
               q: list[float], children: int) -> bool:
        """Whether to draft ``level`` (>= 2) under ``frontier``, the nodes it would expand, each with ``children``
        draws (module docstring). ``parent``, ``depth``, ``rank`` and ``q`` describe every node drawn so far, in draw
        order. A replay drafts the recorded number of levels; before the sizer has measured a level's cost and a
        step's rate, every level is drafted."""
        if self._forced_levels is not None:
            k = self._forced_levels[self._chosen] if self._chosen < len(self._forced_levels) else None
            return k is None or level <= k
        if self._forced is not None or self.steps < self.warmup or self.level_ms is None or self.rate is None:
            return True
        reach = self._reach(range(len(parent)), parent, depth, rank, q)
        missed = 1.0
        for rank_drawn in range(max(int(children), 1)):
            d, r = _depth_rank(level, rank_drawn)
            missed *= 1.0 - self.hits[d][r] / self.seen[d][r]
        gain = sum(reach[i] for i in frontier) * (1.0 - missed)
        return gain >= self.level_ms * self.rate

    def _reach(self, nodes, parent: list[int], depth: list[int], rank: list[int], q: list[float]) -> dict:
        """``{node: chance its whole path is accepted}`` for ``nodes`` (each after its parent and its earlier-drawn
        siblings; -1, the anchor, is 1): its parent's chance, times each earlier sibling's rejection, times its own
        acceptance. A node whose parent is not among them has none."""
        reach = {-1: 1.0}
        untaken: dict[int, float] = {}  # node -> P(every child tested so far rejected)
        for i in nodes:
            p = parent[i]
            a = self.acceptance(depth[i], rank[i], q[i])
            reach[i] = reach.get(p, 0.0) * untaken.get(p, 1.0) * a
            untaken[p] = untaken.get(p, 1.0) * (1.0 - a)
        return reach

    def expected_tokens(self, order: list[int], parent: list[int], depth: list[int], rank: list[int],
                        q: list[float]) -> list[float]:
        """Expected tokens a step commits when it keeps the first ``n`` of ``order`` (index ``n``, from 0 to
        ``len(order)``): 1 (the bonus token) plus each kept node's chance that its whole path is accepted.
        ``parent``, ``depth``, ``rank`` and ``q`` describe every drawn node (parent -1 = the anchor)."""
        reach = self._reach(order, parent, depth, rank, q)
        out = [1.0]
        for i in order:
            out.append(out[-1] + reach[i])
        return out

    def choose(self, order: list[int], parent: list[int], depth: list[int], rank: list[int],
               q: list[float]) -> int:
        """How many of ``order`` (the kept nodes, best first) this step verifies: a forced size, ``most`` during
        the warm-up, else the size with the most expected tokens per modelled millisecond (ties to the smaller).
        ``last`` keeps why, for the trace."""
        most = min(self.most, len(order))
        if self._forced is not None:
            k = self._forced[self._chosen] if self._chosen < len(self._forced) else most
            self._chosen += 1
            self.last = {"tokens": min(max(k, 0), len(order)), "why": "recorded"}
            return self.last["tokens"]
        self._chosen += 1
        if self.steps < self.warmup or not most:
            self.last = {"tokens": most, "why": "warm-up", "steps": self.steps}
            return most
        tokens = self.expected_tokens(order[:most], parent, depth, rank, q)
        overhead = self.draft_ms or 0.0
        best, best_rate = most, -1.0
        for n in range(1, most + 1):
            ms = overhead + interpolate_ms(self.target_ms, n + 1)
            rate = tokens[n] / ms if ms > 0 else tokens[n]
            if rate > best_rate + 1e-12:
                best, best_rate = n, rate
        best_ms = overhead + interpolate_ms(self.target_ms, best + 1)
        self.rate = tokens[best] / best_ms if best_ms > 0 else None
        self.last = {"tokens": best, "why": "fastest", "expected_tokens": round(tokens[best], 4),
                     "expected_all": round(tokens[most], 4), "draft_ms": round(overhead, 3),
                     "cost_ms": round(best_ms, 3)}
        return best


__all__ = ["TreeSizer"]
