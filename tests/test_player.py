"""The lesson player draws what Python computed: every shipped lesson exported (``lessons export``), its pages' data
read back and compared with ``trace/figures.py`` and ``engine/speedup.py`` phase by phase; the index page; and an
exported lesson opened from the index in a real browser (Debian's chromium through Playwright), offline, with the
charts it plots compared with the page's data."""

from __future__ import annotations

import functools
import html.parser
import json
import os
import re
from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from explorer.engine.speedup import tree_speedup
from explorer.lessons import phases, player
from explorer.lessons.lesson import load_lesson, shipped_lessons
from explorer.lessons.race import (SPEEDUP_ALPHAS, SPEEDUP_COSTS, measured_point, race_figure, slider_stop,
                                   speedup_figure)
from explorer.trace import figures

LESSONS = [load_lesson(p) for p in shipped_lessons()]


@functools.cache
def _page_template() -> str:
    """The template every page carries, as Plotly itself sets and writes it (``update_layout(template=...)`` on an
    empty figure, then ``plotly.io.to_json``): made once, as setting it validates it property by property (a second
    a figure, most of this file's time when every figure set it)."""
    return json.dumps(json.loads(pio.to_json(go.Figure().update_layout(template=player.PAGE_TEMPLATE)))["layout"]
                      ["template"])


def _plotly(fig) -> dict:
    """A figure as ``plotly.io.to_json`` writes it, read back, in the template every page carries (whichever the
    process's default is: importing Streamlit, as earlier tests do, makes it Streamlit's)."""
    data = json.loads(pio.to_json(fig))
    data.setdefault("layout", {})["template"] = json.loads(_page_template())
    return data


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every shipped lesson exported by the command a course runs: ``lessons export --out DIR``."""
    from explorer.cli.main import main

    out = tmp_path_factory.mktemp("lessons")
    assert main(["lessons", "export", "--out", str(out)]) == 0
    return out


def _page_data(folder: Path, lesson) -> dict:
    return player.read_page((folder / f"{lesson.id}.html").read_text(encoding="utf-8"))


@pytest.mark.parametrize("lesson", LESSONS, ids=[lesson.id for lesson in LESSONS])
def test_every_phase_of_the_page_draws_what_figures_py_draws(exported, lesson):
    """For every phase of every run, the page's tree and mask are ``trace.figures``' figures for that phase (the
    Plotly JSON whole: data, layout and template), and its words are ``phases.account``'s."""
    data = _page_data(exported, lesson)
    assert data["player_schema"] == player.PLAYER_SCHEMA and data["id"] == lesson.id
    assert len(data["runs"]) == len(lesson.runs)
    for r, (run, lesson_run) in enumerate(zip(data["runs"], lesson.runs)):
        trace = lesson_run.trace
        expected = phases.run_phases(trace)
        assert [s for s, _ in run["phases"]] == [p.step for p in expected]
        assert run["steps"] == len(trace.steps)
        for (_, drawn), phase in zip(run["phases"], expected):
            step = trace.steps[phase.step]
            where = (lesson.id, r, phase)
            assert (drawn["kind"], drawn["label"], drawn["level"], drawn["node"]) == (
                phase.kind, phase.label, phase.level, phase.node), where
            assert drawn["tree"] == _plotly(figures.tree_figure(step, shown=phases.shown_status(step, phase),
                                                                font=player.FONT, fit_labels=False)), where
            if len(step.nodes) > 1 and phases.mask_rows(step, phase):
                assert drawn["mask"] == _plotly(figures.mask_figure(step, rows=phases.mask_rows(step, phase),
                                                                    font=player.FONT, height=player.MASK_HEIGHT)), where
            else:  # no tree, or no row sent yet (PEARL's first round: the prefill's row checks its first draft)
                assert drawn["mask"] is None, where
            assert drawn["account"] == phases.account(step, phase, trace.greedy), where
            assert drawn["note"] == lesson.note_at(r, phase), where


