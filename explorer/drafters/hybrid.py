"""The hybrid drafter: the draft model's tree plus free branches (prompt lookup, then Token Recycling), verified
in one target pass. Lookup's branches win where the output copies the prompt, the model's where it does not, and
recycled ones where the target repeats its own habits; a free branch costs target rows, never a forward.

While lookup is on a run (the last step committed at least ``TRUST_LOOKUP`` tokens of its best branch) and has a
branch again, or when its best branch continues a match of the longest n-gram it looks for, the step proposes
lookup's branches alone: the draft model's forwards and the other free branches' target rows would cost more than
the tokens they add. The draft model catches up on the skipped tokens in its next forward (its chain). The choice is
a function of past outcomes, so the output law is unchanged: lossless."""

from __future__ import annotations

from .base import Drafted, Drafter, empty_draft, merge_free

TRUST_LOOKUP = 4
"""Tokens of lookup's best branch the last step must have committed for the next step to skip the draft model."""


class HybridDrafter(Drafter):
    """Compose a model drafter with free drafters (each with ``free_nodes``); free nodes join the model's tree as
    a trie, the model's children first at every node (``base.merge_free``)."""

    name = "hybrid"

    def __init__(self, model: Drafter, free: list):
        self.model, self.free = model, list(free)
        self.uses_draft_model = model.uses_draft_model

    def start(self, engine) -> None:
        for f in [self.model] + self.free:
            f.start(engine)

    def draft(self, engine) -> Drafted:
        lookup = next((f for f in self.free if f.name == "lookup"), None)
        free = [(f, f.free_nodes(engine)) for f in self.free if f is lookup]
        trusted = lookup is not None and bool(lookup.proposed) and (lookup.last_hit >= TRUST_LOOKUP
                                                                    or lookup.best_ngram >= lookup.max_ngram)
        if not trusted:
            free += [(f, f.free_nodes(engine)) for f in self.free if f is not lookup]
        d = empty_draft(engine) if trusted else self.model.draft(engine)
        d.info["lookup_trusted"] = trusted
        for f, nodes in free:
            d = merge_free(d, nodes, f.row_budget(engine) if trusted else engine.free_rows)
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
