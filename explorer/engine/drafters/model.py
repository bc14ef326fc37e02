"""Model drafting: the draft model grows the tree level by level (``sd``, ``mcsd``, ``mcsd-improved``).

The tree's shape comes from ``MethodConfig.draft_branching()`` (a chain, a ``k_config`` tree, or the improved
MCSD's first levels and chains), its roots from the anchor or, in Lu et al.'s lossy mode, from the target
(target-initialized candidates, Lu et al. 2024). After every drafted level the stop policy scores the branches:
drafting ends, or (``prune``) only the branches that stopped get no children. Children are drawn the way the
verifier expects (``drafting.candidates``). Every level is fed whole; ``Drafted.draft_rows`` says where each fed
node sits in the draft cache.

Where the run allows it (``Engine(chain_levels=N)``, graphs on), the levels where every node has one child (the
chains of ``sd`` and of the improved MCSD after its first levels) run several at a time in one replay
(``GraphRunner.chain``): the next tokens are chosen on the device, and the host reads the levels' tokens, best
tokens and decision features in one transfer, then scores the levels one by one with the stop policy as before.
The tree is the one the level-by-level loop would draft (for greedy decoding up to exact ties between logits); the
levels the replay computed past the policy's stop are dropped (``Drafted.info["chain_replays"]``).
"""

from __future__ import annotations

import numpy as np
import torch

from ...trace.records import TOP_K_SHOWN
from .. import drafting
from ..policies.stopping import LevelView, path_reach
from ..policies.tree_choice import ONLINE_ROOTS, TreeChooser
from ..sampling import LazyRows, RowDists
from ..stop_models.features import (MEMORY_K, PROMPT_MEMORY_ROWS, CopyIndex, NodeFeatures, TargetMemory, dist_features,
                                    model_inputs)
from ..online_distill import LABEL_K
from ..tree import DraftTree, step_mask, step_position_ids
from ..carried import Carried
from ..parts import EngineError
from .base import Drafted, Drafter, Reach, rejected_below


CHAIN_MAX_WIDTH = 8
"""Most chains one replay grows (each width and depth is a graph of its own)."""


