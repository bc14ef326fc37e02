"""Step and run traces: plain data that the engine emits and the figures and the UI read.

Nothing here imports torch: a saved trace replays without a model. ``to_dict``/``from_dict`` round-trip through
JSON; ``load_run`` validates a file (schema version, required fields, size) and raises ``TraceError`` with a
message a user can act on.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .jsonfile import parse_json, read_file

SCHEMA_VERSION = 1
MAX_TRACE_BYTES = 50 * 1024 * 1024
TOP_K_SHOWN = 8  # tokens of p and q recorded per node for the node inspector

# Node status values.
CONTEXT = "context"  # the anchor: the last committed token, root of the drawn tree
ACCEPTED = "accepted"  # verified and accepted (for the lossy rule: accepted within its own branch)
REJECTED = "rejected"  # verified and rejected
UNVERIFIED = "unverified"  # never reached by verification (below a rejection, or in another branch)
DRAFTED = "drafted"  # shown only, never recorded: proposed and not judged yet (the classroom's phases)

# Draft sources (``DraftTree.source`` and ``NodeTrace.source``): ``draft`` sampled from the draft model's q (costs
# draft forwards); ``target`` a target-initialized root (the seed's lossy mode); ``lookup`` copied from an earlier
# occurrence of the last n-gram in prompt + output (prompt lookup decoding); ``recycled`` read from the Token
# Recycling adjacency matrix (the target's own earlier top-k candidates). ``lookup`` and ``recycled`` nodes are
# deterministic proposals (q is a point mass): they cost no forward, and the verifiers test them with the point-mass
# stage of multi-draft speculative sampling (``engine/verify/rules.py``).
FREE_SOURCES = ("lookup", "recycled")
"""Sources of deterministic draft tokens (no draft-model forward, q is a point mass)."""
DRAFT_SOURCES = ("draft",) + FREE_SOURCES
"""Sources of proposed tokens that verification may reject (counted as drafted in the metrics)."""
SOURCE_LABELS = {"draft": "draft model", "target": "target root", "lookup": "prompt lookup",
                 "recycled": "token recycling", "context": "anchor"}


class TraceError(ValueError):
    """A trace file or object that cannot be read: the message says what is wrong."""


@dataclass
class NodeTrace:
    """One node of a step's draft tree.

    ``id`` 0 is the anchor (last committed token); drafted nodes follow in breadth-first order (tree index + 1).
    ``p`` and ``q`` are target and draft probabilities of this token at its parent (processed by temperature /
    top-k / top-p; in greedy mode the plain softmax, for display). ``u`` and ``ratio`` are the uniform draw and
    p/q of its acceptance test when it had one. ``residual_top`` lists ``[token_id, text, prob]`` of the residual
    distribution after this node was rejected. ``p_top`` / ``q_top`` list ``[token_id, text, prob]`` of the
    ``TOP_K_SHOWN`` most likely tokens of p and q at the parent (the distributions this node was drafted from and
    checked against; ``q_top`` is empty for target-sampled roots). ``provenance`` says where a free node
    (``lookup``, ``recycled``) came from: for lookup ``copied_from`` (position in prompt + output), the matched
    n-gram's length ``ngram``, position ``match_at`` and text ``match_text``, and ``in_prompt``; for recycling the
    matrix row's token (``row_token``, ``row_text``), the candidate's ``rank`` there, and the ``step`` and ``node``
    whose target logits wrote that row (step -1: carried over from an earlier run; -2: seeded from the prompt, node =
    the prompt position of the successor). ``accept_prob`` / ``slot_prob`` / ``test_order``: what the verification
    rule implies about this node's test (``engine/verify/expectation.py``): the probability it accepts this token once
    its parent is reached and the siblings tested before it (``test_order`` of them) were rejected, and the same
    averaged over the tokens the draft could have proposed here; None for untested target roots and in older traces.
    """

    id: int
    parent: int | None
    token_id: int
    text: str
    depth: int
    position_id: int
    source: str  # context | draft | target | lookup | recycled (engine/methods.py)
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
    """The stop policy's view after drafting level ``level``: one score per branch still drafting, the threshold
    on the score scale (keep drafting while a score reaches it), the decision, and the branches that stop here."""

    level: int
    scores: dict  # branch index (as str in JSON) -> score
    score: float
    threshold: float
    keep_drafting: bool
    policy: str
    pruned: list = field(default_factory=list)  # branches (str) that stop drafting at this level
    expected: float | None = None  # goodput policy: tokens the step expected to accept so far (policies/stopping.py)
    forwards: int | None = None  # goodput policy: draft forwards so far


@dataclass
class StepTrace:
    """Everything one speculative step did, as plain data.

    Attributes:
        mask: the topology-aware mask rows sent to the target, restricted to the step's own columns
            (``mask_node_ids`` x ``mask_node_ids``, 1 = attend); every row also sees ``mask_context_len`` cached
            context columns, omitted here.
        position_ids: position id of each row of ``mask``.
        committed_ids / committed_text: tokens this step added, the bonus token included (last).
        accepted_draft_len: accepted proposed tokens on the committed path; max_draft_len: the configured
            maximum draft depth.
        draft_ms / verify_ms / step_ms: wall-clock milliseconds.
        forward_ms: of ``step_ms``, the milliseconds spent inside model forwards (draft and target); the rest is
            the engine's own work (tree, masks, sampling, verification, cache trimming, the trace itself).
        drafter: what the drafter read to propose the tree, as plain data (Token Recycling: ``recycling_row``,
            the anchor's matrix row with its ``candidates`` and the ``step`` / ``node`` that wrote it), and
            ``tokens_left`` before ``max_new_tokens`` (no node is drafted deeper than one less: ``Engine.reach``).
        drafted: proposed tokens in the tree (draft model, lookup and recycled; ``methods.DRAFT_SOURCES``).
        expected_tokens: the tokens this step commits in expectation over the verifier's own draws, given the
            drafted tree (``expectation.expected_tokens``; bonus token included, before EOS / length cuts).
        timeline: where the step's time went (``engine/runtime/timeline.py``): ``[{"phase", "start_ms", "ms", "rows"?,
            "gpu_ms"?}]``, contiguous segments from the step's start to the end of its trace recording.
        adaptation: what online adaptation of the stop policy learned from this step (``engine/stop_models/online.py``,
            ``OnlineAdapter.update``: ``mode``, ``threshold`` in force for the next step, ``records``, ``label_mean``
            (mean acceptance probability of the step's model-drafted tokens under the run's verification),
            and for ``last-layer`` the mean predictions ``pred_frozen`` / ``pred_before`` / ``pred_after``); empty
            when adaptation is off.
        fallback: the goodput rule's decision before this step (``engine/policies/fallback.py``): ``speculate`` (False:
            a plain decoding step, no tree), ``reason``, and the measured rates it compared, ``spec_tok_s`` /
            ``ar_tok_s`` (tokens/s; None before the first step of that kind); empty when the rule is off.
        cost: the goodput policy's measured cost ratio (``engine/policies/cost_ratio.py``, ``CostRatioMeter.observe``):
            ``r`` in force during the step, this step's ``level_ms`` (a draft level, its verification rows included) and
            ``rest_ms`` (the rest of the step), ``row_ms`` (what a verification row was charged; absent in older
            traces) and ``next``, r for the next step; empty unless ``cost_ratio`` is ``measured``.
        host_syncs: host synchronisations with the device during the step, counted when the engine was asked to
            (``build_engine(count_syncs=True)``; None otherwise): on CUDA the real ones, on the CPU the reads of tensor
            values into Python that would be ones on a GPU (``engine/runtime/host_reads.py``).
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

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "StepTrace":
        d = dict(d)
        d["nodes"] = [NodeTrace(**_known(NodeTrace, n)) for n in d["nodes"]]
        d["stop_signals"] = [StopSignal(**_known(StopSignal, s)) for s in d.get("stop_signals", [])]
        return StepTrace(**_known(StepTrace, d))


