"""The classroom: a step told in phases (pure functions of a trace), lesson files (recorded, validated, replayed),
and the Classroom page opening a lesson with no model loaded."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.lessons import phases
from explorer.lessons.lesson import LessonError, load_lesson, loads_lesson, shipped_lessons
from explorer.lessons.record import LESSON_SPECS, record_lesson
from explorer.trace import figures
from explorer.trace.records import ACCEPTED, CONTEXT, DRAFTED, REJECTED

EMBEDDED = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")


def _run(tiny, config, temperature=0.0, tokens=12, prompt="def f(x):\n    return"):
    engine = build_engine(tiny, config, SamplingConfig(temperature=temperature, seed=3))
    engine.start(tiny.tokenizer.encode(prompt), tokens)
    return engine.run()


@pytest.fixture(scope="module")
def sampled_run(tiny):
    return _run(tiny, MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs"), temperature=1.0)


def test_a_step_is_told_draft_mask_verify_commit(sampled_run):
    for step in sampled_run.steps:
        seq = phases.step_phases(step)
        kinds = [p.kind for p in seq]
        depth = max(n.depth for n in step.nodes)
        assert kinds == ["draft"] * depth + ["mask"] + ["verify"] * (len(seq) - depth - 2) + ["commit"]
        assert [p.level for p in seq[:depth]] == list(range(1, depth + 1))
        tested = [step.nodes[p.node] for p in seq if p.kind == "verify"]
        assert tested and all(n.status in (ACCEPTED, REJECTED) for n in tested)
        assert [n.depth for n in tested] == sorted(n.depth for n in tested)  # the walk goes down
        # while drafting, nodes appear level by level, unjudged, and the mask is the top-left slice of the levels
        first = seq[0]
        shown = phases.shown_status(step, first)
        assert {step.nodes[i].depth for i in shown} == {0, 1}
        assert {s for i, s in shown.items() if i} == {DRAFTED} and shown[0] == CONTEXT
        rows = phases.mask_rows(step, first)
        assert rows == step.mask_node_ids[: len(rows)] and set(rows) <= set(shown)
        # each verify phase reveals one more node; the commit shows every node as recorded
        revealed = [sum(s != DRAFTED for s in phases.shown_status(step, p).values()) for p in seq if p.kind == "verify"]
        assert revealed == sorted(revealed) and len(set(revealed)) == len(revealed)
        assert phases.shown_status(step, seq[-1]) == {n.id: n.status for n in step.nodes}


def test_the_account_says_what_the_phase_shows(sampled_run, tiny):
    rejected = [(s, n) for s in sampled_run.steps for n in s.nodes if n.status == REJECTED and n.residual_top]
    assert rejected, "the sampled run should have a rejection with a residual"
    step, node = rejected[0]
    text = " ".join(phases.account(step, phases.Phase("verify", step.index, node=node.id), greedy=False))
    assert "rejected" in text and "residual" in text and f"{node.u:.2f}" in text
    commit = " ".join(phases.account(step, phases.step_phases(step)[-1], greedy=False))
    assert f"Committed {len(step.committed_ids)} token" in commit
    ar = _run(tiny, DEFAULTS["ar"])
    assert [p.kind for p in phases.step_phases(ar.steps[0])] == ["commit"]
    assert "No draft" in " ".join(phases.account(ar.steps[0], phases.step_phases(ar.steps[0])[0], greedy=True))
    greedy = _run(tiny, MethodConfig(method="sd", gamma=3))
    step = next(s for s in greedy.steps if len(s.nodes) > 1)
    verify = next(p for p in phases.step_phases(step) if p.kind == "verify")
    assert "the target's own top token" in " ".join(phases.account(step, verify, greedy=True))


def test_phase_figures_draw_only_what_the_phase_shows_in_large_type(sampled_run):
    step = sampled_run.steps[0]
    seq = phases.step_phases(step)
    tree = figures.tree_figure(step, shown=phases.shown_status(step, seq[0]), font=18)
    drawn = sum(len(t.x) for t in tree.data if t.mode == "markers+text")
    assert drawn == len(phases.visible_nodes(step, seq[0]))
    assert not any(t.name == "bonus token (from target)" for t in tree.data)  # the bonus comes at the commit
    assert all(t.textfont.size >= 16 for t in tree.data if t.mode == "markers+text")
    assert tree.layout.xaxis.title.font.size >= 16 and tree.layout.legend.font.size >= 16
    final = figures.tree_figure(step, shown=phases.shown_status(step, seq[-1]), font=18)
    assert (step.bonus_token is not None) == any(t.name == "bonus token (from target)" for t in final.data)
    mask = figures.mask_figure(step, rows=phases.mask_rows(step, seq[0]), font=18, height=500)
    assert len(mask.data[0].z) == len(phases.mask_rows(step, seq[0])) < len(step.mask)
    assert mask.layout.yaxis.tickfont.size >= 16


@pytest.fixture(scope="module")
def tiny_lesson(tiny):
    spec = next(s for s in LESSON_SPECS if s.id == "03-temperature-one")
    return record_lesson(tiny, dataclasses.replace(spec, audit_samples=40, max_new_tokens=16), progress=lambda m: 0)


def test_a_recorded_lesson_round_trips_with_its_notes_race_and_audit(tiny_lesson):
    back = loads_lesson(tiny_lesson.to_json())
    assert [r.trace.generated_ids for r in back.runs] == [r.trace.generated_ids for r in tiny_lesson.runs]
    assert back.baseline is not None and back.baseline.settings["method"]["method"] == "ar"
    assert back.baseline.generated_ids and back.audit["samples"] == 40
    assert back.recorded["command"] == "python -m explorer lessons record --only 03-temperature-one"
    marked = [(r, p) for r, p in back.phases() if back.note_at(r, p)]
    assert len(marked) == len(back.notes) >= 1  # every note is shown at exactly one phase
    assert back.notes[-1].text.startswith("The audit sampled")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(lesson_schema=99), "schema version 99"),
    (lambda d: d.pop("title"), "'title'"),
    (lambda d: d.update(runs=[]), "at least one run"),
    (lambda d: d["runs"][0]["trace"].update(schema_version=7), "run 1 of the lesson"),
    (lambda d: d["runs"][0]["trace"]["steps"][0].update(nodes="x"), "run 1 of the lesson"),
    (lambda d: d["notes"].append({"run": 0, "step": 999, "phase": "commit", "text": "x"}), "step 1000"),
    (lambda d: d["notes"].append({"run": 0, "step": 0, "phase": "lunch", "text": "x"}), "'lunch'"),
    (lambda d: d["notes"].append({"run": "one"}), "malformed"),
])
def test_a_malformed_lesson_is_a_clear_error(tiny_lesson, change, message):
    d = json.loads(tiny_lesson.to_json())
    change(d)
    with pytest.raises(LessonError, match=message):
        loads_lesson(json.dumps(d))


def test_unreadable_oversized_and_non_json_lessons_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(LessonError, match="cannot read"):
        load_lesson(tmp_path / "missing.json")
    with pytest.raises(LessonError, match="not valid JSON"):
        loads_lesson(b"{not json")
    monkeypatch.setattr("explorer.lessons.lesson.MAX_LESSON_BYTES", 10)
    with pytest.raises(LessonError, match="limit"):
        loads_lesson(b'{"lesson_schema": 1, "padding": "...."}')


def test_shipped_lessons_cover_the_topics_and_draw_every_phase():
    lessons = [load_lesson(p) for p in shipped_lessons()]
    assert len(lessons) >= 6
    methods = set()
    for lesson in lessons:
        assert lesson.notes and lesson.title and lesson.question and lesson.baseline is not None
        for run in lesson.runs:
            model = run.trace.model
            assert (model["draft_id"], model["target_id"]) == EMBEDDED  # real traces of the embedded pair
            m = run.trace.settings["method"]
            methods.add(m["method"] + (" lossy" if m.get("lossy") else "")
                        + (" T1" if run.trace.settings["sampling"]["temperature"] >= 1 else ""))
        for r, phase in lesson.phases():
            step = lesson.runs[r].trace.steps[phase.step]
            figures.tree_figure(step, shown=phases.shown_status(step, phase), font=16)
            if len(step.nodes) > 1:
                figures.mask_figure(step, rows=phases.mask_rows(step, phase), font=16, height=500)
            assert phases.account(step, phase, greedy=False)
    assert {"mcsd-improved", "sd", "mcsd T1", "prompt-lookup", "mcsd-improved lossy T1"} <= methods
    audits = {lesson.id: lesson.audit for lesson in lessons if lesson.audit}
    assert audits["03-temperature-one"]["passed"]  # lossless at temperature 1
    assert "06-lossy-roots" in audits  # the lossy lesson says what the audit found
    # a head's levels are told as the head's, a draft model's as the draft model's
    head = next(le for le in lessons if le.id == "07-head-features")
    words = {r: " ".join(line for rr, phase in head.phases() if rr == r and phase.kind == "draft"
                         for line in phases.account(head.runs[r].trace.steps[phase.step], phase, greedy=True))
             for r in (0, 1)}
    assert "from the EAGLE-3 head" in words[0] and "the draft model" not in words[0]
    assert "from the draft model" in words[1] and "head" not in words[1]


# Lessons 01-06 (recorded 2026-11-25) have machine lines that name no CPU model; they were recorded on AMD EPYC CPUs
# (they replay there; on a 2-core Intel Xeon with AMX, and on one without, 4 of their 7 runs leave their recordings at
# steps 2-13, and lesson 07's draft-model run at step 1).
UNNAMED_CPU = "AMD EPYC (AVX512)"


def replayable_runs() -> list[tuple]:
    """``(lesson, run index)`` of the shipped lessons' runs this machine can replay step for step, where the pair
    runs in the lesson's dtype: every run on the CPU model it was recorded on (``UNNAMED_CPU`` for lines that name
    none); on another CPU model only runs drafted without a model (prompt lookup, Token Recycling), which read the
    target's choices alone. Another CPU's kernels round otherwise: its int8 draft model draws other trees, and a
    head's bf16 top-k orders near-equal candidates otherwise, so their acceptance lengths differ. Never a run drafted
    by a head a lesson learnt online (not kept: ``lessons/record._mark_learned``)."""
    from explorer.analysis.bench import cpu_label
    from explorer.engine.methods import METHOD_SPECS
    from explorer.models.loading import default_dtype

    dtype, cpu = str(default_dtype()).removeprefix("torch."), cpu_label()
    kept = []
    for lesson in (load_lesson(p) for p in shipped_lessons()):
        named = str(lesson.recorded.get("machine", "")).split(",")[-1].strip()
        named = UNNAMED_CPU if re.fullmatch(r"\d+ CPUs", named) else named
        if lesson.recorded.get("dtype") != dtype:
            continue
        kept += [(lesson, r) for r, run in enumerate(lesson.runs)
                 if (named == cpu or METHOD_SPECS[run.trace.settings["method"]["method"]].model_tree == "none")
                 and not (run.trace.settings.get("head") or {}).get("learned")]  # lesson 10's head is not kept
    return kept


@pytest.fixture(scope="module")
def lesson_pair(request):
    """The embedded pair as the app and the recorder load it (``real_pair``: the draft in int8 on a CPU), where this
    machine can replay a shipped lesson's run (``replayable_runs``)."""
    from explorer.analysis.bench import cpu_label

    if not replayable_runs():
        pytest.skip(f"no shipped lesson's run can be replayed on this machine's CPU model ({cpu_label()!r}) in the "
                    "dtype it runs the pair in (other kernels, another rounding)")
    return request.getfixturevalue("real_pair")