class ModelDrafter(Drafter):
    """Draft tokens sampled from the draft model's q; costs one draft forward per tree level."""

    name = "model"
    uses_draft_model = True

    def __init__(self, tree_chooser: TreeChooser | None = None, tree_carried: dict | None = None):
        # the online tree choice (``policies/tree_choice.py``), or None for the config's fixed shape; the state
        # of an earlier run of the session it starts from (``TreeChooser.state``), or None
        self.tree_chooser, self.tree_carried = tree_chooser, tree_carried
        # the session features of drafted nodes (engine/stop_models/features.py): n-grams of the committed context, and
        # the target's top candidates after each token (and pair of tokens) it scored, from the prompt's prefill on
        self.copy_index = CopyIndex()
        self.memory = TargetMemory()
        self._after_prompt = TargetMemory()  # the memory right after the prefill, where ``rewind`` returns
        self._chain_used: int | None = None  # chain levels read from replays in the last step that replayed
        self.adapter: dict | None = None  # what the trace records of the draft's LoRA adapter, or None
        self.distill = None  # the session's online distillation (``online_distill_draft.DraftDistiller``), or None

    @staticmethod
    def wants_features(view) -> bool:
        """Whether this run computes the decision features of drafted nodes (a learned stop policy reads them, the
        run collects them, or the stop policy adapts)."""
        return view.stop_policy.needs_features or view.capture_features or view.adapts

    def prompt_rows(self, view) -> int:
        """The target memory is primed from the prompt's last ``PROMPT_MEMORY_ROWS`` rows when features are
        computed."""
        return PROMPT_MEMORY_ROWS if self.wants_features(view) else 0

    def start(self, view) -> None:
        """Fill the target memory with the target's candidates at the prompt's rows (``view.prompt_top``)."""
        self.memory = TargetMemory()
        self.remember_prompt(list(view.committed[:view.n_prompt]), view.prompt_top)
        self._start_chooser()
        if self.distill is not None:
            self.distill.begin()

    def remember_prompt(self, prompt: list[int], top: list | None) -> None:
        """Remember the target's candidates ``top`` at the last rows of ``prompt`` (when given)."""
        if top is not None:
            self.memory.prime(list(prompt), len(prompt) - len(top), top)
        self._after_prompt = self.memory.copy()

    def _start_chooser(self) -> None:
        """The tree chooser afresh, or from the session's earlier run where its state fits."""
        if self.tree_chooser is None:
            return
        self.tree_chooser.reset()
        if self.tree_carried is not None and not self.tree_chooser.restore(self.tree_carried):
            self.tree_carried = None  # another shape: this run starts afresh, and its trace says so

    def carried(self, key: str) -> Carried:
        """What the online tree choice measured so far (``TreeChooser.state``), for the session's next run."""
        if self.tree_chooser is None:
            return Carried()
        return Carried(tree={"key": key, "state": self.tree_chooser.state()})

    def state_for_trace(self) -> dict:
        """The tree chooser's state the run started from, so a replay makes the same choices, and the draft's
        adapter (``online_distill_draft.DraftDistiller.describe``) where it has one."""
        return ({"tree_carried": self.tree_carried} if self.tree_carried is not None else {}) | (
            {"draft_adapter": self.adapter} if self.adapter is not None else {})

    def observe(self, step) -> None:
        """Remember the target's candidates at the prompt (a joint prefill's first step) and at every row that had
        children this step (already ranked for the trace), when the run records decision features. The online tree
        choice learns apart (``observers.TreeChoiceObserver``)."""
        if step.verified.prompt_top is not None:
            self.remember_prompt(step.context, step.verified.prompt_top)
        if self.distill is not None:
            self._record_rejection(step)
        drafted, verified = step.drafted, step.verified
        if not drafted.features:
            return
        tree = drafted.tree
        rows = verified.parent_rows  # row 0 = the anchor, row i + 1 = node i
        top = verified.p_rows.plain_top(rows, MEMORY_K)
        # the tokens each row's children were drafted after (the step's context: the anchor last)
        keys = [(prev, tok) for tok, prev in (_parent_tokens(step.context, tree, r - 1) for r in rows)]
        self.memory.update(keys, [top[r] for r in rows])

    def _record_rejection(self, step) -> None:
        """Tell the distiller where the verifier rejected the draft's children of the last accepted node
        (``rejected_below``): the position they were drafted for and the target's distribution there."""
        found = rejected_below(step, LABEL_K)
        if found is not None:
            path, top = found
            self.distill.rejected(len(step.context) + len(path), [t for t, _ in top], [p for _, p in top])

    def rewind(self) -> None:
        self.memory = self._after_prompt.copy()  # the tree chooser keeps what it measured, as the fallback's rates do
        if self.distill is not None:
            self.distill.begin()

    def draft(self, view) -> Drafted:
        """Grow the step's tree with the draft model, ``view.draft`` (after the target-sampled roots, if lossy).

        The first draft forward also feeds the committed tokens the draft has not cached.
        """
        config, sampling = view.config, view.sampling
        L = len(view.committed)
        branching, choice = self._branching(view)
        tree = DraftTree()
        q_rows = LazyRows()  # row (node + 1; 0 = anchor) -> q its children were drafted from, computed if read
        q_show: dict[int, float] = {}  # node -> q of its own token, as displayed
        q_top: dict[int, list] = {}  # row -> top tokens of q there, for the trace
        features: dict[int, NodeFeatures] = {}  # node -> decision features (temperature 1)
        policy = view.stop_policy
        want_features = self.wants_features(view)
        want_hidden = policy.needs_hidden or view.capture_features  # an extra output of each forward
        signals = []
        if want_features:
            self.copy_index.sync(view.committed)
        if config.is_lossy:
            if sampling.greedy:
                target_roots = drafting.greedy_candidates(view.next_logits, config.width)
            else:
                target_roots = drafting.draw_without_replacement(view.next_dist, config.width, view.generator)
            tree.add_level([-1] * len(target_roots), target_roots, source="target")
        uncached = list(view.committed[view.draft.cache.length:])
        past = L - len(uncached)
        calls = 0
        rows_of: dict[int, int] = {}  # fed tree node -> its draft-cache row after ``past + len(uncached)``
        next_row = 0  # the next free draft-cache row (relative to the same place)
        replay: _ChainReplay | None = None  # the chain replay whose levels are being read, if any
        replays: list[list[int]] = []  # per chain replay of this step: [levels computed, levels read]
        active: set[str] | None = None  # branches still drafting, once the first drafted level exists
        reach = view.reach  # no level deeper than a committable node, no children under an EOS
        template = _template_children(config.tree)  # tree template: node -> its template children, else None
        # sampling without replacement: each row's uniform draws come with the level's best tokens (one transfer)
        draws_per_row = 0
        if not sampling.greedy and drafting.DRAFT_RULES[view.verifier_name] == "without":
            draws_per_row = max([1, *branching, *(len(c) for c in (template or {}).values())])
        host = torch.device("cpu")  # the decision model runs on the host, wherever the models run
        in_template: dict[int, int] = {-1: -1}  # drafted node -> its template node
        accept: dict[int, float] = {}  # node -> predicted acceptance (learned policies)
        root_candidates = None  # the root's best tokens and sureness, for the tree chooser's learning
        for index, k in enumerate(branching):
            level = tree.n_levels
            if level >= reach.max_depth:
                break
            if level >= 1 and tree.source[tree.level_starts[level - 1]] == "draft":
                if active is None:
                    active = {str(b) for b in range(len(tree.children(-1)))}
                level_view = LevelView(tree, level, q_show, active=active, accept=accept)
                if policy.needs_features:
                    nodes = list(tree.level(level))
                    level_view.inputs = model_inputs(features, nodes, [tree.depth[i] for i in nodes],
                                                     hidden=policy.needs_hidden)
                sig = policy.signal(level_view)
                if sig.keep_drafting and self.tree_chooser is not None:
                    self._prune_side_branches(level_view, sig)
                signals.append(sig)
                active -= set(sig.pruned)
                if not sig.keep_drafting:
                    break
            start, stop = (tree.level_starts[level - 1], tree.level_starts[level]) if level else (0, 0)
            if level and all(tree.token[i] in reach.ends for i in range(start, stop)):
                break  # a level of EOS tokens: no forward, nothing after them is committed
            first = calls == 0
            if replay is not None and not replay.covers(level):
                replay = None
            if replay is None and not first:
                levels = self._chain_plan(view, branching, index, level, stop - start, reach, template,
                                          want_hidden, first_of_step=not replays)
                if levels > 1:
                    mask = _level_mask(past, len(uncached), tree, start, stop, rows_of, next_row, bool(replays))
                    pos = step_position_ids(past, len(uncached), False, tree.depth, start, stop)
                    uniforms = None if sampling.greedy else drafting.uniforms(view.generator, levels * (stop - start))
                    replay = _ChainReplay(view, tree, start, stop, levels, pos, mask, uniforms, want_features,
                                          first_row=next_row)
                    next_row += levels * (stop - start)
                    calls += levels
                    replays.append([levels, 0])
            if replay is not None:
                qd, hidden = replay.dists, None
                replays[-1][1] += 1
                for node in range(start, stop):  # this level's nodes sit in the replay's rows
                    rows_of[node] = replay.first_row + replay.row(level, node)
            else:
                ids = (uncached if first else []) + tree.token[start:stop]
                mask = (None if (first and level == 0) else
                        _level_mask(past, len(uncached), tree, start, stop, rows_of, next_row, bool(replays),
                                    uncached_in_query=first))
                pos = step_position_ids(past, len(uncached), first, tree.depth, start, stop)
                fwd = view.draft.forward(ids, pos, mask, keep=max(stop - start, 1), hidden=want_hidden)
                calls += 1
                rows_of.update({node: next_row + c for c, node in enumerate(range(start, stop))})
                next_row += stop - start
                qd, hidden = RowDists(fwd.logits, sampling), fwd.hidden
                # the level's decision features and draws ride with its best tokens: one transfer (GPU sync) per level
                if want_features:
                    qd.attach("dist", _dist_features(qd))
                if draws_per_row:
                    n = qd.logits.shape[0]
                    qd.attach("draws", drafting.uniforms(view.generator, n * draws_per_row).reshape(n, draws_per_row))
            branch_of = tree.branch_ids()
            parents, tokens = [], []
            level_nodes = range(start, stop) if level else [-1]
            rows = [(replay.row(level, node) if replay is not None else r, node) for r, node in enumerate(level_nodes)
                    if active is None or str(branch_of[node]) in active]  # a pruned branch gets no children
            tops = qd.top([r for r, _ in rows], TOP_K_SHOWN)
            dist = torch.tensor(qd.attached("dist"), dtype=torch.float32, device=host) if want_features else None
            for r, node in rows:
                q_top[node + 1] = tops[r]
                if node < 0 and choice is not None:
                    root_candidates = ([t for t, _ in tops[r]],
                                       config.branch_threshold < 1.0 and bool(tops[r])
                                       and tops[r][0][1] >= config.branch_threshold)
                if not sampling.greedy:
                    q_rows.add(node + 1, qd, r)
                slots = None if template is None else template.get(in_template.get(node), [])
                want = k if slots is None else len(slots)
                if want == 0 or (node >= 0 and tree.token[node] in reach.ends):
                    continue
                sure = (want > 1 and config.branch_threshold < 1.0 and tops[r]
                        and tops[r][0][1] >= config.branch_threshold)
                if replay is not None:  # the token the replay chose on the device after this node
                    kids = [replay.token(level, node)]
                else:
                    kids = drafting.candidates(qd, r, 1 if sure else want, verifier=view.verifier_name,
                                               generator=view.generator,
                                               draws=qd.attached("draws")[r] if draws_per_row else None)
                for j, t in enumerate(kids):
                    i = len(tree) + len(tokens)
                    if slots is not None:
                        in_template[i] = slots[j]
                    if replay is not None:
                        replay.chain_of[i] = replay.chain_of[node]
                    q_show[i] = qd.shown(r, t)
                    if dist is not None:
                        q1 = qd.plain(r, t)  # read with the row's best tokens: no read of its own
                        cum = q1 * (features[node].cum_q if node in features else 1.0)  # target roots: 1
                        parent_token, prev_token = _parent_tokens(view.committed, tree, node)
                        session = (*self.copy_index.features(tree.path_tokens(node) + [t]),
                                   *self.memory.features(prev_token, parent_token, t))
                        features[i] = NodeFeatures(None if hidden is None else hidden[r], dist[r], q1, cum, session)
                    parents.append(node)
                    tokens.append(t)
            if not tokens:
                break
            tree.add_level(parents, tokens, source="draft")
        if replays:
            used = sum(r[1] for r in replays)
            self._chain_used = used
            info = {"chain_replays": [{"levels": a, "read": b} for a, b in replays]}
        else:
            info = {}
        if choice is not None:
            info["tree_choice"] = choice
        if self.distill is not None:  # which version of the learning adapter drafted this step
            info["draft_adapter"] = {"version": self.distill.version}
        return Drafted(tree, q_rows=q_rows, q_show=q_show, signals=signals, calls=calls, draft_rows=rows_of,
                       tree_start=past + len(uncached), features=features, q_top=q_top, predicted=dict(accept),
                       info=info, roots=root_candidates)

    def _prune_side_branches(self, level_view: LevelView, sig) -> None:
        """Stop the side branches not worth their rows (the tree chosen online). The verifier tests the roots in
        rank order and accepts at most one, so root r holds the accepted path with chance ``a_r * prod(1 - a_j, j <
        r)`` (``a``: the decision model's predicted acceptance of each root alone); through a deeper node, times the
        predicted acceptance of every drafted node between. A branch whose best chance is under the chooser's
        ``row_floor`` stops, except the branch with the best chance, whose depth stays the stop policy's. Without it
        a step with four roots drafted four chains 16 levels deep wherever one of them was sure (54-64 target rows,
        1.7-3.0 s of verification against 0.6 s for one row on CPU C, for 3 tokens): the roots' own predictions
        (0.85, 0.63, 0.49, 0.40 in one such step) count each as if it were tested alone. Records them in ``sig``."""
        floor = self.tree_chooser.row_floor()
        tree, accept = level_view.tree, level_view.accept
        roots = tree.children(-1)
        if floor is None or len(roots) < 2 or any(r not in accept for r in roots):
            return
        chance_of, rejected = {}, 1.0  # root -> chance it is the accepted one
        for r in roots:
            chance_of[r] = rejected * accept[r]
            rejected *= 1.0 - accept[r]
        branch_of = tree.branch_ids()
        reach: dict[str, float] = {}
        for i in tree.level(level_view.level):
            b = str(branch_of[i])
            if b not in level_view.active or b in sig.pruned:
                continue
            reach[b] = max(reach.get(b, 0.0), path_reach(level_view, i, root_chance=chance_of))
        if len(reach) < 2:
            return
        best = max(reach, key=lambda b: (reach[b], -int(b)))
        weak = sorted((b for b, r in reach.items() if b != best and r < floor), key=int)
        sig.row_floor, sig.chances = round(floor, 4), {b: round(r, 4) for b, r in reach.items()}
        if weak:
            sig.cost_pruned = weak
            sig.pruned = sorted(set(sig.pruned) | set(weak), key=int)

    def branching(self, view) -> list[int]:
        """Children per draft level for this step: the settings' shape (``view.branching``). A model drafter
        written as a plugin may override it to draft a narrower tree for a step: each level at most as wide as the
        settings' and no more levels (they size the caches, the mask and the row budget). The stop policy still
        ends drafting early; the online tree choice, where on, decides instead."""
        return list(view.branching)

    def _branching(self, view) -> tuple[list[int], dict | None]:
        """This step's children per level: ``branching``'s, or with the root width the tree chooser picks (and
        why, for the trace). Raises EngineError where ``branching`` asks for more than the settings' shape."""
        if self.tree_chooser is None:
            shape = list(view.branching)
            branching = [int(k) for k in self.branching(view)]
            if len(branching) > len(shape) or any(not 1 <= k <= s for k, s in zip(branching, shape)):
                raise EngineError(f"{type(self).__name__}.branching gave {branching}: a step's tree may only be "
                                  f"narrower than the settings' {shape} (each level 1 to its width, no more levels)")
            return branching, None
        k = self.tree_chooser.choose()
        return view.config.online_branching(k), dict(self.tree_chooser.last)

    def _chain_plan(self, view, branching: list[int], index: int, level: int, width: int, reach: Reach, template,
                    want_hidden: bool, first_of_step: bool) -> int:
        """How many levels the next chain replay runs (0: a plain forward). Only where the run allows replays
        (``view.draft.chain_levels``), every level left has one child per node (no template), the policy reads no hidden
        states and at most ``CHAIN_MAX_WIDTH`` chains grow. A step's first replay runs about one level more than
        the chains' levels read in the step before: levels past where the stop policy ends drafting are computed
        for nothing, so a replay should end about where drafting ends. Replays run a power of two of levels
        (``chain_depths``), so that a few graphs serve every step."""
        if (not view.draft.chain_levels or template is not None or want_hidden or width > CHAIN_MAX_WIDTH
                or any(b != 1 for b in branching[index:])):
            return 0
        levels = min(view.draft.chain_levels, len(branching) - index, reach.max_depth - level)
        if first_of_step and self._chain_used is not None:
            levels = min(levels, max(2, self._chain_used + 1))
        return max((d for d in chain_depths(view.draft.chain_levels) if d <= levels), default=0)


