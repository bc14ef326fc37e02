"""The Explorer page: step a run on real models, travel back and forth through its steps, inspect nodes, save the
session as a trace and replay a saved one with no model loaded.

Session state (one browser session each; the models are shared): ``state.Explorer``, which says what each key
holds; the Classroom's lessons arrive through ``state.hand_off_to_explorer``.
"""

from __future__ import annotations

import html
import json

import streamlit as st

from ..analysis.audit import audit
from ..analysis.prompts import PromptError, encode_prompt
from ..analysis.rules import compare_rules
from ..decision.calibrate import calibrate
from ..engine.sampling import SamplingConfig
from ..engine.tree import TreeShapeError
from ..instruments.acceptance import measure_forward_costs
from ..instruments.counterfactual import counterfactual, parse_edits
from ..instruments.probe import probe_last_step
from ..instruments.replay import ReplayError, engine_after_text, replay_steps
from ..lessons.player import trace_html
from ..trace import figures
from ..trace.records import MAX_TRACE_BYTES, TraceError, loads_run
from . import layout, panels
from .common import build_config, example_prompts, guarded, make_engine, pair_or_message, parse_upload, set_error
from .counterfactual_panel import counterfactual_section
from .instruments_panel import (acceptance_report, acceptance_section, calibration_section, distill_section,
                               optimal_tree_section, timeline_section)
from .lesson_panel import save_as_lesson
from .state import (Explorer, engine_lock, forget_learned_head, keep_learned, learned_head_history,
                    replay_in_explorer)

ERROR = Explorer.ERROR


def _trace():
    return Explorer.TRACE.get()


def _cursor() -> int | None:
    """Index of the step on screen (None when there are no steps)."""
    trace = _trace()
    if trace is None or not trace.steps:
        return None
    c = Explorer.CURSOR.get()
    return len(trace.steps) - 1 if c is None else max(0, min(c, len(trace.steps) - 1))


def _go(delta: int) -> None:
    c = _cursor()
    if c is not None:
        last = len(_trace().steps) - 1
        new = max(0, min(last, c + delta))
        Explorer.CURSOR.set(None if new == last else new)
        Explorer.STEP_SLIDER.set(new + 1)


def _reset() -> None:
    engine = Explorer.ENGINE.get()
    if engine is not None:  # what the run learned serves the next one
        keep_learned(engine)
    for key in (Explorer.ENGINE, Explorer.TRACE, Explorer.CURSOR, Explorer.REPLAY, Explorer.PENDING,
                Explorer.RUN_SETTINGS, Explorer.STOPPED, Explorer.RUNNING, Explorer.RUNS, Explorer.RUN_INDEX,
                Explorer.COUNTERFACTUALS, Explorer.CONTINUED):
        key.clear()
    _forget_clicks()
    set_error(None, ERROR)


def _forget_clicks() -> None:
    """Drop the node selections of the previous session's steps (they would reselect nodes of a new run)."""
    Explorer.INSPECT.forget()
    Explorer.TREE_CHART.forget()


def _request(what: str) -> None:
    Explorer.PENDING.set(what)
    Explorer.STOPPED.clear()


def _slider_moved() -> None:
    trace = _trace()
    if trace is not None and trace.steps:
        i = int(Explorer.STEP_SLIDER.get()) - 1
        Explorer.CURSOR.set(None if i >= len(trace.steps) - 1 else i)


def _ensure_engine(pair, settings, prompt_text: str, chat: bool):
    """The session's live engine, started on the prompt when there is none or the pair changed under it."""
    engine = Explorer.ENGINE.get()
    if engine is not None and pair is not None and _runs_on(engine, pair):
        return engine
    if pair is None:
        raise ValueError("no model pair is loaded: see the message above")
    engine = make_engine(pair, settings, prompt_text, chat)
    _go_live(engine, _run_key(settings, prompt_text, chat))
    return engine


def _go_live(engine, run_settings: dict) -> None:
    """Make ``engine`` the session's live run, on screen from its latest step."""
    Explorer.ENGINE.set(engine)
    Explorer.TRACE.set(engine.trace)
    Explorer.CURSOR.set(None)
    Explorer.REPLAY.set(None)
    Explorer.RUN_SETTINGS.set(run_settings)


