"""A real browser (Debian's chromium via Playwright) on the running app: Step twice, tree and mask drawn, no error."""

import os
import shutil
from types import SimpleNamespace

import pytest
from browser import CHROMIUM, running_app, server_log, step_twice

pytestmark = pytest.mark.skipif(not (shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)),
                                reason="needs Debian's chromium (installed by .ci/run)")


@pytest.fixture(scope="module")
def app():
    """One app server on the tiny pair for the module's tests (each opens its own browser sessions, as a class
    does): ``url``, ``pid`` and ``log()``, what the server has written so far. Starting one took about 15 s a test."""
    procs: list = []
    with running_app("tiny", procs=procs) as url:
        yield SimpleNamespace(url=url, pid=procs[0].pid, log=lambda: server_log(procs[0]))


def test_step_twice_in_a_real_browser(tmp_path, app):
    """A fresh page, nothing typed: the prompt box holds a real prompt and the first Step draws a tree."""
    report = step_twice(app.url, tmp_path, load_timeout_s=120)
    log = [app.log()]
    assert report["url"].rstrip("/") == app.url.rstrip("/")  # /explorer lands on the app's root page, the Explorer
    assert report["prompt"].strip() and report["exceptions"] == 0 and report["errors"] == []
    assert report["cut"] == [], report["cut"]  # no "For..." buttons or "Generat..." metric labels
    # the server's log is clean too: no traceback, and no widget warning (every kept widget's value is written back
    # each full run: state.keep_widget_values; the tiny pair is not the radio's first option: .streamlit/config.toml)
    assert "Traceback" not in log[0] and "Session State API" not in log[0], log[0]
    assert report["plots"] >= 5  # tree, mask, branches, stop signal, run
    titles = " ".join(report["titles"])
    assert "Step 2: draft tree" in titles and "Tree attention mask" in titles
    assert (tmp_path / "step2_tree.png").stat().st_size > 10_000
    # the default stop policy reads the shipped decision model; its what-if slider explains the step
    assert report["what_if"] and "draft tokens over" in report["what_if"][0]


def test_back_inspect_download_and_replay_in_a_real_browser(tmp_path, app):
    from browser import tour

    from explorer.trace.records import load_run

    url = app.url
    r = tour(url, tmp_path, load_timeout_s=120)
    assert r["exceptions"] == 0
    assert r["after_steps"].startswith("Step 3 of 3") and r["after_back"].startswith("Step 2 of 3")
    assert r["tree_points"] >= 3 and r["inspector"], r  # the click opened the node inspector
    assert r["back_fragment"] and r["click_fragment"], r  # Back and the click reran their fragment, not the app
    trace = load_run(tmp_path / "trace.json")
    assert len(trace.steps) == 3 and trace.prompt == "def fibonacci(n):" and trace.model["draft_id"]
    assert r["after_reset"] == ""
    assert r["replay_info"] and "no model loaded" in r["replay_info"][0]
    assert r["replay_first"].startswith("Step 1 of 3") and r["replay_forward"].startswith("Step 2 of 3")
    assert r["step_disabled"]
    assert any("schema version" in e for e in r["bad_upload"]), r["bad_upload"]
    for shot in ("back_full.png", "inspector_full.png", "replay_full.png"):
        assert (tmp_path / shot).stat().st_size > 20_000


def test_stop_interrupts_run_to_end_and_the_run_goes_on(tmp_path, app):
    import re

    from browser import run_and_stop

    url = app.url
    # the tiny pair holds 512 positions: End (512 tokens) would be refused, and so would about 400 beside the
    # default's widest tree (4 root chains of 16: 64 positions); three PageDowns leave about 350
    # Stop right after the first step: the tiny pair finishes its whole run in about a second
    r = run_and_stop(url, tmp_path, wait_s=0.0, load_timeout_s=120,
                     keys=("End", "PageDown", "PageDown", "PageDown"))
    assert r["exceptions"] == 0
    stopped = [t for t in r["info"] if t.startswith("Stopped after")]
    assert stopped and not r["success"], r  # interrupted before the 512-token run finished
    n = int(re.search(r"Stopped after (\d+) tokens", stopped[0]).group(1))
    assert 0 < n < 350
    shown = int(re.match(r"Step (\d+) of (\d+)", r["caption"]).group(2))
    after = re.match(r"Step (\d+) of (\d+)", r["after_step"])
    # the interrupted run may finish the step it was in after the page was drawn: one or two steps more
    assert after and after.group(1) == after.group(2) and shown + 1 <= int(after.group(2)) <= shown + 2, r


