"""The Benchmarks page: the latest ``python -m explorer bench`` report (or an uploaded bench.json), no model."""

from __future__ import annotations

import html
import json
import os

import streamlit as st

from .. import figures
from ..report import ReportError, load_report, loads_report

DEFAULT_REPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "reports", "bench", "bench.json")


def report_path() -> str:
    """``$SPEC_EXPLORER_BENCH`` or reports/bench/bench.json (read on every page run)."""
    return os.environ.get("SPEC_EXPLORER_BENCH", DEFAULT_REPORT)
COLUMNS = ["temperature", "method", "tokens_per_s", "speedup_vs_ar", "ratio_vs_hf", "ratio_vs_hf_bf16",
           "ratio_vs_hf_lookup",
           "tokens_per_target_call", "acceptance_rate", "mcsd_acceptance_rate", "draft_s", "verify_s", "other_s",
           "overhead_share"]


def benchmarks_page() -> None:
    st.title("Benchmarks")
    st.caption("Our methods against autoregressive decoding, Hugging Face assisted generation "
               "(`generate(assistant_model=draft)`) and its prompt lookup (`generate(prompt_lookup_num_tokens=10)`), "
               "measured in one run. Produce a report with "
               "`python -m explorer bench --prompt-file humaneval --temperatures 0,0.7` (see docs/bench.md).")
    upload = st.file_uploader("Load a benchmark report (bench.json)", type=["json"], key="bench_upload")
    path = report_path()
    try:
        if upload is not None:
            report, source = loads_report(upload.getvalue()), upload.name
        elif os.path.exists(path):
            report, source = load_report(path), path
        else:
            st.info(f"No report at {path} yet: run the bench command above, or load a bench.json.")
            return
        m = report["meta"]
        st.markdown(f"Report **{html.escape(str(source))}** · {html.escape(str(m.get('prompt_set')))} · "
                    f"{m.get('max_new_tokens')} new tokens · {html.escape(str(m.get('pair')))} · "
                    f"{html.escape(str(m.get('dtype')))} on {html.escape(str(m.get('device')))} · draft "
                    f"{html.escape(str(m.get('draft_quant', 'none')))} · {html.escape(str(m.get('machine')))} · "
                    f"{html.escape(str(m.get('date', '')))}")
        st.dataframe([{c: r.get(c) for c in COLUMNS} for r in report["summary"]], hide_index=True, width="stretch")
        for i, fig in enumerate(figures.bench_figures(report)):
            st.plotly_chart(fig, width="stretch", key=f"bench_chart_{i}")
        st.caption("hf-assisted settings: " + html.escape(json.dumps(report.get("hf_assisted", {}))))
    except (ReportError, KeyError, TypeError, AttributeError) as exc:
        st.error(f"Cannot show this report: {exc}")
