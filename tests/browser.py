"""Drive the running app in a real browser (Debian's chromium through Playwright) and take screenshots.

Used by tests/test_browser.py (tiny pair) and by hand on the default pair:
    python tests/browser.py --pair default --out out/screens
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(pair: str, port: int | None = None, timeout: float = 600, log: list | None = None,
                procs: list | None = None, app: Path = ROOT / "app.py"):
    """Start ``streamlit run app.py`` on localhost with the given initial pair; yield its URL. ``log``: a list
    that gets the server's whole output (stdout and stderr) appended once the server has stopped; ``procs``: a list
    that gets the server's ``Popen`` (its pid, for memory readings); ``app``: another checkout's app.py (started in
    its folder, with its .streamlit/config.toml), to measure against this one."""
    port = port or free_port()
    env = dict(os.environ, SPEC_EXPLORER_PAIR=pair)
    app = Path(app).resolve()
    # the server's output goes to a file, which ``server_log(proc)`` reads while it runs (a pipe would be read
    # only at the end, and could fill up and stall a long-lived server)
    out_file = tempfile.NamedTemporaryFile("w+", prefix="streamlit-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(app), "--server.port",
                             str(port), "--server.address", "127.0.0.1", "--server.headless", "true"],
                            cwd=app.parent, env=env, stdout=out_file, stderr=subprocess.STDOUT, text=True)
    proc.log_path = out_file.name
    url = f"http://127.0.0.1:{port}"
    if procs is not None:
        procs.append(proc)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited: {server_log(proc)}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out_file.close()
        if log is not None:
            log.append(server_log(proc))
        with contextlib.suppress(OSError):
            os.unlink(proc.log_path)


def server_log(proc) -> str:
    """What the server ``running_app`` started has written so far (stdout and stderr)."""
    return Path(proc.log_path).read_text(encoding="utf-8", errors="replace")


# How a test knows that the script run its click started has finished, from what Streamlit itself sends: every
# message of a session comes over its websocket as a ForwardMsg protobuf, and a run begins with session_status_changed
# (script running) and ends with script_finished. Chromium's DevTools protocol reports each frame the page receives
# (Network.webSocketFrameReceived), so a test counts the runs that finished without any marker in the app. The
# script-state attribute on the app's root (IDLE) alone cannot tell: a fast rerun (a fragment's) starts and finishes
# between two frames the browser draws, and its "running" phase is never rendered.
class _Runs:
    """Streamlit's own account of one page's script runs, read off its websocket from the first ``runs(page)`` on:
    how many started and finished (``script_finished``, except a run cut short by another, which goes on in its
    place), and whether one is running now."""

    def __init__(self, page):
        self.started = self.finished = 0
        self.running = False
        self.fragment = False  # whether the last run that finished was a fragment's alone (st.fragment)
        self._cdp = page.context.new_cdp_session(page)
        self._cdp.on("Network.webSocketFrameReceived", self._frame)
        self._cdp.send("Network.enable")

    def _frame(self, params: dict) -> None:
        from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

        response = params.get("response") or {}
        if response.get("opcode") != 2:  # Streamlit's messages are binary frames
            return
        try:
            msg = ForwardMsg.FromString(base64.b64decode(response.get("payloadData", "")))
        except Exception:  # noqa: BLE001 - not one of Streamlit's messages
            return
        kind = msg.WhichOneof("type")
        if kind == "session_status_changed":
            if msg.session_status_changed.script_is_running and not self.running:
                self.started += 1
            self.running = msg.session_status_changed.script_is_running
        elif kind == "script_finished" and msg.script_finished != ForwardMsg.FINISHED_EARLY_FOR_RERUN:
            self.finished += 1
            self.running = False
            self.fragment = msg.script_finished == ForwardMsg.FINISHED_FRAGMENT_RUN_SUCCESSFULLY


_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Resolves once the page shows no script run in progress and nothing on it has changed for QUIET ms (the last
# message's elements drawn), or after MAX ms.
SETTLED = """([quiet, max]) => new Promise(resolve => {
  let last = performance.now();
  const start = last;
  const seen = new MutationObserver(() => { last = performance.now(); });
  seen.observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
  const tick = () => {
    const now = performance.now();
    const app = document.querySelector("[data-testid='stApp']");
    const idle = app?.getAttribute('data-test-script-state') === 'notRunning';
    if ((idle && now - last >= quiet) || now - start >= max) { seen.disconnect(); resolve(now - start); }
    else { setTimeout(tick, 10); }
  };
  tick();
})"""


def _watch(page) -> _Runs:
    watch = _WATCHED.get(page)
    if watch is None:
        watch = _WATCHED[page] = _Runs(page)
    return watch


def settle(page, quiet_ms: int = 100, max_ms: int = 5000) -> None:
    """Wait until no script run is in progress and the page has stopped changing (``SETTLED``)."""
    page.evaluate(SETTLED, [quiet_ms, max_ms])


def wait_idle(page, timeout_ms: int) -> None:
    """Wait until no script run is in progress (for the first load; after an action use ``rerun``)."""
    _watch(page)
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    settle(page)


def runs(page) -> int:
    """How many script runs of the page's session have finished since the page was first asked (``_Runs``)."""
    return _watch(page).finished


def last_run_was_fragment(page) -> bool:
    """Whether the page's last finished script run reran one fragment (``st.fragment``) rather than the app."""
    return _watch(page).fragment


def _wait(page, done, timeout_ms: int) -> bool:
    """Let Playwright deliver the page's events until ``done()`` holds (True) or ``timeout_ms`` passes (False)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while not done():
        if time.monotonic() > deadline:
            return False
        page.wait_for_timeout(15)
    return True


def wait_runs_after(page, before, timeout_ms: int) -> None:
    """Wait until a script run has finished after the count ``before`` (``runs``), no other is in progress and the
    page has drawn it; ``before`` None: the page's first load."""
    if before is None:
        wait_idle(page, timeout_ms)
        return
    watch = _watch(page)
    if not _wait(page, lambda: watch.finished > before and not watch.running, timeout_ms):
        raise TimeoutError(f"no script run finished within {timeout_ms} ms")
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    settle(page)


def rerun(page, action, timeout_ms: int = 300_000) -> None:
    """Do ``action()`` (a click, a key press, an upload) and wait until the script run it starts has finished."""
    before = runs(page)
    action()
    wait_runs_after(page, before, timeout_ms)


