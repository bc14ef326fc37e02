"""The Streamlit app driven headlessly (AppTest) on the tiny pair: steps, metrics, and bad input shown as messages."""

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent / "app.py")


@pytest.fixture()
def app(monkeypatch):
    monkeypatch.setenv("SPEC_EXPLORER_PAIR", "tiny")
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    assert not at.exception
    return at


def click(at, key):
    at.button(key=key).click().run()
    assert not at.exception, [e.value for e in at.exception]


def go(at, page):
    """Open ``page`` the way an old ``?page=`` link does: app.py switches to it (``st.switch_page``)."""
    at.query_params["page"] = page.lower()
    at.run()
    assert not at.exception and at.session_state["page"] == page and "page" not in at.query_params


def test_step_twice_draws_a_run(app):
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    click(app, "step_btn")
    assert not app.error
    engine = app.session_state["engine"]
    assert len(engine.trace.steps) == 2
    labels = {m.label: m.value for m in app.metric}
    assert int(labels["Generated tokens"]) == len(engine.trace.generated_ids) >= 2
    assert "Tokens / target call" in labels and "Acceptance (Lu et al.)" in labels
    click(app, "reset_btn")
    assert "engine" not in app.session_state


def test_run_to_end_finishes(app):
    app.sidebar.slider(key="max_new").set_value(10)
    app.text_area(key="prompt_text").set_value("hello")
    click(app, "run_btn")
    engine = app.session_state["engine"]
    assert engine.finished and engine.n_generated == 10
    assert any("finished" in s.value for s in app.success)


def test_example_prompt_fills_the_box(app):
    options = app.selectbox(key="example").options
    pick = next(o for o in options if o.startswith("HumanEval"))
    app.selectbox(key="example").set_value(pick).run()
    assert "def " in app.text_area(key="prompt_text").value


@pytest.mark.parametrize("setup, message", [
    (lambda at: at.text_area(key="prompt_text").set_value("   "), "prompt is empty"),
    (lambda at: at.sidebar.text_input(key="k_config_mcsd-improved_False").set_value("2,0"), "k_config"),
    (lambda at: at.sidebar.text_input(key="k_config_mcsd-improved_False").set_value("two"), "not an integer"),
])
def test_bad_input_shows_a_message_and_the_app_keeps_running(app, setup, message):
    app.text_area(key="prompt_text").set_value("hello")
    setup(app)
    click(app, "step_btn")
    assert any(message in e.value for e in app.error), [e.value for e in app.error]
    # still usable afterwards
    app.text_area(key="prompt_text").set_value("hello")
    app.sidebar.text_input(key="k_config_mcsd-improved_False").set_value("2,2")
    click(app, "step_btn")
    assert not app.error and len(app.session_state["engine"].trace.steps) == 1


def test_custom_pair_errors_are_messages(app, tiny, tmp_path):
    app.sidebar.radio(key="pair_spec").set_value("custom").run()
    app.sidebar.text_input(key="draft_path").set_value("/no/such/draft")
    app.sidebar.text_input(key="target_path").set_value("/no/such/target").run()
    assert not app.exception
    assert any("Cannot load this model pair" in e.value for e in app.error)
    from explorer.models.tiny import tiny_tokenizer

    tiny.draft.save_pretrained(tmp_path / "d")
    tiny.tokenizer.save_pretrained(tmp_path / "d")
    tiny.target.save_pretrained(tmp_path / "t")
    other = tiny_tokenizer()
    other.add_tokens(["<other>"])
    other.save_pretrained(tmp_path / "t")
    app.sidebar.text_input(key="draft_path").set_value(str(tmp_path / "d"))
    app.sidebar.text_input(key="target_path").set_value(str(tmp_path / "t")).run()
    assert not app.exception
    assert any("tokenizers differ" in e.value for e in app.error)
    app.sidebar.radio(key="pair_spec").set_value("tiny").run()
    assert not app.error


