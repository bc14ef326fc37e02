"""The learned stop models a run uses (the seed paper's decision models): the features of a drafted node
(``features``), the models and their shipped weights (``model``), online adaptation during a run (``online``) and
scores (``scores``). The offline tools that collect data and train them are in ``explorer/decision/``."""
