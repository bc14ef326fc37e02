"""The models' forwards of one engine: each model's KV cache, eager calls or graph runners, each forward timed on
the step's timeline (a drafter acts on its own model through ``drafters.base.DraftModelAccess`` over these).

A forward appends its rows to its model's cache and returns the logits of the rows asked for, cut to the pair's
shared vocabulary (``runtime/graphs.ForwardOutput``): with ``hidden`` the last hidden state (the decision
features), with ``layers`` the hidden states entering the named decoder layers at every row (what a drafter that
reads the target's features takes from the verification forward, with no second target forward).
"""

from __future__ import annotations

import contextlib

import torch

from ..models.pair import ModelPair
from .parts import EngineError
from .runtime.graphs import BUCKETS, ForwardOutput, acquire_runner, eager_forward, release_runner
from .runtime.kv_cache import KVCache, new_kv_cache
from .runtime.timeline import StepTimeline
from .sampling import SamplingConfig
from .stop_models.features import top_candidates


class Forwards:
    """Forwards of a pair's ``target`` and ``draft`` models for one engine (batch size 1).

    Args:
        pair: the loaded models (forwards hold ``pair.lock``).
        kv_cache: ``dynamic`` or ``static`` (``runtime/kv_cache.py``).
        graphs: run forwards through graph runners (``runtime/graphs.GraphRunner``; a static cache).
        draft: the session's own draft model (``online_distill_draft.py``: the pair's weights and a LoRA adapter),
            run eagerly (the pair's graph runners hold the pair's draft); None for ``pair.draft``.
    Attributes:
        target_kv, draft_kv: the caches of the current run (``open``); ``draft_kv`` None without a draft model.
        timeline: the current step's ``StepTimeline`` (each forward is a segment of it), or None between steps.
        lanes: role -> the timeline of a thread drafting beside the main one (``Engine`` ``lanes="threads"``): that
            role's forwards are timed there.
        lock_held: the engine holds ``pair.lock`` for the whole step, for its threads (set only while they run).
    """

    def __init__(self, pair: ModelPair, kv_cache: str, graphs: bool, draft: torch.nn.Module | None = None):
        self.pair, self.kv_cache, self.graphs = pair, kv_cache, graphs
        self.draft_model = pair.draft if draft is None else draft
        self.own_draft = draft is not None
        self.runners: dict = {}  # role -> GraphRunner (graphs only)
        self.target_kv: KVCache | None = None
        self.draft_kv: KVCache | None = None
        self.timeline: StepTimeline | None = None
        self.lanes: dict[str, StepTimeline] = {}
        self.lock_held = False

    def open(self, positions: int, drafts: bool) -> None:
        """Fresh caches for a run needing ``positions`` positions; a draft cache where ``drafts``. With graphs, the
        runners come from the pair's idle ones (padding rows of the largest bucket need room past the last row)."""
        self.release()
        self.draft_kv = None
        if self.graphs:  # a draft of its own, or on a device of its own, runs eagerly
            roles = ("target", "draft") if drafts and not self.own_draft and not self.pair.split else ("target",)
            self.runners = {role: acquire_runner(self.pair, role, positions + max(BUCKETS)) for role in roles}
            self.target_kv = self.runners["target"].kv
            self.draft_kv = self.runners["draft"].kv if "draft" in self.runners else None
        else:
            self.target_kv = new_kv_cache(self.kv_cache, self.pair.target, positions)
        if drafts and self.draft_kv is None:
            self.draft_kv = new_kv_cache(self.kv_cache, self.draft_model, positions)

    def release(self) -> None:
        """Give the graph runners back to the pair for the next run."""
        for role, runner in self.runners.items():
            release_runner(self.pair, role, runner)
        self.runners = {}

    @property
    def captures(self) -> int:
        """Graphs captured so far by this run's runners."""
        return sum(runner.captures for runner in self.runners.values())

    def segment(self, role: str, rows: int):
        """A context manager timing a forward of ``role`` over ``rows`` rows on the step's timeline (none between
        steps)."""
        timeline = self.lanes.get(role, self.timeline)
        return timeline.forward(role, rows) if timeline else contextlib.nullcontext()

    def forward(self, role: str, input_ids: list[int], position_ids: list[int], mask, keep: int,
                hidden: bool = False, hidden_rows: int | None = None, layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward of the ``target`` or ``draft`` model (``role``) appending to its KV cache. ``mask``: bool
        ``(q, kv.length + q)`` numpy array or None for the ordinary causal mask. Returns the logits of the last
        ``keep`` rows ``(keep, vocab)`` cut to the shared vocabulary, with ``hidden`` the last hidden state float32
        ``(hidden_rows or keep, hidden_size)``, with ``layers`` the named layers' states ``(q, len(layers),
        hidden_size)`` in the model dtype."""
        model, kv = (self.pair.target, self.target_kv) if role == "target" else (self.draft_model, self.draft_kv)
        runner = self.runners.get(role)
        lock = contextlib.nullcontext() if self.lock_held else self.pair.lock
        with torch.inference_mode(), lock, self.segment(role, len(input_ids)):
            if runner is not None:
                out = runner.forward(input_ids, position_ids, mask, keep, hidden, hidden_rows, layers)
            else:
                out = eager_forward(model, kv, input_ids, position_ids, mask, keep, hidden, hidden_rows, layers)
        if role == "draft" and self.pair.split:  # the engine's tensors live on the target's device
            out = ForwardOutput(*(None if t is None else t.to(self.pair.device) for t in out))
        return out._replace(logits=out.logits[:, : self.pair.vocab_size])

    def draft_chain(self, input_ids: list[int], position_ids: list[int], mask, levels: int, sampling: SamplingConfig,
                    uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``levels`` draft forwards of ``len(input_ids)`` draft chains in one replay (``GraphRunner.chain``):
        returns the chosen tokens int64 ``(levels, w)`` and the logits ``(levels * w, vocab)`` cut to the shared
        vocabulary. Raises EngineError without a graph runner for the draft."""
        runner = self.runners.get("draft")
        if runner is None:
            raise EngineError("a chain replay needs the draft's graph runner (graphs=True)")
        with torch.inference_mode(), self.pair.lock, self.segment("draft", len(input_ids) * levels):
            return runner.chain(input_ids, position_ids, mask, levels, self.pair.vocab_size, sampling, uniforms)

    def capture_graphs(self, draft_hidden: bool, target_layers: tuple[int, ...], chains=None) -> int:
        """CUDA: capture every query-size bucket of the runners now (the target's with ``target_layers``, the
        draft's also with its last hidden state where ``draft_hidden``), and the draft's chain replays ``chains``
        (``(widths, depths, sampling)``) where given. Returns the number of graphs captured; 0 off CUDA."""
        with torch.inference_mode(), self.pair.lock:  # as the forwards: the caches are inference tensors
            n = 0
            for role, runner in self.runners.items():
                n += runner.capture_all(layers=target_layers if role == "target" else ())
            draft = self.runners.get("draft")
            if draft is not None and draft_hidden:
                n += draft.capture_all(hidden=True)
            if draft is not None and chains is not None:
                widths, depths, sampling = chains
                n += draft.capture_chains(widths, depths, self.pair.vocab_size, sampling)
        return n

    def prompt_candidates(self, hidden: torch.Tensor) -> list[list[tuple[int, float]]]:
        """The target's best next tokens (id, plain probability) at the rows whose last hidden states ``hidden``
        ``(rows, hidden_size)`` are, through its LM head, cut to the shared vocabulary."""
        target = self.pair.target
        lm_head = target.get_output_embeddings()
        dtype = next(target.parameters()).dtype
        with torch.inference_mode(), self.pair.lock:
            return top_candidates(hidden, lambda h: lm_head(h.to(dtype))[:, : self.pair.vocab_size])
