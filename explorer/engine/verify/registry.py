"""The verifiers by name, each described once (``Verifier``): its label, how the draft model must draw the children
it tests, its node rule and its odds rule (``node_rules``). ``register_verifier`` adds one, in this one table.

Every other table of verifiers is a live, read-only view of this one (``view``, ``names``), so that a verifier
registered at run time is seen everywhere at once: ``config.VERIFIERS`` and ``config.VERIFIER_LABELS``
(what ``MethodConfig.verifier`` accepts, the CLI's and the app's menus), ``drafting.DRAFT_RULES`` (how children are
drawn), ``expectation.ODDS_RULES`` (expected acceptance) and ``rules.NODE_RULES`` / ``rules.ODDS_RULES`` (how the
verifier walks). This module imports only ``node_rules`` and ``engine/live.py`` below it, so that config and drafting
can read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ..live import LiveMapping, LiveNames

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
        origin: the plugin that registered it (``register_verifier``), None for the project's own.
    """

    name: str
    label: str
    draws: str
    node_rule: Callable | None = None
    odds_rule: Callable | None = None
    selectable: bool = True
    origin: dict | None = None


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


def register_verifier(name: str, node_rule: Callable, odds_rule: Callable | None = None, draws: str = "without",
                      label: str | None = None, origin: dict | None = None) -> Verifier:
    """Make a node rule a verifier by ``name``: from then on ``MethodConfig(verifier=name)`` validates, the menus
    offer it under ``label``, the draft model draws its children by ``draws``, ``expectation`` computes its odds
    with ``odds_rule`` and ``run_verifier`` walks the tree with ``node_rule``.

    Args:
        name: a new name (not ``auto``).
        node_rule: ``(tokens, p, q, generator) -> (index of the accepted child or None, distribution of the next
            token when none was, {child index: NodeDecision})``, walked node by node; ``tokens`` the model-drafted
            children in draft order, ``p`` / ``q`` float32 ``(vocab,)`` (``node_rules``). What it returns is
            checked at each node (``_checked``): a rule that raises, or returns neither a child nor a distribution,
            stops the step with a VerifierError naming the verifier.
        odds_rule: ``(tokens, p, q) -> ([(child index, ratio, slot probability), ...] in test order, p after the
            last test)``, values as 0-d tensors or floats: what the rule implies about each child, for the trace
            and the expected tokens. None: the trace shows the rule's decisions only (no acceptance probabilities,
            no expected tokens for its model-drafted nodes).
        draws: how the draft model draws the children this rule tests (``DRAWS``: ``without`` replacement,
            ``with``, or ``hub``, SpecHub's pairs).
        label: for menus; the name when None.
        origin: where the rule came from when a plugin registered it (``explorer.plugins``: name, file or module,
            version, sha256), recorded in the traces of its runs; None for the project's own.
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
    if not callable(node_rule) or not (odds_rule is None or callable(odds_rule)):
        raise TypeError("a verifier needs a callable node rule (and a callable odds rule, or None)")
    who = f"verifier {name!r}" + (f" (plugin {origin.get('name')})" if origin else "")
    return _add(Verifier(name, name if label is None else label, draws, _checked(who, node_rule), odds_rule,
                         origin=origin))


def _checked(who: str, rule: Callable) -> Callable:
    """``rule`` with what it returns checked at each node: an accepted child's index in range, or else a
    distribution of the next token shaped like ``p`` with non-negative mass; anything else (or an exception of the
    rule's own) is a VerifierError that names the verifier (``who``) and what was wrong."""

    def node_rule(tokens, p, q, generator):
        try:
            out = rule(tokens, p, q, generator)
        except VerifierError:
            raise
        except Exception as exc:  # noqa: BLE001 - a registered rule's own bug, reported with its name
            raise VerifierError(f"{who}: its node rule raised {type(exc).__name__}: {exc}") from exc
        problem = _outcome_problem(out, len(tokens), p)
        if problem:
            raise VerifierError(f"{who}: its node rule {problem}")
        return out

    node_rule.__wrapped__ = rule
    node_rule.__doc__ = rule.__doc__
    return node_rule


def _outcome_problem(out, n_children: int, p) -> str | None:
    """Why a node rule's return value is not ``(child index or None, distribution or None, decisions)``, or None."""
    if not (isinstance(out, tuple) and len(out) == 3):
        return f"must return (child index or None, next-token distribution or None, decisions), got {out!r:.80}"
    idx, dist, decisions = out
    if not isinstance(decisions, dict):
        return f"returned decisions {type(decisions).__name__}, not a dict of child index -> NodeDecision"
    if idx is not None:
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n_children:
            return f"accepted child {idx!r}, not an index of its {n_children} children"
        return None
    if dist is None:
        return "returned neither an accepted child nor a distribution of the next token"
    if not hasattr(dist, "shape") or tuple(dist.shape) != tuple(p.shape):
        return (f"returned a next-token distribution of shape {tuple(getattr(dist, 'shape', ()))}, not the "
                f"vocabulary's {tuple(p.shape)}")
    if not bool((dist >= 0).all()) or not float(dist.sum()) > 0:
        return "returned a next-token distribution with negative or no mass"
    return None


def unregister_verifier(name: str) -> None:
    """Remove a verifier ``register_verifier`` added (tests put the table back so). Raises VerifierError for a
    built-in or unknown name."""
    if name in BUILTIN:
        raise VerifierError(f"the built-in verifier {name!r} cannot be removed")
    if name not in _REGISTRY:
        raise VerifierError(f"no verifier named {name!r} was registered")
    del _REGISTRY[name]


def view(value: Callable[[Verifier], object], keep: Callable[[Verifier], bool] | None = None,
         first: Mapping | None = None) -> Mapping:
    """A live read-only mapping ``{name: value(verifier)}`` of the verifiers that ``keep`` (all when None), after
    the entries of ``first``."""
    return LiveMapping(_REGISTRY, value, keep, first)


def names(keep: Callable[[Verifier], bool]) -> Sequence[str]:
    """A live tuple-like sequence of the names of the verifiers that ``keep``."""
    return LiveNames(_REGISTRY, keep)
