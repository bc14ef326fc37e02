"""Which verification rule accepts more: every rule on the same prompts and tree shape, and RSD-S's beam tree of
about the same number of nodes, as tokens per target call (``spec-explorer verifiers``, the Explorer's rule
comparison). The rules' drafts differ as their drawing laws do (without replacement, i.i.d., SpecHub's pairs); the
prompts, the seeds and the number of draft nodes a step may verify are the same.

Each rule's run follows its own path once a sampled token differs, so two rules' tokens per target call also differ
by where their texts went (at T = 1 a text that drifts off its prompt is drafted worse), not by the rules alone.
The paired figure is ``same_drafts``: every step's drafted tree valued, in expectation over the verifier's draws,
under each rule that assumes the same drawing law (``rrs-replacement`` and ``spectr`` on i.i.d. children, ``rrs``
and ``mcns`` without replacement), on the same p and q rows (``verify/expectation.py``).
"""

from __future__ import annotations

from ..engine.config import DEFAULTS, VERIFIERS, MethodConfig
from ..engine.factory import build_engine
from ..engine.sampling import SamplingConfig
from ..engine.verify import expectation
from ..engine.verify.registry import VERIFIER_REGISTRY
from ..trace.metrics import run_metrics


def peer_rules(verifier: str) -> list[str]:
    """The selectable rules that test children drawn as ``verifier``'s are (``Verifier.draws``), ``verifier`` first:
    the rules that can value the same drafted trees."""
    draws = VERIFIER_REGISTRY[verifier].draws
    peers = [n for n, v in VERIFIER_REGISTRY.items()
             if v.selectable and v.draws == draws and v.odds_rule and n != verifier]
    return [verifier] + peers


class SameDrafts:
    """A step observer (``engine/observers.py``) that values each step's drafted tree under ``rules`` (``peer_rules``)
    on the step's own p and q rows: ``totals[rule]`` sums the expected tokens the step would commit under that rule
    (``expectation.expected_tokens``, bonus token included; for the rule that ran, the value its verification
    computed already), ``steps`` counts the steps that drafted. Notified after the step's clock stops, so its work is
    not timed as the run's."""

    phase, after_clock = "trace recording", True

    def __init__(self, rules: list[str]):
        self.rules, self.totals, self.steps = list(rules), dict.fromkeys(rules, 0.0), 0

    def observe(self, step) -> None:
        tree = step.drafted.tree
        if not step.speculated or not len(tree):
            return
        self.steps += 1
        for rule in self.rules:
            if rule == step.record.verifier:
                self.totals[rule] += step.verified.expected_tokens
                continue
            odds = expectation.node_odds(tree, step.verified.p_rows, step.drafted.q_rows, rule)
            self.totals[rule] += expectation.expected_tokens(tree, odds)


def rule_configs(base: MethodConfig, verifiers=None) -> list[tuple[str, MethodConfig | str]]:
    """``(label, MethodConfig)`` for each verifier (default: every selectable one, ``config.VERIFIERS``) on ``base``'s
    tree where the rule's drawing allows it (``(label, message)`` where it does not, e.g. SpecHub beyond two
    children a node), then ``rsd-s``'s beam tree of about as many nodes (W = nodes / levels, rounded) where the
    bundled plugin is loaded."""
    out: list[tuple[str, MethodConfig | str]] = []
    for verifier in (VERIFIERS if verifiers is None else verifiers):
        try:
            out.append((verifier, base.with_(verifier=verifier)))
        except ValueError as exc:  # TreeShapeError is a ValueError
            out.append((verifier, str(exc)))
    if "rsd-s" in DEFAULTS and base.method != "rsd-s" and base.draft_branching():
        depth = len(base.draft_branching())
        beam = max(1, round(base.max_nodes() / depth))
        out.append(("rsd-s", DEFAULTS["rsd-s"].with_(k_config=(beam,) + (1,) * (depth - 1), fallback=base.fallback)))
    return out


def compare_rules(pair, base: MethodConfig, sampling: SamplingConfig, prompts: list[list[int]], max_new_tokens: int,
                  verifiers=None, repeats: int = 1, progress=lambda done, total: None) -> list[dict]:
    """Run ``rule_configs(base, verifiers)`` on ``prompts`` (token ids), ``repeats`` seeds each (``sampling.seed +
    1000 * repeat + prompt index``), ``max_new_tokens`` each. Returns one row per rule: ``label``, ``method``,
    ``verifier`` (the rule that ran), ``k_config``, ``tree_nodes`` (most draft nodes a step verifies),
    ``generated_tokens``, ``target_calls``, ``tokens_per_target_call``, and ``same_drafts`` ({rule: expected tokens
    per drafting step on this rule's own trees}, for the rule and its ``peer_rules``; empty when greedy); or
    ``label`` and ``skipped`` (why).
    ``progress(done, total)`` after each run. Raises EngineError / ValueError as ``build_engine`` does."""
    configs = rule_configs(base, verifiers)
    runnable = [c for _, c in configs if not isinstance(c, str)]
    total, done, rows = len(runnable) * len(prompts) * repeats, 0, []
    for label, config in configs:
        if isinstance(config, str):
            rows.append({"label": label, "skipped": config})
            continue
        tokens = calls = 0
        rule = config.verifier_for(sampling.greedy)
        paired = SameDrafts([] if sampling.greedy else peer_rules(rule))
        for n, ids in enumerate(prompts):
            for rep in range(repeats):
                run = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                     seed=sampling.seed + 1000 * rep + n)
                engine = build_engine(pair, config, run)
                engine.parts.observers.append(paired)
                engine.start(ids, max_new_tokens)
                m = run_metrics(engine.run())
                tokens += m["generated_tokens"]
                calls += m["target_calls"]
                done += 1
                progress(done, total)
        rows.append({"label": label, "method": config.method, "verifier": rule,
                     "k_config": list(config.k_config), "tree_nodes": config.max_nodes(),
                     "generated_tokens": tokens, "target_calls": calls,
                     "tokens_per_target_call": tokens / calls if calls else None,
                     "same_drafts": {r: t / paired.steps for r, t in paired.totals.items()} if paired.steps else {}})
    return rows
