"""The hybrid drafter: the draft model's tree plus free branches (prompt lookup, then Token Recycling), verified
in one target pass. Lookup's branches win where the output copies the prompt, the model's where it does not, and
recycled ones where the target repeats its own habits; a free branch costs target rows, never a forward."""

from __future__ import annotations

from .base import Drafted, Drafter, merge_free


class HybridDrafter(Drafter):
    """Compose a model drafter with free drafters (each with ``free_nodes``); free nodes join the model's tree as
    a trie, the model's children first at every node (``base.merge_free``)."""

    name = "hybrid"

    def __init__(self, model: Drafter, free: list):
        self.model, self.free = model, list(free)
        self.uses_draft_model = model.uses_draft_model

    def draft(self, engine) -> Drafted:
        d = self.model.draft(engine)
        for f in self.free:
            d = merge_free(d, f.free_nodes(engine))
            d.info.update(f.info(engine))
        return d

    def learn(self, engine, drafted: Drafted, verified) -> None:
        for f in [self.model] + self.free:
            f.learn(engine, drafted, verified)

    def rewind(self) -> None:
        for f in [self.model] + self.free:
            f.rewind()

    def state_for_trace(self) -> dict:
        out: dict = {}
        for f in self.free:
            out.update(f.state_for_trace())
        return out