def chain_depths(chain_levels: int) -> list[int]:
    """The replay depths a run with ``chain_levels`` uses: the powers of two from 2 up to it."""
    return [2 ** e for e in range(1, 8) if 2 ** e <= chain_levels]


def chain_widths(config, lossy_roots: int = 0) -> list[int]:
    """How many chains a step of ``config``'s tree can grow at once (1 .. the nodes of its last branching level,
    at most ``CHAIN_MAX_WIDTH``); empty when its levels never become chains."""
    branching = config.online_branching(max(ONLINE_ROOTS))  # the widest tree the run may draft
    if config.tree is not None or 1 not in branching:
        return []
    width = max(1, lossy_roots)
    for b in branching[: branching.index(1)]:
        width *= b
    return list(range(1, min(width, CHAIN_MAX_WIDTH) + 1))


class _ChainReplay:
    """One chain replay's levels, read one by one by the drafting loop: ``levels`` forwards of the ``w`` nodes of
    tree level ``first_level`` and of the chains growing under them.

    Attributes:
        first_level: the tree level whose nodes the replay's first forward fed.
        dists: ``RowDists`` over the replay's ``levels * w`` rows (level-major), with its decision features
            attached when the run computes them, and the chosen tokens: all reach the host in one transfer.
        first_row: the draft-cache row (relative to the step's ``tree_start``) of the replay's row 0; its rows
            follow it.
        chain_of: tree node -> its chain (0 .. w-1), for the first level's nodes and every child read so far.
    """

    def __init__(self, view, tree: DraftTree, start: int, stop: int, levels: int, pos: list[int], mask, uniforms,
                 want_features: bool, first_row: int):
        self.first_level, self.levels, self.w, self.first_row = tree.n_levels, levels, stop - start, first_row
        tokens, logits = view.draft.chain(tree.token[start:stop], pos, mask, levels, uniforms)
        self.dists = RowDists(logits, view.sampling)
        if want_features:
            self.dists.attach("dist", _dist_features(self.dists))
        self.dists.attach("tokens", tokens.reshape(-1, 1))
        self.chain_of = {node: c for c, node in enumerate(range(start, stop))}
        self._tokens: list[int] | None = None

    def covers(self, level: int) -> bool:
        return self.first_level <= level < self.first_level + self.levels

    def row(self, level: int, node: int) -> int:
        """The replay row that fed ``node`` (a node of tree level ``level``)."""
        return (level - self.first_level) * self.w + self.chain_of[node]

    def token(self, level: int, node: int) -> int:
        """The token the replay chose after ``node``."""
        if self._tokens is None:
            self._tokens = [int(t[0]) for t in self.dists.attached("tokens")]
        return self._tokens[self.row(level, node)]


