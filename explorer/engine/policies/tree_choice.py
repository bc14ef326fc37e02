"""The draft tree chosen online: how many root candidates the improved MCSD drafts, from measured acceptance and cost.

The improved MCSD's tree is a fork and chains: ``k`` candidates at the root (the draft's best tokens; one where the
draft is sure, ``branch_threshold``), then a chain under each, as deep as the stop policy lets it go. The published
shape fixes ``k`` (``k_config``). Which ``k`` is fastest depends on the text and the machine: a second root is
accepted more often where the draft hesitates (chat) than on code, and on a CPU where a target forward's extra rows
are dear every root costs a draft row on each later level and a target row per level (docs/bench.md, "The optimal tree
for measured acceptance": the cost-aware tree was 1.21-1.43x the default one, found after the fact).

``TreeChooser`` measures, as the run goes, what the shape search of ``instruments/optimal_tree.py`` needs:

* **acceptance by (depth, rank)**: at the root, for every rank up to the widest candidate, whether the token the
  step committed first was that rank's candidate, given that no better-ranked one was (the draft's best tokens are
  known whether or not they were drafted, so untried widths are measured too: exact for greedy decoding, where the
  committed token is the target's argmax; for sampling an estimate of what the verification rule accepts); down
  the chains, the verification rule's acceptance probability of each drafted first child (``NodeOdds.accept_prob``).
  Steps where the draft was sure at the root are counted apart (they draft one root whatever ``k`` is);
* **how deep the stop policy lets the chains go** (levels drafted per step, a running mean);
* **what a forward costs here by rows** (draft and target, measured once per loaded pair:
  ``forward_costs.tree_costs``).

Each step it prices every candidate width ``k`` as the tree of ``k`` roots each carrying a chain of the mean depth:
expected tokens under Sequoia's positional acceptance model (Chen et al. 2024, arXiv 2402.12374; the model
``instruments/optimal_tree.py`` searches every shape with) over the step's modelled milliseconds (one draft forward
per level fed the level above, then one target forward of every node: ``optimal_tree.step_cost_ms``'s model), mixed
with the sure steps at their measured share, and drafts the fastest. Until it has measured ``warmup`` steps it drafts
the published width. The choice depends only on earlier steps, never on this step's draws, so the output law is
unchanged; the costs are timed, so a replay takes the recorded ones (``factory.build_parts(..., follow=trace)``).
The same costs set ``row_floor``, below which the drafter stops a side branch
(``ModelDrafter._prune_side_branches``). What it measured carries to the session's next run (``state`` /
``restore``, ``Carried.tree``). The default
``mcsd-improved`` chooses this way: on an H100 it ran HumanEval greedy at 1.19x ``ar`` against 1.04x for the
published width, which drafts a second root whose chain costs host work at every level; on a 2-core CPU the two
were level.
"""

from __future__ import annotations

from ..speedup import interpolate_ms

TREE_CHOICES = ("fixed", "online")
"""``MethodConfig.tree_choice``: the published shape (``fixed``), or the root width chosen each step (``online``)."""
ONLINE_ROOTS = (1, 2, 3, 4)
"""The root widths the online choice weighs."""
WARMUP = 4
"""Steps drafted with the published width before the chooser trusts its measurements."""
PRIOR = (1.0, 0.0)
"""Pseudo-counts (observations, accepted) each acceptance estimate starts from: one observation, rejected (an
untried rank or depth is expected to accept nothing, so a width is drafted only once it measured that it pays)."""
DEPTH_DECAY = 0.8
"""Weight of the past in the running mean of levels drafted per step."""


class _Rate:
    """An acceptance estimate: accepted over observed, with ``PRIOR``'s pseudo-counts."""

    __slots__ = ("n", "accepted")

    def __init__(self, n: float = 0.0, accepted: float = 0.0):
        self.n, self.accepted = n, accepted

    def add(self, p: float) -> None:
        self.n += 1.0
        self.accepted += p

    @property
    def value(self) -> float:
        return (self.accepted + PRIOR[0] * PRIOR[1]) / (self.n + PRIOR[0])

    def to_list(self) -> list[float]:
        return [round(self.n, 6), round(self.accepted, 6)]


