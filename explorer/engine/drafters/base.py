"""The drafter interface: what a drafter hands the engine for one step, and how free branches join a tree.

A drafter (the seam transformers draws with ``CandidateGenerator``, vLLM with its proposers) proposes the step's
draft tree from the committed context and learns from the step's verification. It sees the run through a
``DraftView`` built for each step: what it may read, and its own model's actions (``DraftModelAccess``: its
forwards, its cache), not the engine.

* ``draft(view) -> Drafted``: the tree (tokens, parents, each node's source) plus, for draft-model nodes, the
  distributions their children were drawn from (``q_rows``); free nodes (``trace.records.FREE_SOURCES``) are
  deterministic and carry where they came from (``provenance``).
* ``observe(step)``: called once per step after verification with the step's ``observers.ObservedStep`` (a drafter
  is one of the step's observers: Token Recycling updates its matrix here).
* ``target_layers``: the target layers whose hidden states the drafter reads (``VerifiedStep.target_states``, the
  prefill's in ``view.target_states``); empty for most drafters.
* ``rewind()``: back to the state after the prefill (the audit draws many samples from one context).
* ``carried(key)``: what the drafter learned for the session's next run (``engine/carried.py``).
* ``state_for_trace()``: plain data saved with the run, so a replay can show what the drafter knew.
"""

from __future__ import annotations

from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple
from collections.abc import Callable

import torch

from ..carried import Carried
from ..config import MethodConfig
from ..policies.stopping import StopPolicy
from ..runtime.graphs import ForwardOutput
from ..runtime.kv_cache import copy_layers
from ..sampling import LazyRows, SamplingConfig
from ..tree import DraftTree



@dataclass
class FreeNode:
    """One deterministic proposal: ``parent`` indexes an earlier FreeNode of the same list (-1 = the anchor);
    ``token`` a vocabulary id (an int in ``[0, vocab_size)``); ``source`` ``lookup``, ``recycled`` or (the default)
    ``plugin``; ``provenance`` plain data (JSON types) for ``NodeTrace.provenance`` (``source`` and, for lookup,
    ``copied_from``, ``ngram``, ``match_at``, ``in_prompt``; for recycling ``row_token``, ``rank``, ``step``,
    ``node``; a plugin's node gets ``plugin``, its method's name, and keeps what else the plugin put there).
    ``slot``: which of the drafter's recurring positions it fills (hashable; ``row_pricing.RowPricing`` measures
    each slot's acceptance), or None."""

    parent: int
    token: int
    source: str = "plugin"  # lookup | recycled | plugin
    provenance: dict = field(default_factory=dict)
    slot: object = None