@pytest.mark.real
def test_shipped_lessons_replay_token_for_token_on_the_embedded_pair(lesson_pair):
    """A lesson no longer matching its trace (the engine changed) fails here: every step of every replayable run
    is replayed on the models and must commit the recorded tokens."""
    from explorer.instruments.replay import replay_steps

    for lesson, r in replayable_runs():
        assert lesson.recorded["draft_quant"] == lesson_pair.draft_quant
        trace = lesson.runs[r].trace
        steps = [s for _, s in replay_steps(lesson_pair, trace, len(trace.steps) - 1)]
        assert len(steps) == len(trace.steps)  # replay_steps raises where a step commits other tokens


def press_continue_live(at, run: int, step: int):
    """What the player's Continue live sends (a trigger value of the ``lesson_player`` component, which AppTest
    cannot click): the script reruns with that trigger in its widget states."""
    from streamlit.components.v2.bidi_component.main import _make_trigger_id
    from streamlit.proto.WidgetStates_pb2 import WidgetStates

    states = WidgetStates()
    states.CopyFrom(at._tree.get_widget_states())
    trigger = states.widgets.add()
    trigger.id = _make_trigger_id(at.get("bidi_component")[0].proto.id, "events")
    trigger.json_trigger_value = json.dumps([{"event": "live", "value": {"run": run, "step": step}}])
    return at._run(states)


