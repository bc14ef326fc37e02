"""Policies a run follows between steps: when drafting stops (``stopping``: confidence, the learned decision
models, SpecDec++, goodput), when a step decodes plainly instead (``fallback``: the goodput fallback) and the draft
over target cost ratio the goodput rule uses (``cost_ratio``)."""
