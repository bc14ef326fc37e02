"""Re-running a recorded run on the models, step by step, to look inside a step the trace only summarises (the
probe needs the tree forward's logits, which a trace does not keep).

The engine is deterministic for a given pair, device, dtype, settings and seed, so running the trace's settings
again retraces its steps; every replayed step is checked against the recorded one and a divergence is an error
that says where.
"""

from __future__ import annotations

from ..engine.config import MethodConfig
from ..engine.factory import build_engine
from ..engine.machine import EngineError
from ..engine.methods import METHOD_SPECS
from ..engine.policies.stopping import STOP_POLICY_NAMES
from ..engine.verify.registry import VERIFIER_REGISTRY
from ..engine.sampling import SamplingConfig
from ..models.early_exit import LayerSkipError, self_draft_pair
from ..plugins.loading import ENV
from ..trace.records import RunTrace


class ReplayError(ValueError):
    """The trace cannot be replayed on these models, or the replay left the recorded run."""


def engine_for_trace(pair, trace: RunTrace, decision_model=None):
    """A started ``Engine`` with the trace's method, sampling and length, its parts built from the trace
    (``factory.build_engine(..., follow=trace)``: the starting Token Recycling matrix, the carried adaptation and
    choosers, and the recorded timing-driven decisions: the fallback's, the cost ratio, row prices, tree costs).

    Raises ReplayError when the trace was recorded on another model pair, dtype, draft quantization or version of
    its EAGLE-3 head, or its settings do not parse.
    """
    config, sampling, max_new = _settings(trace)
    if config.spec.self_draft:  # recorded with the target drafting for itself: compare with the same pair
        try:
            pair = self_draft_pair(pair)
        except LayerSkipError as exc:
            raise ReplayError(f"the trace cannot be replayed: {exc}") from None
    _check_models(pair, trace, ("draft", "target"))
    recorded = {k: str(trace.model[k]).removeprefix("torch.") for k in ("dtype", "draft_quant") if k in trace.model}
    loaded = {"dtype": str(pair.dtype).removeprefix("torch."), "draft_quant": pair.draft_quant}
    differ = [f"{k} {recorded[k]} (loaded: {loaded[k]})" for k in recorded if recorded[k] != loaded[k]]
    if differ:  # the replay would round or draft otherwise and leave the recorded run
        raise ReplayError(f"the trace was recorded with {', '.join(differ)}: load the pair that way to replay it")
    try:  # the recorded run's starting state and timing-driven decisions come through the factory
        engine = build_engine(pair, config, sampling, decision_model=decision_model, follow=trace,
                              joint_prefill=bool(trace.settings.get("joint_prefill")))  # its first tree as drafted
    except EngineError as exc:
        raise ReplayError(f"the trace cannot be replayed: {exc}") from None
    _check_head(trace, engine.parts.drafter.state_for_trace().get("head") or {})
    engine.start(list(trace.prompt_ids), max_new, prompt_text=trace.prompt)
    return engine


def _check_models(pair, trace: RunTrace, roles: tuple[str, ...]) -> None:
    """Raises ReplayError where the trace names another model than ``pair`` holds for one of ``roles`` (``draft``,
    ``target``; a trace that names none is taken as it is)."""
    differ = [r for r in roles if trace.model.get(f"{r}_id") not in (None, getattr(pair, f"{r}_id"))]
    if differ:
        raise ReplayError("the trace was recorded with " + ", ".join(
            f"the {r} {trace.model.get(f'{r}_id')} (loaded: {getattr(pair, f'{r}_id')})" for r in differ))


def _check_head(trace: RunTrace, loaded: dict) -> None:
    """Raises ReplayError where the trace's head (its weights' sha256; older traces record none) is not ``loaded``,
    what the engine built for the replay records of its head, or had learned online: the drafts would differ from
    the first step on."""
    recorded = (trace.settings.get("head") or {}).get("weights_sha256")
    taught = (trace.settings.get("head") or {}).get("learned")
    if taught:  # a lesson's head, learnt on a stream of prompts and not kept (lessons/record._mark_learned)
        raise ReplayError(f"the run was drafted by a head that learned online on {taught.get('requests')} "
                          f"{taught.get('kind')} prompts, which is not kept: a live run goes on with the head it "
                          "started from")
    learned = ((trace.settings.get("head") or {}).get("distilled") or {}).get("version", 0)
    if learned:  # the weights that drafted it were learned in a session, not the folder's
        raise ReplayError(f"the trace was drafted by a head that had learned online for {learned} updates "
                          "(online distillation): save that head (generate --save-distilled DIR) and replay with "
                          "--head DIR")
    adapted = (trace.settings.get("draft_adapter") or {}).get("version", 0)
    if adapted:  # likewise a draft's LoRA adapter (online_distill_draft.py)
        raise ReplayError(f"the trace was drafted by a draft whose LoRA adapter had learned online for {adapted} "
                          "updates (online distillation): save that adapter (generate --save-distilled DIR) and "
                          "replay with --draft-adapter DIR")
    if recorded and loaded.get("weights_sha256") != recorded:
        raise ReplayError(f"the trace was drafted by another version of the EAGLE-3 head (weights sha256 {recorded}; "
                          f"{loaded.get('path')} holds {loaded.get('weights_sha256')}): replay it with that head "
                          "(--head DIR, the app's head folder)")