def player_of(at) -> dict:
    """The data the Classroom's embedded player was mounted with (``ui/lesson_player.py``)."""
    players = at.get("bidi_component")
    assert len(players) == 1 and players[0].proto.component_name == "lesson_player"
    return json.loads(players[0].proto.json)


def test_the_classroom_plays_a_lesson_with_no_model_and_no_rerun_per_phase(monkeypatch, tmp_path):
    """The page mounts the lesson's player page (published into the app's static folder) and reruns only when
    another lesson is picked: phases change in the browser (tests/test_browser.py presses the keys)."""
    from streamlit.testing.v1 import AppTest

    from explorer.ui import common, lesson_player

    def no_model(*args, **kwargs):
        raise AssertionError("the classroom must not load a model")

    monkeypatch.setattr(common, "get_pair", no_model)
    monkeypatch.setattr(lesson_player, "STATIC_DIR", tmp_path)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.query_params["page"] = "classroom"
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    data = player_of(at)
    first = load_lesson(shipped_lessons()[0])
    assert data["title"] == first.title and data["src"].startswith("app/static/lessons/01-code-chains.")
    page = (tmp_path / "lessons" / data["src"].rsplit("/", 1)[1]).read_text(encoding="utf-8")
    assert f'"id":"{first.id}"' in page and "Plotly" in page  # the lesson's own player page, Plotly inlined
    options = at.selectbox(key="cls_lesson").options
    assert len(options) >= 6
    at.selectbox(key="cls_lesson").select_index(len(options) - 1).run()
    other = player_of(at)
    assert other["src"] != data["src"] and not at.exception
    assert sorted(p.name for p in (tmp_path / "lessons").iterdir()) == sorted(
        d["src"].rsplit("/", 1)[1] for d in (data, other))


