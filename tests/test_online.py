"""Online adaptation of the stop policy (explorer/engine/stop_models/online.py): the ROC refit, the last-layer refit,
the engine and trace plumbing, and that adapting changes only how much is drafted (greedy output identical; the
sampled law is audited in test_audit.py)."""

import json

import numpy as np
import pytest
import torch

from explorer.analysis.bench import method_for_label
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.policies.stopping import make_stop_policy
from explorer.engine.sampling import SamplingConfig
from explorer.engine.stop_models.model import DecisionMLP, DecisionModel
from explorer.engine.stop_models.online import AdaptError, OnlineAdapter, roc_threshold
from explorer.instruments.replay import ReplayError, replay_steps
from explorer.trace.records import RunTrace

PROMPT = "def add(a, b):"


def test_roc_threshold_separates_and_weighs_misses():
    scores = np.array([0.1, 0.2, 0.3, 0.6, 0.7, 0.9])
    soft = np.array([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    t = roc_threshold(scores, soft)
    assert 0.3 < t <= 0.6  # the cut between the classes
    # overlapping classes: missing an accepted token costs more -> the threshold can only go down
    soft = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert roc_threshold(scores, soft, fnr_cost=3.0) <= roc_threshold(scores, soft, fnr_cost=1.0)
    assert roc_threshold(scores, np.ones(6)) is None  # no rejection seen yet: nothing to refit from


def _toy_model(bias: float) -> DecisionModel:
    torch.manual_seed(0)
    net = DecisionMLP(11, (8, 4))
    with torch.no_grad():
        net.layers[-1].bias.fill_(bias)
    return DecisionModel("dist", net, torch.zeros(11), torch.ones(11), info={"threshold": 0.5})


def test_last_layer_refit_moves_predictions_towards_the_session_and_keeps_the_shipped_model():
    model = _toy_model(bias=3.0)  # predicts acceptance near 0.95 ...
    policy = make_stop_policy("decision", 0.75, model)
    adapter = OnlineAdapter("last-layer", policy)
    gen = torch.Generator().manual_seed(0)
    first = None
    for _ in range(12):  # ... while this session's tokens are accepted 20 % of the time
        dist = torch.randn(20, 11, generator=gen)
        rec = adapter.update(torch.full((20,), 0.2), inputs={"dist": dist})
        first = first or rec
    # pulled towards 0.2 step after step, held back by the prior (the shipped layer counts as evidence too)
    assert first["pred_frozen"] > 0.9 and first["pred_after"] < first["pred_frozen"]
    assert rec["pred_after"] < rec["pred_before"] < first["pred_after"] and rec["pred_after"] < 0.6
    assert rec["weight_shift"] > 0 and rec["records"] == 240 and rec["threshold"] == 0.75  # tau stays
    assert policy.model is not model and float(model.predict(dist=dist).mean()) > 0.9  # the shipped copy untouched
    # the prior holds the layer near the shipped one when the data say little
    weak = OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)), prior=1e6)
    rec = weak.update(torch.full((20,), 0.2), inputs={"dist": torch.randn(20, 11, generator=gen)})
    assert rec["weight_shift"] < 1e-3 and rec["pred_after"] > 0.9


def test_threshold_refit_follows_the_session():
    policy = make_stop_policy("confidence", 0.3, None)
    adapter = OnlineAdapter("threshold", policy)
    scores = torch.tensor([0.1, 0.2, 0.4, 0.5, 0.8, 0.9] * 4)
    soft = (scores > 0.45).float()  # this session: only tokens the draft is sure of pass
    rec = adapter.update(soft, scores=scores)
    assert rec["threshold"] == policy.threshold and 0.4 < policy.threshold <= 0.5


def test_modes_that_cannot_adapt_a_policy_are_clear_errors():
    with pytest.raises(ValueError, match="path product"):
        MethodConfig(method="mcsd-improved", stop="specdec++", adapt="threshold")
    with pytest.raises(ValueError, match="reads no decision model"):
        MethodConfig(method="mcsd-improved", stop="confidence", adapt="last-layer")
    with pytest.raises(ValueError, match="has none"):
        MethodConfig(method="mcsd", adapt="threshold")
    with pytest.raises(ValueError, match="unknown adaptation"):
        MethodConfig(method="mcsd-improved", adapt="sometimes")
    with pytest.raises(AdaptError):
        OnlineAdapter("last-layer", make_stop_policy("confidence", 0.3, None))


