"""The tree-attention probe: does the tree forward give each node the logits plain decoding would?

Verification scores a whole draft tree in one target forward with a topology-aware mask (``engine/tree.py``). Plain
decoding (``ar``, transformers' ``generate``) prefills the prompt and then feeds one token per forward. Both attend
to the same tokens at the same positions, so in exact arithmetic their logits agree; in floating point the order of
the sums differs (another kernel, another query length), and in bf16 a logit moves by a rounding step now and then.
When the best two tokens of a row sit within that step, greedy verification and ``ar`` can pick different tokens:
the divergences docs/numerics.md ("Numerics") describes.

For one step the probe recomputes every tree node's target logits the plain way (``ReferenceDecoder``: the prompt
prefilled, every committed token and then the node's root-to-node path fed one token per forward, a cropped KV cache
shared along the tree), compares them with the logits the tree forward produced, and re-runs the step's verifier
on the reference logits with the same random state: which argmaxes and which accept / reject decisions would flip,
and how close each row's best two tokens are in units of the dtype's rounding step. A mask lint checks what the
target was sent: every row attends to exactly the context, its ancestors and itself, at position ``L - 1 + depth``.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..engine.runtime.graphs import eager_forward
from ..engine.runtime.kv_cache import DynamicKVCache
from ..engine.sampling import RowDists
from ..engine.verify import rules as verify


class ProbeError(ValueError):
    """The probe cannot run (no step yet, a replay that left the recorded run): the message says what to do."""


def rounding_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s representable numbers at ``|value|`` (one unit in the last place), e.g. 0.0625
    for bf16 at 12.3. Floats only (``torch.finfo``)."""
    eps = torch.finfo(dtype).eps
    mag = abs(float(value))
    if mag < torch.finfo(dtype).tiny:
        return float(torch.finfo(dtype).tiny)
    return float(eps * 2.0 ** np.floor(np.log2(mag)))


class ReferenceDecoder:
    """Plain decoding of one model, as ``generate`` does it: one prefill of the prompt, then one token a forward.

    ``extend`` feeds committed tokens; ``tree_logits`` feeds a draft tree depth-first, one token per forward,
    cropping the cache back after each subtree, so every node's logits come from its own root-to-node path.

    Args:
        model: a transformers causal LM (the target).
        prompt_ids: the prompt's token ids (non-empty).
        vocab_size: logits are cut to the pair's shared vocabulary.
        lock: held around each forward (``ModelPair.lock``: the models are shared between sessions).
    """

    def __init__(self, model, prompt_ids: list[int], vocab_size: int, lock=None):
        if not prompt_ids:
            raise ProbeError("the prompt is empty")
        self.model, self.vocab_size = model, vocab_size
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.kv = DynamicKVCache()
        self.tokens = list(prompt_ids)
        self.forwards = 0
        self.last_logits = self._forward(self.tokens)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode(), self.lock:
            start = self.kv.length
            logits = eager_forward(self.model, self.kv, ids, list(range(start, start + len(ids))), None, keep=1).logits
        self.forwards += 1
        return logits[-1, : self.vocab_size]

    def extend(self, tokens: list[int]) -> None:
        """Feed ``tokens`` one per forward; ``last_logits`` becomes the logits after the last one."""
        for t in tokens:
            self.last_logits = self._forward([int(t)])
            self.tokens.append(int(t))

    def advance_to(self, context: list[int]) -> None:
        """Extend to ``context`` (which must start with the tokens fed so far). Raises ProbeError otherwise."""
        n = len(self.tokens)
        if context[:n] != self.tokens:
            raise ProbeError("the reference decoder can only move forward along one run")
        self.extend(context[n:])

    def tree_logits(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """``(N, vocab)`` logits at every tree node (breadth-first ``parents``, -1 = the anchor, which is the last
        token fed). The cache is left as it was."""
        n = len(tokens)
        out: list[torch.Tensor | None] = [None] * n
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)
        base = self.kv.length
        stack = [(c, base) for c in reversed(children.get(-1, []))]
        while stack:
            node, at = stack.pop()
            self.kv.rewind(at)  # back to the node's parent: its path is all the cache holds past the context
            out[node] = self._forward([tokens[node]])
            stack.extend((c, at + 1) for c in reversed(children.get(node, [])))
        self.kv.rewind(base)
        return torch.stack(out) if n else torch.empty(0, self.vocab_size)


