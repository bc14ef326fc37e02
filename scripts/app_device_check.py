"""The app driven headless (Streamlit's AppTest) on whatever device the pair loads on (the GPU where there is one),
against the same steps outside the app, and the peak device memory of the app and of the CLI: a measurement and a
check for a GPU machine, not a test (tests/test_app.py drives the app on the CPU).

    SPEC_EXPLORER_PAIR=default python scripts/app_device_check.py --out DIR [--steps 3]

* Explorer: every method steps ``--steps`` times on one prompt (wall time of each click, the trace's ``step_ms``);
  any exception or error message is recorded.
* Classroom: the first lesson's Continue live at its second step (a replay, or on a machine that rounds otherwise
  the text so far), then Step on the Explorer.
* Compare: Step both.
* Forensics: MT-bench's first five prompts run (the sidebar's method, 64 new tokens); the report holds all five.
* The same steps outside Streamlit (``build_engine``, ``start``, ``step``), run once before the app (a warm-up: the
  first forwards of a shape cost several times the later ones) and once after: the median ``step_ms`` of the app's
  steps after its first against the second pass's, per method.
* Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of this process after the app's
  steps (the app holds one pair), and of ``python -m explorer generate`` (32 new tokens) in a subprocess; on a CPU the
  resident peak is scripts/memory_report.py's job.

Writes ``DIR/app_check.json`` and prints one summary line per check; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROMPT = "Write a Python function that checks whether a number is prime."
CLI_MEMORY = """
import runpy, sys, torch
sys.argv = ["explorer", "generate", "--prompt", {prompt!r}, "--max-new-tokens", "32"]
try:
    runpy.run_module("explorer", run_name="__main__")
except SystemExit:
    pass