def _runs_on(engine, pair) -> bool:
    """Whether ``engine`` runs on the loaded ``pair``: the same pair, or (``layer-skip``) the pair whose draft is the
    target's own first layers, which ``build_engine`` derives from it."""
    own = engine.pair
    return own is pair or (own.target is pair.target and getattr(own.draft, "shares_target", False))


def _run_key(settings, prompt_text, chat):
    return {k: v for k, v in settings.items() if k != "teach"} | {"prompt": prompt_text, "chat": chat}


def _continue_lesson(pair, settings, lesson) -> None:
    """Replay a lesson's run (``lesson["trace"]``) on ``pair`` through step ``lesson["step"]`` and make it the
    session's live run (``lesson``: what ``state.hand_off_to_explorer`` handed over). Where this machine cannot
    replay the recorded steps (another device, dtype or draft quantization: e.g. a lesson recorded on a CPU with an
    int8 draft, opened on a GPU), the run goes on live from the recorded text instead (``replay.engine_after_text``),
    and the message says so. Raises ReplayError (another pair) or ValueError."""
    if pair is None:
        raise ValueError("no model pair is loaded: see the message above")
    trace, step = lesson["trace"], int(lesson["step"])
    try:
        with st.spinner(f"Replaying “{lesson['title']}” to step {step + 1} on the models…"):
            *_, (_, engine) = replay_steps(pair, trace, step)
        said = f"Continuing “{lesson['title']}” live from step {step + 1}: Step goes on."
    except ReplayError as exc:
        engine = engine_after_text(pair, trace, step)
        said = (f"Continuing “{lesson['title']}” live from the text it had after step {step + 1}: its steps cannot "
                f"be replayed here ({exc}). Step goes on from that text.")
    _go_live(engine, _run_key(settings, trace.prompt, True))  # the prompt box's text
    Explorer.CONTINUED.set(said)


def _do_step(pair, settings, prompt_text, chat) -> None:
    engine = _ensure_engine(pair, settings, prompt_text, chat)
    with engine_lock():
        if engine.finished:
            set_error("This run has finished. Press Reset to start a new one.", ERROR)
            return
        engine.step()
    Explorer.CURSOR.set(None)


def _do_run(pair, settings, prompt_text, chat) -> None:
    """Step until the run ends. A click on Stop (or any widget) interrupts this script between two steps;
    every step is complete when it returns, so the trace and the caches stay consistent."""
    engine = _ensure_engine(pair, settings, prompt_text, chat)
    if engine.finished:
        set_error("This run has finished. Press Reset to start a new one.", ERROR)
        return
    bar = st.progress(0.0, text="Running to the end… (Stop interrupts after the current step)")
    total = engine.state.max_new_tokens

    Explorer.CURSOR.set(None)  # follow the run (once: an interrupted run must not move it later)

    def progress(_step):
        bar.progress(min(1.0, engine.n_generated / total), text=f"{engine.n_generated}/{total} tokens · "
                     "Stop interrupts after the current step")

    Explorer.RUNNING.set(True)  # still set on the next rerun = this run was interrupted
    lock = engine_lock()
    try:
        while True:
            with lock:  # released between steps, where the progress call lets Streamlit interrupt this run
                if engine.finished:
                    break
                step = engine.step()
            progress(step)
    except Exception:  # a real error, not Streamlit's interrupt (a BaseException): not a stop
        Explorer.RUNNING.clear()
        raise
    Explorer.RUNNING.clear()
    bar.empty()


def _borrowed_stop_model(pair, trace) -> None:
    """Where the run's stop model was trained on another pair: say so, and offer to calibrate one for this pair
    (``decision/calibrate.py``; the next run uses it)."""
    source = (trace.settings.get("decision_model") or {}) if trace is not None else {}
    if source.get("how") != "transferred":
        return
    st.info(f"The stop model was trained on **{html.escape(str(source.get('trained_on')))}**, not on this pair: "
            "its predictions are a prior, and online adaptation (last layer) learns this pair's acceptance as the "
            "run goes. Calibrating drafts on 24 prompts and trains a model for this pair (about two minutes for a "
            "1.5B target on a 2-core CPU); the next run uses it.")
    if pair is None or not st.button("Calibrate the stop model for this pair", key="calibrate_btn"):
        return

    bar = st.progress(0.0, text="Calibrating…")
    try:
        with engine_lock():
            card = calibrate(pair, on_progress=lambda message, fraction: bar.progress(fraction, text=message))
    except (ValueError, OSError) as exc:
        set_error(f"Calibration failed: {exc}", ERROR)
        return
    auc = card["models"].get(source.get("kind", "context"), {}).get("roc_auc")
    st.success(f"Calibrated on {card['data']['records']} drafted tokens"
               + (f" (ROC-AUC {auc:.2f} on held-out prompts)" if auc is not None else "")
               + ". Reset starts a run with this pair's own stop model.")


