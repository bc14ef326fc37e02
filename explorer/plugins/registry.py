"""Registering a plugin's parts: a method (its drafter), a verification rule, a stop policy. Each registration is
the project's own registry's (``engine/methods.py``, ``engine/verify/registry.py``, ``engine/policies/stopping.py``),
with the plugin's origin attached so that the traces of its runs say where the part came from.

While ``loading.load_plugin`` imports a plugin, what it registers belongs to that plugin (``loading_as``); a part
registered anywhere else (a script, a test) gets the origin of the module that defines it.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.config import DEFAULTS, MethodConfig
from ..engine.drafters.base import DraftOffer, Drafter
from ..engine.drafters.model import ModelDrafter
from ..engine.methods import METHOD_SPECS, MethodError, MethodSpec, add_method, remove_method
from ..engine.parts import PluginError
from ..engine.policies import stopping
from ..engine.verify import registry as verifiers
from ..engine.verify.node_rules import VerifierError


@dataclass
class Registered:
    """What one origin registered: names by kind (``method``, ``verifier``, ``stop``)."""

    methods: list[str] = field(default_factory=list)
    verifiers: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [*self.methods, *self.verifiers, *self.stops]


_LOADING: list[tuple[dict, Registered]] = []  # the plugin being imported now (innermost last), and its names


@contextmanager
def loading_as(origin: dict):
    """Everything registered inside this block belongs to ``origin`` (``name``, ``loaded_from``, ``version``,
    ``sha256``); yields the ``Registered`` record it fills. A block that raises takes its registrations back."""
    record = Registered()
    _LOADING.append((origin, record))
    try:
        yield record
    except BaseException:
        unregister(*record.names())
        raise
    finally:
        _LOADING.pop()


def sha256_of(path: str | Path | None) -> str | None:
    """The hex sha256 of a file's bytes, or None where there is no readable file."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else None
    except OSError:
        return None


def _origin(obj) -> tuple[dict, Registered | None]:
    """The origin of a part being registered, and the record of the plugin loading it (None outside a load)."""
    if _LOADING:
        return _LOADING[-1]
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    name = getattr(module, "__name__", None) or getattr(obj, "__qualname__", "?")
    return {"name": name, "loaded_from": str(path or name), "version": None, "sha256": sha256_of(path)}, None


