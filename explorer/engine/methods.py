"""The decoding methods, each described once: a drafter, the tree it builds, whether a stop policy applies.

A method is a composition: a *drafter* proposes the step's draft tree (``engine/drafters/``), a
*verifier* decides what is committed (``engine/verify/rules.py``, chosen from the sampling settings and
``MethodConfig.verifier``), and for model drafting a *stop policy* ends drafting early
(``engine/policies/stopping.py``). Plain data, no torch.

The draft sources a tree's nodes come from (``draft``, ``target``, ``lookup``, ``recycled``) are the trace's
vocabulary: ``trace/records.py`` (``FREE_SOURCES``, ``DRAFT_SOURCES``, ``SOURCE_LABELS``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

from .live import LiveMapping, LiveNames


@dataclass(frozen=True)
class MethodSpec:
    """One decoding method.

    Attributes:
        name: the name used by the CLI, the bench, traces and the app.
        label: for menus.
        model_tree: how the draft model shapes its tree: ``none`` (no draft model), ``chain`` (``gamma``),
            ``tree`` (``k_config``), ``stoppable`` (``k_config`` then chains to ``max_depth``, with a stop policy)
            or ``head`` (no draft model: an EAGLE-3 head drafts EAGLE-2's dynamic tree from the target's features,
            ``head_topk`` / ``head_depth`` / ``head_tokens``).
        free: the free drafters whose branches join the tree, in verification order (``lookup``, ``recycling``).
        summary: one line for help texts and teach mode.
        self_draft: the draft model is the target's own first layers (``models/early_exit.py``), whatever the pair's
            draft.
        drafter: a method registered from outside (``explorer.plugins.register_method``): builds the run's drafter,
            ``drafter(offer) -> Drafter`` (``drafters.base.DraftOffer``); None for the project's own methods, which
            ``drafters.make_drafter`` builds from the fields above.
        origin: where a registered method came from (plugin name, file or module, version, sha256: plain data the
            trace records); None for the project's own.
    """

    name: str
    label: str
    model_tree: str
    free: tuple[str, ...] = ()
    summary: str = ""
    self_draft: bool = False
    drafter: Callable | None = None
    origin: dict | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.model_tree not in ("none", "head")

    @property
    def uses_head(self) -> bool:
        """Drafts with an EAGLE-3 head that reads the target's hidden states (``drafters/eagle.py``)."""
        return self.model_tree == "head"

    @property
    def lookup_hybrid(self) -> bool:
        """Prompt lookup's copies take a step alone or leave it to a draft model's or head's tree (``hybrid``,
        ``eagle-hybrid``; ``MethodConfig.lookup_alone`` draws the line)."""
        return "lookup" in self.free and self.model_tree != "none"

    @property
    def has_stop_policy(self) -> bool:
        return self.model_tree == "stoppable"


_SPECS: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("ar", "Autoregressive (AR)", "none", summary="one target forward per token"),
    MethodSpec("sd", "Speculative decoding (SD, chain)", "chain", summary="a chain of gamma draft tokens"),
    MethodSpec("mcsd", "MCSD (draft tree, one target pass)", "tree",
               summary="a k_config tree of draft tokens verified in one target pass"),
    MethodSpec("mcsd-improved", "Improved MCSD (Lu et al. 2024)", "stoppable",
               summary="a draft tree whose drafting stops early by a stop policy"),
    MethodSpec("prompt-lookup", "Prompt lookup (n-gram copies, free)", "none", ("lookup",),
               summary="continuations of earlier occurrences of the last n-gram, no draft model"),
    MethodSpec("token-recycling", "Token Recycling (free)", "none", ("recycling",),
               summary="a static tree read from the target's own earlier top-k candidates, no draft model"),
    MethodSpec("hybrid", "Hybrid: draft tree + free branches", "stoppable", ("lookup", "recycling"),
               summary="the improved MCSD tree plus lookup and recycled branches, one target pass for all"),
    MethodSpec("eagle", "EAGLE-3 head (drafts from the target's features)", "head",
               summary="a dynamic tree drafted by a one-layer head that reads three of the target's hidden states"),
    MethodSpec("eagle-hybrid", "EAGLE-3 head + prompt lookup", "head", ("lookup",),
               summary="prompt lookup's copies where the last two tokens occurred before, else the head's tree"),
    MethodSpec("layer-skip", "Layer skip (the target drafts for itself)", "chain", self_draft=True,
               summary="a chain drafted by the target's own first layers, the exit chosen from measured acceptance"),
)}
BUILTIN_METHODS = tuple(_SPECS)
"""The methods shipped here; ``remove_method`` leaves them."""
METHOD_SPECS = MappingProxyType(_SPECS)
"""Name -> ``MethodSpec``, read only (``add_method`` writes): the project's methods first, in menu order."""
METHODS = LiveNames(_SPECS)
"""The method names ``MethodConfig.method`` takes: a live tuple-like view (a registered method appears at once)."""
METHOD_LABELS = LiveMapping(_SPECS, lambda s: s.label)
"""Menu labels by method name: a live read-only view."""


class MethodError(ValueError):
    """A method cannot be added or removed: its name is taken, malformed, or belongs to the project."""


MODEL_TREES = ("none", "chain", "tree", "stoppable", "head")


def add_method(spec: MethodSpec) -> MethodSpec:
    """Add a method described by ``spec`` (a registered one: ``spec.drafter`` builds its drafter). Its defaults are
    ``config.add_method_defaults``'s, which ``explorer.plugins.register_method`` calls next.

    Raises MethodError: the name is taken, or is not 1-40 letters, digits, ``-``, ``_`` or ``.`` (no ``+`` or ``,``,
    so that a bench label ``name+key=value`` and a list of them still parse), or ``model_tree`` is not one of
    ``MODEL_TREES``."""
    name = spec.name
    if not isinstance(name, str) or not name or len(name) > 40 or not all(c.isalnum() or c in "-_." for c in name):
        raise MethodError(f"a method name is 1-40 letters, digits, '-', '_' or '.', got {name!r}")
    if name in _SPECS:
        raise MethodError(f"a method named {name!r} exists already")
    if spec.model_tree not in MODEL_TREES:
        raise MethodError(f"unknown model tree {spec.model_tree!r}; use one of {', '.join(MODEL_TREES)}")
    _SPECS[name] = spec
    return spec


def remove_method(name: str) -> None:
    """Remove a method ``add_method`` added. Raises MethodError for one of the project's or an unknown name."""
    if name in BUILTIN_METHODS:
        raise MethodError(f"the built-in method {name!r} cannot be removed")
    if name not in _SPECS:
        raise MethodError(f"no method named {name!r} was registered")
    del _SPECS[name]
