"""The goodput stop policy's cost ratio r measured from the run's own steps (explorer/engine/policies/cost_ratio.py):
the meter's arithmetic, the setting's validation, an engine run that moves its policy's r (same greedy tokens),
traces that keep it, and replays that follow the record."""

import pytest
from method_grid import AUDIT_SAMPLES, PROMPT

from explorer.analysis.bench import method_for_label
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.policies.cost_ratio import CostRatioMeter
from explorer.engine.policies.stopping import goodput_threshold, recorded_setting
from explorer.engine.sampling import SamplingConfig
from explorer.trace.records import RunTrace, TraceError, loads_run

GOODPUT = MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=6, stop="goodput", threshold=0.3,
                       decision_model="hidden")


def test_the_meter_divides_a_draft_level_by_the_rest_of_a_step():
    m = CostRatioMeter(0.22, alpha=0.5)
    assert m.r == 0.22  # the setting until a step is measured
    rec = m.observe(draft_ms=100.0, draft_calls=2, step_ms=1100.0)  # 50 ms a level, 1000 ms the rest
    assert rec == {"r": 0.22, "level_ms": 50.0, "rest_ms": 1000.0, "row_ms": 0.0, "next": 0.05}
    rec = m.observe(draft_ms=300.0, draft_calls=2, step_ms=800.0)  # 150 / 500: averages 100 / 750
    assert rec["r"] == 0.05 and rec["next"] == pytest.approx(100 / 750, abs=1e-5)
    before = m.r
    rec = m.observe(draft_ms=0.0, draft_calls=0, step_ms=400.0)  # a plain step says nothing about drafting
    assert rec["level_ms"] is None and m.r == before
    assert CostRatioMeter(0.1).observe(900.0, 1, 1000.0)["next"] == 1.0  # clamped to the setting's range
    for bad in ((-0.1, 0.3), (1.5, 0.3), (0.2, 0.0), (0.2, 0.3, -1.0)):
        with pytest.raises(ValueError):
            CostRatioMeter(*bad)


def test_where_rows_are_dear_a_level_is_charged_its_verification_rows():
    """A step of 2 draft levels and 6 tree nodes at 50 ms a row: 300 ms of its verification belong to the levels
    (150 ms each, on top of 50 ms of drafting), not to the rest of the step."""
    rec = CostRatioMeter(0.22, row_ms=50.0).observe(draft_ms=100.0, draft_calls=2, step_ms=1100.0, nodes=6)
    assert rec == {"r": 0.22, "level_ms": 200.0, "rest_ms": 700.0, "row_ms": 50.0, "next": round(200 / 700, 5)}
    assert CostRatioMeter(0.22).observe(100.0, 2, 1100.0, nodes=6)["next"] == 0.05  # rows free: as before


def test_a_replay_takes_the_recorded_ratios():
    m = CostRatioMeter(0.22)
    m.force([0.07, None])
    assert m.observe(100.0, 2, 1100.0)["next"] == 0.07  # forced, whatever was measured
    assert m.observe(100.0, 2, 1100.0)["next"] != 0.07  # None: measured as usual
    assert m.observe(100.0, 2, 1100.0)["next"] == pytest.approx(0.05, abs=1e-4)  # past the record: measured


def test_only_goodput_measures_its_setting():
    assert GOODPUT.with_(cost_ratio="measured").cost_ratio == "measured"
    with pytest.raises(ValueError, match="goodput stop policy"):
        MethodConfig(method="mcsd-improved", stop="decision", cost_ratio="measured")
    with pytest.raises(ValueError, match="unknown cost ratio"):
        GOODPUT.with_(cost_ratio="guessed")
    with pytest.raises(ValueError, match="goodput stop policy"):
        DEFAULTS["sd"].with_(cost_ratio="measured")  # no stop policy at all
    # switching the policy away from goodput drops the measurement with the threshold
    assert GOODPUT.with_(cost_ratio="measured").with_(stop="decision").cost_ratio == "fixed"
    cfg = method_for_label("mcsd-improved+stop=goodput+cost_ratio=measured")
    assert cfg.stop == "goodput" and cfg.cost_ratio == "measured" and cfg.threshold == 0.22


def _run(tiny, cfg, temperature=0.0, n=40, seed=3):
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=temperature, seed=seed))
    eng.start(tiny.tokenizer.encode(PROMPT), n)
    eng.run()
    return eng