class TreeChooser:
    """Picks each step's root width for the improved MCSD from measured acceptance and forward costs.

    Args:
        roots: the candidate root widths (``ONLINE_ROOTS`` or fewer), each >= 1.
        published: the width the method's config drafts (used during the warm-up).
        max_depth: the deepest level a step may draft (the config's ``max_depth``).
        branch_threshold: the adaptive width's bound: a root whose best token has q at least this drafts one root.
        warmup: steps with the published width before choosing.
    """

    def __init__(self, roots=ONLINE_ROOTS, published: int = 2, max_depth: int = 16, branch_threshold: float = 1.0,
                 warmup: int = WARMUP):
        self.roots = tuple(sorted(set(int(k) for k in roots)))
        if not self.roots or self.roots[0] < 1:
            raise ValueError(f"root widths must be >= 1, got {roots!r}")
        self.published, self.max_depth = int(published), int(max_depth)
        self.branch_threshold, self.warmup = float(branch_threshold), int(warmup)
        self.costs: dict | None = None  # {"draft": {rows: ms}, "target": {rows: ms}}, read at the first choice
        self.reset()

    def reset(self) -> None:
        width = max(self.roots)
        self.root_unsure = [_Rate() for _ in range(width)]  # rank -> P(accepted | better ranks rejected)
        self.root_sure = _Rate()  # the sure root's rank 0
        self.chain = [_Rate() for _ in range(self.max_depth)]  # depth (0-based) -> first child accepted, depth >= 2
        self.steps = 0
        self.sure_steps = 0
        self.levels = 0.0  # running mean of levels drafted per step
        self.last: dict | None = None

    # ------------------------------------------------------------------------------------------------ learning

    def record(self, candidates: list[int], sure: bool, committed_first: int, chain_odds: list[tuple[int, float]],
               levels: int) -> None:
        """What one drafted step measured.

        Args:
            candidates: the draft's best tokens at the root, best first (at least ``max(roots)`` where known).
            sure: whether the draft was sure at the root (one root drafted whatever the width).
            committed_first: the first token the step committed (an accepted root, or the bonus token).
            chain_odds: ``(depth, accept_prob)`` of every drafted first child at depth >= 2 (1-based depths).
            levels: draft levels the step drafted.
        """
        self.steps += 1
        if sure:
            self.sure_steps += 1
            self.root_sure.add(1.0 if candidates and candidates[0] == committed_first else 0.0)
        else:
            for rank, rate in enumerate(self.root_unsure[:len(candidates)]):
                hit = candidates[rank] == committed_first
                rate.add(1.0 if hit else 0.0)
                if hit:
                    break  # the ranks below an accepted one are never tested
        for depth, p in chain_odds:
            if 2 <= depth <= self.max_depth:
                self.chain[depth - 1].add(float(p))
        self.levels = float(levels) if self.steps == 1 else DEPTH_DECAY * self.levels + (1 - DEPTH_DECAY) * levels

    # ------------------------------------------------------------------------------------------------ choosing

    def _depth(self) -> int:
        return max(1, min(self.max_depth, round(self.levels)))

    def _tokens(self, root: list[_Rate], depth: int) -> float:
        """Expected tokens a step commits with these root ranks, each carrying a chain to ``depth`` levels: 1 (the
        bonus token) + sum over ranks of P(rank accepted) * (1 + the chain's expected accepted tokens)."""
        chain, reach = 0.0, 1.0
        for d in range(1, depth):
            reach *= self.chain[d].value
            chain += reach
        tokens, rejected = 1.0, 1.0
        for rate in root:
            tokens += rejected * rate.value * (1.0 + chain)
            rejected *= 1.0 - rate.value
        return tokens

    def _cost_ms(self, k: int, depth: int) -> float:
        """Modelled milliseconds of a step with ``k`` roots and chains to ``depth`` levels: draft forwards of 1, then
        ``k`` rows per level below the first, and one target forward of ``1 + k * depth`` rows."""
        draft, target = self.costs["draft"], self.costs["target"]
        return (interpolate_ms(draft, 1) + (depth - 1) * interpolate_ms(draft, k)
                + interpolate_ms(target, 1 + k * depth))

    def price(self, k: int) -> dict:
        """Width ``k``'s modelled step: ``{"k", "expected_tokens", "cost_ms", "tokens_per_s"}`` (mean over sure and
        unsure steps at their measured shares). Needs ``costs``."""
        depth = self._depth()
        share_sure = self.sure_steps / self.steps if self.steps else 0.0
        e_unsure, c_unsure = self._tokens(self.root_unsure[:k], depth), self._cost_ms(k, depth)
        e_sure, c_sure = self._tokens([self.root_sure], depth), self._cost_ms(1, depth)
        tokens = share_sure * e_sure + (1 - share_sure) * e_unsure
        ms = share_sure * c_sure + (1 - share_sure) * c_unsure
        return {"k": k, "expected_tokens": round(tokens, 4), "cost_ms": round(ms, 3),
                "tokens_per_s": round(tokens / ms * 1e3, 4) if ms > 0 else None}

    def row_floor(self) -> float | None:
        """The chance of being accepted a side branch must keep to be drafted deeper: what one more node costs here
        (a target row and a draft row, each the mean cost per row from one row to the widest measured) over a
        one-row target forward, the step an accepted token saves. None without costs. CPU C with packed weights:
        0.04-0.06 (a 16-row target forward 825-985 ms against 507-566 ms for one); on a GPU, where rows are nearly
        free, near 0."""
        if not self.costs:
            return None
        one = interpolate_ms(self.costs["target"], 1)
        extra = sum(_per_row_ms(self.costs[model]) for model in ("draft", "target"))
        return extra / one if one > 0 else None

    def choose(self) -> int:
        """The root width of the next step: the published one during the warm-up or without costs, else the width
        with the most modelled tokens per second (ties to the narrower). ``last`` keeps why, for the trace."""
        if self.steps < self.warmup or not self.costs:
            self.last = {"k": self.published, "why": "warm-up", "steps": self.steps}
            return self.published
        prices = [self.price(k) for k in self.roots]
        best = max(prices, key=lambda p: (p["tokens_per_s"] or 0.0, -p["k"]))
        self.last = {"k": best["k"], "why": "fastest", "depth": self._depth(), "prices": prices,
                     "share_sure": round(self.sure_steps / self.steps, 4)}
        return best["k"]

    # ------------------------------------------------------------------------------------------ carrying over

    def state(self) -> dict:
        """What the chooser measured, as plain data for the session's next run (``restore``) and the trace."""
        return {"roots": list(self.roots), "max_depth": self.max_depth, "steps": self.steps,
                "sure_steps": self.sure_steps, "levels": round(self.levels, 6),
                "root_unsure": [r.to_list() for r in self.root_unsure], "root_sure": self.root_sure.to_list(),
                "chain": [r.to_list() for r in self.chain]}

    def restore(self, state: dict) -> bool:
        """Continue from an earlier run's ``state``: True, or False (starting afresh) where it belongs to other
        widths or depth or is malformed."""
        try:
            if list(state["roots"]) != list(self.roots) or int(state["max_depth"]) != self.max_depth:
                return False
            root = [_Rate(float(n), float(a)) for n, a in state["root_unsure"]]
            chain = [_Rate(float(n), float(a)) for n, a in state["chain"]]
            if len(root) != len(self.root_unsure) or len(chain) != len(self.chain):
                return False
            n, a = state["root_sure"]
            self.root_unsure, self.chain, self.root_sure = root, chain, _Rate(float(n), float(a))
            self.steps, self.sure_steps = int(state["steps"]), int(state["sure_steps"])
            self.levels = float(state["levels"])
        except (KeyError, TypeError, ValueError):
            self.reset()
            return False
        return True


def _per_row_ms(points: dict) -> float:
    """Milliseconds one more query row adds to a forward: the mean slope from one row to the widest measured."""
    widest = max(int(r) for r in points)
    if widest <= 1:
        return 0.0
    return max(interpolate_ms(points, widest) - interpolate_ms(points, 1), 0.0) / (widest - 1)


__all__ = ["ONLINE_ROOTS", "TREE_CHOICES", "TreeChooser"]