def _load_trace(upload) -> None:
    """Validate and replay an uploaded trace; a bad file leaves the current session untouched."""
    trace, problem = parse_upload(upload, Explorer.LOADED_FILE, MAX_TRACE_BYTES, loads_run, TraceError, "trace")
    if problem:
        set_error(problem, ERROR)
    if trace is None:
        return
    replay_in_explorer(trace, upload.name)
    set_error(None, ERROR)


def controls(trace, replaying: bool) -> None:
    """The button row. Stop needs no handler: any click while Run to end goes on makes Streamlit interrupt that script
    run (between two steps: Streamlit calls happen only in the progress callback); the next run sees the ``running``
    flag still set. These buttons rerun the whole page; Back, Forward and Go to step belong to the step view
    (``step_view``), which they rerun alone."""
    b = layout.button_row("controls")  # each button as wide as its label; the row wraps, never a label
    b.button("Step", type="primary", key="step_btn", on_click=_request, args=("step",), disabled=replaying,
             help="draft and verify one speculative round on the real models")
    b.button("Run to end", key="run_btn", on_click=_request, args=("run",), disabled=replaying)
    b.button("Stop", key="stop_btn", help="interrupts Run to end after the current step")
    b.button("Reset", key="reset_btn", on_click=_reset)
    b.download_button("Download trace", data=(lambda t=trace: t.to_json()) if trace is not None else "",
                      file_name="spec-explorer-trace.json", mime="application/json", key="download_btn",
                      disabled=trace is None, on_click="ignore",
                      help="the whole session as JSON: settings, model ids, every step; replay it with Load trace")
    # built on the click, on its own thread (about 1.6 MB: Plotly.js inlined), not on every rerun
    b.download_button("Download as HTML", data=(lambda t=trace: trace_html(t)) if trace is not None else "",
                      file_name="spec-explorer-trace.html", mime="text/html", key="download_html_btn",
                      disabled=trace is None or not trace.steps, on_click="ignore",
                      help="the session as one page that plays its steps in any browser, offline: for a bug "
                           "report or a hand-in")


def step_navigation(trace) -> None:
    """Back, Forward and the Go to step slider (the step view's first row)."""
    c = _cursor()
    n = len(trace.steps)
    b = layout.button_row("navigation")
    b.button("Back", key="back_btn", on_click=_go, args=(-1,), disabled=c is None or c == 0)
    b.button("Forward", key="forward_btn", on_click=_go, args=(1,), disabled=c is None or c >= n - 1)
    if n >= 2:
        if Explorer.STEP_SLIDER.get() != c + 1:
            Explorer.STEP_SLIDER.set(c + 1)
        with b.container(width="stretch", key="step_slider_box"):  # at least 240 px wide: layout.LAYOUT_CSS
            st.slider("Go to step", 1, n, key=Explorer.STEP_SLIDER.name, on_change=_slider_moved)


@st.fragment
def step_view(trace, teach: bool, pair, replaying: bool) -> None:
    """The run on screen from the step at the cursor, a fragment of the page: Back, Forward, Go to step and the step
    panels' own controls (a click on the tree, the what-if slider and edit, the optimal tree's budget) rerun this
    part of the page alone, not the sidebar, the prompt and the run's instruments below it. A control whose work
    needs the models or another run (probe, re-verify, run the optimal tree) reruns the whole page
    (``instruments_panel.app_button``). ``pair``: the loaded models (None when replaying a file)."""
    step_navigation(trace)
    _drawn(replaying, show_run, trace, _cursor(), teach, pair)


def _drawn(replaying: bool, draw, *args) -> None:
    """``draw(*args)``; a replayed file that validated but still cannot be drawn gets a message instead."""
    if not replaying:
        draw(*args)
        return
    try:
        draw(*args)
    except Exception as exc:  # noqa: BLE001 - a file that validated but still cannot be drawn
        st.error(f"This trace cannot be drawn: {type(exc).__name__}: {exc}. Press Reset.")