@dataclass
class Drafted:
    """What drafting produced for one step. N is ``len(tree)``; a *row* is a node's index + 1 (row 0 = the
    anchor), the row a node's children were drafted from and are verified against. Node-keyed dicts use tree
    indices (0-based, breadth-first); ``merge_free`` re-keys them when free branches join.

    Attributes:
        tree: the draft tree (``tree.DraftTree``): N nodes in breadth-first order, each with its token, parent and
            source (``draft``, ``target``, ``lookup``, ``recycled``).
        q_rows: row -> the draft's processed distribution there, float32 ``(vocab,)`` on the pair's device,
            computed when first read (``sampling.LazyRows``); only rows whose draft-model children were drawn by
            sampling (greedy: none; free children need none).
        q_show: node -> the draft's probability of its own token at its parent, in [0, 1], as displayed
            (processed when sampling, plain softmax when greedy); draft-model nodes only.
        signals: one ``trace.records.StopSignal`` per level the stop policy checked.
        calls: draft-model forwards this step (a chain replay counts each level it computed).
        draft_rows: fed node -> its row offset in the draft model's KV cache after ``tree_start`` (the row is
            ``tree_start + offset``); only the nodes fed to the draft model (the levels it ran a forward on, target
            roots included: a breadth-first prefix of its own tree; never free nodes). The engine keeps the
            accepted path's rows by it.
        tree_start: the draft cache's length before the tree rows (the cached context plus the uncached committed
            tokens this step fed), in tokens.
        features: node -> ``stop_models.features.NodeFeatures`` (temperature 1): ``hidden`` float32 ``(H,)`` on
            the device or None, ``dist`` float32 ``(11,)`` on the host, ``q`` = q(x), ``cum_q`` = prod q over its
            path, ``session`` (10 floats); model-drafted nodes, only when the run computes decision features.
        q_top: row -> ``[(token_id, q)]``, the ``TOP_K_SHOWN`` (8) most likely tokens of the distribution its
            children were drafted from, best first, probabilities as in ``q_show``.
        provenance: node -> where a free node came from (``FreeNode.provenance``: lookup's ``copied_from``,
            ``ngram``, ``match_at``, ``in_prompt``; recycling's ``row_token``, ``rank``, ``step``, ``node``).
        info: plain data for ``StepTrace.drafter``: ``tokens_left`` (the engine's, on speculating steps),
            ``chain_replays`` (``[{"levels": computed, "read": used}]``, one per chain replay), ``recycling_row``,
            ``lookup_length`` / ``lookup_branches`` / ``long_copy``, ``lookup_trusted`` (hybrid), ``row_pricing``,
            ``layer_skip``, as the drafter has them.
        predicted: node -> the learned stop policy's predicted acceptance, in [0, 1] (nodes of the levels it
            scored).
        roots: where the tree's root width was chosen online, the draft's best root candidates (token ids, best
            first) and whether it was sure there (``TreeChoiceObserver`` learns from them), else None.
        unfed_leaf: the tree's last node is not fed to the target: it is tested from its parent's row and, when
            accepted, ends the step with no bonus token (PEARL's first new draft, which the target's forward ran
            without: ``plugins/bundled/pearl.py``). It must be a leaf, last in tree order.
        own_draft_cache: the drafter cuts its draft model's cache itself (in ``observe``) instead of the engine
            keeping the accepted path's rows (PEARL keeps drafted tokens that later steps verify).
    """

    tree: DraftTree
    q_rows: LazyRows = field(default_factory=LazyRows)
    q_show: dict = field(default_factory=dict)
    signals: list = field(default_factory=list)
    calls: int = 0
    draft_rows: dict = field(default_factory=dict)
    tree_start: int = 0
    features: dict = field(default_factory=dict)
    q_top: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    roots: tuple[list[int], bool] | None = None
    unfed_leaf: bool = False
    own_draft_cache: bool = False


class Reach(NamedTuple):
    """How far a step's tree can matter: ``max_depth``, the tokens left before the run's budget less one (a path
    that deep plus the bonus token fills the room, so a deeper node could never be committed), and ``ends``, the
    EOS ids (nothing after one is committed, so an EOS node gets no children). Proposals stay a function of the
    history: lossless. transformers' candidate generators cap their drafts at the room left in the same way."""

    max_depth: int
    ends: frozenset


class DraftModelAccess:
    """What a drafter may do with its own model during a run: forwards appending to its own KV cache (one level, or
    several draft-chain levels in one replay), and for a draft that shares the target's layers (``layer-skip``), a
    copy of the target's cached rows of those layers. Built by the engine for each step over its
    ``forwarding.Forwards``.

    Attributes:
        model: the draft model (read-only).
        cache: the draft's own KV cache (``runtime/kv_cache.KVCache``): the drafter may cut it or drop layers.
        chain_levels: the most draft levels one replay may run (0: none; ``Engine`` ``chain_levels``).
    """

    def __init__(self, forwards, sampling: SamplingConfig, chain_levels: int):
        self._forwards, self._sampling = forwards, sampling
        self.model = forwards.pair.draft
        self.cache = forwards.draft_kv
        self.chain_levels = chain_levels

    def forward(self, input_ids: list[int], position_ids: list[int], mask, keep: int,
                hidden: bool = False) -> ForwardOutput:
        """One forward of the draft model appending to its cache (``Forwards.forward``, role ``draft``)."""
        return self._forwards.forward("draft", input_ids, position_ids, mask, keep=keep, hidden=hidden)

    def chain(self, input_ids: list[int], position_ids: list[int], mask, levels: int, uniforms=None):
        """Several draft levels of draft chains in one replay (``forwarding.Forwards.draft_chain``)."""
        return self._forwards.draft_chain(input_ids, position_ids, mask, levels, self._sampling, uniforms)

    def target_cached(self) -> int:
        """Positions the target's KV cache holds."""
        return self._forwards.target_kv.length

    def copy_from_target(self, layers: range) -> None:
        """Copy the target's cached keys and values of ``layers`` into the draft's cache (``kv_cache.copy_layers``):
        an early exit of the target computes exactly those."""
        copy_layers(self._forwards.target_kv, self.cache, layers)


