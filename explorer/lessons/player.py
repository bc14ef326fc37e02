"""A lesson as one self-contained HTML page: the classroom's phases played by the browser, no server.

``player_data(lesson)`` turns a lesson into the plain data the page's player draws from: per step the tree's nodes
with their places (``trace.figures.tree_layout``, so nodes keep their places from phase to phase), labels, sources
and statuses, the attention mask; per phase what is shown (``phases.shown_status``, ``phases.mask_rows``), the
account in words (``phases.account``: the same words the Classroom page shows) and the lesson's note there; per run
the race (``race.race_figure``, one per machine the lesson was timed on) and the measured point of the speedup curve
(``race.measured_point``). The page (``player.html``, beside this module) draws the tree and the mask with Plotly.js
from that data on every key press, computes the speedup curve for its cost slider itself (``engine.speedup``'s
formula), and makes no request: ``export_html`` inlines Plotly.js and the data. No torch.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import plotly
import plotly.io as pio

from ..trace.figures import (BONUS_COLOR, SOURCE_SYMBOLS, STATUS_COLORS, STATUS_LABELS, token_label, tree_graph,
                             tree_layout)
from ..trace.records import DRAFTED, RunTrace, StepTrace
from .authoring import lesson_from_run
from .lesson import Lesson, machine_name
from .phases import account, mask_rows, shown_status, step_phases
from .race import measured_point, race_figure

PLAYER_SCHEMA = 1
TEMPLATE = Path(__file__).with_name("player.html")
# plotly.js's cartesian bundle (1.5 MB: every trace type the player draws), of the version the plotly package
# bundles in full (4.6 MB): a lesson page opens about twice as fast (assets/ATTRIBUTION.md)
PLOTLY_CARTESIAN = Path(__file__).resolve().parents[2] / "assets" / "vendor" / "plotly-cartesian-4.1.1.min.js"
FONT = 16  # px: chart text on a projector (at least 16 px)


def _step_data(step: StepTrace) -> dict:
    """One step's drawing data: ``nodes`` as ``[id, parent, label, x, y, source, status, committed]`` rows, the
    mask (``mask`` rows of 0/1 over ``mask_ids``, ``positions``), the bonus token's label and the title."""
    pos = tree_layout(tree_graph(step))
    nodes = [[n.id, n.parent, token_label(n.text, 10, escape=False), pos[n.id][0], pos[n.id][1], n.source, n.status,
              bool(n.committed)] for n in step.nodes]
    bonus = token_label(step.committed_text[-1], 10, escape=False) if step.bonus_token is not None else None
    return {"index": step.index, "nodes": nodes, "mask": step.mask, "mask_ids": list(step.mask_node_ids),
            "positions": list(step.position_ids), "context_len": step.mask_context_len, "bonus": bonus,
            "lossy": bool(step.lossy)}


def _phase_data(lesson: Lesson, run: int, step: StepTrace, greedy: bool) -> list[dict]:
    """Every phase of ``step``: its kind and label, the statuses shown (``DRAFTED`` until a test reveals one), the
    mask rows drawn, whether the commit is drawn (``final``), the account and the lesson's note there."""
    out = []
    for phase in step_phases(step):
        shown = shown_status(step, phase)
        out.append({"kind": phase.kind, "label": phase.label, "level": phase.level, "node": phase.node,
                    "shown": {str(i): s for i, s in shown.items()}, "rows": mask_rows(step, phase),
                    # the commit's outline and the bonus star once every drawn node shows its own status, as in
                    # trace.figures.tree_figure
                    "final": all(shown[n.id] == n.status for n in step.nodes if n.id in shown),
                    "account": account(step, phase, greedy), "note": lesson.note_at(run, phase)})
    return out


