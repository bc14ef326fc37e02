"""Instruments that answer "why" about a run (issue 15): the tree-attention probe (``probe``), expected against
realised acceptance (``acceptance``) and the optimal tree for measured acceptance rates (``optimal_tree``)."""
