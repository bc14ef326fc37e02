"""Drive the running app in a real browser (Debian's chromium through Playwright) and take screenshots.

Used by tests/test_browser.py (tiny pair) and by hand on the default pair:
    python tests/browser.py --pair default --out out/screens
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
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
def running_app(pair: str, port: int | None = None, timeout: float = 600):
    """Start ``streamlit run app.py`` on localhost with the given initial pair; yield its URL."""
    port = port or free_port()
    env = dict(os.environ, SPEC_EXPLORER_PAIR=pair)
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", str(ROOT / "app.py"), "--server.port",
                             str(port), "--server.address", "127.0.0.1", "--server.headless", "true"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited: {proc.stdout.read()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_idle(page, timeout_ms: int) -> None:
    page.wait_for_timeout(300)  # let a click start a rerun before waiting for it to end
    page.wait_for_selector(IDLE, timeout=timeout_ms)


def step_twice(url: str, out_dir: Path, load_timeout_s: float = 600) -> dict:
    """Open the app, type a prompt, press Step twice; screenshot; report what the page shows."""
    from playwright.sync_api import sync_playwright

    out_dir.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1400})
        page.goto(url)
        page.wait_for_selector("textarea", timeout=load_timeout_s * 1000)
        wait_idle(page, load_timeout_s * 1000)
        page.locator("textarea").first.fill("Write a Python function that checks whether a number is prime.")
        page.keyboard.press("Control+Enter")
        wait_idle(page, 60_000)
        try:
            for _ in range(2):
                page.get_by_role("button", name="Step", exact=True).click(timeout=120_000)
                wait_idle(page, 300_000)
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
            "plots": charts.count(),
            "errors": page.locator("[data-testid='stAlertContentError']").all_inner_texts(),
            "exceptions": page.locator("[data-testid='stException']").count(),
            "titles": page.locator(".js-plotly-plot .gtitle").all_text_contents(),
            "metrics": page.locator("[data-testid='stMetric']").all_inner_texts(),
            "what_if": [t for t in page.locator("[data-testid='stCaptionContainer']").all_inner_texts()
                        if t.startswith("With ")],
        }
        browser.close()
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="default", choices=["default", "tiny"])
    ap.add_argument("--out", default=str(ROOT / "out" / "screens"))
    args = ap.parse_args()
    with running_app(args.pair) as url:
        report = step_twice(url, Path(args.out))
    print(report)
    return 0 if report["plots"] >= 2 and not report["errors"] and not report["exceptions"] else 1


if __name__ == "__main__":
    sys.exit(main())