@pytest.mark.parametrize("lesson", LESSONS, ids=[lesson.id for lesson in LESSONS])
def test_the_race_and_the_speedup_curve_are_pythons(exported, lesson):
    """Per run and machine the lesson was timed on: the race is ``race.race_figure``'s, the measured point
    ``race.measured_point``'s, and every point of every curve the cost slider can show is ``engine.speedup``'s
    ``tree_speedup`` at that acceptance and cost ratio (to the 4 decimals the page keeps)."""
    data = _page_data(exported, lesson)
    for r, run in enumerate(data["runs"]):
        lanes = lesson.race_lanes()
        assert list(run["race"]) == list(lanes)
        for name, timed in lanes.items():
            lane = run["race"][name]
            point = measured_point(timed.runs[r], timed.baseline)
            assert lane["point"] == json.loads(json.dumps(point))
            assert lane["figure"] == _plotly(race_figure(timed.runs[r], timed.baseline, lesson.runs[r].label,
                                                         font=player.FONT, machine=name))
            speedup = lane["speedup"]
            assert speedup["costs"] == list(SPEEDUP_COSTS) and speedup["at"] == slider_stop(point["c"])
            assert speedup["figure"] == _plotly(speedup_figure(point, SPEEDUP_COSTS[speedup["at"]], font=player.FONT))
            widths = point["widths"] or [1.0]
            assert len(speedup["curves"]) == len(SPEEDUP_COSTS)
            for c, curve in zip(SPEEDUP_COSTS, speedup["curves"]):
                assert curve["x"] == list(SPEEDUP_ALPHAS)
                assert curve["y"] == pytest.approx([tree_speedup(a, widths, c) for a in SPEEDUP_ALPHAS], abs=5.1e-5)
            # the figure's first trace is the slider's curve at its first stop; the measured cost ratio's curve
            assert speedup["figure"]["data"][0] == speedup["curves"][speedup["at"]]
            if point["c"] is not None:
                measured = speedup["figure"]["data"][1]
                assert measured["y"] == pytest.approx([tree_speedup(a, widths, point["c"]) for a in SPEEDUP_ALPHAS],
                                                      abs=5.1e-5)
            star = speedup["figure"]["data"][-1]
            assert (star["x"], star["y"]) == ([point["alpha"]], [point["speedup"]])


def test_the_page_has_no_figure_code_of_its_own():
    """The JavaScript ports of the tree and mask figures and of the speedup formula are gone: the page renders
    the embedded figures (Plotly.react) and nothing computes a speedup or lays out a tree in it."""
    script = player.TEMPLATE.read_text(encoding="utf-8")
    for port in ("function speedup(", "treeFigure", "maskFigure", "speedupFigure", "Math.pow", "status_colors",
                 "heatmap"):
        assert port not in script, port
    assert "Plotly.react" in script and "src=" not in script and "href=" not in script


def test_pack_stores_each_value_once_and_unpacks_exactly():
    """``pack``: the figures of a page become references into one pool where repeated values are stored once (a
    string that looks like a reference too; the words around them stay as written), and a page gives back exactly
    what was packed (``read_page``)."""
    tree = {"data": [{"x": [0.0, 1.0, 2.0], "text": ["§1", "a long label here"] * 2}], "layout": {"t": "x" * 40}}
    data = {"id": "x", "runs": [{"phases": [[0, {"tree": tree, "mask": None, "note": "§0 as written"}],
                                            [0, {"tree": tree, "mask": tree, "note": None}]], "race": {}}]}
    packed = player.pack(json.loads(json.dumps(data)))
    first, second = (p["tree"] for _, p in packed["runs"][0]["phases"])
    assert first == second == packed["runs"][0]["phases"][1][1]["mask"] and first.startswith(player.REF)
    assert packed["runs"][0]["phases"][0][1]["mask"] is None and packed["id"] == "x"
    assert packed["pool"].count("a long label here") == 1 and "§1" in packed["pool"]
    assert packed["runs"][0]["phases"][0][1]["note"] == "§0 as written"  # words stay as they are
    page = player.page_json(data)
    assert "<" not in page and json.loads(page)["pool"] == packed["pool"]
    assert player.read_page(f"const DATA = {page};\n// end of DATA") == data


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs, self.srcs, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "href" in attrs:
            self.hrefs.append(attrs["href"])
        if "src" in attrs:
            self.srcs.append(attrs["src"])

    def handle_data(self, data):
        self.text.append(data)


def test_the_index_lists_every_lesson_with_its_question_and_links_to_its_page(exported):
    """``lessons export`` also writes index.html: every lesson's title and question, and a link to its page in the
    folder; nothing loaded from elsewhere (no script, no stylesheet, no image)."""
    index = (exported / "index.html").read_text(encoding="utf-8")
    links = _Links()
    links.feed(index)
    text = " ".join(" ".join(links.text).split())
    assert links.hrefs == [f"{lesson.id}.html" for lesson in LESSONS]
    for lesson in LESSONS:
        assert lesson.title in text and lesson.question in text
        assert (exported / f"{lesson.id}.html").is_file()
    assert links.srcs == [] and "<script" not in index and "<link" not in index and "http" not in index
    # an export of one lesson keeps the others' pages in the index, and the index links nothing that is not there
    from explorer.cli.main import main

    one = exported.parent / "one"
    assert main(["lessons", "export", "--only", LESSONS[2].id, "--out", str(one)]) == 0
    links = _Links()
    links.feed((one / "index.html").read_text(encoding="utf-8"))
    assert links.hrefs == [f"{LESSONS[2].id}.html"]


