"""The Benchmarks page: the latest ``python -m explorer bench`` report (or an uploaded bench.json); until there is
one, the reference reports shipped in ``assets/bench/`` (each with its machine line and date). A button runs a small
benchmark on the embedded pair from the page."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

import streamlit as st

from .. import figures
from ..report import ReportError, load_report, loads_report

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_REPORT = str(ROOT / "reports" / "bench" / "bench.json")
REFERENCE_DIR = ROOT / "assets" / "bench"
# The page's small benchmark: ar, our default method and transformers' assisted generation on two HumanEval prompts.
SMALL_BENCH = {"prompts": "humaneval:0:2", "methods": ("ar", "mcsd-improved", "hf-assisted"), "max_new_tokens": 48}


def report_path() -> str:
    """``$SPEC_EXPLORER_BENCH`` or reports/bench/bench.json (read on every page run)."""
    return os.environ.get("SPEC_EXPLORER_BENCH", DEFAULT_REPORT)


COLUMNS = ["temperature", "method", "tokens_per_s", "speedup_vs_ar", "ratio_vs_hf", "ratio_vs_hf_bf16",
           "ratio_vs_hf_lookup",
           "tokens_per_target_call", "acceptance_rate", "mcsd_acceptance_rate", "draft_s", "verify_s", "other_s",
           "overhead_share"]


def reference_reports(folder: Path = REFERENCE_DIR) -> dict[str, Path]:
    """The shipped reference reports by label (file name without ``.json``)."""
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def show_report(report: dict, source: str) -> None:
    m = report["meta"]
    st.markdown(f"Report **{html.escape(str(source))}** · {html.escape(str(m.get('prompt_set')))} · "
                f"{m.get('max_new_tokens')} new tokens · {html.escape(str(m.get('pair')))} · "
                f"{html.escape(str(m.get('dtype')))} on {html.escape(str(m.get('device')))} · draft "
                f"{html.escape(str(m.get('draft_quant', 'none')))} · {html.escape(str(m.get('machine')))} · "
                f"{html.escape(str(m.get('date', '')))}" + (f" · commit {html.escape(str(m['commit']))}"
                                                           if m.get("commit") else ""))
    st.dataframe([{c: r.get(c) for c in COLUMNS} for r in report["summary"]], hide_index=True, width="stretch")
    for i, fig in enumerate(figures.bench_figures(report)):
        st.plotly_chart(fig, width="stretch", key=f"bench_chart_{i}")
    st.caption("hf-assisted settings: " + html.escape(json.dumps(report.get("hf_assisted", {}))))


def run_small_bench() -> None:
    """The page's small benchmark on the embedded pair, with a progress bar; writes ``reports/bench``."""
    from ..bench import bench, run_facts
    from ..prompts import encode_prompt, select_prompts
    from ..report import write_reports
    from .common import load_pair_with_progress

    pair = load_pair_with_progress("default", "", "", "auto")
    prompts = select_prompts([SMALL_BENCH["prompts"]])
    ids = [encode_prompt(pair.tokenizer, p.text) for p in prompts]
    total = len(ids) * len(SMALL_BENCH["methods"])
    bar = st.progress(0.0, text="Warming up…")
    done = []

    def progress(msg):
        done.append(msg)
        bar.progress(min(1.0, len(done) / total), text=f"{len(done)}/{total} runs · {msg}")

    result = bench(pair, ids, methods=SMALL_BENCH["methods"], temperatures=(0.0,),
                   max_new_tokens=SMALL_BENCH["max_new_tokens"], progress=progress)
    result["meta"] = {"prompt_set": SMALL_BENCH["prompts"], "prompts": [p.id for p in prompts],
                      "max_new_tokens": SMALL_BENCH["max_new_tokens"], "methods": list(SMALL_BENCH["methods"]),
                      "temperatures": [0.0], "top_p": 1.0, "seed": 0, "samples": 1, "warmup": 1,
                      "kv_cache": "dynamic", "graphs": False, "decision_dir": "shipped", **run_facts(pair)}
    write_reports(result, Path(report_path()).parent)
    bar.empty()


def benchmarks_page() -> None:
    st.title("Benchmarks")
    st.caption("Our methods against autoregressive decoding, Hugging Face assisted generation "
               "(`generate(assistant_model=draft)`) and its prompt lookup (`generate(prompt_lookup_num_tokens=10)`), "
               "measured in one run. Produce a report with "
               "`python -m explorer bench --prompt-file humaneval --temperatures 0,0.7` (see docs/bench.md).")
    c = st.columns([2, 3])
    if c[0].button("Run a small benchmark here", key="bench_run",
                   help=f"{', '.join(SMALL_BENCH['methods'])} on HumanEval 0-1, {SMALL_BENCH['max_new_tokens']} new "
                        "tokens, greedy, on the embedded pair (loads it; a few minutes on a CPU)"):
        try:
            run_small_bench()
        except Exception as exc:  # noqa: BLE001 - the page stays up whatever the models do
            st.error(f"The benchmark failed: {type(exc).__name__}: {exc}")
    upload = c[1].file_uploader("Load a benchmark report (bench.json)", type=["json"], key="bench_upload")
    path = report_path()
    try:
        if upload is not None:
            show_report(loads_report(upload.getvalue()), upload.name)
            return
        if os.path.exists(path):
            show_report(load_report(path), path)
            return
    except (ReportError, KeyError, TypeError, AttributeError) as exc:
        st.error(f"Cannot show this report: {exc}")
        return
    references = reference_reports()
    if not references:
        st.info(f"No report at {path} yet: run the bench command above, or load a bench.json.")
        return
    st.info(f"No report of yours at {path} yet: these are the reference reports shipped with the explorer, measured "
            "as docs/bench.md says. Run a small benchmark here, run the bench command, or load a bench.json.")
    label = st.selectbox("Reference report", list(references), key="bench_reference")
    try:
        show_report(load_report(references[label]), f"{label} (reference)")
    except (ReportError, KeyError, TypeError, AttributeError) as exc:
        st.error(f"Cannot show this report: {exc}")
