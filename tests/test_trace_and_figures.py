import json

import pytest

from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.trace import figures
from explorer.trace.metrics import run_metrics
from explorer.trace.records import RunTrace, TraceError, load_run, loads_run, save_run


@pytest.fixture(scope="module")
def run_trace(tiny):
    eng = build_engine(tiny, MethodConfig(method="mcsd-improved", k_config=(3, 2), max_depth=4, threshold=0.05),
                 SamplingConfig(temperature=0.8, seed=4))
    eng.start(tiny.tokenizer.encode("print(<br>"), 24, prompt_text="print(<br>")
    return eng.run()


def test_trace_round_trips_through_json(run_trace, tmp_path):
    path = tmp_path / "t.json"
    save_run(run_trace, path)
    back = load_run(path)
    assert back.to_dict() == run_trace.to_dict()
    assert back.generated_ids == run_trace.generated_ids
    assert run_metrics(back) == run_metrics(run_trace)


def test_metrics_are_consistent(run_trace):
    m = run_metrics(run_trace)
    assert m["generated_tokens"] == 24 == len(run_trace.generated_ids)
    assert m["target_calls"] == len(run_trace.steps) + 1
    assert m["tokens_per_target_call"] == pytest.approx(24 / m["target_calls"])
    assert 0 <= m["acceptance_rate"] <= 1 and 0 <= m["mcsd_acceptance_rate"] <= 1
    assert m["accepted_draft_tokens"] == sum(s.accepted_draft_len for s in run_trace.steps)


@pytest.mark.parametrize("text, message", [
    ("not json", "not valid JSON"),
    ("[]", "JSON object"),
    ('{"schema_version": 99}', "schema version"),
    ('{"schema_version": 1, "settings": {}}', "missing the field"),
    ('{"schema_version": 1, "settings": {}, "model": {}, "prompt": "", "prompt_ids": [], "steps": [{"index": 0}]}',
     "malformed"),
])
def test_malformed_traces_are_refused(text, message):
    with pytest.raises(TraceError, match=message):
        loads_run(text)


def _spoil(d, path, value):
    obj = d
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    return json.dumps(d)


@pytest.mark.parametrize("path, value, message", [
    (("settings",), {}, "method settings"),
    (("settings", "method"), "mcsd", "method settings"),
    (("prefill_ms",), "fast", "prefill_ms"),
    (("prompt_ids",), [1, "two"], "prompt_ids"),
    (("model",), [], "'model'"),
    (("steps", 0, "nodes", 1, "parent"), 999, "parent is not in the tree"),
    (("steps", 0, "nodes", 1, "text"), 42, "'text' has the wrong type"),
    (("steps", 0, "nodes", 1, "p_top"), [[1, "a"]], "top-token list"),
    (("steps", 0, "mask"), [[1]], "the mask does not match"),
    (("steps", 0, "position_ids"), [], "the mask does not match"),
    (("steps", 0, "committed_text"), [None], "committed tokens"),
    (("steps", 0, "step_ms"), "slow", "step_ms"),
    (("steps", 0, "drafter", "row_pricing"), {"offered": 40, "kept": "most"}, "row pricing record"),
])
def test_traces_that_parse_but_cannot_be_drawn_are_refused(run_trace, path, value, message):
    """A hand-edited or hostile file: each broken field gets a TraceError naming it, never a crash later."""
    bad = _spoil(json.loads(run_trace.to_json()), path, value)
    with pytest.raises(TraceError, match=message):
        loads_run(bad)


# The fields added after the first version 1 writer (commit 833fd29): its traces lack them.
LATER_STEP_FIELDS = ("forward_ms", "drafter", "expected_tokens", "timeline", "adaptation", "fallback", "host_syncs",
                     "cost", "prefill_rows")
LATER_NODE_FIELDS = ("p_top", "q_top", "provenance", "accept_prob", "slot_prob", "test_order", "predicted_accept")
LATER_STOP_FIELDS = ("pruned", "expected", "forwards", "cost_pruned", "row_floor", "chances")


def _as_version_1(d: dict) -> dict:
    """``d`` as the first writer wrote it: version 1, no producer, the fields added since left out."""
    d = json.loads(json.dumps(d))
    d["schema_version"] = 1
    del d["producer"]
    for step in d["steps"]:
        for items, names in (([step], LATER_STEP_FIELDS), (step["nodes"], LATER_NODE_FIELDS),
                             (step["stop_signals"], LATER_STOP_FIELDS)):
            for item in items:
                for name in names:
                    item.pop(name)
    return d


def test_traces_are_written_as_version_2_and_name_their_writer(run_trace):
    from explorer import __version__

    d = json.loads(run_trace.to_json())
    assert d["schema_version"] == 2 and d["producer"] == {"name": "spec-explorer", "version": __version__}
    assert all(step["timeline"] and "prefill_rows" in step for step in d["steps"])