def test_free_drafts_show_their_source_provenance_and_matrix_row(tmp_path, app):
    from browser import free_drafts_tour

    url = app.url
    r = free_drafts_tour(url, tmp_path, load_timeout_s=120)
    assert r["exceptions"] == 0 and r["errors"] == [], r
    assert "token recycling" in r["legend"], r["legend"]  # the tree coloured by draft source
    assert r["clicked"] and r["inspector"], r
    assert r["provenance"] and "matrix row of" in r["provenance"][0], r["provenance"]
    assert r["matrix_panel"] and r["matrix_rows"] >= 1
    assert (tmp_path / "free_tree.png").stat().st_size > 10_000


def test_instrument_panels_in_a_real_browser(tmp_path, app):
    """The instruments: probe a step, expected against realised acceptance with measured forward costs, and the optimal
    tree run with one click (the sidebar switches to mcsd with that tree template)."""
    from browser import instruments_tour

    url = app.url
    r = instruments_tour(url, tmp_path, load_timeout_s=120)
    assert r["exceptions"] == 0 and r["errors"] == [], r
    metrics = dict(m.split("\n\n") for m in r["probe_metrics"])
    assert metrics["Flipped decisions"] == "0" and metrics["Mask lint"] == "OK"
    assert float(metrics["max |Δ logit|"]) < 1e-3
    assert r["probe_plot"] == 1
    assert r["acceptance_plots"] == r["acceptance_plots_before_costs"] + 1 == 5
    assert "Forward cost on this machine" in r["acceptance_titles"]
    assert r["optimal_text"] and "Optimal for 32 nodes" in r["optimal_text"][0]
    assert r["optimal_titles"][0].startswith("Optimal tree:")
    assert r["sidebar_template"] == r["template"] and r["after_run"].startswith("Step ")
    assert r["finished"]
    for name in ("probe_panel.png", "acceptance_panel.png", "optimal_panel.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_online_adaptation_in_a_real_browser(tmp_path, app):
    """Switch online adaptation on, step, and see the adapting policy drawn over the run with its caption; after
    Reset, the next run starts from what it learned."""
    from browser import adaptation_tour

    url = app.url
    r = adaptation_tour(url, tmp_path, steps=3, load_timeout_s=120, carried_steps=1)
    assert r["exceptions"] == 0 and r["errors"] == [], r
    assert r["charts"] >= 1 and r["title"] == ["Stop-policy adaptation over the run (last-layer)"]
    assert "predicted, adapting model" in r["legend"] and "accepted (mean P(accept))" in r["legend"]
    assert r["captions"] and "labelled" in r["captions"][0] and r["after_steps"].startswith("Step 3")
    assert (tmp_path / "adaptation_chart.png").stat().st_size > 10_000
    # after Reset the next run starts from what this one learned, and says so
    assert r["carried_captions"] and "labelled tokens" in r["carried_captions"][0], r
    assert (tmp_path / "adaptation_carried.png").stat().st_size > 10_000


def test_the_goodput_fallback_in_a_real_browser(tmp_path, app):
    """With the fallback switched on, the rule's first plain decoding step says so under the step."""
    from browser import fallback_tour

    url = app.url
    r = fallback_tour(url, tmp_path, load_timeout_s=120)
    assert r["exceptions"] == 0 and r["errors"] == [], r
    assert r["after_steps"].startswith("Step 4") and r["captions"], r
    assert "measuring plain decoding" in r["captions"][0] and "drafted nothing" in r["captions"][0]
    assert (tmp_path / "fallback_step.png").stat().st_size > 10_000


def test_what_if_edit_new_run_and_timeline_in_a_real_browser(tmp_path, app):
    """Counterfactuals: re-verify a step as recorded (identical), replace a drafted token and see both trees,
    continue from the edit as a new run and switch back, the step's waterfall, and the stop-signal calibration
    view."""
    from browser import what_if_tour

    url = app.url
    r = what_if_tour(url, tmp_path, load_timeout_s=120)
    assert r["exceptions"] == 0 and r["errors"] == [], r
    assert r["identical"] and "Re-verified as recorded" in r["identical"][0]
    assert r["changes"] and "committed" in r["changes"][0]
    assert sum("draft tree" in t for t in r["trees"]) == 2 and sum("mask" in t for t in r["trees"]) == 2
    assert r["after_branch"].startswith("Step ") and r["after_switch"].startswith("Step 3 of 3")
    assert r["timeline_titles"][0].startswith("Step 3: where") and r["timeline_caption"]
    assert (tmp_path / "what_if_panel.png").stat().st_size > 10_000
    assert (tmp_path / "timeline_panel.png").stat().st_size > 10_000
    assert any(t.startswith("Reliability") for t in r["calibration_titles"]), r["calibration_titles"]
    assert any(t.startswith("ROC") for t in r["calibration_titles"]) and r["calibration_metrics"]


def test_classroom_fits_a_projector_and_plays_with_a_clicker(tmp_path, app):
    """The Classroom at 1280x720, 1920x1080 and on a phone, sidebar collapsed, no model loaded: 30 Right presses
    show 30 phases in order with no websocket message (the player runs in the browser); the tree, the mask, the
    account and the controls lie inside the viewport (a phone: the tree and the account), no text is cut, chart
    text is at least 16 px; Page Down / Page Up / Left move phase by phase; Play advances and a key stops it; every
    lesson opens, and a clicker's key works right after picking it with the mouse; a malformed lesson file gets a
    message and the class goes on."""
    from browser import classroom_tour

    bad = tmp_path / "bad_lesson.json"
    bad.write_text('{"lesson_schema": 99}')
    url = app.url
    report = classroom_tour(url, tmp_path, pid=app.pid, bad_lesson=bad)
    for size, r in report.items():
        width, height = r["viewport"]
        assert r["sidebar_collapsed"] and r["page_errors"] == [], (size, r)
        lesson = r["positions"][0].split(":")[0]
        assert r["positions"] == [f"{lesson}:{i}" for i in range(31)], r["positions"]
        assert r["press_frames"] == 0, (size, r["press_frames"])  # no message to the server, none from it
        assert r["where"].endswith("31/" + r["where"].rsplit("/", 1)[1])  # Continue live knows the phase
        assert r["positions_back"] == f"{lesson}:3"
        names = ("tree", "account") if width < 700 else ("tree", "mask", "account", "controls")
        for name in names:
            left, top, right, bottom = r["boxes"][name]
            assert 0 <= left and 0 <= top and right <= width + 1 and bottom <= height + 1, (size, name, r["boxes"])
        tree_top, tree_bottom = r["boxes"]["tree"][1], r["boxes"]["tree"][3]
        assert tree_bottom - tree_top >= 0.45 * height, (size, r["boxes"]["tree"])  # the charts fill the screen
        assert r["cut"] == [], (size, r["cut"])
        assert r["min_chart_px"] >= 16, (size, r["min_chart_px"])
        assert (r["page_down"], r["page_up"], r["left"]) == (f"{lesson}:4", f"{lesson}:3", f"{lesson}:2")
        if "played" in r:
            before, after = r["played"]
            assert int(after.split(":")[1]) >= int(before.split(":")[1]) + 2, r["played"]  # Play advanced
            assert r["stopped"][0] == r["stopped"][1], r["stopped"]  # and the key stopped it
        assert (tmp_path / f"classroom_{width}x{height}.png").stat().st_size > 20_000
    first = report["1280x720"]
    assert len(first["lessons"]) >= 6 and max(first["lessons"].values()) < 15, first["lessons"]
    assert all(pos.endswith(":1") for pos in first["after_pick"].values()), first["after_pick"]
    assert any("schema version 99" in m for m in first["bad_lesson"]), first["bad_lesson"]
    assert first["after_bad_lesson"].endswith(":1")  # the lesson on screen stayed


def test_a_whole_class_on_one_app(tmp_path, tiny, app):
    """Four browser sessions at once on one server: two replay a lesson and press Right together, two step live
    runs on the tiny pair together (ten took 115 s on 2 cores, most of it opening the pages; four prove the same).
    No error; every classroom is where its own presses took it; every live trace is the one its own steps give when
    run alone (sessions stepping at once do not mix); the server's memory stays flat from round to round."""
    from browser import whole_class

    from explorer.engine.config import MethodConfig
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.trace.records import load_run

    url = app.url
    r = whole_class(url, tmp_path, app.pid, students=4, rounds=3)
    assert r["errors"] == [], r["errors"]
    assert r["phase"]["n"] == 6 and r["step"]["n"] >= 4, (r["phase"], r["step"])  # latencies were measured
    assert all(pos.endswith(":3") for pos in r["positions"]), r["positions"]
    for path in r["traces"]:
        trace = load_run(path)
        assert len(trace.steps) == 3
        solo = build_engine(tiny, MethodConfig(**trace.settings["method"]),
                            SamplingConfig(**trace.settings["sampling"]))
        solo.start(trace.prompt_ids, trace.settings["max_new_tokens"])
        solo.run(max_steps=3)
        assert solo.trace.generated_ids == trace.generated_ids
    assert len({load_run(p).prompt for p in r["traces"]}) == 2  # each session its own run
    first, last = r["memory"][1]["rss"], r["memory"][-1]["rss"]
    assert last <= first * 1.15 + 50, r["memory"]  # flat: rounds do not pile up memory


def test_an_exported_lesson_plays_offline_in_a_real_browser(tmp_path):
    """``lessons export``: a shipped lesson's page opened from disk, every other request aborted: 30 Right presses
    show 30 phases in order with no request, at a projector's size and on a phone (where a tap on the right edge
    goes forward)."""
    from browser import play_exported

    from explorer.lessons.lesson import LESSONS_DIR, load_lesson
    from explorer.lessons.player import export_html

    page = export_html(load_lesson(LESSONS_DIR / "03-temperature-one.json"), tmp_path)
    for viewport in ((1280, 720), (390, 844)):
        report = play_exported(page, viewport=viewport, out_dir=tmp_path)
        assert report["requests"] == [] and report["phases"] == list(range(1, 31)), report
        assert all(ms is not None for ms in report["draw_ms"])
    assert report["tap"] == 1


def test_the_forensics_page_compares_two_settings_in_a_real_browser(tmp_path, tiny, app):
    """Run a built-in set (MT-bench's first five: HumanEval's prompts are too long for the tiny pair, which the page
    says prompt by prompt), keep it as A, read saved traces of the same prompts at T = 0.8 (and one broken file) as
    B: the diff is drawn, the broken file named; a file that is no forensics.json offered as A is refused, and the
    comparison stays. Screenshots at a projector's, a desktop's and a phone's size (docs/img/forensics_*.png)."""
    from browser import forensics_tour

    from explorer.analysis.prompts import encode_prompt, select_prompts
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.trace.records import save_run

    traces = []
    for n, prompt in enumerate(select_prompts(["mt-bench:0:5"])):
        engine = build_engine(tiny, DEFAULTS["mcsd-improved"], SamplingConfig(temperature=0.8, seed=n))
        engine.start(encode_prompt(tiny.tokenizer, prompt.text), 24, prompt_text=prompt.text)
        trace = engine.run()
        trace.prompt_info = prompt.info()
        traces.append(tmp_path / f"run{n}.json")
        save_run(trace, traces[-1])
    broken, not_forensics = tmp_path / "broken.json", tmp_path / "a.json"
    broken.write_text('{"schema_version": 99, "steps": []}')
    not_forensics.write_text('{"forensics_schema": 1}')
    url = app.url
    r = forensics_tour(url, tmp_path / "shots", traces, (broken, not_forensics))
    assert r["exceptions"] == 0 and r["charts_a"] >= 4 and r["kept"] == 1, r
    assert "5 runs of mcsd-improved, T 0" in r["summary_a"], r["summary_a"]
    assert any("broken.json" in w and "schema version" in w for w in r["warnings"]), r["warnings"]
    assert "5 prompts in both" in r["compare"] and "T 0.8" in r["compare"], r["compare"]
    assert any("without its tables" in e for e in r["bad_a"]) and r["still_compared"] == 1, r
    for size, seen in r["sizes"].items():
        assert not seen["overflow"] and seen["cut"] == [], (size, seen)
        assert (tmp_path / "shots" / f"forensics_{size}_whole.png").stat().st_size > 30_000


@pytest.mark.real
def test_the_explorer_reads_whole_at_every_screen_size_on_the_embedded_pair(tmp_path):
    """The Explorer after a step on the embedded pair at a projector's 1280x720, a laptop's 1366x768, 1920x1080
    and a phone's 390x844, teach mode off and on (its larger type), the sidebar open (closed on the phone): no
    button, metric or label cut or broken inside a word, no chart title or note cut at the chart's edge, no
    overprinted ticks or tree labels, no exception."""
    from browser import explorer_layout_tour

    with running_app("default") as url:
        report = explorer_layout_tour(url, tmp_path, steps=1, load_timeout_s=900, whole=False)
    for view, faults in report.items():
        if view.endswith("exceptions"):
            assert faults == 0, view
            continue
        assert faults == {"cut": [], "broken": [], "charts": []}, (view, faults)
    assert (tmp_path / "explorer_1280x720_teach.png").stat().st_size > 30_000