def test_the_classroom_says_where_the_player_cannot_be_published(monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from explorer.ui import lesson_player

    blocker = tmp_path / "static"
    blocker.write_text("a file where the folder should be")
    monkeypatch.setattr(lesson_player, "STATIC_DIR", blocker)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=60)
    at.query_params["page"] = "classroom"
    at.run()
    assert not at.exception and any("cannot be written" in e.value for e in at.error)
    assert not at.get("bidi_component")


def test_chain_speedup_follows_leviathan():
    from explorer.engine.speedup import chain_speedup

    assert chain_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)  # nothing accepted: one token per 4 drafts + 1 target
    assert chain_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)
    assert chain_speedup(0.8, 4, 0.0) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert chain_speedup(0.6, 3, 0.05) < chain_speedup(0.8, 3, 0.05)


def test_tree_speedup_is_the_chain_at_width_one_and_gains_from_width():
    from explorer.engine.speedup import chain_speedup, expected_tokens, tree_speedup

    for alpha in (0.0, 0.3, 0.77, 1.0):
        assert tree_speedup(alpha, [1, 1, 1], 0.1) == pytest.approx(chain_speedup(alpha, 3, 0.1))
    # two candidates per level: a level passes with 1 - (1 - a)^2
    a = 0.5
    assert expected_tokens(a, [2, 2]) == pytest.approx(1 + 0.75 + 0.75 ** 2)
    assert tree_speedup(a, [2, 2], 0.1) > tree_speedup(a, [1, 1], 0.1)
    assert expected_tokens(0.0, [3, 2]) == 1.0 and expected_tokens(1.0, [3, 2]) == 3.0


