"""A lesson as one self-contained HTML page: the classroom's phases played by the browser, no server.

The page draws what Python computed; its script (``player.html``, beside this module) holds no figure code and no
formula of its own. ``player_data(lesson)`` is everything it shows:

* per phase of every run (``phases.step_phases``): the draft tree as ``trace.figures.tree_figure`` draws it for that
  phase (``phases.shown_status``), the mask slice as ``trace.figures.mask_figure`` draws it (``phases.mask_rows``;
  None for a step without a tree), both as Plotly JSON, the account in words
  (``phases.account``: the same words the Classroom page shows) and the lesson's note there;
* per run and machine the lesson was timed on: the race (``race.race_figure``), the run's measured point
  (``race.measured_point``) and the speedup curve (``race.speedup_figure``) with the curve at every stop of the
  cost slider (``race.speedup_curves``: ``engine.speedup.tree_speedup``'s numbers).

The page renders these with ``Plotly.react`` as they are; it only sizes a chart to its box (the figure's fixed
``height`` dropped), moves the race's legend under it on a phone, and swaps in the slider's curve.

Embedding every phase's figures whole would make a page of 5 to 20 MB, mostly the same traces, layouts, templates
and hover texts over and over: ``pack`` puts each value (a figure, a trace, an array, a long string) once into a
pool, and a figure of the page is a reference into it, which the page (and ``unpack`` here) expands where it draws
it. ``read_page`` gives back a written page's ``player_data``. ``export_html`` writes a page, Plotly.js inlined
(no request at all); ``export_index`` writes the index of exported lessons. No torch.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import os
import re
import time
from pathlib import Path
from urllib.parse import quote

import plotly
import plotly.graph_objects as go
import plotly.io as pio

from ..models.cache import cache_dir
from ..trace.figures import mask_figure, tree_figure
from ..trace.records import RunTrace, StepTrace
from .authoring import lesson_from_run
from .lesson import Lesson, machine_name
from .phases import account, mask_rows, shown_status, step_phases
from .race import SPEEDUP_COSTS, measured_point, race_figure, slider_stop, speedup_curves, speedup_figure

PLAYER_SCHEMA = 2
TEMPLATE = Path(__file__).with_name("player.html")
# plotly.js's cartesian bundle (1.5 MB: every trace type the player draws), of the version the plotly package
# bundles in full (4.6 MB): a lesson page opens about twice as fast (assets/ATTRIBUTION.md)
PLOTLY_CARTESIAN = Path(__file__).resolve().parents[2] / "assets" / "vendor" / "plotly-cartesian-4.1.1.min.js"
FONT = 16  # px: chart text on a projector (at least 16 px)
# Every figure of a page carries Plotly's own template by name: the figures take the process's default template,
# which importing Streamlit switches to its own, so a page built by the app would otherwise differ from the same
# page built by `lessons export` (and a cached page from either would be served to both)
PAGE_TEMPLATE = "plotly"
MASK_HEIGHT = 560  # px: the height mask_figure thins its row labels for (the player's mask box on a projector)
REF = "§"  # a string "§<base-36 index>" in the page's data is a reference into its pool (``pack``)
_MIN_POOLED = 12  # values whose JSON is shorter stay where they are
_DATA_RE = re.compile(r"const DATA = (.*?);\n// end of DATA", re.S)


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@functools.cache
def _page_template() -> str:
    """``PAGE_TEMPLATE``'s JSON, made once per process."""
    return _json(pio.templates[PAGE_TEMPLATE].to_plotly_json())


def page_figure(fig: go.Figure) -> dict:
    """``fig`` as a page embeds it: plain JSON data (what ``plotly.io.to_json`` writes, read back), its layout's
    template ``PAGE_TEMPLATE`` whatever the process's default template is. The template is put into the JSON, not
    set on ``fig``: Plotly validates a template set on a figure property by property, which was half of a page's
    build (lesson 07: 14.7 s against 6.7 s on 2 cores, the same page)."""
    data = json.loads(_json(fig.to_plotly_json()))
    data.setdefault("layout", {})["template"] = json.loads(_page_template())  # each figure its own copy
    return data