def _summary(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def register_method(name: str, drafter, *, label: str | None = None, summary: str = "",
                    defaults: dict | None = None, model_tree: str | None = None) -> MethodSpec:
    """Offer a drafter as the decoding method ``name`` in every tool: the CLI's ``--method``, the app's menus,
    ``bench``, ``audit``, ``forensics``, replays and lessons.

    Args:
        name: 1-40 letters, digits, ``-``, ``_`` or ``.``, not taken.
        drafter: a ``Drafter`` subclass, built with no arguments for each run (its settings in ``defaults``), or a
            factory ``drafter(offer) -> Drafter`` given what the run offers (``DraftOffer``: the method's settings,
            the sampling, the vocabulary size, the tokenizer, the EOS ids, the device). A free drafter overrides
            ``free_nodes(view) -> list[FreeNode]``; a model drafter subclasses ``ModelDrafter`` and reaches the
            pair's draft model through ``view.draft`` at each step.
        label: for menus (default: ``name``).
        summary: one line for help texts and teach mode (default: the first paragraph of the drafter's docstring).
        defaults: ``MethodConfig`` settings of the method's default configuration (``config.DEFAULTS[name]``), e.g.
            ``{"k_config": (2, 2), "stop": "none"}`` for a model drafter's tree.
        model_tree: how the pair's draft model shapes the tree (``methods.MethodSpec.model_tree``); default
            ``stoppable`` for a ``ModelDrafter`` subclass (``k_config`` then chains to ``max_depth``, with a stop
            policy), else ``none`` (no draft model runs).
    Returns the method's ``MethodSpec``.
    Raises:
        PluginError (a ValueError): the name is taken or malformed, ``drafter`` is neither a Drafter subclass nor
            callable, or ``defaults`` are not valid settings (the message names the setting).
    """
    origin, record = _origin(drafter)
    if isinstance(drafter, type):
        if not issubclass(drafter, Drafter):
            raise PluginError(f"method {name!r}: {drafter.__name__} is not a Drafter subclass")
        factory: Callable = lambda offer, cls=drafter: cls()  # noqa: E731 - one line
        model_tree = model_tree or ("stoppable" if issubclass(drafter, ModelDrafter) else "none")
    elif callable(drafter):
        factory, model_tree = drafter, model_tree or "none"
    else:
        raise PluginError(f"method {name!r}: the drafter must be a Drafter subclass or a factory, got {drafter!r}")
    spec = MethodSpec(name, label or name, model_tree, summary=summary or _summary(drafter),
                      drafter=_built_by(name, origin, factory), origin={**origin, "doc": _summary(drafter)})
    try:
        add_method(spec)
    except MethodError as exc:
        raise PluginError(f"plugin {origin['name']}: {exc}") from None
    try:
        DEFAULTS[name] = MethodConfig(method=name, **(defaults or {}))
    except (TypeError, ValueError) as exc:
        remove_method(name)
        raise PluginError(f"plugin {origin['name']}: method {name!r}: its defaults are not valid settings: "
                          f"{exc}") from None
    if record is not None:
        record.methods.append(name)
    return spec


def _built_by(name: str, origin: dict, factory: Callable) -> Callable[[DraftOffer], Drafter]:
    """``factory`` checked: what it builds is a Drafter, marked as the plugin's (``Drafter.plugin``); a factory
    that raises is a PluginError naming the plugin and the method."""

    def build(offer: DraftOffer) -> Drafter:
        try:
            drafter = factory(offer)
        except Exception as exc:  # noqa: BLE001 - the plugin's own failure, reported with its name
            raise PluginError(f"plugin {origin['name']}: method {name}: building its drafter raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(drafter, Drafter):
            raise PluginError(f"plugin {origin['name']}: method {name}: the factory returned {drafter!r}, not a "
                              "Drafter")
        drafter.plugin = name
        return drafter

    return build


def register_verifier(name: str, node_rule: Callable, odds_rule: Callable | None = None, draws: str = "without",
                      label: str | None = None):
    """Offer a verification rule as ``MethodConfig(verifier=name)`` and ``--verifier name`` (the project's
    ``engine.verify.registry.register_verifier``, with the plugin's origin recorded in the traces of its runs).

    Args:
        name: not taken, not ``auto``.
        node_rule: ``(tokens, p, q, generator) -> (accepted child index or None, next-token distribution or None,
            {child index: NodeDecision})``: ``tokens`` the node's model-drafted children in draft order (ints),
            ``p`` the target's and ``q`` the draft's processed distributions there, float32 ``(vocab,)`` on the
            pair's device (``q`` None where the children were not sampled), ``generator`` the run's
            ``torch.Generator`` (draw every random number from it so that a run replays). Return a child's index,
            or None and the distribution the next token is drawn from (non-negative, any positive total). Free
            children (prompt lookup, a plugin's free drafter) are tested after the rule by the project's
            point-mass stage, against what the rule left.
        odds_rule: ``(tokens, p, q) -> ([(child index, ratio, slot probability), ...] in test order, p left after
            the last test)``, for the trace's acceptance probabilities and the expected tokens; None: the trace
            shows the rule's decisions only.
        draws: how the draft model draws the children the rule tests: ``without`` replacement, ``with``, ``hub``.
        label: for menus (default: ``name``).
    Returns the registry's ``Verifier``.
    Raises PluginError: the name is taken, ``draws`` unknown, or a rule not callable.
    """
    origin, record = _origin(node_rule)
    try:
        entry = verifiers.register_verifier(name, node_rule, odds_rule, draws=draws, label=label,
                                            origin={**origin, "doc": _summary(node_rule)})
    except (VerifierError, TypeError) as exc:
        raise PluginError(f"plugin {origin['name']}: {exc}") from None
    if record is not None:
        record.verifiers.append(name)
    return entry


def register_stop_policy(policy: type, label: str | None = None, threshold: float = 0.5) -> type:
    """Offer a ``StopPolicy`` subclass (its class attribute ``name``) as ``MethodConfig(stop=name)`` and ``--stop
    name`` for methods with a stop policy (``mcsd-improved``, ``hybrid``, a plugin model drafter's): built as
    ``policy(threshold)``, ``threshold`` in [0, 1] its default setting; it scores each drafted level from
    ``LevelView`` (no decision model). Returns ``policy``. Raises PluginError: the name is taken or missing, or the
    class is not a StopPolicy."""
    origin, record = _origin(policy)
    try:
        stopping.register_stop_policy(policy, label, threshold, origin={**origin, "doc": _summary(policy)})
    except (TypeError, ValueError) as exc:
        raise PluginError(f"plugin {origin['name']}: {exc}") from None
    if record is not None:
        record.stops.append(policy.name)
    return policy


def unregister(*names: str) -> None:
    """Remove registered methods, verifiers or stop policies by name (a plugin reloaded, a test putting the tables
    back); names that are none of those are skipped. The project's own are never removed."""
    for name in names:
        spec = METHOD_SPECS.get(name)
        if spec is not None and spec.drafter is not None:
            remove_method(name)
            DEFAULTS.pop(name, None)
        entry = verifiers.VERIFIER_REGISTRY.get(name)
        if entry is not None and entry.origin is not None:
            verifiers.unregister_verifier(name)
        if name in stopping.STOP_POLICY_ORIGINS:
            stopping.unregister_stop_policy(name)