# What the page plots: each chart's data as the browser holds it (Plotly keeps the traces it was given).
PLOTTED = """() => Object.fromEntries(['tree', 'mask', 'speedup'].map(id => {
  const gd = document.getElementById(id);
  return [id, gd && gd.data ? JSON.parse(JSON.stringify(gd.data)) : null]; }))"""


# The tree's node labels whose drawn boxes overlap another label or a node's marker (by more than a pixel each way).
OVERLAPPING_LABELS = """() => {
  const box = (e) => e.getBoundingClientRect();
  const labels = [...document.querySelectorAll('#tree .textpoint text')].filter(t => t.textContent)
    .map(t => [t.textContent, box(t)]);
  const markers = [...document.querySelectorAll('#tree .scatterlayer .point')].map(m => ['marker', box(m)]);
  const meet = (p, q) => Math.min(p.right, q.right) - Math.max(p.left, q.left) > 1
    && Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top) > 1;
  const out = [];
  labels.forEach(([a, p], i) => [...labels.slice(i + 1), ...markers].forEach(([b, q]) => {
    if (meet(p, q)) out.push([a, b]); }));
  return out; }"""


def _same_tree(plotted: list, embedded: list) -> None:
    """The tree as plotted is the embedded figure's data; the page may only move a label below or beside its node and
    shorten it where labels would overlap (``fitTree``)."""
    assert len(plotted) == len(embedded)
    for shown, made in zip(plotted, embedded):
        fitted = {"text", "textposition"}
        assert {k: v for k, v in shown.items() if k not in fitted} == {k: v for k, v in made.items() if k not in fitted}
        if shown.get("text") != made.get("text"):
            for short, label in zip(shown["text"], made["text"]):
                assert short == label or (short.endswith("…") and label.startswith(short[:-1])), (short, label)
        assert shown.get("textposition") == made.get("textposition") or shown["textposition"] == "middle right" or set(
            shown["textposition"]) <= {"top center", "bottom center"}


