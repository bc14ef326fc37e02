"""The engine wing: the step machine and everything a step runs (torch; imports ``models`` and ``trace`` below it,
nothing above: ``tests/test_architecture.py``).

Modules:

* ``machine``: the step machine (``Engine``: prefill, then draft -> verify -> commit -> record -> notify);
  ``parts``: what it steps with (``EngineParts``, ``EngineOptions``, ``EngineError``); ``run_state``: one run's
  state (``RunState``); ``forwarding``: the models' forwards and a drafter's handle on its own model;
  ``verification``: a step's verification (``VerifiedStep``); ``recording``: its ``StepTrace``; ``observers``:
  what learns from a verified step; ``factory``: builds an engine and its parts (``build_engine``,
  ``build_parts``) for a ``config.MethodConfig``; ``config``: the method settings, validated; ``methods``: the
  methods by name (``MethodSpec``); ``carried``: what a run learned for the session's next run (``Carried``);
* ``tree`` (draft trees, masks, position ids), ``attention`` (the 4D float masks a forward hands a model, windowed
  for sliding-window layers), ``sampling`` (p and q from logits, top-k / top-p, lazy per-row distributions, draws),
  ``drafting`` (how a node's candidates are drawn), ``speedup`` (expected tokens and speedup of a chain or a tree).

Subpackages: ``drafters/`` (who proposes the tree), ``verify/`` (the verifiers by name, their node and odds rules,
residuals, expected acceptance), ``policies/`` (stop policies, the goodput fallback, the measured cost ratio),
``runtime/`` (KV caches, CUDA graph runners, step timelines, host reads, measured forward costs), ``stop_models/``
(the learned stop models a run uses: features, models, online adaptation, scores)."""
