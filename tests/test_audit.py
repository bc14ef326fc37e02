"""Statistical tests (fixed seeds) that every lossless verification rule samples exactly from the target, and that
the audit has the power to catch Lu et al.'s lossy longest-branch rule at the same sample size."""

import json
import math

import pytest
import torch
from method_grid import AUDIT_SAMPLES

from explorer.analysis.audit import MIN_EXPECTED, audit, compare
from explorer.cli.main import main
from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig, logits_to_probs

N = AUDIT_SAMPLES  # the lossy rule's test below is the evidence that this many samples still catch a biased rule
PROMPT = "def f(x):\n    return"
# Contexts tried in order until one has the property a case needs (never an accident of the tiny pair's logits).
CANDIDATES = [PROMPT, "The capital of France is", "def add(a, b):", "x = ", "import numpy as np\n", "Hello, ",
              "for i in range(", "Once upon a time", "SELECT * FROM", "1, 2, 3, "]
MIN_CATEGORIES = 4  # tested first tokens: chi-square with at least 3 degrees of freedom from real categories

LOSSLESS = [
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs"), 1.0, 1.0),
    (MethodConfig(method="mcsd", k_config=(3, 1), verifier="rrs"), 0.7, 0.9),
    (MethodConfig(method="mcsd", k_config=(3, 1), verifier="rrs-replacement"), 1.0, 0.9),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs-replacement"), 0.7, 1.0),
    (MethodConfig(method="mcsd", k_config=(3, 2), verifier="mcns"), 1.0, 1.0),
    (MethodConfig(method="mcsd", k_config=(2, 1), verifier="mcns"), 0.7, 0.9),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="spechub"), 1.0, 0.9),
    (MethodConfig(method="mcsd", k_config=(2, 2, 2), verifier="spechub"), 0.7, 1.0),
    (MethodConfig(method="sd", gamma=3, verifier="rrs"), 1.0, 1.0),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs", branch_threshold=0.4), 0.7, 1.0),
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="confidence", threshold=0.1), 0.7, 0.9),
    # a learned stop policy that prunes branches (the tiny pair's shipped decision model) is still lossless
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="prune", threshold=0.35), 1.0, 1.0),
    # online adaptation moves the stop policy from sample to sample (the adapter outlives the audit's rewinds)
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="prune", threshold=0.35,
                  adapt="last-layer"), 1.0, 1.0),
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="confidence", threshold=0.1,
                  adapt="threshold"), 0.7, 0.9),
    # the goodput rule (expected tokens against cost) under an adapting model
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="goodput", threshold=0.1,
                  adapt="last-layer"), 0.7, 1.0),
    # the root width chosen online from what earlier samples measured (the chooser outlives the audit's rewinds)
    (MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=4, stop="confidence", threshold=0.1,
                  tree_choice="online"), 0.7, 0.9),
    # free drafters: deterministic proposals tested with the point-mass stage (alone and after model children)
    (MethodConfig(method="prompt-lookup"), 1.0, 1.0),
    (MethodConfig(method="prompt-lookup"), 0.7, 0.9),
    (MethodConfig(method="token-recycling"), 1.0, 0.9),
    (MethodConfig(method="token-recycling"), 0.7, 1.0),
    (MethodConfig(method="hybrid", k_config=(2,), max_depth=3, stop="none"), 1.0, 1.0),
    (MethodConfig(method="hybrid", k_config=(2,), max_depth=3, stop="none"), 0.7, 0.9),
    # the bundled plugins (explorer/plugins/bundled/): SpecTr's K-SEQ on i.i.d. drafts, RSD-S's stochastic beam tree
    (MethodConfig(method="mcsd", k_config=(3, 2), verifier="spectr"), 1.0, 1.0),
    (MethodConfig(method="mcsd", k_config=(2, 2), verifier="spectr"), 0.7, 0.9),
    (MethodConfig(method="rsd-s", k_config=(4, 1, 1)), 1.0, 1.0),
    (MethodConfig(method="rsd-s", k_config=(3, 1, 1)), 0.7, 0.9),
    # PEARL: drafts carried from one round to the next, the first new draft tested with no row of its own
    (MethodConfig(method="pearl", gamma=3), 1.0, 1.0),
    (MethodConfig(method="pearl", gamma=2), 0.7, 0.9),
]


# The fast tier audits one case of each verification rule and a free drafter; the rest are marked slow.
FAST_CASES = (0, 2, 4, 6, 8, 16, 22, 24)


@pytest.mark.parametrize("case", [pytest.param(i, marks=() if i in FAST_CASES else pytest.mark.slow)
                                  for i in range(len(LOSSLESS))],
                         ids=[f"{c.method}-{c.verifier}-{c.k_config}-{c.stop}-{c.adapt}-{c.tree_choice}-T{t}-p{p}"
                              for c, t, p in LOSSLESS])
