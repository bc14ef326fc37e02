"""The goodput fallback (explorer/engine/policies/fallback.py): its decisions from measured rates, plain decoding steps
inside a speculative run (same greedy tokens, same output law, recorded in the trace), and replays that follow the
record."""

import pytest
import torch
from method_grid import AUDIT_SAMPLES, PROMPT

from explorer.analysis.audit import audit
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine, times_verification
from explorer.engine.policies.fallback import GoodputFallback, fallback_active
from explorer.engine.runtime.forward_costs import DEAR_ROWS, verification_cost
from explorer.engine.sampling import SamplingConfig

LOSSLESS = ["sd", "mcsd", "mcsd-improved", "prompt-lookup", "token-recycling", "hybrid"]
SCHEDULE = [True, False, False, True, False, True, True, False] * 8


def _feed(fb: GoodputFallback, steps: int, spec: tuple[int, float], ar: tuple[int, float]) -> list[bool]:
    """Run ``steps`` decisions, observing (tokens, ms) per mode; returns the decisions."""
    out = []
    for i in range(steps):
        s = fb.decide(i)
        fb.observe(s, *(spec if s else ar))
        out.append(s)
    return out


def test_slow_speculation_falls_back_and_probes_less_often():
    fb = GoodputFallback(probe_every=4, max_probe_every=16, warmup=1)
    decisions = _feed(fb, 60, spec=(2, 30.0), ar=(1, 10.0))  # 67 tok/s speculating against 100 plain
    assert decisions[:2] == [True, False]  # measure each mode once
    probes = [i for i in range(2, 60) if decisions[i]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 5 and gaps == [9, 17, 17]  # 4, then 8, then 16 (the cap) plain steps before a probe


def test_fast_speculation_speculates_and_probes_plain_decoding_rarely():
    fb = GoodputFallback(ar_probe_every=10, warmup=1)
    decisions = _feed(fb, 60, spec=(4, 20.0), ar=(1, 10.0))  # 200 tok/s against 100
    plain = [i for i, s in enumerate(decisions) if not s]
    assert plain[0] == 1 and all(b - a == 11 for a, b in zip(plain, plain[1:]))
    assert fb.spec.tok_s == pytest.approx(200.0) and fb.ar.tok_s == pytest.approx(100.0)


def test_a_change_in_the_text_is_noticed():
    fb = GoodputFallback(probe_every=4, warmup=1)
    _feed(fb, 30, spec=(1, 30.0), ar=(1, 10.0))  # speculation loses...
    later = _feed(fb, 40, spec=(8, 30.0), ar=(1, 10.0))  # ...then the text turns into copies
    assert sum(later[-20:]) >= 19


def test_one_good_probe_brings_speculation_back():
    """A slow first speculative step must not keep the run in plain decoding: the probe replaces the stale rate."""
    fb = GoodputFallback(probe_every=4, warmup=1)
    fb.observe(fb.decide(0), 1, 40.0)  # a slow first step (one-off costs): 25 tok/s
    decisions = _feed(fb, 30, spec=(4, 20.0), ar=(1, 10.0))  # then speculation runs at 200 tok/s against 100
    assert decisions[:5] == [False] * 4 + [True] and all(decisions[5:])


def test_a_slow_first_step_is_not_judged_alone():
    """HumanEval on a 2-core AVX2 CPU (a recorded trace): the first step committed 2 tokens in 735 ms, the next
    ones 17 in 1.7 s, plain decoding 1 in 340 ms. With the warm-up the run never leaves speculation but to probe."""
    fb = GoodputFallback(ar_probe_every=10)
    fb.observe(fb.decide(0), 2, 735.0)
    decisions = _feed(fb, 12, spec=(17, 1700.0), ar=(1, 340.0))
    assert decisions[:3] == [True, True, False] and all(decisions[3:]) and fb.decide(12)
    slow = GoodputFallback()  # where speculation does lose, it still falls back once warmed up
    assert _feed(slow, 6, spec=(2, 1000.0), ar=(1, 340.0)) == [True, True, True, False, False, False]


def test_one_unlucky_step_in_a_good_stretch_does_not_switch():
    fb = GoodputFallback(warmup=1)
    _feed(fb, 10, spec=(2, 14.0), ar=(1, 8.0))  # 143 tok/s against 125
    fb.observe(fb.decide(10), 1, 14.0)  # a step that accepted nothing: the average drops to 121 tok/s
    assert fb.margin * fb.ar.tok_s < fb.spec.tok_s < fb.ar.tok_s and fb.decide(11)


def test_a_plain_decoding_probe_does_not_reset_speculations_average():
    fb = GoodputFallback(ar_probe_every=4, warmup=1)
    decisions = _feed(fb, 6, spec=(3, 15.0), ar=(1, 8.0))  # 200 tok/s against 125; step 1 and 6 plain
    assert decisions == [True, False, True, True, True, True] and not fb.decide(6)
    fb.observe(False, 1, 8.0)
    fb.observe(fb.decide(7), 1, 15.0)  # right after the probe, an unlucky step: blended, not the new average
    assert fb.spec.tok_s > fb.margin * fb.ar.tok_s and fb.decide(8)


def test_a_step_that_captured_graphs_is_not_measured():
    """H100: a plain step that captured a CUDA graph took 115 ms (8.7 tok/s against about 170), and the
    hybrid then speculated for the whole run. One-off steps are recorded but do not enter the rates."""
    fb = GoodputFallback(warmup=1)
    record = fb.observe(fb.decide(0), 1, 115.0, one_off="graph capture")
    assert record["unmeasured"] == "graph capture" and fb.spec.tok_s is None and fb.spec.steps == 0
    decisions = _feed(fb, 3, spec=(1, 12.0), ar=(1, 6.0))
    fb.observe(fb.decide(3), 1, 115.0, one_off="graph capture")  # a capture inside plain decoding: its rate stays
    assert decisions == [True, False, False] and fb.ar.tok_s == pytest.approx(1e3 / 6.0) and not fb.decide(4)


def test_auto_is_on_for_cuda_and_for_cpus_where_rows_are_dear():
    asked = []

    def dear(answer):
        return lambda: asked.append(answer) or answer

    assert fallback_active("auto", "cuda", dear(False)) and not fallback_active("auto", "cpu")
    assert fallback_active("auto", "cpu", dear(True)) and not fallback_active("auto", "cpu", dear(False))
    assert asked == [True, False]  # only auto on the CPU measures
    assert fallback_active("goodput", "cpu", dear(False)) and not fallback_active("off", "cuda", dear(True))
    assert asked == [True, False]
    with pytest.raises(ValueError, match="unknown fallback"):
        MethodConfig(method="sd", fallback="sometimes")


def test_ar_and_the_lossy_mode_never_fall_back(tiny):
    for cfg in (DEFAULTS["ar"], MethodConfig(method="mcsd-improved", lossy=True, k_config=(1,), max_depth=3)):
        assert build_engine(tiny, cfg.with_(fallback="goodput"), SamplingConfig(temperature=0.0)).parts.fallback is None
    assert build_engine(tiny, DEFAULTS["sd"].with_(fallback="goodput"), SamplingConfig()).parts.fallback is not None
    # auto, on the CPU
    assert build_engine(tiny, DEFAULTS["sd"], SamplingConfig()).parts.fallback is None, tiny.measured


def test_auto_measures_the_cpu_once_and_falls_back_where_rows_are_dear(tiny, monkeypatch):
    """The tiny pair's 16-row forward costs about what a one-row one does: auto stays off and the measurement is
    cached on the pair; a pair measured dear gets the fallback, and the trace says what was measured."""
    monkeypatch.setattr(tiny, "measured", {})
    cost = verification_cost(tiny)
    assert cost["rows"] == DEAR_ROWS and cost["one_row_ms"] > 0 and not cost["dear"]
    assert verification_cost(tiny) is cost  # measured once per pair
    engine = build_engine(tiny, DEFAULTS["mcsd-improved"], SamplingConfig(temperature=0.0))
    assert engine.parts.fallback is None
    assert engine.start(tiny.tokenizer.encode(PROMPT), 8).model["verification_cost"] == cost
    dear = {**cost, "one_row_ms": 300.0, "rows_ms": 900.0, "ratio": 3.0, "dear": True}
    monkeypatch.setitem(tiny.measured, "verification_cost", dear)
    for name in LOSSLESS:
        engine = build_engine(tiny, DEFAULTS[name], SamplingConfig(temperature=0.0))
        assert engine.parts.fallback is not None, name
    assert build_engine(tiny, DEFAULTS["ar"], SamplingConfig()).parts.fallback is None
    assert engine.start(tiny.tokenizer.encode(PROMPT), 8).model["verification_cost"]["dear"]
    # what the app asks before it builds an engine, to show a spinner while the machine is timed
    assert times_verification(DEFAULTS["mcsd-improved"], "cpu") and not times_verification(DEFAULTS["ar"], "cpu")
    assert not times_verification(DEFAULTS["sd"], "cuda") and not times_verification(
        DEFAULTS["sd"].with_(fallback="goodput"), "cpu")
    assert times_verification(DEFAULTS["mcsd-improved"].with_(stop="goodput", cost_ratio="measured"), "cuda")


@pytest.mark.parametrize("method", LOSSLESS)
def test_plain_steps_inside_a_run_keep_the_greedy_tokens(tiny, method):
    ids = tiny.tokenizer.encode(PROMPT)
    runs = {}
    for fallback in ("off", "goodput"):
        eng = build_engine(tiny, DEFAULTS[method].with_(fallback=fallback), SamplingConfig(temperature=0.0))
        eng.start(ids, 40)
        if fallback == "goodput":
            eng.parts.fallback.force(SCHEDULE)
        eng.run()
        runs[fallback] = eng
    assert runs["goodput"].state.committed == runs["off"].state.committed
    steps = runs["goodput"].trace.steps
    assert [s.fallback["speculate"] for s in steps] == SCHEDULE[:len(steps)]
    for s in steps:
        if not s.fallback["speculate"]:  # a plain decoding step: no tree, one token, one target call
            assert s.drafted == 0 and s.draft_calls == 0 and len(s.committed_ids) == 1 and s.target_calls == 1
    assert any(s.drafted for s in steps if s.fallback["speculate"])
    assert all(s.fallback == {} for s in runs["off"].trace.steps)


def test_fallback_steps_keep_the_output_law(tiny, monkeypatch):
    """A plain first step, then speculation (the draft model catching up a token it never saw): the first two
    tokens still follow the target's law."""
    monkeypatch.setattr(GoodputFallback, "decide", lambda self, i: i % 2 == 1)
    cfg = MethodConfig(method="sd", gamma=3, fallback="goodput")
    r = audit(tiny, cfg, SamplingConfig(temperature=1.0, seed=11), tiny.tokenizer.encode(PROMPT), AUDIT_SAMPLES)
    assert r.passed, r.summary()


def test_a_replay_follows_the_recorded_decisions(tiny):
    from explorer.instruments.replay import replay_steps

    eng = build_engine(tiny, DEFAULTS["hybrid"].with_(fallback="goodput"), SamplingConfig(temperature=0.8, seed=2))
    eng.start(tiny.tokenizer.encode(PROMPT), 30)
    eng.parts.fallback.force(SCHEDULE)
    eng.run()
    last = len(eng.trace.steps) - 1
    for i, replayed in replay_steps(tiny, eng.trace, last):
        assert replayed.trace.steps[i].fallback["speculate"] == eng.trace.steps[i].fallback["speculate"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_fallback_runs_on_cuda_by_default(tiny_cuda):
    tiny_cuda.graph_runners.clear()  # fresh runners, whatever ran before: the first step captures graphs
    eng = build_engine(tiny_cuda, DEFAULTS["sd"], SamplingConfig(temperature=0.0), kv_cache="static", graphs=True)
    eng.start(tiny_cuda.tokenizer.encode(PROMPT), 40)
    eng.run()
    eng.release()
    assert eng.parts.fallback is not None and all(s.fallback["reason"] for s in eng.trace.steps)
    # the tiny pair's speculation loses on a GPU; a step that captured graphs is recorded but not measured
    assert any(s.fallback["reason"] == "speculation does not pay" for s in eng.trace.steps)
    assert eng.trace.steps[0].fallback.get("unmeasured") == "graph capture"


def test_teach_mode_explains_a_plain_step(tiny):
    from explorer.lessons.teach import explain_step

    eng = build_engine(tiny, DEFAULTS["sd"].with_(fallback="goodput"), SamplingConfig(temperature=0.0))
    eng.start(tiny.tokenizer.encode(PROMPT), 8)
    eng.parts.fallback.force([True, False])
    first, plain = eng.step(), eng.step()
    text = " ".join(explain_step(plain))
    assert "Plain decoding step" in text and "goodput" in text
    assert "Plain decoding step" not in " ".join(explain_step(first))
    assert "CUDA graphs" not in text
    plain.fallback = {**plain.fallback, "unmeasured": "graph capture"}  # as a GPU step that captured one records
    assert "did not count its time" in " ".join(explain_step(plain))


def test_a_replay_continued_past_the_record_follows_the_engines_own_setting(tiny):
    """A CPU run (fallback auto: off) replayed and continued: the steps after the record speculate, no record."""
    recorded = build_engine(tiny, DEFAULTS["sd"].with_(fallback="goodput"), SamplingConfig(temperature=0.0))
    recorded.start(tiny.tokenizer.encode(PROMPT), 30)
    recorded.parts.fallback.force([True, False])
    recorded.run(max_steps=2)
    eng = build_engine(tiny, DEFAULTS["sd"], SamplingConfig(temperature=0.0), follow=recorded.trace)
    eng.start(tiny.tokenizer.encode(PROMPT), 30)
    steps = [eng.step() for _ in range(5)]
    assert [s.fallback.get("speculate") for s in steps] == [True, False, None, None, None]
    assert all(s.drafted for s in steps[2:])


def test_carried_rates_skip_the_warm_up_and_start_in_the_mode_that_paid():
    """H100 MT-bench: a run's loss against plain decoding was its 6-7 speculative steps, the warm-up
    and the probes. Started from the last run's rates, a run where speculation lost starts plain and probes after
    ``probe_every`` plain steps; that probe replaces the carried speculation rate."""
    first = GoodputFallback(probe_every=4)
    _feed(first, 20, spec=(1, 30.0), ar=(1, 10.0))  # speculation at 33 tok/s against 100
    state = first.state()
    assert state["spec"]["ms"] == pytest.approx(30.0) and state["ar"]["tokens"] == pytest.approx(1.0)
    fresh = _feed(GoodputFallback(probe_every=4), 8, spec=(1, 30.0), ar=(1, 10.0))
    assert fresh[:3] == [True] * 3  # without the carry: three speculative steps first
    carried = GoodputFallback(probe_every=4, carried=state)
    assert carried.carried == {"spec_tok_s": pytest.approx(33.33, abs=0.01), "ar_tok_s": pytest.approx(100.0)}
    assert carried.decide(0) is False and carried._last["carried"]
    carried.observe(False, 1, 10.0)
    later = _feed(carried, 8, spec=(4, 20.0), ar=(1, 10.0))  # this prompt copies: speculation at 200 tok/s
    assert later[:4] == [False, False, False, True] and all(later[4:])  # the probe at step 4 replaced 33 tok/s
    assert "carried" not in carried._last


def test_carried_rates_where_speculation_paid_speculate_from_the_first_step():
    state = {"spec": {"tokens": 4.0, "ms": 20.0}, "ar": {"tokens": 1.0, "ms": 10.0}}
    fb = GoodputFallback(ar_probe_every=5, carried=state)
    decisions = _feed(fb, 7, spec=(4, 20.0), ar=(1, 30.0))  # plain decoding got slower on this prompt
    assert decisions == [True] * 5 + [False, True]  # the first plain probe, after 5 speculative steps...
    assert fb.ar.tok_s == pytest.approx(1e3 / 30.0)  # ...replaced the carried plain rate


@pytest.mark.parametrize("bad", [{"spec": {"tokens": 1.0}}, {"ar": {"tokens": 1.0, "ms": 0.0}}, {"spec": [1, 2]},
                                 {"spec": {"tokens": "x", "ms": 1.0}}])
def test_a_malformed_carried_state_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="carried fallback state is malformed"):
        GoodputFallback(carried=bad)


def test_the_engine_carries_rates_only_to_the_same_method_and_sampling(tiny):
    from explorer.lessons.teach import explain_step

    ids = tiny.tokenizer.encode(PROMPT)
    cfg, greedy = DEFAULTS["sd"].with_(fallback="goodput"), SamplingConfig(temperature=0.0)
    first = build_engine(tiny, cfg, greedy)
    first.start(ids, 24)
    first.run()
    carried = first.carried()
    state = carried.fallback
    assert state["rates"] == first.parts.fallback.state() and state["rates"]["spec"] is not None
    assert "fallback_carried" not in first.trace.settings
    nxt = build_engine(tiny, cfg, SamplingConfig(temperature=0.0, seed=5), carried=carried)  # the seed may differ
    nxt.start(ids, 8)
    step = nxt.step()
    assert nxt.trace.settings["fallback_carried"] == nxt.parts.fallback.carried and step.fallback["carried"]
    assert "earlier run of the session" in " ".join(explain_step(step))
    assert "carried" not in nxt.step().fallback
    for other in (build_engine(tiny, cfg.with_(gamma=2), greedy, carried=carried),
                  build_engine(tiny, cfg, SamplingConfig(temperature=0.7), carried=carried),
                  build_engine(tiny, DEFAULTS["mcsd"].with_(fallback="goodput"), greedy, carried=carried)):
        assert other.parts.fallback.carried is None and other.parts.fallback.spec.tok_s is None
    assert build_engine(tiny, DEFAULTS["sd"], greedy, carried=carried).carried().fallback is None  # CPU auto: off


def test_a_probe_of_speculation_is_judged_on_its_steps_together():
    """A hybrid's steps commit a long copy or next to nothing (2-core AVX2 CPU: 1 token in 1.2 s, then 17 in
    2.8 s): a probe lasts ``warmup`` speculative steps and their mean step replaces the stale rate."""
    fb = GoodputFallback(probe_every=4, warmup=3)
    decisions = _feed(fb, 7, spec=(1, 1200.0), ar=(1, 550.0))  # warm-up: speculation loses, then plain decoding
    assert decisions == [True] * 3 + [False] * 4
    first = fb.decide(7)  # the probe: one miss, then a long copy, then an ordinary step
    record = fb.observe(first, 1, 1200.0)
    assert first and record["reason"] == "probing speculation" and fb.spec.tok_s < fb.ar.tok_s  # not judged yet
    assert fb.decide(8) and fb.observe(True, 17, 2800.0)["reason"] == "probing speculation"
    assert fb.decide(9)
    fb.observe(True, 3, 1000.0)
    assert fb.spec.tok_s == pytest.approx(1e3 * 21 / 5000.0)  # 4.2 tok/s against 1.8: speculation pays
    assert fb.decide(10) and fb.probe_every == 4
    lost = GoodputFallback(probe_every=4, warmup=3)  # a probe that loses as a whole doubles the wait
    decisions = _feed(lost, 30, spec=(1, 1200.0), ar=(1, 550.0))
    probes = [i for i in range(3, 30) if decisions[i]]
    assert probes == [7, 8, 9, 18, 19, 20] and lost.probe_every == 16


def test_the_verification_cost_is_timed_in_interleaved_rounds_and_read_by_medians(tiny, monkeypatch):
    """The widths are timed in turn, round after round (a slow spell of the machine lands on every width alike), and
    each width's figure is the median of its rounds: one slow one-row forward out of five does not make rows look
    cheap, nor one fast one make them dear (an AVX-512-BF16 CPU's one-row forward measured 195-370 ms)."""
    from explorer.engine.runtime import forward_costs

    widths: list[int] = []
    one_row = iter([999.0, 100.0, 900.0, 100.0, 100.0, 1.0])  # the warm-up round, then five rounds: median 100
    ms = {2: 110.0, DEAR_ROWS: 160.0}
    clock = {"t": 0.0}

    def forward_and_tick(model, kv, ids, positions, mask, keep=1):  # a forward advances the clock by its ms
        widths.append(len(ids))
        if len(ids) in (1, 2, DEAR_ROWS):  # not the context's prefill
            clock["t"] += (next(one_row) if len(ids) == 1 else ms[len(ids)]) / 1e3

    monkeypatch.setattr(forward_costs, "eager_forward", forward_and_tick)
    monkeypatch.setattr(forward_costs.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(tiny, "measured", {})
    cost = verification_cost(tiny)
    timed = widths[1:]  # after the context's prefill
    assert timed == [1, 2, DEAR_ROWS] * (forward_costs.VERIFICATION_ROUNDS + 1)
    assert cost["one_row_ms"] == pytest.approx(100.0) and cost["rows_ms"] == pytest.approx(160.0)
    assert cost["ratio"] == pytest.approx(1.6) and not cost["dear"]  # below DEAR_RATIO, 60 ms more