@dataclass
class RowProbe:
    """One row of the tree forward: the anchor (``node`` 0) or a tree node (trace id), against plain decoding.

    ``max_delta_logit``: max over the vocabulary of |tree logit - reference logit|. ``gap_steps``: the reference
    row's top-two logit gap in rounding steps of the model dtype at the top logit (0 = an exact tie)."""

    node: int
    text: str
    max_delta_logit: float
    argmax_tree: int
    argmax_reference: int
    argmax_flip: bool
    top2_gap: float
    gap_steps: float
    top2_reference: list = field(default_factory=list)  # [[token_id, text, logit], [..]]
    top2_tree: list = field(default_factory=list)


@dataclass
class NodeFlip:
    """A drafted node whose verification outcome differs when verified on the reference logits."""

    node: int
    text: str
    status: str  # accepted / rejected / unverified in the step
    reference_status: str  # ... and on the reference logits
    parent: int
    cause: bool = True  # its parent was reached both ways: the flip starts here (else it follows one above)


@dataclass
class StepProbe:
    """The probe of one step (see the module docstring). ``flips`` counts ``node_flips``."""

    step: int
    dtype: str
    rows: list[RowProbe]
    node_flips: list[NodeFlip]
    committed: list[int]
    reference_committed: list[int]
    lint: list[str]
    reference_forwards: int

    @property
    def flips(self) -> int:
        return len(self.node_flips)

    @property
    def max_delta_logit(self) -> float:
        return max((r.max_delta_logit for r in self.rows), default=0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(flips=self.flips, cause_flips=sum(f.cause for f in self.node_flips),
                 max_delta_logit=self.max_delta_logit,
                 argmax_flips=sum(r.argmax_flip for r in self.rows),
                 committed_same=self.committed == self.reference_committed)
        return d


def lint_mask(mask: np.ndarray, past: int, uncached_len: int, parents: list[int], position_ids: list[int]) -> list[str]:
    """Problems with the mask and position ids one verification forward was sent, or [].

    Args:
        mask: bool ``(uncached_len + N, past + uncached_len + N)``: the rows fed (the committed tokens the target
            had not cached, ``uncached_len`` of them, then the N tree nodes) against every column.
        past: cached context columns; uncached_len: uncached committed rows; parents: the tree's breadth-first parents.
        position_ids: ``uncached_len + N`` ints.
    """
    n = len(parents)
    rows, cols = uncached_len + n, past + uncached_len + n
    if mask.shape != (rows, cols):
        return [f"mask shape {mask.shape} is not ({rows}, {cols})"]
    problems = []
    anchor_pos = past + uncached_len - 1  # the last committed token: the last uncached row, or cached
    for c in range(uncached_len):
        want = np.zeros(cols, dtype=bool)
        want[: past + c + 1] = True
        if not np.array_equal(mask[c], want):
            problems.append(f"uncached committed row {c} does not attend exactly to the context up to itself")
        if position_ids[c] != past + c:
            problems.append(f"uncached committed row {c} has position {position_ids[c]}, not {past + c}")
    depth = []
    for i, p in enumerate(parents):
        depth.append(1 if p < 0 else depth[p] + 1)
        want = np.zeros(cols, dtype=bool)
        want[: past + uncached_len] = True
        j = i
        while j >= 0:  # itself and its ancestors
            want[past + uncached_len + j] = True
            j = parents[j]
        row = mask[uncached_len + i]
        if not np.array_equal(row, want):
            extra = [int(k) - past - uncached_len for k in np.flatnonzero(row & ~want)]
            missing = [int(k) for k in np.flatnonzero(want & ~row)]
            what = []
            if extra:
                what.append("also sees " + ", ".join(f"node {k + 1}" if k >= 0 else f"column {k + past + uncached_len}"
                                                     for k in extra))
            if missing:
                what.append(f"misses {len(missing)} of its context / ancestor columns")
            problems.append(f"node {i + 1}: " + "; ".join(what))
        if position_ids[uncached_len + i] != anchor_pos + depth[i]:
            problems.append(f"node {i + 1} has position {position_ids[uncached_len + i]}, not "
                            f"{anchor_pos + depth[i]} (anchor position + depth {depth[i]})")
    return problems


def _status(decisions: dict, i: int, tree) -> str:
    if tree.source[i] == "target":
        return "accepted"
    dec = decisions.get(i)
    return "unverified" if dec is None else ("accepted" if dec.accepted else "rejected")


def _top2(logits: torch.Tensor, text) -> list:
    """``[[id, text, logit], [..]]``: the argmax first (as greedy verification and ``generate`` pick it: the lowest
    id among tied logits; ``topk`` may order ties otherwise), then the best other token."""
    logits = logits.float()
    best = int(logits.argmax())
    rest = logits.clone()
    rest[best] = float("-inf")
    second = int(rest.argmax())
    return [[t, text(t), float(logits[t])] for t in (best, second)]


def probe_last_step(engine, reference: ReferenceDecoder | None = None) -> StepProbe:
    """Probe the step ``engine`` ran last (``engine.last_step``; the engine keeps going afterwards unchanged).

    Args:
        engine: an ``Engine`` after at least one ``step()``.
        reference: a decoder already advanced along this run (probing step after step reuses it); None builds
            one from the prompt.
    Raises:
        ProbeError: before the first step.
    """
    if engine.last_step is None or engine.trace is None or not engine.trace.steps:
        raise ProbeError("run a step first: the probe looks at the latest step")
    d, v = engine.last_step
    step = engine.trace.steps[-1]
    tree = d.tree
    L = step.nodes[0].position_id + 1  # committed tokens when the step began
    context = engine.trace.prompt_ids + engine.trace.generated_ids[: L - len(engine.trace.prompt_ids)]
    if reference is None:
        reference = ReferenceDecoder(engine.pair.target, engine.trace.prompt_ids, engine.pair.vocab_size,
                                     engine.pair.lock)
    before = reference.forwards
    reference.advance_to(context)  # its last logits are now the anchor's row
    anchor_ref = reference.last_logits.float()
    node_ref = reference.tree_logits(tree.token, tree.parent).float()
    dtype = engine.pair.dtype
    text = engine.recorder.token_text
    tree_rows = [v.anchor_logits.float()] + [v.node_logits[i].float() for i in range(len(tree))]
    ref_rows = [anchor_ref] + [node_ref[i] for i in range(len(tree))]
    rows = []
    for r, (a, b) in enumerate(zip(tree_rows, ref_rows)):
        top_ref, top_tree = _top2(b, text), _top2(a, text)
        gap = top_ref[0][2] - top_ref[1][2]
        rows.append(RowProbe(node=r, text=step.nodes[r].text, max_delta_logit=float((a - b).abs().max()),
                             argmax_tree=top_tree[0][0], argmax_reference=top_ref[0][0],
                             argmax_flip=top_tree[0][0] != top_ref[0][0], top2_gap=gap,
                             gap_steps=gap / rounding_step(top_ref[0][2], dtype),
                             top2_reference=top_ref, top2_tree=top_tree))
    # Re-verify on the reference logits with the random state the step's verifier started from.
    gen = torch.Generator(device=engine.state.generator.device)
    gen.set_state(v.rng_state)
    p_ref = RowDists(torch.stack(ref_rows), engine.sampling)
    result = verify.run_verifier(engine.verifier_name, tree, p_ref, d.q_rows, gen, greedy=engine.sampling.greedy)
    flips = []
    for i in range(len(tree)):
        mine, theirs = _status(v.result.decisions, i, tree), _status(result.decisions, i, tree)
        if mine != theirs:
            p = tree.parent[i]
            same_parent = p < 0 or _status(v.result.decisions, p, tree) == _status(result.decisions, p, tree)
            flips.append(NodeFlip(node=i + 1, text=text(tree.token[i]), status=mine, reference_status=theirs,
                                  parent=p + 1, cause=same_parent))
    ref_committed = [tree.token[i] for i in result.path] + ([result.bonus] if result.bonus is not None else [])
    committed = [tree.token[i] for i in v.result.path] + ([v.result.bonus] if v.result.bonus is not None else [])
    uncached_len = len(v.position_ids) - len(tree)
    lint = lint_mask(v.full_mask, v.past, uncached_len, tree.parent, v.position_ids)
    return StepProbe(step=step.index, dtype=str(dtype).removeprefix("torch."), rows=rows, node_flips=flips,
                     committed=committed, reference_committed=ref_committed, lint=lint,
                     reference_forwards=reference.forwards - before)