def test_lossless_rules_pass_the_audit(tiny, case):
    cfg, temperature, top_p = LOSSLESS[case]
    # sample s uses seed + s: disjoint seed ranges keep the cases' samples independent of each other
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=100_000 * (case + 1))

    def usable(ids):
        if _tested_categories(tiny, ids, sampling) < MIN_CATEGORIES:
            return False
        if cfg.spec.free and not _first_step_proposes_free(tiny, cfg, ids):
            return False  # the free drafter must have something to say in this context
        # adaptive width: the second token's node must really be narrowed sometimes, and not always
        return cfg.branch_threshold == 1.0 or _depth1_widths(tiny, cfg, temperature, ids) == {1, cfg.k_config[1]}

    ids = next((ids for ids in map(tiny.tokenizer.encode, CANDIDATES) if usable(ids)), None)
    assert ids is not None, f"no candidate context has {MIN_CATEGORIES} testable first tokens for this case"
    r = audit(tiny, cfg, sampling, ids, N)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    # TV distance as an effect size: a flat law over many tokens has a larger TV under the null hypothesis itself;
    # four standard deviations of the null's TV above its mean (at a few hundred samples few categories are tested, and
    # the TV's spread about its mean is wide: 1.5 times the mean failed a lossless case whose chi-square passed)
    null_tv, null_sd = _null_tv(r.first.exact, N), _null_tv_sd(r.first.exact, N)
    assert r.first.tv_distance < max(0.06, null_tv + 4 * null_sd), (r.first.tv_distance, null_tv, null_sd)
    real = [c for c, p in zip(r.first.categories, r.first.exact) if p * N >= MIN_EXPECTED]
    assert len(real) >= MIN_CATEGORIES and r.pairs.dof >= 3  # the test really spans several categories
    if cfg.adapt != "off":  # the policy really changed during the audit
        a = r.adaptation
        assert a["records"] > 100 and (a.get("weight_shift", 0) > 0.01 or a["threshold"] != a["start_threshold"]), a


def _null_tv(exact, n) -> float:
    """Expected TV distance between the exact law and an empirical one of ``n`` samples drawn from it (normal
    approximation: E|X - np| = sqrt(2 np(1-p) / pi) per category)."""
    return 0.5 * sum(math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in exact)


def _null_tv_sd(exact, n) -> float:
    """Standard deviation of that TV distance (normal approximation, categories taken as independent: |X - np| is
    half-normal, variance np(1-p)(1 - 2/pi) per category)."""
    return 0.5 * math.sqrt(sum(p * (1 - p) * (1 - 2 / math.pi) / n for p in exact))


def _tested_categories(tiny, ids, sampling) -> int:
    """First tokens whose probability under the processed target law reaches the audit's expected-count floor."""
    with torch.inference_mode():
        logits = tiny.target(input_ids=torch.tensor([ids])).logits[0, -1, : tiny.vocab_size]
    return int((logits_to_probs(logits, sampling) * N >= MIN_EXPECTED).sum())


def _first_step_proposes_free(tiny, cfg, ids) -> bool:
    """The first step's tree has free (lookup or recycled) children of the anchor."""
    engine = build_engine(tiny, cfg, SamplingConfig(temperature=1.0))
    engine.start(ids, 4)
    return any(n.source in ("lookup", "recycled") and n.depth == 1 for n in engine.step().nodes)


def _depth1_widths(tiny, cfg, temperature, ids, runs=40) -> set:
    """How many children the first-level nodes got over ``runs`` seeds (one step each)."""
    engine = build_engine(tiny, cfg, SamplingConfig(temperature=temperature))
    engine.start(ids, 4)
    widths = set()
    for seed in range(runs):
        engine.rewind(seed)
        step = engine.step()
        depth1 = {n.id for n in step.nodes if n.depth == 1}
        for parent in depth1:
            widths.add(sum(1 for n in step.nodes if n.parent == parent))
    return widths


def test_the_lossy_longest_branch_rule_is_detected(tiny):
    ids = tiny.tokenizer.encode(PROMPT)
    cfg = MethodConfig(method="mcsd-improved", lossy=True, width=3, k_config=(1,), max_depth=3)
    # the seed after the 22 lossless cases this test was measured beside (method_grid.AUDIT_SAMPLES' comment): fixed,
    # so that adding a lossless case does not move it
    r = audit(tiny, cfg, SamplingConfig(temperature=1.0, seed=2_300_000), ids, N)
    assert r.verifier == "longest-branch"
    assert r.first.p_value < 1e-6 and not r.passed
    assert r.first.tv_distance > 0.08


def test_compare_pools_rare_categories_and_flags_impossible_ones():
    exact = {"a": 0.5, "b": 0.3, "c": 0.199, "d": 0.001}
    c = compare({"a": 50, "b": 30, "c": 20}, exact, 100)
    assert c.categories == ["a", "b", "c", "(other)"] and c.counts[-1] == 0
    assert c.p_value > 0.9 and c.tv_distance < 0.01
    bad = compare({"a": 90, "b": 10}, exact, 100)
    assert bad.p_value < 1e-6
    impossible = compare({"a": 99, "z": 1}, {"a": 1.0}, 100)
    assert impossible.p_value == 0.0
    assert all(p * 100 >= MIN_EXPECTED for p in c.exact[:-1])
    # a law that sums to 1 only up to float32 rounding: the same categories and dof however the sum rounded
    for eps in (-3e-7, 0.0, 2e-7):
        r = compare({"a": 60, "b": 40}, {"a": 0.6, "b": 0.4 + eps}, 100)
        assert r.categories == ["a", "b"] and r.dof == 1, (eps, r.categories)


def test_audit_refuses_greedy(tiny):
    with pytest.raises(ValueError, match="temperature"):
        audit(tiny, MethodConfig(method="sd"), SamplingConfig(), tiny.tokenizer.encode("x"), 10)


def test_audit_command_line(capsys):
    rc = main(["audit", "--samples", "300", "--json", "--method", "mcsd", "--k-config", "2,2", "--verifier", "spechub"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["passed"] and out["verifier"] == "spechub" and out["samples"] == 300
    assert main(["audit", "--samples", "10", "--temperature", "0"]) == 2
    assert main(["audit", "--samples", "10", "--verifier", "spechub", "--k-config", "3,1"]) == 2