def explorer_page(settings) -> None:
    st.title("Speculative decoding explorer")
    st.caption("Draft a token tree with a small model, verify it with the large one in a single pass, and watch "
               "every decision. Methods: AR, SD, MCSD, the improved MCSD of Lu et al. 2024, prompt lookup, Token "
               "Recycling, a hybrid of both with the draft model, an EAGLE-3 head reading the target's own hidden "
               "states, and layer skip (the target drafting for itself).")
    st.html(layout.LAYOUT_CSS)
    if settings["teach"]:
        st.html(layout.TEACH_CSS)

    examples = example_prompts()

    def use_example():
        choice = Explorer.EXAMPLE.get()
        if choice and examples.get(choice):
            Explorer.PROMPT_TEXT.set(examples[choice])

    st.selectbox("Example prompt", [""] + list(examples), key=Explorer.EXAMPLE.name, on_change=use_example,
                 format_func=lambda s: s or "— pick one —")  # a phone's box at teach mode's size cut a longer one
    Explorer.PROMPT_TEXT.ensure()  # a real prompt: the first Step draws a tree
    prompt_text = st.text_area("Prompt", key=Explorer.PROMPT_TEXT.name, height=110)
    chat = st.checkbox("Apply the chat template", value=Explorer.CHAT.default, key=Explorer.CHAT.name)
    with st.expander("Save and replay", expanded=Explorer.REPLAY.get() is not None):
        st.caption("**Download trace** saves the session as JSON (schema version, settings, model ids, every step). "
                   "**Load trace** replays one here with no model loaded: Back, Forward and the slider move "
                   f"through its steps. Files up to {MAX_TRACE_BYTES // 2**20} MB.")
        _load_trace(st.file_uploader("Load trace", type=["json"], key="trace_upload"))

    lesson = Explorer.CONTINUE_LESSON.pop()
    if lesson is not None:  # the Classroom's "Continue live": replay the lesson's run to its step, then go on
        _reset()
        guarded(_continue_lesson, pair_or_message(settings), settings, lesson, error_key=ERROR)
    if Explorer.INSTRUMENT_RESET.pop():  # "Run mcsd with this tree": a new run, straight away
        _reset()
        _request("run")
    pending = Explorer.PENDING.pop()
    if Explorer.RUNNING.pop():
        Explorer.STOPPED.set(True)
        with engine_lock():  # the interrupted run may still be finishing its step: draw after it
            pass
    replaying = Explorer.REPLAY.get() is not None
    pair = None
    if not replaying:  # a replayed trace needs no model
        pair = pair_or_message(settings)
        if pair is not None:
            st.caption(f"Models: **{html.escape(pair.name)}** · {str(pair.dtype).removeprefix('torch.')} on "
                       f"{pair.device} · draft {pair.draft_quant}"
                       + (" · weights packed for oneDNN" if pair.packed_weights else ""))
    if pending == "step":
        guarded(_do_step, pair, settings, prompt_text, chat, error_key=ERROR)
    if not replaying:  # the instrument buttons' requests (they may switch the session to a new run)
        run_instrument_requests(pair, _trace())
    trace = _trace()
    runs_selector()
    controls(trace, replaying)
    save_as_lesson(trace)
    if pending == "run":
        guarded(_do_run, pair, settings, prompt_text, chat, error_key=ERROR)
        st.rerun()  # redraw the controls for the finished run
    _borrowed_stop_model(pair, trace)
    engine = Explorer.ENGINE.get()
    if ERROR.get():
        st.error(ERROR.get())
    elif Explorer.CONTINUED.get() and engine is not None:
        st.success(Explorer.CONTINUED.get())
    if Explorer.STOPPED.get() and engine is not None:
        st.info(f"Stopped after {engine.n_generated} tokens: Step or Run to end goes on.")

    if trace is None:
        st.info("Press **Step** to draft and verify one speculative round on the prompt, or load a saved trace.")
        if pair is not None:
            audit_panel(pair, settings, prompt_text, chat)
            rules_panel(pair, settings, prompt_text, chat)
        return
    if replaying:
        m = trace.model
        st.info(f"Replaying **{html.escape(str(Explorer.REPLAY.get()))}** with no model loaded: "
                f"{html.escape(str(m.get('name')))} ({html.escape(str(m.get('draft_id')))} → "
                f"{html.escape(str(m.get('target_id')))}), method "
                f"**{html.escape(str(trace.settings['method']['method']))}**. Back, Forward and the slider move "
                "through its steps; Reset leaves the replay.")
    if not replaying and Explorer.RUN_SETTINGS.get() != _run_key(settings, prompt_text, chat):
        st.info("Settings or prompt changed since this run started: press Reset to apply them.")
    if trace.settings["method"].get("lossy"):
        st.warning("Lossy mode: the longest-branch rule of Lu et al. 2024 does not preserve the target's distribution.")
    if engine is not None and engine.finished:
        st.success("Run finished (max new tokens or end of sequence). Press Reset to start again.")
    step_view(trace, settings["teach"], pair, replaying)
    if trace.steps:
        _drawn(replaying, run_instruments, trace, settings["teach"], pair)
    if pair is not None:
        audit_panel(pair, settings, prompt_text, chat)
        rules_panel(pair, settings, prompt_text, chat)