def _phase_data(lesson: Lesson, run: int, step: StepTrace, greedy: bool) -> list[dict]:
    """Every phase of ``step``: its kind and label, its tree and mask figures (Plotly JSON), the account and the
    lesson's note there. Each figure is drawn once per step: the mask once per slice (a verification or commit phase
    keeps the last one), the tree once per set of statuses shown (the mask phase shows the last level's)."""
    out, trees, masks = [], {}, {}
    for phase in step_phases(step):
        shown = shown_status(step, phase)
        key = tuple(sorted(shown.items()))
        if key not in trees:
            trees[key] = page_figure(tree_figure(step, shown=shown, font=FONT, fit_labels=False))  # fitTree fits them
        rows = tuple(mask_rows(step, phase))
        if len(step.nodes) > 1 and rows and rows not in masks:
            masks[rows] = page_figure(mask_figure(step, rows=list(rows), font=FONT, height=MASK_HEIGHT))
        out.append({"kind": phase.kind, "label": phase.label, "level": phase.level, "node": phase.node,
                    "tree": trees[key], "mask": masks.get(rows),
                    "account": account(step, phase, greedy), "note": lesson.note_at(run, phase)})
    return out


def _race_data(lesson: Lesson, run: int) -> dict:
    """Per machine the lesson was timed on: the race figure, the measured point of run ``run`` and its speedup
    curve (the figure at the slider's first stop, ``at``, and the curve at every stop of ``costs``)."""
    out = {}
    for name, timed in lesson.race_lanes().items():
        trace, baseline = timed.runs[run], timed.baseline
        point = measured_point(trace, baseline)
        at = slider_stop(point["c"])
        out[name] = {"figure": page_figure(race_figure(trace, baseline, lesson.runs[run].label, font=FONT,
                                                       machine=name)),
                     "point": point,
                     "speedup": {"figure": page_figure(speedup_figure(point, SPEEDUP_COSTS[at], font=FONT)),
                                 "costs": list(SPEEDUP_COSTS), "at": at,
                                 "curves": [json.loads(_json(c.to_plotly_json())) for c in speedup_curves(point)]}}
    return out


def player_data(lesson: Lesson) -> dict:
    """Everything the HTML player shows of a lesson (module docstring), as plain data with every figure whole.
    Raises nothing a loaded lesson can trigger (``lesson.load_lesson`` checked it)."""
    runs = []
    for r, lesson_run in enumerate(lesson.runs):
        trace: RunTrace = lesson_run.trace
        greedy = trace.greedy
        runs.append({"label": lesson_run.label, "greedy": greedy, "prompt": trace.prompt, "steps": len(trace.steps),
                     "phases": [[s.index, p] for s in trace.steps for p in _phase_data(lesson, r, s, greedy)],
                     "race": _race_data(lesson, r)})
    recorded = {k: lesson.recorded.get(k) for k in ("date", "commit", "dtype")}
    recorded["machine"] = machine_name(lesson.recorded) if lesson.recorded.get("machine") else None
    return {"player_schema": PLAYER_SCHEMA, "id": lesson.id, "title": lesson.title, "question": lesson.question,
            "recorded": recorded, "runs": runs, "font": FONT}


# Where the figures sit in player_data: these keys' values are packed (the rest of the data stays plain).
_FIGURE_KEYS = ("tree", "mask", "figure", "curves")


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, d = divmod(n, 36)
        out = digits[d] + out
        if not n:
            return out


def pack(data: dict) -> dict:
    """``data`` (``player_data``) with every figure replaced by a reference into ``data["pool"]``: each value of
    a figure (a trace, an array, an object, a string) whose JSON is at least ``_MIN_POOLED`` characters long, and
    every string that starts with ``REF``, is stored once in the pool and referred to as ``REF`` + its index in
    base 36; an entry refers only to earlier ones. ``unpack`` reverses it."""
    pool: list = []
    index: dict[str, str] = {}

    def intern(value, text: str):
        ref = index.get(text)
        if ref is None:
            ref = index[text] = REF + _base36(len(pool))
            pool.append(value)
        return ref

    def walk(value):
        if isinstance(value, str):
            return intern(value, _json(value)) if len(value) >= _MIN_POOLED or value.startswith(REF) else value
        if isinstance(value, list):
            value = [walk(v) for v in value]
        elif isinstance(value, dict):
            value = {k: walk(v) for k, v in value.items()}
        else:
            return value
        text = _json(value)
        return intern(value, text) if len(text) >= _MIN_POOLED else value

    out = _at_figures(data, walk)
    out["pool"] = pool
    return out


def _at_figures(value, change):
    """``value`` (``player_data``, packed or not) with ``change`` applied to each figure in it (the values under
    ``_FIGURE_KEYS``); nothing else is changed."""
    if isinstance(value, list):
        return [_at_figures(v, change) for v in value]
    if isinstance(value, dict):
        return {k: (change(v) if k in _FIGURE_KEYS and v is not None else _at_figures(v, change))
                for k, v in value.items()}
    return value