if torch.cuda.is_available():
    print("PEAK", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
"""


def _gpu_peak() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return {"allocated_mb": torch.cuda.max_memory_allocated() / 2**20,
            "reserved_mb": torch.cuda.max_memory_reserved() / 2**20}


def _forget_peak() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _click(at, key, log: list, what: str) -> float:
    t0 = time.perf_counter()
    at.button(key=key).click().run()
    ms = (time.perf_counter() - t0) * 1e3
    problems = [str(e.value)[:300] for e in at.exception] + [str(e.value)[:300] for e in at.error]
    if problems:
        log.append({"check": what, "problems": problems})
    return ms


def app_checks(steps: int, classroom: bool = True) -> tuple[dict, list]:
    """Every page's steps in AppTest (``classroom``: Continue live too, which loads the embedded pair). Returns
    (per-method app step timings, problems)."""
    from streamlit.testing.v1 import AppTest

    from explorer.engine.methods import METHODS

    problems: list = []
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=900)
    at.run()
    if at.exception:
        return {}, [{"check": "app start", "problems": [str(e.value)[:300] for e in at.exception]}]
    timings = {}
    for method in METHODS:
        at.sidebar.selectbox(key="method").set_value(method).run()
        at.text_area(key="prompt_text").set_value(PROMPT).run()
        clicks = [_click(at, "step_btn", problems, f"explorer {method}") for _ in range(steps)]
        engine = at.session_state["engine"] if "engine" in at.session_state else None
        if engine is None or len(engine.trace.steps) != steps:
            problems.append({"check": f"explorer {method}", "problems": ["the steps did not all run"]})
        else:
            timings[method] = {"click_ms": clicks, "step_ms": [s.step_ms for s in engine.trace.steps],
                               "device": engine.trace.model.get("device")}
            print(f"explorer {method}: device {timings[method]['device']}, step ms "
                  f"{[round(x) for x in timings[method]['step_ms']]}, click ms {[round(x) for x in clicks]}",
                  flush=True)
        _click(at, "reset_btn", problems, f"explorer reset {method}")
    if classroom:
        timings["_continue_live"] = _continue_live(at, problems)
    # Compare
    at.sidebar.radio(key="page").set_value("Compare").run()
    at.text_area(key="cmp_prompt").set_value(PROMPT).run()
    _click(at, "cmp_step", problems, "compare step both")
    engines = at.session_state["cmp_engines"] if "cmp_engines" in at.session_state else None
    if not engines or any(len(e.trace.steps) != 1 for e in engines):
        problems.append({"check": "compare", "problems": ["Step both did not step both"]})
    print(f"compare: {'ok' if engines else 'failed'}", flush=True)
    timings["_forensics"] = _forensics(at, problems)
    return timings, problems


def _forensics(at, problems: list) -> dict:
    """Forensics: MT-bench's first five run with the sidebar's method; the report must hold all five."""
    at.sidebar.radio(key="page").set_value("Forensics").run()
    at.selectbox(key="fo_set").set_value("MT-bench, first 5").run()
    ms = _click(at, "fo_run", problems, "forensics run")
    report = at.session_state["fo_result"] if "fo_result" in at.session_state else None
    done = {"seconds": ms / 1e3, "prompts": len(report["prompts"]) if report else 0,
            "skipped": list(at.session_state["fo_skipped"]) if "fo_skipped" in at.session_state else []}
    if not report or done["prompts"] + len(done["skipped"]) != 5:
        problems.append({"check": "forensics", "problems": [f"no report of five prompts: {done}"]})
    print(f"forensics: {done}", flush=True)
    return done


def _continue_live(at, problems: list) -> dict:
    """Classroom: the first lesson's player sends Continue live at its first run's second step (a trigger value of
    the ``lesson_player`` component, which AppTest cannot click, as tests/test_classroom.py sends it), then one Step
    on the Explorer."""
    from streamlit.components.v2.bidi_component.main import _make_trigger_id
    from streamlit.proto.WidgetStates_pb2 import WidgetStates

    at.sidebar.radio(key="page").set_value("Classroom").run()
    states = WidgetStates()
    states.CopyFrom(at._tree.get_widget_states())
    trigger = states.widgets.add()
    trigger.id = _make_trigger_id(at.get("bidi_component")[0].proto.id, "events")
    trigger.json_trigger_value = json.dumps([{"event": "live", "value": {"run": 0, "step": 1}}])
    at = at._run(states)
    if at.exception or at.error:
        problems.append({"check": "classroom continue live",
                         "problems": [str(e.value)[:300] for e in list(at.exception) + list(at.error)]})
    said = at.session_state["continued"] if "continued" in at.session_state else None
    engine_before = at.session_state["engine"] if "engine" in at.session_state else None
    n_before = len(engine_before.trace.steps) if engine_before is not None else None
    _click(at, "step_btn", problems, "classroom continue live: step")
    engine = at.session_state["engine"] if "engine" in at.session_state else None
    live = {"message": said, "steps_before": n_before, "steps_after": len(engine.trace.steps) if engine else None}
    if engine is None or n_before is None or len(engine.trace.steps) != n_before + 1:
        problems.append({"check": "classroom continue live", "problems": [f"no live step: {live}"]})
    print(f"classroom continue live: {live}", flush=True)
    return live


def cli_steps(steps: int) -> dict:
    """The same steps outside Streamlit, on a pair loaded as the CLI loads it."""
    from explorer.analysis.prompts import encode_prompt
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.methods import METHODS
    from explorer.engine.sampling import SamplingConfig
    from explorer.models.loading import load_default_pair

    pair = load_default_pair() if os.environ.get("SPEC_EXPLORER_PAIR", "default") == "default" else None
    if pair is None:
        from explorer.models.tiny import tiny_pair

        pair = tiny_pair(seed=0)
    ids = encode_prompt(pair.tokenizer, PROMPT, chat_template=True)
    out = {}
    for method in METHODS:
        engine = build_engine(pair, DEFAULTS[method], SamplingConfig(temperature=0.0))
        engine.start(ids, 64, prompt_text=PROMPT)
        out[method] = [engine.step().step_ms for _ in range(steps)]
    return out


def cli_memory() -> dict | None:
    """Peak CUDA memory of ``python -m explorer generate`` (32 new tokens, the default method), or None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    done = subprocess.run([sys.executable, "-c", CLI_MEMORY.format(prompt=PROMPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PEAK")), None)
    if line is None:
        return {"error": (done.stderr or done.stdout)[-500:]}
    _, allocated, reserved = line.split()
    return {"allocated_mb": int(allocated) / 2**20, "reserved_mb": int(reserved) / 2**20}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-classroom", action="store_true", help="skip Continue live (it loads the embedded pair)")
    args = ap.parse_args()
    t0 = time.time()
    print(f"CLI steps before the app (warm-up): {cli_steps(args.steps)}", flush=True)
    _forget_peak()  # the app's own peak: that pair is gone
    app, problems = app_checks(args.steps, classroom=not args.no_classroom)
    app_memory = _gpu_peak()
    print(f"app peak memory: {app_memory}", flush=True)
    cli = cli_steps(args.steps)
    print(f"CLI steps after the app: {cli}", flush=True)
    ratios = {m: statistics.median(app[m]["step_ms"][1:] or app[m]["step_ms"]) /
              statistics.median(cli[m][1:] or cli[m]) for m in cli if m in app}
    for m, r in ratios.items():
        print(f"app / CLI median step ({m}): {r:.2f}", flush=True)
    memory = cli_memory()
    print(f"CLI peak memory: {memory}", flush=True)
    report = {"app": app, "cli_step_ms": cli, "app_over_cli": ratios, "app_memory": app_memory,
              "cli_memory": memory, "problems": problems, "seconds": time.time() - t0}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "app_check.json").write_text(json.dumps(report, indent=1, default=str))
    for p in problems:
        print(f"PROBLEM {p['check']}: {p['problems']}", flush=True)
    print(f"app check: {len(problems)} problem(s), {report['seconds']:.0f} s", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
