"""The Classroom page: a recorded lesson told phase by phase on one projector screen, with no model loaded.

One row of controls (lesson, Back, Next, Play, pace, text size, Continue live), then the step's draft tree, the tree
attention mask and the plain-language account of the phase on screen (``lessons/phases.py``), side by side. Next and
Back move phase by phase across steps and runs; the keyboard does the same (Right arrow / Page Down, Left arrow / Page
Up: what presentation clickers send); Play advances on its own at the chosen pace and stops at the end of the lesson
or at any other key. **Continue live** loads the embedded pair, replays the lesson's run to the step on screen and
carries on from there on the Explorer page.

Session state: ``state.Classroom``, which says what each key holds. Continue live hands the lesson to the Explorer
through ``state.hand_off_to_explorer``, which says what it writes.
"""

from __future__ import annotations

import html
import time
from pathlib import Path

import streamlit as st

from ..lessons import phases
from ..lessons.lesson import MAX_LESSON_BYTES, Lesson, LessonError, load_lesson, loads_lesson, shipped_lessons
from ..lessons.race import measured_point, race_figure, speedup_figure
from ..trace import figures
from .common import parse_upload
from .state import App, Classroom, hand_off_to_explorer

PACES = (2, 3, 5, 8)  # seconds a phase stays on screen while playing
TEXT_SIZES = (16, 18, 20, 24)  # px of every chart text; 16 is the floor for a 1280x720 projector
FIGURE_HEIGHT = 500  # px: the height the mask's row labels are thinned for; on screen the tree and the mask
# fill the viewport under the control row (CLASSROOM_CSS): 500 px at 720 px high, 860 px at 1080

CLASSROOM_CSS = """<style>
[data-testid="stMainBlockContainer"] {padding-top: 2.6rem; padding-bottom: 0.5rem; max-width: 100%;}
.cls-head {font-size: 1.05rem; margin: 0 0 0.2rem 0;}
.cls-where {font-size: 1rem; color: #555; margin: 0;}
.cls-account p, .cls-account li {font-size: 1.15rem; line-height: 1.45;}
div.st-key-cls_tree_box, div.st-key-cls_mask_box {
  flex: none !important; height: max(420px, calc(100vh - 220px)) !important;}
div.st-key-cls_tree_box > div, div.st-key-cls_mask_box > div,
div.st-key-cls_tree_box [data-testid=stFullScreenFrame], div.st-key-cls_mask_box [data-testid=stFullScreenFrame],
div.st-key-cls_tree_box [data-testid=stPlotlyChart], div.st-key-cls_mask_box [data-testid=stPlotlyChart],
div.st-key-cls_tree_box .js-plotly-plot, div.st-key-cls_mask_box .js-plotly-plot {height: 100% !important;}
</style>"""

# Page Down / Page Up click Next / Back (Right / Left are the buttons' own shortcuts); any other key pauses Play.
KEYS_JS = """<script>
(function () {
  if (window.__specClassroomKeys) { return; }
  window.__specClassroomKeys = true;
  const click = (key) => {
    const b = document.querySelector('.st-key-' + key + ' button');
    if (b && !b.disabled) { b.click(); }
  };
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (!document.querySelector('.st-key-cls_next')) { return; }
    if (t && (t.tagName === 'INPUT' || t.tagName === 'TEXTAREA' || t.isContentEditable)) { return; }
    if (e.key === 'PageDown') { e.preventDefault(); click('cls_next'); return; }
    if (e.key === 'PageUp') { e.preventDefault(); click('cls_back'); return; }
    if (['ArrowRight', 'ArrowLeft', 'Shift', 'Control', 'Alt', 'Meta'].includes(e.key)) { return; }
    const play = document.querySelector('.st-key-cls_play button');
    if (play && play.innerText.includes('Pause')) { play.click(); }
  }, true);
})();
</script>"""


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


def _move(delta: int, n: int) -> None:
    Classroom.PLAYING.set(False)
    Classroom.POS.set(max(0, min(n - 1, Classroom.POS.get() + delta)))


def _toggle_play(n: int) -> None:
    playing = not Classroom.PLAYING.get()
    if playing and Classroom.POS.get() >= n - 1:
        Classroom.POS.set(0)  # Play at the end starts the lesson again
    Classroom.PLAYING.set(playing)
    Classroom.TICK.set(time.monotonic())


def _new_lesson() -> None:
    Classroom.POS.set(0)
    Classroom.PLAYING.set(False)


def _continue_live(lesson: Lesson, run: int, step: int) -> None:
    """Hand the lesson's run to the Explorer page, which loads the pair and replays it to ``step``."""
    Classroom.PLAYING.set(False)
    hand_off_to_explorer(lesson.runs[run].trace, step, lesson.title)


