"""What each verification rule implies about acceptance (explorer/engine/verify/expectation.py), against Monte Carlo on
the tiny pair: the expected tokens of a drafted tree against re-verifying it with many seeds, and the slot
probability (sum_x min(p, q)) against re-drafting with many seeds."""

import math

import pytest
import torch

from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.engine.verify import expectation
from explorer.engine.verify import rules as verify

SAMPLED = SamplingConfig(temperature=1.0, seed=3)
PROMPT = "def add(a, b):\n    return"


def _first_step(pair, cfg, sampling=SAMPLED):
    # fallback off: on a busy machine the tiny pair's rows can measure dear, and plain steps would test nothing
    eng = build_engine(pair, cfg.with_(fallback="off"), sampling)
    eng.start(pair.tokenizer.encode(PROMPT), 32)
    step = eng.step()
    d, v = eng.last_step
    return eng, step, d, v


CASES = [
    MethodConfig(method="sd", gamma=4),
    MethodConfig(method="mcsd", k_config=(3, 2, 2)),
    MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs-replacement"),
    MethodConfig(method="mcsd", k_config=(2, 2, 1), verifier="mcns"),
    MethodConfig(method="mcsd", k_config=(2, 2, 2), verifier="spechub"),
    MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="none"),  # lossy longest-branch
    MethodConfig(method="hybrid", k_config=(2,), max_depth=4, stop="none"),  # free branches: the point stage
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.method}-{c.verifier}-{c.k_config}")
def test_expected_tokens_match_reverifying_the_drafted_tree(tiny, cfg):
    eng, step, d, v = _first_step(tiny, cfg)
    assert step.expected_tokens == pytest.approx(v.expected_tokens)
    laws = expectation.accepted_length_laws(d.tree, v.odds)
    assert all(law.sum() == pytest.approx(1.0) for law in laws.values())
    n = 3000
    gen = torch.Generator().manual_seed(11)
    total = 0
    on_path = [0] * len(d.tree)
    for _ in range(n):
        r = verify.run_verifier(eng.verifier_name, d.tree, v.p_rows, d.q_rows, gen, greedy=False)
        total += len(r.path) + (r.bonus is not None)
        for i in r.path:
            on_path[i] += 1
    mean = total / n
    var = max(v.expected_tokens * 0.5, 0.05)  # committed lengths are small integers: a loose variance bound
    assert abs(mean - v.expected_tokens) < 4 * math.sqrt(var / n), (mean, v.expected_tokens)
    # Each node's frequency on the committed path matches the product of the odds down to it (lossless rules).
    if not cfg.is_lossy:
        reach = _reach(d.tree, v.odds)
        for i, count in enumerate(on_path):
            pr = reach.get(i, 0.0)
            assert abs(count / n - pr) < 4 * math.sqrt(pr * (1 - pr) / n) + 2e-3, (i, count / n, pr)


def _reach(tree, odds):
    """P(node on the committed path) = P(parent on it) * prod(1 - accept of siblings tested before) * accept."""
    reach = {}
    for i in range(len(tree)):
        if i not in odds:
            continue
        parent = 1.0 if tree.parent[i] < 0 else reach.get(tree.parent[i], 0.0)
        before = [c for c in tree.children(tree.parent[i]) if c in odds and odds[c].order < odds[i].order]
        reach[i] = parent * math.prod(1 - odds[c].accept_prob for c in before) * odds[i].accept_prob
    return reach


def test_slot_probability_is_the_acceptance_rate_over_redrafts(tiny):
    # sd with one draft token: the first step commits 2 tokens with probability sum_x min(p(x), q(x)), else 1.
    cfg = MethodConfig(method="sd", gamma=1)
    eng, step, _, _ = _first_step(tiny, cfg)
    slot = step.nodes[1].slot_prob
    assert 0.05 < slot < 0.95  # the tiny pair disagrees sometimes: the test can fail both ways
    n = 3000
    accepted = 0
    for seed in range(n):
        eng.rewind(seed=seed)
        accepted += eng.step().accepted_draft_len
    assert abs(accepted / n - slot) < 4 * math.sqrt(slot * (1 - slot) / n)


def test_greedy_expectation_is_exactly_what_was_committed(tiny):
    eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2, 2), fallback="off"), SamplingConfig())
    eng.start(tiny.tokenizer.encode(PROMPT), 40)
    trace = eng.run()
    for s in trace.steps:
        if not s.finished:
            assert s.expected_tokens == pytest.approx(len(s.committed_ids))
        for node in s.nodes[1:]:
            assert node.accept_prob in (0.0, 1.0)
            assert (node.accept_prob == 1.0) == (node.status == "accepted") or node.status == "unverified"


def test_every_tested_node_has_odds_and_old_traces_load(tiny):
    from explorer.trace.records import RunTrace

    eng, step, d, v = _first_step(tiny, MethodConfig(method="mcsd", k_config=(2, 2)))
    for node in step.nodes[1:]:
        assert node.accept_prob is not None and 0.0 <= node.accept_prob <= 1.0
        assert node.slot_prob is not None and 0.0 <= node.slot_prob <= 1.0
        if node.status in ("accepted", "rejected"):
            # the recorded test ratio is the odds' argument
            assert node.accept_prob == pytest.approx(min(1.0, node.ratio), abs=1e-6)
    d_old = eng.trace.to_dict()
    d_old["schema_version"] = 1  # written before these fields were recorded (trace/schema.py upgrades it)
    for s in d_old["steps"]:
        s.pop("expected_tokens")
        for n in s["nodes"]:
            for key in ("accept_prob", "slot_prob", "test_order"):
                n.pop(key)
    old = RunTrace.from_dict(d_old)
    assert old.steps[0].expected_tokens is None and old.steps[0].nodes[1].accept_prob is None
