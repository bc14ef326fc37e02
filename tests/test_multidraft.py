"""The seeds' other multi-draft systems, bundled as plugins (explorer/plugins/bundled/): SpecTr's K-SEQ verifier
(``spectr``) and RSD-S's stochastic beam tree (``rsd-s``). Their lossless runs are in the audit's grid
(tests/test_audit.py); here: the rules' arithmetic, the lossy controls the audit must catch, the trees, greedy
equality with ``ar``, and the command that compares the rules on the same trees."""

import json

import numpy as np
import pytest
import torch

from method_grid import AUDIT_SAMPLES
from explorer.analysis.audit import audit
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.machine import EngineError
from explorer.engine.sampling import SamplingConfig
from explorer.plugins import register_method, register_verifier, unregister
from explorer.plugins.bundled import rsd, spectr

PROMPT = "def f(x):\n    return"


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_rho_star_keeps_the_residual_a_distribution_and_is_the_smallest_that_does(k):
    """rho* solves 1 - (1 - beta)^k = rho beta; the residual is then non-negative with mass (1 - beta)^k, so the
    committed token follows p exactly; any smaller rho leaves negative residual mass (the lossy side)."""
    rng = np.random.default_rng(k)
    for _ in range(20):
        p, q = rng.dirichlet(np.full(40, 0.3)), rng.dirichlet(np.full(40, 0.3))
        rho, b = spectr.optimal_rho(p, q, k)
        assert 1.0 <= rho <= k
        a = 1 - (1 - b) ** k
        residual = p - np.minimum(q, p / rho) * a / b
        assert residual.min() > -1e-12 and residual.sum() == pytest.approx((1 - b) ** k, abs=1e-9)
        # the law of the committed token: k sequential tests, then the residual
        accept = np.minimum(q, p / rho)
        law = accept * a / b + residual
        assert law == pytest.approx(p, abs=1e-9)
        if k > 1 and rho > 1 + 1e-6:
            smaller = rho * 0.97
            bs = spectr._pass_rate(p, q)(smaller)
            assert (p - np.minimum(q, p / smaller) * (1 - (1 - bs) ** k) / bs).min() < 0
    assert spectr.optimal_rho(p, q, 1)[0] == 1.0  # one draft: speculative decoding's own test


def test_one_draft_skips_the_search_and_keeps_its_numbers():
    """A chain's node (one draft) takes K-SEQ's shortcut, rho* = 1 without the sort: the same rho, beta, test
    and residual as the general path."""
    rng = np.random.default_rng(5)
    p64, q64 = rng.dirichlet(np.full(300, 0.2)), rng.dirichlet(np.full(300, 0.2))
    p, q = torch.tensor(p64, dtype=torch.float32), torch.tensor(q64, dtype=torch.float32)
    px, qx, rho, b = spectr._node([7], p, q, None)
    host_p, host_q = p.double().numpy(), q.double().numpy()
    assert (rho, px, qx) == (1.0, [host_p[7]], [host_q[7]])
    assert b == pytest.approx(spectr.optimal_rho(host_p, host_q, 1)[1], abs=1e-9)
    residual = spectr._residual(p, q, rho, b, 1)
    sd = torch.clamp(p - q, min=0)
    assert torch.allclose(residual, sd / sd.sum(), atol=1e-7)


def test_spectr_with_rho_one_is_caught_by_the_audit(tiny):
    """rho = 1 (every draft tested as if it were alone) is lossy: the audit's chi-square rejects it."""
    register_verifier("spectr-rho1", lambda t, p, q, g: spectr.kseq(t, p, q, g, rho=1.0),
                      lambda t, p, q: spectr.kseq_odds(t, p, q, rho=1.0), draws="with")
    try:
        config = MethodConfig(method="mcsd", k_config=(3, 2), verifier="spectr-rho1", fallback="off")
        r = audit(tiny, config, SamplingConfig(temperature=1.0, seed=11), tiny.tokenizer.encode(PROMPT),
                  AUDIT_SAMPLES)
        assert not r.passed and r.first.p_value < 1e-4 and r.first.tv_distance > 0.1
    finally:
        unregister("spectr-rho1")


