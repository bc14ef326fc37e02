"""Where an engine's parts are built: one place from a ``MethodConfig``, a ``SamplingConfig`` and the pair.

``Engine`` (``engine/machine.py``) is only the step machine (draft, verify, commit, record, notify); the strategies
and meters it steps with are built here:

* the drafter (``drafters.make_drafter``; for ``eagle`` the head, ``models/head_store.py``) and the free rows its
  branches may fill (``config.free_row_budget``);
* the stop policy (``stopping.make_stop_policy``) and, for the learned ones, the decision model that serves the
  pair (``resolve_decision``: its own, shipped or calibrated, else the embedded pair's, transferred, with online
  adaptation switched on);
* the stop policy's online adaptation (``engine/stop_models/online.py``), started from an earlier run's state when that
  run had the same pair, method, sampling and decision model;
* the goodput fallback to plain decoding steps (``engine/policies/fallback.py``), with an earlier run's rates on the
  same terms;
* the row pricing of Token Recycling's branches on a CPU (``drafters/row_pricing.py``);
* the goodput stop policy's measured cost ratio (``engine/policies/cost_ratio.py``);
* the online tree choice (``policies/tree_choice.py``; for ``eagle`` the tree's size, ``policies/head_tree.py``)
  and the forward costs it prices steps with;
* the verifier's name for the sampling (``MethodConfig.verifier_for``);
* the step's observers (``engine/observers.py``), in the order a step notifies them.

A replay hands the recorded run to the same place (``build_engine(..., follow=trace)``): the parts start from what
the recording started from and take the recorded timing-driven decisions (the fallback's, the measured cost ratio,
the row prices, the tree costs) instead of this machine's timings.

Call ``build_engine`` wherever a run starts (CLI, app, bench, audit, decision collect, replays, tests).
"""

from __future__ import annotations

import json

from ..models.early_exit import LayerSkipError, self_draft_pair
from ..models.eagle3 import HeadError
from ..models.head_store import describe, head_for
from ..models.pair import ModelPair
from ..trace.records import RunTrace
from .carried import Carried
from .config import MethodConfig, free_row_budget
from .drafters import DraftOffer, head_drafter, make_drafter, model_drafter
from .drafters.row_pricing import RowPricing
from .machine import Engine
from .observers import (AdaptationObserver, CostRatioObserver, FallbackObserver, RowPricingObserver,
                        TreeChoiceObserver)
from .parts import EngineError, EngineParts
from .policies.cost_ratio import CostRatioMeter
from .policies.fallback import GoodputFallback, asks_row_costs, fallback_active
from .online_distill import HeadDistiller
from .online_distill_draft import AdapterError, DraftDistiller
from .policies.head_tree import TreeSizer
from .policies.stopping import LEARNED_POLICIES, adapt_problem, make_stop_policy
from .policies.tree_choice import ONLINE_ROOTS, TreeChooser
from .runtime.forward_costs import head_tree_costs, row_ms, row_prices, rows_are_dear, tree_costs
from .sampling import SamplingConfig
from .stop_models.model import DecisionModelError, decision_model_for
from .stop_models.online import AdaptError, make_adapter

# The online adaptation a run gets where its decision model was trained on another pair and the method asks for
# none: the transferred model is a prior, and the last-layer refit learns this pair's acceptance as the run goes.
TRANSFER_ADAPT = "last-layer"


def can_fall_back(config: MethodConfig) -> bool:
    """Whether a step of ``config`` could be a plain decoding step instead (a lossless method that drafts)."""
    return bool(config.max_draft_depth()) and not config.is_lossy


def prices_rows(config: MethodConfig, device_type: str) -> bool:
    """Whether this method's tree takes Token Recycling's branches with an automatic row budget on a CPU: then,
    where rows cost time (``forward_costs.row_prices``), its template's slots are priced (``drafters/row_pricing.py``),
    in ``token-recycling``'s tree and in the hybrid's (beside the model's tree, whose rows follow its stop policy).
    Not prompt lookup's copies: pricing them fought its own adaptive copy length (docs/bench.md, "Tried and not
    kept")."""
    return device_type == "cpu" and not config.free_rows and "recycling" in config.spec.free


def times_verification(config: MethodConfig, device_type: str) -> bool:
    """Whether building the parts of ``config`` on a ``device_type`` device times the target's verification
    (``forward_costs.verification_cost``, once per pair: about 6 s on a 2-core AVX2 CPU): for the measured cost
    ratio's row charge, for ``--fallback auto`` off CUDA in a method that can fall back, and for Token Recycling's
    row pricing on a CPU (``prices_rows``). The app asks first, to say so while it waits."""
    return (config.cost_ratio == "measured" or prices_rows(config, device_type)
            or (can_fall_back(config) and asks_row_costs(config.fallback, device_type)))


