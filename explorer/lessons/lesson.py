"""Lessons for the classroom: real runs recorded from the embedded pair, each with a title, the question it answers
and what to notice at marked phases. Plain data (JSON), no torch: a lesson opens with no model loaded.

A lesson file (``assets/lessons/*.json``, written by ``python -m explorer lessons record``)::

    {"lesson_schema": 1, "id": "...", "title": "...", "question": "...",
     "runs": [{"label": "...", "trace": <RunTrace>}, ...],          # played one after the other
     "notes": [{"run": 0, "step": 2, "phase": "verify", "text": "..."}, ...],   # step: 0-based index
     "baseline": <RunTrace of ar on the same prompt, for the race> | null,
     "recorded": {"command", "machine", "date", "commit", "dtype", ...},
     "audit": <audit summary> | null,
     "timings": [{"recorded": {...}, "runs": [<RunTrace>, ...], "baseline": <RunTrace>}, ...]}  # optional

``timings`` holds the same runs timed on other machines (``python -m explorer lessons time``, e.g. on a GPU): each
entry has one trace per run of the lesson and its own ``ar`` baseline, so the race can be shown for either machine.
Its traces are that machine's own runs of the lesson's settings: greedy runs can part from the shipped text where the
target's two best tokens are nearly tied (another device rounds bf16 differently).

A note belongs to the first phase of its kind (``phases.PHASE_KINDS``) in its step. ``load_lesson`` checks the schema
version, the size, every run's trace (``trace.RunTrace.from_dict``) and that every note points at a phase that exists,
and raises ``LessonError`` with a message a user can act on.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..trace.jsonfile import parse_json, read_file
from ..trace.records import RunTrace, TraceError
from .phases import PHASE_KINDS, Phase, step_phases

LESSON_SCHEMA = 1
MAX_LESSON_BYTES = 20 * 1024 * 1024
LESSONS_DIR = Path(__file__).resolve().parents[2] / "assets" / "lessons"


class LessonError(ValueError):
    """A lesson file that cannot be used: the message says what is wrong."""


@dataclass
class Note:
    """What to notice at one phase: run index, step index (0-based), phase kind, text (markdown), and for a draft
    or verify phase optionally its ``level`` or ``node`` (else the first phase of that kind in the step)."""

    run: int
    step: int
    phase: str
    text: str
    level: int | None = None
    node: int | None = None

    def marks(self, phase: Phase, first: Phase) -> bool:
        """Whether this note belongs to ``phase`` (``first``: the first phase of that kind in its step)."""
        if phase.step != self.step or phase.kind != self.phase:
            return False
        if self.level is not None or self.node is not None:
            return phase.level == self.level and phase.node == self.node
        return phase == first


@dataclass
class LessonRun:
    label: str
    trace: RunTrace


@dataclass
class MachineTimings:
    """The lesson's runs timed on one machine: ``recorded`` (``bench.run_facts`` of that machine), ``runs`` (one
    trace per run of the lesson, in its order) and ``baseline`` (``ar`` on the same prompt, same machine)."""

    recorded: dict
    runs: list[RunTrace]
    baseline: RunTrace

    @property
    def machine(self) -> str:
        """A short name of the machine: the GPU's name on CUDA, else the CPU's (``machine_name``)."""
        return machine_name(self.recorded)

    def to_dict(self) -> dict:
        return {"recorded": self.recorded, "runs": [t.to_dict() for t in self.runs],
                "baseline": self.baseline.to_dict()}


def machine_name(recorded: dict) -> str:
    """A short name for the machine a recording ran on, from its ``machine`` line and ``device``: the GPU's name on
    CUDA (``"NVIDIA H200"``), else ``"CPU: "`` and the CPU's model where the line names it (``"CPU: AMD EPYC"``) or
    its core count (``"CPU: 2 cores"``)."""
    last = str(recorded.get("machine", "?")).split(",")[-1].strip() or "?"
    if str(recorded.get("device", "")).startswith("cuda"):
        return last
    cores = re.fullmatch(r"(\d+) CPUs", last)
    return f"CPU: {cores.group(1)} cores" if cores else f"CPU: {last}"


@dataclass
class Lesson:
    """A lesson: ``runs`` (played in order), ``notes`` at marked phases, ``baseline`` (``ar`` on the same prompt,
    recorded with the runs: the race's other lane), how it was ``recorded`` (command, machine, date, commit, dtype)
    and, where the lesson is about losslessness, an ``audit`` summary (``audit.AuditResult``'s first-token and pair
    p-values, TV distances and sample count); ``timings``: the same runs timed on other machines (``MachineTimings``,
    at most one per machine name)."""

    id: str
    title: str
    question: str
    runs: list[LessonRun]
    notes: list[Note] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)
    audit: dict | None = None
    baseline: RunTrace | None = None
    timings: list[MachineTimings] = field(default_factory=list)

    def race_lanes(self) -> dict[str, MachineTimings]:
        """Every machine the race can be shown for, by machine name (``machine_name``): the lesson's own recording
        first (only when it has a baseline), then ``timings``."""
        out = {}
        if self.baseline is not None:
            out[machine_name(self.recorded)] = MachineTimings(self.recorded, [r.trace for r in self.runs],
                                                              self.baseline)
        for t in self.timings:
            out.setdefault(t.machine, t)
        return out

    def with_timings(self, timings: MachineTimings) -> Lesson:
        """This lesson with ``timings`` in place of any earlier entry for the same machine name.

        Raises LessonError when ``timings`` does not hold one trace per run of the lesson."""
        if len(timings.runs) != len(self.runs):
            raise LessonError(f"timings of {len(timings.runs)} run(s) for a lesson of {len(self.runs)}")
        kept = [t for t in self.timings if t.machine != timings.machine]
        return dataclasses.replace(self, timings=kept + [timings])

    def phases(self) -> list[tuple[int, Phase]]:
        """Every phase of every run, in order: ``(run index, phase)``."""
        return [(r, p) for r, run in enumerate(self.runs) for step in run.trace.steps for p in step_phases(step)]

    def note_at(self, run: int, phase: Phase) -> str | None:
        """The notes marked at ``phase`` of run ``run``, joined, or None (``Note.marks``)."""
        first = next(p for p in step_phases(self.runs[run].trace.steps[phase.step]) if p.kind == phase.kind)
        texts = [n.text for n in self.notes if n.run == run and n.marks(phase, first)]
        return "\n\n".join(texts) or None

    def to_dict(self) -> dict:
        return {"lesson_schema": LESSON_SCHEMA, "id": self.id, "title": self.title, "question": self.question,
                "runs": [{"label": r.label, "trace": r.trace.to_dict()} for r in self.runs],
                "notes": [vars(n) for n in self.notes], "recorded": self.recorded, "audit": self.audit,
                "baseline": self.baseline.to_dict() if self.baseline is not None else None,
                "timings": [t.to_dict() for t in self.timings]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @staticmethod
    def from_dict(d) -> Lesson:
        """Raises LessonError for another schema version or a malformed lesson."""
        if not isinstance(d, dict):
            raise LessonError("a lesson must be a JSON object")
        if d.get("lesson_schema") != LESSON_SCHEMA:
            raise LessonError(f"lesson schema version {d.get('lesson_schema')!r} is not supported (this build "
                              f"reads {LESSON_SCHEMA}); re-record it with `python -m explorer lessons record`")
        for key, kind in (("id", str), ("title", str), ("question", str), ("runs", list), ("notes", list)):
            if not isinstance(d.get(key), kind):
                raise LessonError(f"lesson field {key!r} is missing or is not a {kind.__name__}")
        if not d["runs"]:
            raise LessonError("a lesson needs at least one run")
        runs = []
        for i, r in enumerate(d["runs"]):
            if not isinstance(r, dict) or not isinstance(r.get("label"), str):
                raise LessonError(f"run {i + 1} of the lesson has no label")
            try:
                trace = RunTrace.from_dict(r.get("trace"))
            except TraceError as exc:
                raise LessonError(f"run {i + 1} of the lesson: {exc}") from None
            if not trace.steps:
                raise LessonError(f"run {i + 1} of the lesson has no steps")
            runs.append(LessonRun(r["label"], trace))
        notes = checked_notes(d["notes"], runs)
        recorded = d.get("recorded") if isinstance(d.get("recorded"), dict) else {}
        audit = d.get("audit") if isinstance(d.get("audit"), dict) else None
        baseline = None
        if d.get("baseline") is not None:
            try:
                baseline = RunTrace.from_dict(d["baseline"])
            except TraceError as exc:
                raise LessonError(f"the lesson's baseline run: {exc}") from None
        timings = []
        for i, t in enumerate(d.get("timings") or []):
            try:
                if not isinstance(t, dict) or not isinstance(t.get("recorded"), dict):
                    raise TraceError("it has no 'recorded' facts")
                if not isinstance(t.get("runs"), list) or len(t["runs"]) != len(runs):
                    raise TraceError(f"it needs one trace per run of the lesson ({len(runs)})")
                timings.append(MachineTimings(t["recorded"], [RunTrace.from_dict(r) for r in t["runs"]],
                                              RunTrace.from_dict(t.get("baseline"))))
            except TraceError as exc:
                raise LessonError(f"timing {i + 1} of the lesson: {exc}") from None
        return Lesson(d["id"], d["title"], d["question"], runs, notes, recorded, audit, baseline, timings)


def checked_notes(raw: list, runs: list[LessonRun]) -> list[Note]:
    """Notes as a lesson file holds them (dicts), each pointing at a phase that ``runs`` have. Raises LessonError
    for a malformed note or one at a run, step or phase the lesson does not have."""
    notes = []
    for n in raw:
        try:
            note = Note(int(n["run"]), int(n["step"]), str(n["phase"]), str(n["text"]),
                        None if n.get("level") is None else int(n["level"]),
                        None if n.get("node") is None else int(n["node"]))
        except (TypeError, KeyError, ValueError, AttributeError):
            raise LessonError(f"a note of the lesson is malformed: {n!r:.80}") from None
        if not (0 <= note.run < len(runs) and 0 <= note.step < len(runs[note.run].trace.steps)):
            raise LessonError(f"a note points at run {note.run + 1}, step {note.step + 1}, which the lesson "
                              "does not have")
        phases = step_phases(runs[note.run].trace.steps[note.step])
        if note.phase not in PHASE_KINDS or not any(
                note.marks(p, next(q for q in phases if q.kind == p.kind)) for p in phases):
            raise LessonError(f"a note points at a {note.phase!r} phase of step {note.step + 1} that the step "
                              "does not have")
        notes.append(note)
    return notes


def loads_lesson(data: str | bytes, what: str = "the lesson") -> Lesson:
    """A lesson from JSON text. Raises LessonError (too large, not JSON, malformed, another schema version)."""
    return Lesson.from_dict(parse_json(data, LessonError, what, MAX_LESSON_BYTES))


def load_lesson(path: str | Path) -> Lesson:
    """A lesson from a file. Raises LessonError (unreadable, too large, not JSON, malformed, another schema)."""
    return loads_lesson(read_file(path, LessonError, "the lesson "), f"the lesson {Path(path).name}")


def shipped_lessons(folder: Path = LESSONS_DIR) -> list[Path]:
    """The lesson files shipped in ``assets/lessons``, in their numbered order."""
    return sorted(folder.glob("*.json"))


__all__ = ["LESSON_SCHEMA", "LESSONS_DIR", "Lesson", "LessonError", "LessonRun", "MAX_LESSON_BYTES", "MachineTimings",
           "Note", "load_lesson", "loads_lesson", "machine_name", "shipped_lessons"]