def test_version_1_traces_are_upgraded_and_keep_what_they_hold(run_trace, tmp_path):
    from explorer.trace import schema

    old = _as_version_1(run_trace.to_dict())
    assert old["steps"][0].get("timeline") is None and "p_top" not in old["steps"][0]["nodes"][1]
    back = loads_run(json.dumps(old))
    assert back.schema_version == 2 and back.producer == schema.V1_PRODUCER
    assert back.generated_ids == run_trace.generated_ids
    for was, now in zip(run_trace.steps, back.steps):
        assert [n.token_id for n in now.nodes] == [n.token_id for n in was.nodes]
        assert [n.status for n in now.nodes] == [n.status for n in was.nodes]
        assert now.mask == was.mask and now.timeline == [] and now.forward_ms is None
        assert all(n.p_top == [] and n.accept_prob is None for n in now.nodes)
        figures.tree_figure(now), figures.mask_figure(now), figures.stop_figure(now)  # still drawn
    save_run(back, tmp_path / "upgraded.json")  # saved again: version 2, and it reads back the same
    again = load_run(tmp_path / "upgraded.json")
    assert again.to_dict() == back.to_dict() and json.loads((tmp_path / "upgraded.json").read_text())[
        "schema_version"] == 2
    assert old["schema_version"] == 1 and "producer" not in old  # the reader upgraded a copy


def test_shipped_lessons_still_open_and_some_are_version_1_traces():
    """Every shipped lesson opens as a version-2 trace; those recorded before version 2 keep the reader's upgrade
    exercised on real files (a lesson recorded again is written as version 2)."""
    from explorer.lessons.lesson import load_lesson, shipped_lessons

    paths = shipped_lessons()
    assert paths
    versions = set()
    for path in paths:
        raw = json.loads(path.read_text())
        versions |= {r["trace"]["schema_version"] for r in raw["runs"]}
        lesson = load_lesson(path)
        assert all(r.trace.schema_version == 2 and r.trace.steps for r in lesson.runs)
    assert 1 in versions and versions <= {1, 2}


def test_the_upgrade_fills_exactly_the_fields_a_version_1_reader_defaulted():
    """Each record's fields with a default are the ones version 1 let a trace leave out, and the upgrade fills them
    with those defaults: a field added later without a default, or with another one, fails here."""
    import dataclasses

    from explorer.trace import records, schema

    for cls, added in ((records.StepTrace, schema.STEP_FIELDS_ADDED), (records.NodeTrace, schema.NODE_FIELDS_ADDED),
                       (records.StopSignal, schema.STOP_FIELDS_ADDED)):
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        assert {k: v for k, v in added.items() if k != "stop_signals"} == defaults, cls.__name__
    assert set(LATER_STEP_FIELDS) <= set(schema.STEP_FIELDS_ADDED)


@pytest.mark.parametrize("spoil, message", [
    (lambda d: d["steps"][0].pop("timeline"), "step 1 of the trace is malformed: the step lacks the field 'timeline'"),
    (lambda d: d["steps"][0]["nodes"][1].pop("p_top"), "node 1 lacks the field 'p_top'"),
    (lambda d: d.pop("producer"), "'producer'"),
    (lambda d: d.update(schema_version=3), "a newer spec-explorer wrote it"),
    (lambda d: d.update(schema_version="2"), "schema version '2' is not supported"),
])
def test_version_2_traces_must_hold_every_field(run_trace, spoil, message):
    d = json.loads(run_trace.to_json())
    spoil(d)
    with pytest.raises(TraceError, match=message):
        loads_run(json.dumps(d))


def test_unreadable_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_run(tmp_path / "missing.json")


def test_figures_build_from_a_replayed_trace_without_a_model(run_trace):
    replay = RunTrace.from_dict(json.loads(run_trace.to_json()))
    for step in replay.steps:
        tree = figures.tree_figure(step)
        node_ids = [c for tr in tree.data if tr.customdata is not None for c in tr.customdata]
        assert sorted(node_ids) == [n.id for n in step.nodes]
        # a label sits above its node: clipped at the plot area, the top node's was cut in half at a lesson's font
        assert all(tr.cliponaxis is False for tr in tree.data if tr.customdata is not None)
        mask = figures.mask_figure(step)
        assert len(mask.data[0].y) == len(set(mask.data[0].y)) == len(step.mask)  # unique labels
        assert len(figures.branch_figure(step).data[0].x) == len(step.branches)
        figures.stop_figure(step)
    figures.run_figure(replay)


def test_token_text_is_escaped_everywhere(run_trace):
    assert figures.token_label("<br>") == "&lt;br&gt;"
    assert figures.token_label('"""\n') == '"""↵' and figures.token_label("a'b&") == "a'b&amp;"  # Plotly shows &quot;
    assert figures.token_label("\n") == "↵" and figures.token_label("  ") == "␣␣"
    html_text = figures.text_html(run_trace)
    # a generated "<" must never reach the page as markup
    raw = run_trace.generated_text
    if "<" in raw:
        assert "&lt;" in html_text
    step = run_trace.steps[0]
    step.nodes[1].text = "<script>alert(1)</script>"
    fig = figures.tree_figure(step)
    assert not any("<script>" in (t or "") for tr in fig.data if tr.text is not None for t in tr.text)


