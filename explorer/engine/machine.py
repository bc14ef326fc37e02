"""The step machine: prefill, then steps that read draft -> verify -> commit -> record -> notify.

One engine drives all methods (``methods.METHODS``); they differ only in the parts ``factory.build_parts`` builds
(``parts.EngineParts``): the drafter that proposes the tree (``engine/drafters/``), the stop policy, the verifier,
and the observers that learn from each verified step (``engine/observers.py``). The run's state lives in one place
(``run_state.RunState``); the models' forwards in ``forwarding.Forwards``; verification in ``verification.py``;
the step's record in ``recording.py``.

A step feeds each model the committed tokens it has not cached together with tree nodes; tree nodes use the
topology-aware float mask and position ids ``L - 1 + depth`` (``engine/tree.py``). After verification both caches
keep the committed context plus the accepted path (``runtime/kv_cache.py``: only the path's rows move). With a
joint prefill the target caches nothing at ``start``: the first step's target forward reads the whole prompt with
the tree, the prefill and the first verification in one forward.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch

from ..models.pair import ModelPair
from ..trace.metrics import first_acceptance, run_metrics
from ..trace.records import RunTrace, StepTrace
from .carried import Carried
from .config import MethodConfig
from .drafters.base import Drafted, DraftModelAccess, DraftView, Reach, empty_draft
from .drafters.model import chain_depths, chain_widths
from .forwarding import Forwards
from .observers import ObservedStep
from .parts import EngineError, EngineOptions, EngineParts, PluginError
from .recording import Recorder, run_header
from .run_state import RunState
from .runtime.timeline import StepTimeline, step_times
from .sampling import SamplingConfig, logits_to_probs
from .tree import DraftTree
from .verification import VerifiedStep, read_tree, verify_tree

__all__ = ["JOINT_PREFILL_ROWS", "Engine", "EngineError", "EngineParts", "VerifiedStep", "positions_needed"]

JOINT_PREFILL_ROWS = 1024
"""The longest prompt (tokens) whose prefill joins the first verification (``EngineOptions.joint_prefill``): its
rows go through an explicit ``(rows, rows)`` float mask there, not the causal kernel; a longer one is prefilled
apart."""


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Engine:
    """Step-wise speculative decoding on one ModelPair: the step machine.

    Build it with ``factory.build_engine(pair, config, sampling, ...)``, which builds its parts; this constructor
    takes them ready-made.

    Args:
        pair: the loaded models (shared, read-only; forwards hold ``pair.lock``).
        config: the method and its shape (``MethodConfig``).
        sampling: temperature / top-k / top-p / seed, applied to draft and target alike.
        parts: the drafter, stop policy, verifier and observers (``EngineParts``).
        capture_features, kv_cache, graphs, count_syncs, chain_levels, joint_prefill, lanes, lane_threads: how the
            machine runs (``EngineOptions``).
    Attributes:
        state: the current run's ``RunState`` (None before ``start``); ``trace`` its ``RunTrace``.
        last_step: ``(Drafted, VerifiedStep)`` of the latest step (decision collect, the probe).
        verifier_name: the verification rule in force (an instrument may change it between steps).
    Raises:
        EngineError: bad options (``EngineOptions.check``); on ``start``, an empty prompt or one that leaves no room
            in the context window.
    """

    def __init__(self, pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, parts: EngineParts,
                 capture_features: bool = False, kv_cache: str = "dynamic", graphs: bool = False,
                 count_syncs: bool = False, chain_levels: int = 0, joint_prefill: bool = False, lanes: str = "one",
                 lane_threads: int = 1):
        self.options = EngineOptions(capture_features=bool(capture_features), kv_cache=kv_cache, graphs=bool(graphs),
                                     chain_levels=int(chain_levels), count_syncs=bool(count_syncs),
                                     joint_prefill=bool(joint_prefill), lanes=lanes, lane_threads=int(lane_threads))
        self.options.check(pair)
        self.pair, self.config, self.sampling, self.parts = pair, config, sampling, parts
        self.verifier_name = parts.verifier_name
        self.forwards = Forwards(pair, kv_cache, self.options.graphs, draft=parts.draft_model)
        self.recorder = Recorder(pair.tokenizer)
        self.state: RunState | None = None
        self.trace: RunTrace | None = None
        self.last_step: tuple[Drafted, VerifiedStep] | None = None
        self._branching = tuple(config.draft_branching())

    # ------------------------------------------------------------------ a run

    def start(self, prompt_ids: list[int], max_new_tokens: int, prompt_text: str = "") -> RunTrace:
        """Prefill on the prompt and open a new RunTrace.

        The target caches the whole prompt (exactly as transformers' generate prefills it) and keeps its next-token
        distribution for the first step, unless the prefill joins the first verification; the draft caches
        ``prompt[:-1]`` and feeds the last prompt token (the first anchor) in its first forward. The same target
        forward gives the drafter what it reads of the prompt: the target's candidates at the last rows
        (``Drafter.prompt_rows``, through the LM head apart, so the last row's logits stay those of a one-row LM
        head, bit for bit) and the hidden states of the layers it names (``Drafter.target_layers``)."""
        if not prompt_ids:
            raise EngineError("the prompt is empty: type a prompt or pick an example")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        n = len(prompt_ids)
        needed = positions_needed(self.config, n, max_new_tokens)
        if needed > self.pair.max_positions:
            raise EngineError(
                f"the prompt has {n} tokens; with {max_new_tokens} new tokens and a tree of "
                f"{self.config.max_nodes()} nodes it needs {needed} positions, but the models hold "
                f"{self.pair.max_positions}. Shorten the prompt or lower max new tokens.")
        drafter = self.parts.drafter
        self.forwards.open(needed, drafter.uses_draft_model)
        generator = torch.Generator(device=self.pair.device)
        generator.manual_seed(int(self.sampling.seed))
        s = self.state = RunState(committed=[int(t) for t in prompt_ids], n_prompt=n,
                                  max_new_tokens=int(max_new_tokens), target_kv=self.forwards.target_kv,
                                  draft_kv=self.forwards.draft_kv, generator=generator)
        self.trace, self.last_step = None, None
        self.recorder.output.reset()
        t0 = _now(self.pair.device)
        prompt_rows = min(n, drafter.prompt_rows(self._view()))
        s.prefill_pending = joins_prefill(self.options, self.config, n)
        prompt_top = states = None
        if s.prefill_pending:  # the first verification reads the prompt (and returns what the drafter reads)
            s.prompt_rows = prompt_rows
        else:
            fwd = self.forwards.forward("target", s.committed, list(range(n)), None, keep=1, hidden=prompt_rows > 0,
                                        hidden_rows=prompt_rows or None, layers=drafter.target_layers)
            s.next_logits = fwd.logits[-1].float()
            s.next_dist = logits_to_probs(s.next_logits, self.sampling)
            prompt_top = self.forwards.prompt_candidates(fwd.hidden) if prompt_rows else None
            states = fwd.states
        # an early exit of the target (layer-skip) computes what the target's cache already holds: the drafter
        # copies those layers when it first drafts (layer_skip.CATCH_UP_ROWS), and most of its runs never draft
        context = s.committed[:-1]
        if s.draft_kv is not None and context and not self.config.spec.self_draft:
            self.forwards.forward("draft", context, list(range(len(context))), None, keep=1)
        drafter.start(self._view(prompt_top=prompt_top, target_states=states))
        s.mark_prefilled()
        self.trace = run_header(self, prompt_text, (_now(self.pair.device) - t0) * 1e3, s.prefill_pending)
        return self.trace

    def rewind(self, seed: int | None = None) -> RunTrace:
        """Go back to the state right after the prefill (caches cut back, no tokens generated), optionally with a
        new seed, without recomputing the prompt (a joint prefill's target reads it again in the next verification).
        The drafter and the row prices return to their state after the prefill; the tree choice, the online
        adaptation, the fallback and the cost meter keep what they learned. Used to draw many samples from one
        context (``analysis/audit.py``)."""
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        if seed is not None:
            self.sampling = replace(self.sampling, seed=int(seed))
        self.state.rewind(self.sampling.seed)
        self.parts.drafter.rewind()
        if self.parts.row_pricing is not None:
            self.parts.row_pricing.reset()
        self.recorder.output.reset()
        self.trace = RunTrace(settings={**self.trace.settings, "sampling": self.sampling.to_dict()},
                              model=self.trace.model, prompt=self.trace.prompt, prompt_ids=self.trace.prompt_ids,
                              prefill_ms=self.trace.prefill_ms)
        return self.trace

    def release(self) -> None:
        """Give this engine's graph runners back to the pair for the next run; the run cannot step after it."""
        self.forwards.release()

    def capture_graphs(self) -> int:
        """CUDA: capture every query-size bucket of this run's graph runners now (after ``start``), so that no
        later step pays for a capture (the bench's warm-up; about 0.1-0.2 s a bucket on an H100), and with
        ``chain_levels`` every chain replay this run's tree and sampling can use. Returns the number of graphs
        captured; 0 without graphs or off CUDA."""
        chains = None
        if "draft" in self.forwards.runners and self.options.chain_levels:
            chains = (chain_widths(self.config, self.config.target_roots), chain_depths(self.options.chain_levels),
                      self.sampling)
        return self.forwards.capture_graphs(self.parts.stop_policy.needs_hidden, self.parts.drafter.target_layers,
                                            chains)

    @property
    def finished(self) -> bool:
        """Whether the current run has committed EOS or spent its budget (True before any run)."""
        return self.state is None or self.state.finished

    @property
    def n_generated(self) -> int:
        """New tokens the current run has committed."""
        return 0 if self.state is None else self.state.n_generated

    def carried(self) -> Carried:
        """What this run learned for the session's next run (pass it to ``build_engine(..., carried=...)``): the
        drafter's (``Drafter.carried``), the goodput fallback's rates (none where this engine does not fall back or
        only replays recorded decisions) and the stop policy's online adaptation, each None where there is none."""
        parts = self.parts
        fallback = (None if parts.fallback is None or parts.fallback.replay_only
                    else {"key": parts.fallback_key, "rates": parts.fallback.state()})
        adapter = None if parts.adapter is None else {"key": parts.adapter_key, **parts.adapter.state()}
        return replace(parts.drafter.carried(parts.carry_key), fallback=fallback, adapter=adapter)

    def run(self, max_steps: int | None = None, on_step=None) -> RunTrace:
        """Step until finished (or ``max_steps``); ``on_step(step_trace)`` is called after each step. Raises
        EngineError before ``start``."""
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        count = 0
        while not self.finished and (max_steps is None or count < max_steps):
            s = self.step()
            count += 1
            if on_step:
                on_step(s)
        return self.trace

    # ------------------------------------------------------------------ one step

    def step(self, edit=None) -> StepTrace:
        """Run one speculative round: draft a tree, verify it with one target forward, commit, record, notify.

        ``edit``: ``edit(engine, drafted) -> Drafted``, applied between drafting and verification (the
        counterfactual steps of ``instruments/counterfactual.py``). Returns the step's StepTrace (also appended to
        ``self.trace``). Raises EngineError when called before ``start``, after the run finished or after
        ``release`` on graphs.
        """
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        if self.state.finished:
            raise EngineError("this run has finished: reset to start again")
        if self.options.graphs and not self.forwards.runners:
            raise EngineError("this run's graph runners were released: start a new run")
        timeline = self.forwards.timeline = StepTimeline(self.pair.device, count_syncs=self.options.count_syncs)
        try:
            return self._step(edit, timeline)
        finally:
            if self.forwards.timeline is not None:  # the step raised: stop counting syncs, drop its segments
                timeline.abort()
                self.forwards.timeline = None

    def _step(self, edit, timeline: StepTimeline) -> StepTrace:
        timeline.enter("drafting")
        s, parts = self.state, self.parts
        speculate = parts.fallback.decide(len(self.trace.steps)) if parts.fallback is not None else True
        captures = self.forwards.captures
        ahead = parts.drafter.reads_ahead() if speculate and self.options.lanes == "threads" else None
        read = None
        if ahead is not None:
            drafted, read = self._two_lanes(ahead, timeline)
        else:
            drafted = self._draft() if speculate else empty_draft(len(s.committed))
        if speculate:  # the room that capped the tree's depth (``Reach``), for the trace and teach mode
            drafted.info["tokens_left"] = s.tokens_left
        if edit is not None:
            if drafted.unfed_leaf or drafted.own_draft_cache:
                raise EngineError(f"{self.config.method}'s steps carry drafts from round to round: they cannot be "
                                  "edited and re-verified one by one")
            drafted = edit(self, drafted)
        verified = verify_tree(self.forwards, s, drafted.tree, drafted.q_rows, self.sampling, self.verifier_name,
                               self.config.is_lossy, parts.drafter.target_layers, unfed_leaf=drafted.unfed_leaf,
                               read=read)
        self.last_step = (drafted, verified)
        timeline.enter("KV-cache commit")
        context = s.committed[:]
        committed = self._commit(drafted, verified)
        timeline.enter("trace recording")
        record = self.recorder.step(len(self.trace.steps), context, drafted, verified, committed,
                                    method=self.config.method, lossy=self.config.is_lossy,
                                    max_draft_len=self.config.max_draft_depth() or drafted.tree.n_levels,
                                    verifier=self.verifier_name,
                                    finished=s.finished)
        self.trace.steps.append(record)
        one_off = "graph capture" if self.forwards.captures > captures else "prefill" if verified.prefill_rows else None
        self._notify(ObservedStep(drafted=drafted, verified=verified, record=record, context=context,
                                  committed=committed, history=s.committed, speculated=speculate, one_off=one_off),
                     timeline)
        if s.finished and parts.distiller is not None:  # between requests: the head or adapter may learn
            parts.distiller.end_request(s.committed, head_summary(self.trace))
        return record

    def _two_lanes(self, ahead: list[int], timeline: StepTimeline):
        """Draft in a thread of its own while this thread runs the target's forward over the uncached committed
        tokens and ``ahead`` (PEARL's lanes, ``EngineOptions.lanes``). The engine holds ``pair.lock`` for both;
        each lane runs on ``lane_threads`` intra-op threads (a per-thread setting; with the draft on a device of its
        own, torch's setting); the draft's segments join the step's timeline as the ``draft`` lane. Returns
        ``(Drafted, TargetRead)``; what the drafter raised is raised here."""
        chain = DraftTree()
        for i, token in enumerate(ahead):
            chain.add_level([i - 1], [int(token)], source="draft")
        lane = StepTimeline(self.pair.draft_at)  # a draft on the CPU beside a GPU target: wall-clock segments
        out: dict = {}
        # two devices: the draft's lane has the host's cores to itself (the target's only launches kernels)
        threads = 0 if self.pair.split else self.options.lane_threads

        def draft_lane():
            if threads:
                torch.set_num_threads(threads)
            lane.enter("drafting")
            try:
                out["drafted"] = self._draft()
            except BaseException as exc:  # noqa: BLE001 - handed to the step's thread
                out["error"] = exc

        before = torch.get_num_threads()
        worker = threading.Thread(target=draft_lane, name="draft lane", daemon=True)
        with self.pair.lock:
            self.forwards.lanes, self.forwards.lock_held = {"draft": lane}, True
            try:
                if threads:
                    torch.set_num_threads(threads)
                timeline.enter("mask")  # from here the target's lane: launching the draft's delays its forward
                worker.start()
                try:
                    read = read_tree(self.forwards, self.state, chain, len(chain), self.parts.drafter.target_layers)
                finally:
                    timeline.enter("draft wait")
                    worker.join()
            finally:
                torch.set_num_threads(before)
                self.forwards.lanes, self.forwards.lock_held = {}, False
        timeline.add_lane("draft", lane)
        if "error" in out:
            raise out["error"]
        return out["drafted"], read

    def _draft(self) -> Drafted:
        """The drafter's tree for this step, its tokens checked against the vocabulary. A plugin's drafter that
        raises or proposes a token outside ``[0, vocab_size)`` stops the step with a PluginError naming the plugin
        and the method (the run keeps its steps so far); any drafter's out-of-vocabulary token is an EngineError."""
        drafter = self.parts.drafter
        try:
            drafted = drafter.draft(self._view())
        except EngineError:
            raise
        except Exception as exc:
            if not drafter.plugin:
                raise
            raise PluginError(f"{self._plugin_label()}: its drafter raised {type(exc).__name__}: {exc}") from exc
        vocab = self.pair.vocab_size
        for token in drafted.tree.token:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                where = self._plugin_label() if drafter.plugin else f"the {self.config.method} drafter"
                raise (PluginError if drafter.plugin else EngineError)(
                    f"{where}: proposed token {token!r}, outside the vocabulary (ids 0 to {vocab - 1})")
        return drafted

    def _plugin_label(self, step: int | None = None) -> str:
        """``step N: plugin NAME (FROM): method METHOD`` for error messages; N (1-based) the step that failed,
        by default the one being drafted."""
        origin = self.config.spec.origin or {}
        n = len(self.trace.steps) + 1 if step is None else step
        return (f"step {n}: plugin {origin.get('name', '?')} ({origin.get('loaded_from', '?')}): method "
                f"{self.config.method}")

    def _commit(self, drafted: Drafted, verified: VerifiedStep) -> list[int]:
        """Append the accepted path and the bonus token (cut at EOS and the budget) and cut both caches to the
        committed context plus the path's rows; the lossy method keeps the target's distribution for the next
        anchor. Returns the committed tokens."""
        s, result = self.state, verified.result
        tokens = [drafted.tree.token[i] for i in result.path] + ([result.bonus] if result.bonus is not None else [])
        s.target_kv.keep(verified.tree_start, [verified.tree_start + i for i in result.path if i < verified.fed])
        if drafted.calls and s.draft_kv is not None and not drafted.own_draft_cache:  # the path's fed prefix
            fed_path = []
            for i in result.path:
                if i not in drafted.draft_rows:
                    break
                fed_path.append(drafted.tree_start + drafted.draft_rows[i])
            s.draft_kv.keep(drafted.tree_start, fed_path)
        if self.config.is_lossy:
            s.next_dist = result.next_dist
            s.next_logits = verified.p_rows.row_logits(result.next_row).clone()  # not a view of all rows
        if s.prefill_pending:
            s.prompt_read()
        return s.commit(tokens, self.pair.eos_token_ids)

    def _notify(self, step: ObservedStep, timeline: StepTimeline) -> None:
        """Every observer learns from the step, once: the learners timed as segments of the step, then (after the
        step's clock stops and its times are in its record) the meters that read those times. The drafter first."""
        observers = (self.parts.drafter, *self.parts.observers)
        for observer in observers:
            if not observer.after_clock:
                timeline.enter(observer.phase)
                if observer is self.parts.drafter and observer.plugin:
                    try:
                        observer.observe(step)
                    except Exception as exc:
                        where = self._plugin_label(step.record.index + 1)  # the step is recorded already
                        raise PluginError(f"{where}: its drafter's observe raised {type(exc).__name__}: {exc}") from exc
                else:
                    observer.observe(step)
        record = step.record
        record.timeline = timeline.finish()  # CUDA: the step's one deliberate synchronisation
        self.forwards.timeline = None
        for name, ms in step_times(record.timeline).items():
            setattr(record, name, ms)
        record.host_syncs = timeline.syncs
        for observer in observers:
            if observer.after_clock:
                observer.observe(step)

    def _view(self, prompt_top: list | None = None, target_states: torch.Tensor | None = None) -> DraftView:
        """What the drafter sees of the run now (``DraftView``), built for each step."""
        s, parts = self.state, self.parts
        chains = self.options.chain_levels if "draft" in self.forwards.runners else 0  # replays need a draft runner
        draft = DraftModelAccess(self.forwards, self.sampling, chains) if s.draft_kv is not None else None
        return DraftView(
            committed=tuple(s.committed), n_prompt=s.n_prompt, steps_done=len(self.trace.steps) if self.trace else 0,
            config=self.config, sampling=self.sampling, verifier_name=self.verifier_name, branching=self._branching,
            reach=Reach(s.tokens_left - 1, frozenset(self.pair.eos_token_ids)), generator=s.generator,
            next_logits=s.next_logits, next_dist=s.next_dist, free_rows=parts.free_rows,
            free_rows_run=parts.free_rows_run, row_pricing=parts.row_pricing, stop_policy=parts.stop_policy,
            adapts=parts.adapter is not None, capture_features=self.options.capture_features, draft=draft,
            prompt_top=prompt_top, target_states=target_states, vocab_size=self.pair.vocab_size,
            time_forward=lambda rows: self.forwards.segment("draft", rows))


def head_summary(trace) -> dict:
    """A finished run's ``first_acceptance`` (steps that committed a head token at depth 1 over steps that drafted
    one; None where none did) and ``tokens_per_call``, for the online distillation's history."""
    return {"first_acceptance": first_acceptance(trace.steps)["rate"],
            "tokens_per_call": run_metrics(trace)["tokens_per_target_call"]}


def joins_prefill(options: EngineOptions, config: MethodConfig, n_prompt: int) -> bool:
    """Whether a run's first verification reads the prompt (``joint_prefill``): its tree must not need the target's
    prediction at the prompt's end (target-initialized roots; ``ar``, whose step is that prediction), the draft must
    not read the target's cache (``layer-skip``), forwards are eager (a graph runner has no bucket for a prompt),
    and the prompt is at most ``JOINT_PREFILL_ROWS`` tokens (its rows get an explicit mask, ``(rows, rows)``
    floats, instead of the causal kernel)."""
    return (options.joint_prefill and not options.graphs and config.method != "ar" and not config.is_lossy
            and not config.spec.self_draft and n_prompt <= JOINT_PREFILL_ROWS)


def positions_needed(config: MethodConfig, n_prompt: int, max_new_tokens: int) -> int:
    """Positions a run needs in the models' context window: the prompt, the new tokens, and a whole tree of
    ``config`` past them plus one (``Engine.start`` refuses a run that needs more than ``pair.max_positions``)."""
    return n_prompt + max_new_tokens + config.max_nodes() + 1