def step_twice(url: str, out_dir: Path, load_timeout_s: float = 600) -> dict:
    """Open the app, press Step twice with nothing typed; screenshot; report what the page shows."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1400})
        page.goto(url.rstrip("/") + "/explorer")  # the Explorer's own path: the app's root page
        page.wait_for_selector("textarea", timeout=load_timeout_s * 1000)
        wait_runs_after(page, None, load_timeout_s * 1000)
        landed = page.url
        # nothing typed: the prompt box starts with a real prompt, so the first Step of a fresh page draws a tree
        prompt = page.get_by_label("Prompt", exact=True).input_value()
        try:
            for _ in range(2):
                _press(page, "Step")
        except Exception:
            page.screenshot(path=str(out_dir / "failure.png"), full_page=True)
            raise
        page.wait_for_selector(".js-plotly-plot", timeout=60_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(out_dir / "step2_full.png"), full_page=True)
        charts = page.locator(".js-plotly-plot")
        charts.nth(0).screenshot(path=str(out_dir / "step2_tree.png"))
        charts.nth(1).screenshot(path=str(out_dir / "step2_mask.png"))
        if charts.count() >= 4:
            charts.nth(3).screenshot(path=str(out_dir / "step2_stop.png"))
        report = {
            "url": landed,
            "prompt": prompt,
            "plots": charts.count(),
            "errors": page.locator("[data-testid='stAlertContentError']").all_inner_texts(),
            "exceptions": page.locator("[data-testid='stException']").count(),
            "titles": page.locator(".js-plotly-plot .gtitle").all_text_contents(),
            "metrics": page.locator("[data-testid='stMetric']").all_inner_texts(),
            "what_if": [t for t in page.locator("[data-testid='stCaptionContainer']").all_inner_texts()
                        if t.startswith("With ")],
            "cut": page.evaluate(CUT_TEXT),  # a button, metric, label or selectbox value cut short
        }
        browser.close()
    return report


def _open(browser, url: str, prompt: str, load_timeout_s: float, page=None):
    """Load the app in ``page`` (default: a new page of ``browser``), type ``prompt`` and wait for the rerun."""
    page = page or browser.new_page(viewport={"width": 1600, "height": 1400}, accept_downloads=True)
    page.goto(url)
    page.wait_for_selector("textarea", timeout=load_timeout_s * 1000)
    wait_runs_after(page, None, load_timeout_s * 1000)
    page.get_by_label("Prompt", exact=True).fill(prompt)
    rerun(page, lambda: page.keyboard.press("Control+Enter"), 60_000)
    return page


def _press(page, name: str, timeout_ms: int = 300_000, attempts: int = 3) -> None:
    """Click the button ``name`` and wait for the script run it starts. A click that lands while the page is
    still settling (an expander opening, a chart drawing) can be lost: when no run starts or finishes within 20 s,
    click again."""
    button = page.get_by_role("button", name=name, exact=True)
    watch = _watch(page)
    for _ in range(attempts):
        before, started = watch.finished, watch.started
        button.click(timeout=120_000)
        if not _wait(page, lambda b=before, s=started: watch.started != s or watch.finished != b, 20_000):
            continue  # nothing started: the click was lost
        wait_runs_after(page, before, timeout_ms)
        return
    raise AssertionError(f"pressing {name!r} started no script run in {attempts} clicks")


def slider_key(page, label: str, key: str, attempts: int = 5) -> str:
    """Press ``key`` on the slider ``label`` until its value changes (a key that lands while the previous rerun
    redraws the slider is lost), then wait for the rerun the change starts. Returns the new value."""
    from playwright.sync_api import expect

    thumb = page.locator(f"input[type='range'][aria-label='{label}']")
    old = thumb.get_attribute("aria-valuetext")
    for _ in range(attempts):
        before = runs(page)
        thumb.press(key)
        try:
            expect(thumb).not_to_have_attribute("aria-valuetext", old, timeout=3000)
        except AssertionError:  # the key was lost: press it again
            continue
        wait_runs_after(page, before, 60_000)
        return thumb.get_attribute("aria-valuetext")
    raise AssertionError(f"the slider {label!r} did not move on {key} after {attempts} presses")


def _shows(page, selector: str, timeout_ms: int = 60_000) -> bool:
    """Wait until ``selector`` is on the page and no script run is in progress; False if it never came (the
    caller's assertion then says what was missing)."""
    try:
        page.wait_for_selector(selector, timeout=timeout_ms)
    except Exception:  # playwright's TimeoutError
        return False
    wait_idle(page, timeout_ms)
    return True


def _step_caption(page) -> str:
    texts = page.locator("[data-testid='stMarkdownContainer'] p").all_inner_texts()
    return next((t for t in texts if t.startswith("Step ") and " of " in t.split("·")[0]), "")


@contextlib.contextmanager
def _app_page(url: str, out_dir: Path, prompt: str, load_timeout_s: float, report: dict):
    """A new chromium page on the app with ``prompt`` typed (``_open``). A failure inside saves
    ``out_dir/failure.png`` and re-raises; at the end ``report`` gets the page's exception count and error texts."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = _open(browser, url, prompt, load_timeout_s)
        try:
            yield page
        except Exception:
            page.screenshot(path=str(out_dir / "failure.png"), full_page=True)
            raise
        report["exceptions"] = page.locator("[data-testid='stException']").count()
        report["errors"] = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
        browser.close()


def tour(url: str, out_dir: Path, load_timeout_s: float = 600) -> dict:
    """Step three times, go Back, click a tree node (inspector), download the trace, Reset, load the trace
    again and replay it with Forward. Screenshots at each stage; returns what the page showed."""
    report: dict = {}
    with _app_page(url, out_dir, "def fibonacci(n):", load_timeout_s, report) as page:
        for _ in range(3):
            _press(page, "Step")
        report["after_steps"] = _step_caption(page)
        _press(page, "Back")
        report["after_back"] = _step_caption(page)
        report["back_fragment"] = last_run_was_fragment(page)  # the step view alone reran, not the app
        page.screenshot(path=str(out_dir / "back_full.png"), full_page=True)
        # click a drafted node of the tree (the second marker of the first node trace after the anchor)
        tree = page.locator(".js-plotly-plot").first
        points = tree.locator(".scatterlayer .trace .points path")
        report["tree_points"] = points.count()
        box = points.nth(min(2, points.count() - 1)).bounding_box()
        rerun(page, lambda: page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2), 60_000)
        report["click_fragment"] = last_run_was_fragment(page)
        heads = page.locator("h4").all_inner_texts()
        report["inspector"] = [h for h in heads if h.startswith("Node inspector")]
        page.screenshot(path=str(out_dir / "inspector_full.png"), full_page=True)
        insp = page.locator("h4", has_text="Node inspector")
        if insp.count():
            insp.first.scroll_into_view_if_needed()
            page.screenshot(path=str(out_dir / "inspector_view.png"))
        with page.expect_download() as dl:
            page.get_by_role("button", name="Download trace").click()
        trace_path = out_dir / "trace.json"
        dl.value.save_as(trace_path)
        report["downloaded"] = trace_path.stat().st_size
        _press(page, "Reset")
        report["after_reset"] = _step_caption(page)
        page.get_by_text("Save and replay").click()
        rerun(page, lambda: page.locator("input[type='file']").first.set_input_files(str(trace_path)), 60_000)
        # replacing an uploaded file may take more than one script run: wait for what this one must show
        _shows(page, "[data-testid='stAlertContentInfo']:has-text('Replaying')")
        report["replay_info"] = [t for t in page.locator("[data-testid='stAlertContentInfo']").all_inner_texts()
                                 if t.startswith("Replaying")]
        report["replay_first"] = _step_caption(page)
        _press(page, "Forward")
        report["replay_forward"] = _step_caption(page)
        report["step_disabled"] = page.get_by_role("button", name="Step", exact=True).is_disabled()
        page.screenshot(path=str(out_dir / "replay_full.png"), full_page=True)
        bad = out_dir / "bad.json"
        bad.write_text('{"schema_version": 99, "steps": []}')
        rerun(page, lambda: page.locator("input[type='file']").first.set_input_files(str(bad)), 60_000)
        _shows(page, "[data-testid='stAlertContentError']")
        report["bad_upload"] = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
    return report


def run_and_stop(url: str, out_dir: Path, wait_s: float = 3.0, load_timeout_s: float = 600,
                 keys=("End",)) -> dict:
    """Max new tokens up (the slider's keys: End = 512), Run to end, Stop ``wait_s`` after the first step is in:
    what the page says."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = _open(browser, url, "Write a long story about a dragon.", load_timeout_s)
        for key in keys:
            slider_key(page, "Max new tokens", key)
        page.get_by_role("button", name="Run to end", exact=True).click()
        page.wait_for_selector("[data-testid='stProgress']", timeout=120_000)
        # the bar's text counts tokens once the first step is in ("12/400 tokens"): Stop then has a run to interrupt
        page.wait_for_function("""() => [...document.querySelectorAll("[data-testid='stProgress']")]
                                      .some(e => /^[1-9][0-9]*\\/[0-9]+ tokens/.test(e.innerText.trim()))""",
                               timeout=120_000)
        page.wait_for_timeout(wait_s * 1000)
        _press(page, "Stop")
        report = {"info": page.locator("[data-testid='stAlertContentInfo']").all_inner_texts(),
                  "success": page.locator("[data-testid='stAlertContentSuccess']").all_inner_texts(),
                  "caption": _step_caption(page),
                  "exceptions": page.locator("[data-testid='stException']").count()}
        page.screenshot(path=str(out_dir / "stopped.png"), full_page=True)
        _press(page, "Step")  # the stopped run goes on
        report["after_step"] = _step_caption(page)
        browser.close()
    return report


def two_sessions(url: str, out_dir: Path, prompts=("def add(a, b):", "The capital of France is"),
                 steps: int = 2, load_timeout_s: float = 600) -> list[Path]:
    """Two browser sessions (separate contexts) on one server, pressing Step at the same moment each time;
    returns each session's downloaded trace."""

    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        pages = []
        for prompt in prompts:
            ctx = browser.new_context(viewport={"width": 1400, "height": 1200}, accept_downloads=True)
            pages.append(_open(browser, url, prompt, load_timeout_s, page=ctx.new_page()))  # own session
        for _ in range(steps):
            # both clicks go out before either rerun finishes: the server runs the two sessions concurrently
            before = [runs(page) for page in pages]
            for page in pages:
                page.get_by_role("button", name="Step", exact=True).click(no_wait_after=True)
            for page, n in zip(pages, before):
                wait_runs_after(page, n, 300_000)
        for i, page in enumerate(pages):
            page.screenshot(path=str(out_dir / f"session{i}.png"), full_page=True)
            with page.expect_download() as dl:
                page.get_by_role("button", name="Download trace").click()
            path = out_dir / f"session{i}.json"
            dl.value.save_as(path)
            paths.append(path)
        browser.close()
    return paths


def choose(page, label: str, option: str) -> None:
    """Pick ``option`` in the Streamlit selectbox labelled ``label`` and wait for the rerun it starts."""
    box = page.locator("[data-testid='stSelectbox']", has_text=label).first
    box.locator("input").first.click()
    page.keyboard.press("ArrowDown")  # a click may only focus the field: the arrow key opens the list
    rerun(page, lambda: page.get_by_role("option", name=option, exact=True).click(), 60_000)


def click_source_node(page, source_label: str) -> bool:
    """Click the first marker of the tree's trace named ``source_label`` (the tree coloured by draft source);
    False when the tree has no such trace."""
    tree = page.locator(".js-plotly-plot").first
    index = tree.evaluate(f"el => el.data.findIndex(t => t.name === {source_label!r})")
    if index < 0:
        return False
    # scatter traces are drawn in data order, one <g class='trace'> each
    point = tree.locator(".scatterlayer .trace").nth(index).locator(".points path").first
    box = point.bounding_box()
    rerun(page, lambda: page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2), 60_000)
    return True


FREE_PROMPT = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + "


def free_drafts_tour(url: str, out_dir: Path, method: str = "Token Recycling (free)", steps: int = 2,
                     source: str = "token recycling", prompt: str = FREE_PROMPT,
                     load_timeout_s: float = 600) -> dict:
    """Pick a free-drafting method, Step, colour the tree by draft source, click a free node (the inspector says
    where it came from) and open the matrix row panel. Screenshots; returns what the page showed."""
    report: dict = {}
    with _app_page(url, out_dir, prompt, load_timeout_s, report) as page:
        choose(page, "Method", method)
        for _ in range(steps):
            _press(page, "Step")
        # the colouring radio shows on steps with free nodes: go back to the latest such step
        radio = page.get_by_text("draft source", exact=True)
        for _ in range(steps - 1):
            if radio.count():
                break
            _press(page, "Back")
        report["step"] = _step_caption(page)
        rerun(page, lambda: radio.click(), 60_000)
        report["legend"] = page.locator(".js-plotly-plot").first.locator(".legendtext").all_text_contents()
        report["clicked"] = click_source_node(page, source)
        report["inspector"] = page.locator("h4", has_text="Node inspector").all_inner_texts()
        report["provenance"] = [t for t in page.locator("[data-testid='stMarkdownContainer'] p").all_inner_texts()
                                if "(a free draft" in t]
        matrix = page.get_by_text("Token Recycling: the matrix row", exact=False)
        report["matrix_panel"] = matrix.count() > 0
        if report["matrix_panel"]:  # an expander opens in the browser: no script run
            matrix.first.click()
            _shows(page, "[data-testid='stExpander'] [data-testid='stDataFrame']")
        report["matrix_rows"] = page.locator("[data-testid='stExpander'] [data-testid='stDataFrame']").count()
        page.screenshot(path=str(out_dir / "free_full.png"), full_page=True)
        page.locator(".js-plotly-plot").first.screenshot(path=str(out_dir / "free_tree.png"))
        insp = page.locator("h4", has_text="Node inspector")
        if insp.count():
            insp.first.scroll_into_view_if_needed()
            page.screenshot(path=str(out_dir / "free_inspector.png"))
    return report


def _expander(page, title: str):
    """Open the expander whose summary starts with ``title`` (client side: no script run) and return it."""
    box = page.locator("[data-testid='stExpander']", has_text=title).first
    if box.locator("details").first.get_attribute("open") is None:
        box.locator("summary").first.click()
    box.locator("summary").first.scroll_into_view_if_needed()
    return box


def instruments_tour(url: str, out_dir: Path, steps: int = 6, prompt: str = "def fibonacci(n):",
                     method: str = "MCSD (draft tree, one target pass)", load_timeout_s: float = 600) -> dict:
    """The instruments' three panels: Step, probe the step (tree forward against plain decoding), open expected
    against realised acceptance, measure forward costs, open the optimal tree and run mcsd with it. Screenshots
    of each panel; returns what the page showed."""
    report: dict = {}
    with _app_page(url, out_dir, prompt, load_timeout_s, report) as page:
        choose(page, "Method", method)  # a full tree: every (depth, rank) slot gets measured
        for _ in range(steps):
            _press(page, "Step")
        _expander(page, "Tree-attention probe")
        _press(page, "Probe this step", 600_000)
        probe = _expander(page, "Tree-attention probe")
        report["probe_metrics"] = probe.locator("[data-testid='stMetric']").all_inner_texts()
        report["probe_plot"] = probe.locator(".js-plotly-plot").count()
        probe.screenshot(path=str(out_dir / "probe_panel.png"))
        report["flip_marks"] = page.locator(".js-plotly-plot").first.locator(".legendtext").all_text_contents()
        page.locator(".js-plotly-plot").first.screenshot(path=str(out_dir / "probe_tree.png"))
        acc = _expander(page, "Expected against realised acceptance")
        report["acceptance_metrics"] = acc.locator("[data-testid='stMetric']").all_inner_texts()
        report["acceptance_plots_before_costs"] = acc.locator(".js-plotly-plot").count()
        _press(page, "Measure forward costs on this machine", 600_000)
        acc = _expander(page, "Expected against realised acceptance")
        report["acceptance_plots"] = acc.locator(".js-plotly-plot").count()
        report["acceptance_titles"] = acc.locator(".gtitle").all_text_contents()
        acc.screenshot(path=str(out_dir / "acceptance_panel.png"))
        opt = _expander(page, "The optimal tree for this run")
        report["optimal_text"] = [t for t in opt.locator("[data-testid='stMarkdownContainer'] p").all_inner_texts()
                                  if "Optimal for" in t]
        report["optimal_titles"] = opt.locator(".gtitle").all_text_contents()
        opt.screenshot(path=str(out_dir / "optimal_panel.png"))
        report["template"] = opt.locator("code").first.inner_text()
        _press(page, "Run mcsd with the optimal tree", 600_000)
        _shows(page, "[data-testid='stAlertContentSuccess']", 600_000)
        report["after_run"] = _step_caption(page)
        report["sidebar_template"] = page.locator("[data-testid='stTextInput']", has_text="Tree template").locator(
            "input").first.input_value()
        report["finished"] = page.locator("[data-testid='stAlertContentSuccess']").all_inner_texts()
        page.locator(".js-plotly-plot").first.screenshot(path=str(out_dir / "optimal_run_tree.png"))
    return report


def what_if_tour(url: str, out_dir: Path, steps: int = 3, prompt: str = "def fibonacci(n):",
                 method: str = "MCSD (draft tree, one target pass)", load_timeout_s: float = 600) -> dict:
    """Counterfactuals: Step, re-verify the step as recorded (identical), replace its first drafted token with the
    target's best and re-verify (both trees side by side), continue from the edit as a new run, switch back to the
    original, and open the step's timeline. Screenshots; returns what the page showed."""
    report: dict = {}
    with _app_page(url, out_dir, prompt, load_timeout_s, report) as page:
        choose(page, "Method", method)
        for _ in range(steps):
            _press(page, "Step")
        box = _expander(page, "What if: edit this step")
        rerun(page, lambda: box.get_by_text("nothing: re-verify as recorded").click(), 60_000)
        _press(page, "Re-verify this step", 600_000)
        box = _expander(page, "What if: edit this step")
        report["identical"] = box.locator("[data-testid='stAlertContentSuccess']").all_inner_texts()
        rerun(page, lambda: box.get_by_text("replace a drafted token").click(), 60_000)
        _press(page, "Re-verify this step", 600_000)
        box = _expander(page, "What if: edit this step")
        report["changes"] = [t for t in box.locator("[data-testid='stMarkdownContainer']").all_inner_texts()
                             if t.startswith("What changed")]
        report["trees"] = box.locator(".js-plotly-plot .gtitle").all_text_contents()
        box.screenshot(path=str(out_dir / "what_if_panel.png"))
        _press(page, "Continue from the edit as a new run", 600_000)
        _shows(page, "[data-testid='stSelectbox']:has-text('Run of this session')")
        runs = page.locator("[data-testid='stSelectbox']", has_text="Run of this session")
        report["run_choice"] = runs.inner_text()
        report["after_branch"] = _step_caption(page)
        choose(page, "Run of this session", "run 1 (as recorded)")
        report["after_switch"] = _step_caption(page)
        tl = _expander(page, "The step's timeline")
        report["timeline_titles"] = tl.locator(".gtitle").all_text_contents()
        report["timeline_caption"] = [t for t in tl.locator("[data-testid='stCaptionContainer']").all_inner_texts()
                                      if "Their sum" in t]
        tl.screenshot(path=str(out_dir / "timeline_panel.png"))
        cal = _expander(page, "Stop-signal calibration")
        report["calibration_titles"] = cal.locator(".gtitle").all_text_contents()
        report["calibration_metrics"] = cal.locator("[data-testid='stMetric']").all_inner_texts()
        cal.screenshot(path=str(out_dir / "calibration_panel.png"))
    return report


def adaptation_tour(url: str, out_dir: Path, steps: int = 8, prompt: str = "def fibonacci(n):",
                    mode: str = "decision model's last layer", load_timeout_s: float = 600,
                    carried_steps: int = 3) -> dict:
    """Online adaptation: switch it on (the default method, mcsd-improved), step, and screenshot the chart of
    the adapting stop policy over the run; then Reset and step again: the second run starts from what the first
    learned, and its caption says so (``adaptation_carried.png``). Returns what the page showed."""
    report: dict = {}
    with _app_page(url, out_dir, prompt, load_timeout_s, report) as page:
        choose(page, "Online adaptation", mode)
        for _ in range(steps):
            _press(page, "Step")
        chart = page.locator(".js-plotly-plot", has_text="Stop-policy adaptation")
        report["charts"] = chart.count()
        if chart.count():
            chart.first.scroll_into_view_if_needed()
            report["legend"] = chart.first.locator(".legendtext").all_text_contents()
            report["title"] = chart.first.locator(".gtitle").all_text_contents()
            chart.first.screenshot(path=str(out_dir / "adaptation_chart.png"))
            page.screenshot(path=str(out_dir / "adaptation_view.png"))
        report["captions"] = [t for t in page.locator("[data-testid='stCaptionContainer']").all_inner_texts()
                              if "labelled" in t]
        report["after_steps"] = _step_caption(page)
        if carried_steps:
            report["carried_captions"] = _carried_run(page, out_dir, carried_steps)
    return report


def _carried_run(page, out_dir: Path, steps: int) -> list[str]:
    """Reset and step a new run; screenshot it where its adaptation caption says it started from the last run's
    (``adaptation_carried.png``). Returns those captions."""
    _press(page, "Reset")
    for _ in range(steps):
        _press(page, "Step")
    carried = page.locator("[data-testid='stCaptionContainer']", has_text="previous run of the method")
    if carried.count():
        carried.first.scroll_into_view_if_needed()
        page.screenshot(path=str(out_dir / "adaptation_carried.png"))
    return carried.all_inner_texts()


def fallback_tour(url: str, out_dir: Path, steps: int = 4, prompt: str = "def fibonacci(n):",
                  load_timeout_s: float = 600) -> dict:
    """The goodput fallback: switch it on (the default method), step four times and screenshot the fourth
    step, the rule's first plain decoding step (it measures speculation over 3 steps, then plain decoding once),
    with its caption. Returns what it showed."""
    report: dict = {}
    with _app_page(url, out_dir, prompt, load_timeout_s, report) as page:
        choose(page, "Fall back to plain decoding", "when slower")
        for _ in range(steps):
            _press(page, "Step")
        report["captions"] = [t for t in page.locator("[data-testid='stCaptionContainer']").all_inner_texts()
                              if t.startswith("Plain decoding step")]
        report["after_steps"] = _step_caption(page)
        page.screenshot(path=str(out_dir / "fallback_step.png"))
    return report


# The Classroom's lesson player: an iframe (ui/lesson_player.py; inside the component's shadow root, which
# Playwright's CSS selectors pierce) whose page says the phase on screen in window.shownPhase.
PLAYER_POS = """f => { const w = f.contentWindow;
  return w && w.shownPhase !== undefined
    ? f.dataset.src.split('/').pop().split('.')[0] + ':' + w.shownPhase : null; }"""
# Things a projector must show whole: no button, selectbox value, metric or label cut (scrollWidth > clientWidth).
CUT_TEXT = """() => [...document.querySelectorAll('button *, button, select, input[role=combobox], '
  + '[data-testid="stMetricLabel"] *, [data-testid="stMetricValue"] *, [data-testid="stWidgetLabel"] *')]
  .filter(e => e.offsetParent && e.scrollWidth > e.clientWidth)
  .map(e => (e.innerText || e.value || '').slice(0, 40))"""
# Words broken inside across two lines (a word's characters on two line boxes): buttons, metrics, widget labels,
# headings and captions, as a narrow column breaks "Reset" into "Res|et".
BROKEN_WORDS = """() => { const out = [];
  const sel = 'button, [data-testid="stMetricLabel"], [data-testid="stMetricValue"], [data-testid="stWidgetLabel"], '
    + 'h1, h2, h3, [data-testid="stCaptionContainer"], [data-testid="stExpander"] summary';
  for (const el of document.querySelectorAll(sel)) {
    const b = el.getBoundingClientRect();
    if (!el.offsetParent || b.right <= 0 || b.left >= innerWidth) continue;  // hidden, or in a closed sidebar
    const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) {
      for (const m of n.textContent.matchAll(/[^\\s-]+-?/g)) {  // a break after a hyphen is a line's end
        const r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        const tops = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
        if (tops.size > 1) out.push(m[0]);
      } } }
  return [...new Set(out)]; }"""
# What Plotly draws that a chart does not show whole or overprints, per chart (its title, or its index): a title,
# annotation or legend text reaching outside its SVG (cut there), tick labels of one axis that overlap, and tree node
# labels that overlap (more than 2 px each way).
CHART_FAULTS = """() => { const out = [];
  const hit = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 2
                        && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 2;
  const overlaps = (els) => { const bs = els.map(e => e.getBoundingClientRect()).filter(b => b.width > 0);
    for (let i = 0; i < bs.length; i++) for (let j = i + 1; j < bs.length; j++) if (hit(bs[i], bs[j])) return true;
    return false; };
  document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
    if (!plot.offsetParent) return;
    const svg = plot.querySelector('.main-svg'); if (!svg) return;
    const box = svg.getBoundingClientRect();
    const title = (plot.querySelector('.gtitle') || {}).textContent || `chart ${i}`;
    plot.querySelectorAll('.gtitle, .g-gtitle text, .annotation-text, .legendtext, .g-xtitle text, .g-ytitle text')
      .forEach(t => { const b = t.getBoundingClientRect();
        if (b.width > 0 && (b.left < box.left - 1 || b.right > box.right + 1))
          out.push(`${title.slice(0, 40)}: cut "${t.textContent.slice(0, 40)}"`); });
    for (const axis of ['xtick', 'ytick', 'x2tick', 'y2tick'])  // rotated labels: their boxes overlap, not they
      if (overlaps([...plot.querySelectorAll(`.${axis} text`)].filter(t => !/rotate\\(-?[1-9]/.test(
            t.getAttribute('transform') || ''))))
        out.push(`${title.slice(0, 40)}: ${axis} labels overprint`);
    if (overlaps([...plot.querySelectorAll('.scatterlayer .textpoint text')].filter(t => t.textContent.trim())))
      out.push(`${title.slice(0, 40)}: point labels overprint`);
    const xt = plot.querySelector('.g-xtitle text'), lg = plot.querySelector('.legend');
    if (xt && lg && hit(xt.getBoundingClientRect(), lg.getBoundingClientRect()))
      out.push(`${title.slice(0, 40)}: axis title under the legend`);
  });
  return out; }"""
# CUT_TEXT of what is on screen sideways (a closed sidebar is laid out off screen, its values cut or not)
CUT_SHOWN = CUT_TEXT.replace(".filter(e => e.offsetParent", ".filter(e => e.offsetParent"
                             " && e.getBoundingClientRect().right > 0 && e.getBoundingClientRect().left < innerWidth")
# The smallest rendered text in the charts (px): Plotly sets each label's font size on its SVG text element.
MIN_CHART_TEXT = """() => Math.min(...[...document.querySelectorAll('.js-plotly-plot text')]
  .filter(t => t.textContent.trim() && t.getBoundingClientRect().width > 0)
  .map(t => parseFloat(getComputedStyle(t).fontSize)))"""
# Where the player's tree, mask, account and Next button lie on the page (the iframe's offset added).
BOXES = """f => { const o = f.getBoundingClientRect(), d = f.contentDocument;
  return Object.fromEntries([['tree', '#tree'], ['mask', '#mask'], ['account', '#account'], ['controls', '#next']]
    .map(([k, sel]) => { const e = d.querySelector(sel); if (!e) return [k, null];
      const r = e.getBoundingClientRect(); return [k, [o.left + r.left, o.top + r.top, o.left + r.right,
                                                        o.top + r.bottom]]; })); }"""


def _sidebar(page, open_it: bool) -> None:
    """Open or close the sidebar (a phone starts with it closed; the Explorer's settings live there)."""
    shown = page.evaluate("() => { const s = document.querySelector('[data-testid=stSidebar]');"
                          " return !!s && s.getAttribute('aria-expanded') !== 'false'"
                          " && s.getBoundingClientRect().right > 0; }")
    if shown == open_it:
        return
    button = ("[data-testid='stExpandSidebarButton'], [data-testid='stSidebarCollapsedControl'] button" if open_it
              else "[data-testid='stSidebarCollapseButton'] button, [data-testid='stSidebarHeader'] button")
    page.locator(button).first.click()
    page.wait_for_timeout(600)  # the sidebar's slide


def whole_page_shot(page, path: Path) -> None:
    """A screenshot of the whole page: Streamlit scrolls its main section, not the document, so Playwright's
    ``full_page`` sees one screen; the viewport is made as tall as the section's content for the shot, then put
    back (only its height changes: the layout is the one measured)."""
    size = page.viewport_size
    tall = page.evaluate("() => { const m = document.querySelector('[data-testid=stMain]');"
                         " return m ? m.scrollHeight : document.body.scrollHeight; }")
    page.set_viewport_size({"width": size["width"], "height": max(size["height"], min(int(tall), 16000))})
    page.wait_for_timeout(800)
    page.screenshot(path=str(path))
    page.set_viewport_size(size)
    page.wait_for_timeout(300)


def layout_faults(page) -> dict:
    """What the page shows badly now: text cut (``CUT_TEXT``), words broken inside (``BROKEN_WORDS``) and charts'
    cut titles, overprinted ticks and labels (``CHART_FAULTS``)."""
    page.wait_for_timeout(800)  # Plotly lays out after the rerun
    return {"cut": page.evaluate(CUT_SHOWN), "broken": page.evaluate(BROKEN_WORDS),
            "charts": page.evaluate(CHART_FAULTS)}


def explorer_layout_tour(url: str, out_dir: Path, sizes=((1280, 720), (1366, 768), (1920, 1080), (390, 844)),
                         method: str | None = None, steps: int = 2, load_timeout_s: float = 600,
                         whole: bool = True, prompt: str | None = None) -> dict:
    """The Explorer at each screen size, in teach mode and out: ``method`` picked in the sidebar (its label; None
    keeps the default), ``prompt`` typed (None keeps the page's), Step ``steps`` times with the sidebar open (closed
    on a phone), then ``layout_faults`` and a screenshot (``explorer_<w>x<h>[_teach].png``, and with ``whole`` the
    whole page, ``..._whole.png``: tall pages make Plotly lay out again, seconds each), teach mode off and on. The
    desktop sizes share one session, its window resized as a user's would be (a step on the embedded pair costs
    seconds); a phone gets a session of its own (a touch screen). Returns ``{"<w>x<h>[ teach]": faults}`` with each
    session's exception count."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    desktops = [size for size in sizes if size[0] >= 700]
    sessions = ([desktops] if desktops else []) + [[size] for size in sizes if size[0] < 700]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        for shown in sessions:
            (width, height), phone = shown[0], shown[0][0] < 700
            page = browser.new_page(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
            try:
                page.goto(url)
                page.wait_for_selector("textarea", timeout=load_timeout_s * 1000)
                wait_runs_after(page, None, load_timeout_s * 1000)
                if method:
                    _sidebar(page, True)
                    choose(page, "Method", method)
                _sidebar(page, not phone)
                if prompt:
                    page.get_by_label("Prompt", exact=True).fill(prompt)
                    rerun(page, lambda p=page: p.keyboard.press("Control+Enter"), 60_000)
                for _ in range(steps):
                    _press(page, "Step")
                page.wait_for_selector(".js-plotly-plot", timeout=60_000)
                for teach in (False, True):
                    if teach:
                        _sidebar(page, True)
                        rerun(page, lambda p=page: p.get_by_text("Teach mode", exact=True).click(), 120_000)
                        _sidebar(page, not phone)
                    for width, height in shown:
                        if page.viewport_size != {"width": width, "height": height}:
                            page.set_viewport_size({"width": width, "height": height})
                            page.wait_for_timeout(700)  # the charts follow the new width
                        name = f"{width}x{height}" + ("_teach" if teach else "")
                        report[name.replace("_", " ")] = layout_faults(page)
                        page.screenshot(path=str(out_dir / f"explorer_{name}.png"))
                        if whole:
                            whole_page_shot(page, out_dir / f"explorer_{name}_whole.png")
                report[f"{shown[0][0]}x{shown[0][1]} exceptions"] = page.locator("[data-testid='stException']").count()
            except Exception:
                page.screenshot(path=str(out_dir / f"failure_{width}x{height}.png"), full_page=True)
                raise
            page.close()
        browser.close()
    return report


def player_pos(page) -> str | None:
    """``<lesson>:<phase>`` of the Classroom's player, or None before it shows one."""
    frame = page.locator("iframe")
    return frame.first.evaluate(PLAYER_POS) if frame.count() else None


def player_frame(page):
    """The player's page (a Playwright Frame), once it has drawn its first phase."""
    frame = page.locator("iframe").first.element_handle(timeout=120_000).content_frame()
    frame.wait_for_function("window.shownPhase !== undefined", timeout=120_000)
    return frame


def _player_moved(page, before, timeout_ms: int = 10_000) -> str | None:
    """Wait until the player's position differs from ``before``; the position then (``before`` at the timeout)."""
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
        now = player_pos(page)
        if now is not None and now != before:
            return now
        time.sleep(0.01)
    return before


def _player_key(page, key: str) -> str:
    before = player_pos(page)
    page.keyboard.press(key)
    return _player_moved(page, before)


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, s: /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def classroom_tour(url: str, out_dir: Path, pid: int | None = None, sizes=((1280, 720), (1920, 1080), (390, 844)),
                   bad_lesson: Path | None = None, presses: int = 30) -> dict:
    """The Classroom as a projector and a phone show it: for each screen size open ``?page=classroom`` in a new
    session (the sidebar collapsed) and time the lesson's opening; press Right ``presses`` times, counting the
    websocket frames and (with ``pid``) the server's CPU seconds they cost; check that the player's tree, mask,
    account and controls lie inside the viewport (the phone: the tree and the account on the first screen), that no
    text is cut, and the charts' smallest text; Page Down / Page Up / Left; Play at 0.5 s a phase, then any key
    stops it. At the first size: pick every lesson with the mouse and press Right at once (the keys reach the
    player), and a malformed lesson file gets a message. Screenshots in ``out_dir``."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for width, height in sizes:
            r: dict = {}
            report[f"{width}x{height}"] = r
            phone = width < 700
            page = browser.new_page(viewport={"width": width, "height": height}, is_mobile=phone, has_touch=phone)
            errors: list[str] = []
            frames: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            page.on("websocket", lambda ws, frames=frames: (
                ws.on("framesent", lambda f: frames.append("sent")),
                ws.on("framereceived", lambda f: frames.append("received"))))
            t0 = time.monotonic()
            page.goto(url + "/?page=classroom")
            frame = player_frame(page)
            frame.wait_for_selector("#tree .main-svg", timeout=60_000)
            page.wait_for_selector(IDLE, timeout=120_000)
            r["open_s"] = round(time.monotonic() - t0, 2)
            r["sidebar_collapsed"] = page.evaluate(
                "() => { const s = document.querySelector('[data-testid=stSidebar]');"
                " return !s || s.getAttribute('aria-expanded') === 'false' || s.getBoundingClientRect().right <= 0; }")
            time.sleep(1.0)  # the last of the page's own messages
            sent, cpu0 = len(frames), cpu_s(pid) if pid else None
            start = player_pos(page)
            r["positions"] = [start] + [_player_key(page, "ArrowRight") for _ in range(presses)]
            time.sleep(1.0)
            r["press_frames"] = len(frames) - sent
            r["press_cpu_s"] = round(cpu_s(pid) - cpu0, 3) if pid else None
            r["where"] = page.locator(".where").inner_text()  # the component heard the player's position
            for _ in range(presses - 3):
                page.keyboard.press("ArrowLeft")
            r["positions_back"] = player_pos(page)
            time.sleep(0.5)  # let Plotly finish laying out
            r["boxes"], r["viewport"] = page.locator("iframe").first.evaluate(BOXES), [width, height]
            r["cut"] = page.evaluate(CUT_TEXT) + frame.evaluate(CUT_TEXT)
            r["min_chart_px"] = frame.evaluate(MIN_CHART_TEXT)
            page.screenshot(path=str(out_dir / f"classroom_{width}x{height}.png"))
            r["page_down"] = _player_key(page, "PageDown")
            r["page_up"] = _player_key(page, "PageUp")
            r["left"] = _player_key(page, "ArrowLeft")
            if not phone:  # Play at 0.5 s a phase advances on its own; any other key stops it
                frame.select_option("#pace", "0.5")
                before = player_pos(page)
                frame.click("#play")
                time.sleep(1.8)
                r["played"] = [before, player_pos(page)]
                page.keyboard.press("b")  # a clicker's "blank screen" key, or any other
                stopped = player_pos(page)
                time.sleep(1.2)
                r["stopped"] = [stopped, player_pos(page)]
            if (width, height) == sizes[0]:
                r["lessons"], r["after_pick"] = {}, {}
                page.locator(".st-key-cls_lesson input[role=combobox]").click()
                count = len(page.get_by_role("option").all())
                page.keyboard.press("Escape")
                for i in list(range(1, count)) + [0]:  # each pick with the mouse, then the clicker's key
                    page.locator(".st-key-cls_lesson input[role=combobox]").click()
                    option = page.get_by_role("option").nth(i)
                    name = option.inner_text()
                    before = player_pos(page)
                    t0 = time.monotonic()
                    option.click()
                    _player_moved(page, before, 60_000)
                    player_frame(page).wait_for_selector("#tree .main-svg", timeout=60_000)
                    r["lessons"][name] = round(time.monotonic() - t0, 2)
                    page.wait_for_selector(IDLE)
                    time.sleep(0.3)
                    r["after_pick"][name] = _player_key(page, "ArrowRight")
                if bad_lesson is not None:
                    page.get_by_text("Open a lesson file").click()
                    page.locator(".st-key-cls_upload input[type=file]").set_input_files(str(bad_lesson))
                    page.wait_for_selector("[data-testid=stAlert]:has-text('Cannot load')", timeout=30_000)
                    r["bad_lesson"] = page.locator("[data-testid=stAlert]").all_inner_texts()
                    r["after_bad_lesson"] = player_pos(page)
            r["page_errors"] = errors
            page.close()
        browser.close()
    return report


def memory_mb(pid: int) -> dict:
    """The process's resident memory now and its peak (``VmRSS`` / ``VmHWM`` of /proc, MB)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[v].split()[0]) / 1024 for k, v in (("rss", "VmRSS"), ("peak", "VmHWM"))}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def whole_class(url: str, out_dir: Path, pid: int, students: int = 10, rounds: int = 4,
                prompts=("def add(a, b):", "The capital of France is", "import numpy as np", "for i in range(",
                         "Once upon a time")) -> dict:
    """``students`` browser sessions on one server at once: half replay a lesson on the Classroom page and press
    Right together, half step live runs (one prompt each) on the Explorer page and press Step together, ``rounds``
    times. Latency of each action (a phase: the player's key press to the phase drawn; a step: the click to the page
    showing its result; ms), the server's memory after each round,
    and every live session's downloaded trace (to compare with the same steps run alone)."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"step_ms": [], "phase_ms": [], "memory": [], "positions": [], "errors": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        classroom, live = [], []
        for i in range(students):
            page = browser.new_context(viewport={"width": 1280, "height": 720}, accept_downloads=True).new_page()
            page.on("pageerror", lambda e: report["errors"].append(str(e)))
            if i % 2 == 0:
                page.goto(url + "/?page=classroom")
                player_frame(page).wait_for_selector("#tree .main-svg", timeout=120_000)
                page.wait_for_selector(IDLE, timeout=120_000)
                classroom.append(page)
            else:
                live.append(_open(browser, url, prompts[len(live) % len(prompts)], 120, page=page))
        report["memory"].append(memory_mb(pid))
        for _ in range(rounds):
            pending = []
            for page in classroom:
                pending.append(("phase", page, player_pos(page), time.monotonic()))
                page.keyboard.press("ArrowRight")
            for page in live:
                pending.append(("step", page, runs(page), time.monotonic()))
                page.get_by_role("button", name="Step", exact=True).click(no_wait_after=True)
            deadline = time.monotonic() + 300
            while pending and time.monotonic() < deadline:
                for item in list(pending):
                    kind, page, before, t0 = item
                    now = player_pos(page) if kind == "phase" else runs(page)
                    idle = page.evaluate("() => document.querySelector(\"[data-testid='stApp']\")"
                                         "?.getAttribute('data-test-script-state') === 'notRunning'")
                    if now != before and idle:
                        # a phase: the player's own time from the key press to the phase drawn (this loop polls
                        # ten pages in turn and would add its own waits); a live step: click to result shown
                        report[f"{kind}_ms"].append(
                            page.locator("iframe").first.evaluate("f => f.contentWindow.lastKeyMs")
                            if kind == "phase" else (time.monotonic() - t0) * 1e3)
                        pending.remove(item)
                time.sleep(0.02)
            report["memory"].append(memory_mb(pid))
        report["positions"] = [player_pos(page) for page in classroom]
        report["traces"] = []
        for i, page in enumerate(live):
            with page.expect_download() as dl:
                page.get_by_role("button", name="Download trace").click()
            path = out_dir / f"student{i}.json"
            dl.value.save_as(path)
            report["traces"].append(str(path))
        browser.close()
    for kind in ("step_ms", "phase_ms"):
        values = report[kind]
        report[kind.replace("_ms", "")] = {"n": len(values), "p50_ms": round(_percentile(values, 0.5)),
                                           "p95_ms": round(_percentile(values, 0.95))} if values else {}
    return report


# CUT_TEXT within the main block only (the sidebar is the Explorer's, drawn off-screen on a phone); the file
# uploader's "add icon" ligature is a material icon's name, clipped on purpose
CUT_MAIN = CUT_TEXT.replace(".filter(e => e.offsetParent",
                            ".filter(e => e.closest('[data-testid=stMain]') && e.offsetParent")


def forensics_tour(url: str, out_dir: Path, traces: list[Path], bad_files: tuple[Path, Path],
                   sizes=((1280, 720), (1920, 1080), (390, 844))) -> dict:
    """The Forensics page: run MT-bench's first five, keep it as A, read ``traces`` (the same prompts under other
    settings) plus ``bad_files[0]`` (not a trace) as B, then offer ``bad_files[1]`` (not a forensics.json) as A.
    A full-page screenshot at each of ``sizes`` (``forensics_WxH.png``). Returns what the page showed."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    r: dict = {"sizes": {}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": sizes[0][0], "height": sizes[0][1]})
        page.goto(url.rstrip("/") + "/?page=forensics")
        wait_runs_after(page, None, 300_000)
        try:
            choose(page, "Set", "MT-bench, first 5")
            _press(page, "Run")
            page.wait_for_selector(".js-plotly-plot .gtitle", timeout=60_000)
            r["charts_a"] = page.locator(".js-plotly-plot").count()
            r["summary_a"] = page.locator("[data-testid='stMarkdownContainer'] p", has_text="tested drafted").first \
                .inner_text()
            _press(page, "Keep this report as A")
            r["kept"] = page.locator("[data-testid='stAlertContentInfo']", has_text="This report is A").count()
            rerun(page, lambda: page.get_by_text("Saved traces", exact=True).click(), 60_000)
            rerun(page, lambda: page.locator(".st-key-fo_traces input[type=file]").set_input_files(
                [str(t) for t in traces] + [str(bad_files[0])]), 60_000)
            _press(page, "Read traces")
            page.wait_for_selector(".js-plotly-plot .gtitle:has-text('B against A')", timeout=60_000)
            r["warnings"] = page.locator("[data-testid='stAlertContentWarning']").all_inner_texts()
            r["compare"] = page.locator("[data-testid='stMarkdownContainer'] p", has_text="prompts in both").first \
                .inner_text()
            r["titles"] = page.locator(".js-plotly-plot .gtitle").all_text_contents()
            for w, h in sizes:
                # Streamlit scrolls its main block, not the page: a tall window shows the whole page at this width
                page.set_viewport_size({"width": w, "height": 6000})
                page.wait_for_timeout(1500)  # the charts follow the new width
                page.screenshot(path=str(out_dir / f"forensics_{w}x{h}_whole.png"))
                page.set_viewport_size({"width": w, "height": h})
                page.wait_for_timeout(1500)
                for name, title in (("charts", "Acceptance by token class"), ("diff", "B against A")):
                    page.locator(f".js-plotly-plot:has(.gtitle:has-text('{title}'))").scroll_into_view_if_needed()
                    page.wait_for_timeout(300)
                    page.screenshot(path=str(out_dir / f"forensics_{w}x{h}_{name}.png"))
                r["sizes"][f"{w}x{h}"] = {
                    "overflow": page.evaluate("document.documentElement.scrollWidth > window.innerWidth"),
                    "cut": [t for t in page.evaluate(CUT_MAIN) if t != "add icon"]}
            page.set_viewport_size({"width": sizes[0][0], "height": sizes[0][1]})
            rerun(page, lambda: page.locator(".st-key-fo_a_file input[type=file]").set_input_files(
                str(bad_files[1])), 60_000)
            _press(page, "Use as A")
            _shows(page, "[data-testid='stAlertContentError']")
            r["bad_a"] = page.locator("[data-testid='stAlertContentError']").all_inner_texts()
            r["still_compared"] = page.locator(".js-plotly-plot .gtitle:has-text('B against A')").count()
        except Exception:
            page.screenshot(path=str(out_dir / "failure.png"), full_page=True)
            raise
        r["exceptions"] = page.locator("[data-testid='stException']").count()
        browser.close()
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="default", choices=["default", "tiny"])
    ap.add_argument("--out", default=str(ROOT / "out" / "screens"))
    ap.add_argument("--tour", action="store_true", help="also: back, inspector, download, replay, two sessions")
    ap.add_argument("--free", action="store_true", help="also: a Token Recycling tree with a node's provenance")
    ap.add_argument("--instruments", action="store_true", help="also: probe, acceptance and optimal tree panels")
    ap.add_argument("--what-if", action="store_true", help="also: a what-if edit, a new run from it, the timeline")
    ap.add_argument("--adaptation", action="store_true", help="also: online adaptation switched on, its chart")
    ap.add_argument("--fallback", action="store_true", help="also: the goodput fallback's plain decoding step")
    ap.add_argument("--classroom", action="store_true", help="only the Classroom at 1280x720 and 1920x1080")
    ap.add_argument("--layout", metavar="METHOD", nargs="?", const="",
                    help="only the Explorer's layout at four sizes, teach mode off and on (a method label to pick)")
    ap.add_argument("--whole-class", type=int, metavar="N", help="only: N sessions at once (lessons and live steps)")
    args = ap.parse_args()
    if args.classroom:
        with running_app(args.pair) as url:
            print(classroom_tour(url, Path(args.out) / "classroom"))
        return 0
    if args.layout is not None:
        with running_app(args.pair) as url:
            print(explorer_layout_tour(url, Path(args.out) / "layout", method=args.layout or None))
        return 0
    if args.whole_class:
        procs: list = []
        with running_app(args.pair, procs=procs) as url:
            r = whole_class(url, Path(args.out) / "class", procs[0].pid, students=args.whole_class)
        print({k: v for k, v in r.items() if k not in ("step_ms", "phase_ms")})
        return 0
    with running_app(args.pair) as url:
        report = step_twice(url, Path(args.out))
        print(report)
        if args.tour:
            print(tour(url, Path(args.out) / "tour"))
            print(run_and_stop(url, Path(args.out) / "stop"))
            print([str(p) for p in two_sessions(url, Path(args.out) / "sessions")])
        if args.free:
            print(free_drafts_tour(url, Path(args.out) / "free"))
        if args.instruments:
            print(instruments_tour(url, Path(args.out) / "instruments"))
        if args.what_if:
            print(what_if_tour(url, Path(args.out) / "what_if"))
        if args.adaptation:
            print(adaptation_tour(url, Path(args.out) / "adaptation"))
        if args.fallback:
            print(fallback_tour(url, Path(args.out) / "fallback"))
    return 0 if report["plots"] >= 2 and not report["errors"] and not report["exceptions"] else 1


