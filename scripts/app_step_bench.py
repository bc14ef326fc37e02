"""An app step against the same CLI step: the Explorer page in a real browser (Debian's chromium) presses Step with
``--idle`` seconds of quiet before each, and the same prompt runs with ``python -m explorer generate`` in its own
process; prints each step's draft / verify milliseconds from both, and their ratios, as JSON.

    python scripts/app_step_bench.py --pair default --steps 4 --idle 12

A measurement, not a test: timings drift on shared machines, so compare the two columns of one run. The app steps
with ``app_threads`` intra-op threads (one core left to the browser; ``SPEC_EXPLORER_THREADS`` sets it), the CLI
with all of them (docs/bench.md, "The app's steps against the CLI's").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import CHROMIUM, CHROMIUM_ARGS, IDLE, rerun, running_app  # noqa: E402

PROMPT = "Who played anna in once upon a time?"


def app_steps(pair: str, steps: int, idle: float) -> list[dict]:
    from playwright.sync_api import sync_playwright

    out = []
    with running_app(pair) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url)
        page.wait_for_selector("textarea", timeout=900_000)
        page.wait_for_selector(IDLE, timeout=900_000)
        box = page.get_by_label("Prompt", exact=True)
        rerun(page, lambda: (box.fill(PROMPT), page.keyboard.press("Control+Enter")))
        for _ in range(steps):
            time.sleep(idle)
            rerun(page, lambda: page.get_by_role("button", name="Step", exact=True).click())
            text = page.locator("text=/· draft \\d+ ms/").first.inner_text()
            m = re.search(r"draft (\d+) ms \((\d+) calls\) · verify (\d+) ms", text)
            out.append({"draft_ms": int(m.group(1)), "draft_calls": int(m.group(2)), "verify_ms": int(m.group(3))})
        browser.close()
    return out


def cli_steps(pair: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "explorer", "generate", "--models", pair, "--prompt", PROMPT,
                        "--max-new-tokens", "64", "--save-trace", tmp], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from explorer.trace.records import load_run

        trace = load_run(next(Path(tmp).glob("*.json")))
    return [{"draft_ms": round(s.draft_ms), "draft_calls": s.draft_calls, "verify_ms": round(s.verify_ms)}
            for s in trace.steps[:steps]]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="default", choices=["default", "tiny"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--idle", type=float, default=12.0, help="seconds of quiet before each app Step")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    app = app_steps(args.pair, args.steps, args.idle)
    cli = cli_steps(args.pair, args.steps)
    rows = [{"step": i + 1, "app": a, "cli": c,
             "draft_ratio": round(a["draft_ms"] / max(c["draft_ms"], 1), 2),
             "verify_ratio": round(a["verify_ms"] / max(c["verify_ms"], 1), 2)}
            for i, (a, c) in enumerate(zip(app, cli))]
    from explorer.ui.common import app_threads

    print(json.dumps({"prompt": PROMPT, "pair": args.pair, "idle_s": args.idle, "app_threads": app_threads(),
                      "cli_threads": torch.get_num_threads(), "steps": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
