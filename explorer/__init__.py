"""Speculative decoding explorer: a step-wise engine whose every step is a plain-data trace, plus figures, lessons,
instruments, a command line and a Streamlit app that read those traces.

The engine runs the methods side by side (``engine/methods.py``): autoregressive decoding (``ar``), speculative
decoding (``sd``), Multi-Candidate Speculative Decoding (``mcsd``), the improved MCSD of Lu et al. 2024
(``mcsd-improved``), the free drafters (``prompt-lookup``, ``token-recycling``, the ``hybrid``) and self-drafting
(``layer-skip``). The package is laid out in wings that import only downward (docs/architecture.md, "Module map"):
``ui`` and ``cli``; ``lessons``, ``decision``, ``instruments``; ``analysis``; ``engine``; ``models`` and ``trace``.

The command line, ``python -m explorer`` (``cli/main.py``), has the subcommands ``generate``, ``greedy-check``,
``audit``, ``verifiers``, ``bench``, ``lessons``, ``decision`` (collect, train, calibrate, eval, generalise,
ablation) and the instruments ``probe``, ``acceptance``, ``calibration``, ``timeline``, ``counterfactual``; the
Streamlit app is ``app.py`` at the project root."""

__version__ = "0.9.0"