def rules_panel(pair, settings, prompt_text: str, chat: bool) -> None:
    """Every verification rule on this prompt and the sidebar's tree, and RSD-S's beam tree of about as many nodes:
    tokens per target call of each (``analysis/rules.py``)."""
    with st.expander("Which rule accepts more? Every verification rule on this prompt"):
        st.caption("Decodes the prompt once per rule with the sidebar's tree, sampling and seed (RSD-S with its own "
                   "beam tree of about as many nodes) and counts tokens per target call. Every rule is exact: they "
                   "differ only in how many drafted tokens survive. Needs a temperature above 0 and a method that "
                   "drafts a tree (mcsd, sd); on the embedded pair a rule costs about a second a step.")
        tokens = st.slider("Tokens per rule", 8, 64, 32 if settings["spec"] == "tiny" else 16, 8, key="rules_n")
        if st.button("Compare the rules", key="rules_btn"):
            bar = st.progress(0.0, text="Decoding…")
            try:
                config = build_config(settings["method"], settings["changes"])
                sampling = SamplingConfig(**settings["sampling"])
                if sampling.greedy or not config.draft_branching():
                    raise ValueError("the rules differ only when sampling from a drafted tree: set a temperature "
                                     "above 0 and pick mcsd or sd")
                ids = encode_prompt(pair.tokenizer, prompt_text, chat_template=chat)
                with engine_lock():
                    rows = compare_rules(pair, config.with_(verifier="auto"), sampling, [ids], tokens,
                                         progress=lambda d, t: bar.progress(d / t, text=f"{d}/{t} runs"))
                Explorer.RULES.set({"rows": rows, "tokens": tokens, "temperature": sampling.temperature})
            except (PromptError, TreeShapeError, ValueError) as exc:
                Explorer.RULES.clear()
                st.error(str(exc))
            finally:
                bar.empty()
        result = Explorer.RULES.get()
        if result:
            st.plotly_chart(figures.rules_figure(result["rows"]), width="stretch", key="rules_chart")
            paired = figures.same_drafts_figure(result["rows"])
            if paired is not None:
                st.caption("Each rule's run above follows its own text once a sampled token differs, so its count "
                           "also depends on where the text went. Below, the paired test: each run's own drafted "
                           "trees, valued in expectation under every rule that assumes the same drawing of children, "
                           "on the same target and draft probabilities.")
                st.plotly_chart(paired, width="stretch", key="rules_paired_chart")
            skipped = [f"{r['label']}: {r['skipped']}" for r in result["rows"] if "skipped" in r]
            if skipped:
                st.caption("Not run on this tree: " + "; ".join(skipped))


def show_run(trace, cursor: int | None, teach: bool, pair=None) -> None:
    """The run on screen at the step ``cursor``: metrics up to it, the text, the step's panels, its what-if, its
    timeline and the optimal tree beside its own (``pair``: the loaded models, which the probe and the what-if need;
    None when replaying a file)."""
    panels.metrics_row(trace, cursor)
    st.markdown("**Generated text** (each step's tokens shaded; bonus tokens underlined in blue; the step on "
                "screen outlined)")
    st.markdown(figures.text_html(trace, current=cursor), unsafe_allow_html=True)
    if cursor is None:
        return
    step = trace.steps[cursor]
    panels.step_panels(trace, step, teach, probe=_results(Explorer.PROBES, trace).get(step.index),
                       can_probe=pair is not None)
    counterfactual_section(step, _results(Explorer.COUNTERFACTUALS, trace).get(step.index),
                           can_edit=pair is not None, teach=teach,
                           temperature=trace.temperature)
    costs = _costs_for(pair)
    timeline_section(trace, step, costs, teach)
    optimal_tree_section(trace, step, acceptance_report(trace, costs), can_run=pair is not None, teach=teach)


