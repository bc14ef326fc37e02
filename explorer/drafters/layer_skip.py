"""The ``layer-skip`` drafter: a chain drafted by the target's own first layers, the exit chosen step by step.

The draft model of a ``layer-skip`` run is an ``EarlyExitDraft`` of the target (``layer_skip.py``; the factory
swaps it into the pair). Before each step this drafter asks the ``ExitChooser`` for the exit layer; when the exit
moves deeper than the layers the draft's KV cache holds, those layers take the target's cached keys and values
(``kv_cache.copy_layers``: an early exit computes what the target computes there). Drafting itself is the model
drafter's chain (``ModelDrafter``); after verification the exit's acceptance is recorded. The step's trace holds the
exit and every candidate's measured acceptance (``StepTrace.drafter["layer_skip"]``).
"""

from __future__ import annotations

from ..kv_cache import copy_layers
from ..layer_skip import ExitChooser
from .base import Drafted, empty_draft
from .model import ModelDrafter


class LayerSkipDrafter(ModelDrafter):
    """A chain of ``gamma`` tokens from the target's first ``exit`` layers, the exit chosen from measured
    acceptance (``layer_skip.ExitChooser``)."""

    name = "layer-skip"

    def __init__(self, gamma: int):
        super().__init__()
        self.gamma = gamma
        self.chooser: ExitChooser | None = None
        self._exit = 0

    def start(self, engine) -> None:
        super().start(engine)
        self.chooser = ExitChooser(engine.pair.draft.n_layers, self.gamma)

    def rewind(self) -> None:
        super().rewind()
        if self.chooser is not None:  # a rewound run is a fresh one: the same choices from the same start
            self.chooser.reset()

    def draft(self, engine) -> Drafted:
        draft, kv = engine.pair.draft, engine.draft_kv
        exit_layer = self.chooser.choose()
        self._exit = exit_layer
        if exit_layer is None:  # no exit pays: a plain decoding step (the draft cache is fed at the next draft)
            self.chooser.plain_step()
            drafted = empty_draft(engine)
            drafted.info["layer_skip"] = {"exit_layer": None, "layers": draft.n_layers,
                                          "candidates": self.chooser.summary()}
            return drafted
        held = len(kv.hf.layers)  # every layer the draft cache holds is current (the others are dropped)
        if exit_layer > held:
            copy_layers(engine.target_kv, kv, range(held, exit_layer))
        else:  # layers past the exit would miss this step's rows: drop them (copied back if needed again)
            del kv.hf.layers[exit_layer:]
        draft.set_exit(exit_layer)
        drafted = super().draft(engine)
        drafted.info["layer_skip"] = {"exit_layer": exit_layer, "layers": draft.n_layers,
                                      "candidates": self.chooser.summary()}
        return drafted

    def learn(self, engine, drafted: Drafted, verified) -> None:
        super().learn(engine, drafted, verified)
        n = sum(1 for s in drafted.tree.source if s == "draft")
        if n and self._exit is not None:
            self.chooser.record(self._exit, len(verified.result.path), n)


__all__ = ["LayerSkipDrafter"]