def test_the_race_lays_both_runs_on_one_clock(tiny_lesson):
    from explorer.lessons.race import commit_times, lane_segments, measured_point, race_figure

    run, baseline = tiny_lesson.runs[0].trace, tiny_lesson.baseline
    for trace in (run, baseline):
        segs = lane_segments(trace)
        assert segs[0]["part"] == "prefill"
        for a, b in zip(segs, segs[1:]):  # contiguous, no gaps
            assert b["start_ms"] == pytest.approx(a["start_ms"] + a["ms"])
        end, tokens = commit_times(trace)[-1]
        assert end == pytest.approx(segs[-1]["start_ms"] + segs[-1]["ms"]) and tokens == len(trace.generated_ids)
    fig = race_figure(run, baseline, "mcsd")
    assert {a.y for a in fig.layout.annotations} == {"mcsd", "ar (plain decoding)"}  # both finishing times
    point = measured_point(run, baseline)
    rate = lambda t: len(t.generated_ids) / commit_times(t)[-1][0]  # noqa: E731
    assert point["speedup"] == pytest.approx(rate(run) / rate(baseline))
    assert 0 <= point["alpha"] <= 1 and point["gamma"] == 2 and point["c"] > 0
    if point["alpha_fitted"]:  # a tree: the fitted alpha gives back the run's accepted tokens per drafting step
        from explorer.engine.speedup import expected_tokens

        drafting = [s for s in run.steps if len(s.nodes) > 1]
        mean = sum(s.accepted_draft_len for s in drafting) / len(drafting)
        assert expected_tokens(point["alpha"], point["widths"]) - 1 == pytest.approx(mean, abs=1e-6)


def test_lessons_and_their_figures_need_no_torch():
    """A lesson opens with no model: the modules that read and draw it never import torch."""
    import subprocess
    import sys

    code = ("import sys, explorer.lessons.lesson, explorer.lessons.phases, explorer.lessons.race, "
            "explorer.trace.figures, explorer.trace.records, explorer.trace.metrics, explorer.analysis.report; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


@pytest.mark.real
def test_continue_live_replays_the_lesson_to_its_step_and_steps_on(lesson_pair, monkeypatch):
    from streamlit.testing.v1 import AppTest

    from explorer.ui import common
    from explorer.ui.state import Classroom

    lesson, r = replayable_runs()[0]
    monkeypatch.setattr(common, "get_pair", lambda *args, **kwargs: lesson_pair)  # the pair the fixture loaded
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=600)
    at.query_params["page"] = "classroom"
    at.run()
    at.selectbox(key=Classroom.LESSON.name).set_value(lesson.id).run()
    press_continue_live(at, r, 1)  # the player showed the second step of that run
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.session_state["page"] == "Explorer"
    engine = at.session_state["engine"]
    recorded = lesson.runs[r].trace
    assert [s.committed_ids for s in engine.trace.steps] == [s.committed_ids for s in recorded.steps[:2]]
    at.button(key="step_btn").click().run()  # and it goes on live
    assert len(at.session_state["engine"].trace.steps) == 3 and not at.error


def test_a_replay_on_another_dtype_or_draft_quantization_is_a_clear_error(tiny, tiny_lesson):
    """Continue live replays a lesson's run: on a pair loaded another way it would round or draft otherwise, so it
    refuses up front and says how the trace was recorded."""
    from explorer.instruments.replay import ReplayError, engine_for_trace

    trace = loads_lesson(tiny_lesson.to_json()).runs[0].trace
    engine_for_trace(tiny, trace)  # as recorded: fine
    trace.model["draft_quant"] = "int8"
    with pytest.raises(ReplayError, match="draft_quant int8 \\(loaded: none\\)"):
        engine_for_trace(tiny, trace)
    trace.model.update(draft_quant="none", dtype="bfloat16")
    with pytest.raises(ReplayError, match="dtype bfloat16 \\(loaded: float32\\)"):
        engine_for_trace(tiny, trace)


