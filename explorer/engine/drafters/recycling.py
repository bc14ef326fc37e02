"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure", arXiv 2408.08696): the target's own top-k
candidates at every verified position, otherwise thrown away, become the next drafts.

* An adjacency matrix holds, per token id, the ``k`` most likely next tokens the target gave after that token the
  last time it was verified (here a dict of the rows written so far: a run touches a few hundred of 151,936 ids).
* Drafting reads a static tree template breadth-first (``tree.rank_decay_parents``): the anchor's row gives the
  first level, each node's row its children, as many as the template gives a node of that level and rank.
* After verification every row the target scored (the anchor and every tree node) overwrites the matrix row of its
  token with the top-k of its logits.

Train-free and lossless: the drafts are a function of the history only (deterministic proposals). The matrix is
kept across steps and, when the caller passes it on, across runs of a session (``state`` / ``initial``).

One addition to the paper: before the first step, the rows of the prompt's tokens are filled with the tokens that
follow them in the prompt (most recent first), ahead of any carried-over candidates. The prefill computes logits
for the last prompt token only, so without this a run starts blind exactly where outputs copy their prompt.
"""

from __future__ import annotations

import torch

from ..carried import Carried
from ..tree import rank_decay_parents
from .base import Drafter, FreeNode

CARRIED = -1
"""``step`` of a matrix row written before this run (carried over from an earlier run of the session)."""
PROMPT = -2
"""``step`` of a matrix row filled from the prompt's own successors (``RecyclingDrafter.start``)."""


class RecyclingDrafter(Drafter):
    """Free draft trees read from the adjacency matrix (``recycled`` nodes).

    Args:
        widths: the tree template (``tree.rank_decay_parents``).
        k: candidates stored per token.
        initial: a matrix carried over from an earlier run (``state()`` of that run's drafter), or None.
    """

    name = "recycling"

    def __init__(self, widths, k: int, initial: dict | None = None):
        self.parents, self.ranks = rank_decay_parents(widths)
        self.k = int(k)
        self.rows: dict[int, list[int]] = {}  # token id -> candidate ids, best first
        self.origin: dict[int, tuple[int, int]] = {}  # token id -> (step, node id) whose logits wrote the row
        for t, cands in (initial or {}).get("rows", {}).items():
            self.rows[int(t)] = [int(c) for c in cands][: self.k]
            self.origin[int(t)] = (CARRIED, 0)
        self.carried_rows = len(self.rows)
        self._initial = (dict(self.rows), dict(self.origin))

    def start(self, view) -> None:
        """Fill the rows of the prompt's tokens with their successors in the prompt, most recent first, then the
        carried-over candidates; ``node`` records the prompt position of the first successor."""
        prompt = view.committed
        successors: dict[int, list[int]] = {}
        first: dict[int, int] = {}
        for i in range(len(prompt) - 2, -1, -1):  # most recent occurrence first
            row = successors.setdefault(prompt[i], [])
            if prompt[i + 1] not in row and len(row) < self.k:
                row.append(prompt[i + 1])
                first.setdefault(prompt[i], i + 1)
        for t, row in successors.items():
            rest = [c for c in self.rows.get(t, []) if c not in row]
            self.rows[t] = (row + rest)[: self.k]
            self.origin[t] = (PROMPT, first[t])
        self._initial = (dict(self.rows), dict(self.origin))

    def free_nodes(self, view) -> list[FreeNode]:
        """The template filled breadth-first from the matrix, starting at the anchor (the last committed token). A
        node whose token has no row yet gets no children; neither do template slots beyond a row's candidates."""
        anchor = view.committed[-1]
        nodes: list[FreeNode] = []
        where: dict[int, int] = {-1: -1}  # template index -> FreeNode index (absent: not filled)
        token_of = {-1: anchor}
        for i, (p, rank) in enumerate(zip(self.parents, self.ranks)):
            if p not in where:
                continue
            row_token = token_of[p]
            row = self.rows.get(row_token)
            if row is None or rank >= len(row):
                continue
            step, node = self.origin[row_token]
            nodes.append(FreeNode(where[p], row[rank], "recycled",
                                  {"source": "recycled", "row_token": row_token, "rank": rank, "step": step,
                                   "node": node}, slot=("recycled", i)))
            where[i] = len(nodes) - 1
            token_of[i] = row[rank]
        return nodes

    def info(self, view) -> dict:
        """The matrix row of the anchor as plain data: its candidates and the step and node that wrote them."""
        token = view.committed[-1]
        step, node = self.origin.get(token, (None, None))
        return {"recycling_row": {"token": int(token), "candidates": list(self.rows.get(token, [])), "step": step,
                                  "node": node}}

    def observe(self, step) -> None:
        """Overwrite the row of every token the target scored this step (the anchor and every tree node) with the
        top-k of its logits; later rows win when a token occurs twice."""
        drafted, verified = step.drafted, step.verified
        logits = [verified.anchor_logits.float().reshape(1, -1)]
        if len(drafted.tree):
            logits.append(verified.node_logits[: len(drafted.tree)].float())
        top = torch.topk(torch.cat(logits), self.k, dim=-1).indices.tolist()  # one transfer for all rows
        for node, (t, cands) in enumerate(zip([verified.anchor_token] + list(drafted.tree.token), top)):
            self.rows[int(t)] = cands
            self.origin[int(t)] = (step.record.index, node)

    def rewind(self) -> None:
        self.rows, self.origin = dict(self._initial[0]), dict(self._initial[1])

    def state(self) -> dict:
        """The matrix as plain data (``{"rows": {token: [candidates]}}``), for the next run or the trace."""
        return {"k": self.k, "rows": {str(t): list(c) for t, c in self.rows.items()}}

    def carried(self, key: str) -> Carried:
        """The matrix, for the session's next run (not keyed: a matrix holds for any method of the pair)."""
        return Carried(recycling=self.state())

    def state_for_trace(self) -> dict:
        """The matrix the run started from (after filling it from the prompt), so a replay can show any row."""
        return {"recycling_initial": {"k": self.k, "carried_rows": self.carried_rows,
                                      "rows": {str(t): list(c) for t, c in self._initial[0].items()}}}