def test_a_measured_run_moves_r_and_keeps_the_greedy_tokens(tiny):
    fixed = _run(tiny, GOODPUT)
    measured = _run(tiny, GOODPUT.with_(cost_ratio="measured"))
    assert measured.state.committed == fixed.state.committed  # only how much is drafted may change
    steps = measured.trace.steps
    assert all(s.cost == {} for s in fixed.trace.steps)
    assert steps[0].cost["r"] == 0.3  # the setting, until the first step is measured
    for prev, s in zip(steps, steps[1:]):
        assert s.cost["r"] == prev.cost["next"]  # each step runs on the r its predecessor measured
        if s.stop_signals:  # and its levels' thresholds say so
            assert recorded_setting(s.stop_signals[0]) == pytest.approx(s.cost["r"], abs=1e-6)
            first = s.stop_signals[0]
            assert first.threshold == pytest.approx(goodput_threshold(s.cost["r"], first.forwards, first.expected))
    drafted = [s for s in steps if s.draft_calls]
    assert drafted and all(s.cost["level_ms"] > 0 and s.cost["rest_ms"] > 0 for s in drafted)
    assert measured.parts.stop_policy.threshold == steps[-1].cost["next"]
    from explorer.lessons.teach import explain_step
    from explorer.trace.figures import cost_ratio_figure

    fig = cost_ratio_figure(measured.trace, current=1)
    assert list(fig.data[0].y) == [s.cost["r"] for s in steps]
    assert [y is not None for y in fig.data[1].y] == [s.cost["level_ms"] is not None for s in steps]

    assert "measured, not set" in " ".join(explain_step(steps[-1]))


@pytest.mark.parametrize("joint", [False, True])
def test_measured_ratios_survive_a_saved_trace_and_steer_its_replay(tiny, joint):
    """A joint prefill's first step is not measured: the replay's recorded ratios stay aligned with the steps."""
    from explorer.instruments.replay import replay_steps

    eng = build_engine(tiny, GOODPUT.with_(cost_ratio="measured"), SamplingConfig(temperature=0.8, seed=5),
                       joint_prefill=joint)
    eng.start(tiny.tokenizer.encode(PROMPT), 30)
    eng.run()
    assert bool(eng.trace.steps[0].prefill_rows) == joint
    loaded = loads_run(eng.trace.to_json())
    assert [s.cost for s in loaded.steps] == [s.cost for s in eng.trace.steps]
    last = len(loaded.steps) - 1
    for i, replayed in replay_steps(tiny, loaded, last):  # raises if a replayed step commits other tokens
        assert replayed.trace.steps[i].cost.get("next") == loaded.steps[i].cost.get("next")
        assert [s.threshold for s in replayed.trace.steps[i].stop_signals] == pytest.approx(
            [s.threshold for s in loaded.steps[i].stop_signals])
    bad = eng.trace.to_dict()
    for cost in ({"r": 0.1, "next": "fast"}, {"next": 0.1}, {"r": 0.1, "next": 0.1, "level_ms": "slow"}):
        bad["steps"][1]["cost"] = cost
        with pytest.raises(TraceError, match="cost ratio"):
            RunTrace.from_dict(bad)
    bad["steps"][1]["cost"] = [0.1]
    with pytest.raises(TraceError, match="cost record"):
        RunTrace.from_dict(bad)


def test_an_adapting_run_records_the_measured_r_as_its_next_threshold(tiny):
    from explorer.trace.figures import adaptation_figure

    eng = _run(tiny, GOODPUT.with_(cost_ratio="measured", adapt="last-layer"), n=30)
    steps = eng.trace.steps
    assert all(s.adaptation["threshold"] == s.cost["next"] for s in steps)
    fig = adaptation_figure(eng.trace)
    assert fig.data[0].name == "cost ratio r" and list(fig.data[0].y) == [s.cost["r"] for s in steps]


def test_an_r_that_moves_between_samples_keeps_the_output_law(tiny, monkeypatch):
    """The audit's samples share one engine (its meter outlives the rewinds); here r swings deterministically
    between free draft forwards and costly ones, so the samples are drafted to very different depths."""
    from explorer.analysis.audit import audit

    swing = iter([0.0, 0.9] * 10_000)

    def observe(self, draft_ms, draft_calls, step_ms, nodes=0):
        used, self.r = self.r, next(swing)
        return {"r": used, "level_ms": None, "rest_ms": None, "next": self.r}

    monkeypatch.setattr(CostRatioMeter, "observe", observe)
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="goodput", threshold=0.1,
                       cost_ratio="measured", adapt="last-layer")
    r = audit(tiny, cfg, SamplingConfig(temperature=0.7, seed=31), tiny.tokenizer.encode(PROMPT), AUDIT_SAMPLES)
    assert r.passed, r.summary()
