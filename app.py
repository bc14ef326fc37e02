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
from explorer.ui.forensics_page import forensics_page
from explorer.ui.sidebar import sidebar
from explorer.ui.state import App, keep_widget_values

PAGES = ["Explorer", "Classroom", "Compare", "Forensics", "Benchmarks"]


def page_from_url() -> str | None:
    """``?page=classroom`` (any page's name, any case) opens that page on a new session: a teacher's bookmark."""
    wanted = str(st.query_params.get("page", "")).lower()
    return next((p for p in PAGES if p.lower() == wanted), None)


if not App.PAGE.present() and page_from_url():
    App.PAGE.set(page_from_url())
st.set_page_config(page_title="Speculative decoding explorer", page_icon="🌳", layout="wide",
                   initial_sidebar_state="collapsed" if App.PAGE.get() == "Classroom" else "auto")


def mark_run_finished() -> None:
    """A hidden marker holding how many script runs of this session have finished: browser automation waits for
    it to change after a click instead of guessing how long the rerun takes (tests/browser.py)."""
    n = App.FINISHED_RUNS.get() + 1
    App.FINISHED_RUNS.set(n)
    st.sidebar.html(f'<span data-spec-run="{n}" hidden></span>')


def main() -> None:
    keep_widget_values()  # prompts and settings survive the pages that do not draw their widgets (ui/state.py)
    page = st.sidebar.radio("Page", PAGES, horizontal=True, key=App.PAGE.name)
    if page == "Benchmarks":
        benchmarks_page()
        return
    if page == "Classroom":  # recorded lessons: no model is loaded
        classroom_page()
        return
    settings = sidebar()
    if page == "Compare":
        compare_page(settings)
    elif page == "Forensics":
        forensics_page(settings)
    else:
        explorer_page(settings)


main()
mark_run_finished()