def _open_file(upload) -> None:
    lesson, problem = parse_upload(upload, Classroom.FILE, MAX_LESSON_BYTES, loads_lesson, LessonError, "lesson")
    if problem:
        Classroom.ERROR.set(problem)
    if lesson is not None:
        Classroom.UPLOADED.set(lesson)
        Classroom.LESSON.set("file:" + lesson.id)
        _new_lesson()
        Classroom.ERROR.set(None)


def classroom_page() -> None:
    st.markdown(CLASSROOM_CSS, unsafe_allow_html=True)
    st.html(KEYS_JS, unsafe_allow_javascript=True)
    lessons, problems = _lessons()
    for problem in problems:
        st.error(f"A shipped lesson cannot be opened: {problem}")
    if not lessons:
        st.info("No lessons are installed: record them with `python -m explorer lessons record`.")
        return
    if Classroom.LESSON.get() not in lessons:
        Classroom.LESSON.set(next(iter(lessons)))
    every = _run_every()
    Classroom.EVERY.set(every)
    st.fragment(_view, run_every=every)(lessons)
    with st.expander("Open a lesson file"):
        st.caption("A lesson file from `python -m explorer lessons record` (JSON, up to "
                   f"{MAX_LESSON_BYTES // 2**20} MB). The shipped lessons were recorded on the embedded pair; the "
                   "commands and machines are in each file.")
        _open_file(st.file_uploader("Lesson file", type=["json"], key="cls_upload"))
    if Classroom.ERROR.get():
        st.error(Classroom.ERROR.get())


def _run_every() -> float | None:
    """While playing, the view reruns itself once a phase (the pace); else only on a click."""
    return Classroom.PACE.get() if Classroom.PLAYING.get() else None


def _view(lessons: dict[str, Lesson]) -> None:
    if App.PAGE.get() != "Classroom":  # Continue live switched pages from inside this fragment
        st.rerun(scope="app")
    lesson = lessons[Classroom.LESSON.get()]
    order = lesson.phases()
    n = len(order)
    pos = max(0, min(n - 1, Classroom.POS.get()))
    playing = Classroom.PLAYING.get()
    pace = Classroom.PACE.get()
    if playing and time.monotonic() - Classroom.TICK.get() >= pace - 0.25:
        pos = min(n - 1, pos + 1)
        Classroom.TICK.set(time.monotonic())
        if pos == n - 1:
            playing = False
            Classroom.PLAYING.set(False)
    Classroom.POS.set(pos)
    if _run_every() != Classroom.EVERY.get():
        st.rerun(scope="app")  # Play was pressed or ended, or the pace changed: the view's auto-rerun follows

    run_i, phase = order[pos]
    run = lesson.runs[run_i]
    step = run.trace.steps[phase.step]
    c = st.columns([2.7, 1.3, 1.3, 1.25, 1.25, 1.05, 1.5], vertical_alignment="bottom")
    c[0].selectbox("Lesson", list(lessons), key=Classroom.LESSON.name, on_change=_new_lesson,
                   format_func=lambda k: lessons[k].title)
    c[1].button("Back", key="cls_back", on_click=_move, args=(-1, n), disabled=pos == 0, shortcut="Left",
                icon=":material/arrow_back:", width="stretch")
    c[2].button("Next", key="cls_next", on_click=_move, args=(1, n), disabled=pos >= n - 1, shortcut="Right",
                icon=":material/arrow_forward:", type="primary", width="stretch")
    c[3].button("Pause" if playing else "Play", key="cls_play", on_click=_toggle_play, args=(n,),
                icon=":material/pause:" if playing else ":material/play_arrow:", width="stretch")
    c[4].selectbox("Pace", PACES, index=PACES.index(Classroom.PACE.default), key=Classroom.PACE.name,
                   format_func=lambda s: f"{s} s / phase")
    font = c[5].selectbox("Text", TEXT_SIZES, index=1, key="cls_font", format_func=lambda s: f"{s} px")
    c[6].button("Continue live", key="cls_live", on_click=_continue_live, args=(lesson, run_i, phase.step),
                width="stretch", help="load the embedded pair, replay this run to the step on screen and go on "
                                      "stepping on the Explorer page")
    where = (f"Run {run_i + 1}/{len(lesson.runs)} · " if len(lesson.runs) > 1 else "") + (
        f"{html.escape(run.label)} · step {phase.step + 1}/{len(run.trace.steps)} · <b>{phase.label}</b> · "
        f"phase {pos + 1}/{n}")
    st.markdown(f'<p class="cls-head"><b>{html.escape(lesson.title)}</b> · {html.escape(lesson.question)}</p>'
                f'<p class="cls-where">{where}</p><span data-cls-pos="{lesson.id}:{pos}" hidden></span>',
                unsafe_allow_html=True)

    greedy = run.trace.greedy
    left, middle, right = st.columns([5, 3.6, 3.4])
    shown = phases.shown_status(step, phase)
    highlight = phase.node if phase.kind == "verify" else None
    tree = figures.tree_figure(step, height=FIGURE_HEIGHT, shown=shown, font=font, selected=highlight,
                               final=phase.kind == "commit")
    tree.update_layout(height=None, autosize=True)  # the box's height (CSS), whatever the screen
    left.container(key="cls_tree_box").plotly_chart(tree, width="stretch", height="stretch", key="cls_tree",
                                                    config={"displayModeBar": False, "responsive": True})
    if len(step.nodes) > 1:
        rows = phases.mask_rows(step, phase)
        mask = figures.mask_figure(step, highlight=highlight, rows=rows, font=font, height=FIGURE_HEIGHT)
        mask.update_layout(title_text=f"Tree attention mask: {len(rows)}×{len(rows)}<br>+{step.mask_context_len} "
                                      "cached context columns (not drawn)")  # title_text: keeps the title's size
        mask.update_layout(height=None, autosize=True)
        middle.container(key="cls_mask_box").plotly_chart(mask, width="stretch", height="stretch", key="cls_mask",
                                                          config={"displayModeBar": False, "responsive": True})
    else:
        middle.info("No tree this step: no mask to send.")
    with right:
        lines = phases.account(step, phase, greedy)
        st.markdown('<div class="cls-account">' + "".join(
            f"<p>{_markdown_bold(html.escape(line))}</p>" for line in lines) + "</div>", unsafe_allow_html=True)
        note = lesson.note_at(run_i, phase)
        if note:
            st.info("**What to notice.** " + note)
    lanes = lesson.race_lanes()
    if lanes:
        with st.expander("The race against plain decoding, and the speedup curve"):
            _race(lesson, lanes, run_i, font)


