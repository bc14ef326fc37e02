"""The step's timeline: contiguous segments that account for the step's wall time, measured from
outside, with each forward's query rows; run totals and plain decoding's estimate; old and malformed traces."""

import json
import time

import pytest

from explorer.cli.main import main
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.runtime.timeline import PHASES, phase_totals, plain_decoding_ms
from explorer.engine.sampling import SamplingConfig
from explorer.trace.records import RunTrace, TraceError


@pytest.mark.parametrize("cfg", [MethodConfig(method="mcsd", k_config=(3, 2)), DEFAULTS["mcsd-improved"],
                                 DEFAULTS["hybrid"], DEFAULTS["ar"]], ids=lambda c: c.method)
def test_segments_partition_the_step_and_account_for_its_wall_time(tiny, cfg):
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=1.0, seed=1))
    eng.start(tiny.tokenizer.encode("def add(a, b):\n    return"), 24)
    wall = parts = 0.0
    while not eng.finished:
        t0 = time.perf_counter()
        step = eng.step()
        wall += (time.perf_counter() - t0) * 1e3
        segs = step.timeline
        parts += sum(s["ms"] for s in segs)
        assert segs[0]["phase"] == "drafting"
        # then the commit and the record; what the observers learn from the step closes it
        after = [s["phase"] for s in segs[[s["phase"] for s in segs].index("trace recording"):]]
        assert after[0] == "trace recording" and set(after[1:]) <= {"drafter learn", "stop-policy adaptation"}
        assert {s["phase"] for s in segs} <= set(PHASES)
        for a, b in zip(segs, segs[1:]):
            assert b["start_ms"] == pytest.approx(a["start_ms"] + a["ms"], abs=1e-6)
        forwards = [s for s in segs if s["phase"].endswith("forward")]
        assert sum(1 for s in forwards if s["phase"] == "draft forward") == step.draft_calls
        assert sum(1 for s in forwards if s["phase"] == "target forward") == step.target_calls
        n = len(step.nodes) - 1
        target = [s for s in forwards if s["phase"] == "target forward"]
        if target:  # the tree's rows plus the committed tokens the target had not cached
            assert target[0]["rows"] >= n and target[0]["rows"] == len(step.mask_node_ids)
    assert 0.95 * wall <= parts <= wall  # the parts miss only the calls around the step


def test_run_totals_and_plain_decoding_estimate(tiny):
    eng = build_engine(tiny, DEFAULTS["sd"], SamplingConfig())
    eng.start(tiny.tokenizer.encode("x = 1"), 16)
    steps = eng.run().steps
    totals = phase_totals(steps)
    assert list(totals)[0] == "drafting" and totals["target forward"] > 0
    assert sum(totals.values()) == pytest.approx(sum(seg["ms"] for s in steps for seg in s.timeline))
    tokens = sum(len(s.committed_ids) for s in steps)
    assert plain_decoding_ms(steps, one_row_ms=10.0) == 10.0 * tokens
    assert plain_decoding_ms(steps) is None or plain_decoding_ms(steps) > 0  # sd verifies 5 rows: maybe none small
    ar = build_engine(tiny, DEFAULTS["ar"], SamplingConfig())
    ar.start(tiny.tokenizer.encode("x = 1"), 8)
    ar_steps = ar.run().steps
    assert plain_decoding_ms(ar_steps) == pytest.approx(
        min(seg["ms"] for s in ar_steps for seg in s.timeline if seg["phase"] == "target forward") * 8)


def test_old_traces_load_and_malformed_timelines_are_refused(tiny):
    eng = build_engine(tiny, DEFAULTS["mcsd"], SamplingConfig())
    eng.start(tiny.tokenizer.encode("x"), 4)
    d = eng.run().to_dict()
    old = json.loads(json.dumps(d))
    old["schema_version"] = 1  # written before timelines were recorded (trace/schema.py upgrades it)
    for s in old["steps"]:
        s.pop("timeline")
    assert RunTrace.from_dict(old).steps[0].timeline == []
    d["steps"][0]["timeline"] = [{"phase": "drafting"}]
    with pytest.raises(TraceError, match="timeline"):
        RunTrace.from_dict(d)


def test_timeline_command(capsys):
    assert main(["timeline", "--models", "tiny", "--prompt", "def f(x):", "--method", "mcsd", "--max-new-tokens",
                 "8", "--no-chat-template", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == len(out["per_step"]) > 0 and 0 < out["worst_ratio"] <= 1.0
    assert 0.95 * out["wall_ms"] <= out["sum_of_parts_ms"] <= out["wall_ms"]


def test_a_step_that_raises_leaves_no_open_timeline(tiny):
    """An edit hook that fails mid-step: the error reaches the caller and the engine holds no half-open timeline
    (on CUDA with count_syncs, the process-wide sync debug mode is switched off again)."""
    eng = build_engine(tiny, DEFAULTS["sd"], SamplingConfig(temperature=0.0), count_syncs=True)
    eng.start(tiny.tokenizer.encode("def add(a, b):"), 8)

    def broken(engine, drafted):
        raise RuntimeError("edit failed")

    with pytest.raises(RuntimeError, match="edit failed"):
        eng.step(edit=broken)
    assert eng.forwards.timeline is None and eng.trace.steps == []
