"""What keeps a page whole from a phone to a projector: the CSS the Explorer draws (teach mode's type, labels that
wrap between words), rows of charts that wrap, and rows of buttons as wide as their labels."""

from __future__ import annotations

import streamlit as st

# Teach mode's large type, for a projector (drawn with st.html: style only, it takes no room on the page), in the main
# area only: the sidebar's settings are the presenter's, and at 1.3rem its selectboxes cut their values. Streamlit
# has no per-page text size (theme.baseFontSize is the whole app's, fixed at start): this stays CSS. Icons keep
# their own size (a material icon is a ligature: larger type cut it to "expand_mo"); the heading rules name their
# elements more precisely than the rule for every element (its :not() counts), which would otherwise win.
TEACH_CSS = """<style>
[data-testid="stMain"] [class*="st-"]:not([data-testid="stIconMaterial"]), [data-testid="stMain"] .stMarkdown p,
[data-testid="stMain"] .stMarkdown li { font-size: 1.3rem !important; }
[data-testid="stMain"] [data-testid="stHeading"][data-testid] :is(h1, h1 *) { font-size: 2.6rem !important; }
[data-testid="stMain"] [data-testid="stHeading"][data-testid] :is(h2, h2 *, h3, h3 *) { font-size: 2rem !important; }
</style>"""


# What keeps the Explorer whole from a phone to a projector (drawn once per page with st.html):
# - metric labels wrap between words onto a second line, never inside one ("Generat|ed") and never cut to
#   "Generat..." (st.metric's label is one line, cut with an ellipsis, and has no option for it);
# - button labels never break inside a word: a row of buttons is a wrapping horizontal container (``button_row``),
#   so a button too wide for what is left of its row starts the next one;
# - the rows of charts (``chart_columns``) wrap: a column narrower than a chart can show its title in goes under the
#   one before it, instead of Plotly cutting the title at the chart's edge.
LAYOUT_CSS = """<style>
[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] * {white-space: normal !important;
  overflow: visible !important; text-overflow: clip !important; word-break: normal !important;
  overflow-wrap: normal !important;}
button p, [data-testid="stMetricValue"] * {word-break: keep-all !important; overflow-wrap: normal !important;}
[class*="st-key-wrap_"] [data-testid="stHorizontalBlock"] {flex-wrap: wrap !important;}
[class*="st-key-wrap_"] [data-testid="stColumn"] {min-width: min(100%, 400px) !important;}
.st-key-step_slider_box {min-width: min(100%, 240px);}
</style>"""


def chart_columns(spec, key: str) -> list:
    """``st.columns(spec)`` whose columns wrap onto the next line where the page is too narrow for each to be 400 px
    wide (``LAYOUT_CSS``): for rows of charts, whose titles and ticks need the room. ``key``: unique on the page."""
    with st.container(key=f"wrap_{key}"):
        return st.columns(spec)


def button_row(key: str):
    """A horizontal container whose buttons take their labels' width and wrap onto a second line where the row is
    too narrow (a button's label never breaks inside a word). ``key``: unique on the page."""
    return st.container(horizontal=True, key=f"buttons_{key}", gap="small", vertical_alignment="bottom")
