"""Method settings: which speculative method runs, with which tree shape, verifier and stop policy.

Plain data (no torch), validated on construction so that bad input from the CLI or the UI fails early with a
message that names the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .methods import METHOD_LABELS, METHOD_SPECS, METHODS  # noqa: F401  (re-exported: the UI and CLI read them)
from .policies.cost_ratio import COST_RATIO_MODES
from .policies.fallback import FALLBACK_MODES
from .policies.stopping import DECISION_MODELS, DEFAULT_THRESHOLDS, STOP_POLICY_NAMES, adapt_problem
from .policies.tree_choice import ONLINE_ROOTS, TREE_CHOICES
from .tree import TreeShapeError, parse_k_config, parse_tree_template, rank_decay_parents, template_levels, tree_size
from .verify.registry import VERIFIER_REGISTRY, names, view

MAX_TREE_NODES = 512
MAX_BUFFERED = 64  # online distillation: requests' records held between two updates at most (the oldest go first)
FREE_ROWS_CPU = 32
"""Free branches fill a step's tree to at most this many target rows on the CPU. Measured here (bf16 target, 2
cores, oneDNN; docs/bench.md): a forward of 1 / 16 / 32 / 33 / 40 / 64 rows takes 201 / 215 / 234 / 283 / 302 / 336
ms, the matrix multiplies being done in blocks of 32 rows; the 33rd row costs as much as the 2nd to the 32nd
together. A free token is worth a row only below that edge."""
FREE_ROWS_CPU_RUN = 64
"""The CPU row budget of a step that continues a copy run (prompt lookup committed its whole best branch last step):
that branch alone may fill the next 32-row block. 64 rows cost 1.44x 32 rows (336 against 234 ms) and copy up to
twice as much, and a branch that was committed whole is usually committed almost whole again (docs/bench.md)."""
VERIFIERS = names(lambda v: v.selectable)
"""The verifiers ``MethodConfig.verifier`` takes besides ``auto`` (``rrs``, ``rrs-replacement``, ``mcns``, ``spechub``
and any that ``verify.registry.register_verifier`` added): a live, read-only view of the registry (``+`` with a
tuple gives a tuple)."""
VERIFIER_LABELS = view(lambda v: v.label, first={"auto": "auto (greedy at T=0, else RRS)"})
"""Menu labels by verifier name, ``auto`` first: a live, read-only view of the registry."""


@dataclass(frozen=True)
class MethodConfig:
    """Settings of one decoding method.

    Attributes:
        method: one of ``methods.METHODS`` (``ar``, ``sd``, ``mcsd``, ``mcsd-improved``, ``prompt-lookup``,
            ``token-recycling``, ``hybrid``, ``eagle``, ``layer-skip``).
        gamma: draft chain length for ``sd`` and ``layer-skip``.
        k_config: children per node at each draft level (``mcsd``; for ``mcsd-improved`` the first levels,
            padded with 1s up to ``max_depth``: 1s make the "fork" chains of Lu et al. 2024).
        width: target-initialized roots (``mcsd-improved`` with ``lossy``).
        max_depth: maximum draft levels for ``mcsd-improved``.
        lossy: ``mcsd-improved`` only: Lu et al.'s target-initialized roots + longest-branch rule (biased output).
            Off (default): one target root (the bonus token) and a lossless draft tree.
        stop: stop policy for ``mcsd-improved`` (``stopping.STOP_POLICY_NAMES``: none, confidence, decision,
            prune, specdec++, goodput); ``sd``/``mcsd`` never stop early.
        threshold: the stop policy's tau (``specdec++``: h); None = the policy's default
            (``stopping.DEFAULT_THRESHOLDS``).
        decision_model: which learned model the decision, prune and specdec++ policies read: ``context`` (the
            default: ``path`` plus session evidence, n-gram matches in the context and the target's earlier top
            candidates; the only one >= 0.75 ROC-AUC on every held-out prompt kind), ``path`` (``dist`` plus the
            token's q, depth and path probability: scores siblings apart), ``dist`` (entropy + top-10 of q, from
            Lu et al. 2024) or ``hidden`` (the draft's last hidden state, from the same paper). See docs/decision.md.
        branch_threshold: adaptive width (``mcsd`` and ``mcsd-improved``): a node gets its level's k children
            only where the draft's top probability is below this, else one child (a sure draft's second candidate
            is rarely accepted but costs a draft row on every later level). 1.0 = the fixed k_config.
        verifier: ``auto`` (greedy at temperature 0, else ``rrs``), ``rrs`` (without replacement, MCSD),
            ``rrs-replacement`` (SpecInfer), ``mcns`` (naive), ``spechub`` (two drafts per node) or one that
            ``register_verifier`` added (``VERIFIERS``). Drafting follows the verifier. The lossy mode always uses
            the longest-branch rule of Lu et al. 2024.
        lookup_tokens: prompt lookup: most tokens copied after a match (the adaptive copy length's cap; see
            ``drafters/lookup.py``; transformers copies a fixed ``prompt_lookup_num_tokens``).
        lookup_ngram: prompt lookup: the longest n-gram matched (shorter ones are tried when it has no match).
        lookup_branches: prompt lookup: distinct continuations proposed (the most recent matches first).
        lookup_alone: hybrids (``hybrid``, ``eagle-hybrid``): the shortest n-gram match on which prompt lookup's copies
            go alone (the draft model or head sits the step out); where the best match is shorter, lookup proposes
            nothing that step and the model or head drafts (``drafters/hybrid.py``). 1 = every match.
        recycling_widths: Token Recycling's static tree template (``tree.rank_decay_parents``).
        recycling_k: Token Recycling: candidates stored per token in the adjacency matrix.
        adapt: online adaptation of the stop policy (``engine/stop_models/online.py``): ``off`` (default), ``threshold``
            (refit from the session's ROC curve) or ``last-layer`` (refit the decision model's last layer); methods
            with a stop policy only. Changes how much is drafted, never the output law.
        fallback: falling back to plain decoding steps when speculation measures slower
            (``engine/policies/fallback.py``, SmartSpec's goodput rule): ``auto`` (default: on CUDA only), ``goodput``
            (everywhere) or ``off``. Lossless methods only (the lossy mode always speculates).
        free_rows: most target rows (the anchor included) a step's tree may reach when the free drafters'
            branches join it (``drafters.base.merge_free``; branches are added best first and the rest left out).
            0 = auto (``free_row_budget``): ``FREE_ROWS_CPU`` on the CPU, no limit on CUDA; and on a CPU where
            rows cost time (``forward_costs.row_prices``), Token Recycling's branches (its own tree, and the
            hybrid's beside the model's) keep only the template slots whose measured acceptance pays for their
            rows (``drafters/row_pricing.py``).
        cost_ratio: the ``goodput`` stop policy's r: ``fixed`` (the ``threshold`` setting) or ``measured`` (from
            the run's own step times, starting at ``threshold``; ``engine/policies/cost_ratio.py``).
        tree_choice: ``mcsd-improved`` (lossless) and ``eagle`` only: ``fixed`` (the published shape: ``k_config``'s
            root width; ``head_tokens`` nodes) or ``online`` (each step's root width chosen from ``ONLINE_ROOTS`` by
            the acceptance and forward costs the run measures, ``engine/policies/tree_choice.py``, the chains and the
            stop policy as before; for ``eagle`` how many of the ``head_tokens`` best nodes the step verifies and
            how many of the ``head_depth`` levels it drafts, ``engine/policies/head_tree.py``; ``DEFAULTS["eagle"]``
            chooses online too). The
            dataclass default is ``fixed`` (so a config saved before the choice existed replays as it ran);
            ``DEFAULTS["mcsd-improved"]`` chooses online (docs/bench.md, "The root width chosen online on the H100").
        head: ``eagle``: the EAGLE-3 head's checkpoint folder (``models/eagle3.py``); empty = the head shipped for
            the pair's target (``models/head_store.py``).
        head_topk, head_depth, head_tokens: ``eagle``: EAGLE-2's dynamic tree (``drafters/eagle.py``): children
            drawn per expanded node (and nodes expanded per level), most levels drafted, most nodes verified (SGLang's
            ``speculative_eagle_topk``, ``speculative_num_steps``, ``speculative_num_draft_tokens``).
        online_distill, distill_lr, distill_every: OSD's online distillation between requests of the head
            (``eagle``, ``eagle-hybrid``: ``online_distill.py``) or of a LoRA adapter on the draft model (``sd``,
            ``mcsd``, ``mcsd-improved``, ``hybrid``: ``online_distill_draft.py``): one AdamW step at ``distill_lr``
            every ``distill_every`` requests on the target's distributions where the drafted tokens were rejected
            (OSD: 1e-4 every 8, or 1e-5 every request); ``distill_replay``: earlier requests each update learns
            from again (0, OSD's: only those since the last update).
        draft_adapter: a draft model's LoRA adapter folder (``online_distill_draft.DraftDistiller.save``) the draft
            drafts with (and, with ``online_distill``, learns on from); empty = the draft as loaded.
        tree: ``mcsd`` only: a tree template (``tree.parse_tree_template``: breadth-first parents, -1 = the
            anchor) that replaces the full tree of ``k_config``, e.g. the optimal tree for measured acceptance
            rates (``instruments/optimal_tree.py``). None = the ``k_config`` tree.
    """

    method: str = "mcsd"
    gamma: int = 4
    k_config: tuple[int, ...] = (4, 2, 2)
    width: int = 3
    max_depth: int = 6
    lossy: bool = False
    stop: str = "confidence"
    threshold: float | None = None
    verifier: str = "auto"
    decision_model: str = "context"
    branch_threshold: float = 1.0
    lookup_tokens: int = 64  # 32-token copies double to 64 on a copy run (drafters/lookup.py)
    lookup_ngram: int = 3
    lookup_branches: int = 2
    lookup_alone: int = 1
    recycling_widths: tuple[int, ...] = (8, 3, 2, 1, 1, 1, 1, 1)
    recycling_k: int = 8
    tree: tuple[int, ...] | None = None
    adapt: str = "off"
    fallback: str = "auto"
    free_rows: int = 0
    cost_ratio: str = "fixed"
    tree_choice: str = "fixed"
    head: str = ""
    head_topk: int = 4
    head_depth: int = 6
    head_tokens: int = 16
    online_distill: bool = False
    distill_lr: float = 1e-4
    distill_every: int = 8
    distill_replay: int = 0
    draft_adapter: str = ""

    @property
    def spec(self):
        """The method's ``methods.MethodSpec``."""
        return METHOD_SPECS[self.method]

    @property
    def distils_draft(self) -> bool:
        """Whether the method's own model drafter drafts (the project's ``sd``, ``mcsd``, ``mcsd-improved``,
        ``hybrid``): a LoRA adapter on the draft can learn online (``online_distill_draft.py``)."""
        spec = self.spec
        return spec.uses_draft_model and not spec.self_draft and spec.drafter is None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {', '.join(METHODS)}")
        object.__setattr__(self, "k_config", parse_k_config(self.k_config))
        object.__setattr__(self, "recycling_widths", parse_k_config(self.recycling_widths))
        if self.tree is not None:
            if self.method != "mcsd":
                raise ValueError(f"a tree template belongs to mcsd, not {self.method}")
            object.__setattr__(self, "tree", parse_tree_template(self.tree))
        for name, lo, hi in (("gamma", 1, 64), ("width", 1, 64), ("max_depth", 1, 64), ("lookup_tokens", 1, 64),
                             ("lookup_ngram", 1, 8), ("lookup_branches", 1, 16), ("lookup_alone", 1, 8),
                             ("recycling_k", 1, 64),
                             ("free_rows", 0, MAX_TREE_NODES + 1), ("head_topk", 1, 16), ("head_depth", 1, 32),
                             ("head_tokens", 1, 256)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise TreeShapeError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if self.spec.lookup_hybrid and self.lookup_alone > self.lookup_ngram:
            raise ValueError(f"lookup_alone {self.lookup_alone} is longer than the longest n-gram lookup matches "
                             f"(lookup_ngram {self.lookup_ngram}): lookup would never propose")
        if self.stop not in STOP_POLICY_NAMES:
            raise ValueError(f"unknown stop policy {self.stop!r}; use one of {', '.join(STOP_POLICY_NAMES)}")
        if self.adapt != "off":
            if not self.spec.has_stop_policy:
                raise ValueError(f"online adaptation moves a stop policy; {self.method} has none")
            problem = adapt_problem(self.adapt, self.stop)
            if problem:
                raise ValueError(problem)
        if self.cost_ratio not in COST_RATIO_MODES:
            raise ValueError(f"unknown cost ratio {self.cost_ratio!r}; use one of {', '.join(COST_RATIO_MODES)}")
        if self.cost_ratio == "measured" and self.stop_policy_name() != "goodput":
            raise ValueError("a measured cost ratio is the goodput stop policy's r; choose stop goodput")
        if self.tree_choice not in TREE_CHOICES:
            raise ValueError(f"unknown tree choice {self.tree_choice!r}; use one of {', '.join(TREE_CHOICES)}")
        if self.tree_choice == "online" and (self.method not in ("mcsd-improved", "eagle", "eagle-hybrid")
                                             or self.lossy):
            raise ValueError("the tree chosen online is the lossless mcsd-improved's root width or eagle's tree "
                             f"size; {'the lossy mode' if self.lossy else self.method} keeps its fixed shape")
        if self.fallback not in FALLBACK_MODES:
            raise ValueError(f"unknown fallback {self.fallback!r}; use one of {', '.join(FALLBACK_MODES)}")
        if self.decision_model not in DECISION_MODELS:
            raise ValueError(f"unknown decision model {self.decision_model!r}; use {', '.join(DECISION_MODELS)}")
        if self.threshold is None:
            object.__setattr__(self, "threshold", DEFAULT_THRESHOLDS[self.stop])
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"threshold must be a number in [0, 1], got {self.threshold!r}")
        object.__setattr__(self, "threshold", float(self.threshold))
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        bt = self.branch_threshold
        if isinstance(bt, bool) or not isinstance(bt, (int, float)) or not 0.0 <= bt <= 1.0:
            raise ValueError(f"branch_threshold must be a number in [0, 1], got {bt!r}")
        object.__setattr__(self, "branch_threshold", float(bt))
        if self.spec.has_stop_policy and len(self.k_config) > self.max_depth:
            raise TreeShapeError(f"k_config {self.k_config} has more levels than max_depth {self.max_depth}")
        if self.verifier != "auto" and self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; use auto or one of {', '.join(VERIFIERS)}")
        if (self.online_distill or self.draft_adapter) and not self.distils_draft and not (
                self.online_distill and self.spec.uses_head):
            raise ValueError(f"online distillation learns an EAGLE-3 head (eagle, eagle-hybrid) or a LoRA adapter on "
                             f"the draft model (sd, mcsd, mcsd-improved, hybrid); {self.method} has neither"
                             + (" to adapt" if self.draft_adapter else ""))
        if not isinstance(self.draft_adapter, str):
            raise ValueError(f"draft_adapter must be a folder path (or empty), got {self.draft_adapter!r}")
        if self.online_distill:
            lr, every = self.distill_lr, self.distill_every
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0.0 < lr <= 1.0:
                raise ValueError(f"distill_lr must be a number in (0, 1], got {lr!r}")
            if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= 1000:
                raise ValueError(f"distill_every must be an integer in [1, 1000] requests, got {every!r}")
            replay = self.distill_replay
            if isinstance(replay, bool) or not isinstance(replay, int) or not 0 <= replay <= MAX_BUFFERED:
                raise ValueError(f"distill_replay must be an integer in [0, {MAX_BUFFERED}] requests, got {replay!r}")
        if not isinstance(self.head, str):
            raise ValueError(f"head must be a folder path (or empty for the shipped head), got {self.head!r}")
        if self.lossy and self.method != "mcsd-improved":
            raise ValueError(f"the lossy mode belongs to mcsd-improved, not {self.method}")
        if self.lossy and self.verifier != "auto":
            raise ValueError("the lossy mode uses Lu et al.'s longest-branch rule; leave the verifier on auto")
        hub = self.verifier != "auto" and VERIFIER_REGISTRY[self.verifier].draws == "hub"  # SpecHub's pairs
        branching = self.draft_branching() + ([self.head_topk] if self.spec.uses_head else [])
        if hub and any(k > 2 for k in branching):
            shape = (f"tree template {self.tree}" if self.tree else f"head_topk {self.head_topk}"
                     if self.spec.uses_head else f"k_config {self.k_config}")
            who = "SpecHub" if self.verifier == "spechub" else f"{self.verifier} (SpecHub's hub drafting)"
            raise TreeShapeError(f"{who} verifies at most two drafts per node; {shape} has {max(branching)} "
                                 f"(use e.g. {'head_topk 2' if self.spec.uses_head else '2,2,2'})")
        if "recycling" in self.spec.free and max(self.recycling_widths) > self.recycling_k:
            raise TreeShapeError(f"recycling widths {self.recycling_widths} ask for more candidates per token than "
                                 f"the matrix stores (recycling_k {self.recycling_k})")
        if self.max_nodes() > MAX_TREE_NODES:
            raise TreeShapeError(f"this tree has {self.max_nodes()} nodes; at most {MAX_TREE_NODES} are verified "
                                 "in one target pass")

    def draft_branching(self) -> list[int]:
        """Children per node for each draft-model level (empty for methods without a draft model, ``eagle``'s head
        included: its tree is dynamic)."""
        shape = self.spec.model_tree
        if shape in ("none", "head"):
            return []
        if shape == "chain":
            return [1] * self.gamma
        if shape == "tree":
            return template_levels(self.tree) if self.tree else list(self.k_config)
        return list(self.k_config) + [1] * (self.max_depth - len(self.k_config))

    def online_branching(self, roots: int) -> list[int]:
        """``draft_branching`` with ``roots`` candidates at the root where the tree is chosen online (``tree_choice``),
        else ``draft_branching`` unchanged."""
        branching = self.draft_branching()
        if self.tree_choice != "online" or self.spec.uses_head:  # a head's tree has no root width to choose
            return branching
        return [roots] + branching[1:]

    def free_nodes(self) -> int:
        """Most tree nodes the free drafters (lookup, recycling) add in one step."""
        n = 0
        if "lookup" in self.spec.free:
            n += self.lookup_tokens * self.lookup_branches
        if "recycling" in self.spec.free:
            n += len(rank_decay_parents(self.recycling_widths)[0])
        return n

    def max_draft_depth(self) -> int:
        """Deepest draft level a step can reach (the acceptance rate of Lu et al. 2024 divides by it; 0 for ``ar``)."""
        depth = len(self.draft_branching())
        if self.spec.uses_head:
            depth = self.head_depth
        if "lookup" in self.spec.free:
            depth = max(depth, self.lookup_tokens)
        if "recycling" in self.spec.free:
            depth = max(depth, len(self.recycling_widths))
        return depth

    @property
    def target_roots(self) -> int:
        """Target-initialized roots per step (0 unless lossy ``mcsd-improved``)."""
        return self.width if self.method == "mcsd-improved" and self.lossy else 0

    @property
    def is_lossy(self) -> bool:
        return self.target_roots > 0

    def max_nodes(self) -> int:
        roots = self.target_roots
        if roots:
            return roots * (1 + tree_size(self.draft_branching()))
        if self.tree:
            return len(self.tree)
        if self.spec.uses_head:
            return self.head_tokens
        return tree_size(self.online_branching(max(ONLINE_ROOTS))) + self.free_nodes()

    def verifier_for(self, greedy: bool) -> str:
        """The verifier that runs: ``longest-branch`` when lossy, ``greedy`` at temperature 0, else the setting."""
        if self.is_lossy:
            return "longest-branch"
        if greedy:
            return "greedy"
        return "rrs" if self.verifier == "auto" else self.verifier

    def stop_policy_name(self) -> str:
        return self.stop if self.spec.has_stop_policy else "none"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["k_config"] = list(self.k_config)
        d["recycling_widths"] = list(self.recycling_widths)
        d["tree"] = None if self.tree is None else list(self.tree)
        return d

    def with_(self, **changes) -> MethodConfig:
        """A copy with ``changes``; a new stop policy without a threshold gets that policy's default (and a fixed
        cost ratio unless it is ``goodput``); the lossy mode of Lu et al. 2024 without a tree choice gets the published
        shape (the root width is chosen online for the lossless method only)."""
        if changes.get("lossy") and "tree_choice" not in changes:
            changes["tree_choice"] = "fixed"
        if "stop" in changes and "threshold" not in changes and changes["stop"] != self.stop:
            changes["threshold"] = None
        if changes.get("stop", "goodput") != "goodput" and "cost_ratio" not in changes:
            changes["cost_ratio"] = "fixed"  # only goodput measures its setting
        return replace(self, **changes)


def free_row_budget(free_rows: int, device_type: str, copy_run: bool = False) -> int | None:
    """Most target rows free branches may fill a tree to (``MethodConfig.free_rows``), None for no limit; 0 (auto)
    is ``FREE_ROWS_CPU`` on the CPU (``FREE_ROWS_CPU_RUN`` for a step that continues a copy run) and no limit
    elsewhere (on CUDA the graph buckets go up to 256 rows and a 64-row graphed target forward costs 1.05x a 16-row
    one on an H100: 5.84 against 5.58 ms). A budget set by hand holds for every step."""
    if free_rows:
        return int(free_rows)
    if device_type != "cpu":
        return None
    return FREE_ROWS_CPU_RUN if copy_run else FREE_ROWS_CPU


DEFAULTS = {
    "ar": MethodConfig(method="ar"),
    "sd": MethodConfig(method="sd", gamma=4),
    "mcsd": MethodConfig(method="mcsd", k_config=(4, 2, 2)),
    # Chosen from measurements with the int8 draft (docs/bench.md): a second candidate at the root only where the
    # draft is unsure there (adaptive width), then chains as deep as the decision model lets them go; every
    # extra branch costs a draft row on each later level.
    "mcsd-improved": MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=16, stop="decision",
                                  branch_threshold=0.8, tree_choice="online"),
    "prompt-lookup": MethodConfig(method="prompt-lookup"),
    "token-recycling": MethodConfig(method="token-recycling"),
    "hybrid": MethodConfig(method="hybrid", k_config=(2,), max_depth=16, stop="decision", branch_threshold=0.8),
    # EAGLE-2's tree of up to 16 nodes, 4 children per expanded node, 6 levels (SGLang's defaults for small targets);
    # how many of the 16 a step verifies and how many levels it drafts are chosen online (docs/heads.md: with the
    # second head 1.37x ar against 1.27x for every node and level on the kinds set on an Intel Xeon with AMX)
    "eagle": MethodConfig(method="eagle", tree_choice="online"),
    # the same head where prompt lookup finds no match of two tokens or more: a one-token match's copies cost target
    # rows and were rarely accepted (docs/heads.md, "The head with prompt lookup": 1.90x ar against 1.70x for
    # lookup on every match, kinds set, greedy, one run)
    "eagle-hybrid": MethodConfig(method="eagle-hybrid", tree_choice="online", lookup_alone=2),
    "layer-skip": MethodConfig(method="layer-skip", gamma=4),
}