def _race(lesson: Lesson, lanes: dict, run_i: int, font: int) -> None:
    """Run ``run_i`` of the lesson and ``ar`` as two lanes on one clock, and the expected speedup against
    acceptance, timed on the machine the class picks among ``lanes`` (``Lesson.race_lanes``)."""
    name = next(iter(lanes))
    if len(lanes) > 1:  # the machine named in the caption below where the lesson was timed on one only
        name = st.radio("Timed on", list(lanes), horizontal=True, key=f"cls_machine_{lesson.id}",
                        help="the same lesson's runs, each machine timing its own: a GPU runs our forwards through "
                             "CUDA graphs, and its greedy text can part from the CPU's where two tokens are nearly "
                             "tied")
    timed = lanes[name]
    trace, baseline, label = timed.runs[run_i], timed.baseline, lesson.runs[run_i].label
    machine = f"{name}, {timed.recorded.get('dtype', '?')}, {timed.recorded.get('date', '')[:10]}"
    st.plotly_chart(race_figure(trace, baseline, label, font=font, machine=machine),
                    width="stretch", key="cls_race", config={"displayModeBar": False})
    point = measured_point(trace, baseline)
    if not point["gamma"]:
        st.caption("This run drafted nothing: no speedup curve.")
        return
    left, right = st.columns([1, 2])
    measured = round(1 / point["c"]) if point["c"] else 5
    ratio = left.slider("What if the target cost this many draft forwards?", 1, 50, max(1, min(50, measured)),
                        key=f"cls_ratio_{lesson.id}")
    acceptance = (f"its mean tree ({', '.join(f'{w:.2g}' for w in point['widths'])} candidates per parent, level "
                  f"by level) accepts as many tokens as candidates each accepted with probability "
                  f"{point['alpha']:.0%} would" if point["alpha_fitted"] else
                  f"the run's acceptance is {point['alpha']:.0%} over {point['gamma']} drafted levels on average")
    left.caption(f"Measured here: a draft forward costs {point['c']:.2f} of a target forward (c), {acceptance}, "
                 f"and it ran {point['speedup']:.2f}x as fast as ar. Timings: {machine}." if point["c"] else
                 f"No draft forwards (free drafts): c = 0. {acceptance[0].upper() + acceptance[1:]}; "
                 f"{point['speedup']:.2f}x ar. Timings: {machine}.")
    right.plotly_chart(speedup_figure(point, 1 / ratio, font=font), width="stretch", key="cls_speedup",
                       config={"displayModeBar": False})


def _markdown_bold(text: str) -> str:
    """``**x**`` to ``<b>x</b>`` in escaped text (the account's only markup)."""
    parts = text.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