def unpack(value, pool: list):
    """A value of a packed figure with every reference into ``pool`` expanded (``pack``)."""
    if isinstance(value, str):
        if not value.startswith(REF):
            return value
        entry = pool[int(value[len(REF):], 36)]
        return entry if isinstance(entry, str) else unpack(entry, pool)
    if isinstance(value, list):
        return [unpack(v, pool) for v in value]
    if isinstance(value, dict):
        return {k: unpack(v, pool) for k, v in value.items()}
    return value


def page_json(data: dict) -> str:
    """Packed data as a JavaScript literal safe inside ``<script>``: ``<`` (so neither ``</script>`` nor ``<!--``),
    U+2028 and U+2029 written as JSON escapes."""
    return (_json(pack(data)).replace("<", "\\u003c").replace("\u2028", "\\u2028")
            .replace("\u2029", "\\u2029"))


def player_html(lesson: Lesson) -> str:
    """The lesson as one HTML page: the player, Plotly.js and ``player_data`` inlined (no request at all).

    Drawing every phase's figures costs seconds of CPU for a long lesson (about 4 s for lesson 07 on 2 cores,
    mostly Plotly building figures), so a page is kept in ``page_cache()`` under a digest of the lesson and of the
    code that draws it: the Classroom's first open of a lesson pays once per machine, not once per app start.
    """
    cache = page_cache()
    path = cache / page_file_name(lesson) if cache is not None else None
    if path is not None and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            pass  # built again below
    page = TEMPLATE.read_text(encoding="utf-8")
    page = page.replace("{{TITLE}}", html.escape(lesson.title, quote=False))
    page = page.replace("/*PLOTLY_JS*/", _plotly_js(), 1).replace("/*PLAYER_DATA*/", page_json(player_data(lesson)), 1)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(page, encoding="utf-8")
            tmp.replace(path)  # whole or not at all: another process may read it
            evict_stale_pages(cache, path.name)
        except OSError:
            pass  # a cache that cannot be written only costs time
    return page


def page_file_name(lesson: Lesson) -> str:
    """``<drawing code digest>-<page key>.html``: the digest of the drawing code (``_code_key``) in the name lets
    ``evict_stale_pages`` tell the pages no current code would serve without reading any."""
    return f"{_code_key()[:12]}-{_page_key(lesson)}.html"


def evict_stale_pages(cache: Path, kept: str) -> int:
    """Delete the pages in ``cache`` built by other drawing code than ``kept``'s (another digest prefix: they
    would never be read again), and temporary files of writers that died more than ten minutes ago. Returns how many
    files went; a file another process removes first is skipped."""
    code = kept.split("-", 1)[0]
    gone = 0
    for path in cache.iterdir():
        name = path.name
        try:
            if name.endswith(".html"):
                stale = name.split("-", 1)[0] != code
            else:
                stale = name.endswith(".tmp") and time.time() - path.stat().st_mtime > 600
            if stale:
                path.unlink()
                gone += 1
        except OSError:
            continue
    return gone


# The modules whose code decides what a page holds: a change to any of them changes every page's key.
_PAGE_CODE = ("lessons/player.py", "lessons/player.html", "lessons/phases.py", "lessons/race.py", "trace/figures.py",
              "engine/speedup.py")


def page_cache() -> Path | None:
    """The folder of built lesson pages: ``lesson_pages`` in the project's cache (``models.cache.cache_dir``); None
    when ``SPEC_EXPLORER_PAGE_CACHE=off``."""
    if os.environ.get("SPEC_EXPLORER_PAGE_CACHE", "").lower() == "off":
        return None
    return cache_dir() / "lesson_pages"


@functools.cache
def _code_key() -> str:
    """sha256 (hex) of the drawing code (``_PAGE_CODE``) and the Plotly.js bundled."""
    root, h = Path(__file__).resolve().parents[1], hashlib.sha256()
    for name in _PAGE_CODE:
        h.update(name.encode() + (root / name).read_bytes())
    h.update(f"{plotly.__version__} {PLOTLY_CARTESIAN.name}".encode())
    return h.hexdigest()


def _page_key(lesson: Lesson) -> str:
    """sha256 (24 hex digits) of the lesson's JSON and ``_code_key``."""
    return hashlib.sha256((_code_key() + lesson.to_json()).encode("utf-8")).hexdigest()[:24]


def read_page(page: str) -> dict:
    """The ``player_data`` a player page holds (``player_html``), every figure expanded. Raises ValueError for a
    page that holds none."""
    found = _DATA_RE.search(page)
    if found is None:
        raise ValueError("not a lesson player page: it holds no player data")
    data = json.loads(found.group(1))
    pool = data.pop("pool")
    return _at_figures(data, lambda figure: unpack(figure, pool))


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