@pytest.mark.parametrize("viewport", [(1280, 720), (390, 844)])
def test_a_course_opens_the_index_and_plays_a_lesson_offline_in_a_real_browser(exported, viewport, tmp_path):
    """index.html opened from disk with every request that is not a file of the folder aborted: a link leads to
    its lesson; Right plays phase after phase with no request, and at each phase the tree and mask the browser
    plots are the page's figures for that phase (the Python ones, as the first test checks); the cost slider's
    curve is the one Python computed for its stop. Screenshots of the index and the page in ``tmp_path``."""
    from browser import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    lesson = next(lesson for lesson in LESSONS if lesson.id == "04-chain-vs-tree")
    data = _page_data(exported, lesson)
    flat = [p for run in data["runs"] for _, p in run["phases"]]
    folder = exported.resolve().as_uri() + "/"
    outside, errors = [], []

    def route(r):
        if r.request.url.startswith(folder):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    phone = viewport[0] < 700
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]}, is_mobile=phone,
                                has_touch=phone)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", route)
        page.goto(folder + "index.html")
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport[0]  # no sideways scrolling
        page.screenshot(path=str(tmp_path / f"index-{viewport[0]}x{viewport[1]}.png"))
        page.get_by_role("link", name=re.compile(re.escape(lesson.title))).click()
        page.wait_for_url(folder + f"{lesson.id}.html")
        page.wait_for_function("window.shownPhase === 0", timeout=60_000)
        for at in range(4):
            if at:
                page.keyboard.press("ArrowRight")
            assert page.evaluate("window.shownPhase") == at
            plotted = page.evaluate(PLOTTED)
            _same_tree(plotted["tree"], flat[at]["tree"]["data"])
            if not phone:  # a phone shows the mask a tab away
                assert plotted["mask"] == flat[at]["mask"]["data"], at
        if phone:
            page.click("#tab-mask")
            assert page.evaluate(PLOTTED)["mask"] == flat[3]["mask"]["data"]
        lane = next(iter(data["runs"][0]["race"].values()))["speedup"]
        page.wait_for_function("document.getElementById('speedup').data !== undefined")
        assert page.evaluate(PLOTTED)["speedup"] == lane["figure"]["data"]
        page.eval_on_selector("#cost", "e => { e.value = 35; e.dispatchEvent(new Event('input')); }")
        plotted = page.evaluate(PLOTTED)["speedup"]
        assert plotted[0] == lane["curves"][35] and plotted[1:] == lane["figure"]["data"][1:]
        assert page.locator("#cost-value").inner_text() == f"{SPEEDUP_COSTS[35]:.2f}"
        page.screenshot(path=str(tmp_path / f"player-{viewport[0]}x{viewport[1]}.png"))
        # a head's tree keeps the top margin its subtitle (the target layers read) needs
        head = next(lesson for lesson in LESSONS if lesson.id == "07-head-features")
        tree = _page_data(exported, head)["runs"][0]["phases"][0][1]["tree"]
        assert tree["layout"]["title"]["subtitle"]["text"].startswith("head read target layers")
        page.goto(folder + f"{head.id}.html")
        page.wait_for_function("window.shownPhase === 0", timeout=60_000)
        assert page.evaluate("document.getElementById('tree')._fullLayout.margin.t") >= tree["layout"]["margin"]["t"]
        if phone:  # the widest tree's labels stay apart (beside their nodes where rows are close)
            learns = next(lesson for lesson in LESSONS if lesson.id == "10-head-learns")
            page.goto(folder + f"{learns.id}.html")
            page.wait_for_function("window.shownPhase === 0", timeout=60_000)
            spans = [p["tree"]["layout"]["yaxis"]["range"] for run in _page_data(exported, learns)["runs"]
                     for _, p in run["phases"]]
            widest = max(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
            rows = spans[widest][1] - spans[widest][0]
            assert rows >= 10  # a head's wide level: the case the growing box is for
            page.evaluate(f"show({widest})")
            assert page.evaluate(OVERLAPPING_LABELS) == []
        browser.close()
    assert outside == [] and errors == []


def test_a_built_page_is_kept_and_a_changed_lesson_is_built_again(tmp_path, monkeypatch):
    """``player_html`` keeps each page under a digest of the lesson and the drawing code: the second call reads it
    back (the same page), a lesson that differs in anything gets its own, and ``SPEC_EXPLORER_PAGE_CACHE=off``
    keeps nothing."""
    import dataclasses

    monkeypatch.setenv("SPEC_EXPLORER_CACHE", str(tmp_path))
    lesson = min(LESSONS, key=lambda le: sum(len(r.trace.steps) for r in le.runs))
    page = player.player_html(lesson)
    kept = list((tmp_path / "lesson_pages").glob("*.html"))
    assert len(kept) == 1 and kept[0].read_text(encoding="utf-8") == page
    kept[0].write_text(page.replace("</html>", "<!-- read back -->\n</html>"), encoding="utf-8")
    assert "read back" in player.player_html(lesson)  # read from the cache, not built again
    retitled = dataclasses.replace(lesson, title=lesson.title + " (again)")
    assert "(again)" in player.player_html(retitled)
    assert len(list((tmp_path / "lesson_pages").glob("*.html"))) == 2
    # a page built by other drawing code is never read again: the next page written evicts it (and a dead writer's
    # leftover), not the current code's pages
    old = tmp_path / "lesson_pages" / ("0" * 12 + "-" + "1" * 24 + ".html")
    old.write_text("old drawing code", encoding="utf-8")
    dead = tmp_path / "lesson_pages" / "x.123.tmp"
    dead.write_text("half a page", encoding="utf-8")
    os.utime(dead, (1, 1))
    assert "(twice)" in player.player_html(dataclasses.replace(lesson, title=lesson.title + " (twice)"))
    assert not old.exists() and not dead.exists()
    assert len(list((tmp_path / "lesson_pages").glob("*.html"))) == 3
    monkeypatch.setenv("SPEC_EXPLORER_PAGE_CACHE", "off")
    assert player.page_cache() is None and "read back" not in player.player_html(lesson)


def test_a_page_is_the_same_whichever_template_the_process_defaults_to(monkeypatch):
    """A page built where Streamlit was imported (the app: it makes its template Plotly's default) is the page
    ``lessons export`` builds: each figure carries ``PAGE_TEMPLATE``, so the page cache may serve either to both."""
    lesson = min(LESSONS, key=lambda le: sum(len(r.trace.steps) for r in le.runs))
    monkeypatch.setattr(pio.templates, "default", "plotly")
    plain = player.player_data(lesson)
    monkeypatch.setattr(pio.templates, "default", "plotly_dark")
    assert player.player_data(lesson) == plain
    tree = plain["runs"][0]["phases"][0][1]["tree"]
    assert tree["layout"]["template"] == json.loads(json.dumps(pio.templates[player.PAGE_TEMPLATE].to_plotly_json()))
