"""What learns from a verified step: the observers a step notifies once, after it is committed and recorded.

Every part that learns as a run goes is a ``StepObserver`` (one method, ``observe(step)``), built by the factory;
a step notifies them in this order (the drafter, then ``EngineParts.observers``):

* the drafter itself (``Drafter.observe``: Token Recycling's matrix, prompt lookup's copy length, the decision
  features' memory of the target, ``layer-skip``'s exit chooser);
* the online tree choice (``TreeChoiceObserver``: acceptance by depth and root rank);
* the stop policy's online adaptation (``AdaptationObserver``);
* the price of free rows (``RowPricingObserver``);
* after the step's clock stops (``after_clock``), the meters that read its times: the goodput fallback
  (``FallbackObserver``) and the goodput policy's measured cost ratio (``CostRatioObserver``).

Observers before the clock stops are timed as a segment of the step (their ``phase``); what they add to the step's
record (``StepTrace.adaptation``, ``fallback``, ``cost``) they write there themselves. They read the parts they
feed from ``EngineParts`` when notified, so a part swapped in after ``build_parts`` is the one that learns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..trace.records import StepTrace
from .drafters.base import Drafted
from .parts import EngineParts
from .policies.tree_choice import TreeChooser
from .stop_models.features import model_inputs
from .verification import VerifiedStep
from .verify import expectation


@dataclass(frozen=True, kw_only=True)
class ObservedStep:
    """One step as its observers see it.

    Attributes:
        drafted: what drafting produced (``drafters.base.Drafted``).
        verified: what verification produced (``verification.VerifiedStep``).
        record: the step's ``StepTrace`` (times filled in for the observers after the clock).
        context: the committed token ids before the step (prompt first, the anchor last); read, never modify.
        committed: the tokens the step committed (the accepted path, the bonus token), cut at EOS and the budget.
        history: the run's committed token ids after the step (read, never modify).
        speculated: whether the step drafted (False: a plain decoding step the fallback chose).
        one_off: what made the step's time unlike its mode's (``"graph capture"``, ``"prefill"``), or None.
    """

    drafted: Drafted
    verified: VerifiedStep
    record: StepTrace
    context: list[int]
    committed: list[int]
    history: list[int]
    speculated: bool
    one_off: str | None = None


class StepObserver(Protocol):
    """Learns from each verified step. ``phase``: the timeline segment its work is timed in; ``after_clock``: it
    reads the step's times, so it is notified after the step's clock stops (and is not timed)."""

    phase: str
    after_clock: bool

    def observe(self, step: ObservedStep) -> None: ...


class TreeChoiceObserver:
    """Feeds the online tree choice (``policies/tree_choice.TreeChooser``) what a step measured: its root
    candidates and whether the draft was sure there, the first committed token, and the acceptance of each first
    child below depth 1."""

    phase, after_clock = "drafter learn", False

    def __init__(self, chooser: TreeChooser):
        self.chooser = chooser

    def observe(self, step: ObservedStep) -> None:
        d, v = step.drafted, step.verified
        tree, result = d.tree, v.result
        if d.roots is None or not len(tree):
            return
        candidates, sure = d.roots
        first = tree.token[result.path[0]] if result.path else result.bonus
        odds = v.odds or {}
        chain = [(tree.depth[i], odds[i].accept_prob) for i in range(len(tree))
                 if tree.depth[i] >= 2 and tree.source[i] == "draft" and i in odds
                 and tree.children(tree.parent[i])[0] == i]
        self.chooser.record(candidates, sure, first, chain, tree.n_levels)


class AdaptationObserver:
    """The stop policy's online adaptation (``stop_models/online.py``): labels the step's model-drafted tokens and
    lets the adapter learn; its record goes to ``StepTrace.adaptation``.

    The label of a token is its acceptance probability under this run's own verification (``accept_prob`` of
    ``verify/expectation.py``: 0 or 1 when greedy, ``min(1, p'/q')`` with the residuals of earlier-tested siblings
    when sampling), so the policy drifts towards what this run's verifier really accepts, not the temperature-1
    soft label it was trained on."""

    phase, after_clock = "stop-policy adaptation", False

    def __init__(self, parts: EngineParts):
        self.parts = parts

    def observe(self, step: ObservedStep) -> None:
        step.record.adaptation = self._update(step.drafted, step.verified)

    def _update(self, d: Drafted, v: VerifiedStep) -> dict:
        adapter, policy = self.parts.adapter, self.parts.stop_policy
        tree = d.tree
        nodes = [i for i in range(len(tree)) if tree.source[i] == "draft" and i in d.features and i in v.odds]
        if not nodes:
            return {"mode": adapter.mode, "tokens": 0, "threshold": float(policy.threshold)}
        host = torch.device("cpu")  # the adapter learns on the host, wherever the models run
        labels = torch.tensor([v.odds[i].accept_prob for i in nodes], dtype=torch.float32, device=host)
        if adapter.needs == "score":
            scores = [d.predicted[i] if i in d.predicted else d.q_show.get(i, 0.0) for i in nodes]
            return adapter.update(labels, scores=torch.tensor(scores, dtype=torch.float32, device=host))
        inputs = model_inputs(d.features, nodes, [tree.depth[i] for i in nodes], hidden=policy.needs_hidden)
        tested = expectation.tested_probs(tree, v.odds)  # the refit weighs a token by the chance its test happened
        weights = torch.tensor([tested.get(i, 0.0) for i in nodes], dtype=torch.float32, device=host)
        return adapter.update(labels, inputs=inputs, weights=weights)


class RowPricingObserver:
    """The price of free rows (``drafters/row_pricing.py``) learns which of its slots the committed tokens took."""

    phase, after_clock = "drafter learn", False

    def __init__(self, parts: EngineParts):
        self.parts = parts

    def observe(self, step: ObservedStep) -> None:
        if self.parts.row_pricing is not None:
            self.parts.row_pricing.observe(step.history)


class FallbackObserver:
    """The goodput fallback (``policies/fallback.py``) learns the step's tokens per wall millisecond by its mode;
    its record goes to ``StepTrace.fallback``. A step that captured graphs or read the prompt says nothing of its
    mode (``one_off``)."""

    phase, after_clock = "fallback", True

    def __init__(self, parts: EngineParts):
        self.parts = parts

    def observe(self, step: ObservedStep) -> None:
        ms = sum(s["ms"] for s in step.record.timeline)
        step.record.fallback = self.parts.fallback.observe(step.speculated, len(step.committed), ms,
                                                           one_off=step.one_off)


class CostRatioObserver:
    """The goodput stop policy's measured cost ratio r (``policies/cost_ratio.py``): the step's times move it and
    the policy's threshold follows (``StopPolicy.set_threshold``); its record goes to ``StepTrace.cost``. A joint
    prefill's step is not measured (the prompt's rows are in its forward)."""

    phase, after_clock = "cost ratio", True

    def __init__(self, parts: EngineParts):
        self.parts = parts

    def observe(self, step: ObservedStep) -> None:
        record = step.record
        if step.verified.prefill_rows:
            self.parts.cost_meter.skip()
            return
        record.cost = self.parts.cost_meter.observe(record.draft_ms, record.draft_calls, record.step_ms,
                                                    len(step.drafted.tree))
        self.parts.stop_policy.set_threshold(record.cost["next"])
        if record.adaptation:  # its record names the threshold in force next
            record.adaptation["threshold"] = record.cost["next"]
