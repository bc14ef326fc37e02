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


def test_step_twice_draws_a_run(app):
    app.text_area(key="prompt_text").set_value("def add(a, b):")
    click(app, "step_btn")
    click(app, "step_btn")
    assert not app.error
    engine = app.session_state["engine"]
    assert len(engine.trace.steps) == 2
    labels = {m.label: m.value for m in app.metric}
    assert int(labels["Generated tokens"]) == len(engine.trace.generated_ids) >= 2
    assert "Tokens / target call" in labels and "Acceptance (seed)" in labels
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
    from explorer.tiny import tiny_tokenizer

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
    assert app.session_state["engine"].decision_model.kind == "dist"
    app.sidebar.selectbox(key="decision_model").set_value("hidden").run()
    click(app, "reset_btn")
    click(app, "step_btn")
    assert not app.error and app.session_state["engine"].decision_model.kind == "hidden"
