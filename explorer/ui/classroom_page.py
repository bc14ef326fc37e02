"""The Classroom page: a recorded lesson told phase by phase on one projector screen, with no model loaded.

A lesson box (and a lesson file to open), then the lesson's player (``lessons/player.py``, the page ``lessons
export`` writes) embedded by ``ui/lesson_player.py``: the step's draft tree, the tree attention mask and the
plain-language account of the phase on screen (``lessons/phases.py``), the notes, the race and the speedup curve. Next,
Back, Play, the keys (Right / Page Down / Space, Left / Page Up: what presentation clickers send; Home / End; a step
number and Enter) and the race's slider all run in the browser: a phase change reruns nothing on the server, so a
class of any size can step at once. **Continue live** sends the step on screen to the server, which loads the
embedded pair, replays the lesson's run to that step and carries on from there on the Explorer page.

Session state: ``state.Classroom``, which says what each key holds. Continue live hands the lesson to the Explorer
through ``state.hand_off_to_explorer``, which says what it writes.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from ..lessons.lesson import MAX_LESSON_BYTES, Lesson, LessonError, load_lesson, loads_lesson, shipped_lessons
from .common import parse_upload
from .lesson_player import STATIC_DIR, lesson_player, live_position, publish, static_serving
from .state import Classroom, hand_off_to_explorer

PLAYER_HEIGHT = "max(520px, calc(100vh - 150px))"  # the player under the lesson row, on any screen

# The player fills the screen under the lesson row: the main block's top and bottom padding (6rem and 10rem) shrink,
# the top to what keeps the lesson row clear of the app's header when the focused player scrolls into view. Streamlit
# has no option for that padding (the wide layout already lifts the width limit), so this stays CSS.
CLASSROOM_CSS = """<style>
[data-testid="stMainBlockContainer"] {padding-top: 3.2rem; padding-bottom: 0.5rem;}
</style>"""


@st.cache_resource(show_spinner=False, max_entries=32)
def _shipped(path: str, mtime: float) -> Lesson:
    """A shipped lesson, parsed once per file version and shared by every session (read-only)."""
    return load_lesson(path)


def _lessons() -> tuple[dict[str, Lesson], list[str]]:
    """Every lesson on offer (shipped, and one opened from a file), by key; the messages of files that failed."""
    out, problems = {}, []
    for path in shipped_lessons():
        try:
            lesson = _shipped(str(path), path.stat().st_mtime)
            out[lesson.id] = lesson
        except (LessonError, OSError) as exc:
            problems.append(f"{Path(path).name}: {exc}")
    uploaded = Classroom.UPLOADED.get()
    if uploaded is not None:
        out["file:" + uploaded.id] = uploaded
    return out, problems


def _continue_live() -> None:
    """Continue live (the player's trigger, a callback before the script): hand the lesson's run to the Explorer
    page, which loads the pair and replays it to the step the player showed."""
    where = live_position(Classroom.PLAYER.get())
    lesson = _lessons()[0].get(Classroom.LESSON.get())
    if where is None or lesson is None or not 0 <= where[0] < len(lesson.runs):
        return
    run, step = where
    steps = lesson.runs[run].trace.steps
    hand_off_to_explorer(lesson.runs[run].trace, max(0, min(step, len(steps) - 1)), lesson.title)


def _open_file(upload) -> None:
    lesson, problem = parse_upload(upload, Classroom.FILE, MAX_LESSON_BYTES, loads_lesson, LessonError, "lesson")
    if problem:
        Classroom.ERROR.set(problem)
    if lesson is not None:
        Classroom.UPLOADED.set(lesson)
        Classroom.LESSON.set("file:" + lesson.id)
        Classroom.ERROR.set(None)


def classroom_page() -> None:
    st.html(CLASSROOM_CSS)  # style only: it takes no room on the page
    lessons, problems = _lessons()
    for problem in problems:
        st.error(f"A shipped lesson cannot be opened: {problem}")
    if not lessons:
        st.info("No lessons are installed: record them with `python -m explorer lessons record`.")
        return
    if Classroom.LESSON.get() not in lessons:
        Classroom.LESSON.set(next(iter(lessons)))
    pick, upload = st.columns([4, 1.3], vertical_alignment="bottom")
    pick.selectbox("Lesson", list(lessons), key=Classroom.LESSON.name, format_func=lambda k: lessons[k].title,
                   label_visibility="collapsed")
    with upload.popover("Open a lesson file", width="stretch"):
        st.caption("A lesson file from `python -m explorer lessons record` (JSON, up to "
                   f"{MAX_LESSON_BYTES // 2**20} MB). The shipped lessons were recorded on the embedded pair; the "
                   "commands and machines are in each file.")
        _open_file(st.file_uploader("Lesson file", type=["json"], key="cls_upload"))
    if Classroom.ERROR.get():
        st.error(Classroom.ERROR.get())
    key = Classroom.LESSON.get()
    lesson = lessons[key]
    if not static_serving():
        st.error("This Streamlit does not serve the app's static folder, where the lesson player lives: start the "
                 "app from the project folder (its `.streamlit/config.toml` sets `server.enableStaticServing`), or "
                 "open the lesson as a page: `python -m explorer lessons export`.")
        return
    try:
        url = publish(lesson, key.replace(":", "-"))
    except OSError as exc:
        st.error(f"The lesson's page cannot be written to {STATIC_DIR / 'lessons'}: {exc}. "
                 "`python -m explorer lessons export --out DIR` writes it where you can.")
        return
    lesson_player(url, lesson.title, PLAYER_HEIGHT, Classroom.PLAYER.name, _continue_live)