def _race_data(lesson: Lesson, run: int) -> dict:
    """Per machine the lesson was timed on: the race figure (Plotly JSON) and the measured point of run ``run``."""
    out = {}
    for name, timed in lesson.race_lanes().items():
        trace, baseline = timed.runs[run], timed.baseline
        fig = race_figure(trace, baseline, lesson.runs[run].label, font=FONT, machine=name)
        out[name] = {"figure": json.loads(pio.to_json(fig)), "point": measured_point(trace, baseline)}
    return out


def player_data(lesson: Lesson) -> dict:
    """The plain data the HTML player draws a lesson from (module docstring). Raises nothing a loaded lesson can
    trigger (``lesson.load_lesson`` checked it)."""
    runs = []
    for r, lesson_run in enumerate(lesson.runs):
        trace: RunTrace = lesson_run.trace
        greedy = trace.greedy
        runs.append({"label": lesson_run.label, "greedy": greedy, "prompt": trace.prompt,
                     "steps": [_step_data(s) for s in trace.steps],
                     "phases": [[s.index, p] for s in trace.steps for p in _phase_data(lesson, r, s, greedy)],
                     "race": _race_data(lesson, r)})
    recorded = {k: lesson.recorded.get(k) for k in ("date", "commit", "dtype")}
    recorded["machine"] = machine_name(lesson.recorded) if lesson.recorded.get("machine") else None
    return {"player_schema": PLAYER_SCHEMA, "id": lesson.id, "title": lesson.title, "question": lesson.question,
            "recorded": recorded, "runs": runs, "font": FONT,
            "style": {"status_colors": {**STATUS_COLORS}, "status_labels": {**STATUS_LABELS},
                      "source_symbols": {**SOURCE_SYMBOLS}, "bonus_color": BONUS_COLOR, "drafted": DRAFTED}}


def player_html(lesson: Lesson) -> str:
    """The lesson as one HTML page: the player, Plotly.js and ``player_data`` inlined (no request at all)."""
    page = TEMPLATE.read_text(encoding="utf-8")
    data = json.dumps(player_data(lesson), separators=(",", ":")).replace("</", "<\\/")  # no early </script>
    plotly_js = _plotly_js()
    page = page.replace("{{TITLE}}", html.escape(lesson.title, quote=False))
    return page.replace("/*PLOTLY_JS*/", plotly_js, 1).replace("/*PLAYER_DATA*/", data, 1)


def _plotly_js() -> str:
    """The cartesian bundle where it matches the plotly package's plotly.js version, else the full bundle."""
    if PLOTLY_CARTESIAN.exists() and plotly.offline.get_plotlyjs_version() in PLOTLY_CARTESIAN.name:
        return PLOTLY_CARTESIAN.read_text(encoding="utf-8")
    return plotly.offline.get_plotlyjs()


def trace_lesson(trace: RunTrace, title: str = "") -> Lesson:
    """Any recorded run as a lesson of one run, no notes and no race (a trace has no baseline): what the player
    plays for the Explorer's "Download as HTML" and ``generate --html`` (``authoring.lesson_from_run``)."""
    method = trace.settings.get("method", {})
    label = method.get("method", "run") if isinstance(method, dict) else str(method)
    prompt = " ".join(trace.prompt.split())
    return lesson_from_run(trace, title or f"{label}: {prompt[:60]}{'…' if len(prompt) > 60 else ''}",
                           f"{len(trace.steps)} steps of {label} on {trace.model.get('name', 'a model pair')}")


def trace_html(trace: RunTrace, title: str = "") -> str:
    """One recorded run as a player page (``trace_lesson``, ``player_html``)."""
    return player_html(trace_lesson(trace, title))


def export_html(lesson: Lesson, out_dir: str | Path) -> Path:
    """Write ``<out_dir>/<lesson id>.html`` (``player_html``); returns its path. Raises OSError where the folder
    cannot be written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{lesson.id}.html"
    path.write_text(player_html(lesson), encoding="utf-8")
    return path


__all__ = ["PLAYER_SCHEMA", "export_html", "player_data", "player_html", "trace_html", "trace_lesson"]