@dataclass(frozen=True)
class DraftOffer:
    """What a run offers a registered method's drafter factory (``explorer.plugins.register_method``) when it
    builds the run's drafter: the settings and the pair's facts, never the models themselves (a model drafter
    reaches its draft model through ``DraftView.draft`` at each step; nothing reaches the target's weights).

    Attributes:
        config: the method's settings (``MethodConfig``), its ``defaults`` applied.
        sampling: temperature / top-k / top-p / seed (``SamplingConfig``).
        vocab_size: the pair's shared vocabulary (token ids are in ``[0, vocab_size)``).
        tokenizer: the pair's tokenizer (a transformers tokenizer; the tiny pair's byte-level one).
        eos_token_ids: the pair's end-of-sequence ids.
        device: where the models run (``cpu``, ``cuda``).
        draft_id, target_id: the pair's model names.
    """

    config: MethodConfig
    sampling: SamplingConfig
    vocab_size: int
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    device: str
    draft_id: str = ""
    target_id: str = ""


@dataclass(frozen=True, kw_only=True)
class DraftView:
    """What a drafter may read of the run it drafts for, built by the engine for each step (and for ``start``),
    and the one handle through which it acts: its own model (``draft``).

    Attributes:
        committed: prompt and committed token ids (a copy: the anchor last).
        n_prompt: prompt tokens at the start of ``committed``.
        steps_done: steps run so far.
        config: the method (``MethodConfig``); ``branching``: candidates per level of its tree.
        sampling: temperature / top-k / top-p / seed (``SamplingConfig``).
        verifier_name: the rule the tree will be verified by (it decides how children are drawn).
        reach: how deep a node can still matter and the EOS ids (``Reach``).
        generator: the run's random stream (``torch.Generator`` on the pair's device): a drafter that samples draws
            from it, in order, so that a run replays.
        next_logits, next_dist: float32 ``(vocab,)``: the target's logits and processed distribution after the last
            committed token where the target has read it (the roots of Lu et al.'s target-initialized candidates),
            else None.
        free_rows, free_rows_run: most target rows free nodes may fill (None: no limit), and the same on a copy run.
        row_pricing: ``row_pricing.RowPricing`` where free rows are priced, else None.
        stop_policy: when the draft model stops drafting (``policies/stopping.py``).
        adapts: the stop policy adapts online (its labels need the decision features).
        capture_features: the run records the decision features of drafted nodes.
        draft: the drafter's own model (``DraftModelAccess``), or None where no draft model runs.
        prompt_top: in ``start``, the target's best candidates ``[(id, plain probability)]`` at the prompt's last
            ``prompt_rows`` rows, where the prefill read them (None with a joint prefill: they come with the first
            step, ``VerifiedStep.prompt_top``).
        target_states: in ``start``, the prefill's hidden states of ``target_layers`` at every prompt row, model
            dtype ``(n_prompt, len(target_layers), hidden_size)``, else None.
        vocab_size: the pair's shared vocabulary (the width of every p and q row).
        time_forward: ``time_forward(rows)``, a context manager that times a drafter's own model call (one that
            does not run through ``draft``, such as a draft head's) as a ``draft forward`` of ``rows`` rows.
    """

    committed: tuple[int, ...]
    n_prompt: int
    steps_done: int
    config: MethodConfig
    sampling: SamplingConfig
    verifier_name: str
    branching: tuple[int, ...]
    reach: Reach
    generator: torch.Generator
    next_logits: torch.Tensor | None = None
    next_dist: torch.Tensor | None = None
    free_rows: int | None = None
    free_rows_run: int | None = None
    row_pricing: object = None  # row_pricing.RowPricing (it imports this module)
    stop_policy: StopPolicy | None = None
    adapts: bool = False
    capture_features: bool = False
    draft: DraftModelAccess | None = None
    prompt_top: list | None = None
    target_states: torch.Tensor | None = None
    vocab_size: int = 0
    time_forward: Callable[[int], ContextManager] = lambda rows: nullcontext()


