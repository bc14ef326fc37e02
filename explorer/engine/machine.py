"""The step machine: prefill, draft, verify, commit, trim the KV caches; every step emits a StepTrace.

One engine drives all methods (``methods.METHODS``); they differ only in the drafter that proposes the tree
(``engine/drafters/``: none, the draft model, prompt lookup, Token Recycling, or the draft model plus free
branches), the stop policy and the verifier (see ``config.MethodConfig``).

Invariants between steps (batch size 1):

* ``committed`` holds prompt + generated token ids. Each model's KV cache covers a prefix of it:
  ``target_len`` and ``draft_len`` tokens. After a lossless step the last committed token (the bonus token, the
  next tree's *anchor*) is not in the target cache yet; after the prefill, and after every step of the lossy
  target-initialized method, the target caches everything and keeps its next-token distribution (``next_dist``)
  for the anchor. The prompt is never recomputed (but by a joint prefill's rewind, below).
* A step feeds each model the committed tokens it lacks (its *chain*) together with tree nodes; tree nodes use
  the topology-aware float mask and position ids ``L - 1 + depth`` (``engine/tree.py``). After verification both caches
  keep the committed context plus the accepted path (``engine/runtime/kv_cache.py``: only the path's rows move).
* With ``joint_prefill`` the target caches nothing at ``start``: the first step's chain is the whole prompt, so the
  prefill and the first verification are one forward.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch

from ..models.pair import ModelPair
from ..trace.records import (ACCEPTED, CONTEXT, DRAFT_SOURCES, REJECTED, TOP_K_SHOWN, UNVERIFIED, NodeTrace, RunTrace,
                             StepTrace)
from .attention import sliding_window
from .carried import Carried
from .config import MethodConfig
from .drafters import Drafted
from .drafters.base import Drafter, DraftView, empty_draft
from .drafters.model import chain_depths, chain_widths
from .drafters.row_pricing import RowPricing
from .policies.cost_ratio import CostRatioMeter
from .policies.fallback import GoodputFallback
from .policies.stopping import StopPolicy
from .runtime.forward_costs import tree_costs
from .runtime.graphs import BUCKETS, acquire_runner, eager_forward, release_runner
from .runtime.kv_cache import KV_CACHES, new_kv_cache
from .runtime.timeline import StepTimeline, step_times
from .sampling import LazyRows, RowDists, SamplingConfig, logits_to_probs
from .stop_models.features import model_inputs, top_candidates
from .tree import DraftTree, step_mask, step_position_ids
from .verify import expectation
from .verify import rules as verify


JOINT_PREFILL_ROWS = 1024
"""The longest prompt (tokens) whose prefill joins the first verification (``Engine`` ``joint_prefill``): its rows
go through an explicit ``(rows, rows)`` float mask there, not the causal kernel; a longer one is prefilled apart."""


class EngineError(ValueError):
    """Bad input to the engine (empty or too long prompt, impossible settings): the message says what is wrong."""


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class _Forward:
    """Logits of one forward, kept for the rows we need (``(n_rows, vocab)``, model dtype)."""

    logits: torch.Tensor
    first_row: int  # index in the query of logits[0]
    hidden: torch.Tensor | None = None  # float32 (n_rows, hidden_size): last hidden state of the same rows


@dataclass
class VerifiedStep:
    """What verification produced for one step: what drafters learn from (``Drafter.learn``) and instruments read
    (``Engine.last_step``: the latest step's ``(Drafted, VerifiedStep)``). Tensors live on the pair's device; N is
    the number of tree nodes, R the rows sent to the target (the anchor, when fed, and the N nodes), vocab the
    pair's shared vocabulary.

    Attributes:
        result: the walk's outcome (``verify.VerifyResult``): the accepted path (tree indices), the bonus token,
            each tested node's ``NodeDecision``, per-branch accepted counts, the chosen branch.
        p_rows: the target's processed distributions (``sampling.RowDists``): row 0 the anchor, row i + 1 tree
            node i, each float32 ``(vocab,)`` (one-hot when greedy), computed when read.
        mask: numpy bool ``(R, R)``: the step's own columns of the mask sent to the target (True = attend).
        position_ids: R ints, ``L - 1 + depth`` (the anchor, when fed, at ``L - 1``).
        past: cached context columns every row also attends to.
        anchor_fed: whether the anchor was a row of this forward (it was not in the target's cache yet).
        calls: target forwards this verification took: 1, or 0 on a first ``ar`` step (nothing to feed).
        head: target cache length before the tree rows (``past`` plus the anchor when fed), in tokens.
        parent_rows: sorted p rows with children in the tree (batched in ``p_rows``; their top tokens are traced).
        anchor_token: the last committed token id, root of the tree.
        anchor_logits: ``(vocab,)`` the target's logits at the anchor: model dtype when the anchor was fed, else
            float32 (kept from the prefill or the previous lossy step).
        node_logits: ``(N, vocab)`` model dtype: the target's logits at every tree node, tree order.
        odds: tree index -> ``expectation.NodeOdds`` (``accept_prob``, ``slot_prob`` in [0, 1], ``order``,
            ``ratio``): what the rule implies about each tested node.
        expected_tokens: tokens the step commits in expectation over the verifier's draws (bonus included).
        rng_state: uint8 CPU tensor, the generator's state right before verification (the probe re-verifies).
        full_mask: numpy bool ``(R, past + R)``: the whole mask the target was sent (the probe lints it).
        prompt_hidden: with the prefill joined to this verification (``Engine`` ``joint_prefill``), the target's
            last hidden states ``(rows, hidden_size)`` float32 at the prompt rows that seed the decision features'
            memory; else None. The prompt's rows before the anchor are not part of ``mask``, ``full_mask``,
            ``position_ids`` or ``R``: ``past`` counts them as cached context.
        prefill_rows: the prompt's tokens this forward read (a joint prefill), else 0.
    """

    result: verify.VerifyResult
    p_rows: RowDists
    mask: object
    position_ids: list[int]
    past: int
    anchor_fed: bool
    calls: int
    head: int
    parent_rows: list[int]
    anchor_token: int
    anchor_logits: torch.Tensor
    node_logits: torch.Tensor
    odds: dict
    expected_tokens: float
    rng_state: torch.Tensor
    full_mask: object
    prompt_hidden: torch.Tensor | None = None
    prefill_rows: int = 0


@dataclass
class EngineParts:
    """The strategies and meters one run steps with, built from the method, the sampling and the pair by
    ``factory.build_parts`` (the one place that builds them). The engine calls them; it builds none itself.

    Attributes:
        drafter: who proposes the tree (``drafters/``).
        stop_policy: when the draft model stops drafting (``engine/policies/stopping.py``); its ``threshold`` follows
            the measured cost ratio where ``cost_meter`` is set.
        verifier_name: the verification rule for this sampling (a ``verify.run_verifier`` name).
        decision_model: the learned model behind a learned stop policy, or None.
        free_rows / free_rows_run: the most target rows free branches may fill a tree to (None: no limit), and the
            same on a copy run (``config.free_row_budget``).
        adapter: the stop policy's online adaptation (``engine/stop_models/online.py``), or None; ``adapter_key`` what
            its state belongs to (``factory.carry_key``), ``adapter_carried`` the carried state it started from.
        fallback: the goodput fallback to plain decoding steps (``engine/policies/fallback.py``), or None;
            ``fallback_key`` what its rates belong to.
        carry_key: what the drafter's learned state (``layer-skip``'s exit chooser) belongs to (``carry_key``).
        row_pricing: the price of free rows (``drafters/row_pricing.py``), or None.
        cost_meter: the goodput stop policy's measured cost ratio r (``engine/policies/cost_ratio.py``), or None.
    """

    drafter: Drafter
    stop_policy: StopPolicy
    verifier_name: str
    decision_model: object | None = None
    free_rows: int | None = None
    free_rows_run: int | None = None
    adapter: object | None = None
    adapter_key: str | None = None
    adapter_carried: dict | None = None
    fallback: GoodputFallback | None = None
    fallback_key: str | None = None
    carry_key: str | None = None
    row_pricing: RowPricing | None = None
    cost_meter: CostRatioMeter | None = None


class Engine:
    """Step-wise speculative decoding on one ModelPair: the step machine (draft, verify, commit, record).

    Build it with ``factory.build_engine(pair, config, sampling, ...)``, which builds its parts; this constructor
    takes them ready-made.

    Args:
        pair: the loaded models (shared, read-only; forwards hold ``pair.lock``).
        config: the method and its shape (``MethodConfig``).
        sampling: temperature / top-k / top-p / seed, applied to draft and target alike.
        parts: the drafter, stop policy, verifier and meters (``EngineParts``).
        capture_features: keep every drafted node's decision features (``drafters.Drafted.features``) for
            ``decision collect``, whatever the stop policy.
        kv_cache: ``dynamic`` (default) or ``static`` (preallocated for the run; fixed shapes, see
            ``engine/runtime/kv_cache.py``). Both give the same tokens and traces.
        graphs: run forwards through ``graphs.GraphRunner`` (CUDA graphs per query-size bucket on a GPU, padded
            eager forwards elsewhere); needs ``kv_cache="static"``. Runners come from the pair's idle ones and go
            back with ``release()``.
        chain_levels: with ``graphs``, the most draft levels of a step's chains (levels of one token per node)
            run in one replay (``GraphRunner.chain``, next tokens chosen on the device); 0 (default) = one forward
            per level. Levels past where the stop policy ends drafting are computed and dropped.
        count_syncs: count each step's host synchronisations into ``StepTrace.host_syncs``: on CUDA torch's sync
            debug mode (process-wide, a few microseconds each), on the CPU the value reads that would synchronise on
            a GPU (``engine/runtime/host_reads.py``; slows the step several-fold). For measurements and tests, not the
            app.
        joint_prefill: where the first step's tree does not need the target's prediction at the prompt (drafted
            roots, not target-initialized ones; a separate draft model; eager forwards), ``start`` prefills the
            draft only and the first step's target forward reads the prompt and the tree together: the prefill and
            the first verification in one forward, as transformers' assisted generation does, one target forward
            fewer per run (about 0.55 s of a 2-core AVX2 CPU's fp32 target). That step's record counts the prompt
            rows (``StepTrace.prefill_rows``), and its decision features miss the memory of the prompt's rows (it is
            seeded right after). Off by default: the explorer shows the prefill apart.
    Raises:
        EngineError: an unknown ``kv_cache``, graphs without a static cache, ``chain_levels`` without graphs or
            negative; on ``start``, an empty prompt or one
            that leaves no room in the context window.
    """

    def __init__(self, pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, parts: EngineParts,
                 capture_features: bool = False, kv_cache: str = "dynamic", graphs: bool = False,
                 count_syncs: bool = False, chain_levels: int = 0, joint_prefill: bool = False):
        if kv_cache not in KV_CACHES:
            raise EngineError(f"unknown KV cache {kv_cache!r}; use one of {', '.join(KV_CACHES)}")
        if graphs and kv_cache != "static":
            raise EngineError("CUDA graphs need fixed shapes: use kv_cache='static' with graphs")
        if kv_cache == "static" and any(sliding_window(m) for m in (pair.target, pair.draft)):
            # transformers' static sliding layers keep only the window: rows past it could not be kept or rewound
            raise EngineError("the static KV cache (and CUDA graphs) do not serve models with sliding-window "
                              "attention yet: use the dynamic cache")
        if chain_levels < 0 or (chain_levels and not graphs):
            raise EngineError(f"chain_levels must be >= 0 and needs graphs, got {chain_levels} "
                              f"{'with' if graphs else 'without'} graphs")
        self.kv_cache, self.graphs = kv_cache, bool(graphs)
        self.chain_levels = int(chain_levels)
        self.joint_prefill = bool(joint_prefill)
        self._prefill_pending = False  # the target has not read the prompt yet: the next verification reads it
        self._seed_rows = 0  # prompt rows whose target candidates the next verification returns for the memory
        self.count_syncs = count_syncs  # count each step's host synchronisations (engine/runtime/timeline.py; opt-in)
        self._runners: dict = {}  # role -> GraphRunner (graphs only)
        self.pair = pair
        self.config = config
        self.sampling = sampling
        self.branching = config.draft_branching()
        self.capture_features = capture_features
        self.drafter = parts.drafter
        self.view = DraftView(self)  # what the drafter sees of the run (not the engine)
        self.stop_policy = parts.stop_policy
        self.verifier_name = parts.verifier_name
        self.decision_model = parts.decision_model
        self.free_rows, self.free_rows_run = parts.free_rows, parts.free_rows_run
        # The adapter, the fallback and the cost meter outlive rewind(): what they learned carries to the next run.
        self.adapter, self._adapter_key, self._adapter_carried = parts.adapter, parts.adapter_key, parts.adapter_carried
        self.fallback, self._fallback_key, self._carry_key = parts.fallback, parts.fallback_key, parts.carry_key
        self.row_pricing = parts.row_pricing
        self.cost_meter = parts.cost_meter
        self.tree_costs: dict | None = None  # the online tree choice's forward costs (measured, or a trace's)
        self._tree_costs_followed = False
        self.trace: RunTrace | None = None
        self._timeline: StepTimeline | None = None  # the current step's segments (None outside a step)
        self._texts: dict[int, str] = {}  # token id -> decoded text (the trace shows thousands per run)
        self.last_step: tuple | None = None  # (Drafted, VerifiedStep) of the latest step: decision collect, probe
        # while drafters start: the target's best candidates (id, plain probability) at the prompt's last rows
        self.prefill_top: list | None = None

    # ------------------------------------------------------------------ set-up

    def start(self, prompt_ids: list[int], max_new_tokens: int, prompt_text: str = "") -> RunTrace:
        """Prefill both models on the prompt and open a new RunTrace.

        The target caches the whole prompt and keeps its next-token distribution for the first step; the draft
        caches ``prompt[:-1]`` and feeds the last prompt token (the first anchor) in its first forward.
        """
        if not prompt_ids:
            raise EngineError("the prompt is empty: type a prompt or pick an example")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = self.pair.max_positions
        needed = positions_needed(self.config, len(prompt_ids), max_new_tokens)
        if needed > budget:
            raise EngineError(
                f"the prompt has {len(prompt_ids)} tokens; with {max_new_tokens} new tokens and a tree of "
                f"{self.config.max_nodes()} nodes it needs {needed} positions, but the models hold {budget}. "
                "Shorten the prompt or lower max new tokens."
            )
        if self.config.tree_choice == "online" and not self._tree_costs_followed:
            self.tree_costs = tree_costs(self.pair)  # measured once per pair, before the prefill's clock
        self.generator = torch.Generator(device=self.pair.device)
        self.generator.manual_seed(int(self.sampling.seed))
        self.committed = list(int(t) for t in prompt_ids)
        self.n_prompt = len(self.committed)
        self.max_new_tokens = int(max_new_tokens)
        self.finished = False
        self.release()
        drafts = self.drafter.uses_draft_model
        if self.graphs:  # padding rows of the largest bucket need room past the last real row
            roles = ("target", "draft") if drafts else ("target",)
            self._runners = {role: acquire_runner(self.pair, role, needed + max(BUCKETS)) for role in roles}
            self.target_kv = self._runners["target"].kv
            self.draft_kv = self._runners["draft"].kv if drafts else None
        else:
            self.target_kv = new_kv_cache(self.kv_cache, self.pair.target, needed)
            self.draft_kv = new_kv_cache(self.kv_cache, self.pair.draft, needed) if drafts else None
        self._text_so_far = ""  # decoded generated text, complete characters only
        t0 = _now(self.pair.device)
        # The target prefills the whole prompt exactly as transformers' generate does (same kernels, same cache
        # rounding), and its last row gives p for the first step's anchor.
        # A drafter that learns from the target's verdicts may read the prompt's rows too: their last hidden states
        # come out of the same forward, and the lm head runs over them apart, so the last row's logits stay those
        # of a one-row head, bit for bit (a many-row matmul rounds otherwise).
        seed_rows = min(self.n_prompt, self.drafter.prompt_rows(self.view))
        self._prefill_pending = self._can_join_prefill()
        if self._prefill_pending:  # the first verification reads the prompt (and returns the memory's rows)
            self.next_logits = self.next_dist = None
            self._seed_rows = seed_rows
        else:
            fwd = self.forward("target", self.committed, list(range(self.n_prompt)), None, keep=1,
                               hidden=seed_rows > 0, hidden_rows=seed_rows or None)
            self.next_logits = fwd.logits[-1].float()
            self.next_dist = logits_to_probs(self.next_logits, self.sampling)
            self.prefill_top = self._prompt_candidates(fwd.hidden) if seed_rows else None
            del fwd
        head = self.committed[:-1]
        # an early exit of the target (layer-skip) computes what the target's cache already holds: the drafter
        # copies those layers when it first drafts (layer_skip.CATCH_UP_ROWS), and most of its runs never draft
        if self.draft_kv is not None and head and not getattr(self.pair.draft, "shares_target", False):
            self.forward("draft", head, list(range(len(head))), None, keep=1)
        self.drafter.start(self.view)
        self.prefill_top = None  # read once, by the drafter's start
        prefill_ms = (_now(self.pair.device) - t0) * 1e3
        self._after_prefill = (self.target_len(), self.draft_len(), self.next_logits, self.next_dist)
        self.trace = RunTrace(
            settings={"method": self.config.to_dict(), "sampling": self.sampling.to_dict(),
                      "max_new_tokens": self.max_new_tokens, "verifier": self.verifier_name,
                      **self.drafter.state_for_trace(),
                      **({"fallback_carried": self.fallback.carried} if self.fallback and self.fallback.carried
                         else {}),
                      **({"adaptation_carried": self._adapter_carried} if self._adapter_carried else {}),
                      **({"joint_prefill": True} if self._prefill_pending else {}),
                      **({"decision_model": {"kind": self.decision_model.kind, **self.decision_model.source}}
                         if getattr(self.decision_model, "source", None) else {})},
            model={"name": self.pair.name, "draft_id": self.pair.draft_id, "target_id": self.pair.target_id,
                   "dtype": str(self.pair.dtype).removeprefix("torch."), "device": str(self.pair.device),
                   "draft_quant": self.pair.draft_quant, "packed_weights": self.pair.packed_weights,
                   "kv_cache": self.kv_cache, "graphs": self.graphs,
                   **({"chain_levels": self.chain_levels} if self.chain_levels else {}),
                   **({"fused_kernels": True} if self.pair.fused_kernels else {}),
                   **({"verification_cost": self.pair.measured["verification_cost"]}
                      if "verification_cost" in self.pair.measured else {}),
                   **({"row_pricing": self.row_pricing.prices} if self.row_pricing is not None else {}),
                   **({"tree_costs": self.tree_costs} if self.tree_costs is not None else {})},
            prompt=prompt_text, prompt_ids=list(self.committed), prefill_ms=prefill_ms)
        return self.trace

    def _can_join_prefill(self) -> bool:
        """Whether this run's first verification reads the prompt (``joint_prefill``): its tree must not need the
        target's prediction at the prompt's end (target-initialized roots; ``ar``, whose step is that prediction),
        the draft must not read the target's cache (``layer-skip``), forwards are eager (a graph runner has no
        bucket for a prompt), and the prompt is at most ``JOINT_PREFILL_ROWS`` tokens (its rows get an explicit
        mask, ``(rows, rows)`` floats, instead of the causal kernel)."""
        return (self.joint_prefill and not self.graphs and self.config.method != "ar" and not self.config.is_lossy
                and not getattr(self.pair.draft, "shares_target", False) and self.n_prompt <= JOINT_PREFILL_ROWS)

    def rewind(self, seed: int | None = None) -> RunTrace:
        """Go back to the state right after the prefill (caches cut back, no tokens generated), optionally with a
        new seed, without recomputing the prompt (a joint prefill's target reads it again in the next verification).
        Used to draw many samples from one context (``analysis/audit.py``)."""
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        target_len, draft_len, self.next_logits, self.next_dist = self._after_prefill
        self._prefill_pending = target_len == 0  # a joint prefill: the next verification reads the prompt again
        self.target_kv.rewind(target_len)
        if self.draft_kv is not None:
            self.draft_kv.rewind(draft_len)
        del self.committed[self.n_prompt:]
        self.drafter.rewind()
        if self.row_pricing is not None:
            self.row_pricing.reset()
        self.finished = False
        self._text_so_far = ""
        if seed is not None:
            self.sampling = replace(self.sampling, seed=int(seed))
        self.generator.manual_seed(int(self.sampling.seed))
        self.trace = RunTrace(settings={**self.trace.settings, "sampling": self.sampling.to_dict()},
                              model=self.trace.model, prompt=self.trace.prompt, prompt_ids=self.trace.prompt_ids,
                              prefill_ms=self.trace.prefill_ms)
        return self.trace

    def release(self) -> None:
        """Give this engine's graph runners back to the pair for the next run; the run cannot step after it."""
        for role, runner in self._runners.items():
            release_runner(self.pair, role, runner)
        self._runners = {}

    def capture_graphs(self) -> int:
        """CUDA: capture every query-size bucket of this run's graph runners now (after ``start``), so that no
        later step pays for a capture (the bench's warm-up; about 0.1-0.2 s a bucket on an H100), and with
        ``chain_levels`` every chain replay this run's tree and sampling can use. Returns the number of graphs
        captured; 0 without graphs or off CUDA."""
        with torch.inference_mode(), self.pair.lock:  # as the forwards: the caches are inference tensors
            n = sum(runner.capture_all() for runner in self._runners.values())
            if "draft" in self._runners and getattr(self.stop_policy, "needs_hidden", False):  # draft features
                n += self._runners["draft"].capture_all(hidden=True)
            if "draft" in self._runners and self.chain_levels:
                n += self._runners["draft"].capture_chains(chain_widths(self.config, self.config.target_roots),
                                                           chain_depths(self.chain_levels), self.pair.vocab_size,
                                                           self.sampling)
        return n

    def reach(self) -> dict:
        """How far this step's tree can matter, for the drafters (``drafters.base.merge_free``, ``ModelDrafter``):
        ``max_depth``, the tokens left before ``max_new_tokens`` less one (a path that deep plus the bonus token
        fills the room, so a deeper node could never be committed), and ``ends``, the EOS ids (nothing after one
        is committed, so an EOS node gets no children). Proposals stay a function of the history: lossless.
        transformers' candidate generators cap their drafts at the room left in the same way."""
        return {"max_depth": self.tokens_left - 1, "ends": frozenset(self.pair.eos_token_ids)}

    @property
    def tokens_left(self) -> int:
        """New tokens the run may still commit before ``max_new_tokens``."""
        return self.max_new_tokens - self.n_generated

    def _graph_captures(self) -> int:
        return sum(runner.captures for runner in self._runners.values())

    @property
    def n_generated(self) -> int:
        return len(self.committed) - self.n_prompt

    def token_text(self, token_id: int) -> str:
        """The text of one token as the tokenizer decodes it alone (cached per run): what the trace shows."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.pair.tokenizer.decode([token_id])
        return text

    def _pieces(self, new_tokens: list[int]) -> list[str]:
        """Text each new token adds to the output. A token that ends inside a multi-byte character adds "" and
        the token completing it carries the whole character, so the pieces always join to the decoded text."""
        out = []
        done = self.committed[self.n_prompt:]
        base = len(done) - len(new_tokens)
        for j in range(len(new_tokens)):
            full = self.pair.tokenizer.decode(done[: base + j + 1])
            if full.endswith("\ufffd") or not full.startswith(self._text_so_far):
                out.append("")
                continue
            out.append(full[len(self._text_so_far):])
            self._text_so_far = full
        return out

    # ------------------------------------------------------------------ forwards

    def forward(self, role: str, input_ids: list[int], position_ids: list[int], mask, keep: int,
                hidden: bool = False, hidden_rows: int | None = None) -> _Forward:
        """One forward of the ``target`` or ``draft`` model (``role``) appending to its KV cache. ``mask``: bool
        ``(q, kv.length + q)`` numpy array or None for the ordinary causal mask. Returns the logits of the last
        ``keep`` rows, cut to the shared vocabulary, and with ``hidden`` the last hidden state of the last
        ``hidden_rows`` rows (default: the same rows)."""
        model, kv = (self.pair.target, self.target_kv) if role == "target" else (self.pair.draft, self.draft_kv)
        runner = self._runners.get(role)
        segment = self._timeline.forward(role, len(input_ids)) if self._timeline else contextlib.nullcontext()
        with torch.inference_mode(), self.pair.lock, segment:
            if runner is not None:
                logits, h = runner.forward(input_ids, position_ids, mask, keep, hidden, hidden_rows)
            else:
                logits, h = eager_forward(model, kv, input_ids, position_ids, mask, keep, hidden, hidden_rows)
        logits = logits[:, : self.pair.vocab_size]
        return _Forward(logits=logits, first_row=len(input_ids) - logits.shape[0], hidden=h)

    def draft_chain(self, input_ids: list[int], position_ids: list[int], mask, levels: int,
                    uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``levels`` draft forwards of ``len(input_ids)`` chains in one replay (``GraphRunner.chain``): returns
        the chosen tokens int64 ``(levels, w)`` and the logits ``(levels * w, vocab)`` cut to the shared vocabulary.
        Raises EngineError without a graph runner for the draft."""
        runner = self._runners.get("draft")
        if runner is None:
            raise EngineError("a chain replay needs the draft's graph runner (graphs=True)")
        rows = len(input_ids) * levels
        segment = self._timeline.forward("draft", rows) if self._timeline else contextlib.nullcontext()
        with torch.inference_mode(), self.pair.lock, segment:
            return runner.chain(input_ids, position_ids, mask, levels, self.pair.vocab_size, self.sampling, uniforms)

    def _prompt_candidates(self, hidden: torch.Tensor) -> list[list[tuple[int, float]]]:
        """The target's best next tokens (id, plain probability) at the prompt rows whose last hidden states
        ``hidden`` ``(rows, hidden_size)`` are, through its lm head, cut to the shared vocabulary."""
        target = self.pair.target
        head = target.get_output_embeddings()
        dtype = next(target.parameters()).dtype
        with torch.inference_mode(), self.pair.lock:
            return top_candidates(hidden, lambda h: head(h.to(dtype))[:, : self.pair.vocab_size])

    # ------------------------------------------------------------------ one step

    def step(self, edit=None) -> StepTrace:
        """Run one speculative round: draft a tree, verify it with one target forward, commit, trim caches.

        ``edit``: ``edit(engine, drafted) -> Drafted``, applied between drafting and verification (the
        counterfactual steps of ``instruments/counterfactual.py``). Returns the step's StepTrace (also appended to
        ``self.trace``). Raises EngineError when called before ``start`` or after the run finished.
        """
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        if self.finished:
            raise EngineError("this run has finished: reset to start again")
        if self.graphs and not self._runners:
            raise EngineError("this run's graph runners were released: start a new run")
        self._timeline = StepTimeline(self.pair.device, count_syncs=self.count_syncs)
        try:
            return self._step(edit, self._timeline)
        finally:
            if self._timeline is not None:  # the step raised: stop counting syncs, drop its segments
                self._timeline.abort()
                self._timeline = None

    def _step(self, edit, timeline: StepTimeline) -> StepTrace:
        timeline.enter("drafting")
        L = len(self.committed)
        speculate = self.fallback.decide(len(self.trace.steps)) if self.fallback is not None else True
        captures = self._graph_captures()
        d = self.drafter.draft(self.view) if speculate else empty_draft(self.view)
        if speculate:  # the room that capped the tree's depth (``reach``), for the trace and teach mode
            d.info["tokens_left"] = self.tokens_left
        if edit is not None:
            d = edit(self, d)
        v = self._verify(d.tree, d.q_rows)
        result = v.result
        self.last_step = (d, v)
        timeline.enter("drafter learn")
        if v.prompt_hidden is not None:  # a joint prefill: the prompt's memory, older than this step's verdicts
            self.prefill_top = self._prompt_candidates(v.prompt_hidden)
            self.drafter.seed_prompt(self.view)
            self.prefill_top, self._seed_rows = None, 0
        self.drafter.learn(self.view, d, v)
        adaptation = {}
        if self.adapter is not None:
            timeline.enter("stop-policy adaptation")
            adaptation = self._adapt(d, v)

        # Commit, then cut both caches to the committed context plus the accepted path.
        timeline.enter("KV-cache commit")
        new_tokens = [d.tree.token[i] for i in result.path] + ([result.bonus] if result.bonus is not None else [])
        self.target_kv.keep(v.head, [v.head + i for i in result.path])
        if d.calls:  # the path's nodes the draft model saw: a prefix of the path (free nodes were never fed)
            fed_path = []
            for i in result.path:
                if i not in d.draft_rows:
                    break
                fed_path.append(d.head + d.draft_rows[i])
            self.draft_kv.keep(d.head, fed_path)
        if self.config.is_lossy:
            self.next_dist = result.next_dist
            self.next_logits = v.p_rows.row_logits(result.next_row).clone()  # not a view of all rows
        new_tokens = self._truncate(new_tokens)
        self.committed.extend(new_tokens)
        if self.row_pricing is not None:
            self.row_pricing.observe(self.committed)

        timeline.enter("trace recording")
        step = self._record(L, d, v, new_tokens)
        step.prefill_rows = v.prefill_rows
        step.adaptation = adaptation
        self.trace.steps.append(step)
        step.timeline = timeline.finish()  # CUDA: the step's one deliberate synchronisation
        self._timeline = None
        for name, ms in step_times(step.timeline).items():
            setattr(step, name, ms)
        step.host_syncs = timeline.syncs
        if self.fallback is not None:  # a step that captured graphs or read the prompt says nothing of its mode
            one_off = "graph capture" if self._graph_captures() > captures else "prefill" if v.prefill_rows else None
            step.fallback = self.fallback.observe(speculate, len(new_tokens), sum(s["ms"] for s in step.timeline),
                                                  one_off=one_off)
        if self.cost_meter is not None and not v.prefill_rows:
            step.cost = self.cost_meter.observe(step.draft_ms, step.draft_calls, step.step_ms, len(d.tree))
            self.stop_policy.threshold = step.cost["next"]
            if step.adaptation:  # its record names the threshold in force next
                step.adaptation["threshold"] = step.cost["next"]
        return step

    def follow_fallback(self, decisions: list[bool]) -> None:
        """Replay: speculate (True) or take a plain decoding step (False) in each next step as recorded, whatever
        this machine measures (``fallback.GoodputFallback.force``); after them the engine's own setting rules."""
        if self.fallback is None:
            self.fallback = GoodputFallback(replay_only=True)
        self.fallback.force(decisions)

    def follow_tree_costs(self, costs: dict | None) -> None:
        """Price the online tree choice's steps with ``costs`` (a trace's ``model["tree_costs"]``) instead of this
        machine's timings, from the next draft on: a replay chooses the recorded run's trees; called before
        ``start``, ``start`` times no forward for them. None: nothing changes."""
        if costs is None:
            return
        self.tree_costs, self._tree_costs_followed = costs, True
        if self.trace is not None:
            self.trace.model["tree_costs"] = costs

    def follow_row_pricing(self, prices: dict | None) -> None:
        """Price free rows at ``prices`` (``{"one_row_ms", "jump_ms", "row_ms"}``: ``forward_costs.row_prices``,
        or a trace's ``model["row_pricing"]``), or not at all (None); replays take the recorded prices, whatever
        this machine measures. Raises KeyError, TypeError or ValueError for a malformed record."""
        self.row_pricing = RowPricing.from_prices(prices)

    def follow_cost_ratio(self, values: list) -> None:
        """Replay: the goodput policy's measured r after each next step as recorded (``StepTrace.cost["next"]``),
        whatever this machine measures; no effect unless the config measures it."""
        if self.cost_meter is not None:
            self.cost_meter.force(values)

    def _verify(self, tree: DraftTree, q_rows: LazyRows) -> "VerifiedStep":
        """One target forward over its chain (the anchor, when not cached) and the whole tree, then the verifier."""
        L = len(self.committed)
        chain = self.committed[self.target_len():]
        past = L - len(chain)
        n = len(tree)
        self._timeline.enter("mask")
        mask = step_mask(past, len(chain), True, tree.anc, 0, n)
        pos = step_position_ids(past, len(chain), True, tree.depth, 0, n)
        calls = 1 if chain or n else 0
        seed = self._seed_rows if self._prefill_pending else 0  # the memory's prompt rows, then the tree's rows
        prompt_hidden = None
        if calls:
            fwd = self.forward("target", chain + tree.token, pos, mask if n else None,
                               keep=n + (1 if chain else 0), hidden=seed > 0, hidden_rows=(seed + n) or None)
            logits = fwd.logits
            if seed:
                prompt_hidden = fwd.hidden[:seed]
        else:  # first `ar` step: the prefill already gave the anchor's distribution
            logits = torch.empty(0, self.pair.vocab_size, device=self.pair.device)
        self._prefill_pending = False
        # The prompt's rows before the anchor (a joint prefill) count as cached context in the step's record.
        skip = max(0, len(chain) - 1)
        shown_past, mask, pos = past + skip, mask[skip:], pos[skip:]
        self._timeline.enter("odds")
        parents = sorted({p + 1 for p in tree.parent})  # rows with children: their best tokens go into the trace
        if chain:  # logits row 0 = anchor (p row 0), row 1 + i = node i
            p_rows = RowDists(logits, self.sampling, stat_rows=parents)
        else:  # the anchor is cached: its distribution was kept from the prefill or the previous (lossy) step
            p_rows = RowDists(logits, self.sampling, offset=1, fixed={0: (self.next_dist, self.next_logits)},
                              stat_rows=parents)
        # every node's test, computed on the device and read in one transfer; the walk below compares them with draws
        odds = expectation.node_odds(tree, p_rows, q_rows, self.verifier_name, greedy=self.sampling.greedy)
        expected = expectation.expected_tokens(tree, odds, lossy=self.config.is_lossy)
        self._timeline.enter("verification")
        rng_state = self.generator.get_state()
        result = verify.run_verifier(self.verifier_name, tree, p_rows, q_rows, self.generator,
                                     greedy=self.sampling.greedy, odds=odds)
        anchor_logits = logits[0] if chain else self.next_logits
        return VerifiedStep(result, p_rows, mask[:, shown_past:], pos, shown_past, bool(chain), calls,
                            past + len(chain), parents, self.committed[-1], anchor_logits,
                            logits[1:] if chain else logits, odds, expected, rng_state, mask, prompt_hidden,
                            len(chain) if skip else 0)

    def _adapt(self, d: Drafted, v: "VerifiedStep") -> dict:
        """Label the step's model-drafted tokens and let the adapter learn; returns its record for the trace.

        The label of a token is its acceptance probability under this run's own verification (``accept_prob`` of
        ``engine/verify/expectation.py``, already computed for the trace: 0 or 1 when greedy, ``min(1, p'/q')`` with the
        residuals of earlier-tested siblings when sampling), so the policy drifts towards what this run's verifier
        really accepts, not the temperature-1 soft label it was trained on."""
        tree = d.tree
        nodes = [i for i in range(len(tree)) if tree.source[i] == "draft" and i in d.features and i in v.odds]
        if not nodes:
            return {"mode": self.adapter.mode, "tokens": 0, "threshold": float(self.stop_policy.threshold)}
        host = torch.device("cpu")  # the adapter learns on the host, wherever the models run
        labels = torch.tensor([v.odds[i].accept_prob for i in nodes], dtype=torch.float32, device=host)
        if self.adapter.needs == "score":
            scores = [d.predicted[i] if i in d.predicted else d.q_show.get(i, 0.0) for i in nodes]
            return self.adapter.update(labels, scores=torch.tensor(scores, dtype=torch.float32, device=host))
        inputs = model_inputs(d.features, nodes, [tree.depth[i] for i in nodes], hidden=self.stop_policy.needs_hidden)
        tested = expectation.tested_probs(tree, v.odds)  # the refit weighs a token by the chance its test happened
        weights = torch.tensor([tested.get(i, 0.0) for i in nodes], dtype=torch.float32, device=host)
        return self.adapter.update(labels, inputs=inputs, weights=weights)

    def _truncate(self, tokens: list[int]) -> list[int]:
        """Cut at the first EOS (kept) and at ``max_new_tokens``; mark the run finished when either is hit."""
        room = self.tokens_left
        out = []
        for t in tokens[:room]:
            out.append(t)
            if t in self.pair.eos_token_ids:
                self.finished = True
                break
        if len(out) >= room:
            self.finished = True
        return out

    def carried(self) -> Carried:
        """What this run learned for the session's next run (pass it to ``build_engine(..., carried=...)``): Token
        Recycling's matrix, the goodput fallback's rates (none where this engine does not fall back or only replays
        recorded decisions) and the stop policy's online adaptation, each None where there is none."""
        recycling = next((f.state() for f in [self.drafter] + list(getattr(self.drafter, "free", []))
                          if hasattr(f, "state")), None)  # only RecyclingDrafter has a state()
        fallback = (None if self.fallback is None or self.fallback.replay_only
                    else {"key": self._fallback_key, "rates": self.fallback.state()})
        adapter = None if self.adapter is None else {"key": self._adapter_key, **self.adapter.state()}
        exits = self.drafter.chooser_state() if hasattr(self.drafter, "chooser_state") else None
        layer_skip = None if exits is None else {"key": self._carry_key, "state": exits}
        chooser = self.drafter.tree_state() if hasattr(self.drafter, "tree_state") else None
        tree = None if chooser is None else {"key": self._carry_key, "state": chooser}
        return Carried(recycling=recycling, fallback=fallback, adapter=adapter, layer_skip=layer_skip, tree=tree)

    def target_len(self) -> int:
        """Committed tokens in the target's KV cache."""
        return self.target_kv.length

    def draft_len(self) -> int:
        """Committed tokens in the draft's KV cache."""
        return self.draft_kv.length if self.draft_kv is not None else 0

    # ------------------------------------------------------------------ trace

    def _record(self, L: int, d: Drafted, v: "VerifiedStep", new_tokens: list[int]) -> StepTrace:
        """The step's trace; its times are filled in from the timeline once the step is over."""
        tree, result, p_rows = d.tree, v.result, v.p_rows
        committed_nodes = set(result.path[: len(new_tokens)])
        branches = tree.children(-1)
        branch_of = tree.branch_ids()
        anchor_token = self.committed[L - 1]
        p_top = p_rows.top(v.parent_rows, TOP_K_SHOWN)  # from the batched pass over the parent rows
        p_rows.prefetch_shown([(tree.parent[i] + 1, tree.token[i]) for i in range(len(tree))])
        nodes = [NodeTrace(id=0, parent=None, token_id=anchor_token, text=self.token_text(anchor_token), depth=0,
                           position_id=L - 1, source=CONTEXT, status=CONTEXT, committed=True)]
        for i in range(len(tree)):
            parent_row = tree.parent[i] + 1
            tok = tree.token[i]
            dec = result.decisions.get(i)
            odds = v.odds.get(i)
            if tree.source[i] == "target":
                status = ACCEPTED
            elif dec is None:
                status = UNVERIFIED
            else:
                status = ACCEPTED if dec.accepted else REJECTED
            nodes.append(NodeTrace(
                id=i + 1, parent=parent_row, token_id=tok, text=self.token_text(tok), depth=tree.depth[i],
                position_id=L - 1 + tree.depth[i], source=tree.source[i], status=status,
                committed=i in committed_nodes, branch=branch_of[i],
                q=d.q_show.get(i), p=p_rows.shown(parent_row, tok), provenance=self._provenance(d.provenance.get(i)),
                u=None if dec is None else dec.u, ratio=None if dec is None else _finite(dec.ratio),
                residual_top=[] if dec is None else self._top_rows(dec.residual_top),
                p_top=self._top_rows(p_top.get(parent_row, [])), q_top=self._top_rows(d.q_top.get(parent_row, [])),
                accept_prob=None if odds is None else odds.accept_prob,
                slot_prob=None if odds is None else odds.slot_prob, test_order=None if odds is None else odds.order,
                predicted_accept=d.predicted.get(i)))
        ids = ([0] if v.anchor_fed else []) + [i + 1 for i in range(len(tree))]
        drafted = sum(1 for s in tree.source if s in DRAFT_SOURCES)
        accepted_draft = sum(1 for i in result.path[: len(new_tokens)] if tree.source[i] in DRAFT_SOURCES)
        branch_rows = []
        for b, root in enumerate(branches):
            branch_rows.append({"branch": b, "root_id": root + 1, "root_text": self.token_text(tree.token[root]),
                                "accepted": int(result.branch_accepted.get(b, 0)),
                                "drafted": sum(1 for j in range(len(tree))
                                               if branch_of[j] == b and tree.source[j] in DRAFT_SOURCES),
                                "chosen": b == result.chosen_branch})
        return StepTrace(
            index=len(self.trace.steps), method=self.config.method, lossy=self.config.is_lossy, nodes=nodes,
            mask=v.mask.astype(int).tolist(), mask_node_ids=ids, mask_context_len=v.past,
            position_ids=[int(p) for p in v.position_ids], branches=branch_rows, stop_signals=d.signals,
            committed_ids=list(new_tokens), committed_text=self._pieces(new_tokens),
            bonus_token=result.bonus if (result.bonus is not None and len(new_tokens) > len(result.path)) else None,
            accepted_draft_len=accepted_draft, max_draft_len=self.config.max_draft_depth(), drafted=drafted,
            draft_calls=d.calls, target_calls=v.calls, draft_ms=0.0, verify_ms=0.0, step_ms=0.0,
            verifier=self.verifier_name, finished=self.finished,
            drafter=self._drafter_info(d.info), expected_tokens=v.expected_tokens)

    def _provenance(self, prov: dict | None) -> dict | None:
        """A free node's provenance with the texts a replay needs (no tokenizer there)."""
        if prov is None:
            return None
        prov = dict(prov)
        if "row_token" in prov:  # recycled: the token whose matrix row proposed it
            prov["row_text"] = self.token_text(prov["row_token"])
        if "match_at" in prov:  # lookup: the earlier occurrence of the n-gram the copy continues
            at = prov["match_at"]
            prov["match_text"] = "".join(self.token_text(t) for t in self.committed[at: at + prov["ngram"]])
        return prov

    def _drafter_info(self, info: dict) -> dict:
        """The drafter's record with token texts added (the matrix row of the anchor)."""
        info = dict(info)
        row = info.get("recycling_row")
        if row is not None:
            info["recycling_row"] = {**row, "token_text": self.token_text(row["token"]),
                                     "candidate_texts": [self.token_text(t) for t in row["candidates"]]}
        return info

    def _top_rows(self, top: list) -> list:
        return [[t, self.token_text(t), float(pr)] for t, pr in top]

    # ------------------------------------------------------------------ whole runs

    def run(self, max_steps: int | None = None, on_step=None) -> RunTrace:
        """Step until finished (or ``max_steps``); ``on_step(step_trace)`` is called after each step."""
        count = 0
        while not self.finished and (max_steps is None or count < max_steps):
            s = self.step()
            count += 1
            if on_step:
                on_step(s)
        return self.trace


def positions_needed(config: MethodConfig, n_prompt: int, max_new_tokens: int) -> int:
    """Positions a run needs in the models' context window: the prompt, the new tokens, and a whole tree of
    ``config`` past them plus one (``Engine.start`` refuses a run that needs more than ``pair.max_positions``)."""
    return n_prompt + max_new_tokens + config.max_nodes() + 1


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