def test_a_custom_pair_steps_with_a_borrowed_stop_model_and_calibrates_one(app, tmp_path, monkeypatch):
    """The default method on a pair that ships no decision model: the app says whose model it borrowed, teach mode
    too, and the Calibrate button trains one for the pair that the next run uses."""
    from explorer.models.tiny import save_pair, tiny_family_pair

    monkeypatch.setenv("SPEC_EXPLORER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("explorer.decision.calibrate.CALIBRATION_PROMPTS", 4)
    draft, target = save_pair(tiny_family_pair("gemma2"), tmp_path / "pair")
    app.sidebar.radio(key="pair_spec").set_value("custom").run()
    app.sidebar.text_input(key="draft_path").set_value(draft)
    app.sidebar.text_input(key="target_path").set_value(target).run()
    app.sidebar.toggle(key="teach").set_value(True).run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    assert not app.error, [e.value for e in app.error]
    assert any("trained on" in i.value and "not on this pair" in i.value for i in app.info)
    trace = app.session_state["engine"].trace
    assert trace.settings["decision_model"]["how"] == "transferred"
    assert any("has no decision model of its own" in m.value for m in app.markdown)  # teach mode says it too
    click(app, "calibrate_btn")
    assert any("Calibrated on" in s.value for s in app.success), [e.value for e in app.error]
    click(app, "reset_btn")
    click(app, "step_btn")
    assert app.session_state["engine"].trace.settings["decision_model"]["how"] == "calibrated"
    assert not any("not on this pair" in i.value for i in app.info)


def test_every_method_steps_in_the_app(app):
    app.text_area(key="prompt_text").set_value("x = ")
    for method in ("ar", "sd", "mcsd", "mcsd-improved"):
        click(app, "reset_btn")
        app.sidebar.selectbox(key="method").set_value(method).run()
        click(app, "step_btn")
        assert not app.error, (method, [e.value for e in app.error])
        assert app.session_state["engine"].trace.steps[-1].method == method
    app.sidebar.checkbox(key="lossy").check().run()
    click(app, "reset_btn")
    click(app, "step_btn")
    assert any("Lossy" in w.value for w in app.warning)


def test_audit_panel_runs_and_explains_greedy(app):
    app.text_area(key="prompt_text").set_value("def f(x):")
    app.sidebar.slider(key="temperature").set_value(1.0)
    app.sidebar.selectbox(key="method").set_value("mcsd").run()
    app.sidebar.selectbox(key="verifier").set_value("spechub").run()
    app.sidebar.text_input(key="k_config_mcsd_False").set_value("2,2")
    app.slider(key="audit_n").set_value(200)
    click(app, "audit_btn")
    result = app.session_state["audit"]
    assert result["verifier"] == "spechub" and result["samples"] == 200
    assert any("spechub" in m.value for m in app.markdown)
    app.sidebar.slider(key="temperature").set_value(0.0)
    click(app, "audit_btn")
    assert any("temperature above 0" in e.value for e in app.error)


def test_goodput_stop_policy_shows_its_cost_ratio_and_level_thresholds(app):
    app.sidebar.selectbox(key="stop").set_value("goodput").run()
    assert app.sidebar.slider(key="threshold_goodput").value == pytest.approx(0.22)
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    assert not app.error
    sigs = app.session_state["engine"].trace.steps[-1].stop_signals
    assert sigs and all(s.policy == "goodput" and s.forwards == s.level for s in sigs)
    slider = app.slider(key="whatif_goodput")
    assert slider.value == pytest.approx(0.22)  # r recovered from the first level's recorded threshold
    slider.set_value(0.0).run()  # free draft forwards: nothing stops before the recorded depth
    assert not app.exception
    note = next(c.value for c in app.caption if c.value.startswith("With r = 0.00"))
    assert f"over {len(sigs)} levels" in note
    assert ("deeper than this step did" in note) == (not sigs[-1].keep_drafting)


def test_goodput_can_measure_its_cost_ratio_on_this_machine(app):
    app.sidebar.selectbox(key="stop").set_value("goodput").run()
    app.sidebar.checkbox(key="cost_ratio").check().run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    click(app, "step_btn")
    assert not app.error and not app.exception
    engine = app.session_state["engine"]
    assert engine.config.cost_ratio == "measured"
    steps = engine.trace.steps
    assert steps[0].cost["r"] == pytest.approx(0.22) and steps[1].cost["r"] == steps[0].cost["next"]
    words = next(c.value for c in app.caption if c.value.startswith("r measured on this machine"))
    assert f"{steps[-1].cost['next']:.3f}" in words
    # the what-if slider starts from the r this step ran on, not from the first step's
    slider = next(s for s in app.slider if str(s.key).startswith("whatif_goodput_"))
    assert slider.value == pytest.approx(steps[-1].cost["r"], abs=0.0051)


def test_learned_stop_policy_and_what_if_slider(app):
    app.sidebar.selectbox(key="stop").set_value("prune").run()
    app.sidebar.slider(key="threshold_prune").set_value(0.4).run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    assert not app.error
    step = app.session_state["engine"].trace.steps[-1]
    assert step.stop_signals and step.stop_signals[0].policy == "prune"
    slider = app.slider(key="whatif_prune")
    assert slider.value == pytest.approx(0.4)
    slider.set_value(1.0).run()
    assert not app.exception
    note = next(c.value for c in app.caption if c.value.startswith("With τ = 1.00"))
    assert "2 draft tokens over 1 levels" in note  # nothing reaches 1: only the first level stays
    # the other decision model applies from the next run
    assert app.session_state["engine"].parts.decision_model.kind == "context"
    app.sidebar.selectbox(key="decision_model").set_value("hidden").run()
    click(app, "reset_btn")
    click(app, "step_btn")
    assert not app.error and app.session_state["engine"].parts.decision_model.kind == "hidden"


def caption_with(at, prefix):
    return [m.value for m in at.markdown if m.value.startswith(prefix)]


def test_back_forward_and_the_step_slider_travel_through_the_run(app):
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    for _ in range(3):
        click(app, "step_btn")
    assert caption_with(app, "**Step 3 of 3**")
    assert app.button(key="forward_btn").disabled and not app.button(key="back_btn").disabled
    click(app, "back_btn")
    click(app, "back_btn")
    assert caption_with(app, "**Step 1 of 3**") and app.button(key="back_btn").disabled
    assert app.slider(key="step_slider").value == 1
    click(app, "forward_btn")
    assert caption_with(app, "**Step 2 of 3**")
    app.slider(key="step_slider").set_value(3).run()
    assert caption_with(app, "**Step 3 of 3**")
    # metrics follow the step on screen; Step goes on from the end of the run
    app.slider(key="step_slider").set_value(1).run()
    first = app.session_state["trace"].steps[0]
    assert {m.label: m.value for m in app.metric}["Generated tokens"] == str(len(first.committed_ids))
    click(app, "step_btn")
    assert caption_with(app, "**Step 4 of 4**") and len(app.session_state["engine"].trace.steps) == 4


def test_node_inspector_shows_p_q_and_highlights_the_mask_row(app):
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    step = app.session_state["trace"].steps[0]
    node = next(n for n in step.nodes if n.source == "draft")
    app.session_state["inspect_0"] = node.id  # what a click on the tree stores (the browser test clicks)
    app.run()
    assert caption_with(app, f"#### Node inspector: node {node.id}")
    assert any(f"position id **{node.position_id}**" in m.value for m in app.markdown)
    assert len(node.p_top) == len(node.q_top) == 8 and node.q_top[0][2] >= node.q_top[-1][2]


def test_teach_mode_explains_the_step(app):
    app.sidebar.toggle(key="teach").set_value(True).run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    text = " ".join(m.value for m in app.markdown)
    assert "teach-box" in text and "Drafting:" in text and "Outcome:" in text
    assert any("font-size" in h.proto.body for h in app.get("html"))  # the large type


def test_tokens_and_prompts_are_escaped(app):
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    app.text_area(key="prompt_text").set_value(evil)
    app.sidebar.toggle(key="teach").set_value(True).run()
    click(app, "step_btn")
    assert not app.error
    # Every token of the step (text, committed text, top-k lists) now reads as markup; a replayed trace could
    # carry exactly this.
    step = app.session_state["trace"].steps[0]
    for n in step.nodes:
        n.text = evil
        n.p_top = [[t, evil, p] for t, _, p in n.p_top]
    step.committed_text = [evil] * len(step.committed_text)
    app.session_state["inspect_0"] = step.nodes[1].id
    app.run()
    html_blocks = [m.value for m in app.markdown if m.allow_html]
    assert any("&lt;script&gt;" in v for v in html_blocks)  # the text panel and the teach box
    for v in html_blocks:
        assert "<script" not in v and "<img" not in v, v
    # Markdown without HTML shows markup as text; the token stays readable there (not double-escaped)
    assert any(m.value.startswith(f"#### Node inspector: node {step.nodes[1].id}") and "<script>" in m.value
               and not m.allow_html for m in app.markdown)


def test_a_prompt_longer_than_the_context_window_is_refused(app):
    app.text_area(key="prompt_text").set_value("word " * 600)
    click(app, "step_btn")
    assert any("positions" in e.value and "Shorten the prompt" in e.value for e in app.error)
    assert app.session_state["trace"] is None if "trace" in app.session_state else True
    app.text_area(key="prompt_text").set_value("hello")
    click(app, "step_btn")
    assert not app.error and len(app.session_state["trace"].steps) == 1


def test_replaying_a_saved_trace_needs_no_model(app, tiny):
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.trace.records import loads_run

    engine = build_engine(tiny, DEFAULTS["mcsd"], SamplingConfig())
    engine.start(tiny.tokenizer.encode("def f(x):"), 12, prompt_text="def f(x):")
    saved = loads_run(engine.run().to_json())
    app.session_state["trace"] = saved
    app.session_state["replay"] = "saved.json"
    app.session_state["cursor"] = 0
    app.run()
    assert not app.exception and not app.error
    assert app.button(key="step_btn").disabled and app.button(key="run_btn").disabled
    assert any("Replaying **saved.json**" in i.value for i in app.info)
    assert caption_with(app, f"**Step 1 of {len(saved.steps)}**")
    click(app, "forward_btn")
    assert caption_with(app, f"**Step 2 of {len(saved.steps)}**")
    click(app, "reset_btn")
    assert "trace" not in app.session_state and not app.button(key="step_btn").disabled


def test_compare_page_runs_two_methods_side_by_side(app):
    go(app, "Compare")
    app.text_area(key="cmp_prompt").set_value("def add(a, b):")
    app.selectbox(key="b_method").set_value("ar").run()
    click(app, "cmp_step")
    a, b = app.session_state["cmp_engines"]
    assert a.trace.settings["method"]["method"] == "mcsd-improved" and b.trace.settings["method"]["method"] == "ar"
    assert a.sampling == b.sampling and a.trace.prompt_ids == b.trace.prompt_ids
    click(app, "cmp_run")
    assert a.finished and b.finished and a.trace.generated_ids == b.trace.generated_ids  # greedy: lossless
    heads = [h.value for h in app.subheader]
    assert any(h.startswith("A:") for h in heads) and any(h.startswith("B:") for h in heads)
    click(app, "cmp_reset")
    assert "cmp_engines" not in app.session_state


def test_prompt_and_settings_survive_a_page_change(app):
    app.text_area(key="prompt_text").set_value("def keep_me():")
    app.sidebar.slider(key="max_new").set_value(33).run()
    for page in ("Benchmarks", "Classroom", "Compare", "Explorer"):
        go(app, page)
    assert app.text_area(key="prompt_text").value == "def keep_me():"
    assert app.sidebar.slider(key="max_new").value == 33


def test_probe_a_past_step_by_replay_and_a_bad_tree_template(app):
    app.sidebar.selectbox(key="method").set_value("mcsd").run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    for _ in range(3):
        click(app, "step_btn")
    click(app, "back_btn")  # step 2 of 3: the probe replays the run to it
    click(app, "probe_btn_1")
    assert not app.error, [e.value for e in app.error]
    labels = {m.label: m.value for m in app.metric}
    assert labels["Flipped decisions"] == "0" and labels["Mask lint"] == "OK"
    assert app.session_state["probes"][1]["step"] == 1
    app.sidebar.text_input(key="tree_template").set_value("-1,1").run()
    click(app, "reset_btn")
    click(app, "step_btn")
    assert any("tree template node 1 has parent 1" in e.value for e in app.error)


def test_an_old_trace_without_odds_replays_with_empty_instruments(app, tiny):
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.trace.records import RunTrace

    engine = build_engine(tiny, DEFAULTS["mcsd"], SamplingConfig())
    engine.start(tiny.tokenizer.encode("def f(x):"), 12, prompt_text="def f(x):")
    d = engine.run().to_dict()
    d["schema_version"] = 1  # written before the odds were kept: version 1 traces could leave them out
    for s in d["steps"]:
        s.pop("expected_tokens")
        for n in s["nodes"]:
            for key in ("accept_prob", "slot_prob", "test_order"):
                n.pop(key)
    app.session_state["trace"] = RunTrace.from_dict(d)
    app.session_state["replay"] = "old.json"
    app.session_state["cursor"] = 0
    app.run()
    assert not app.exception and not app.error
    assert any("recorded before the odds" in i.value for i in app.info)
    assert any("use `python -m explorer probe --trace FILE`" in c.value for c in app.caption)


def test_what_if_edit_reverifies_branches_and_keeps_the_original(app):
    app.sidebar.selectbox(key="method").set_value("mcsd").run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    click(app, "step_btn")
    original = app.session_state["trace"]
    recorded = original.to_json()
    app.radio(key="cf_1_action").set_value("none").run()
    click(app, "cf_1_go")
    assert not app.error, [e.value for e in app.error]
    assert app.session_state["counterfactuals"][1]["identical"] is True
    assert any("Re-verified as recorded" in s.value for s in app.success)
    app.radio(key="cf_1_action").set_value("replace").run()  # the first drafted node, the target's best token
    click(app, "cf_1_go")
    result = app.session_state["counterfactuals"][1]
    assert not result["identical"] and result["edit"]["replace"]
    click(app, "cf_branch_1")
    runs = app.session_state["runs"]
    assert len(runs) == 2 and app.session_state["run_index"] == 1
    assert app.session_state["trace"] is runs[1]["trace"] and runs[0]["trace"] is original
    assert original.to_json() == recorded  # the recorded run is untouched
    before = len(runs[1]["trace"].steps)
    click(app, "step_btn")  # the branch is live
    assert len(app.session_state["trace"].steps) == before + 1
    app.selectbox(key="run_choice").set_value(0).run()
    assert app.session_state["trace"] is original and not app.exception


def test_online_adaptation_carries_to_the_sessions_next_run(app):
    """What the stop policy learned in one run starts the next run of the same method (after Reset), and the
    adaptation panel says so."""
    from explorer.engine.config import DEFAULTS

    app.sidebar.selectbox(key=f"adapt_{DEFAULTS['mcsd-improved'].stop}").set_value("last-layer")
    app.sidebar.slider(key="max_new").set_value(12)
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "run_btn")
    learned = app.session_state["engine"].carried().adapter
    assert learned is not None and learned["labels"]
    click(app, "reset_btn")
    assert app.session_state["carried"].adapter == learned
    click(app, "step_btn")
    engine = app.session_state["engine"]
    assert engine.parts.adapter.carried == len(learned["labels"])
    assert engine.trace.settings["adaptation_carried"] == learned
    assert any("previous run of the method learned" in c.value for c in app.caption)


