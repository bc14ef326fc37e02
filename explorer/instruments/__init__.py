"""Instruments that answer "why" about a run: the tree-attention probe (``probe``), re-running a
recorded run to look inside a step (``replay``), expected against realised acceptance (``acceptance``), the optimal
tree for measured acceptance rates (``optimal_tree``), counterfactual steps re-verified as recorded or edited
(``counterfactual``), stop-signal calibration (``calibration``) and the Plotly figures of their results
(``figures``)."""