def test_a_lesson_keeps_its_runs_timed_on_other_machines(tiny, tiny_lesson):
    """``lessons time``: the lesson's runs and ar timed again (here on the tiny pair, graphed buckets as on a GPU,
    eager off CUDA) are kept beside the recording, one entry per machine; the race offers every machine."""
    from explorer.lessons.lesson import machine_name
    from explorer.lessons.record import time_lesson

    spec = dataclasses.replace(next(s for s in LESSON_SPECS if s.id == "03-temperature-one"), max_new_tokens=12)
    timed = time_lesson(tiny, spec, graphs=True, progress=lambda m: 0)
    assert len(timed.runs) == len(tiny_lesson.runs) and timed.baseline.settings["method"]["method"] == "ar"
    assert timed.recorded["graphs"] and timed.recorded["command"].endswith("--graphs")
    idle = sum(len(v) for v in tiny.graph_runners.values())
    time_lesson(tiny, spec, graphs=True, progress=lambda m: 0)  # the runners (their graphs captured) are reused
    assert idle >= 2 and sum(len(v) for v in tiny.graph_runners.values()) == idle
    gpu = dataclasses.replace(timed, recorded=timed.recorded | {"device": "cuda:0",
                                                                "machine": "Linux, 16 CPUs, NVIDIA H200"})
    lesson = tiny_lesson.with_timings(gpu).with_timings(gpu)  # the same machine again replaces its entry
    back = loads_lesson(lesson.to_json())
    assert len(back.timings) == 1 and back.timings[0].machine == "NVIDIA H200"
    lanes = back.race_lanes()
    assert list(lanes) == [machine_name(tiny_lesson.recorded), "NVIDIA H200"]
    assert lanes["NVIDIA H200"].runs[0].generated_ids == timed.runs[0].generated_ids
    assert machine_name({"machine": "Linux, 2 CPUs", "device": "cpu"}) == "CPU: 2 cores"
    assert machine_name({"machine": "Linux, 2 CPUs, AMD EPYC", "device": "cpu"}) == "CPU: AMD EPYC"
    with pytest.raises(LessonError, match="one trace per run"):
        bad = back.to_dict()
        bad["timings"][0]["runs"].append(bad["timings"][0]["runs"][0])
        loads_lesson(json.dumps(bad))
    with pytest.raises(LessonError, match="timings of 2 run"):
        tiny_lesson.with_timings(dataclasses.replace(gpu, runs=gpu.runs * 2))


def test_the_players_race_offers_every_machine_the_lesson_was_timed_on(tiny_lesson):
    """With a lesson timed on a second machine, the player's race (its machine picker) has a lane set for each, each
    with its own figure and measured point."""
    from explorer.lessons.lesson import MachineTimings
    from explorer.lessons.player import player_data

    other = MachineTimings(tiny_lesson.recorded | {"machine": "Linux, 16 CPUs, NVIDIA H200", "device": "cuda:0"},
                           [r.trace for r in tiny_lesson.runs], tiny_lesson.baseline)
    data = player_data(tiny_lesson.with_timings(other))
    for run in data["runs"]:
        race = run["race"]
        assert list(race)[-1] == "NVIDIA H200" and len(race) == 2
        for name, lane in race.items():
            assert name in lane["figure"]["layout"]["title"]["text"] and lane["point"]["speedup"] > 0