def run_instruments(trace, teach: bool, pair=None) -> None:
    """The instruments of the whole run, under the step view (they do not change with the step on screen):
    expected against realised acceptance (with the forward-cost measurement: ``pair``, the loaded models) and the
    stop signal's calibration."""
    acceptance_section(trace, _costs_for(pair), can_measure=pair is not None, teach=teach)
    calibration_section(trace, teach)
    if (trace.settings.get("head") or {}).get("distilled") is not None:
        distill_section(learned_head_history(), teach, reset=forget_learned_head)
    elif (trace.settings.get("method") or {}).get("online_distill"):  # a draft's LoRA adapter learning
        distill_section(learned_head_history(), teach, reset=forget_learned_head, who="draft")


def _results(key, trace, create: bool = False) -> dict:
    """Per-step results of an instrument (``Explorer.PROBES``, ``Explorer.COUNTERFACTUALS``) held for ``trace``:
    step index -> plain data. Results of another trace do not count; with ``create`` they make way for a new
    holder."""
    held = key.get()
    if held is not None and held.get("trace") is trace:
        return held
    if create:
        held = {"trace": trace}
        key.set(held)
        return held
    return {}


def _costs_for(pair) -> dict | None:
    held = Explorer.FORWARD_COSTS.get()
    return held["costs"] if held and pair is not None and held["pair"] == pair.name else None


def _store_current_run() -> None:
    runs, i = Explorer.RUNS.get(), Explorer.RUN_INDEX.get()
    if runs is not None and i is not None:
        runs[i].update(engine=Explorer.ENGINE.get(), trace=_trace())


def _show_run(run: dict, index: int) -> None:
    """Put ``run`` (one of ``Explorer.RUNS``, at ``index``) on screen from its latest step."""
    Explorer.ENGINE.set(run["engine"])
    Explorer.TRACE.set(run["trace"])
    Explorer.CURSOR.set(None)
    Explorer.RUN_INDEX.set(index)
    _forget_clicks()


def _switch_run() -> None:
    _store_current_run()
    i = int(Explorer.RUN_CHOICE.get())
    _show_run(Explorer.RUNS.get()[i], i)


def new_run_from(engine, name: str) -> None:
    """Make ``engine`` (a what-if branch) the session's current run; the runs so far stay in ``Explorer.RUNS``."""
    runs = Explorer.RUNS.setdefault([])
    if Explorer.RUN_INDEX.get() is None:
        runs.append({"name": "run 1 (as recorded)", "engine": Explorer.ENGINE.get(), "trace": _trace()})
    else:
        _store_current_run()
    runs.append({"name": name, "engine": engine, "trace": engine.trace})
    Explorer.RUN_CHOICE.set(len(runs) - 1)
    _show_run(runs[-1], len(runs) - 1)


def runs_selector() -> None:
    """Switch between the session's runs (a what-if edit continued makes a new one) and download them all."""
    runs = Explorer.RUNS.get()
    if not runs or len(runs) < 2:
        return

    c = st.columns([3, 1])
    c[0].selectbox("Run of this session", list(range(len(runs))), format_func=lambda i: runs[i]["name"],
                   key=Explorer.RUN_CHOICE.name, on_change=_switch_run)
    _store_current_run()
    c[1].download_button("Download all runs", file_name="spec-explorer-runs.json", mime="application/json",
                         data=lambda: json.dumps({"runs": [{"name": r["name"], "trace": r["trace"].to_dict()}
                                                           for r in runs]}, ensure_ascii=False),
                         key="download_runs", on_click="ignore")


