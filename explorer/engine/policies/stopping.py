"""Stop policies: after each draft level, decide whether drafting goes on, for the whole tree or per branch.

A policy sees the newest level of the tree (``LevelView``: the draft's probability of each new token, and for the
learned policies the draft's last hidden state and the 11 distribution features at each token's parent row),
gives every new node a score, reduces them to one score per *branch* (the subtree under one of the anchor's
children) and returns a ``StopSignal`` (plain data, kept in the step trace). Every rule reads "keep drafting while
the score reaches the threshold", so one chart and one slider serve them all:

* ``none``: static depth, never stops early (the MCSD baseline).
* ``confidence``: score = the draft's probability of the token; keep drafting while any branch reaches tau
  (Hugging Face assisted generation stops its chain the same way, threshold 0.4).
* ``decision``: Lu et al.'s rule (Lu et al. 2024, arXiv 2409.10644): score = a learned decision model's predicted
  acceptance of the token (``explorer.decision``); keep drafting while any branch's score reaches tau.
* ``prune``: per-branch pruning (beyond the paper): the same scores, but a branch whose score falls below tau stops
  alone (its frontier gets no children, so its rows leave the next mask slices); drafting ends when every branch
  has stopped.
* ``specdec++``: SpecDec++'s cumulative rule (Huang et al. 2024, arXiv 2405.19715): stop when the predicted
  probability that at least one token of the path is rejected, ``1 - prod(predicted acceptance)``, exceeds ``h``.
  Shown on the same scale: score = ``prod(predicted acceptance)`` of the best path in a branch, threshold
  ``1 - h``.
* ``goodput``: draft one more level only while it is expected to raise the step's tokens per millisecond (the
  goodput of SmartSpec, Liu et al. 2024, arXiv 2406.14066, applied per level). The setting is ``r``, the cost of a draft
  forward over the rest of a step (target forward and host work). Score of a node = ``reach(x) * a(x)``, the
  expected tokens its next level adds (``reach``: the predicted chance the whole path to x is accepted, ``a``:
  x's own predicted acceptance, standing in for its child's). Exactly one path of a tree is accepted, so these
  chances add up over the level's nodes: a branch's score is the sum over its newest nodes, and the step's gain
  the sum over its branches (the signal's ``score``). After ``D`` draft forwards with ``E`` tokens expected
  accepted so far (the chance of reaching each drafted level, summed the same way), one more forward pays when
  the gain exceeds ``r (1 + E) / (1 + D r)``, the threshold recorded for the level (it rises as the step grows);
  drafting goes on or stops for all branches at once, since one forward serves them all. Calibrated predictions
  make the rule right, which is what online adaptation provides (``engine/stop_models/online.py``). Sums, not maxima
  (the best node's): a maximum is exact for a chain and short for a tree.

For the other policies a branch's score is the best score among its newest nodes. The rules themselves
(``decide``) are pure functions of the branch scores, so the app can re-run them on a recorded step with another
threshold (``replay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...trace.records import StopSignal
from ..live import LiveNames

_POLICIES: dict[str, type] = dict.fromkeys(("none", "confidence", "decision", "prune", "specdec++", "goodput"))
"""Name -> policy class (filled below; ``register_stop_policy`` adds)."""
STOP_POLICY_NAMES = LiveNames(_POLICIES)
"""The stop policies ``MethodConfig.stop`` takes: a live tuple-like view (a registered policy appears at once)."""
STOP_POLICY_ORIGINS: dict[str, dict] = {}
"""Where each registered policy came from (``register_stop_policy``'s ``origin``); the project's own have none."""
LEARNED_POLICIES = ("decision", "prune", "specdec++", "goodput")
# Measured on the embedded pair (docs/decision.md, "Stop-policy ablation"): decision / prune at tau 0.75 (near the
# Youden threshold of the model measured then, 0.80; the shipped context model's is 0.72) beat 0.5 on MT-bench
# (1.19-1.23x vs 1.00-1.02x over ar, greedy) and matched it on HumanEval; SpecDec++ at h 0.5 beat h 0.7 on MT-bench
# (1.15x vs 1.00x) and matched it on HumanEval; in a small HumanEval sweep h 0.3 (the paper's) / 0.5 / 0.7 were
# within noise of each other.
# goodput's r: a draft forward of the embedded pair over a target forward on the CPU, 45 / 200 ms (docs/bench.md).
DEFAULT_THRESHOLDS = {"none": 0.0, "confidence": 0.3, "decision": 0.75, "prune": 0.75, "specdec++": 0.5,
                      "goodput": 0.22}
# The learned models a policy can read (engine/stop_models/model.py; docs/decision.md), the default first.
DECISION_MODELS = ("context", "path", "dist", "hidden")
# Online adaptation (``engine/stop_models/online.py``): which policies each mode can move. A threshold refit needs
# per-token acceptance scores (not SpecDec++'s path products); a last-layer refit needs a decision model.
ADAPT_MODES = ("off", "threshold", "last-layer")
ADAPTABLE = {"off": STOP_POLICY_NAMES, "threshold": ("confidence", "decision", "prune"),
             "last-layer": LEARNED_POLICIES}
# The name of each policy's setting where it is not tau (SpecDec++'s h, goodput's cost ratio r).
SETTING_NAMES = {"specdec++": "h", "goodput": "r"}
STOP_POLICY_LABELS = {
    "none": "none (static depth)",
    "confidence": "draft confidence",
    "decision": "decision model (Lu et al.)",
    "prune": "decision model, per branch",
    "specdec++": "SpecDec++ cumulative",
    "goodput": "goodput (expected gain vs. cost)",
}


@dataclass
class LevelView:
    """What a policy sees after draft level ``level`` was added to ``tree``.

    Attributes:
        tree: the step's DraftTree (``explorer.engine.tree``).
        level: 1-based level just drafted.
        q: node index -> the draft's probability of that node's token (as displayed).
        inputs: the decision models' inputs for the new nodes, in level order (``decision.features.model_inputs``:
            ``dist`` ``(n, 11)``, ``path`` ``(n, 14)``, ``context`` ``(n, 24)`` float32, and ``hidden`` ``(n, H)``
            when the policy needs hidden states); empty unless the policy asked for features.
        active: branches (as str) still drafting; the engine only drafts below these.
        accept: node index -> predicted acceptance of earlier levels of this step (filled by learned policies).
    """

    tree: object
    level: int
    q: dict
    inputs: dict = field(default_factory=dict)
    active: set = field(default_factory=set)
    accept: dict = field(default_factory=dict)


def decide(policy: str, scores: dict, threshold: float) -> tuple[bool, list[str]]:
    """Apply a policy's rule to one level's branch scores.

    Args:
        policy: a name in ``STOP_POLICY_NAMES``.
        scores: branch (str) -> score of the branches scored at this level.
        threshold: the score a branch must reach to keep drafting (for ``specdec++`` this is ``1 - h``, for
            ``goodput`` the level's threshold from ``goodput_threshold``).
    Returns:
        ``(keep_drafting, pruned)``: whether any drafting goes on, and the branches that stop here.
    """
    if policy == "none":
        return True, []
    if policy == "goodput":  # the branches' gains add up: one draft forward serves them all
        keep = sum(scores.values()) >= threshold
        return keep, [] if keep else sorted(scores, key=int)
    below = sorted((b for b, s in scores.items() if s < threshold), key=int)
    if policy == "prune":
        return len(below) < len(scores), below
    keep = len(below) < len(scores)
    return keep, [] if keep else sorted(scores, key=int)


def replay(signals: list[StopSignal], threshold: float) -> list[dict]:
    """Re-run recorded stop decisions with another threshold on the score scale (``score_threshold``; the scores
    are what the policy computed; ``goodput`` derives each level's threshold from it and the level's record).

    Returns one row per recorded level, until the new rule stops everything: ``{"level", "keep_drafting",
    "pruned", "active", "threshold"}`` (the level's threshold on the score scale). Pruning with a lower threshold
    can only keep branches the recording already dropped, whose later scores were never computed; those rows say so
    with ``"unknown": [...]``.
    """
    out: list[dict] = []
    if not signals:
        return out
    policy = signals[0].policy
    active: set[str] | None = None
    for s in signals:
        scores = {b: v for b, v in s.scores.items() if active is None or b in active}
        unknown = sorted(active - set(s.scores), key=int) if active is not None else []
        at = level_threshold(policy, threshold, s)
        keep, pruned = decide(policy, scores, at)
        if keep:  # side branches the row floor stopped stay stopped: that rule does not read the threshold
            pruned = sorted(set(pruned) | (set(s.cost_pruned) & set(scores)), key=int)
        active = set(scores) - set(pruned) | set(unknown)
        out.append({"level": s.level, "keep_drafting": keep or bool(unknown), "pruned": pruned,
                    "active": sorted(active, key=int), "unknown": unknown, "threshold": at})
        if not keep and not unknown:
            break
    return out


class StopPolicy:
    """Interface: ``node_scores(view)`` gives the new nodes a score; ``signal(view)`` returns the StopSignal.

    ``needs_features`` tells the engine to collect the decision features of each drafted level, and
    ``needs_hidden`` whether they must include the draft's hidden states (an extra output of every draft forward).
    Raises ValueError for a threshold outside [0, 1].
    """

    name = "base"
    needs_features = False
    needs_hidden = False

    def __init__(self, threshold: float):
        self.threshold = 0.0
        self.set_threshold(threshold)

    def set_threshold(self, threshold: float) -> None:
        """Move the policy's threshold (the online adaptation's refit, the goodput policy's measured r) from the next
        level on. Raises ValueError outside [0, 1]."""
        if not (0.0 <= threshold <= 1.0):
            raise ValueError(f"stop threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    @property
    def score_threshold(self) -> float:
        """The threshold on the score scale (what a branch must reach to keep drafting)."""
        return score_threshold(self.name, self.threshold)

    def node_scores(self, view: LevelView) -> dict[int, float]:
        raise NotImplementedError

    def signal(self, view: LevelView) -> StopSignal:
        node_scores = self.node_scores(view)
        per_branch: dict[str, float] = {}
        branch_of = view.tree.branch_ids()
        for i in view.tree.level(view.level):
            b = str(branch_of[i])
            if b in view.active:
                per_branch[b] = max(per_branch.get(b, 0.0), float(node_scores.get(i, 0.0)))
        per_branch = self.branch_scores(view, node_scores, per_branch)
        cost = self.step_cost(view)
        threshold = level_threshold(self.name, self.score_threshold, **cost)
        keep, pruned = decide(self.name, per_branch, threshold)
        return StopSignal(level=view.level, scores=per_branch, score=self.level_score(per_branch),
                          threshold=threshold, keep_drafting=keep, policy=self.name, pruned=pruned, **cost)

    def branch_scores(self, view: LevelView, node_scores: dict[int, float], best: dict[str, float]) -> dict:
        """Each active branch's score at this level: its best new node's (``best``), except where a policy
        combines them otherwise (``goodput``)."""
        return best

    def level_score(self, branch_scores: dict[str, float]) -> float:
        """The level's score, the one ``decide`` compares with the threshold: the best branch's."""
        return max(branch_scores.values(), default=0.0)

    def step_cost(self, view: LevelView) -> dict:
        """What a threshold that depends on the step so far reads (``goodput``: ``expected`` tokens and draft
        ``forwards``, recorded in the StopSignal); empty for the fixed-threshold policies."""
        return {}


class ConfidenceStop(StopPolicy):
    name = "confidence"

    def node_scores(self, view: LevelView) -> dict[int, float]:
        return {i: view.q.get(i, 0.0) for i in view.tree.level(view.level)}


class NoStop(ConfidenceStop):
    """Static depth: the draft confidence is recorded for the chart, ``decide`` never stops."""

    name = "none"


class DecisionStop(StopPolicy):
    """Lu et al.'s rule with a learned decision model (``explorer.decision.DecisionModel``) as the score."""

    name = "decision"
    needs_features = True

    def __init__(self, threshold: float, model):
        super().__init__(threshold)
        if model is None:
            raise ValueError(f"stop policy {self.name!r} needs a decision model")
        self.model = model
        self.needs_hidden = model.kind == "hidden"

    def node_scores(self, view: LevelView) -> dict[int, float]:
        nodes = list(view.tree.level(view.level))
        pred = self.model.predict(**view.inputs).tolist()
        scores = dict(zip(nodes, pred))
        view.accept.update(scores)
        return scores


class PruneStop(DecisionStop):
    name = "prune"


class SpecDecPPStop(DecisionStop):
    """Score = product of predicted acceptances along the node's path; stop when 1 - product > h."""

    name = "specdec++"

    def node_scores(self, view: LevelView) -> dict[int, float]:
        accept = super().node_scores(view)
        return {i: path_reach(view, i) for i in accept}


class GoodputStop(DecisionStop):
    """Score = ``reach(x) * a(x)``, the expected tokens a node's next level adds; keep drafting while the best
    branch's gain exceeds ``r (1 + E) / (1 + D r)`` (``goodput_threshold``). Module docstring: the derivation."""

    name = "goodput"

    def node_scores(self, view: LevelView) -> dict[int, float]:
        accept = super().node_scores(view)
        return {i: path_reach(view, i) * a for i, a in accept.items()}

    def branch_scores(self, view: LevelView, node_scores: dict[int, float], best: dict[str, float]) -> dict:
        """A branch's expected gain: the sum of its new nodes' scores. Exactly one path of a tree is accepted, so
        the chances of reaching the next level through different nodes add up (EAGLE-2's expected acceptance
        length sums path probabilities over a tree's nodes the same way). An over-confident model can make
        siblings' chances sum past the chance of reaching this level; the branches' gains are then scaled down
        to it (``level_mass``). In Lu et al.'s lossy mode each branch is verified on its own and the longest kept:
        there the sum bounds the chance from above, as the best branch's did from below."""
        tree, branch_of = view.tree, view.tree.branch_ids()
        gain: dict[str, float] = {}
        for i in tree.level(view.level):
            b = str(branch_of[i])
            if b in best:
                gain[b] = gain.get(b, 0.0) + float(node_scores.get(i, 0.0))
        total, mass = sum(gain.values()), level_mass(view)[-1]
        if total > mass > 0.0:
            gain = {b: g * mass / total for b, g in gain.items()}
        return gain

    def level_score(self, branch_scores: dict[str, float]) -> float:
        """The step's gain from one more level: the branches' gains summed (``decide`` compares the same sum)."""
        return sum(branch_scores.values())

    def step_cost(self, view: LevelView) -> dict:
        """``forwards``: drafted levels so far (a draft forward each); ``expected`` (E): the tokens the step
        expects to accept, the chance of reaching each drafted level summed (``level_mass``)."""
        levels, mass = drafted_levels(view), level_mass(view)
        return {"expected": sum(mass[lv - 1] for lv in levels), "forwards": len(levels)}


def drafted_levels(view: LevelView) -> list[int]:
    """The levels (1-based) of ``view``'s tree up to ``view.level`` that the draft model proposed."""
    tree = view.tree
    return [lv for lv in range(1, view.level + 1) if tree.source[tree.level_starts[lv - 1]] == "draft"]


def level_mass(view: LevelView) -> list[float]:
    """The predicted chance that the accepted path reaches each level 1 .. ``view.level`` (index 0 = level 1): the
    level's nodes' ``path_reach`` summed (their paths exclude each other), capped by the level above it, since no
    path reaches a level without passing the one before."""
    out, above = [], 1.0
    for lv in range(1, view.level + 1):
        above = min(above, sum(path_reach(view, i) for i in view.tree.level(lv)))
        out.append(above)
    return out


def path_reach(view: LevelView, i: int, root_chance: dict | None = None) -> float:
    """The predicted chance that node ``i`` and every drafted node above it are accepted (``view.accept``;
    target-initialized roots count as 1). ``root_chance``: root node -> the chance to take for it instead of its
    own predicted acceptance (``ModelDrafter._prune_side_branches``: a root's chance after its better-ranked
    siblings were rejected)."""
    tree = view.tree
    prod, j = 1.0, i
    while j >= 0:
        if root_chance is not None and tree.parent[j] < 0 and j in root_chance:
            prod *= root_chance[j]
        elif tree.source[j] == "draft":
            prod *= view.accept.get(j, 1.0)
        j = tree.parent[j]
    return prod


def goodput_threshold(r: float, forwards: int, expected: float) -> float:
    """The expected gain (tokens) one more draft forward must bring to raise tokens per millisecond.

    With a step costing ``1 + forwards * r`` target-forward units and ``1 + expected`` tokens (the bonus token
    included), another forward (cost ``r``) that adds ``g`` tokens pays when
    ``(1 + expected + g) / (1 + (forwards + 1) r) > (1 + expected) / (1 + forwards r)``, i.e.
    ``g > r (1 + expected) / (1 + forwards r)``. Args: ``r`` in [0, 1], ``forwards`` >= 0, ``expected`` >= 0.
    """
    return r * (1.0 + expected) / (1.0 + forwards * r)


def level_threshold(policy: str, threshold: float, signal: StopSignal | None = None, *, forwards: int = 0,
                    expected: float = 0.0) -> float:
    """The threshold on the score scale at one level: ``threshold`` itself, except for ``goodput`` (whose setting
    ``threshold`` is r): ``goodput_threshold`` with the level's draft ``forwards`` and ``expected`` tokens, read
    from ``signal`` when given (a recorded level)."""
    if policy != "goodput":
        return threshold
    if signal is not None:
        forwards, expected = signal.forwards or 0, signal.expected or 0.0
    return goodput_threshold(threshold, forwards, expected)


_POLICIES.update({"none": NoStop, "confidence": ConfidenceStop, "decision": DecisionStop, "prune": PruneStop,
                  "specdec++": SpecDecPPStop, "goodput": GoodputStop})
BUILTIN_POLICIES = tuple(_POLICIES)


def register_stop_policy(policy: type, label: str | None = None, threshold: float = 0.5,
                         origin: dict | None = None) -> type:
    """Offer the ``StopPolicy`` subclass ``policy`` by its ``name``: from then on ``MethodConfig(stop=name)``
    validates, the menus list it under ``label``, and a run builds it as ``policy(threshold)`` (the setting, in
    [0, 1]; ``threshold`` is its default). It reads no decision model: ``node_scores(view)`` scores each new node
    from ``LevelView`` (the tree, the level, q), and drafting goes on while some branch's best score reaches the
    threshold. ``origin``: where it came from (``explorer.plugins``), recorded in its runs' traces.

    Returns ``policy``. Raises ValueError: the name is taken or empty, or ``threshold`` is outside [0, 1];
    TypeError: ``policy`` is not a StopPolicy subclass."""
    if not (isinstance(policy, type) and issubclass(policy, StopPolicy)):
        raise TypeError(f"a stop policy is a StopPolicy subclass, got {policy!r}")
    name = getattr(policy, "name", "")
    if not isinstance(name, str) or not name or name == StopPolicy.name:
        raise ValueError(f"stop policy {policy.__name__} needs a class attribute name (a new, non-empty string)")
    if name in _POLICIES:
        raise ValueError(f"a stop policy named {name!r} exists already")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"stop policy {name!r}: its default threshold must be in [0, 1], got {threshold!r}")
    _POLICIES[name] = policy
    STOP_POLICY_LABELS[name] = label or name
    DEFAULT_THRESHOLDS[name] = float(threshold)
    if origin is not None:
        STOP_POLICY_ORIGINS[name] = origin
    return policy


def unregister_stop_policy(name: str) -> None:
    """Remove a policy ``register_stop_policy`` added. Raises ValueError for a built-in or unknown name."""
    if name in BUILTIN_POLICIES or name not in _POLICIES:
        raise ValueError(f"no registered stop policy named {name!r} (the built-in ones stay)")
    for table in (_POLICIES, STOP_POLICY_LABELS, DEFAULT_THRESHOLDS, STOP_POLICY_ORIGINS):
        table.pop(name, None)


def make_stop_policy(name: str, threshold: float, model=None) -> StopPolicy:
    """Build a policy by name; the learned ones (``decision``, ``prune``, ``specdec++``) need ``model``.

    Raises ValueError for an unknown name, a threshold outside [0, 1], or a learned policy without a model.
    """
    if name not in _POLICIES:
        raise ValueError(f"unknown stop policy {name!r}; use one of {', '.join(STOP_POLICY_NAMES)}")
    if name in LEARNED_POLICIES:
        return _POLICIES[name](threshold, model)
    return _POLICIES[name](threshold)


def adapt_problem(mode: str, policy: str) -> str | None:
    """Why ``mode`` cannot adapt the stop policy named ``policy`` (a message), or None when it can."""
    if mode not in ADAPT_MODES:
        return f"unknown adaptation {mode!r}; use one of {', '.join(ADAPT_MODES)}"
    if policy in ADAPTABLE[mode]:
        return None
    if mode == "threshold":
        return (f"the threshold adapts for the {', '.join(ADAPTABLE[mode])} stop policies, not {policy} "
                "(its score is a path product): use last-layer")
    return (f"the {policy} stop policy reads no decision model: adapt its threshold instead, or pick "
            f"{', '.join(ADAPTABLE[mode])}")


def recorded_setting(signal: StopSignal) -> float:
    """The policy setting (tau, h or r) a recorded level was decided under, back from its score-scale threshold
    (``goodput``: r from ``t = r (1 + E) / (1 + D r)``, so ``r = t / (1 + E - t D)``)."""
    t = signal.threshold
    if signal.policy == "goodput":
        return t / max(1.0 + (signal.expected or 0.0) - t * (signal.forwards or 0), 1e-9)
    return score_threshold(signal.policy, t)


def score_threshold(policy: str, threshold: float) -> float:
    """A policy's threshold setting on its score scale (``specdec++`` takes h and keeps paths with prod >= 1 - h;
    ``goodput``'s r is turned into each level's threshold by ``level_threshold``)."""
    return 1.0 - threshold if policy == "specdec++" else threshold


def what_if(step, threshold: float) -> dict:
    """What a recorded step would have drafted and committed had its stop policy used ``threshold`` (the policy's
    own setting: tau, or h for ``specdec++``). Pure function of the StepTrace: no model runs.

    Returns ``{"rows"`` (``replay`` output), ``"kept"`` (node ids still in the tree), ``"drafted"``,
    ``"draft_levels"``, ``"tokens"`` (committed tokens: kept accepted path + one target token),
    ``"deeper"`` (True when the new rule would draft beyond what the step recorded: the figures are then a lower
    bound) and ``"exact"`` (True for greedy verification, where removing nodes cannot change the walk)``}``.
    """
    signals = step.stop_signals
    policy = signals[0].policy if signals else "none"
    rows = replay(signals, score_threshold(policy, threshold))
    limit: dict[str, int] = {}  # branch -> deepest drafted level
    for row in rows:
        for b in row["pruned"]:
            limit.setdefault(b, row["level"])
    deeper = any(row["unknown"] for row in rows) or (
        bool(rows) and rows[-1]["keep_drafting"] and len(rows) == len(signals) and not signals[-1].keep_drafting)
    kept = {n.id for n in step.nodes
            if n.parent is None or n.source == "target" or n.depth <= limit.get(str(n.branch), 10**9)}
    path = sorted((n for n in step.nodes if n.committed and n.parent is not None), key=lambda n: n.depth)
    accepted = 0
    for n in path:
        if n.id not in kept:
            break
        accepted += 1
    drafted = sum(1 for n in step.nodes if n.id in kept and n.source == "draft")
    levels = max((n.depth for n in step.nodes if n.id in kept and n.source == "draft"), default=0)
    cut = accepted < len(path)
    tokens = accepted + 1 if cut else len(step.committed_ids)
    return {"rows": rows, "kept": kept, "drafted": drafted, "draft_levels": levels, "tokens": tokens,
            "deeper": deeper, "exact": step.verifier == "greedy" or not cut}
