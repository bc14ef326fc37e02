"""Verification: the rules that accept or reject drafted nodes against the target (``rules``: greedy, recursive
rejection sampling with and without replacement, MCNS, SpecHub; ``register_verifier``), the residual distributions
a rejection draws from (``residuals``) and each node's probability of passing (``expectation``)."""
