"""Drafting with an EAGLE-3 head (``models/eagle3.py``): a draft tree from the target's own hidden states.

The head reads, at each committed position t, the target's hidden states of three layers (``target_layers``; they
come out of the verification forward, ``VerifiedStep.target_states``, and the prefill's, ``view.target_states``)
with the token at t + 1, and predicts the token at t + 2. So after a step the head first catches up on the
committed positions it has not read (``_catch_up``): its last row predicts the anchor's children. Deeper levels feed
the head's own output back as the feature, one head forward per level.

The tree is EAGLE-2's dynamic tree (Li et al. 2024, arXiv 2406.16858): each level expands the ``frontier`` nodes with
the best cumulative draft log-probability, ``top_k`` children each, for ``depth`` levels; then the ``tokens`` best
nodes are kept, every kept node's ancestors and earlier-drawn siblings with it (so each node's kept children are a
prefix of its draws and the verifier's rule holds: lossless). With ``tree_choice=online`` a
``policies.head_tree.TreeSizer`` keeps fewer of them, and drafts fewer levels, where this machine's costs and the
run's measured acceptance say fewer pay. Children are drawn as every verifier expects (``drafting.candidates``: the
best ones when greedy), over the head's draft vocabulary (its ids, mapped to the target's as they are drawn; the q
rows a sampling verifier reads are spread over the target's vocabulary, ``TargetRows``). The head's tree rows are
dropped from its cache after each step; the accepted path comes back with the target's own features at the next
catch-up.
"""

from __future__ import annotations

import heapq
import math
import time

import torch

from ...models.eagle3 import HeadCache, target_columns
from ..online_distill import LABEL_K
from ...trace.records import TOP_K_SHOWN
from .. import drafting
from ..policies.head_tree import TreeSizer
from ..sampling import LazyRows, RowDists
from ..tree import DraftTree
from .base import Drafted, Drafter, empty_draft, rejected_below