def test_the_goodput_fallback_carries_its_rates_to_the_sessions_next_run(app):
    """The rates a run measured start the next run of the same method (after Reset), and its first step says so."""
    app.sidebar.selectbox(key="fallback").set_value("goodput")
    app.sidebar.slider(key="max_new").set_value(10)
    app.text_area(key="prompt_text").set_value("hello")
    click(app, "run_btn")
    measured = app.session_state["engine"].carried().fallback
    assert measured is not None and measured["rates"]["spec"] is not None
    click(app, "reset_btn")
    assert app.session_state["carried"].fallback == measured
    click(app, "step_btn")
    engine = app.session_state["engine"]
    assert engine.trace.settings["fallback_carried"] == engine.parts.fallback.carried
    assert engine.trace.steps[0].fallback["carried"]


def test_the_adaptation_panel_speaks_of_a_step_that_drafted_nothing(tiny, monkeypatch):
    """A plain step of the goodput fallback (or one of only free drafts) labels no token: its adaptation record has
    no refit to report, and the panel says so instead of failing (it did, where the fallback measured rows dear)."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.ui import panels

    engine = build_engine(tiny, DEFAULTS["mcsd-improved"].with_(adapt="last-layer", fallback="off"), SamplingConfig())
    engine.start(tiny.tokenizer.encode("def add(a, b):"), 8)
    step = engine.step()
    step.adaptation = {"mode": "last-layer", "tokens": 0, "threshold": 0.75}  # what a plain step records
    captions = []
    monkeypatch.setattr(panels.st, "caption", lambda text, *a, **k: captions.append(text))
    panels.adaptation_panel(engine.trace, step, teach=False)
    assert captions and "drafted nothing" in captions[0]


def test_layer_skip_steps_on_one_engine(app):
    """layer-skip runs on a pair derived from the loaded one (the target's own first layers as the draft): Step
    goes on with the same engine instead of starting the run again."""
    app.sidebar.selectbox(key="method").set_value("layer-skip").run()
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    engine = app.session_state["engine"]
    click(app, "step_btn")
    click(app, "step_btn")
    assert app.session_state["engine"] is engine and len(engine.trace.steps) == 3 and not app.error


def test_auto_and_the_dtype_it_means_are_one_loaded_pair(monkeypatch):
    """The sidebar's "auto" and the dtype it resolves to (the Classroom's Continue live names the lesson's) share
    one cached pair: another key would load a second copy beside the first."""
    from explorer.models.loading import default_dtype
    from explorer.ui import common

    loads = []
    monkeypatch.setattr(common, "get_pair", lambda *key: loads.append(key) or key)
    named = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}[str(default_dtype())]
    assert common.load_pair_with_progress("tiny", "", "", "auto") == common.load_pair_with_progress("tiny", "", "",
                                                                                                    named)
    assert len(set(loads)) == 1 and loads[0][3] == str(default_dtype()).removeprefix("torch.")


PLUGIN = '''
"""A plugin for the app's test: a free bigram drafter that fails at its third step when asked to."""
from explorer.plugins import Drafter, FreeNode, register_method


class BigramDrafter(Drafter):
    """After each token, the token that followed it the last time."""

    fail_at = None

    def free_nodes(self, view):
        if view.steps_done == self.fail_at:
            raise RuntimeError("the plugin broke here")
        follows = dict(zip(view.committed, view.committed[1:]))
        nodes, token = [], view.committed[-1]
        while len(nodes) < 4 and token in follows:
            token = follows[token]
            nodes.append(FreeNode(len(nodes) - 1, token))
        return nodes


register_method("bigram-app", BigramDrafter, label="Bigram (plugin)", defaults={"fallback": "off"})
'''


def test_a_plugin_from_the_environment_is_listed_steps_and_fails_by_name(tmp_path, monkeypatch):
    """The app started with SPEC_EXPLORER_PLUGINS lists the plugin in the sidebar, offers its method and steps it
    (plugin nodes in the tree); when its drafter raises, the run keeps its steps and the page names the plugin."""
    from explorer.engine.methods import METHOD_SPECS
    from explorer.plugins import loading, unregister
    from explorer.ui.plugin_list import startup_plugins

    path = tmp_path / "bigram_app.py"
    path.write_text(PLUGIN, encoding="utf-8")
    monkeypatch.setenv("SPEC_EXPLORER_PAIR", "tiny")
    monkeypatch.setenv(loading.ENV, str(path))
    startup_plugins.clear()
    try:
        at = AppTest.from_file(APP, default_timeout=120)
        at.run()
        assert not at.exception
        assert any("bigram_app" in m.value and "bigram-app" in m.value for m in at.sidebar.markdown)
        assert any(str(path.resolve()) in c.value for c in at.sidebar.caption)
        at.sidebar.selectbox(key="method").set_value("bigram-app").run()
        at.text_area(key="prompt_text").set_value("a b c a b c a b")
        click(at, "step_btn")
        click(at, "step_btn")
        trace = at.session_state["engine"].trace
        assert any(n.source == "plugin" for s in trace.steps for n in s.nodes)
        assert trace.settings["plugins"][0]["loaded_from"] == str(path.resolve())
        assert METHOD_SPECS["bigram-app"].origin["sha256"]
        at.session_state["engine"].parts.drafter.fail_at = 2
        click(at, "step_btn")
        assert len(at.session_state["engine"].trace.steps) == 2  # the run and its steps are kept
        assert any("step 3: plugin bigram_app" in e.value and "the plugin broke here" in e.value for e in at.error)
    finally:
        unregister("bigram-app")
        loading._LOADED.pop(str(path.resolve()), None)
        startup_plugins.clear()


def test_the_rule_comparison_ranks_every_rule_on_the_prompt(app):
    """Which rule accepts more: every selectable rule on the sidebar's tree (SpecHub where its pairs fit), SpecTr
    among them, and RSD-S's beam tree, with a chart; greedy is refused with a message."""
    app.sidebar.selectbox(key="method").set_value("mcsd").run()
    app.text_area(key="prompt_text").set_value("def f(x):")
    app.slider(key="rules_n").set_value(8)
    click(app, "rules_btn")
    assert any("temperature above 0" in e.value for e in app.error)  # greedy: every rule is argmax matching
    app.sidebar.slider(key="temperature").set_value(1.0).run()
    click(app, "rules_btn")
    rows = app.session_state["rules"]["rows"]
    ran = {r["label"]: r for r in rows if "skipped" not in r}
    assert {"rrs", "rrs-replacement", "mcns", "spectr", "rsd-s"} <= set(ran)
    assert all(r["generated_tokens"] == 8 for r in ran.values())
    assert [r["label"] for r in rows if "skipped" in r] == ["spechub"]  # the default tree has 4 children a node
    assert len(app.get("plotly_chart")) == 2 and not app.exception  # the runs, then the paired comparison


def test_the_draft_learns_online_between_prompts_and_resets(app):
    """sd with "Draft: learn online": each finished prompt gives the session's LoRA adapter an update, the
    Explorer's panel draws acceptance by prompt, and its reset drops the adapter."""
    app.sidebar.selectbox(key="method").set_value("sd").run()
    app.sidebar.checkbox(key="head_distill").check().run()
    app.sidebar.select_slider(key="distill_replay").set_value(2)
    app.sidebar.slider(key="max_new").set_value(12)
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    for _ in range(2):
        click(app, "run_btn")
        click(app, "reset_btn")
    click(app, "run_btn")
    trace = app.session_state["engine"].trace
    assert {s.drafter["draft_adapter"]["version"] for s in trace.steps} == {2}  # two updates before this prompt
    assert any("3 prompts finished; 3 updates (draft's adapter version 3)" in c.value for c in app.caption)
    assert app.session_state["distiller"][1].replay == 2  # the sidebar's replay window reached the distiller
    click(app, "distill_reset")
    assert app.session_state["distiller"] is None