def test_continue_live_goes_on_from_the_text_where_the_steps_cannot_be_replayed(tiny, tiny_lesson, monkeypatch):
    """A lesson recorded with an int8 draft (a CPU) opened where the draft is not quantized (a GPU) cannot be
    replayed step for step: the run goes on live from the text the recording had after the step on screen."""
    from streamlit.testing.v1 import AppTest

    from explorer.instruments.replay import ReplayError, engine_after_text, replay_steps
    from explorer.ui import common

    trace = loads_lesson(tiny_lesson.to_json()).runs[0].trace
    trace.model["draft_quant"] = "int8"
    with pytest.raises(ReplayError, match="draft_quant"):
        next(replay_steps(tiny, trace, 1))
    engine = engine_after_text(tiny, trace, 1)
    done = [t for s in trace.steps[:2] for t in s.committed_ids]
    assert engine.trace.prompt_ids == trace.prompt_ids + done and not engine.trace.steps
    assert engine.state.max_new_tokens == int(trace.settings["max_new_tokens"]) - len(done)
    with pytest.raises(ReplayError, match="step 99"):
        engine_after_text(tiny, trace, 98)

    monkeypatch.setattr(common, "get_pair", lambda *args, **kwargs: tiny)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    at.session_state["continue_lesson"] = {"trace": trace, "step": 1, "title": tiny_lesson.title}
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("from the text it had after step 2" in s.value for s in at.success)
    at.button(key="step_btn").click().run()
    live = at.session_state["engine"]
    assert len(live.trace.steps) == 1 and live.trace.prompt_ids[: len(trace.prompt_ids)] == trace.prompt_ids


def test_the_players_data_holds_every_phase_of_the_lesson(tiny_lesson, tmp_path):
    """``lessons export``: the page's data has every step and phase of the lesson with the Classroom's own words
    (one source), each phase's tree and mask as ``trace.figures`` draws them, and the page holds Plotly.js itself
    (no request); the page gives its data back whole (``read_page``). tests/test_player.py checks every shipped
    lesson."""
    import plotly
    import plotly.io as pio

    from explorer.lessons.player import (FONT, MASK_HEIGHT, PAGE_TEMPLATE, PLOTLY_CARTESIAN, TEMPLATE, export_html,
                                         player_data, read_page)

    data = json.loads(json.dumps(player_data(tiny_lesson)))  # plain data
    assert data["title"] == tiny_lesson.title and len(data["runs"]) == len(tiny_lesson.runs)
    for r, (run, lesson_run) in enumerate(zip(data["runs"], tiny_lesson.runs)):
        trace = lesson_run.trace
        expected = [(p.step, p.kind, p.label, phases.account(trace.steps[p.step], p, run["greedy"]),
                     tiny_lesson.note_at(r, p)) for p in phases.run_phases(trace)]
        assert [(s, p["kind"], p["label"], p["account"], p["note"]) for s, p in run["phases"]] == expected
        assert run["steps"] == len(trace.steps)
        for (s, drawn), phase in zip(run["phases"], phases.run_phases(trace)):
            step = trace.steps[s]
            tree = figures.tree_figure(step, shown=phases.shown_status(step, phase), font=FONT, fit_labels=False)
            assert drawn["tree"] == json.loads(pio.to_json(tree.update_layout(template=PAGE_TEMPLATE)))
            if len(step.nodes) > 1:
                mask = figures.mask_figure(step, rows=phases.mask_rows(step, phase), font=FONT, height=MASK_HEIGHT)
                assert drawn["mask"] == json.loads(pio.to_json(mask.update_layout(template=PAGE_TEMPLATE)))
        assert run["race"] and all(lane["point"]["speedup"] > 0 for lane in run["race"].values())
    assert any(p["note"] for run in data["runs"] for _, p in run["phases"])
    page = export_html(tiny_lesson, tmp_path).read_text(encoding="utf-8")
    assert read_page(page) == data
    assert "src=" not in TEMPLATE.read_text() and "href=" not in TEMPLATE.read_text()  # nothing loaded from outside
    # plotly.js inlined: the cartesian bundle of the plotly package's own version (every trace the player draws)
    assert page.count("/*PLOTLY_JS*/") == 0 and PLOTLY_CARTESIAN.read_text()[:200] in page
    assert f"plotly.js (cartesian - minified) v{plotly.offline.get_plotlyjs_version()}" in page
    assert len(page.encode()) < 8 * 1024 * 1024