INDEX_CSS = """
  html, body { margin: 0; font-family: system-ui, sans-serif; font-size: 18px; line-height: 1.45; color: #222;
               background: #fafafa; }
  main { max-width: 980px; margin: 0 auto; padding: 16px 20px 32px; }
  h1 { font-size: 30px; margin: 8px 0 4px; }
  .intro { margin: 0 0 16px; color: #444; }
  kbd { white-space: nowrap; border: 1px solid #bbb; border-bottom-width: 2px; border-radius: 4px; padding: 0 5px;
        font-size: 15px; background: #fff; }
  ol { list-style: none; margin: 0; padding: 0; display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
  li { background: #fff; border: 1px solid #ddd; border-left: 6px solid #3b6fb6; border-radius: 6px;
       padding: 10px 14px; }
  li a { font-size: 20px; font-weight: 650; color: #1a4d99; text-decoration: none; }
  li a:hover, li a:focus { text-decoration: underline; }
  .number { color: #888; font-weight: 400; margin-right: 6px; }
  .question { margin: 6px 0; font-style: italic; }
  .facts { margin: 0; color: #555; font-size: 15px; }
  footer { margin-top: 20px; color: #666; font-size: 15px; }
  @media (max-width: 800px) {
    html, body { font-size: 17px; }
    main { padding: 10px 12px 24px; }
    h1 { font-size: 24px; }
    ol { grid-template-columns: 1fr; gap: 10px; }
    li a { font-size: 19px; }
  }
"""


def index_html(entries: list[tuple[Lesson, str, int | None]], title: str = "Speculative decoding: lessons") -> str:
    """The index of exported lessons as one self-contained page (no script, no request): per ``(lesson, href,
    page bytes)`` its number, title (a link to ``href``), the question it answers, its runs with their steps and
    phases, where it was recorded and where its race was timed. Readable on a projector and on a phone."""
    esc = lambda text: html.escape(str(text), quote=True)  # noqa: E731
    items = []
    for n, (lesson, href, size) in enumerate(entries, 1):
        runs = "; ".join(f"{esc(r.label)}: {len(r.trace.steps)} steps" for r in lesson.runs)
        facts = [f"{runs} · {len(lesson.phases())} phases"]
        if lesson.recorded.get("machine"):
            facts.append(f"recorded on {esc(machine_name(lesson.recorded))}, "
                         f"{esc(str(lesson.recorded.get('date', ''))[:10])}")
        lanes = list(lesson.race_lanes())
        if lanes:
            facts.append("race timed on " + ", ".join(esc(m) for m in lanes))
        if size is not None:
            facts.append(f"{size / 1e6:.1f} MB")
        items.append(f'<li><a href="{esc(quote(href))}"><span class="number">{n:02d}</span>{esc(lesson.title)}</a>'
                     f'<p class="question">{esc(lesson.question)}</p><p class="facts">{" · ".join(facts)}</p></li>')
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title>
<style>{INDEX_CSS}</style>
</head>
<body>
<main>
<h1>{esc(title)}</h1>
<p class="intro">Each lesson is one page that plays a recorded run phase by phase in the browser, offline: the
draft tree growing level by level, the mask the target receives, the verification node by node and the commit, with
the race against plain decoding. Keys: <kbd>&rarr;</kbd> <kbd>Space</kbd> <kbd>Page Down</kbd> forward,
<kbd>&larr;</kbd> <kbd>Page Up</kbd> back, a step number and <kbd>Enter</kbd> to jump; on a phone, tap the right or
left edge.</p>
<ol>
{chr(10).join(items)}
</ol>
<footer>Written by <code>python -m explorer lessons export</code>.</footer>
</main>
</body>
</html>
"""


def export_index(lessons: list[Lesson], out_dir: str | Path) -> Path:
    """Write ``<out_dir>/index.html`` (``index_html``) listing those of ``lessons`` whose page is in ``out_dir``
    (``export_html``), in their order; returns its path. Raises OSError where the folder cannot be written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = [(lesson, f"{lesson.id}.html", (out / f"{lesson.id}.html").stat().st_size)
               for lesson in lessons if (out / f"{lesson.id}.html").is_file()]
    path = out / "index.html"
    path.write_text(index_html(entries), encoding="utf-8")
    return path


__all__ = ["FONT", "MASK_HEIGHT", "PLAYER_SCHEMA", "REF", "export_html", "export_index", "index_html", "pack",
           "page_cache", "page_json", "player_data", "player_html", "read_page", "trace_html", "trace_lesson", "unpack"]
