"""The hybrid drafter: the draft model's tree (or an EAGLE-3 head's, ``eagle-hybrid``) plus free branches (prompt
lookup, then Token Recycling), verified in one target pass. Lookup's branches win where the output copies the prompt,
the model's where it does not, and recycled ones where the target repeats its own habits; a free branch costs
target rows, never a forward.

When lookup finds a match, the step proposes lookup's branches alone; the draft model drafts (with the recycled branches
beside its tree) where lookup has nothing to copy. Measured on the embedded pair, CPU, greedy, 3 prompts x 128 tokens
(docs/bench.md, "The hybrid: lookup alone wherever it has a match"): a matched step's model forwards cost more than the
tokens they add, even for one-token matches. Against an earlier rule that trusted lookup only on a run (the last step
committed at least 4 tokens of its best branch, or a match of the longest n-gram): HumanEval 0-2 31.6 against 25.2
tok/s, MT-bench 0-2 7.5 against 7.6. The draft model catches up on the skipped tokens in its next forward.

With an EAGLE-3 head (``eagle-hybrid``) a match must be of two tokens or more (``MethodConfig.lookup_alone``): a
one-token match's copies were rarely accepted (72 % of such steps committed at most one token; kinds set, greedy)
and cost target rows the head's small tree does not, so there the head drafts (docs/heads.md, "The head with prompt
lookup"). The draft model's ``hybrid`` keeps every match: a two-token line gave it 1.93x ``ar`` against 1.76x on
the kinds set and 1.67x against 1.49x on MT-bench 0-2, but 5.07x against 5.86x on HumanEval 0-2 (one greedy run
each, 64 and 128 tokens, AMD EPYC, 2026-11-29).
The choice is a function of the context, so the output law is unchanged: lossless.

Where a verification row costs time (a CPU without fast bf16 rows: ``forward_costs.row_prices``), the recycled
branches beside the model's tree are priced like Token Recycling's own tree (``row_pricing.py``): only the slots
whose measured acceptance pays for their rows join it. Lookup's copies are not priced (see ``factory.prices_rows``)."""

from __future__ import annotations

from ..carried import Carried
from .base import Drafted, Drafter, empty_draft, merge_free


class HybridDrafter(Drafter):
    """Compose a model drafter with free drafters (each with ``free_nodes``); free nodes join the model's tree as
    a trie, the model's children first at every node (``base.merge_free``). ``lookup_alone``
    (``MethodConfig.lookup_alone``): the shortest n-gram match on which lookup's copies go alone; a shorter best
    match is dropped and the model drafts."""

    name = "hybrid"

    def __init__(self, model: Drafter, free: list, lookup_alone: int = 1):
        self.model, self.free, self.lookup_alone = model, list(free), lookup_alone
        self.uses_draft_model = model.uses_draft_model
        self.target_layers = model.target_layers  # an EAGLE head reads the target's states (``eagle-hybrid``)

    @property
    def sizer(self):
        """The head's online tree sizer (``eagle-hybrid``; a replay forces its recorded sizes), else None."""
        return self.model.sizer

    def prompt_rows(self, view) -> int:
        return max(f.prompt_rows(view) for f in [self.model] + self.free)

    def start(self, view) -> None:
        for f in [self.model] + self.free:
            f.start(view)

    def remember_prompt(self, prompt: list[int], top: list | None) -> None:
        for f in [self.model] + self.free:
            f.remember_prompt(prompt, top)

    def draft(self, view) -> Drafted:
        lookup = next((f for f in self.free if f.name == "lookup"), None)
        free, dropped = [], 0
        if lookup is not None:
            nodes = lookup.free_nodes(view)
            if lookup.proposed and lookup.best_ngram < self.lookup_alone:  # too short to trust: the model drafts
                dropped = lookup.best_ngram
                lookup.withdraw()
            else:
                free.append((lookup, nodes, None))  # lookup's copies: never priced
        trusted = lookup is not None and bool(lookup.proposed)  # a match: lookup alone
        if not trusted:
            free += [(f, *f.priced_free_nodes(view)) for f in self.free if f is not lookup]
        d = empty_draft(len(view.committed)) if trusted else self.model.draft(view)
        d.info["lookup_trusted"] = trusted
        if dropped:
            d.info["lookup_dropped_ngram"] = dropped
        for f, nodes, priced in free:
            d = merge_free(d, nodes, f.row_budget(view), **view.reach._asdict())
            d.info.update(f.info(view))
            if priced is not None:
                d.info["row_pricing"] = priced
        return d

    def observe(self, step) -> None:
        for f in [self.model] + self.free:
            f.observe(step)

    def rewind(self) -> None:
        for f in [self.model] + self.free:
            f.rewind()

    def carried(self, key: str) -> Carried:
        out = Carried()
        for f in [self.model] + self.free:
            out = out.updated(f.carried(key))
        return out

    def state_for_trace(self) -> dict:
        out: dict = dict(self.model.state_for_trace())  # the head it drafts with, the tree chooser's start
        for f in self.free:
            out.update(f.state_for_trace())
        return out
