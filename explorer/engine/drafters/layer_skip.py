"""The ``layer-skip`` drafter: a chain drafted by the target's own first layers, the exit chosen step by step.

The draft model of a ``layer-skip`` run is an ``EarlyExitDraft`` of the target (``models/early_exit.py``; the factory
swaps it into the pair). Before each step this drafter asks the ``ExitChooser`` for the exit layer: each candidate
exit's acceptance is measured on the steps it drafted (an untried exit is expected to accept nothing), and the exit
with the best expected speedup ``tokens(alpha, gamma) / (gamma c + 1)`` is taken, ``c`` being the exit's share of
the target's layers (Leviathan et al.'s formula, as DEL picks its exit layer from measured acceptance); where no exit
is expected to beat plain decoding the step drafts nothing (a plain decoding step). Exits are tried to be measured,
within a budget of target forwards while none pays, and what they measured carries over to the session's next run
(``Carried.layer_skip``), so a target whose exits cannot pay runs within about 1 % of plain decoding; when the exit
moves deeper than the layers the draft's KV cache holds, those layers take the target's cached keys and values
(``kv_cache.copy_layers``: an early exit computes what the target computes there), and so do all the exit's layers
when plain steps left the draft cache more than a few tokens behind. Drafting itself is the model
drafter's chain (``ModelDrafter``); after verification the exit's acceptance is recorded. The step's trace holds the
exit and every candidate's measured acceptance (``StepTrace.drafter["layer_skip"]``).
"""

from __future__ import annotations

from ..carried import Carried
from ..speedup import chain_speedup
from .base import Drafted, empty_draft
from .model import ModelDrafter


def candidate_exits(n_layers: int) -> list[int]:
    """The exits the chooser weighs: 3/8, 1/2, 5/8 and 3/4 of the layers (distinct, within 1 .. layers - 1)."""
    return sorted({min(n_layers - 1, max(1, round(n_layers * f))) for f in (0.375, 0.5, 0.625, 0.75)})


CATCH_UP_ROWS = 4  # committed tokens the draft cache may lag behind before it is copied from the target's
PRIOR_DRAFTED = 1  # pseudo-tokens drafted, none accepted: an exit expects nothing until it has measured
EXPLORE_SHARE = 0.01  # target forwards per step that trying exits may cost while none is expected to pay
EXPLORE_START = 4.0  # target forwards of trying allowed before the first step: one try of the deepest exit


class ExitChooser:
    """Picks the exit layer of each step from the acceptance each exit measured so far.

    For exit ``e``: ``alpha_e`` = accepted over drafted tokens of the steps it drafted, with a prior of one token
    drafted and none accepted (an untrained exit is expected to accept nothing, so plain decoding is the default),
    ``c_e = e / layers`` (a draft forward's cost against the target's, by layers run), expected speedup
    ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c_e + 1))``; the best exit drafts when that beats 1.

    Exits are tried to measure them: an untried exit, or one not drafted in its last ``wait`` steps (``revisit``,
    doubled after each try that did not pay), is due, deepest first; a shallower exit is skipped while a deeper one
    (which accepts at least as much) cannot accept enough to pay the shallower's cost even optimistically
    (``(accepted + 1) / (drafted + 1)``). While no exit pays, a try is a loss against plain decoding: tries then
    spend a budget of ``explore_start`` target forwards plus ``explore_share`` per step (a try at exit ``e`` costs
    ``gamma c_e``), so a target whose exits cannot pay runs within about ``explore_share`` of plain decoding. The
    state carries across the runs of a session (``state``/``restore``). Deterministic: the trace can be replayed.
    """

    def __init__(self, n_layers: int, gamma: int, revisit: int = 16, explore_share: float | None = None,
                 explore_start: float | None = None):
        self.n_layers, self.gamma, self.revisit = n_layers, gamma, revisit
        self.explore_share = EXPLORE_SHARE if explore_share is None else explore_share
        self.explore_start = EXPLORE_START if explore_start is None else explore_start
        self.candidates = candidate_exits(n_layers)
        self.reset()

    def reset(self) -> None:
        self.accepted = {e: 0 for e in self.candidates}
        self.drafted = {e: 0 for e in self.candidates}
        self.last_used: dict[int, int | None] = {e: None for e in self.candidates}
        self.wait = {e: self.revisit for e in self.candidates}  # steps before an unused exit is tried again
        self.steps = 0
        self.spent = 0.0  # target forwards spent on tries while no exit paid

    def alpha(self, e: int) -> float:
        return self.accepted[e] / (self.drafted[e] + PRIOR_DRAFTED)

    def speedup(self, e: int) -> float:
        return chain_speedup(self.alpha(e), self.gamma, e / self.n_layers)

    def _could_pay(self, e: int) -> bool:
        """Whether every deeper exit measured so far could still accept enough (optimistically) to pay ``e``."""
        bounds = [(self.accepted[d] + 1) / (self.drafted[d] + 1) for d in self.candidates
                  if d > e and self.drafted[d]]
        return not bounds or chain_speedup(min(1.0, min(bounds)), self.gamma, e / self.n_layers) > 1.0

    def _due(self, e: int) -> bool:
        return self.last_used[e] is None or self.steps - self.last_used[e] > self.wait[e]

    def choose(self) -> int | None:
        """The exit for the next step: a due exit first (deepest first; out of the try budget while no exit pays),
        else the best; None (a plain decoding step, no draft) when no exit is expected to beat plain decoding."""
        best = max(self.candidates, key=self.speedup)
        paying = self.speedup(best) > 1.0
        budget = self.explore_start + self.explore_share * self.steps - self.spent
        for e in reversed(self.candidates):
            if not (self._due(e) and self._could_pay(e)):
                continue
            if paying:
                return e
            cost = self.gamma * e / self.n_layers
            if cost <= budget:
                self.spent += cost
                return e
        return best if paying else None

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

    def state(self) -> dict:
        """What the chooser measured, as plain data for the session's next run (``restore``) and the trace."""
        return {"layers": self.n_layers, "gamma": self.gamma, "steps": self.steps, "spent": round(self.spent, 6),
                "exits": {str(e): {"accepted": self.accepted[e], "drafted": self.drafted[e],
                                   "last_used": self.last_used[e], "wait": self.wait[e]} for e in self.candidates}}

    def restore(self, state: dict) -> bool:
        """Continue from an earlier run's ``state``: True, or False (nothing changed) where it belongs to another
        depth or chain length or is malformed."""
        try:
            if state["layers"] != self.n_layers or state["gamma"] != self.gamma:
                return False
            exits = {int(e): v for e, v in state["exits"].items()}
            if sorted(exits) != self.candidates:
                return False
            for e, v in exits.items():
                self.accepted[e], self.drafted[e] = int(v["accepted"]), int(v["drafted"])
                self.last_used[e] = None if v["last_used"] is None else int(v["last_used"])
                self.wait[e] = int(v["wait"])
            self.steps, self.spent = int(state["steps"]), float(state["spent"])
        except (KeyError, TypeError, ValueError, AttributeError):
            self.reset()
            return False
        return True

    def summary(self) -> dict:
        """Per candidate exit: its measured acceptance and expected speedup, as plain data for the trace."""
        return {str(e): {"alpha": round(self.alpha(e), 4), "drafted": self.drafted[e],
                         "speedup": round(self.speedup(e), 4)} for e in self.candidates}


