"""The command line (top floor): ``python -m explorer`` and its subcommands (``main``), the options they share
(``args``), the decision models' subcommands (``decision``: collect, train, calibrate, eval, generalise, ablation)
and the instruments' (``instruments``: probe, acceptance, calibration, timeline, counterfactual)."""