if __name__ == "__main__":
    sys.exit(main())


def play_exported(path: Path, presses: int = 30, viewport=(1280, 720), out_dir: Path | None = None) -> dict:
    """Open an exported lesson (``lessons export``) from disk with every request that is not the file itself
    aborted and counted, press Right ``presses`` times, and tap the right edge once at phone widths. Returns
    ``{"requests": [...], "phases": [phase index after each press], "draw_ms": [...], "open_s", "tap"}``."""
    from playwright.sync_api import sync_playwright

    url, report = path.resolve().as_uri(), {"requests": []}

    def route(r):
        if r.request.url == url:
            r.continue_()
        else:
            report["requests"].append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        page.route("**/*", route)
        t0 = time.monotonic()
        page.goto(url)
        page.wait_for_function("window.shownPhase === 0")
        report["open_s"] = time.monotonic() - t0
        report["phases"], report["draw_ms"] = [], []
        for _ in range(presses):
            page.keyboard.press("ArrowRight")
            shown, ms = page.evaluate("[window.shownPhase, window.lastDrawMs]")
            report["phases"].append(shown)
            report["draw_ms"].append(ms)
        if viewport[0] <= 700:  # a phone: a tap on the right edge goes forward
            before = page.evaluate("window.shownPhase")
            page.mouse.click(viewport[0] - 10, viewport[1] // 2)
            report["tap"] = page.evaluate("window.shownPhase") - before
        if out_dir is not None:
            page.screenshot(path=str(out_dir / f"player-{viewport[0]}x{viewport[1]}.png"))
        browser.close()
    return report
