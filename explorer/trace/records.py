"""Step and run traces: plain data that the engine emits and the figures and the UI read.

Nothing here imports torch: a saved trace replays without a model. ``to_dict``/``from_dict`` round-trip through
JSON; ``load_run`` validates a file (schema version, required fields, size) and raises ``TraceError`` with a
message a user can act on. Version 1 traces are upgraded on reading (``schema.upgrade``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .. import __version__
from .jsonfile import parse_json, read_file
from .schema import SCHEMA_VERSION, SchemaError, missing_fields, upgrade

PRODUCER = {"name": "spec-explorer", "version": __version__}
"""What a trace written by this build says wrote it (``RunTrace.producer``)."""
MAX_TRACE_BYTES = 50 * 1024 * 1024
TOP_K_SHOWN = 8  # tokens of p and q recorded per node for the node inspector

# Node status values.
CONTEXT = "context"  # the anchor: the last committed token, root of the drawn tree
ACCEPTED = "accepted"  # verified and accepted (for the lossy rule: accepted within its own branch)
REJECTED = "rejected"  # verified and rejected
UNVERIFIED = "unverified"  # never reached by verification (below a rejection, or in another branch)
DRAFTED = "drafted"  # shown only, never recorded: proposed and not judged yet (the classroom's phases)

# Draft sources (``DraftTree.source`` and ``NodeTrace.source``): ``draft`` sampled from the draft model's q (costs
# draft forwards); ``target`` a target-initialized root (Lu et al.'s lossy mode); ``lookup`` copied from an earlier
# occurrence of the last n-gram in prompt + output (prompt lookup decoding); ``recycled`` read from the Token
# Recycling adjacency matrix (the target's own earlier top-k candidates); ``plugin`` proposed by a free drafter a
# plugin registered (``explorer.plugins``; its name in the node's provenance). ``lookup``, ``recycled`` and
# ``plugin`` nodes are deterministic proposals (q is a point mass): they cost no forward, and the verifiers test
# them with the point-mass stage of multi-draft speculative sampling (``engine/verify/rules.py``).
FREE_SOURCES = ("lookup", "recycled", "plugin")
"""Sources of deterministic draft tokens (no draft-model forward, q is a point mass)."""
DRAFT_SOURCES = ("draft",) + FREE_SOURCES
"""Sources of proposed tokens that verification may reject (counted as drafted in the metrics)."""
SOURCE_LABELS = {"draft": "draft model", "target": "target root", "lookup": "prompt lookup",
                 "recycled": "token recycling", "plugin": "plugin drafter", "context": "anchor"}


class TraceError(ValueError):
    """A trace file or object that cannot be read: the message says what is wrong."""


@dataclass
class NodeTrace:
    """One node of a step's draft tree (``StepTrace.nodes``).

    Probabilities are in [0, 1] and, like ``p_top`` / ``q_top``, *as shown*: the processed distribution
    (temperature / top-k / top-p) when sampling, the plain softmax when greedy.

    Attributes:
        id: 0 for the anchor (the last committed token); drafted node i (breadth-first tree index) is ``i + 1``.
        parent: the parent's ``id`` (0 = the anchor); None for the anchor.
        token_id / text: the token's vocabulary id, and its text decoded alone (``Recorder.token_text``).
        depth: 0 for the anchor, 1 for its children, and so on.
        position_id: ``L - 1 + depth``, L the committed tokens before the step (the anchor sits at ``L - 1``).
        source: ``context`` (the anchor), ``draft``, ``target``, ``lookup`` or ``recycled`` (the proposed ones:
            ``DRAFT_SOURCES``).
        status: ``context``, ``accepted``, ``rejected`` or ``unverified`` (never ``drafted``); target roots are
            ``accepted``.
        committed: on the committed path (the anchor: True).
        branch: index of the anchor's child whose subtree holds the node; None for the anchor.
        q: the draft's probability of this token at its parent; None for free nodes, target roots and the anchor.
        p: the target's probability of this token at its parent; None for the anchor.
        u: the uniform draw in [0, 1) of its acceptance test; None where the test drew none (greedy, ``mcns``) or
            the node was not tested.
        ratio: the test's argument (``NodeDecision.ratio``): ``p'(x) / q'(x)`` for ``rrs`` (may exceed 1),
            ``p'(x)`` for a free node and for ``mcns``, SpecHub's alpha or beta, 1 or 0 when greedy; None when
            untested or not finite.
        residual_top: after a rejection when sampling, ``[token_id, text, prob]`` of the residual distribution
            the next sibling (or the replacement token) faces, at most ``node_rules.RESIDUAL_TOP`` (5) long, best
            first; else empty.
        p_top / q_top: ``[token_id, text, prob]`` of the ``TOP_K_SHOWN`` (8) most likely tokens of p and q at the
            parent (the distributions this node was checked against and drafted from), best first; ``q_top`` is
            empty where the draft model did not draft at the parent (target roots, free nodes below free nodes,
            methods without a draft model).
        provenance: where a free node came from (None for the others). Lookup: ``copied_from`` (position in prompt
            + output), the matched n-gram's length ``ngram``, position ``match_at`` and text ``match_text``, and
            ``in_prompt``. Recycling: the matrix row's token (``row_token``, ``row_text``), the candidate's
            ``rank`` there, and the ``step`` and ``node`` whose target logits wrote that row (step -1: carried
            over from an earlier run; -2: filled from the prompt, node = the prompt position of the successor).
            Both hold ``source``.
        accept_prob / slot_prob / test_order: what the verification rule implies about this node's test
            (``engine/verify/expectation.py``): the probability it accepts this token once its parent is reached
            and the siblings tested before it were rejected; the same averaged over the tokens the draft could
            have proposed here; its place among its siblings in test order (0 = tested first). None for untested
            target roots and in older traces.
        predicted_accept: the learned stop policy's predicted acceptance of this node, in [0, 1]; None for nodes
            of levels it did not score and without a learned policy.
    """

    id: int
    parent: int | None
    token_id: int
    text: str
    depth: int
    position_id: int
    source: str  # context | draft | target | lookup | recycled (the draft sources above)
    status: str
    committed: bool = False
    branch: int | None = None
    q: float | None = None
    p: float | None = None
    u: float | None = None
    ratio: float | None = None
    residual_top: list = field(default_factory=list)
    p_top: list = field(default_factory=list)
    q_top: list = field(default_factory=list)
    provenance: dict | None = None
    accept_prob: float | None = None
    slot_prob: float | None = None
    test_order: int | None = None
    predicted_accept: float | None = None  # the learned stop policy's prediction for this node (levels it scored)


@dataclass
class StopSignal:
    """The stop policy's view after drafting level ``level`` (``engine/policies/stopping.py``); every rule reads
    "keep drafting while the score reaches the threshold".

    Attributes:
        level: the tree level just drafted, 1-based (the target roots' level counts in the lossy mode).
        scores: branch index (str) -> that branch's score, for the branches still drafting: a probability in
            [0, 1] (the best new node's draft probability, predicted acceptance, or for ``specdec++`` predicted
            path acceptance); for ``goodput`` the expected tokens the branch's next level adds.
        score: the level's score: the best branch's (``goodput``: the branches' sum, in tokens).
        threshold: what a score must reach to keep drafting, on the score scale (``specdec++``: ``1 - h``;
            ``goodput``: ``r (1 + E) / (1 + D r)`` tokens, from ``expected`` and ``forwards``).
        keep_drafting: whether any branch drafts on after this level.
        policy: the stop policy's name (``stopping.STOP_POLICY_NAMES``).
        pruned: branch indices (str) that stop drafting at this level (all of them when drafting stops).
        expected / forwards: ``goodput`` only (None for the others): the tokens the step expected to accept so far
            (E) and the draft forwards so far (D).
        cost_pruned / row_floor / chances: with the tree chosen online, the side branches (also in ``pruned``)
            stopped here because their chance of holding the accepted path (``chances``: branch -> probability,
            for the branches weighed) fell below ``row_floor``, what a node's target and draft rows cost over a
            one-row target forward (``TreeChooser.row_floor``, ``ModelDrafter._prune_side_branches``); the branch
            with the best chance is never among them. Empty / None where the floor did not apply.
    """

    level: int
    scores: dict  # branch index (str) -> score
    score: float
    threshold: float
    keep_drafting: bool
    policy: str
    pruned: list = field(default_factory=list)  # branches (str) that stop drafting at this level
    expected: float | None = None  # goodput policy: tokens the step expected to accept so far (policies/stopping.py)
    forwards: int | None = None  # goodput policy: draft forwards so far
    cost_pruned: list = field(default_factory=list)  # side branches stopped by the row floor (tree chosen online)
    row_floor: float | None = None
    chances: dict = field(default_factory=dict)  # branch (str) -> chance of holding the accepted path


@dataclass
class StepTrace:
    """Everything one speculative step did, as plain data. Times are wall-clock milliseconds, token counts are
    tokens; R below is ``len(mask_node_ids)``, the rows the step sent to the target.

    Attributes:
        index: the step's place in the run, 0-based.
        method / lossy / verifier: the method's name (``methods.METHODS``), whether its verification is lossy
            (the target-initialized roots of Lu et al. 2024), and the verification rule's name (``""`` in older traces).
        nodes: the anchor (id 0) then every drafted node in breadth-first order (``NodeTrace``): 1 + N long.
        mask: the topology-aware mask rows sent to the target, restricted to the step's own columns: R rows of R
            ints (1 = attend), row and column j being node ``mask_node_ids[j]``; every row also sees
            ``mask_context_len`` cached context columns, omitted here.
        mask_node_ids: the node id of each mask row: 0 (the anchor, only when it was fed to the target this step,
            i.e. not cached yet), then 1 .. N.
        mask_context_len: cached context columns every row attends to.
        position_ids: R ints, the position id of each row of ``mask``.
        branches: one dict per branch (the anchor's children, tree order): ``branch`` (index), ``root_id``,
            ``root_text``, ``accepted`` and ``drafted`` (accepted and proposed tokens in the branch) and ``chosen``
            (the committed path runs through it).
        stop_signals: one ``StopSignal`` per drafted level the stop policy checked (empty when it checked none).
        committed_ids / committed_text: the tokens this step added, the bonus token included (last), cut after an
            EOS (kept) and at ``max_new_tokens``; the text each adds (``""`` for a token that ends inside a multi-byte
            character: the token completing it carries the whole character), as long as ``committed_ids``.
        bonus_token: the token drawn after the accepted path when it was committed (``committed_ids[-1]``); None
            for the lossy rule (the next step's roots take its place) or when EOS or ``max_new_tokens`` cut it.
        accepted_draft_len: proposed tokens (``DRAFT_SOURCES``) on the committed path; max_draft_len: the deepest
            level a step of this configuration can draft (``MethodConfig.max_draft_depth``).
        drafted: proposed tokens in the tree (draft model, lookup and recycled; ``DRAFT_SOURCES``).
        draft_calls / target_calls: draft-model forwards (a chain replay counts each level it computed) and target
            forwards (1, or 0 on a first ``ar`` step, whose anchor distribution came from the prefill).
        draft_ms / verify_ms / step_ms: from ``timeline`` (``timeline.step_times``): drafting and draft forwards;
            mask, target forward, verification and odds; every segment but the trace recording.
        finished: the run finished with this step (EOS or ``max_new_tokens``).
        forward_ms: of ``step_ms``, the milliseconds spent inside model forwards (draft and target); the rest is
            the engine's own work (tree, masks, sampling, verification, cache trimming). None in older traces.
        drafter: what the drafter read to propose the tree, as plain data (``Drafted.info`` with token texts added):
            ``tokens_left`` before ``max_new_tokens`` on speculating steps (no node is drafted deeper than one
            less: ``drafters.base.Reach``); Token Recycling's ``recycling_row`` (the anchor's matrix row: ``token``,
            ``candidates``, ``step`` / ``node`` that wrote it, ``token_text``, ``candidate_texts``); prompt lookup's
            ``lookup_length``, ``lookup_branches``, ``long_copy``; the hybrid's ``lookup_trusted`` and
            ``lookup_dropped_ngram`` (a match shorter than ``lookup_alone``, dropped for the model's tree);
            ``row_pricing``
            (``{"offered", "kept", "expected_tokens", "row_ms", "jump_ms", "one_row_ms"}``); ``layer_skip``
            (``{"exit_layer", "layers", "candidates"}``); ``chain_replays`` (``[{"levels", "read"}]``).
        expected_tokens: the tokens this step commits in expectation over the verifier's own draws, given the
            drafted tree (``expectation.expected_tokens``; bonus token included, before EOS / length cuts). None
            in older traces.
        timeline: where the step's time went (``engine/runtime/timeline.py``): ``[{"phase", "start_ms", "ms", "rows"?,
            "gpu_ms"?}]`` (``rows``: a forward's query rows; ``gpu_ms``: a forward's device time on CUDA),
            contiguous segments from the step's start to the end of what its observers learned; empty in older traces.
        adaptation: what online adaptation of the stop policy learned from this step (``engine/stop_models/online.py``,
            ``OnlineAdapter.update``: ``mode``, ``tokens`` labelled, ``threshold`` in force for the next step,
            ``records``, ``label_mean`` (mean acceptance probability of the step's model-drafted tokens under the
            run's verification), ``score_mean`` in threshold mode, and for ``last-layer`` the mean predictions
            ``pred_frozen`` / ``pred_before`` / ``pred_after``, ``bias`` and ``weight_shift``); empty when
            adaptation is off.
        fallback: the goodput rule's decision before this step (``engine/policies/fallback.py``): ``speculate`` (False:
            a plain decoding step, no tree), ``reason``, and the measured rates it compared, ``spec_tok_s`` /
            ``ar_tok_s`` (tokens/s; None before the first step of that kind), ``carried`` (the first step read an
            earlier run's rates) and ``unmeasured`` (the step's time was not measured: a graph capture, or the prompt's
            prefill joined to the step); empty when the rule is off.
        host_syncs: host synchronisations with the device during the step, counted when the engine was asked to
            (``build_engine(count_syncs=True)``; None otherwise): on CUDA the real ones, on the CPU the reads of tensor
            values into Python that would be ones on a GPU (``engine/runtime/host_reads.py``).
        cost: the goodput policy's measured cost ratio (``engine/policies/cost_ratio.py``, ``CostRatioMeter.observe``):
            ``r`` in force during the step, this step's ``level_ms`` (a draft level, its verification rows included) and
            ``rest_ms`` (the rest of the step), ``row_ms`` (what a verification row was charged; absent in older
            traces) and ``next``, r for the next step; ``level_ms`` / ``rest_ms`` None where the step did not
            measure them; empty unless ``cost_ratio`` is ``measured``.
        prefill_rows: the prompt's tokens this step's target forward also read (the prefill joined to the first
            verification, ``Engine`` ``joint_prefill``; its time is in ``verify_ms``); 0 otherwise.
    """

    index: int
    method: str
    lossy: bool
    nodes: list[NodeTrace]
    mask: list[list[int]]
    mask_node_ids: list[int]
    mask_context_len: int
    position_ids: list[int]
    branches: list[dict]
    stop_signals: list[StopSignal]
    committed_ids: list[int]
    committed_text: list[str]
    bonus_token: int | None
    accepted_draft_len: int
    max_draft_len: int
    drafted: int
    draft_calls: int
    target_calls: int
    draft_ms: float
    verify_ms: float
    step_ms: float
    verifier: str = ""
    finished: bool = False
    forward_ms: float | None = None  # None in traces saved before it was recorded
    drafter: dict = field(default_factory=dict)
    expected_tokens: float | None = None  # None in traces saved before it was recorded
    timeline: list = field(default_factory=list)  # timeline.StepTimeline segments (empty in older traces)
    adaptation: dict = field(default_factory=dict)
    fallback: dict = field(default_factory=dict)
    host_syncs: int | None = None  # with count_syncs only
    cost: dict = field(default_factory=dict)
    prefill_rows: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> StepTrace:
        d = dict(d)
        d["nodes"] = [NodeTrace(**_known(NodeTrace, n)) for n in d["nodes"]]
        d["stop_signals"] = [StopSignal(**_known(StopSignal, s)) for s in d.get("stop_signals", [])]
        return StepTrace(**_known(StepTrace, d))


@dataclass
class RunTrace:
    """A whole run: settings, prompt, every step, and the text so far.

    Attributes:
        settings: how the run was configured: ``method`` (``MethodConfig.to_dict``), ``sampling``
            (``SamplingConfig.to_dict``), ``max_new_tokens``, ``verifier``; where they apply, the drafter's
            ``recycling_initial`` (the Token Recycling matrix the run started from), ``fallback_carried`` and
            ``adaptation_carried`` (state carried over from an earlier run) and ``decision_model`` (``kind`` and
            where it came from).
        model: the pair and how it ran: ``name``, ``draft_id``, ``target_id``, ``dtype``, ``device``,
            ``draft_quant``, ``packed_weights``, ``kv_cache``, ``graphs``; where they apply, ``chain_levels``,
            ``fused_kernels``, ``verification_cost`` and ``row_pricing`` (the prices of free rows, ms).
        prompt / prompt_ids: the prompt's text (``""`` when the caller gave none) and its token ids.
        steps: every step so far, in order.
        prefill_ms: wall-clock milliseconds of the prefill (both models, and the drafter's start).
        prompt_info: where the prompt came from when it came from a prompt set: ``id``, ``source`` (``humaneval``,
            ``mt-bench``, a file name) and ``category``; ``{}`` otherwise (forensics groups saved runs by it).
        schema_version: ``SCHEMA_VERSION`` of the writer (``from_dict`` reads it and upgrades version 1,
            ``schema.upgrade``).
        producer: what wrote the trace, ``{"name", "version"}`` (``PRODUCER``; an upgraded version 1 trace says
            ``schema.V1_PRODUCER``).
    """

    settings: dict
    model: dict  # name, draft_id, target_id, dtype, device
    prompt: str
    prompt_ids: list[int]
    steps: list[StepTrace] = field(default_factory=list)
    prefill_ms: float = 0.0
    prompt_info: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    producer: dict = field(default_factory=lambda: dict(PRODUCER))

    @property
    def generated_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.committed_ids]

    @property
    def generated_text(self) -> str:
        return "".join(t for s in self.steps for t in s.committed_text)

    @property
    def temperature(self) -> float:
        """The run's sampling temperature (0 = greedy) as its settings recorded it."""
        return float(self.settings.get("sampling", {}).get("temperature", 0.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"schema_version": self.schema_version, "producer": self.producer, "settings": self.settings,
                "model": self.model,
                "prompt": self.prompt, "prompt_ids": self.prompt_ids, "prefill_ms": self.prefill_ms,
                **({"prompt_info": self.prompt_info} if self.prompt_info else {}),
                "steps": [s.to_dict() for s in self.steps]}

    @staticmethod
    def from_dict(d: dict) -> RunTrace:
        if not isinstance(d, dict):
            raise TraceError("a trace must be a JSON object")
        try:
            d = upgrade(d)
        except SchemaError as exc:
            raise TraceError(str(exc)) from None
        for key in ("settings", "model", "prompt", "prompt_ids", "steps"):
            if key not in d:
                raise TraceError(f"trace is missing the field {key!r}")
        if not isinstance(d["steps"], list):
            raise TraceError("trace field 'steps' must be a list")
        for i, step in enumerate(d["steps"]):
            problem = _missing_in_step(step)
            if problem:
                raise TraceError(f"step {i + 1} of the trace is malformed: {problem}")
        producer = d.get("producer")
        if not (isinstance(producer, dict) and all(isinstance(producer.get(k), str) for k in ("name", "version"))):
            raise TraceError("trace field 'producer' must be an object with the strings name and version")
        try:
            steps = [StepTrace.from_dict(s) for s in d["steps"]]
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise TraceError(f"a step of the trace is malformed: {exc}") from None
        method = d["settings"].get("method") if isinstance(d["settings"], dict) else None
        if not isinstance(method, dict) or not isinstance(method.get("method"), str):
            raise TraceError("trace field 'settings' must hold the method settings ({'method': {'method': ...}})")
        if not isinstance(d["model"], dict) or not isinstance(d["prompt"], str):
            raise TraceError("trace fields 'model' (an object) and 'prompt' (a string) are malformed")
        if not _is_list_of(d["prompt_ids"], int) or not isinstance(d.get("prefill_ms", 0.0), (int, float)):
            raise TraceError("trace fields 'prompt_ids' (token ids) or 'prefill_ms' (a number) are malformed")
        info = d.get("prompt_info", {})
        if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
            raise TraceError("trace field 'prompt_info' must be an object of strings")
        for i, step in enumerate(steps):
            problem = _step_problem(step)
            if problem:
                raise TraceError(f"step {i + 1} of the trace is malformed: {problem}")
        return RunTrace(settings=d["settings"], model=d["model"], prompt=d["prompt"], prompt_ids=d["prompt_ids"],
                        steps=steps, prefill_ms=float(d.get("prefill_ms", 0.0)), prompt_info=info,
                        producer=producer)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_list_of(value, kind) -> bool:
    return isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


_NODE_TYPES = {"id": int, "parent": (int, type(None)), "token_id": int, "text": str, "depth": int,
               "position_id": int, "source": str, "status": str, "committed": bool, "branch": (int, type(None)),
               "q": (int, float, type(None)), "p": (int, float, type(None)), "u": (int, float, type(None)),
               "ratio": (int, float, type(None)), "residual_top": list, "p_top": list, "q_top": list,
               "provenance": (dict, type(None)), "accept_prob": (int, float, type(None)),
               "slot_prob": (int, float, type(None)), "test_order": (int, type(None)),
               "predicted_accept": (int, float, type(None))}


def _missing_in_step(step) -> str | None:
    """Which field a version 2 step dict, or one of its nodes or stop signals, lacks (every field is written), or
    None."""
    if not isinstance(step, dict):
        return f"expected an object, got {type(step).__name__}"
    parts = [("the step", step, StepTrace)]
    for key, cls in (("nodes", NodeTrace), ("stop_signals", StopSignal)):
        items = step.get(key)
        parts += [(f"{key[:-1].replace('_', ' ')} {j}", item, cls)
                  for j, item in enumerate(items if isinstance(items, list) else []) if isinstance(item, dict)]
    for where, obj, cls in parts:
        lacking = missing_fields(obj, [f.name for f in fields(cls)])
        if lacking:
            return f"{where} lacks the field {lacking[0]!r}"
    return None


def _step_problem(step: StepTrace) -> str | None:
    """What makes a loaded step impossible to draw (types and references the figures rely on), or None."""
    for n in step.nodes:
        for name, kind in _NODE_TYPES.items():
            if not isinstance(getattr(n, name), kind):
                return f"node field {name!r} has the wrong type"
        for row in (n.residual_top, n.p_top, n.q_top):
            if not all(isinstance(r, list) and len(r) == 3 and isinstance(r[1], str)
                       and isinstance(r[2], (int, float)) for r in row):
                return "a node's top-token list is malformed"
    ids = [n.id for n in step.nodes]
    if not ids or ids[0] != 0 or len(set(ids)) != len(ids):
        return "node ids must start at 0 (the anchor) and be unique"
    if any(n.parent is not None and n.parent not in ids for n in step.nodes[1:]) or step.nodes[0].parent is not None:
        return "a node's parent is not in the tree"
    if not _is_list_of(step.committed_ids, int) or not all(isinstance(t, str) for t in step.committed_text):
        return "committed tokens are malformed"
    n = len(step.mask_node_ids)
    if (not _is_list_of(step.mask_node_ids, int) or set(step.mask_node_ids) - set(ids) or len(step.mask) != n
            or any(not _is_list_of(row, int) or len(row) != n for row in step.mask)
            or not _is_list_of(step.position_ids, int) or len(step.position_ids) != n):
        return "the mask does not match its node ids and position ids"
    for name in ("drafter", "adaptation", "fallback", "cost"):
        if not isinstance(getattr(step, name), dict):
            return f"the step's {name} record must be an object"
    times = ("level_ms", "rest_ms", "row_ms")
    if step.cost and not (all(_is_number(step.cost.get(k)) for k in ("r", "next"))
                          and all(step.cost.get(k) is None or _is_number(step.cost[k]) for k in times)):
        return "the measured cost ratio record needs numbers r and next (level_ms, rest_ms, row_ms: numbers or null)"
    priced = step.drafter.get("row_pricing")
    if priced is not None and not (isinstance(priced, dict) and all(
            _is_number(priced.get(k)) for k in ("offered", "kept", "expected_tokens", "row_ms", "one_row_ms"))
            and _is_number(priced.get("jump_ms", 0))):
        return "the drafter's row pricing record needs numbers offered, kept, expected_tokens, row_ms, one_row_ms"
    if not isinstance(step.timeline, list) or not all(
            isinstance(seg, dict) and isinstance(seg.get("phase"), str) and isinstance(seg.get("ms"), (int, float))
            and isinstance(seg.get("start_ms"), (int, float)) for seg in step.timeline):
        return "the timeline must be a list of segments with phase, start_ms and ms"
    for name in ("draft_ms", "verify_ms", "step_ms"):
        if not isinstance(getattr(step, name), (int, float)):
            return f"{name} must be a number"
    return None


def _known(cls, d: dict) -> dict:
    """Keep the fields ``cls`` knows (newer writers may add some); missing required ones raise TypeError later."""
    if not isinstance(d, dict):
        raise TypeError(f"expected an object, got {type(d).__name__}")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def loads_run(text: str | bytes) -> RunTrace:
    """Parse a JSON trace. Raises TraceError on size, JSON or schema problems."""
    return RunTrace.from_dict(parse_json(text, TraceError, "trace", MAX_TRACE_BYTES))


def save_run(run: RunTrace, path: str | Path) -> None:
    Path(path).write_text(run.to_json(), encoding="utf-8")


def load_run(path: str | Path) -> RunTrace:
    """Read a trace file. Raises TraceError when the file is unreadable, too large, or malformed."""
    return loads_run(read_file(path, TraceError, "trace "))