class _SortedByQ(rsd.RSDSDrafter):
    """RSD-S with each node's children re-sorted by q instead of kept in draw order (lossy)."""

    sort_by_q = True


def test_rsd_s_with_siblings_sorted_by_q_is_caught_by_the_audit(tiny):
    register_method("rsd-sorted", _SortedByQ, model_tree="tree", defaults={"k_config": (4, 1, 1), "fallback": "off"})
    try:
        r = audit(tiny, DEFAULTS["rsd-sorted"], SamplingConfig(temperature=1.0, seed=11),
                  tiny.tokenizer.encode(PROMPT), AUDIT_SAMPLES)
        assert not r.passed and r.first.p_value < 1e-4
    finally:
        unregister("rsd-sorted")


def test_the_conditioned_keys_have_their_parents_key_as_maximum():
    g = torch.distributions.Gumbel(0.0, 1.0).sample((3, 50)).double() + torch.randn(3, 50).double()
    g[0, :10] = float("-inf")  # off q's support
    parent = torch.tensor([-0.5, 1.2, -3.0], dtype=torch.float64)
    keys = rsd.shifted_keys(g, parent)
    assert torch.allclose(keys.max(dim=1).values, parent)
    assert torch.equal(torch.argsort(keys[1]), torch.argsort(g[1]))  # the shift keeps each row's order
    assert torch.isinf(keys[0, :10]).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rsd_s_trees_are_beams_in_draw_order(tiny, temperature):
    """At most W nodes a level, L levels; siblings in descending key order (the order they are verified in), every
    node's key at most its parent's; greedy, exactly ar's tokens."""
    config = DEFAULTS["rsd-s"].with_(k_config=(3, 1, 1, 1), fallback="off")
    engine = build_engine(tiny, config, SamplingConfig(temperature=temperature, seed=5))
    engine.start(tiny.tokenizer.encode(PROMPT), 24)
    trace = engine.run()
    for step in trace.steps:
        nodes = {n.id: n for n in step.nodes}
        assert max(n.depth for n in step.nodes) <= 4
        for depth in range(1, 5):
            assert sum(1 for n in step.nodes if n.depth == depth) <= 3
        for n in step.nodes:
            if n.parent is None:
                continue
            key = n.provenance["gumbel_key"]
            siblings = [s for s in step.nodes if s.parent == n.parent]
            assert [s.provenance["gumbel_key"] for s in siblings] == sorted(
                (s.provenance["gumbel_key"] for s in siblings), reverse=True)
            if n.parent != 0 and temperature > 0:
                assert key <= nodes[n.parent].provenance["gumbel_key"] + 1e-9
    assert trace.settings["plugins"][0]["method"] == "rsd-s"
    if temperature == 0.0:
        plain = build_engine(tiny, DEFAULTS["ar"], SamplingConfig())
        plain.start(tiny.tokenizer.encode(PROMPT), 24)
        assert trace.generated_ids == plain.run().generated_ids


def test_rsd_s_refuses_a_rule_that_would_not_be_lossless(tiny):
    config = DEFAULTS["rsd-s"].with_(verifier="rrs-replacement", fallback="off")
    engine = build_engine(tiny, config, SamplingConfig(temperature=1.0))
    engine.start(tiny.tokenizer.encode(PROMPT), 8)
    with pytest.raises(EngineError, match="only rrs verifies"):
        engine.step()