def run_instrument_requests(pair, trace) -> None:
    """Do what the instrument buttons asked for (they only set a flag): probe a step, measure forward costs. The
    results are plain data in the session; errors become a message and the session goes on."""
    index = Explorer.PROBE_REQUEST.pop()
    if index is not None and pair is not None and trace is not None and index < len(trace.steps):
        engine = Explorer.ENGINE.get()

        def probe():
            if engine is not None and engine.trace is trace and index == len(trace.steps) - 1:
                with engine_lock():
                    return probe_last_step(engine)
            with st.spinner(f"Replaying the run to step {index + 1}…"):
                *_, (_, replayed) = replay_steps(pair, trace, index)
            return probe_last_step(replayed)

        with st.spinner(f"Probing step {index + 1}: one plain forward per node…"):
            result = guarded(probe, error_key=Explorer.PROBE_ERROR)
        if result is not None:
            _results(Explorer.PROBES, trace, create=True)[index] = result.to_dict()
    if Explorer.COSTS_REQUEST.pop() and pair is not None and trace is not None:
        with st.spinner("Timing draft and target forwards at 1 to 64 rows…"):
            costs = guarded(measure_forward_costs, pair, trace.prompt_ids + trace.generated_ids,
                            error_key=Explorer.PROBE_ERROR)
        if costs is not None:
            Explorer.FORWARD_COSTS.set({"pair": pair.name, "costs": costs})
            Explorer.RUN_FIGURES.clear()  # the figures drawn from the costs measured before
    _what_if_requests(pair, trace)
    error = Explorer.PROBE_ERROR.pop()
    if error:
        st.error(error)


def _what_if_requests(pair, trace) -> None:
    """A what-if re-verification (``Explorer.CF_REQUEST``) and "continue from the edit" (``Explorer.CF_BRANCH``)."""
    request = Explorer.CF_REQUEST.pop()
    if request is not None and pair is not None and trace is not None and request["step"] < len(trace.steps):
        def run():
            edit = parse_edits(request["edits"], pair.tokenizer)
            return counterfactual(pair, trace, request["step"], edit, continue_tokens=request["continue"])

        with st.spinner(f"Replaying to step {request['step'] + 1} and re-verifying it…"):
            cf = guarded(run, error_key=Explorer.PROBE_ERROR)
        if cf is not None:
            _results(Explorer.COUNTERFACTUALS, trace, create=True)[request["step"]] = {**cf.to_dict(),
                                                                                      "engine": cf.engine}
    index = Explorer.CF_BRANCH.pop()
    held = _results(Explorer.COUNTERFACTUALS, trace)
    if index is not None and index in held:
        engine = held[index]["engine"]
        n = len(Explorer.RUNS.get() or [None]) + 1
        if engine is not None:
            new_run_from(engine, f"run {n}: step {index + 1} edited ({'; '.join(held[index]['differences'][:1])})")
            held[index]["engine"] = None  # one run per branch: the engine now belongs to it


def audit_panel(pair, settings, prompt_text: str, chat: bool) -> None:
    """Sample the first two tokens many times and test them against the target's exact distribution."""
    with st.expander("Losslessness audit: does this method sample exactly from the target?"):
        st.caption("Samples the first two committed tokens N times from the prompt (one speculative step each) and "
                   "compares them with the target's exact probabilities (chi-square test, total variation). Needs "
                   "a temperature above 0. On the embedded pair each sample costs about half a second.")
        samples = st.slider("Samples", 100, 5000, 1000 if settings["spec"] == "tiny" else 200, 100, key="audit_n")
        if st.button("Run audit", key="audit_btn"):
            bar = st.progress(0.0, text="Sampling…")
            try:
                config = build_config(settings["method"], settings["changes"])
                sampling = SamplingConfig(**settings["sampling"])
                ids = encode_prompt(pair.tokenizer, prompt_text, chat_template=chat)
                result = audit(pair, config, sampling, ids, samples,
                               progress=lambda d, t: bar.progress(d / t, text=f"{d}/{t} samples"))
                Explorer.AUDIT.set(result.to_dict())
            except (PromptError, TreeShapeError, ValueError) as exc:
                Explorer.AUDIT.clear()
                st.error(str(exc))
            finally:
                bar.empty()
        result = Explorer.AUDIT.get()
        if result:
            verdict = "passes" if result["passed"] else "FAILS"
            st.markdown(f"**{html.escape(result['method']['method'])}** with verifier `{result['verifier']}` "
                        f"{verdict} at α = {result['alpha']} over {result['samples']} samples.")
            c1, c2 = st.columns(2)
            c1.plotly_chart(figures.audit_figure(result, "first"), width="stretch", key="audit_first")
            if result.get("pairs"):
                c2.plotly_chart(figures.audit_figure(result, "pairs"), width="stretch", key="audit_pairs")