class HeadDrafter(Drafter):
    """A draft tree from an EAGLE-3 head (module docstring).

    Args:
        head: the loaded head (``models.eagle3.Eagle3Head``), its embedding set to the target's where it has none.
        target_layers: the target layers whose inputs it reads (``HeadConfig.aux_layers``).
        top_k: children per expanded node; frontier: nodes expanded per level; depth: levels drafted; tokens: the
            most nodes the tree keeps (SGLang's ``speculative_eagle_topk``, ``speculative_num_steps``,
            ``speculative_num_draft_tokens``).
        source: what the trace records of the head (``head_store.describe``: its folder, config hash, draft
            vocabulary size, feature layers).
        sizer: the online choice of how many of the ``tokens`` kept nodes a step verifies
            (``policies/head_tree.py``), or None to verify them all.
    """

    name = "eagle"
    uses_draft_model = False

    def __init__(self, head, target_layers: tuple[int, ...], top_k: int = 4, frontier: int = 4, depth: int = 6,
                 tokens: int = 16, source: dict | None = None, sizer: TreeSizer | None = None):
        self.head, self.target_layers, self.source = head, tuple(target_layers), dict(source or {})
        self.sizer = sizer
        self._sized: tuple | None = None  # (the step's Drafted, (depth, rank, q) per tree node, draft ms)
        self.top_k, self.frontier, self.depth, self.tokens = top_k, frontier, depth, tokens
        self.cache = HeadCache()
        self._vocab: tuple | None = None  # (target vocab, ``_draft_vocab``'s answer for it)
        self._states: torch.Tensor | None = None  # target states of positions start.. not yet read by the head
        self._states_start = 0
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None  # the last read row's logits and output g
        self._after_start: tuple = (None, 0)
        self.distill = None  # the session's online distillation (``online_distill.HeadDistiller``), or None

    def state_for_trace(self) -> dict:
        return {"head": self.source} if self.source else {}

    # ------------------------------------------------------------------ the committed positions

    def start(self, view) -> None:
        """Keep the prefill's target states of the prompt rows (None with a joint prefill: they come with the
        first verification); the sizer starts afresh."""
        self.cache, self._root = HeadCache(), None
        if self.sizer is not None:
            self.sizer.reset()
        self._states, self._states_start = view.target_states, 0
        self._after_start = (self._states, 0)
        if self.distill is not None:
            self.distill.begin()

    def rewind(self) -> None:
        self.cache, self._root = HeadCache(), None
        self._states, self._states_start = self._after_start
        if self.distill is not None:
            self.distill.begin()

    def observe(self, step) -> None:
        """Keep the target states of the committed rows the verification read (the path's rows past what the step
        committed, cut at EOS or the budget, are left out)."""
        v = step.verified
        self._learn_size(step)
        if self.distill is not None:
            self._record_rejection(step)
        if v.target_states is None:
            return
        rows = v.target_states[: max(0, len(step.history) - v.states_start)]
        if self._states is None or self._states_start + self._states.shape[0] != v.states_start:
            self._states, self._states_start = rows, v.states_start  # a gap: read from here on
            self.cache, self._root = HeadCache(), None
        else:
            self._states = torch.cat([self._states, rows])

    def _learn_size(self, step) -> None:
        """The sizer learns the step's measured acceptance of each verified head node and the drafter's time."""
        if self.sizer is None or self._sized is None or self._sized[0] is not step.drafted:
            return
        _, nodes, ms = self._sized
        odds, tree = step.verified.odds or {}, step.drafted.tree
        seen = [i for i in range(len(tree)) if i < len(nodes) and i in odds and tree.source[i] == "draft"]
        self.sizer.record([nodes[i] for i in seen], [odds[i].accept_prob for i in seen], ms)
        self._sized = None

    def _record_rejection(self, step) -> None:
        """Tell the distiller where the verifier rejected the head's tokens (``rejected_below``): the chain level
        that drafted them from the step's root row, and the target's distribution there (the row of the last
        accepted head node)."""
        found = rejected_below(step, LABEL_K)
        if found is not None:
            path, top = found
            self.distill.rejected(len(step.context) - 2, len(path) + 1, [t for t, _ in top], [p for _, p in top])

    def _catch_up(self, committed, timed) -> bool:
        """Feed the head the committed positions t it has not read, up to the anchor's parent (the token at t + 1
        is committed), in one forward; keep its last row as the root (it predicts the anchor's children). Returns
        whether the root is known (not before the target's states of those positions are)."""
        last, start = len(committed) - 2, self.cache.length  # the last position whose next token is committed
        if last < start:
            return self._root is not None
        held = 0 if self._states is None else self._states.shape[0]
        if self._states_start != start or self._states_start + held <= last:
            return False
        head, device = self.head, self._states.device
        n = last + 1 - start
        tokens = torch.tensor(committed[start + 1: last + 2], dtype=torch.long, device=device)
        with torch.inference_mode(), timed(n):
            logits, g = head(tokens, head.features(self._states[:n]), torch.arange(start, last + 1, device=device),
                             self.cache)
        self._root = (logits[-1:], g[-1:])
        if self.distill is not None:  # the rows the head read: what its update recomputes
            self.distill.read(start, committed[start + 1: last + 2], self._states[:n])
        self._states, self._states_start = self._states[n:], last + 1  # the anchor's state, where known
        return True

    # ------------------------------------------------------------------ drafting

    def draft(self, view) -> Drafted:
        t0 = time.perf_counter()
        committed = view.committed
        calls_before = self.cache.length
        if not self._catch_up(committed, view.time_forward):
            return empty_draft(len(committed))
        calls = 1 if self.cache.length > calls_before else 0
        sampling, head = view.sampling, self.head
        target_of, columns, outside = self._draft_vocab(view.vocab_size)
        base = self.cache.length  # committed rows in the head's cache (positions 0 .. base - 1)
        # drawn nodes: parent (-1 anchor), token (target id), its draft id, depth, q, cumulative log q, draw rank
        parent, token, draft_id, depth, q, score, rank = [], [], [], [], [], [], []
        dists: dict[int, tuple[RowDists, int]] = {}  # node (-1 anchor) -> its children's distribution, row
        g_of: dict[int, torch.Tensor] = {}  # node -> the head's output at its row (its children's feature)
        row_of: dict[int, int] = {}  # fed node -> its row in the cache after ``base``
        logits, g = self._root
        frontier = [-1]
        g_of[-1] = g[0]
        level_logits = logits
        levels, deepened_at = min(self.depth, view.reach.max_depth), None
        without = not sampling.greedy and drafting.DRAFT_RULES[view.verifier_name] == "without"
        draws = self.top_k if without else 0  # uniform draws per row for sampling without replacement
        for level in range(1, levels + 1):
            # q over the draft vocabulary (draft ids): a twelfth of the target's columns to sort and normalise
            level_logits = level_logits.float()
            qd = RowDists(level_logits if outside is None else level_logits.masked_fill(outside, float("-inf")),
                          sampling)
            if draws:  # each row's uniform draws ride with the level's best tokens: one transfer (GPU sync)
                qd.attach("draws", drafting.uniforms(view.generator, len(frontier) * draws).reshape(-1, draws))
            new = []
            for r, node in enumerate(frontier):
                if node >= 0 and token[node] in view.reach.ends:
                    continue
                dists[node] = (qd, r)
                kids = drafting.candidates(qd, r, self.top_k, verifier=view.verifier_name, generator=view.generator,
                                           draws=qd.attached("draws")[r] if draws else None)
                for j, d in enumerate(kids):
                    q.append(qd.plain(r, d))
                    parent.append(node), token.append(target_of[d]), draft_id.append(int(d))
                    depth.append(level), rank.append(j)
                    score.append((score[node] if node >= 0 else 0.0) + math.log(max(q[-1], 1e-30)))
                    new.append(len(token) - 1)
            if deepened_at is not None:  # what this level cost: the frontier's forward and these draws
                self.sizer.record_level((time.perf_counter() - deepened_at) * 1e3)
            if not new or level == levels:
                break
            frontier = sorted(new, key=lambda i: -score[i])[: self.frontier]
            if self.sizer is not None and not self.sizer.deepen(level + 1, frontier, parent, depth, rank, q,
                                                                self.top_k):
                break
            deepened_at = time.perf_counter() if self.sizer is not None else None
            mask = self._level_mask(frontier, parent, row_of, base)
            ids = torch.tensor([token[i] for i in frontier], dtype=torch.long, device=g.device)
            feats = torch.stack([g_of[parent[i]] for i in frontier])
            pos = torch.tensor([base - 1 + depth[i] for i in frontier], dtype=torch.long, device=g.device)
            with torch.inference_mode(), view.time_forward(len(frontier)):
                level_logits, out = head(ids, feats, pos, self.cache, mask)
            calls += 1
            for c, i in enumerate(frontier):
                g_of[i], row_of[i] = out[c], len(row_of)
        self.cache.rewind(base)  # the tree's rows: the accepted path comes back with the target's features
        keep = _best_closed(parent, score, rank, self.tokens)  # best first: every prefix is closed
        size = None
        if self.sizer is not None and keep:
            keep = keep[: self.sizer.choose(keep, parent, depth, rank, q)]
            size = dict(self.sizer.last, levels=max(depth))
        order = sorted(keep, key=lambda i: (depth[i], i))  # breadth first: the tree's node order
        drafted = self._tree(order, parent, token, draft_id, depth, dists, sampling.greedy, calls,
                             (target_of, columns, view.vocab_size))
        drafted.tree_start = len(committed)  # no draft-model cache: the tree's rows sit after the context
        if self.distill is not None:  # which version of the learning head drafted this step
            drafted.info["head"]["version"] = self.distill.version
        if size is not None:
            drafted.info["head"]["size"] = size
            self._sized = (drafted, [(depth[i], rank[i], q[i]) for i in order],
                           (time.perf_counter() - t0) * 1e3)
        return drafted

    def _draft_vocab(self, vocab: int) -> tuple:
        """The target id of each draft id (a host list), its column over the target's ``vocab`` logits
        (``eagle3.target_columns``, int64 on the device) and, where some draft ids map past those logits, a bool
        ``(draft_vocab,)`` mask of them (else None); computed once per vocabulary size."""
        if self._vocab is None or self._vocab[0] != vocab:
            ids = self.head.target_ids()
            outside = ids >= vocab
            self._vocab = (vocab, (ids.tolist(), target_columns(ids, vocab), outside if bool(outside.any()) else None))
        return self._vocab[1]

    def _level_mask(self, frontier: list[int], parent: list[int], row_of: dict[int, int], base: int):
        """Bool ``(rows, base + fed + rows)``: each frontier row sees the committed rows, its fed ancestors' rows
        and itself."""
        fed = len(row_of)
        mask = torch.zeros(len(frontier), base + fed + len(frontier), dtype=torch.bool)
        mask[:, :base] = True
        for c, i in enumerate(frontier):
            a = parent[i]
            while a >= 0:
                mask[c, base + row_of[a]] = True
                a = parent[a]
            mask[c, base + fed + c] = True
        return mask.to(self._root[1].device)

    def _tree(self, order: list[int], parent, token, draft_id, depth, dists, greedy: bool, calls: int,
              target: tuple) -> Drafted:
        """The kept nodes, breadth first (``order``: by depth, then draw), as a ``DraftTree`` with their q rows
        (over the target's vocabulary) and shown q. ``dists`` are over the draft vocabulary; ``target``: the draft
        ids' target ids (host list), their columns (``eagle3.target_columns``) and the target's vocabulary size."""
        target_of, columns, vocab = target
        index = {i: n for n, i in enumerate(order)}
        tree = DraftTree()
        for level in sorted({depth[i] for i in order}):
            nodes = [i for i in order if depth[i] == level]
            tree.add_level([-1 if parent[i] < 0 else index[parent[i]] for i in nodes], [token[i] for i in nodes],
                           source="draft")
        q_rows, q_show, q_top = LazyRows(), {}, {}
        rows_with_kids = {parent[i] for i in order}
        for p in rows_with_kids:
            qd, r = dists[p]
            row = 0 if p < 0 else index[p] + 1
            if not greedy:
                q_rows.add(row, TargetRows(qd, columns, vocab), r)
            q_top[row] = [(target_of[d], q) for d, q in qd.top([r], TOP_K_SHOWN)[r]]
        for i in order:
            qd, r = dists[parent[i]]
            q_show[index[i]] = qd.shown(r, draft_id[i])
        return Drafted(tree, q_rows=q_rows, q_show=q_show, calls=calls, q_top=q_top,
                       info={"head": {"top_k": self.top_k, "frontier": self.frontier, "depth": self.depth,
                                      "tokens": self.tokens, "target_layers": list(self.target_layers),
                                      "drawn": len(token), "draft_vocab": self.head.config.draft_vocab_size}})


