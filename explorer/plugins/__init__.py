"""Bring your own method: the one import a plugin needs (docs/plugins.md).

A plugin is a Python file, a module or an installed package's entry point (group ``spec_explorer.plugins``) that
registers parts when loaded; the CLI loads it with ``--plugin PATH_OR_MODULE``, the app with
``SPEC_EXPLORER_PLUGINS`` (``loading.py``). What it can register:

* a method: ``register_method(name, drafter, label=..., summary=..., defaults=...)``, where ``drafter`` is a
  ``Drafter`` subclass (a free drafter overrides ``free_nodes(view) -> [FreeNode]``; a model drafter subclasses
  ``ModelDrafter``) or a factory ``drafter(offer: DraftOffer) -> Drafter``; the adapters
  ``from_candidate_generator`` (a transformers ``CandidateGenerator``) and ``from_vllm_proposer`` (vLLM's
  ``custom_class`` signature) make such factories;
* a verification rule: ``register_verifier(name, node_rule, odds_rule=None, draws="without", label=None)``, written
  with ``NodeDecision`` and the residual helpers (``ratio``, ``rrs_rejected``, ``without``, ``normalize_or``);
* a stop policy: ``register_stop_policy(StopPolicy subclass, label, threshold)``, scoring ``LevelView``.

Every name in ``__all__`` is the stable API (``tests/test_plugins.py`` fails when one leaves it).
"""

from ..engine.drafters.base import DraftOffer, Drafted, Drafter, DraftView, FreeNode
from ..engine.drafters.model import ModelDrafter
from ..engine.parts import PluginError
from ..engine.policies.stopping import LevelView, StopPolicy
from ..engine.verify.node_rules import NodeDecision
from ..engine.verify.residuals import normalize_or, ratio, rrs_rejected, without
from .adapters import from_candidate_generator, from_vllm_proposer
from .registry import register_method, register_stop_policy, register_verifier, unregister

__all__ = ["DraftOffer", "DraftView", "Drafted", "Drafter", "FreeNode", "LevelView", "ModelDrafter", "NodeDecision",
           "PluginError", "StopPolicy", "from_candidate_generator", "from_vllm_proposer", "normalize_or", "ratio",
           "register_method", "register_stop_policy", "register_verifier", "rrs_rejected", "unregister", "without"]
