"""Offline tools for the learned stop models: collect decision data from runs (``collect``), train (``train``),
calibrate a model for another pair (``calibrate``), evaluate (``evaluate``), check generalisation (``generalise``) and
ablate features (``ablation``). The models a run uses are in ``explorer/engine/stop_models/``."""
