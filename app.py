"""Streamlit UI of the speculative decoding explorer: page set-up and routing only (pages in ``explorer/ui/``).

Data flows one way: models (cached, shared by all sessions) -> engine (one per session) -> RunTrace -> figures ->
page. The pages never touch the engine's tensors; they read traces, so a saved trace replays with no model.

Pages (``st.navigation``, each at its own URL): the Explorer (``/``, also ``/explorer``), the Classroom
(``/classroom``), Compare (``/compare``), Forensics (``/forensics``) and Benchmarks (``/benchmarks``). An old link
``?page=classroom`` (any page's name, any case) still opens that page.

Run: ``streamlit run app.py`` (``SPEC_EXPLORER_PAIR=tiny`` starts on the tiny random pair instead of the
embedded one; ``SPEC_EXPLORER_PLUGINS=my_method.py`` loads a plugin, docs/plugins.md).
"""

from __future__ import annotations

import streamlit as st

from explorer.ui.bench_page import benchmarks_page
from explorer.ui.classroom_page import classroom_page
from explorer.ui.compare_page import compare_page
from explorer.ui.explorer_page import explorer_page
from explorer.ui.forensics_page import forensics_page
from explorer.ui.plugin_list import startup_plugins
from explorer.ui.sidebar import sidebar
from explorer.ui.state import App, keep_widget_values


def _explorer() -> None:
    explorer_page(sidebar())


def _compare() -> None:
    compare_page(sidebar())


def _forensics() -> None:
    forensics_page(sidebar())


def _to_explorer() -> None:
    """``/explorer``: the Explorer is the app's root page; the old path lands there."""
    st.switch_page(PAGES["Explorer"])


# title -> page; the Classroom and Benchmarks load no model and draw no sidebar settings
PAGES = {
    "Explorer": st.Page(_explorer, title="Explorer", icon=":material/account_tree:", url_path="start", default=True),
    "Classroom": st.Page(classroom_page, title="Classroom", icon=":material/school:", url_path="classroom"),
    "Compare": st.Page(_compare, title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    "Forensics": st.Page(_forensics, title="Forensics", icon=":material/search_insights:", url_path="forensics"),
    "Benchmarks": st.Page(benchmarks_page, title="Benchmarks", icon=":material/speed:", url_path="benchmarks"),
}
ALIASES = [st.Page(_to_explorer, title="Explorer", url_path="explorer", visibility="hidden")]


def page_from_url() -> str | None:
    """``?page=classroom`` (any page's name, any case): the page an old link or a teacher's bookmark names."""
    wanted = str(st.query_params.get("page", "")).lower()
    return next((p for p in PAGES if p.lower() == wanted), None)


def main() -> None:
    startup_plugins()  # SPEC_EXPLORER_PLUGINS and entry points, once per server: their methods join the menus
    keep_widget_values()  # prompts and settings survive the pages that do not draw their widgets (ui/state.py)
    page = st.navigation(list(PAGES.values()) + ALIASES)
    wanted = App.GO_TO.pop() or page_from_url()
    if wanted and PAGES[wanted].url_path != page.url_path:
        st.switch_page(PAGES[wanted])  # another part asked for it (a hand-off), or an old ?page= link
    if "page" in st.query_params:
        del st.query_params["page"]
    App.PAGE.set(page.title)
    st.set_page_config(page_title="Speculative decoding explorer", page_icon="🌳", layout="wide",
                       initial_sidebar_state="collapsed" if page.title == "Classroom" else "auto")
    page.run()


main()
