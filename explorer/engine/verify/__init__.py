"""Verification: the rules that accept or reject drafted nodes against the target.

Modules: ``registry`` (the verifiers by name, each described once: label, drafting law, node rule, odds rule;
``register_verifier``), ``node_rules`` (what each rule does at one node: its test and its odds, and the point-mass
stage for free children), ``rules`` (the walks over a tree: greedy, recursive rejection sampling with and without
replacement, MCNS, SpecHub, the lossy longest-branch rule; ``run_verifier``), ``residuals`` (the distributions a
rejection leaves) and ``expectation`` (each node's probability of passing, a step's expected tokens)."""
