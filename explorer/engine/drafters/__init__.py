"""Drafters: who proposes a step's draft tree. ``make_drafter`` builds the one a method names
(``methods.METHOD_SPECS``): none (``ar``), the draft model, prompt lookup, Token Recycling, the hybrid, an EAGLE-3
head (``eagle``; with prompt lookup, ``eagle-hybrid``) or the target's own first layers (``layer-skip``).

Modules: ``base`` (the interface: ``Drafter``, ``DraftView``, ``Reach``, the step's ``Drafted`` record, ``FreeNode`` and
``merge_free``, which joins free branches to a tree as a trie), ``model`` (the draft model's tree, level by level,
with the stop policy), ``lookup`` (prompt lookup decoding), ``recycling`` (Token Recycling), ``hybrid`` (the draft
model's tree plus free branches), ``layer_skip`` (the target's first layers, the exit chosen from measured
acceptance), ``eagle`` (an EAGLE-3 head's dynamic tree from the target's features) and ``row_pricing`` (which free
rows pay for their verification)."""

from __future__ import annotations

from ..policies.head_tree import TreeSizer
from ..policies.tree_choice import TreeChooser
from .base import Drafted, DraftOffer, Drafter, FreeNode, merge_free
from .eagle import HeadDrafter
from .hybrid import HybridDrafter
from .layer_skip import LayerSkipDrafter
from .lookup import LookupDrafter, lookup_continuations
from .model import ModelDrafter
from .recycling import RecyclingDrafter

__all__ = ["DraftOffer", "Drafted", "Drafter", "FreeNode", "HeadDrafter", "HybridDrafter", "LookupDrafter",
           "ModelDrafter", "RecyclingDrafter", "head_drafter", "lookup_continuations", "make_drafter", "merge_free",
           "model_drafter"]


def head_drafter(drafter: Drafter) -> HeadDrafter | None:
    """The EAGLE-3 head's drafter in ``drafter`` (itself, or the model part of ``eagle-hybrid``), else None."""
    inner = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    return inner if isinstance(inner, HeadDrafter) else None


def model_drafter(drafter: Drafter) -> ModelDrafter | None:
    """The draft model's drafter in ``drafter`` (itself, or the model part of ``hybrid``), else None."""
    inner = drafter.model if isinstance(drafter, HybridDrafter) else drafter
    return inner if isinstance(inner, ModelDrafter) else None


def make_drafter(config, recycling_state: dict | None = None, layer_skip_state: dict | None = None,
                 tree_chooser: TreeChooser | None = None, tree_state: dict | None = None, head=None,
                 sizer: TreeSizer | None = None, offer: DraftOffer | None = None) -> Drafter:
    """The drafter of ``config`` (a ``MethodConfig``); ``recycling_state``: a Token Recycling matrix carried over
    from an earlier run (``RecyclingDrafter.state()``), or None to start empty; ``layer_skip_state``: likewise
    ``layer-skip``'s exit chooser (``ExitChooser.state()``); ``tree_chooser``: the online tree choice the model
    drafter picks its root width with (``policies/tree_choice.py``; None: the config's fixed shape), and
    ``tree_state`` what it measured in an earlier run (``TreeChooser.state()``); ``head``: for ``eagle``, the loaded
    head, the target layers it reads and what the trace records of it (``(head, layers, source)``), and ``sizer``
    the online choice of its tree's size (``policies/head_tree.py``; None: ``head_tokens`` nodes every step);
    ``offer``: what a registered method's drafter factory builds from (``DraftOffer``; ``MethodSpec.drafter``)."""
    spec = config.spec
    if spec.drafter is not None:
        return spec.drafter(offer)
    free: list[Drafter] = []
    for name in spec.free:
        if name == "lookup":
            free.append(LookupDrafter(config.lookup_ngram, config.lookup_tokens, config.lookup_branches))
        elif name == "recycling":
            free.append(RecyclingDrafter(config.recycling_widths, config.recycling_k, recycling_state))
    if spec.self_draft:
        return LayerSkipDrafter(config.gamma, layer_skip_state)
    model = ModelDrafter(tree_chooser, tree_state) if spec.uses_draft_model else None
    if spec.uses_head:
        weights, layers, source = head
        model = HeadDrafter(weights, layers, top_k=config.head_topk, frontier=config.head_topk,
                            depth=config.head_depth, tokens=config.head_tokens, source=source, sizer=sizer)
    if model is not None and free:
        return HybridDrafter(model, free, config.lookup_alone)
    if model is not None:
        return model
    if len(free) == 1:
        return free[0]
    return HybridDrafter(Drafter(), free) if free else Drafter()
