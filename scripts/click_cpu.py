"""The server's CPU time per Back / Forward click on the Explorer page: what one click costs the app's own process.

Starts ``streamlit run app.py`` (headless, a free port, ``SPEC_EXPLORER_PAIR=tiny`` unless ``--pair``) as a
subprocess, opens the Explorer in Debian's chromium (Playwright) at 1280x720, presses Step ``--steps`` times, then
clicks Back and Forward ``2 x --clicks`` times in all (Back all the way down the run, Forward back up, again),
waiting after each click until the script run it started has finished (Streamlit's own ``script_finished``
message, read off the page's websocket: ``tests/browser.py`` ``rerun``) and the page has drawn it. The server's CPU
time (user + system of all its threads, ``/proc/<pid>/stat``) is read just before and just after each click's wait;
the mean CPU of the same span of idle time, read with no click, is subtracted. Prints JSON: the CPU ms per click
(median and mean of the clicks, idle subtracted), the idle CPU ms per the same span, and the wall ms per click.

    python scripts/click_cpu.py                      # tiny pair, 4 steps, 20 Back + 20 Forward
    python scripts/click_cpu.py --repeat 3           # three fresh servers, the median of their medians
    git worktree add /tmp/before HEAD~1 && python scripts/click_cpu.py --app /tmp/before/app.py   # an older app

A measurement, not a test: on a shared machine compare numbers taken in one sitting. ``/proc`` counts CPU time in
clock ticks (10 ms), so a single click's reading is coarse: the median over many clicks and the mean say more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import CHROMIUM, CHROMIUM_ARGS, _step_caption, cpu_s, rerun, running_app, wait_idle  # noqa: E402


def measure(pair: str, steps: int, clicks: int, width: int, height: int, app: Path = ROOT / "app.py") -> dict:
    from playwright.sync_api import sync_playwright

    procs: list = []
    with running_app(pair, procs=procs, app=app) as url, sync_playwright() as p:
        pid = procs[0].pid
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(url)
        page.wait_for_selector("textarea", timeout=300_000)
        wait_idle(page, 300_000)
        step = page.get_by_role("button", name="Step", exact=True)
        for _ in range(steps):
            rerun(page, lambda: step.click())
        back = page.get_by_role("button", name="Back", exact=True)
        forward = page.get_by_role("button", name="Forward", exact=True)
        time.sleep(1.0)  # the last Step's charts drawn, the server quiet
        # down the run with Back, up again with Forward, until 2 x clicks
        order = (["Back"] * (steps - 1) + ["Forward"] * (steps - 1)) * (2 * clicks)
        cpu_ms, wall_ms = [], []
        for name in order[: 2 * clicks]:
            button = back if name == "Back" else forward
            c0, t0 = cpu_s(pid), time.monotonic()
            rerun(page, button.click, 60_000)
            cpu_ms.append((cpu_s(pid) - c0) * 1e3)
            wall_ms.append((time.monotonic() - t0) * 1e3)
        # idle: the same spans with no click
        span = statistics.mean(wall_ms) / 1e3
        idle = []
        for _ in range(10):
            c0 = cpu_s(pid)
            page.wait_for_timeout(span * 1e3)
            idle.append((cpu_s(pid) - c0) * 1e3)
        caption = _step_caption(page)
        exceptions = page.locator("[data-testid='stException']").count()
        browser.close()
    idle_ms = statistics.mean(idle)
    net = [c - idle_ms for c in cpu_ms]
    return {"clicks": len(cpu_ms), "cpu_ms_median": round(statistics.median(net), 1),
            "cpu_ms_mean": round(statistics.mean(net), 1), "idle_ms_per_span": round(idle_ms, 1),
            "wall_ms_median": round(statistics.median(wall_ms), 1), "last_caption": caption[:40],
            "exceptions": exceptions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="tiny", choices=["tiny", "default"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--clicks", type=int, default=20, help="Back clicks, and as many Forward clicks")
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--repeat", type=int, default=1, help="fresh servers, one measurement each")
    ap.add_argument("--app", default=str(ROOT / "app.py"),
                    help="the app.py to start (another checkout's, e.g. a `git worktree` of an older commit)")
    args = ap.parse_args()
    width, height = map(int, args.size.split("x"))
    runs = [measure(args.pair, args.steps, args.clicks, width, height, Path(args.app)) for _ in range(args.repeat)]
    out = {"runs": runs, "cpu_ms_per_click": statistics.median(r["cpu_ms_median"] for r in runs),
           "cpu_ms_per_click_mean": statistics.median(r["cpu_ms_mean"] for r in runs)}
    print(json.dumps(out, indent=1))
    return 0 if all(r["exceptions"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