class LayerSkipDrafter(ModelDrafter):
    """A chain of ``gamma`` tokens from the target's first ``exit`` layers, the exit chosen from measured
    acceptance (``ExitChooser``), starting from ``carried`` (an earlier run's chooser state) where given."""

    name = "layer-skip"

    def __init__(self, gamma: int, carried: dict | None = None):
        super().__init__()
        self.gamma = gamma
        self.carried_state = carried  # an earlier run's ``ExitChooser.state``, or None to start afresh
        self.chooser: ExitChooser | None = None
        self._exit = 0

    def start(self, view) -> None:
        super().start(view)
        self.chooser = ExitChooser(view.draft.model.n_layers, self.gamma)
        if self.carried_state is not None and not self.chooser.restore(self.carried_state):
            self.carried_state = None  # another target or chain length: this run starts afresh, and its trace says so

    def rewind(self) -> None:
        super().rewind()
        if self.chooser is not None:  # a rewound run is a fresh one: the same choices from the same start
            self.chooser.reset()
            if self.carried_state is not None:
                self.chooser.restore(self.carried_state)

    def carried(self, key: str) -> Carried:
        """What the exit chooser measured so far (``ExitChooser.state``), for the session's next run."""
        return Carried() if self.chooser is None else Carried(layer_skip={"key": key, "state": self.chooser.state()})

    def state_for_trace(self) -> dict:
        """The chooser's state the run started from, so a replay makes the same choices."""
        return {"layer_skip_carried": self.carried_state} if self.carried_state is not None else {}

    def draft(self, view) -> Drafted:
        draft, kv = view.draft.model, view.draft.cache
        exit_layer = self.chooser.choose()
        self._exit = exit_layer
        if exit_layer is None:  # no exit pays: a plain decoding step (the draft cache is fed at the next draft)
            self.chooser.plain_step()
            drafted = empty_draft(len(view.committed))
            drafted.info["layer_skip"] = {"exit_layer": None, "layers": draft.n_layers,
                                          "candidates": self.chooser.summary()}
            return drafted
        held = len(kv.hf.layers)  # every layer the draft cache holds is current (the others are dropped)
        if view.draft.target_cached() - kv.length > CATCH_UP_ROWS:
            # plain steps left the draft cache behind: the target's cache holds what the exit's layers would compute
            # for the tokens missed, so copy it instead of feeding them through those layers
            del kv.hf.layers[exit_layer:]
            # the last committed token stays out: the draft's first forward of the step reads its row
            kv.length = min(view.draft.target_cached(), len(view.committed) - 1)
            view.draft.copy_from_target(range(0, exit_layer))
        elif exit_layer > held:
            view.draft.copy_from_target(range(held, exit_layer))
        else:  # layers past the exit would miss this step's rows: drop them (copied back if needed again)
            del kv.hf.layers[exit_layer:]
        draft.set_exit(exit_layer)
        drafted = super().draft(view)
        drafted.info["layer_skip"] = {"exit_layer": exit_layer, "layers": draft.n_layers,
                                      "candidates": self.chooser.summary()}
        return drafted

    def observe(self, step) -> None:
        super().observe(step)
        n = sum(1 for s in step.drafted.tree.source if s == "draft")
        if n and self._exit is not None:
            self.chooser.record(self._exit, len(step.verified.result.path), n)


__all__ = ["ExitChooser", "LayerSkipDrafter", "candidate_exits"]