@dataclass
class RunTrace:
    """A whole session: settings, prompt, every step, and the text so far."""

    settings: dict
    model: dict  # name, draft_id, target_id, dtype, device
    prompt: str
    prompt_ids: list[int]
    steps: list[StepTrace] = field(default_factory=list)
    prefill_ms: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def generated_ids(self) -> list[int]:
        return [t for s in self.steps for t in s.committed_ids]

    @property
    def generated_text(self) -> str:
        return "".join(t for s in self.steps for t in s.committed_text)

    def to_dict(self) -> dict:
        return {"schema_version": self.schema_version, "settings": self.settings, "model": self.model,
                "prompt": self.prompt, "prompt_ids": self.prompt_ids, "prefill_ms": self.prefill_ms,
                "steps": [s.to_dict() for s in self.steps]}

    @staticmethod
    def from_dict(d: dict) -> "RunTrace":
        if not isinstance(d, dict):
            raise TraceError("a trace must be a JSON object")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"trace schema version {version!r} is not supported (this build reads {SCHEMA_VERSION})")
        for key in ("settings", "model", "prompt", "prompt_ids", "steps"):
            if key not in d:
                raise TraceError(f"trace is missing the field {key!r}")
        if not isinstance(d["steps"], list):
            raise TraceError("trace field 'steps' must be a list")
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
        for i, step in enumerate(steps):
            problem = _step_problem(step)
            if problem:
                raise TraceError(f"step {i + 1} of the trace is malformed: {problem}")
        return RunTrace(settings=d["settings"], model=d["model"], prompt=d["prompt"], prompt_ids=d["prompt_ids"],
                        steps=steps, prefill_ms=float(d.get("prefill_ms", 0.0)))

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


def _step_problem(step: "StepTrace") -> str | None:
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
