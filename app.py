"""Streamlit UI of the speculative decoding explorer: page set-up and routing only (pages in ``explorer/ui/``).

Data flows one way: models (cached, shared by all sessions) -> engine (one per session) -> RunTrace -> figures ->
page. The pages never touch the engine's tensors; they read traces, so a saved trace replays with no model.

Run: ``streamlit run app.py`` (``SPEC_EXPLORER_PAIR=tiny`` starts on the tiny random pair instead of the
embedded one).
"""

from __future__ import annotations

import streamlit as st

from explorer.ui.bench_page import benchmarks_page
from explorer.ui.classroom_page import classroom_page
from explorer.ui.compare_page import compare_page
from explorer.ui.explorer_page import explorer_page
from explorer.ui.sidebar import sidebar

PAGES = ["Explorer", "Classroom", "Compare", "Benchmarks"]


def page_from_url() -> str | None:
    """``?page=classroom`` (any page's name, any case) opens that page on a new session: a teacher's bookmark."""
    wanted = str(st.query_params.get("page", "")).lower()
    return next((p for p in PAGES if p.lower() == wanted), None)


if "page" not in st.session_state and page_from_url():
    st.session_state["page"] = page_from_url()
st.set_page_config(page_title="Speculative decoding explorer", page_icon="🌳", layout="wide",
                   initial_sidebar_state="collapsed" if st.session_state.get("page") == "Classroom" else "auto")
KEPT = ("prompt_text", "chat", "example", "cmp_prompt", "cmp_chat", "pair_spec", "draft_path", "target_path",
        "dtype", "method", "gamma", "lossy", "width", "max_depth", "stop", "decision_model", "verifier",
        "temperature", "top_k", "top_p", "seed", "max_new", "teach", "tree_template")
KEPT_PREFIXES = ("k_config_", "threshold_", "b_")


def keep_widget_values() -> None:
    """Streamlit forgets the value of a widget that a run does not draw (another page): writing each value back
    at the top of the run keeps prompts and settings across page changes."""
    for key in list(st.session_state):
        if key in KEPT or str(key).startswith(KEPT_PREFIXES):
            st.session_state[key] = st.session_state[key]


def mark_run_finished() -> None:
    """A hidden marker holding how many script runs of this session have finished: browser automation waits for
    it to change after a click instead of guessing how long the rerun takes (tests/browser.py)."""
    n = st.session_state.get("_finished_runs", 0) + 1
    st.session_state["_finished_runs"] = n
    st.sidebar.html(f'<span data-spec-run="{n}" hidden></span>')


def main() -> None:
    keep_widget_values()
    page = st.sidebar.radio("Page", PAGES, horizontal=True, key="page")
    if page == "Benchmarks":
        benchmarks_page()
        return
    if page == "Classroom":  # recorded lessons: no model is loaded
        classroom_page()
        return
    settings = sidebar()
    if page == "Compare":
        compare_page(settings)
    else:
        explorer_page(settings)


main()
mark_run_finished()
