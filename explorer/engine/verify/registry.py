"""The verifiers by name, each described once (``Verifier``): its label, how the draft model must draw the children
it tests, its node rule and its odds rule (``node_rules``). ``register_verifier`` adds one, in this one table.

Every other table of verifiers is a live, read-only view of this one (``view``, ``names``), so that a verifier
registered at run time is seen everywhere at once: ``config.VERIFIERS`` and ``config.VERIFIER_LABELS``
(what ``MethodConfig.verifier`` accepts, the CLI's and the app's menus), ``drafting.DRAFT_RULES`` (how children are
drawn), ``expectation.ODDS_RULES`` (expected acceptance) and ``rules.NODE_RULES`` / ``rules.ODDS_RULES`` (how the
verifier walks). This module imports only ``node_rules`` below it, so that config and drafting can read it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from .node_rules import (VerifierError, mcns_node, mcns_odds, rrs_odds, rrs_replacement_odds, spechub_node,
                         spechub_odds)

DRAWS = ("without", "with", "hub")
"""How the draft model may draw the children a rule tests (``drafting.candidates``): ``without`` replacement (the
law MCSD's rejection sampling assumes), ``with`` (i.i.d., SpecInfer's), ``hub`` (SpecHub's pairs). The fourth,
``greedy`` (the top-k), belongs to the greedy rule alone."""


@dataclass(frozen=True)
class Verifier:
    """One verification rule.

    Attributes:
        name: what ``MethodConfig.verifier``, ``run_verifier``, ``EngineParts.verifier_name`` and traces use.
        label: for menus.
        draws: how the draft model draws the children this rule tests (``DRAWS``, or ``greedy``).
        node_rule: the test walked node by node (``node_rules``); None for the rules whose test of a node depends
            only on the tree, which the verifier walks on the odds computed on the device for the whole tree
            (greedy, ``rrs``, ``rrs-replacement``, ``longest-branch``: a few host synchronisations per step).
        odds_rule: what the test implies about each child (``node_rules``), for the trace and the expected tokens
            (``expectation.node_odds``); None for greedy, whose test is the argmax.
        selectable: offered as ``MethodConfig.verifier`` and in the menus; greedy and the lossy ``longest-branch``
            are chosen by the sampling and the lossy mode instead.
    """

    name: str
    label: str
    draws: str
    node_rule: Callable | None = None
    odds_rule: Callable | None = None
    selectable: bool = True


_REGISTRY: dict[str, Verifier] = {}
VERIFIER_REGISTRY: Mapping[str, Verifier] = MappingProxyType(_REGISTRY)
"""Name -> ``Verifier``, read only (``register_verifier`` writes): the built-in rules first, in menu order."""

RESERVED = ("auto",)
"""Names that are ``MethodConfig.verifier`` settings, not verifiers."""


def _add(entry: Verifier) -> Verifier:
    if entry.name in _REGISTRY or entry.name in RESERVED:
        raise VerifierError(f"a verifier named {entry.name!r} exists already")
    _REGISTRY[entry.name] = entry
    return entry


for _entry in (
    Verifier("greedy", "Greedy (the target's argmax)", "greedy", selectable=False),
    Verifier("rrs", "RRS without replacement (MCSD)", "without", odds_rule=rrs_odds),  # Yang et al. 2024
    Verifier("rrs-replacement", "RRS with replacement (SpecInfer)", "with", odds_rule=rrs_replacement_odds),
    Verifier("mcns", "MCNS (naive multi-candidate)", "without", mcns_node, mcns_odds),
    Verifier("spechub", "SpecHub (2 drafts per node)", "hub", spechub_node, spechub_odds),  # Sun et al. 2024
    # The rule of Lu et al. 2024 (lossy): each root's branch walked with rrs, the longest committed.
    Verifier("longest-branch", "Longest branch (Lu et al. 2024, lossy)", "without", odds_rule=rrs_odds,
             selectable=False),
):
    _add(_entry)
BUILTIN = tuple(_REGISTRY)
"""The names shipped here; ``unregister_verifier`` leaves them."""


def register_verifier(name: str, node_rule: Callable, odds_rule: Callable, draws: str = "without",
                      label: str | None = None) -> Verifier:
    """Make a node rule a verifier by ``name``: from then on ``MethodConfig(verifier=name)`` validates, the menus
    offer it under ``label``, the draft model draws its children by ``draws``, ``expectation`` computes its odds
    with ``odds_rule`` and ``run_verifier`` walks the tree with ``node_rule``.

    Args:
        name: a new name (not ``auto``).
        node_rule: ``(tokens, p, q, generator) -> (index of the accepted child or None, distribution of the next
            token when none was, {child index: NodeDecision})``, walked node by node; ``tokens`` the model-drafted
            children in draft order, ``p`` / ``q`` float32 ``(vocab,)`` (``node_rules``).
        odds_rule: ``(tokens, p, q) -> ([(child index, ratio, slot probability), ...] in test order, p after the
            last test)``, values as 0-d tensors or floats: what the rule implies about each child, for the trace
            and the expected tokens.
        draws: how the draft model draws the children this rule tests (``DRAWS``: ``without`` replacement,
            ``with``, or ``hub``, SpecHub's pairs).
        label: for menus; the name when None.
    Returns the new ``Verifier``.
    Raises:
        VerifierError (a ValueError): the name is taken already, or ``draws`` is not one of ``DRAWS``.
        TypeError: a rule is not callable, or the name or label is not a string.
    """
    if not isinstance(name, str) or not name or not isinstance(label, (str, type(None))):
        raise TypeError(f"a verifier needs a non-empty string name and label, got {name!r}, {label!r}")
    if name in _REGISTRY or name in RESERVED:
        raise VerifierError(f"a verifier named {name!r} exists already")
    if draws not in DRAWS:
        raise VerifierError(f"unknown drafting law {draws!r}; use {', '.join(DRAWS)}")
    if not callable(node_rule) or not callable(odds_rule):
        raise TypeError("a verifier needs a callable node rule and odds rule")
    return _add(Verifier(name, name if label is None else label, draws, node_rule, odds_rule))


def unregister_verifier(name: str) -> None:
    """Remove a verifier ``register_verifier`` added (tests put the table back so). Raises VerifierError for a
    built-in or unknown name."""
    if name in BUILTIN:
        raise VerifierError(f"the built-in verifier {name!r} cannot be removed")
    if name not in _REGISTRY:
        raise VerifierError(f"no verifier named {name!r} was registered")
    del _REGISTRY[name]


class _View(Mapping):
    """``{name: value(verifier)}`` over the registry's verifiers that ``keep``, after ``first``; live (read at each
    access) and read only."""

    def __init__(self, value: Callable[[Verifier], object], keep: Callable[[Verifier], bool] | None = None,
                 first: Mapping | None = None):
        self._value, self._keep, self._first = value, keep or (lambda v: True), dict(first or {})

    def __getitem__(self, name):
        if name in self._first:
            return self._first[name]
        entry = _REGISTRY[name]
        if not self._keep(entry):
            raise KeyError(name)
        return self._value(entry)

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (n for n, v in _REGISTRY.items() if self._keep(v) and n not in self._first)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(dict(self))


class _Names(Sequence):
    """The names of the registry's verifiers that ``keep``, in registration order: a live tuple (``+`` with a
    tuple gives a tuple)."""

    def __init__(self, keep: Callable[[Verifier], bool]):
        self._keep = keep

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, v in _REGISTRY.items() if self._keep(v))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __add__(self, other):
        return self._names() + other if isinstance(other, tuple) else NotImplemented

    def __radd__(self, other):
        return other + self._names() if isinstance(other, tuple) else NotImplemented

    def __eq__(self, other) -> bool:
        return self._names() == (tuple(other) if isinstance(other, (tuple, _Names)) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


def view(value: Callable[[Verifier], object], keep: Callable[[Verifier], bool] | None = None,
         first: Mapping | None = None) -> Mapping:
    """A live read-only mapping ``{name: value(verifier)}`` of the verifiers that ``keep`` (all when None), after
    the entries of ``first``."""
    return _View(value, keep, first)


def names(keep: Callable[[Verifier], bool]) -> Sequence[str]:
    """A live tuple-like sequence of the names of the verifiers that ``keep``."""
    return _Names(keep)
