"""The engine wing: the step machine (``machine.Engine``: draft, verify, commit, record) and everything a step runs.

* ``factory`` builds an engine and its parts for a ``config.MethodConfig`` (``methods``: the methods by name);
  ``tree`` (draft trees, masks, position ids), ``attention`` (4D float masks), ``sampling`` (distributions, top-k/p),
  ``drafting`` (how a node's candidates are drawn), ``speedup`` (expected tokens and speedup of a chain or a tree);
* ``drafters/`` (who proposes the tree), ``verify/`` (the verification rules, residuals, expected acceptance),
  ``policies/`` (stop policies, the goodput fallback, the cost ratio), ``runtime/`` (KV caches, CUDA graph runners,
  step timelines, host reads, measured forward costs), ``stop_models/`` (the learned decision models a run uses:
  features, model, online adaptation, scores).

Imports ``models`` and ``trace`` below it, nothing above (``tests/test_architecture.py``)."""