def test_the_verifiers_command_compares_every_rule_and_rsd_s_on_the_same_budget(capsys):
    from explorer.cli.main import main

    assert main(["verifiers", "--models", "tiny", "--prompt", PROMPT, "--max-new-tokens", "12", "--temperatures",
                 "1.0", "--k-config", "3,1,1", "--no-chat-template"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by = {(r["method"], r["verifier"]): r for r in rows if "skipped" not in r}
    assert {("mcsd", v) for v in ("rrs", "rrs-replacement", "mcns", "spectr")} <= set(by)
    assert [r["label"] for r in rows if "skipped" in r] == ["spechub"]  # three drafts a node: not SpecHub's
    assert by["rsd-s", "rrs"]["tree_nodes"] == by["mcsd", "rrs"]["tree_nodes"] == 9
    assert all(r["generated_tokens"] == 12 and r["target_calls"] > 0 for r in by.values())
    # the paired figure: each run's trees under every rule of its drawing law, itself first
    assert list(by["mcsd", "spectr"]["same_drafts"]) == ["spectr", "rrs-replacement"]
    assert list(by["mcsd", "rrs"]["same_drafts"]) == ["rrs", "mcns"]
    assert list(by["rsd-s", "rrs"]["same_drafts"]) == ["rrs", "mcns"]
    assert all(1.0 <= x <= 4.0 for r in by.values() for x in r["same_drafts"].values())  # 3 levels + the bonus
    assert main(["generate", "--models", "tiny", "--method", "rsd-s", "--beam", "2", "--depth", "5", "--prompt",
                 PROMPT, "--max-new-tokens", "8", "--json"]) == 0


def test_bench_labels_name_a_rule_and_a_tree():
    from explorer.analysis.bench import method_for_label

    config = method_for_label("mcsd+k_config=4-1-1-1+verifier=spectr")
    assert config.k_config == (4, 1, 1, 1) and config.verifier == "spectr" and config.max_nodes() == 16
    assert method_for_label("rsd-s+k_config=8-1-1-1").max_nodes() == 32


def test_peer_rules_are_the_rules_of_the_same_drawing_law():
    from explorer.analysis.rules import peer_rules

    assert peer_rules("rrs-replacement") == ["rrs-replacement", "spectr"]
    assert peer_rules("spectr") == ["spectr", "rrs-replacement"]
    assert peer_rules("rrs") == ["rrs", "mcns"]
    assert peer_rules("spechub") == ["spechub"]


@pytest.mark.parametrize("k_config, verifier", [((1, 1, 1), "spectr"), ((3, 1), "rrs-replacement")])
def test_same_drafts_values_the_runs_own_trees_as_the_run_does(tiny, k_config, verifier):
    """The observer's value of a run's trees under the run's own rule is the engine's own expectation, step by step;
    on chains (one draft a node) K-SEQ's rho* is 1, so SpecTr and RRS with replacement are the same test."""
    from explorer.analysis.rules import SameDrafts, peer_rules

    observer = SameDrafts(peer_rules(verifier))
    engine = build_engine(tiny, DEFAULTS["mcsd"].with_(k_config=k_config, verifier=verifier, fallback="off"),
                          SamplingConfig(temperature=1.0, seed=3))
    engine.parts.observers.append(observer)
    engine.start(tiny.tokenizer.encode(PROMPT), 24)
    trace = engine.run()
    drafted = [s for s in trace.steps if s.nodes]
    assert observer.steps == len(drafted) > 3
    assert observer.totals[verifier] == pytest.approx(sum(s.expected_tokens for s in drafted), rel=1e-9)
    other = observer.totals["rrs-replacement" if verifier == "spectr" else "spectr"]
    if max(k_config) == 1:
        assert other == pytest.approx(observer.totals[verifier], rel=1e-6)
    else:
        assert other != pytest.approx(observer.totals[verifier], rel=1e-6)


def test_the_paired_figure_groups_each_runs_trees():
    from explorer.trace.figures import same_drafts_figure

    rows = [{"label": "spectr", "same_drafts": {"spectr": 2.1, "rrs-replacement": 2.0}},
            {"label": "rrs", "same_drafts": {"rrs": 2.5, "mcns": 1.5}},
            {"label": "spechub", "same_drafts": {"spechub": 2.2}}, {"label": "mcns", "skipped": "why"}]
    fig = same_drafts_figure(rows)
    assert [t.name for t in fig.data] == ["SpecTr K-SEQ", "RRS with replacement (SpecInfer)",
                                          "RRS without replacement (RSD-C)", "MCNS"]
    assert list(fig.data[0].y) == ["SpecTr's trees"] and list(fig.data[0].x) == [2.1]
    assert same_drafts_figure([{"label": "rrs", "same_drafts": {}}]) is None