class TargetRows:
    """Rows of a ``RowDists`` over the draft vocabulary read as processed distributions over the target's:
    ``rows[r]`` is float32 ``(vocab,)``, zero outside the draft vocabulary (what a verifier's q row must be)."""

    def __init__(self, dists: RowDists, columns: torch.Tensor, vocab: int):
        self.dists, self.columns, self.vocab = dists, columns, vocab  # columns: ``eagle3.target_columns``
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, r: int) -> torch.Tensor:
        if r not in self._rows:
            q = self.dists[r]
            out = torch.zeros(self.vocab + 1, dtype=q.dtype, device=q.device)
            out.index_copy_(0, self.columns, q)
            self._rows[r] = out[: self.vocab]
        return self._rows[r]


def _best_closed(parent: list[int], score: list[float], rank: list[int], budget: int) -> list[int]:
    """The ``budget`` drawn nodes with the best cumulative scores, closed under ancestors and earlier-drawn
    siblings: a node becomes a candidate once its parent and its previous sibling are kept (EAGLE-2's rerank, with
    each node's kept children a prefix of its draws)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parent):
        children.setdefault(p, []).append(i)
    for kids in children.values():
        kids.sort(key=lambda i: rank[i])
    heap = [(-score[children[-1][0]], children[-1][0])] if children.get(-1) else []
    kept: list[int] = []
    while heap and len(kept) < budget:
        _, i = heapq.heappop(heap)
        kept.append(i)
        siblings = children[parent[i]]
        nxt = siblings.index(i) + 1
        if nxt < len(siblings):
            heapq.heappush(heap, (-score[siblings[nxt]], siblings[nxt]))
        if children.get(i):
            heapq.heappush(heap, (-score[children[i][0]], children[i][0]))
    return kept