def rejected_below(step, k: int) -> tuple[list[int], list[tuple[int, float]]] | None:
    """Where a verified step (``ObservedStep``) rejected the drafter's own tokens, for online distillation: the
    accepted path (node indices) and the target's ``k`` best tokens with plain probabilities at its last node's row
    (the anchor's where nothing was accepted), whose drafted children the verifier rejected. None where the path
    holds a node of another source (prompt lookup's copies, target-initialized roots), or the walk ended at a leaf:
    nothing of the drafter's was rejected."""
    tree, path = step.drafted.tree, step.verified.result.path
    if not len(tree) or any(tree.source[i] != "draft" for i in path):
        return None
    last = path[-1] if path else -1
    if not any(tree.source[c] == "draft" for c in tree.children(last)):
        return None
    return list(path), step.verified.p_rows.plain_top([last + 1], k)[last + 1]


def empty_draft(context_len: int) -> Drafted:
    """A step's draft with no tree yet (the draft model not run), anchored after ``context_len`` committed tokens."""
    return Drafted(DraftTree(), tree_start=context_len)


class Drafter:
    """Base drafter: its own free nodes as the tree (none: ``ar``). Free drafters override ``free_nodes`` and
    ``info``; the model drafter overrides ``draft``; a drafter that learns overrides ``observe``. A drafter is one
    of the step's observers (``observers.StepObserver``)."""

    name = "none"
    plugin = ""  # the registered method's name when a plugin built this drafter (``explorer.plugins``)
    uses_draft_model = False
    target_layers: tuple[int, ...] = ()  # target layers whose hidden states it reads (``forwarding.Forwards``)
    sizer = None  # an EAGLE head's online tree sizer (``policies/head_tree.py``), which a replay forces
    phase, after_clock = "drafter learn", False  # as a step observer

    def draft(self, view) -> Drafted:
        """The free nodes as the tree, within the row budget; where the run prices rows (``view.row_pricing``),
        only the nodes worth theirs (``row_pricing.py``)."""
        nodes, priced = self.priced_free_nodes(view)
        if self.plugin:  # a plugin's free nodes say whose they are
            for node in nodes:
                if node.source == "plugin":
                    node.provenance = {"plugin": self.plugin, **(node.provenance or {})}
        d = merge_free(empty_draft(len(view.committed)), nodes, self.row_budget(view), **view.reach._asdict())
        d.info.update(self.info(view))
        if priced is not None:
            d.info["row_pricing"] = priced
        return d

    def prompt_rows(self, view) -> int:
        """How many of the prompt's last rows of the target's prefill this drafter reads in ``start`` or
        ``remember_prompt`` (``view.prompt_top``: their best candidates); 0 (the default): the prefill keeps only
        the last row."""
        return 0

    def start(self, view) -> None:
        """Called once after the prefill (``view.committed`` holds the prompt); ``rewind`` returns here. Where the
        prefill joins the first verification (``Engine`` ``joint_prefill``), the target has not read the prompt
        yet: ``view.prompt_top`` is None here and comes to ``remember_prompt`` after that verification."""

    def remember_prompt(self, prompt: list[int], top: list) -> None:
        """The target's candidates ``top`` at the last rows of ``prompt``. With a joint prefill they come with the
        first step (``VerifiedStep.prompt_top``): a drafter that reads them calls this from its ``observe`` before
        learning from that step (``ModelDrafter`` does); ``rewind`` keeps them. Nothing by default."""

    def priced_free_nodes(self, view) -> tuple[list[FreeNode], dict | None]:
        """``free_nodes``, and where the run prices rows (``view.row_pricing``) only those worth their rows
        (``row_pricing.RowPricing.choose``), with the record of that choice for the trace (None: not priced)."""
        nodes = self.free_nodes(view)
        pricing = view.row_pricing
        if pricing is None:
            return nodes, None
        return pricing.choose(nodes, at=len(view.committed))

    def free_nodes(self, view) -> list[FreeNode]:
        """Deterministic proposals for this step (free drafters only), as a trie-able list of FreeNodes."""
        return []

    def row_budget(self, view) -> int | None:
        """Most target rows this step's free nodes may fill the tree to (None: no limit): ``view.free_rows``."""
        return view.free_rows

    def info(self, view) -> dict:
        """Plain data for the step trace (what the drafter read to propose this step's tree)."""
        return {}

    def observe(self, step) -> None:
        """Learn from a verified step (``observers.ObservedStep``; default: nothing to learn)."""

    def rewind(self) -> None:
        """Return to the state right after the prefill."""

    def reads_ahead(self) -> list[int] | None:
        """The tokens past the committed context that this step's target forward reads whatever the drafter
        drafts now, where its tree will begin with them as a chain: the target may read them while it drafts
        (``EngineOptions.lanes``). None (default): the target's forward needs the tree."""
        return None

    def carried(self, key: str) -> Carried:
        """What this drafter learned for the session's next run, its keyed parts under ``key``
        (``factory.carry_key``); nothing by default."""
        return Carried()

    def state_for_trace(self) -> dict:
        return {}


