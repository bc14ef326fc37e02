"""Draft trees: nodes in breadth-first order, k_config shapes, topology-aware attention masks and position ids.

Conventions (shared by drafting, verification, the engine and the trace):

* The *anchor* is the last committed token. Tree node ``i`` (0-based, breadth-first) hangs from the anchor when
  ``parent[i] == -1``; its ``depth`` is 1 then, and ``depth[parent] + 1`` otherwise.
* With ``L`` committed tokens the anchor sits at position ``L - 1`` and node ``i`` at position ``L - 1 + depth[i]``
  (not ``arange``: siblings share a position).
* A node attends to the committed context, to its ancestors and to itself: the topology-aware causal mask
  (MCSD, Yang et al. 2024; SpecInfer). Because nodes are stored level by level, the first ``s`` levels form a
  closed subtree and their mask is the top-left ``cum[s] x cum[s]`` slice of the full one: the *dynamic sliced*
  mask of the improved MCSD (Lu et al. 2024, arXiv 2409.10644), which lets drafting stop after any level.

Masks here are numpy bool arrays (True = may attend); ``to_float_mask`` turns them into the additive float mask a
Hugging Face model takes (0 where allowed, ``finfo(dtype).min`` elsewhere; a bool mask is silently wrong under
``eager`` attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class TreeShapeError(ValueError):
    """An invalid tree shape (k_config, width or depth): the message says what is wrong."""


def parse_k_config(value) -> tuple[int, ...]:
    """Validate a k_config: children per node at each level, e.g. ``(4, 2, 2)`` or the string ``"4,2,2"``.

    Raises:
        TreeShapeError: empty, non-integer, zero/negative entries, or more than 4096 nodes in total.
    """
    if isinstance(value, str):
        items = [s for s in value.replace(" ", "").split(",") if s != ""]
        if not items:
            raise TreeShapeError("k_config is empty: give children per level, e.g. 4,2,2")
        parsed = []
        for s in items:
            try:
                parsed.append(int(s))
            except ValueError:
                raise TreeShapeError(f"k_config entry {s!r} is not an integer (e.g. 4,2,2)") from None
        value = parsed
    try:
        items = list(value)
    except TypeError:
        raise TreeShapeError(f"k_config must be a list of integers, got {value!r}") from None
    if not items:
        raise TreeShapeError("k_config is empty: give children per level, e.g. 4,2,2")
    out = []
    for k in items:
        if isinstance(k, float) and k.is_integer():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TreeShapeError(f"k_config entry {k!r} is not an integer")
        if int(k) < 1:
            raise TreeShapeError(f"k_config entries must be >= 1 (a level with {int(k)} children ends the tree)")
        out.append(int(k))
    if tree_size(out) > 4096:
        raise TreeShapeError(f"k_config {tuple(out)} makes {tree_size(out)} nodes; at most 4096 fit one verification")
    return tuple(out)


def parse_tree_template(value) -> tuple[int, ...]:
    """Validate a tree template: the breadth-first parent index of every node (-1 = the anchor), siblings
    contiguous and in rank order, e.g. ``(-1, -1, 0, 0, 2)`` or the string ``"-1,-1,0,0,2"`` (the shape
    ``instruments.optimal_tree`` computes). Parents must be non-decreasing and precede their children.

    Raises:
        TreeShapeError: empty, non-integer entries, a parent that does not precede its child, parents out of
            breadth-first order, or more than 4096 nodes.
    """
    if isinstance(value, str):
        items = [s for s in value.replace(" ", "").split(",") if s != ""]
        try:
            value = [int(s) for s in items]
        except ValueError:
            raise TreeShapeError(f"tree template {value!r} must be comma-separated integers, e.g. -1,-1,0") from None
    try:
        items = list(value)
    except TypeError:
        raise TreeShapeError(f"a tree template must be a list of parent indices, got {value!r}") from None
    if not items:
        raise TreeShapeError("the tree template is empty: give each node's parent, -1 for the anchor's children")
    if len(items) > 4096:
        raise TreeShapeError(f"the tree template has {len(items)} nodes; at most 4096 fit one verification")
    out = []
    for i, p in enumerate(items):
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise TreeShapeError(f"tree template entry {p!r} is not an integer")
        p = int(p)
        if not -1 <= p < i:
            raise TreeShapeError(f"tree template node {i} has parent {p}: a parent is -1 or an earlier node")
        if out and p < out[-1]:
            raise TreeShapeError(f"tree template node {i} has parent {p} after a node with parent {out[-1]}: "
                                 "list nodes breadth-first, each parent's children together")
        out.append(p)
    return tuple(out)


def template_levels(parents) -> list[int]:
    """Largest number of children of one node at each level of a tree template (its per-level ``k``)."""
    d = depths(parents)
    counts: dict[int, int] = {}
    for p in parents:
        counts[p] = counts.get(p, 0) + 1
    levels = [0] * (max(d) if d else 0)
    for p, c in counts.items():
        level = 0 if p < 0 else d[p]
        levels[level] = max(levels[level], c)
    return levels


def tree_size(k_config) -> int:
    """Number of nodes of a full tree: ``k1 + k1*k2 + ...`` (28 for (4, 2, 2))."""
    total, width = 0, 1
    for k in k_config:
        width *= int(k)
        total += width
    return total


def k_config_parents(k_config) -> list[int]:
    """Breadth-first parent indices of the full tree of ``k_config`` (-1 = the anchor)."""
    parents: list[int] = []
    frontier = [-1]
    for k in k_config:
        level = []
        for p in frontier:
            for _ in range(k):
                parents.append(p)
                level.append(len(parents) - 1)
        frontier = level
    return parents


def rank_decay_parents(widths) -> tuple[list[int], list[int]]:
    """Breadth-first parents and sibling ranks of a static tree template (Token Recycling's tree, here built by
    one rule): a node at level ``l`` whose rank among its siblings is ``r`` (0 = the best candidate) gets
    ``floor(widths[l] / (r + 1))`` children, so better-ranked candidates grow wider and deeper subtrees.
    ``(8, 3, 2, 1, 1, 1, 1, 1)`` gives 40 nodes, 8 levels deep along the best candidates.

    Returns:
        ``(parents, ranks)``: ``N`` parent indices (-1 = the anchor) and each node's rank among its siblings.
    """
    parents: list[int] = []
    ranks: list[int] = []
    frontier = [(-1, 0)]
    for w in widths:
        level = []
        for p, r in frontier:
            for c in range(int(w) // (r + 1)):
                parents.append(p)
                ranks.append(c)
                level.append((len(parents) - 1, c))
        frontier = level
    return parents, ranks


def ancestor_matrix(parents) -> np.ndarray:
    """``anc[i, j]`` is True when node j is node i or one of its ancestors. Shape ``(N, N)`` bool.

    Raises TreeShapeError unless every parent precedes its child (breadth- or depth-first order).
    """
    n = len(parents)
    anc = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise TreeShapeError(f"node {i} has parent {p}: parents must come before their children")
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def depths(parents) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


@dataclass
class DraftTree:
    """The candidate tree of one speculative step, grown level by level.

    Attributes:
        parent: ``N`` ints, -1 for nodes hanging from the anchor.
        depth: ``N`` ints >= 1.
        token: ``N`` token ids.
        source: ``N`` of ``"draft"`` (sampled from q), ``"target"`` (target-initialized roots), ``"lookup"`` or
            ``"recycled"`` (deterministic free proposals; ``engine/methods.py``).
        level_starts: ``cum`` offsets: level s (1-based) holds nodes ``[level_starts[s-1], level_starts[s])``.
        anc: ``(N, N)`` bool ancestor-or-self matrix, grown with each level.
    """

    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    token: list[int] = field(default_factory=list)
    source: list[str] = field(default_factory=list)
    level_starts: list[int] = field(default_factory=lambda: [0])
    anc: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))

    def __len__(self) -> int:
        return len(self.token)

    @property
    def n_levels(self) -> int:
        return len(self.level_starts) - 1

    def level(self, s: int) -> range:
        """Indices of level ``s`` (1-based)."""
        return range(self.level_starts[s - 1], self.level_starts[s])

    def add_level(self, parents: list[int], tokens: list[int], source: str | list[str] = "draft") -> range:
        """Append one level (its nodes must hang from the previous level, or the anchor for the first);
        ``source``: one for the whole level or one per node (``engine/methods.py`` lists the sources)."""
        if len(parents) != len(tokens):
            raise ValueError("parents and tokens differ in length")
        sources = [source] * len(tokens) if isinstance(source, str) else list(source)
        if len(sources) != len(tokens):
            raise ValueError("sources and tokens differ in length")
        start = len(self.token)
        prev = self.level(self.n_levels) if self.n_levels else range(-1, 0)
        for p in parents:
            if p not in prev:
                raise TreeShapeError(f"parent {p} is not in the previous level {list(prev)}")
        n_new = len(tokens)
        anc = np.zeros((start + n_new, start + n_new), dtype=bool)
        anc[:start, :start] = self.anc
        for j, p in enumerate(parents):
            i = start + j
            if p >= 0:
                anc[i, :start] = anc[p, :start]
                self.depth.append(self.depth[p] + 1)
            else:
                self.depth.append(1)
            anc[i, i] = True
        self.anc = anc
        self.parent.extend(int(p) for p in parents)
        self.token.extend(int(t) for t in tokens)
        self.source.extend(sources)
        self.level_starts.append(start + n_new)
        return range(start, start + n_new)

    def children(self, i: int) -> list[int]:
        """Children of node ``i`` (``-1`` = the anchor) in breadth-first order."""
        return [j for j, p in enumerate(self.parent) if p == i]

    def path_tokens(self, i: int) -> list[int]:
        """Tokens from the first level down to node ``i`` (empty for ``-1``, the anchor)."""
        out: list[int] = []
        while i >= 0:
            out.append(self.token[i])
            i = self.parent[i]
        return out[::-1]

    def branch_of(self, i: int) -> int:
        """Index (0-based, among the anchor's children) of the first-level node above ``i``."""
        while self.parent[i] >= 0:
            i = self.parent[i]
        return self.children(-1).index(i)

    def branch_ids(self) -> list[int]:
        """For every node, the index of its branch (its first-level ancestor among the anchor's children)."""
        out: list[int] = []
        n_roots = 0
        for p in self.parent:
            if p < 0:
                out.append(n_roots)
                n_roots += 1
            else:
                out.append(out[p])
        return out

    def leaves(self) -> list[int]:
        has_child = set(self.parent)
        return [i for i in range(len(self)) if i not in has_child]


def step_mask(past_len: int, uncached_len: int, uncached_in_query: bool, anc: np.ndarray, start: int,
              stop: int) -> np.ndarray:
    """Bool attention mask for one forward inside a speculative step.

    Key layout: ``past_len`` cached committed tokens, then ``uncached_len`` committed tokens that this model has not
    cached yet (fed in the step's first forward), then tree nodes ``0..stop-1`` in breadth-first order.
    Query rows: the uncached committed tokens (if ``uncached_in_query``), then tree nodes ``start..stop-1``.

    Returns:
        ``(n_query, past_len + uncached_len + stop)`` bool, True where attention is allowed.
    """
    n_ctx = past_len + uncached_len
    n_q = (uncached_len if uncached_in_query else 0) + (stop - start)
    mask = np.zeros((n_q, n_ctx + stop), dtype=bool)
    r = 0
    if uncached_in_query:
        for j in range(uncached_len):
            mask[j, : past_len + j + 1] = True
        r = uncached_len
    mask[r:, :n_ctx] = True
    mask[r:, n_ctx:] = anc[start:stop, :stop]
    return mask


def step_position_ids(past_len: int, uncached_len: int, uncached_in_query: bool, depth: list[int], start: int,
                      stop: int) -> list[int]:
    """Position ids for the rows of ``step_mask``: the uncached committed tokens count on from ``past_len``; a tree
    node sits at ``L - 1 + depth`` with ``L = past_len + uncached_len`` committed tokens."""
    anchor = past_len + uncached_len - 1
    uncached = list(range(past_len, past_len + uncached_len)) if uncached_in_query else []
    return uncached + [anchor + depth[i] for i in range(start, stop)]


def to_float_mask(mask: np.ndarray, dtype: torch.dtype, device) -> torch.Tensor:
    """Bool ``(q, k)`` -> additive float ``(1, 1, q, k)`` in ``dtype``: 0 allowed, ``finfo(dtype).min`` blocked."""
    m = torch.from_numpy(mask).to(device)
    out = torch.zeros(m.shape, dtype=dtype, device=device)
    out.masked_fill_(~m, torch.finfo(dtype).min)
    return out[None, None]
