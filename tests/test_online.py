"""Online adaptation of the stop policy (explorer/decision/online.py): the ROC refit, the last-layer refit, the
engine and trace plumbing, and that adapting changes only how much is drafted (greedy output identical; the
sampled law is audited in test_audit.py)."""

import numpy as np
import pytest
import torch

from explorer.bench import method_for_label
from explorer.config import DEFAULTS, MethodConfig
from explorer.decision.model import DecisionMLP, DecisionModel
from explorer.decision.online import AdaptError, OnlineAdapter, roc_threshold
from explorer.engine import Engine
from explorer.instruments.replay import replay_steps
from explorer.sampling import SamplingConfig
from explorer.stopping import make_stop_policy
from explorer.trace import RunTrace

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
    e = Engine(tiny, cfg, SamplingConfig(temperature=temperature, seed=3))
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
        assert engine.stop_policy.model is not engine.decision_model
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
    assert engine.committed[engine.n_prompt:] == back.generated_ids