def _level_mask(past: int, uncached_len: int, tree: DraftTree, start: int, stop: int, rows_of: dict[int, int],
                next_row: int, replayed: bool, uncached_in_query: bool = False) -> np.ndarray:
    """The bool attention mask of a draft forward feeding tree nodes ``start .. stop - 1`` at draft-cache rows
    ``next_row ..`` (after ``past`` cached and ``uncached_len`` new committed tokens): ``tree.step_mask`` until the step
    ran a chain replay (``replayed``; until then every fed node sits at its own index), else built from
    ``rows_of``: each row sees the committed tokens, its ancestors' rows and its own.
    ``(q, past + uncached_len + next_row + q)`` with ``q`` the uncached committed tokens (when ``uncached_in_query``)
    plus the nodes."""
    if not replayed:
        return step_mask(past, uncached_len, uncached_in_query, tree.anc, start, stop)
    n_ctx, w = past + uncached_len, stop - start
    mask = np.zeros((w, n_ctx + next_row + w), dtype=bool)
    mask[:, :n_ctx] = True
    for c, node in enumerate(range(start, stop)):
        parent = tree.parent[node]
        while parent >= 0:
            mask[c, n_ctx + rows_of[parent]] = True
            parent = tree.parent[parent]
        mask[c, n_ctx + next_row + c] = True
    return mask


def _parent_tokens(committed: list[int], tree: DraftTree, node: int) -> tuple[int, int]:
    """The token a child of ``node`` (-1: the anchor) is drafted after, and the one before that (-1: none)."""
    if node < 0:
        return committed[-1], (committed[-2] if len(committed) > 1 else -1)
    parent = tree.parent[node]
    return tree.token[node], (committed[-1] if parent < 0 else tree.token[parent])


def _template_children(parents) -> dict[int, list[int]] | None:
    """A tree template's children lists (-1 = the anchor), or None without a template."""
    if parents is None:
        return None
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def _dist_features(qd: RowDists) -> torch.Tensor:
    """The 11 distribution features of every row of a draft forward, ``(rows, 11)`` float32 on its device."""
    lse, _, top = qd.stats()
    return dist_features(qd.float_logits, lse, top)
