"""A teacher's own lesson from a recorded run: the Explorer's "Save as lesson" and the page any
run plays as (``player.trace_lesson``).

The lesson is of the shipped schema (``lesson.py``): one run, the title and the question the teacher gives, and the
notes they write at chosen phases, one per line::

    2 verify: The second candidate is tested only after the first was rejected.
    3 draft 2: The stop policy ends the draft here.   # the draft phase of level 2 of step 3
    5 commit: A bonus token: the target's own choice after the accepted path.

(step numbers from 1, as the Explorer shows them; a phase kind of ``phases.PHASE_KINDS``; for ``draft`` an optional
level, for ``verify`` an optional node id; without one, the step's first phase of that kind). Its notes go
through the lesson file's own checks (``lesson.checked_notes``), so a note at a phase the run does not have is refused
with a message, as in a malformed lesson file. No torch.
"""

from __future__ import annotations

import dataclasses
import re

from ..trace.records import RunTrace
from .lesson import Lesson, LessonError, LessonRun, checked_notes
from .phases import PHASE_KINDS

_NOTE = re.compile(r"^\s*(\d+)\s+([a-z]+)(?:\s+(\d+))?\s*:\s*(.+?)\s*$")
MAX_TITLE = 120


def parse_notes(text: str) -> list[dict]:
    """Notes written one per line (module docstring) as lesson-file notes of run 0 (``step`` 0-based). Blank lines
    are skipped. Raises LessonError naming the first line that does not read as a note."""
    notes = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _NOTE.match(line)
        if m is None or m.group(2) not in PHASE_KINDS:
            raise LessonError(f"note line {number} should read 'STEP PHASE: text' (PHASE one of "
                              f"{', '.join(PHASE_KINDS)}; e.g. '2 verify: ...'), got {line.strip()[:60]!r}")
        step, kind, extra, words = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if extra is not None and kind not in ("draft", "verify"):
            raise LessonError(f"note line {number}: only a draft phase takes a level and only a verify phase a node")
        note = {"run": 0, "step": step - 1, "phase": kind, "text": words}
        if extra is not None:
            note["level" if kind == "draft" else "node"] = int(extra)
        notes.append(note)
    return notes


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "lesson"


def lesson_from_run(trace: RunTrace, title: str, question: str = "", notes: str | list[dict] = "",
                    label: str | None = None) -> Lesson:
    """A lesson of one run: ``trace`` under ``title`` with ``question`` and ``notes`` (lines as ``parse_notes``
    reads them, or lesson-file notes). ``label`` names the run (default: its method). ``recorded`` is the run's own
    model facts (pair, dtype, device, ...).

    Raises:
        LessonError: no title, a title over ``MAX_TITLE`` characters, a run with no steps, or a note that does not
            read or points at a phase the run does not have (the lesson file's own checks).
    """
    title = " ".join(title.split())
    if not title:
        raise LessonError("a lesson needs a title")
    if len(title) > MAX_TITLE:
        raise LessonError(f"the title has {len(title)} characters; keep it under {MAX_TITLE}")
    method = trace.settings.get("method", {})
    label = label or (method.get("method", "run") if isinstance(method, dict) else str(method))
    if not trace.steps:
        raise LessonError("run 1 of the lesson has no steps")
    # a snapshot of the steps so far: the Explorer's run goes on appending to its trace
    runs = [LessonRun(label, dataclasses.replace(trace, steps=list(trace.steps)))]
    # the lesson file's own checks: every note at a phase the run has
    return Lesson(id=_slug(title), title=title, question=" ".join(question.split()), runs=runs,
                  notes=checked_notes(parse_notes(notes) if isinstance(notes, str) else list(notes), runs),
                  recorded=dict(trace.model))


__all__ = ["MAX_TITLE", "lesson_from_run", "parse_notes"]