def missing_plugin(trace: RunTrace) -> str | None:
    """Which plugin the trace's run used that is not loaded here (a message that names it, where it was loaded from
    and how to load it), or None. A saved trace replays in the figures without its plugins; a live run needs them."""
    for p in trace.settings.get("plugins") or []:
        if not isinstance(p, dict):
            continue
        roles = (("method", METHOD_SPECS), ("verifier", VERIFIER_REGISTRY), ("stop", STOP_POLICY_NAMES))
        absent = [f"the {role} {p[role]!r}" for role, known in roles
                  if isinstance(p.get(role), str) and p[role] not in known]
        if absent:
            where = p.get("loaded_from") or p.get("name")
            return (f"this run used the plugin {p.get('name')} ({', '.join(absent)}), which is not loaded here: "
                    f"start the app with {ENV}={where}, or pass --plugin {where} on the command line, to go on live")
    return None


def _settings(trace: RunTrace) -> tuple[MethodConfig, SamplingConfig, int]:
    """The trace's method, sampling and new-token budget. Raises ReplayError where they do not parse, or where a
    plugin the run used is not loaded (``missing_plugin``)."""
    missing = missing_plugin(trace)
    if missing:
        raise ReplayError(missing)
    try:
        config = MethodConfig(**trace.settings["method"])
        sampling = SamplingConfig(**trace.settings["sampling"])
        max_new = int(trace.settings.get("max_new_tokens", sum(len(s.committed_ids) for s in trace.steps)))
    except (TypeError, ValueError, KeyError) as exc:
        raise ReplayError(f"the trace's settings cannot be replayed: {exc}") from None
    return config, sampling, max_new


def engine_after_text(pair, trace: RunTrace, last: int, decision_model=None):
    """A started ``Engine`` with the trace's method and sampling whose context is the trace's prompt followed by
    every token the recording committed through step ``last`` (0-based), with the rest of its new-token budget:
    where the recorded steps cannot be replayed (another device or draft quantization rounds differently), a run
    can still go on live from the recorded text. Its own trace starts there (that text is its prompt).

    Raises ReplayError when ``last`` is not a recorded step, the trace's settings do not parse, or the engine cannot
    be built on ``pair`` (e.g. another tokenizer's ids)."""
    check_step(trace, last)
    _check_models(pair, trace, ("target",))  # the draft only proposes: another one goes on from the same text
    config, sampling, max_new = _settings(trace)
    committed = [t for s in trace.steps[:last + 1] for t in s.committed_ids]
    text = "".join(t for s in trace.steps[:last + 1] for t in s.committed_text)
    try:
        engine = build_engine(pair, config, sampling, decision_model=decision_model)
        engine.start(list(trace.prompt_ids) + committed, max(1, max_new - len(committed)),
                     prompt_text=trace.prompt + text)
    except EngineError as exc:
        raise ReplayError(f"the run cannot go on from the recorded text: {exc}") from None
    return engine


def check_step(trace: RunTrace, index: int) -> None:
    """Raises ReplayError unless ``index`` (0-based) is a recorded step of ``trace``."""
    if not 0 <= index < len(trace.steps):
        raise ReplayError(f"step {index + 1} is not in the trace (it has {len(trace.steps)} steps)")


def replay_steps(pair, trace: RunTrace, last: int, decision_model=None):
    """Yield ``(index, engine)`` after each replayed step ``0..last``; the engine's ``last_step`` is that step's.

    Raises ReplayError when ``last`` is not a recorded step or a replayed step commits other tokens than the
    recorded one (another device, CPU model, dtype or decision model than the recording's).
    """
    check_step(trace, last)
    engine = engine_for_trace(pair, trace, decision_model)
    for i in range(last + 1):
        step = engine.step()
        if step.committed_ids != trace.steps[i].committed_ids:
            raise ReplayError(f"the replay left the recorded run at step {i + 1} (it committed other tokens): the "
                              "trace was recorded on another device, CPU model (other kernels round otherwise), "
                              "dtype or decision model")
        yield i, engine
