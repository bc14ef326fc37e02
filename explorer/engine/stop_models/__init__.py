"""The learned stop models a run uses (the decision models of Lu et al. 2024, arXiv 2409.10644): the features of a
drafted node (``features``), the models, their shipped weights and which one serves a pair (``model``), online
adaptation during a run (``online``) and scores (``scores``). The offline tools that collect data and train them are
in ``explorer/decision/``."""