def test_bench_labels_carry_settings():
    cfg = method_for_label("mcsd-improved+adapt=last-layer")
    assert cfg == DEFAULTS["mcsd-improved"].with_(adapt="last-layer")
    cfg = method_for_label("hybrid+decision_model=path+threshold=0.6")
    assert (cfg.method, cfg.decision_model, cfg.threshold) == ("hybrid", "path", 0.6)
    for bad in ("mcsd-improved+adapt", "mcsd-improved+colour=red", "nope+adapt=threshold"):
        with pytest.raises(ValueError):
            method_for_label(bad)


def _run(tiny, cfg, temperature=0.0, n=48):
    e = build_engine(tiny, cfg, SamplingConfig(temperature=temperature, seed=3))
    e.start(tiny.tokenizer.encode(PROMPT), n)
    return e, e.run()


@pytest.mark.parametrize("adapt,stop", [("threshold", "decision"), ("threshold", "confidence"),
                                        ("last-layer", "prune"), ("last-layer", "specdec++"),
                                        ("last-layer", "goodput")])
def test_adaptation_changes_drafting_not_the_greedy_output(tiny, adapt, stop):
    base = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop=stop, threshold=0.3)
    _, frozen = _run(tiny, base)
    engine, adapted = _run(tiny, base.with_(adapt=adapt))
    assert adapted.generated_ids == frozen.generated_ids  # greedy: the target decides every token
    drafted = [s for s in adapted.steps if s.drafted]  # not the last step where the room left is one token
    recs = [s.adaptation for s in drafted]
    assert all(r["mode"] == adapt for r in recs) and not any(s.adaptation for s in frozen.steps)
    assert recs[-1]["records"] == min(512, sum(r["tokens"] for r in recs)) > 16
    if adapt == "threshold":
        assert len({r["threshold"] for r in recs}) > 1  # the refit moved it during the run
        # the stop signals of later steps compare against the refitted threshold
        i = max(i for i, s in enumerate(adapted.steps) if s.stop_signals)
        assert adapted.steps[i].stop_signals[0].threshold == pytest.approx(adapted.steps[i - 1].adaptation["threshold"])
    else:
        assert recs[-1]["weight_shift"] > 0 and recs[-1]["pred_after"] != recs[-1]["pred_frozen"]
        assert engine.parts.stop_policy.model is not engine.parts.decision_model
    assert any(seg["phase"] == "stop-policy adaptation" for seg in drafted[-1].timeline)


def test_adaptive_runs_round_trip_and_replay(tiny):
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.3,
                       adapt="last-layer")
    _, trace = _run(tiny, cfg, temperature=0.8, n=32)
    back = RunTrace.from_dict(trace.to_dict())
    assert back.steps[3].adaptation == trace.steps[3].adaptation
    assert back.settings["method"]["adapt"] == "last-layer"
    for i, engine in replay_steps(tiny, back, len(back.steps) - 1):  # the adapter evolves the same way again
        assert engine.trace.steps[i].adaptation == back.steps[i].adaptation
    assert engine.state.committed[engine.state.n_prompt:] == back.generated_ids


def test_an_adapter_state_carries_exactly_and_refuses_what_does_not_fit():
    gen = torch.Generator().manual_seed(1)
    first = OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)))
    for _ in range(3):
        first.update(torch.rand(20, generator=gen), inputs={"dist": torch.randn(20, 11, generator=gen)})
    state = json.loads(json.dumps(first.state()))  # plain data, through JSON as a trace file holds it
    nxt = OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)), carried=state)
    probe = torch.randn(7, 11, generator=gen)
    assert nxt.carried == 60 and list(nxt.labels) == list(first.labels)
    assert torch.equal(nxt.policy.model.predict(dist=probe), first.policy.model.predict(dist=probe))
    assert not torch.equal(nxt.frozen.predict(dist=probe), nxt.policy.model.predict(dist=probe))  # shipped: prior
    labels, inputs = torch.rand(20, generator=gen), {"dist": torch.randn(20, 11, generator=gen)}
    assert nxt.update(labels, inputs=inputs) == first.update(labels, inputs=inputs)  # the same learner from here on
    threshold = OnlineAdapter("threshold", make_stop_policy("confidence", 0.3, None))
    scores = torch.linspace(0, 1, 24)
    threshold.update((scores > 0.6).float(), scores=scores)
    moved = OnlineAdapter("threshold", make_stop_policy("confidence", 0.3, None), carried=threshold.state())
    assert moved.policy.threshold == threshold.policy.threshold != 0.3 and moved.carried == 24
    # another model, mode or policy, or a malformed state: a clear error, nothing half-restored
    other = _toy_model(-1.0)
    bad_states = [state | {"labels": state["labels"][:-1]}, state | {"labels": [2.0] * 60},
                  state | {"acts": [[0.0] * 3] * 60}, state | {"theta": None}, {"mode": "last-layer"}]
    for bad in bad_states:
        with pytest.raises(AdaptError, match="malformed"):
            OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)), carried=bad)
    for policy, carried in ((make_stop_policy("decision", 0.75, other), state),
                            (make_stop_policy("prune", 0.75, _toy_model(3.0)), state),
                            (make_stop_policy("decision", 0.75, _toy_model(3.0)), threshold.state())):
        with pytest.raises(AdaptError, match="cannot start"):
            OnlineAdapter("last-layer", policy, carried=carried)


