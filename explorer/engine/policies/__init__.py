"""Policies a run follows between steps: when drafting stops (``stopping``: confidence, the learned decision
models, per-branch pruning, SpecDec++, goodput; what-if replays of a step's stop decisions), when a step decodes
plainly instead (``fallback``: the goodput fallback) and the draft over target cost ratio the goodput rule uses
(``cost_ratio``: measured from the run's own steps)."""
