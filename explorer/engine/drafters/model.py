"""Model drafting: the draft model grows the tree level by level (``sd``, ``mcsd``, ``mcsd-improved``).

The tree's shape comes from ``MethodConfig.draft_branching()`` (a chain, a ``k_config`` tree, or the improved
MCSD's first levels and chains), its roots from the anchor or, in the seed's lossy mode, from the target
(target-initialized candidates, Lu et al. 2024). After every drafted level the stop policy scores the branches:
drafting ends, or (``prune``) only the branches that stopped get no children. Children are drawn the way the
verifier expects (``drafting.candidates``). Every level is fed whole, so the draft cache keeps a breadth-first
prefix of the tree.
"""

from __future__ import annotations

import torch

from ...trace.records import TOP_K_SHOWN
from .. import drafting
from ..policies.stopping import LevelView
from ..sampling import LazyRows, RowDists
from ..stop_models.features import (MEMORY_K, PROMPT_MEMORY_ROWS, CopyIndex, NodeFeatures, TargetMemory, dist_features,
                                    model_inputs)
from ..tree import DraftTree, step_mask, step_position_ids
from .base import Drafted, Drafter


class ModelDrafter(Drafter):
    """Draft tokens sampled from the draft model's q; costs one draft forward per tree level."""

    name = "model"
    uses_draft_model = True

    def __init__(self):
        # the session features of drafted nodes (engine/stop_models/features.py): n-grams of the committed context, and
        # the target's top candidates after each token (and pair of tokens) it scored, from the prompt's prefill on
        self.copy_index = CopyIndex()
        self.memory = TargetMemory()
        self._seeded = TargetMemory()  # the memory right after the prefill, where ``rewind`` returns

    @staticmethod
    def wants_features(view) -> bool:
        """Whether this run computes the decision features of drafted nodes (a learned stop policy reads them, the
        run collects them, or the stop policy adapts)."""
        return view.stop_policy.needs_features or view.capture_features or view.adapter is not None

    def prompt_rows(self, view) -> int:
        """The target memory is seeded from the prompt's last ``PROMPT_MEMORY_ROWS`` rows when features are
        computed."""
        return PROMPT_MEMORY_ROWS if self.wants_features(view) else 0

    def start(self, view) -> None:
        """Seed the target memory with the target's candidates at the prompt's rows (``view.prefill_top``)."""
        self.memory = TargetMemory()
        top = view.prefill_top
        if top is not None:
            self.memory.seed(view.committed, len(view.committed) - len(top), top)
        self._seeded = self.memory.copy()

    def learn(self, view, drafted: Drafted, verified) -> None:
        """Remember the target's top candidates at every row that had children this step (already ranked for the
        trace), when the run records decision features."""
        if not drafted.features:
            return
        tree = drafted.tree
        rows = verified.parent_rows  # row 0 = the anchor, row i + 1 = node i
        top = verified.p_rows.plain_top(rows, MEMORY_K)
        # the tokens each row's children were drafted after (this step is not committed yet: the anchor is last)
        keys = [(prev, tok) for tok, prev in (_parent_tokens(view.committed, tree, r - 1) for r in rows)]
        self.memory.update(keys, [top[r] for r in rows])

    def rewind(self) -> None:
        self.memory = self._seeded.copy()

    def draft(self, view) -> Drafted:
        """Grow the step's tree with the draft model, ``view.draft_model`` (after the target-sampled roots, if lossy).

        The first draft forward also feeds the committed tokens the draft has not cached (its chain).
        """
        config, sampling = view.config, view.sampling
        L = len(view.committed)
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
                roots = drafting.greedy_candidates(view.next_logits, config.width)
            else:
                roots = drafting.draw_without_replacement(view.next_dist, config.width, view.generator)
            tree.add_level([-1] * len(roots), roots, source="target")
        chain = view.committed[view.draft_len():]
        past = L - len(chain)
        calls = fed = 0  # fed: tree nodes in the draft cache (a breadth-first prefix)
        active: set[str] | None = None  # branches still drafting, once the first drafted level exists
        reach = view.reach()  # no level deeper than a committable node, no children under an EOS
        template = _template_children(config.tree)  # tree template: node -> its template children, else None
        # sampling without replacement: each row's uniform draws come with the level's best tokens (one transfer)
        draws_per_row = 0
        if not sampling.greedy and drafting.DRAFT_RULES[view.verifier_name] == "without":
            draws_per_row = max([1, *view.branching, *(len(c) for c in (template or {}).values())])
        host = torch.device("cpu")  # the decision model runs on the host, wherever the models run
        in_template: dict[int, int] = {-1: -1}  # drafted node -> its template node
        accept: dict[int, float] = {}  # node -> predicted acceptance (learned policies)
        for k in view.branching:
            level = tree.n_levels
            if level >= reach["max_depth"]:
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
                signals.append(sig)
                active -= set(sig.pruned)
                if not sig.keep_drafting:
                    break
            start, stop = (tree.level_starts[level - 1], tree.level_starts[level]) if level else (0, 0)
            if level and all(tree.token[i] in reach["ends"] for i in range(start, stop)):
                break  # a level of EOS tokens: no forward, nothing after them is committed
            first = calls == 0
            ids = (chain if first else []) + tree.token[start:stop]
            mask = None if (first and level == 0) else step_mask(past, len(chain), first, tree.anc, start, stop)
            pos = step_position_ids(past, len(chain), first, tree.depth, start, stop)
            fwd = view.draft_forward(ids, pos, mask, keep=max(stop - start, 1), hidden=want_hidden)
            calls += 1
            fed = stop
            qd = RowDists(fwd.logits, sampling)
            # the level's decision features and draws ride with its best tokens: one transfer (GPU sync) per level
            if want_features:
                qd.attach("dist", _dist_features(qd))
            if draws_per_row:
                n = qd.logits.shape[0]
                qd.attach("draws", drafting.uniforms(view.generator, n * draws_per_row).reshape(n, draws_per_row))
            branch_of = tree.branch_ids()
            parents, tokens = [], []
            rows = [(r, node) for r, node in enumerate(range(start, stop) if level else [-1])
                    if active is None or str(branch_of[node]) in active]  # a pruned branch gets no children
            tops = qd.top([r for r, _ in rows], TOP_K_SHOWN)
            dist = torch.tensor(qd.attached("dist"), dtype=torch.float32, device=host) if want_features else None
            for r, node in rows:
                q_top[node + 1] = tops[r]
                if not sampling.greedy:
                    q_rows.add(node + 1, qd, r)
                slots = None if template is None else template.get(in_template.get(node), [])
                want = k if slots is None else len(slots)
                if want == 0 or (node >= 0 and tree.token[node] in reach["ends"]):
                    continue
                sure = (want > 1 and config.branch_threshold < 1.0 and tops[r]
                        and tops[r][0][1] >= config.branch_threshold)
                kids = drafting.candidates(qd, r, 1 if sure else want, verifier=view.verifier_name,
                                           generator=view.generator,
                                           draws=qd.attached("draws")[r] if draws_per_row else None)
                for j, t in enumerate(kids):
                    i = len(tree) + len(tokens)
                    if slots is not None:
                        in_template[i] = slots[j]
                    q_show[i] = qd.shown(r, t)
                    if dist is not None:
                        q1 = qd.plain(r, t)  # read with the row's best tokens: no read of its own
                        cum = q1 * (features[node].cum_q if node in features else 1.0)  # target roots: 1
                        parent_token, prev_token = _parent_tokens(view.committed, tree, node)
                        session = (*self.copy_index.features(tree.path_tokens(node) + [t]),
                                   *self.memory.features(prev_token, parent_token, t))
                        features[i] = NodeFeatures(None if fwd.hidden is None else fwd.hidden[r], dist[r], q1, cum,
                                                   session)
                    parents.append(node)
                    tokens.append(t)
            if not tokens:
                break
            tree.add_level(parents, tokens, source="draft")
        return Drafted(tree, q_rows=q_rows, q_show=q_show, signals=signals, calls=calls,
                       draft_rows={i: i for i in range(fed)}, head=past + len(chain), features=features, q_top=q_top,
                       predicted=dict(accept))


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
