"""What a run learned that the session's next run may start from: one typed record of plain data.

Five parts of a run learn as they go and are worth keeping between the runs of one session (the app's runs, the
bench's prompts of one method and temperature): Token Recycling's adjacency matrix
(``engine/drafters/recycling.py``), the goodput fallback's measured rates (``engine/policies/fallback.py``), the
stop policy's online adaptation (``engine/stop_models/online.py``), ``layer-skip``'s exit chooser
(``engine/drafters/layer_skip.py``) and the online tree choice (``engine/policies/tree_choice.py``).
``Engine.carried()`` gives them as one ``Carried``; ``factory.build_engine(..., carried=...)`` starts a run from it.
The fallback's rates, the adaptation and the two choosers carry a ``key`` (method, sampling less the seed, pair,
device and, for the adaptation, the decision model): a run whose key differs starts afresh, so handing a session's
record to any run is always safe.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Carried:
    """The learned state one run hands to the next. All plain data (JSON-able), None where nothing was learned.

    Attributes:
        recycling: Token Recycling's matrix, ``{"k": int, "rows": {token id (str): [candidate ids, best first]}}``
            (``RecyclingDrafter.state``).
        fallback: the goodput fallback's rates, ``{"key": str, "rates": {"spec": {"tokens", "ms"} or None, "ar":
            ...}}``: moving averages of committed tokens and wall milliseconds per speculative and per plain step
            (``GoodputFallback.state``).
        adapter: the online adaptation, ``{"key": str, ...}`` (``OnlineAdapter.state``: the refitted threshold or
            last layer and the labels it learned from).
        layer_skip: ``layer-skip``'s exit chooser, ``{"key": str, "state": ExitChooser.state()}``: each exit's
            measured acceptance, its try schedule and the try budget spent.
        tree: the online tree choice, ``{"key": str, "state": TreeChooser.state()}``: acceptance by depth and root
            rank, the share of sure roots and the mean levels drafted.
    """

    recycling: dict | None = None
    fallback: dict | None = None
    adapter: dict | None = None
    layer_skip: dict | None = None
    tree: dict | None = None

    def updated(self, newer: Carried) -> Carried:
        """This record with ``newer``'s parts where ``newer`` has them: a run that learned nothing of a kind (another
        method) leaves the session's earlier state of that kind as it was."""
        return Carried(recycling=newer.recycling if newer.recycling is not None else self.recycling,
                       fallback=newer.fallback if newer.fallback is not None else self.fallback,
                       adapter=newer.adapter if newer.adapter is not None else self.adapter,
                       layer_skip=newer.layer_skip if newer.layer_skip is not None else self.layer_skip,
                       tree=newer.tree if newer.tree is not None else self.tree)

    def without_recycling(self) -> Carried:
        """The same record with an empty Token Recycling matrix (a run that starts its matrix afresh)."""
        return Carried(fallback=self.fallback, adapter=self.adapter, layer_skip=self.layer_skip, tree=self.tree)
