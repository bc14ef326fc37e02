"""Peak resident memory of the CLI and of the app on the embedded pair, per dtype: a measurement, not a test.

    python scripts/memory_report.py --dtypes bfloat16,float32 [--no-app]

CLI: ``python -m explorer generate`` on one prompt (32 new tokens, the default method) under ``/usr/bin/time``
(its maximum resident set). App: ``streamlit run app.py`` with ``SPEC_EXPLORER_DTYPE`` set, the Explorer in headless
chromium pressing Step twice; the server's peak (``VmHWM`` of ``/proc/<pid>/status``). A dtype's first use converts
the GGUF files once (not counted: the conversion runs before the measured commands). Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
PROMPT = "Write a Python function that checks whether a number is prime."


def cli_peak_mb(dtype: str) -> float:
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run(["/usr/bin/time", "-f", "%M", "-o", out.name, sys.executable, "-m", "explorer", "generate",
                        "--dtype", dtype, "--prompt", PROMPT, "--max-new-tokens", "32"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return int(Path(out.name).read_text().split()[-1]) / 1024


def app_peak_mb(dtype: str) -> float:
    from browser import CHROMIUM, CHROMIUM_ARGS, IDLE, rerun, running_app
    from playwright.sync_api import sync_playwright

    procs: list = []
    os.environ["SPEC_EXPLORER_DTYPE"] = dtype
    with running_app("default", procs=procs) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url)
        page.wait_for_selector("textarea", timeout=900_000)
        page.wait_for_selector(IDLE, timeout=900_000)
        for _ in range(2):
            rerun(page, lambda: page.get_by_role("button", name="Step", exact=True).click())
        status = Path(f"/proc/{procs[0].pid}/status").read_text()
        browser.close()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--no-app", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from explorer.models.loading import prepare_default_pair

    for dtype in args.dtypes.split(","):
        prepare_default_pair(dtype)  # the one-time conversion, outside the measured runs
        row = {"dtype": dtype, "cli_peak_mb": round(cli_peak_mb(dtype))}
        if not args.no_app:
            row["app_peak_mb"] = round(app_peak_mb(dtype))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