def test_any_trace_plays_as_a_page(tiny, tmp_path):
    """A plain run (no lesson, no baseline) becomes a player page of one run without a race: the Explorer's
    Download as HTML and ``generate --html``."""
    from explorer.cli.main import main
    from explorer.lessons.player import PLAYER_SCHEMA, player_data, trace_lesson

    run = _run(tiny, MethodConfig(method="sd", gamma=3), tokens=8)
    data = player_data(trace_lesson(run))
    assert len(data["runs"]) == 1 and data["runs"][0]["race"] == {} and data["recorded"]["machine"] is None
    assert [s for s, _ in data["runs"][0]["phases"]] == [p.step for p in phases.run_phases(run)]
    assert main(["generate", "--models", "tiny", "--prompt", "def f(x):", "--method", "sd", "--max-new-tokens", "6",
                 "--html", str(tmp_path)]) == 0
    page = (tmp_path / "trace_000.html").read_text(encoding="utf-8")
    assert f'"player_schema":{PLAYER_SCHEMA}' in page and "def f(x):" in page


def test_a_teachers_lesson_from_a_run_with_notes_at_chosen_phases(tiny):
    """Save as lesson: a run, a title, the question and notes one per line become a lesson of the shipped schema
    that round-trips through its file, shows each note at its phase in the player's data, and is refused with a
    message where a note does not read or points past the run."""
    from explorer.lessons.authoring import lesson_from_run, parse_notes
    from explorer.lessons.player import player_data

    eng = build_engine(tiny, DEFAULTS["mcsd"].with_(fallback="off"), SamplingConfig(temperature=0.0))
    eng.start(tiny.tokenizer.encode("def f(x):\n    return"), 16)
    eng.run(max_steps=3)
    trace = eng.trace
    assert parse_notes("2 verify: tested\n\n 3  draft 1 : first level ") == [
        {"run": 0, "step": 1, "phase": "verify", "text": "tested"},
        {"run": 0, "step": 2, "phase": "draft", "text": "first level", "level": 1}]
    lesson = lesson_from_run(trace, "  Why   a tree ", "What does a second candidate buy?",
                             "1 mask: the mask the target sees\n3 commit: **bonus** token")
    assert (lesson.id, lesson.title, len(lesson.runs), len(lesson.notes)) == ("why-a-tree", "Why a tree", 1, 2)
    again = loads_lesson(lesson.to_json())
    assert again.to_dict() == lesson.to_dict()
    marked = [(p["kind"], p["note"]) for _, p in player_data(again)["runs"][0]["phases"] if p["note"]]
    assert marked == [("mask", "the mask the target sees"), ("commit", "**bonus** token")]
    for notes, message in (("2 verfy: typo", "note line 1"), ("9 commit: past the end", "step 9"),
                           ("1 mask 2: no level here", "only a draft phase")):
        with pytest.raises(LessonError, match=message):
            lesson_from_run(trace, "A title", "", notes)
    with pytest.raises(LessonError, match="title"):
        lesson_from_run(trace, "   ", "", "")


def test_save_as_lesson_opens_the_lesson_in_the_classroom(monkeypatch, tmp_path):
    """The Explorer's Save as lesson, on the tiny pair: two steps, a title and a note, Open in the Classroom: the
    Classroom plays that lesson (its player page published), with the lesson in its list."""
    from streamlit.testing.v1 import AppTest

    from explorer.ui import lesson_player

    monkeypatch.setattr(lesson_player, "STATIC_DIR", tmp_path)
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.session_state["pair_spec"] = "tiny"
    at.run()
    at.button(key="step_btn").click().run()
    at.button(key="step_btn").click().run()
    at.text_input(key="lesson_title").input("My own lesson").run()
    at.text_area(key="lesson_notes").input("2 verify: look here").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    at.button(key="lesson_open_btn").click().run()
    assert not at.exception and at.session_state["page"] == "Classroom"
    assert at.session_state["cls_lesson"] == "file:my-own-lesson"
    data = player_of(at)
    assert data["title"] == "My own lesson" and data["src"].startswith("app/static/lessons/file-my-own-lesson.")
    page = (tmp_path / "lessons" / data["src"].rsplit("/", 1)[1]).read_text(encoding="utf-8")
    assert "look here" in page