def merge_free(drafted: Drafted, free: list[FreeNode], max_rows: int | None = None, max_depth: int | None = None,
               ends=frozenset()) -> Drafted:
    """Add free nodes to a drafted tree as a trie: a free node whose token already hangs under the same parent is
    merged into that node (its subtree continues there), otherwise it becomes a new node. The result is again
    breadth-first, with each level's existing nodes first in their old order (so branch indices, stop signals and
    the draft cache rows of the existing nodes keep their meaning) and the new free nodes after them.

    ``max_depth`` / ``ends`` (``Reach``): free nodes deeper than ``max_depth`` (None = no limit) or below a
    node whose token is in ``ends`` (EOS ids) could never be committed, and are left out with their subtrees.

    Verification order follows tree order: at a node, draft-model children are tested before free ones.

    ``max_rows`` (``MethodConfig.free_rows``; None = no limit): free nodes that would take the tree past this many
    target rows (nodes + the anchor) are left out, with their subtrees; ``free`` is in priority order (each drafter
    lists its best branch first), so the best proposals fill the budget. Merging into an existing node costs no row.
    """
    old = drafted.tree
    if not free:
        return drafted
    # Work on (parent, token, source, old index or None, provenance) records, merged parents resolved as we go.
    records = [(old.parent[i], old.token[i], old.source[i], i, None) for i in range(len(old))]
    children: dict[int, dict[int, int]] = {}  # record parent (-1 anchor) -> token -> record index
    for r, (p, t, *_rest) in enumerate(records):
        children.setdefault(p, {}).setdefault(t, r)
    depth = [old.depth[i] for i in range(len(old))]  # per record
    where: list[int | None] = []  # free index -> record index (None: left out for the row budget)
    for node in free:
        parent = -1 if node.parent < 0 else where[node.parent]
        if parent is None:  # its parent was left out: so is its subtree
            where.append(None)
            continue
        below = 0 if parent < 0 else depth[parent]
        if (max_depth is not None and below >= max_depth) or (parent >= 0 and records[parent][1] in ends):
            where.append(None)  # never committed: past the room left, or after the end of the sequence
            continue
        hit = children.setdefault(parent, {}).get(node.token)
        if hit is None and max_rows is not None and len(records) + 1 >= max_rows:  # a new row would pass the budget
            where.append(None)
            continue
        if hit is None:
            hit = len(records)
            records.append((parent, node.token, node.source, None, node.provenance))
            depth.append(below + 1)
            children[parent][node.token] = hit
        where.append(hit)
    order = sorted(range(len(records)), key=lambda r: (depth[r], records[r][3] is None, r))
    new_index = {r: n for n, r in enumerate(order)}
    tree = DraftTree()
    for level in range(1, max(depth, default=0) + 1):
        rs = [r for r in order if depth[r] == level]
        tree.add_level([-1 if records[r][0] < 0 else new_index[records[r][0]] for r in rs],
                       [records[r][1] for r in rs], source=[records[r][2] for r in rs])
    to_new = {records[r][3]: new_index[r] for r in range(len(records)) if records[r][3] is not None}

    def row(r: int) -> int:  # rows are node + 1 (0 = the anchor)
        return 0 if r == 0 else to_new[r - 1] + 1

    out = Drafted(tree, q_rows=drafted.q_rows.remapped(row), q_show={to_new[i]: v for i, v in drafted.q_show.items()},
                  signals=drafted.signals, calls=drafted.calls,
                  draft_rows={to_new[i]: v for i, v in drafted.draft_rows.items()}, tree_start=drafted.tree_start,
                  features={to_new[i]: v for i, v in drafted.features.items()},
                  q_top={row(r): v for r, v in drafted.q_top.items()},
                  provenance={to_new[i]: v for i, v in drafted.provenance.items()}, info=dict(drafted.info),
                  predicted={to_new[i]: v for i, v in drafted.predicted.items()}, roots=drafted.roots)
    for r, rec in enumerate(records):
        if rec[3] is None:
            out.provenance[new_index[r]] = rec[4]
    return out
