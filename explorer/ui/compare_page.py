"""The Compare page: two methods, or two settings of one method, on the same prompt and seed, side by side.

Session state: ``state.Compare``. The steps take the session's engine lock (``state.engine_lock``), which the
Explorer's steps take too; the per-source counts come from ``trace.metrics.draft_source_counts``."""

from __future__ import annotations

import html

import streamlit as st

from ..engine.config import METHOD_LABELS, METHODS
from ..trace import figures
from ..trace.metrics import draft_source_counts, run_metrics
from ..trace.records import SOURCE_LABELS
from .common import guarded, make_engine, pair_or_message, set_error
from .sidebar import method_widgets
from .state import Compare, engine_lock

ERROR_KEY = Compare.ERROR


def _reset() -> None:
    Compare.ENGINES.clear()
    set_error(None, ERROR_KEY)


def _engines(settings, b_method, b_changes, prompt_text, chat):
    engines = Compare.ENGINES.get()
    if engines is None:
        pair = pair_or_message(settings)
        if pair is None:
            return None
        engines = [make_engine(pair, settings, prompt_text, chat),
                   make_engine(pair, settings, prompt_text, chat, method=b_method, changes=b_changes)]
        Compare.ENGINES.set(engines)
    return engines


def _advance(settings, b_method, b_changes, prompt_text, chat, to_end: bool) -> None:
    engines = _engines(settings, b_method, b_changes, prompt_text, chat)
    if engines is None:
        return
    if all(e.finished for e in engines):
        set_error("Both runs have finished. Press Reset both to start again.", ERROR_KEY)
        return
    bar = st.progress(0.0, text="Running both…") if to_end else None
    while True:  # alternate, so both runs see the same machine load
        with engine_lock():  # an interrupted run may still be stepping (see state.engine_lock)
            for e in engines:
                if not e.finished:
                    e.step()
        if bar is not None:
            done = sum(e.n_generated for e in engines) / sum(e.state.max_new_tokens for e in engines)
            bar.progress(min(1.0, done), text=f"{done:.0%}")
        if not to_end or all(e.finished for e in engines):
            break
    if bar is not None:
        bar.empty()


def compare_page(settings) -> None:
    st.title("Compare two methods")
    st.caption("Run A uses the sidebar's settings; choose run B here. Both decode the same prompt with the same "
               "seed and sampling settings on the same models, one step each in turn.")
    Compare.PROMPT.ensure()
    prompt_text = st.text_area("Prompt", key=Compare.PROMPT.name, height=90)
    chat = st.checkbox("Apply the chat template", value=Compare.CHAT.default, key=Compare.CHAT.name)
    with st.expander("Run B settings", expanded=True):
        b_method = st.selectbox("Method (B)", list(METHODS), index=METHODS.index("sd"), format_func=METHOD_LABELS.get,
                                key=Compare.B_METHOD.name)
        b_changes = method_widgets(st, b_method, prefix=Compare.B_WIDGETS.prefix)
    c = st.columns([1, 1.3, 1, 4])
    if c[0].button("Step both", type="primary", key="cmp_step"):
        guarded(_advance, settings, b_method, b_changes, prompt_text, chat, False, error_key=ERROR_KEY)
    if c[1].button("Run both to end", key="cmp_run"):
        guarded(_advance, settings, b_method, b_changes, prompt_text, chat, True, error_key=ERROR_KEY)
    c[2].button("Reset both", key="cmp_reset", on_click=_reset)
    if ERROR_KEY.get():
        st.error(ERROR_KEY.get())
    engines = Compare.ENGINES.get()
    if not engines:
        st.info("Press **Step both** to run one step of each method.")
        return
    cols = st.columns(2)
    for name, col, engine in zip("AB", cols, engines):
        with col:
            column(name, engine.trace)


def column(name: str, trace) -> None:
    cfg = trace.settings["method"]
    adaptive = f", branch where q < {cfg['branch_threshold']:g}" if cfg.get("branch_threshold", 1.0) < 1.0 else ""
    free = (f", lookup copies up to {cfg.get('lookup_tokens')} tokens", f", recycling template "
            f"{cfg.get('recycling_widths')}")
    shape = {"sd": f"γ = {cfg['gamma']}", "mcsd": f"k_config {cfg['k_config']}{adaptive}",
             "mcsd-improved": f"k_config {cfg['k_config']}{adaptive}, depth {cfg['max_depth']}, stop {cfg['stop']}",
             "prompt-lookup": free[0][2:], "token-recycling": free[1][2:],
             "hybrid": f"k_config {cfg['k_config']}{adaptive}, depth {cfg['max_depth']}, stop {cfg['stop']}"
                       + "".join(free)}
    st.subheader(f"{name}: {METHOD_LABELS[cfg['method']]}")
    st.caption(html.escape(shape.get(cfg["method"], "one token per target call")) + f" · verifier "
               f"{html.escape(trace.settings.get('verifier', ''))}")
    m = run_metrics(trace)
    k = st.columns(3)
    k[0].metric("Tokens", m["generated_tokens"])
    k[1].metric("Tokens / target call", "–" if not m["target_calls"] else f"{m['tokens_per_target_call']:.2f}")
    k[2].metric("Tokens / s", "–" if not m["tokens_per_s"] else f"{m['tokens_per_s']:.1f}")
    k = st.columns(3)
    k[0].metric("Target calls", m["target_calls"])
    k[1].metric("Draft calls", m["draft_calls"])
    acc = m["mcsd_acceptance_rate"]
    k[2].metric("Acceptance (MCSD)", "–" if acc is None else f"{acc:.2f}")
    st.markdown(figures.text_html(trace, current=len(trace.steps) - 1 if trace.steps else None),
                unsafe_allow_html=True)
    if trace.steps:
        st.plotly_chart(figures.tree_figure(trace.steps[-1], color_by="source"), width="stretch",
                        key=f"cmp_tree_{name}")
        by_source = draft_source_counts(trace.steps)
        if by_source:
            st.caption("Committed drafts by source: " + ", ".join(f"{SOURCE_LABELS[s]} {a}/{p}"
                                                                  for s, (a, p) in by_source.items()))
