"""The ``layer-skip`` drafter: a chain drafted by the target's own first layers, the exit chosen step by step.

The draft model of a ``layer-skip`` run is an ``EarlyExitDraft`` of the target (``models/early_exit.py``; the factory
swaps it into the pair). Before each step this drafter asks the ``ExitChooser`` for the exit layer: each candidate
exit's acceptance is measured on the steps it drafted, and the exit with the best expected speedup
``tokens(alpha, gamma) / (gamma c + 1)`` is taken, ``c`` being the exit's share of the target's layers (Leviathan et
al.'s formula, as DEL picks its exit layer from measured acceptance); an exit not tried for a while is tried again
(an exit that did not pay waits twice as long each time), and where no exit is expected to beat plain decoding the
step drafts nothing (a plain decoding step) until the next exit is due to be tried again; when the exit
moves deeper than the layers the draft's KV cache holds, those layers take the target's cached keys and values
(``kv_cache.copy_layers``: an early exit computes what the target computes there). Drafting itself is the model
drafter's chain (``ModelDrafter``); after verification the exit's acceptance is recorded. The step's trace holds the
exit and every candidate's measured acceptance (``StepTrace.drafter["layer_skip"]``).
"""

from __future__ import annotations

import math

from ..runtime.kv_cache import copy_layers
from ..speedup import chain_speedup
from .base import Drafted, empty_draft
from .model import ModelDrafter


def candidate_exits(n_layers: int) -> list[int]:
    """The exits the chooser weighs: 3/8, 1/2, 5/8 and 3/4 of the layers (distinct, within 1 .. layers - 1)."""
    return sorted({min(n_layers - 1, max(1, round(n_layers * f))) for f in (0.375, 0.5, 0.625, 0.75)})


class ExitChooser:
    """Picks the exit layer of each step from the acceptance each exit measured so far.

    For exit ``e``: ``alpha_e`` = accepted over drafted tokens of the steps it drafted (a prior of 1 accepted in 2
    drafted until it has data), ``c_e = e / layers`` (a draft forward's cost against the target's, by layers run),
    expected speedup ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c_e + 1))``. An exit not drafted in the last
    ``revisit`` steps is tried again (acceptance drifts with the text); one that did not pay waits twice as long
    after each try. Deterministic: the trace can be replayed.
    """

    def __init__(self, n_layers: int, gamma: int, revisit: int = 16):
        self.n_layers, self.gamma, self.revisit = n_layers, gamma, revisit
        self.candidates = candidate_exits(n_layers)
        self.reset()

    def reset(self) -> None:
        self.accepted = {e: 0 for e in self.candidates}
        self.drafted = {e: 0 for e in self.candidates}
        self.last_used = {e: -math.inf for e in self.candidates}
        self.wait = {e: self.revisit for e in self.candidates}  # steps before an unused exit is tried again
        self.steps = 0

    def alpha(self, e: int) -> float:
        return (self.accepted[e] + 1) / (self.drafted[e] + 2)

    def speedup(self, e: int) -> float:
        return chain_speedup(self.alpha(e), self.gamma, e / self.n_layers)

    def choose(self) -> int | None:
        """The exit for the next step: an untried or long-unused exit first (deepest first), else the best; None
        (a plain decoding step, no draft) when no exit is expected to beat plain decoding."""
        stale = [e for e in reversed(self.candidates) if self.steps - self.last_used[e] > self.wait[e]]
        if stale:
            return stale[0]
        best = max(self.candidates, key=self.speedup)
        return best if self.speedup(best) > 1.0 else None

    def plain_step(self) -> None:
        """A step that drafted nothing (``choose`` returned None): it counts towards revisiting every exit."""
        self.steps += 1

    def record(self, exit_layer: int, accepted: int, drafted: int) -> None:
        """What a step drafted at ``exit_layer`` measured. An exit that still does not pay waits twice as long
        before its next try (a try costs gamma draft forwards); one that pays is watched at the base interval."""
        self.accepted[exit_layer] += accepted
        self.drafted[exit_layer] += drafted
        self.last_used[exit_layer] = self.steps
        pays = self.speedup(exit_layer) > 1.0
        self.wait[exit_layer] = self.revisit if pays else 2 * self.wait[exit_layer]
        self.steps += 1

    def summary(self) -> dict:
        """Per candidate exit: its measured acceptance and expected speedup, as plain data for the trace."""
        return {str(e): {"alpha": round(self.alpha(e), 4), "drafted": self.drafted[e],
                         "speedup": round(self.speedup(e), 4)} for e in self.candidates}


class LayerSkipDrafter(ModelDrafter):
    """A chain of ``gamma`` tokens from the target's first ``exit`` layers, the exit chosen from measured
    acceptance (``ExitChooser``)."""

    name = "layer-skip"

    def __init__(self, gamma: int):
        super().__init__()
        self.gamma = gamma
        self.chooser: ExitChooser | None = None
        self._exit = 0

    def start(self, view) -> None:
        super().start(view)
        self.chooser = ExitChooser(view.draft_model.n_layers, self.gamma)

    def rewind(self) -> None:
        super().rewind()
        if self.chooser is not None:  # a rewound run is a fresh one: the same choices from the same start
            self.chooser.reset()

    def draft(self, view) -> Drafted:
        draft, kv = view.draft_model, view.draft_kv
        exit_layer = self.chooser.choose()
        self._exit = exit_layer
        if exit_layer is None:  # no exit pays: a plain decoding step (the draft cache is fed at the next draft)
            self.chooser.plain_step()
            drafted = empty_draft(view)
            drafted.info["layer_skip"] = {"exit_layer": None, "layers": draft.n_layers,
                                          "candidates": self.chooser.summary()}
            return drafted
        held = len(kv.hf.layers)  # every layer the draft cache holds is current (the others are dropped)
        if exit_layer > held:
            copy_layers(view.target_kv, kv, range(held, exit_layer))
        else:  # layers past the exit would miss this step's rows: drop them (copied back if needed again)
            del kv.hf.layers[exit_layer:]
        draft.set_exit(exit_layer)
        drafted = super().draft(view)
        drafted.info["layer_skip"] = {"exit_layer": exit_layer, "layers": draft.n_layers,
                                      "candidates": self.chooser.summary()}
        return drafted

    def learn(self, view, drafted: Drafted, verified) -> None:
        super().learn(view, drafted, verified)
        n = sum(1 for s in drafted.tree.source if s == "draft")
        if n and self._exit is not None:
            self.chooser.record(self._exit, len(verified.result.path), n)


__all__ = ["ExitChooser", "LayerSkipDrafter", "candidate_exits"]
