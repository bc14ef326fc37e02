"""What an engine steps with: its parts (built by ``factory.build_parts``) and its options, and the engine's error.

``Engine`` builds none of its parts: the drafter, the stop policy, the verifier's name and every observer come ready
made, so a strategy can be swapped in before the engine is made (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .attention import sliding_window
from .drafters.base import Drafter
from .drafters.row_pricing import RowPricing
from .policies.cost_ratio import CostRatioMeter
from .policies.fallback import GoodputFallback
from .policies.stopping import StopPolicy
from .runtime.kv_cache import KV_CACHES


class EngineError(ValueError):
    """Bad input to the engine (empty or too long prompt, impossible settings): the message says what is wrong."""


class PluginError(EngineError):
    """A plugin's part failed during a run (its drafter raised, proposed a token outside the vocabulary, or its
    verification rule returned nothing usable): the message names the plugin, the method and the error. The run
    keeps its steps so far."""


@dataclass
class EngineParts:
    """The strategies and meters one run steps with, built from the method, the sampling and the pair by
    ``factory.build_parts`` (the one place that builds them).

    Attributes:
        drafter: who proposes the tree (``drafters/``); also the first of the step's observers.
        stop_policy: when the draft model stops drafting (``policies/stopping.py``).
        verifier_name: the verification rule for this sampling (a ``verify.run_verifier`` name).
        decision_model: the learned model behind a learned stop policy, or None.
        free_rows / free_rows_run: the most target rows free branches may fill a tree to (None: no limit), and the
            same on a copy run (``config.free_row_budget``).
        adapter: the stop policy's online adaptation (``stop_models/online.py``), or None; ``adapter_key`` what
            its state belongs to (``factory.carry_key``), ``adapter_carried`` the carried state it started from.
        fallback: the goodput fallback to plain decoding steps (``policies/fallback.py``), or None;
            ``fallback_key`` what its rates belong to. Its ``decide`` is the one call before drafting.
        carry_key: what the drafter's learned state (``layer-skip``'s exit chooser, the tree chooser) belongs to.
        row_pricing: the price of free rows (``drafters/row_pricing.py``), or None.
        cost_meter: the goodput stop policy's measured cost ratio r (``policies/cost_ratio.py``), or None.
        tree_costs: the forward costs by rows the online tree choice prices steps with (measured here, or a
            recorded run's), or None where the tree is fixed.
        observers: what else learns from a verified step (``observers.StepObserver``), in the order the step
            notifies them after the drafter.
        distiller: the session's online distillation of the head or the draft (``online_distill.HeadDistiller``,
            ``online_distill_draft.DraftDistiller``), told when a run finishes; None where the method does not distil.
        draft_model: the session's own draft model (the pair's weights with a LoRA adapter,
            ``online_distill_draft.py``) the draft forwards run on, or None for the pair's.
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
    tree_costs: dict | None = None
    observers: list = field(default_factory=list)
    distiller: object = None
    draft_model: object = None


LANES = ("one", "threads")
"""How a step's drafting and its target forward share the host (``EngineOptions.lanes``)."""


@dataclass(frozen=True)
class EngineOptions:
    """How the step machine runs: greedy tokens are the same under every option; a joint prefill changes the first
    step's record, and ``count_syncs`` fills ``StepTrace.host_syncs``.

    Attributes:
        capture_features: keep every drafted node's decision features (``Drafted.features``) for ``decision
            collect``, whatever the stop policy.
        kv_cache: ``dynamic`` (default) or ``static`` (preallocated for the run; fixed shapes,
            ``runtime/kv_cache.py``).
        graphs: run forwards through ``graphs.GraphRunner`` (CUDA graphs per query-size bucket on a GPU, padded
            eager forwards elsewhere); needs ``kv_cache="static"``. Runners come from the pair's idle ones and go
            back with ``Engine.release()``.
        chain_levels: with ``graphs``, the most draft levels of a step's draft chains (levels of one token per
            node) run in one replay (``GraphRunner.chain``, next tokens chosen on the device); 0 (default) = one
            forward per level. Levels past where the stop policy ends drafting are computed and dropped.
        count_syncs: count each step's host synchronisations into ``StepTrace.host_syncs``: on CUDA torch's sync
            debug mode (process-wide, a few microseconds each), on the CPU the value reads that would synchronise
            on a GPU (``runtime/host_reads.py``; slows the step several-fold). For measurements and tests.
        joint_prefill: where the first step's tree does not need the target's prediction at the prompt (drafted
            roots, not target-initialized ones; a separate draft model; eager forwards), ``start`` prefills the
            draft only and the first step's target forward reads the prompt and the tree together: the prefill and
            the first verification in one forward, as transformers' assisted generation does, one target forward
            fewer per run. That step's record counts the prompt rows (``StepTrace.prefill_rows``), and its decision
            features miss the memory of the prompt's rows (it is filled right after). Off by default: the explorer
            shows the prefill apart.
        lanes: ``one`` (default): a step drafts, then verifies, on one thread. ``threads``: where the drafter can
            say what the step's target forward reads before it drafts (``Drafter.reads_ahead``: PEARL), the draft
            drafts in a thread of its own while the target's forward runs, each thread on ``lane_threads`` CPU
            threads; the step's timeline keeps the draft's segments as a lane (``runtime/timeline.py``). Other
            drafters step as with ``one``.
        lane_threads: intra-op CPU threads of each lane with ``lanes="threads"`` (1: one core each); 0 leaves
            torch's setting, as does a pair whose draft is on a device of its own (``ModelPair.split``).
    """

    capture_features: bool = False
    kv_cache: str = "dynamic"
    graphs: bool = False
    chain_levels: int = 0
    count_syncs: bool = False
    joint_prefill: bool = False
    lanes: str = "one"
    lane_threads: int = 1

    def check(self, pair) -> None:
        """Raises EngineError for an unknown ``kv_cache``, graphs without a static cache, a static cache on a pair
        with sliding-window attention, or ``chain_levels`` negative or without graphs."""
        if self.kv_cache not in KV_CACHES:
            raise EngineError(f"unknown KV cache {self.kv_cache!r}; use one of {', '.join(KV_CACHES)}")
        if self.graphs and self.kv_cache != "static":
            raise EngineError("CUDA graphs need fixed shapes: use kv_cache='static' with graphs")
        if self.kv_cache == "static" and any(sliding_window(m) for m in (pair.target, pair.draft)):
            # transformers' static sliding layers keep only the window: rows past it could not be kept or rewound
            raise EngineError("the static KV cache (and CUDA graphs) do not serve models with sliding-window "
                              "attention yet: use the dynamic cache")
        if self.lanes not in LANES:
            raise EngineError(f"unknown lanes {self.lanes!r}; use one of {', '.join(LANES)}")
        if self.lane_threads < 0:
            raise EngineError(f"lane_threads must be >= 0, got {self.lane_threads}")
        if self.chain_levels < 0 or (self.chain_levels and not self.graphs):
            raise EngineError(f"chain_levels must be >= 0 and needs graphs, got {self.chain_levels} "
                              f"{'with' if self.graphs else 'without'} graphs")
