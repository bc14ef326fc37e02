"""The Explorer's **Save as lesson**: the run on screen becomes a lesson of the shipped schema,
with the title, the question and the notes the teacher writes at chosen phases (``lessons/authoring.py``), saved as
a lesson file and as its player page, or opened in the Classroom at once (``state.hand_lesson_to_classroom``)."""

from __future__ import annotations

import streamlit as st

from ..lessons.authoring import MAX_TITLE, lesson_from_run
from ..lessons.lesson import LessonError
from ..lessons.phases import PHASE_KINDS
from ..lessons.player import player_html
from .state import hand_lesson_to_classroom

NOTES_HELP = (f"One note per line: the step number, the phase ({', '.join(PHASE_KINDS)}; a draft level or a verified "
              "node id may follow), a colon and the text. The note shows at that phase, as the shipped lessons' do.")


def save_as_lesson(trace) -> None:
    """The popover under the Explorer's controls; disabled until the run has a step."""
    with st.popover("Save as lesson", disabled=trace is None or not trace.steps, icon=":material/school:",
                    help="this run as a lesson for the Classroom: a title, the question, notes at chosen phases"):
        title = st.text_input("Title", key="lesson_title", max_chars=MAX_TITLE,
                              placeholder="e.g. Why the second candidate wins here")
        question = st.text_area("The question it answers", key="lesson_question", height=68)
        notes = st.text_area("Notes", key="lesson_notes", height=110, help=NOTES_HELP,
                             placeholder="2 verify: the first candidate is rejected; its sibling is tested next\n"
                                         "3 commit: the bonus token is the target's own choice")
        if not title.strip():
            st.caption("Give the lesson a title to save it.")
            return
        try:
            lesson = lesson_from_run(trace, title, question, notes)
        except LessonError as exc:
            st.error(str(exc))
            return
        st.caption(f"{len(trace.steps)} steps, {len(lesson.notes)} note{'s' if len(lesson.notes) != 1 else ''}.")
        c = st.columns(3)
        # both built on the click (a lesson page is about 1.6 MB: Plotly.js inlined), not on every rerun
        c[0].download_button("Lesson file", data=lambda: lesson.to_json(), file_name=f"{lesson.id}.json",
                             mime="application/json", key="lesson_json_btn", on_click="ignore",
                             help="opens in the Classroom's 'Open a lesson file'")
        c[1].download_button("Lesson page", data=lambda: player_html(lesson), file_name=f"{lesson.id}.html",
                             mime="text/html", key="lesson_html_btn", on_click="ignore",
                             help="plays in any browser, offline: for a course page")
        c[2].button("Open in the Classroom", key="lesson_open_btn", on_click=hand_lesson_to_classroom,
                    args=(lesson,))