def carry_key(pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, model: str | None = None) -> str:
    """What a fallback's rates (or an adapter's state) belong to: the pair, the device, the method's settings and
    the sampling (not the seed), and the decision model's fingerprint when given. What was learned under one of
    these says little about another."""
    return json.dumps({"pair": pair.name, "device": pair.device.type, "method": config.to_dict(),
                       "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                       **({"decision_model": model} if model else {})}, sort_keys=True, default=str)


def resolve_decision(pair: ModelPair, config: MethodConfig, decision_model=None) -> tuple[MethodConfig, object]:
    """The decision model a learned stop policy of ``config`` reads on ``pair``, and the config the run takes.

    The model is ``decision_model`` when given, else ``decision.model.decision_model_for`` (the pair's own, shipped
    or calibrated, else the embedded pair's for the kinds that transfer; its ``source`` says which). Where it is
    transferred and ``config`` asks for no online adaptation, the returned config has ``adapt`` set to
    ``TRANSFER_ADAPT``; otherwise ``config`` comes back as it is. A method without a learned stop policy gets
    ``(config, decision_model)`` unchanged.

    Raises:
        EngineError: no decision model can serve the pair (``hidden`` on a pair not calibrated), or its files are
            unreadable.
    """
    policy = config.stop_policy_name()
    if policy not in LEARNED_POLICIES:
        return config, decision_model
    if decision_model is None:
        try:
            decision_model = decision_model_for(pair.draft_id, pair.target_id, config.decision_model)
        except DecisionModelError as exc:
            raise EngineError(str(exc)) from None
    transferred = getattr(decision_model, "source", {}).get("how") == "transferred"
    if transferred and config.adapt == "off" and adapt_problem(TRANSFER_ADAPT, policy) is None:
        config = config.with_(adapt=TRANSFER_ADAPT)
    return config, decision_model


def build_parts(pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, decision_model=None,
                carried: Carried | None = None, follow: RunTrace | None = None,
                distiller: HeadDistiller | DraftDistiller | None = None) -> EngineParts:
    """The parts one run of ``config`` on ``pair`` steps with (arguments as ``build_engine``'s). The parts follow
    ``resolve_decision``'s config (a transferred decision model adapts online); ``build_engine`` gives the engine
    that config too.

    Raises:
        EngineError: a learned stop policy with no decision model for this pair, a carried adaptation state that
            does not fit the adapter, a followed trace whose row prices are malformed, or (``eagle``) a head that
            cannot be found, read or fitted to the target.
        ValueError: a stop policy threshold outside [0, 1] (``stopping.make_stop_policy``).
    """
    config, decision_model = resolve_decision(pair, config, decision_model)
    carried = carried or Carried()
    adapter_state, fallback_state = carried.adapter, carried.fallback
    policy = config.stop_policy_name()
    stop_policy = make_stop_policy(policy, config.threshold, decision_model)
    key = carry_key(pair, config, sampling)  # what the fallback's rates and the two choosers belong to
    exits = carried.layer_skip["state"] if carried.layer_skip and carried.layer_skip.get("key") == key else None
    tree = carried.tree["state"] if carried.tree and carried.tree.get("key") == key else None
    chooser, sizer, costs = None, None, None
    recorded = follow.model.get("tree_costs") if follow is not None else None  # a replay's: timed, not computed
    if config.tree_choice == "online" and config.spec.uses_head:  # the head's tree size; a replay forces it
        costs = recorded or head_tree_costs(pair)
        sizer = TreeSizer(costs["target"], config.head_tokens)
    elif config.tree_choice == "online":
        costs = recorded or tree_costs(pair)
        chooser = TreeChooser(ONLINE_ROOTS, published=config.draft_branching()[0], max_depth=config.max_depth,
                              branch_threshold=config.branch_threshold)
        chooser.costs = costs
    head = _head(pair, config)
    if config.online_distill and config.spec.uses_head:  # the session's own copy of the head learns
        distiller = _distiller(head[0], config, distiller)
        head = (distiller.head, head[1], {**head[2], "distilled": distiller.describe()})
    parts = EngineParts(
        drafter=make_drafter(config, carried.recycling, exits, chooser, tree, head, sizer,
                             DraftOffer(config, sampling, pair.vocab_size, pair.tokenizer,
                                        tuple(pair.eos_token_ids), pair.device.type, pair.draft_id, pair.target_id)),
        stop_policy=stop_policy,
        verifier_name=config.verifier_for(sampling.greedy), decision_model=decision_model,
        free_rows=free_row_budget(config.free_rows, pair.device.type),
        free_rows_run=free_row_budget(config.free_rows, pair.device.type, copy_run=True), carry_key=key,
        tree_costs=costs)
    if config.adapt != "off":
        parts.adapter = make_adapter(config.adapt, stop_policy)
        parts.adapter_key = carry_key(pair, config, sampling, parts.adapter.model_id)
        if adapter_state and adapter_state.get("key") == parts.adapter_key:
            try:
                parts.adapter.restore(adapter_state)
            except AdaptError as exc:
                raise EngineError(str(exc)) from None
            parts.adapter_carried = adapter_state
    if can_fall_back(config) and fallback_active(config.fallback, pair.device.type, lambda: rows_are_dear(pair)):
        parts.fallback_key = key
        same = bool(fallback_state) and fallback_state.get("key") == parts.fallback_key
        parts.fallback = GoodputFallback(carried=fallback_state["rates"] if same else None)
    if prices_rows(config, pair.device.type):  # where rows cost time, recycled slots must pay for their rows
        parts.row_pricing = RowPricing.from_prices(row_prices(pair))
    if config.cost_ratio == "measured":
        parts.cost_meter = CostRatioMeter(config.threshold, row_ms=row_ms(pair))
    if follow is not None:
        _follow(parts, follow)
    parts.observers = _observers(parts, chooser)
    if config.online_distill and config.spec.uses_head:
        parts.distiller = distiller
        head_drafter(parts.drafter).distill = distiller
    elif config.distils_draft and (config.online_distill or config.draft_adapter):
        _adapt_draft(parts, pair, config, distiller)
    return parts


def _adapt_draft(parts: EngineParts, pair: ModelPair, config: MethodConfig, distiller) -> None:
    """The session's draft with a LoRA adapter (``online_distill_draft.py``): ``distiller`` where it adapts this
    pair's draft from the same adapter folder (its settings set to the config's), else a new one; the drafter records
    its rejections where it learns. Raises EngineError where the draft cannot take an adapter."""
    same = (isinstance(distiller, DraftDistiller) and distiller.base is pair.draft
            and distiller.source == config.draft_adapter)
    if not same:
        try:
            distiller = DraftDistiller.for_draft(pair.draft, pair.vocab_size, config.distill_lr, config.distill_every,
                                                 adapter=config.draft_adapter or None)
        except AdapterError as exc:
            raise EngineError(str(exc)) from None
    distiller.set_schedule(config.distill_lr, config.distill_every, config.distill_replay)
    parts.draft_model = distiller.model
    drafter = model_drafter(parts.drafter)
    drafter.adapter = distiller.describe()
    if config.online_distill:
        parts.distiller = distiller
        drafter.distill = distiller


def _distiller(head, config: MethodConfig, distiller: HeadDistiller | None) -> HeadDistiller:
    """The session's distiller of ``head`` at ``config``'s settings: ``distiller`` where it distils a head of the same
    shape, else a new one from a copy of ``head``; its learning rate, interval and replay window set to the
    config's."""
    if not isinstance(distiller, HeadDistiller) or distiller.head.config != head.config:
        distiller = HeadDistiller.for_head(head, config.distill_lr, config.distill_every)
    distiller.set_schedule(config.distill_lr, config.distill_every, config.distill_replay)
    return distiller


def _head(pair: ModelPair, config: MethodConfig):
    """``make_drafter``'s head for ``eagle`` (the loaded head, its target layers, what the trace records of it), else
    None. Raises EngineError where the head cannot be found or loaded, or does not fit the target."""
    if not config.spec.uses_head:
        return None
    try:
        head, folder = head_for(pair, config.head)
    except HeadError as exc:
        raise EngineError(f"the EAGLE-3 head: {exc}") from None
    n_layers = pair.target.config.num_hidden_layers
    return head, head.config.aux_layers(n_layers), describe(head, folder, n_layers)


def _follow(parts: EngineParts, trace: RunTrace) -> None:
    """Make ``parts`` take ``trace``'s timing-driven decisions whatever this machine measures: speculate or take a
    plain step as recorded (a fallback that only replays where the run has none), the measured cost ratio after
    each step, the free rows' prices (none where the recording priced none), the head's tree sizes and depths. Raises
    EngineError for malformed recorded prices."""
    if parts.fallback is None:
        parts.fallback = GoodputFallback(replay_only=True)
    parts.fallback.force([s.fallback.get("speculate", True) for s in trace.steps])
    if parts.cost_meter is not None:
        parts.cost_meter.force([s.cost.get("next") for s in trace.steps])
    sizer = parts.drafter.sizer
    if sizer is not None:  # the head's tree sizes, chosen from wall times
        sizes = [size for s in trace.steps if isinstance(size := s.drafter.get("head", {}).get("size"), dict)
                 and "tokens" in size]
        sizer.force([size["tokens"] for size in sizes], [size.get("levels") for size in sizes])
    try:
        parts.row_pricing = RowPricing.from_prices(trace.model.get("row_pricing"))
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"its row pricing is malformed: {exc!r}") from None


def _observers(parts: EngineParts, chooser: TreeChooser | None) -> list:
    """What learns from each verified step besides the drafter (notified first, ``Engine._notify``), in the order a
    step notifies them (``engine/observers.py``): the tree choice, the adaptation and the row prices, then the meters
    that read the step's times."""
    observers = []
    if chooser is not None:
        observers.append(TreeChoiceObserver(chooser))
    if parts.adapter is not None:
        observers.append(AdaptationObserver(parts))
    if parts.row_pricing is not None:
        observers.append(RowPricingObserver(parts))
    if parts.fallback is not None:
        observers.append(FallbackObserver(parts))
    if parts.cost_meter is not None:
        observers.append(CostRatioObserver(parts))
    return observers


def carried_from_trace(pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, trace: RunTrace) -> Carried:
    """What a recorded run started from (its trace's settings): Token Recycling's matrix, the carried stop-policy
    adaptation, ``layer-skip``'s exit chooser and the tree chooser, keyed for this pair, so a replay starts there."""
    initial = trace.settings.get("recycling_initial")
    state = {"k": initial["k"], "rows": initial["rows"]} if isinstance(initial, dict) else None
    exits, tree = trace.settings.get("layer_skip_carried"), trace.settings.get("tree_carried")
    key = carry_key(pair, config, sampling)
    return Carried(recycling=state, adapter=trace.settings.get("adaptation_carried"),
                   layer_skip={"key": key, "state": exits} if exits else None,
                   tree={"key": key, "state": tree} if tree else None)


def build_engine(pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, decision_model=None,
                 capture_features: bool = False, kv_cache: str = "dynamic", graphs: bool = False,
                 carried: Carried | None = None, count_syncs: bool = False, chain_levels: int = 0,
                 joint_prefill: bool = False, follow: RunTrace | None = None, lanes: str = "one",
                 lane_threads: int = 1, distiller: HeadDistiller | DraftDistiller | None = None) -> Engine:
    """An ``Engine`` for ``config`` on ``pair``, its parts built by ``build_parts``.

    Args:
        pair: the loaded models (shared, read-only; forwards hold ``pair.lock``).
        config: the method and its shape (``MethodConfig``).
        sampling: temperature / top-k / top-p / seed, applied to draft and target alike.
        decision_model: the learned model for the ``decision`` / ``prune`` / ``specdec++`` stop policies
            (``explorer.decision.DecisionModel``); None = the one shipped in assets/ for this pair.
        capture_features, kv_cache, graphs, count_syncs, chain_levels, joint_prefill, lanes, lane_threads: the step
            machine's options
            (``Engine``).
        carried: what an earlier run of the session learned (``Engine.carried()`` of that run's engine,
            ``engine/carried.py``): Token Recycling starts from its matrix; the goodput fallback's rates and the online
            adaptation are used where they come from the same method, sampling (seed aside), pair and device (and
            decision model), else ignored. The adaptation a run starts from is recorded in the trace
            (``adaptation_carried``) for replays. None starts afresh.
        follow: a recorded run to replay (``instruments/replay.py``): the parts start from what it started from
            (``carried_from_trace``, in place of ``carried``) and take its timing-driven decisions (``_follow``).
        distiller: with ``online_distill``, the session's ``online_distill.HeadDistiller`` or
            ``online_distill_draft.DraftDistiller`` (an earlier run's ``engine.parts.distiller``): the run drafts with
            its head or adapter and it learns when the run finishes; None starts one from the pair's head or draft.
    Raises:
        EngineError: as ``build_parts`` and ``Engine`` do (no decision model for a learned stop policy, an unknown
            ``kv_cache``, graphs without a static cache).
    """
    config, decision_model = resolve_decision(pair, config, decision_model)
    if config.spec.self_draft:  # the target drafts with its own first layers, whatever the pair's draft model
        if kv_cache != "dynamic":
            raise EngineError("layer-skip moves its exit layer between steps: it runs on the dynamic KV cache")
        try:
            pair = self_draft_pair(pair)
        except LayerSkipError as exc:
            raise EngineError(str(exc)) from None
    if follow is not None:
        carried = carried_from_trace(pair, config, sampling, follow)
    parts = build_parts(pair, config, sampling, decision_model, carried, follow, distiller)
    return Engine(pair, config, sampling, parts, capture_features=capture_features, kv_cache=kv_cache,
                  graphs=graphs, count_syncs=count_syncs, chain_levels=chain_levels, joint_prefill=joint_prefill,
                  lanes=lanes, lane_threads=lane_threads)


__all__ = ["TRANSFER_ADAPT", "build_engine", "build_parts", "can_fall_back", "carried_from_trace", "carry_key",
           "prices_rows", "resolve_decision", "times_verification"]
