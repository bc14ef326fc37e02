"""The draft tree that maximises the expected number of accepted tokens for measured acceptance rates.

Model
-----
A draft tree hangs from the *anchor*, the last committed token (always "accepted"). A tree is a list ``parents`` of
``N`` ints (-1 = the anchor) in which every parent precedes its child; siblings are ordered by *rank*: the first
child of a node in the list is rank 0 (the draft's best candidate), the next rank 1, and so on. Verification walks
down from the anchor: at an accepted node its children are tested in rank order, the child of rank ``r`` at depth
``d`` (1 for the anchor's children) being accepted with probability ``acc(d, r)`` given that the ranks below ``r``
were rejected; at most one child is accepted and the walk goes on below it. Hence

    P(child of rank r accepted) = P(parent accepted) * prod_{j<r} (1 - acc(d, j)) * acc(d, r)

and one target call commits ``1 + sum_nodes P(node accepted)`` tokens (the bonus token plus the accepted path).
This is the *positional acceptance* assumption of Sequoia (Chen et al. 2024, "Sequoia: Scalable, Robust, and
Hardware-aware Speculative Decoding", arXiv 2402.12374), made depth dependent: ``acc[d-1][r]`` is the table entry,
a tree deeper than the table reuses its last row, and a rank beyond a row's length is never accepted.

Dynamic program
---------------
Sequoia's dynamic program, with the row that a node's children read in the state (the table depends on depth, so
the value of a subtree depends on where it hangs; rows repeat past the table, so that row index is capped at the
last row). ``V(c, h, n)`` is the best expected number of accepted nodes strictly below an accepted node whose
children read row ``c``, with at most ``h`` more levels and ``n`` nodes. The children are a knapsack over ranks:

    H(r, m) = max(0, max_{1<=s<=m} w_r * (1 + V(c', h-1, s-1)) + H(r+1, m-s)),    V(c, h, n) = H(0, n)

where ``w_r = prod_{j<r}(1 - acc[c][j]) * acc[c][r]`` is the probability that rank ``r`` is reached and accepted,
``s`` the size of its subtree and ``c' = min(c+1, rows-1)``. ``0`` stops adding ranks (ranks are contiguous: the
child of rank ``r`` exists only if ranks ``< r`` do). One run fills the table for every budget and depth limit.

Costs
-----
``step_cost_ms`` prices a tree under our engine's drafting (one draft forward per level, fed the whole previous
level, then one target forward of ``1 + N`` rows) and ``fastest_tree`` picks, among the optima for every budget and
depth limit, the one with the most tokens per second.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from numbers import Integral, Real

import numpy as np

from ..engine.speedup import interpolate_ms

_TIE = 1e-12  # values this close count as equal, so that the tree with fewer nodes wins


class OptimalTreeError(ValueError):
    """Invalid input to the optimal-tree instrument (table, tree, budget, depth or cost); the message says what."""


@dataclass(frozen=True)
class OptimalTree:
    """A draft tree and its expected yield.

    ``parents`` is breadth-first with children in rank order; ``expected_tokens`` counts the bonus token;
    ``node_probabilities[i]`` is P(node i accepted); ``level_widths[l]`` is the number of nodes at depth ``l + 1``.
    ``cost_ms`` (one speculative step) and ``tokens_per_s`` are filled by ``fastest_tree`` only.
    """

    parents: tuple[int, ...]
    expected_tokens: float
    node_probabilities: tuple[float, ...]
    depth: int
    level_widths: tuple[int, ...]
    cost_ms: float | None = None
    tokens_per_s: float | None = None

    @property
    def nodes(self) -> int:
        return len(self.parents)

    def to_dict(self) -> dict:
        """Plain JSON-able data: lists, ints, floats and None."""
        return {
            "parents": list(self.parents),
            "nodes": self.nodes,
            "expected_tokens": self.expected_tokens,
            "node_probabilities": list(self.node_probabilities),
            "depth": self.depth,
            "level_widths": list(self.level_widths),
            "cost_ms": self.cost_ms,
            "tokens_per_s": self.tokens_per_s,
        }


# ---------------------------------------------------------------------------------------------------- validation


def _check_table(acc) -> tuple[tuple[float, ...], ...]:
    """The acceptance table as a tuple of non-empty rows of floats in [0, 1]."""
    hint = "give one list of per-rank acceptance probabilities per depth, e.g. [[0.6, 0.2], [0.5]]"
    if isinstance(acc, (str, bytes)):
        raise OptimalTreeError(f"acceptance table must be a list of rows, got a string: {hint}")
    try:
        rows = list(acc)
    except TypeError:
        raise OptimalTreeError(f"acceptance table must be a list of rows, got {acc!r}: {hint}") from None
    if not rows:
        raise OptimalTreeError(f"acceptance table is empty: {hint}")
    table = []
    for d, row in enumerate(rows, 1):
        if isinstance(row, (str, bytes)):
            raise OptimalTreeError(f"acceptance row {d} is a string: {hint}")
        try:
            values = list(row)
        except TypeError:
            raise OptimalTreeError(f"acceptance row {d} is {row!r}, not a list: {hint}") from None
        if not values:
            raise OptimalTreeError(f"acceptance row {d} (depth {d}) is empty: give at least rank 0")
        for r, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, Real) or not math.isfinite(float(v)) \
                    or not 0.0 <= float(v) <= 1.0:
                raise OptimalTreeError(f"acceptance at depth {d}, rank {r} is {v!r}: must be a probability in [0, 1]")
        table.append(tuple(float(v) for v in values))
    return tuple(table)


def _check_parents(parents) -> tuple[int, ...]:
    if isinstance(parents, (str, bytes)):
        raise OptimalTreeError("parents must be a list of integers (-1 = the anchor), got a string")
    try:
        items = list(parents)
    except TypeError:
        raise OptimalTreeError(f"parents must be a list of integers (-1 = the anchor), got {parents!r}") from None
    out = []
    for i, p in enumerate(items):
        if isinstance(p, bool) or not isinstance(p, Integral):
            raise OptimalTreeError(f"parent of node {i} is {p!r}, not an integer")
        p = int(p)
        if p < -1:
            raise OptimalTreeError(f"parent of node {i} is {p}: use -1 for the anchor, never less")
        if p >= i:
            raise OptimalTreeError(f"node {i} has parent {p}: parents must come before their children")
        out.append(p)
    return tuple(out)


def _check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, Integral):
        raise OptimalTreeError(f"budget must be an integer number of nodes, got {budget!r}")
    if budget < 0:
        raise OptimalTreeError(f"budget is {budget}: it must be >= 0 nodes")
    return int(budget)


def _check_depth(max_depth, budget: int) -> int:
    if max_depth is None:
        return max(budget, 1)
    if isinstance(max_depth, bool) or not isinstance(max_depth, Integral):
        raise OptimalTreeError(f"max_depth must be an integer number of levels, got {max_depth!r}")
    if max_depth < 1:
        raise OptimalTreeError(f"max_depth is {max_depth}: it must be >= 1 level")
    return int(max_depth)


# --------------------------------------------------------------------------------------------- expected tokens


def _depths(parents: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def _level_widths(parents: tuple[int, ...]) -> tuple[int, ...]:
    widths: list[int] = []
    for d in _depths(parents):
        if d > len(widths):
            widths.extend([0] * (d - len(widths)))
        widths[d - 1] += 1
    return tuple(widths)


def _acceptance(table, depth: int, rank: int) -> float:
    row = table[min(depth, len(table)) - 1]
    return row[rank] if rank < len(row) else 0.0


def _probabilities(parents: tuple[int, ...], table) -> list[float]:
    probs: list[float] = []
    depths: list[int] = []
    seen: dict[int, tuple[int, float]] = {}  # parent -> (children so far, P(all of them rejected))
    for p in parents:
        d = 1 if p < 0 else depths[p] + 1
        rank, rejected = seen.get(p, (0, 1.0))
        a = _acceptance(table, d, rank)
        probs.append((1.0 if p < 0 else probs[p]) * rejected * a)
        seen[p] = (rank + 1, rejected * (1.0 - a))
        depths.append(d)
    return probs


def node_probabilities(parents, acc) -> list[float]:
    """P(node accepted) for each node of a tree.

    Args:
        parents: ``N`` parent indices (-1 = the anchor), every parent before its child; siblings in rank order.
        acc: acceptance table, ``acc[d-1][r]`` for depth ``d`` (1-based) and rank ``r``.

    Returns:
        ``N`` probabilities, in the order of ``parents``.

    Raises:
        OptimalTreeError: a bad table (empty, an empty row, a value outside [0, 1] or not finite) or bad parents
            (not integers, below -1, or a parent that does not precede its child).
    """
    return _probabilities(_check_parents(parents), _check_table(acc))


def expected_tokens(parents, acc) -> float:
    """Expected tokens committed by one target call: 1 (the bonus token) + the sum of ``node_probabilities``.

    Arguments and errors as ``node_probabilities``; an empty tree gives 1.0.
    """
    return 1.0 + math.fsum(node_probabilities(parents, acc))


def _make_tree(parents: tuple[int, ...], table) -> OptimalTree:
    probs = _probabilities(parents, table)
    widths = _level_widths(parents)
    return OptimalTree(parents=parents, expected_tokens=1.0 + math.fsum(probs), node_probabilities=tuple(probs),
                       depth=len(widths), level_widths=widths)


# ------------------------------------------------------------------------------------------- dynamic program


def _rank_weights(row: tuple[float, ...], budget: int) -> np.ndarray:
    """``w[r]``: P(rank r is reached and accepted | parent accepted). Trailing zeros are cut: they add nothing."""
    weights, rejected = [], 1.0
    for a in row[:budget]:
        weights.append(rejected * a)
        rejected *= 1.0 - a
    w = np.array(weights, dtype=float)
    positive = np.flatnonzero(w > 0.0)
    return w[: positive[-1] + 1] if positive.size else w[:0]


def _fewest(values: np.ndarray, n: int) -> int:
    """The fewest nodes reaching ``values[n]`` (``values`` is non-decreasing in the node count)."""
    return int(np.argmax(values[: n + 1] >= values[n] - _TIE))


def _bfs_parents(children: tuple) -> tuple[int, ...]:
    """Breadth-first parents of a nested tree (each node = the tuple of its children, in rank order)."""
    parents: list[int] = []
    queue = deque([(children, -1)])
    while queue:
        kids, p = queue.popleft()
        for kid in kids:
            parents.append(p)
            queue.append((kid, len(parents) - 1))
    return tuple(parents)


class _Sequoia:
    """The filled DP for every budget ``<= budget`` and depth limit ``<= depth``; ``tree(n, d)`` reconstructs."""

    def __init__(self, table, budget: int, depth: int):
        self.table = table
        self.budget = budget
        self.depth = min(depth, budget)  # n nodes never make more than n levels
        self.zero = np.zeros(budget + 1)
        self.values: dict[tuple[int, int], np.ndarray] = {}  # (row c, levels h) -> V(c, h, 0..budget)
        self.knapsacks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # -> (w, H[rank, nodes])
        self._subtrees: dict[tuple[int, int, int], tuple] = {}
        self._trees: dict[tuple, OptimalTree] = {}
        self._fill()

    def _child_row(self, c: int) -> int:
        return min(c + 1, len(self.table) - 1)

    def _child_values(self, c: int, h: int) -> np.ndarray:
        return self.zero if h == 1 else self.values[(self._child_row(c), h - 1)]

    def _fill(self) -> None:
        b = self.budget
        if b == 0:
            return
        # cand[m, s-1] = w_r * (1 + V(s-1)) + H(r+1, m-s) for subtree sizes s = 1..m; s > m is masked out.
        rest = np.arange(b + 1)[:, None] - np.arange(1, b + 1)[None, :]
        invalid = rest < 0
        rest[invalid] = 0
        weights = [_rank_weights(row, b) for row in self.table]
        for h in range(1, self.depth + 1):
            # A node whose children read row c sits at depth >= c, so c + h <= depth covers every reachable state.
            for c in range(min(len(self.table) - 1, self.depth - h) + 1):
                gain = 1.0 + self._child_values(c, h)[:-1]
                w = weights[c]
                knap = np.zeros((len(w) + 1, b + 1))
                for r in range(len(w) - 1, -1, -1):
                    cand = w[r] * gain[None, :] + knap[r + 1][rest]
                    cand[invalid] = -np.inf
                    knap[r] = np.maximum(cand.max(axis=1), 0.0)
                self.knapsacks[(c, h)] = (w, knap)
                self.values[(c, h)] = knap[0]

    def _children(self, c: int, h: int, n: int) -> tuple:
        """Optimal children (nested tuples, rank order) of an accepted node in state ``(c, h)`` with ``<= n`` nodes."""
        key = (c, h, n)
        if key not in self._subtrees:
            children = []
            if h > 0 and n > 0:
                w, knap = self.knapsacks[(c, h)]
                gain = 1.0 + self._child_values(c, h)
                m = n
                for r in range(len(w)):
                    m = _fewest(knap[r], m)  # fewest nodes for these ranks' best value: no useless nodes
                    if m == 0:
                        break
                    sizes = np.arange(1, m + 1)
                    s = int(np.argmax(w[r] * gain[sizes - 1] + knap[r + 1][m - sizes])) + 1
                    children.append(self._children(self._child_row(c), h - 1, s - 1))
                    m -= s
            self._subtrees[key] = tuple(children)
        return self._subtrees[key]

    def tree(self, n: int, d: int) -> OptimalTree:
        """The optimum for budget ``n <= budget`` and depth limit ``d <= depth`` (as given to the constructor)."""
        h = min(d, n)
        nested = self._children(0, h, n) if h > 0 else ()
        if nested not in self._trees:
            self._trees[nested] = _make_tree(_bfs_parents(nested), self.table)
        return self._trees[nested]


def optimal_tree(acc, budget: int, max_depth: int | None = None) -> OptimalTree:
    """The tree of at most ``budget`` nodes (anchor excluded) and ``max_depth`` levels with the most expected tokens.

    Sequoia's dynamic program (see the module docstring); among trees of equal value the one with fewest nodes.
    Cost ``O(min(rows, depth) * depth * ranks * budget**2)``: budget 64, depth 16 takes a few tens of ms.

    Args:
        acc: acceptance table, ``acc[d-1][r]`` for depth ``d`` (1-based) and rank ``r``.
        budget: most draft nodes (tokens), >= 0; 0 gives the empty tree (1.0 expected tokens).
        max_depth: most levels, >= 1; None means ``budget`` (no limit).

    Returns:
        An ``OptimalTree`` in breadth-first order, children in rank order.

    Raises:
        OptimalTreeError: a bad table, a negative or non-integer budget, or ``max_depth < 1``.
    """
    table = _check_table(acc)
    budget = _check_budget(budget)
    depth = _check_depth(max_depth, budget)
    return _Sequoia(table, budget, depth).tree(budget, depth)


def optimal_trees(acc, max_budget: int, max_depth: int | None = None) -> dict[tuple[int, int], OptimalTree]:
    """The optimum for every budget ``0..max_budget`` and depth limit ``1..max_depth``, from one DP run.

    Returns:
        ``{(budget, max_depth): OptimalTree}``; each entry equals ``optimal_tree(acc, budget, max_depth)``
        (equal trees are the same object).

    Raises:
        OptimalTreeError: as ``optimal_tree``.
    """
    table = _check_table(acc)
    max_budget = _check_budget(max_budget)
    depth = _check_depth(max_depth, max_budget)
    dp = _Sequoia(table, max_budget, depth)
    return {(n, d): dp.tree(n, d) for n in range(max_budget + 1) for d in range(1, depth + 1)}


# ------------------------------------------------------------------------------------------------------- costs


def cost_curve(points: Mapping[int, float]) -> Callable[[int], float]:
    """A forward's cost in ms as a function of its row count, from measurements ``{rows: ms}``.

    Linear between measured row counts. Below the smallest one it is flat (small forwards are latency bound, never
    cheaper than the narrowest measured); above the largest it goes on with the last segment's slope, clamped at
    >= 0 so that noise never makes a wider forward cheaper (flat when only one point is given).

    Raises:
        OptimalTreeError: no points, a row count that is not an integer >= 1, or a cost that is not finite and >= 0.
    """
    if not isinstance(points, Mapping) or not points:
        raise OptimalTreeError(f"cost points must be a non-empty {{rows: ms}} mapping, got {points!r}")
    for rows, ms in points.items():
        if isinstance(rows, bool) or not isinstance(rows, Integral) or rows < 1:
            raise OptimalTreeError(f"cost point rows {rows!r}: must be an integer >= 1")
        if isinstance(ms, bool) or not isinstance(ms, Real) or not math.isfinite(float(ms)) or ms < 0:
            raise OptimalTreeError(f"cost at {rows} rows is {ms!r}: must be a finite number of ms >= 0")
    measured = dict(points)  # a snapshot: later changes to the caller's mapping do not move the curve
    return lambda rows: interpolate_ms(measured, rows)


def _as_curve(cost, name: str) -> Callable[[int], float]:
    if isinstance(cost, Mapping):
        return cost_curve(cost)
    if callable(cost):
        return cost
    raise OptimalTreeError(f"{name} must be a callable rows -> ms or a {{rows: ms}} mapping, got {cost!r}")


def _forward_ms(curve: Callable[[int], float], rows: int, name: str) -> float:
    ms = curve(rows)
    if isinstance(ms, bool) or not isinstance(ms, Real) or not math.isfinite(float(ms)) or ms < 0:
        raise OptimalTreeError(f"{name}({rows}) returned {ms!r}: a forward must cost a finite number of ms >= 0")
    return float(ms)


def step_cost_ms(parents, draft_ms, target_ms) -> float:
    """Wall time (ms) of one speculative step with this tree under our engine's drafting.

    The draft runs one forward per level, fed the whole previous level: rows ``[1, w_1, ..., w_{depth-1}]`` (the
    anchor, then each level's width); the target runs one forward of ``1 + N`` rows. An empty tree costs
    ``target_ms(1)`` and no draft forward.

    Args:
        parents: ``N`` parent indices (-1 = the anchor), every parent before its child.
        draft_ms, target_ms: a callable ``rows -> ms`` or measurements ``{rows: ms}`` (see ``cost_curve``).

    Raises:
        OptimalTreeError: bad parents, a cost that is neither callable nor a mapping, or a forward costing a
            negative or non-finite time.
    """
    parents = _check_parents(parents)
    draft = _as_curve(draft_ms, "draft_ms")
    target = _as_curve(target_ms, "target_ms")
    widths = _level_widths(parents)
    draft_rows = [1, *widths[:-1]] if widths else []
    return math.fsum(_forward_ms(draft, rows, "draft_ms") for rows in draft_rows) \
        + _forward_ms(target, 1 + len(parents), "target_ms")


def fastest_tree(acc, budget: int, max_depth: int | None, draft_ms, target_ms) -> OptimalTree:
    """Among the optima for every budget ``<= budget`` and depth limit ``<= max_depth`` (the empty tree included),
    the one with the most tokens per second, ``expected_tokens / step_cost_ms * 1000``; ties go to fewer nodes.

    Args:
        acc: acceptance table, as ``optimal_tree``.
        budget: most draft nodes, >= 0. max_depth: most levels, >= 1, or None for no limit.
        draft_ms, target_ms: forward cost, a callable ``rows -> ms`` or ``{rows: ms}`` (see ``cost_curve``).

    Returns:
        The ``OptimalTree`` with ``cost_ms`` and ``tokens_per_s`` filled.

    Raises:
        OptimalTreeError: as ``optimal_tree`` and ``step_cost_ms``, or a step costing 0 ms (infinitely fast).
    """
    draft = _as_curve(draft_ms, "draft_ms")
    target = _as_curve(target_ms, "target_ms")
    candidates = {tree.parents: tree for tree in optimal_trees(acc, budget, max_depth).values()}
    best: OptimalTree | None = None
    for tree in sorted(candidates.values(), key=lambda t: (t.nodes, t.depth, t.parents)):
        cost = step_cost_ms(tree.parents, draft, target)
        if cost <= 0.0:
            raise OptimalTreeError(f"a step with {tree.nodes} nodes costs {cost} ms: costs must be positive")
        speed = tree.expected_tokens / cost * 1000.0
        # A relative margin, so float noise never buys a bigger tree.
        if best is None or speed > best.tokens_per_s * (1.0 + _TIE):
            best = replace(tree, cost_ms=cost, tokens_per_s=speed)
    return best


# ------------------------------------------------------------------------------------------------ descriptions


def as_k_config(parents) -> tuple[int, ...] | None:
    """The k_config (children per node at each level) when ``parents`` is exactly the full uniform tree that
    ``explorer.engine.tree.k_config_parents`` builds, else None (an irregular tree, or the empty one).

    Raises:
        OptimalTreeError: bad parents.
    """
    parents = _check_parents(parents)
    if not parents:
        return None
    counts = [0] * len(parents)
    for p in parents:
        if p >= 0:
            counts[p] += 1
    levels: dict[int, list[int]] = {}
    for i, d in enumerate(_depths(parents)):
        levels.setdefault(d, []).append(i)
    k_config = [len(levels[1])]
    for d in range(1, len(levels)):
        per_node = {counts[i] for i in levels[d]}
        if len(per_node) != 1:
            return None
        k_config.append(per_node.pop())
    from explorer.engine.tree import k_config_parents  # here, not at the top: explorer.tree imports torch

    return tuple(k_config) if tuple(k_config_parents(k_config)) == parents else None


def summary(tree: OptimalTree) -> str:
    """One line, e.g. "23 nodes, depth 5, level widths 4-8-6-3-2, 3.41 expected tokens per call", plus the step
    cost and tokens/s when ``fastest_tree`` filled them."""
    widths = "-".join(str(w) for w in tree.level_widths) or "none"
    text = (f"{tree.nodes} node{'' if tree.nodes == 1 else 's'}, depth {tree.depth}, level widths {widths}, "
            f"{tree.expected_tokens:.2f} expected tokens per call")
    if tree.cost_ms is not None:
        text += f", {tree.cost_ms:.2f} ms per step"
    if tree.tokens_per_s is not None:
        text += f", {tree.tokens_per_s:.1f} tokens/s"
    return text