def test_the_next_run_starts_from_what_the_last_one_learned_and_replays(tiny):
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.3,
                       adapt="last-layer")
    first, before = _run(tiny, cfg, temperature=0.8, n=32)
    carried = first.carried()
    state = carried.adapter
    assert "adaptation_carried" not in before.settings
    assert state["key"] and len(state["labels"]) == first.parts.adapter.summary()["records"] > 16
    nxt = build_engine(tiny, cfg, SamplingConfig(temperature=0.8, seed=9), carried=carried)  # the seed may differ
    nxt.start(tiny.tokenizer.encode("def g(y):"), 24)
    trace = nxt.run()
    assert nxt.parts.adapter.carried == len(state["labels"]) and trace.settings["adaptation_carried"] == state
    assert trace.steps[0].adaptation["records"] == len(state["labels"]) + trace.steps[0].adaptation["tokens"]
    from explorer.trace.figures import adaptation_figure  # the first step drafted with tau: a layer carries, not tau

    assert adaptation_figure(trace).data[0].y[0] == cfg.threshold
    # learned under other settings: not used
    for other in (build_engine(tiny, cfg, SamplingConfig(temperature=0.0, seed=3), carried=carried),
                  build_engine(tiny, cfg.with_(max_depth=4), SamplingConfig(temperature=0.8, seed=3),
                               carried=carried),
                  build_engine(tiny, cfg.with_(adapt="threshold"), SamplingConfig(temperature=0.8),
                               carried=carried)):
        assert other.parts.adapter.carried == 0
    back = RunTrace.from_dict(json.loads(json.dumps(trace.to_dict())))
    for i, engine in replay_steps(tiny, back, len(back.steps) - 1):  # a replay starts from the carried state too
        assert engine.trace.steps[i].adaptation == back.steps[i].adaptation
    back.settings["adaptation_carried"] = {**state, "acts": state["acts"][:3]}
    with pytest.raises(ReplayError, match="malformed"):
        next(replay_steps(tiny, back, 0))


def test_a_refit_weighs_each_token_by_the_chance_its_test_happened():
    from explorer.engine.tree import DraftTree
    from explorer.engine.verify.expectation import NodeOdds, tested_probs

    # anchor -> a (tested first), b; a -> c -> d: P(tested) multiplies acceptances down the path, and b is tested
    # only when a was rejected
    tree = DraftTree()
    tree.add_level([-1, -1], [1, 2])
    tree.add_level([0], [3])
    tree.add_level([2], [4])
    odds = {0: NodeOdds(0.6, 0.6, 0), 1: NodeOdds(0.5, 0.5, 1), 2: NodeOdds(0.5, 0.5, 0), 3: NodeOdds(1.0, 1.0, 0)}
    assert tested_probs(tree, odds) == pytest.approx({0: 1.0, 1: 0.4, 2: 0.6, 3: 0.3})
    greedy = {0: NodeOdds(0.0, 0.0, 0), 1: NodeOdds(1.0, 1.0, 1), 2: NodeOdds(1.0, 1.0, 0), 3: NodeOdds(1.0, 1.0, 0)}
    assert tested_probs(tree, greedy) == {0: 1.0, 1: 1.0, 2: 0.0, 3: 0.0}  # nothing below a rejection is tested
    # tokens of weight 0 leave the refit as if they had never been seen
    gen = torch.Generator().manual_seed(2)
    dist, labels = torch.randn(40, 11, generator=gen), torch.rand(40, generator=gen)
    keep = torch.arange(40) % 2 == 0
    weighted = OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)))
    weighted.update(labels, inputs={"dist": dist}, weights=keep.float())
    alone = OnlineAdapter("last-layer", make_stop_policy("decision", 0.75, _toy_model(3.0)))
    alone.update(labels[keep], inputs={"dist": dist[keep]})
    probe = torch.randn(5, 11, generator=gen)
    assert torch.allclose(weighted.policy.model.predict(dist=probe), alone.policy.model.predict(dist=probe), atol=1e-6)