def _drawn_step(nodes, **fields):
    """A step of ``nodes`` with nothing else recorded (no mask, no timings): enough for the tree figure."""
    from explorer.trace.records import StepTrace

    base = dict(index=0, method="mcsd", lossy=False, nodes=nodes, mask=[], mask_node_ids=[], mask_context_len=0,
                position_ids=[], branches=[], stop_signals=[], committed_ids=[], committed_text=[], bonus_token=None,
                accepted_draft_len=0, max_draft_len=3, drafted=len(nodes) - 1, draft_calls=0, target_calls=0,
                draft_ms=0, verify_ms=0, step_ms=0)
    return StepTrace(**{**base, **fields})


def test_tree_layout_keeps_chains_level_and_parents_centred():
    from explorer.trace.records import NodeTrace

    parents = [None, 0, 0, 1, 1, 2, 3, 5]  # two branches, each a small subtree continued by chains
    nodes = [NodeTrace(id=i, parent=p, token_id=i, text=str(i), depth=0 if p is None else 0, position_id=0,
                       source="draft", status="unverified") for i, p in enumerate(parents)]
    for n in nodes[1:]:
        n.depth = nodes[n.parent].depth + 1
    step = _drawn_step(nodes)
    pos = figures.tree_layout(figures.tree_graph(step))
    assert pos[3][1] == pos[6][1] and pos[5][1] == pos[7][1]  # chains are horizontal
    assert pos[1][1] == (pos[3][1] + pos[4][1]) / 2  # a parent sits between its children
    assert len({pos[i][1] for i in (3, 4, 5)}) == 3  # leaves do not overlap
    assert all(pos[i][0] == nodes[i].depth for i in range(len(nodes)))


@pytest.mark.parametrize("children", [1, 2, 3])
def test_the_bonus_star_never_sits_on_a_rejected_child(children):
    """The deepest accepted node's rejected children take the depth where the bonus token hangs: the star gets a row
    of its own below them (a middle or only child shares its parent's row), and the node keeps its row where it has no
    children."""
    from explorer.trace.records import NodeTrace

    parents = [None, 0, 0] + [1] * children  # node 1 accepted, its children rejected, node 2 a rejected sibling
    nodes = [NodeTrace(id=i, parent=p, token_id=i, text=f"t{i}", depth=0 if p is None else 1 + (p == 1),
                       position_id=0, source="draft", status="rejected") for i, p in enumerate(parents)]
    nodes[0].status, nodes[1].status = "context", "accepted"
    nodes[0].committed = nodes[1].committed = True
    step = _drawn_step(nodes, committed_ids=[1, 99], committed_text=["t1", "b"], bonus_token=99, accepted_draft_len=1,
                       max_draft_len=2, target_calls=1)
    fig = figures.tree_figure(step)
    star = next(t for t in fig.data if t.name == "bonus token (from target)")
    points = {(x, y) for t in fig.data if t.mode == "markers+text" and t is not star for x, y in zip(t.x, t.y)}
    assert star.x[0] == 2 and (star.x[0], star.y[0]) not in points
    assert star.y[0] < min(y for x, y in points if x == 2)  # below the rejected children, on a row of its own
    assert fig.layout.yaxis.range[0] <= star.y[0] - 0.5  # and inside the plot
    line = fig.data[fig.data.index(star) - 1]  # the dotted line hangs the star off the accepted node
    node = next((x, y) for t in fig.data if t.name == "accepted" for x, y in zip(t.x, t.y))
    assert (line.x[0], line.y[0]) == node and (line.x[1], line.y[1]) == (star.x[0], star.y[0])
    childless = _drawn_step(nodes[:3], committed_ids=[1, 99], committed_text=["t1", "b"], bonus_token=99,
                            accepted_draft_len=1, max_draft_len=2, target_calls=1)
    star = next(t for t in figures.tree_figure(childless).data if t.name == "bonus token (from target)")
    assert (star.x[0], star.y[0]) == (2, figures.tree_layout(figures.tree_graph(childless))[1][1])


@pytest.mark.parametrize("depth", [4, 14])
def test_stop_chart_names_every_decision_only_while_the_labels_fit(tiny, depth):
    cfg = MethodConfig(method="mcsd-improved", k_config=(1,), max_depth=depth, stop="confidence", threshold=0.0)
    eng = build_engine(tiny, cfg, SamplingConfig())
    eng.start(tiny.tokenizer.encode("x"), 40)
    step = eng.step()
    levels = len(step.stop_signals)
    assert levels == depth - 1 and all(s.keep_drafting for s in step.stop_signals)  # tau 0 never stops
    words = [a.text for a in figures.stop_figure(step).layout.annotations]
    assert words == (["continue"] * levels if levels <= figures.STOP_WORDS_UP_TO else [])
