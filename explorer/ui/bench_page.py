"""The Benchmarks page: the latest ``python -m explorer bench`` report (or an uploaded bench.json) and, below it (or
in its place until there is one), the reference reports shipped in ``assets/bench/`` (each with its machine line and
date), named
``<machine>-<prompt set>.json`` (``cpu-humaneval.json``, ``gpu-humaneval.json``, ...): for a prompt set measured on
more than one machine, the machines side by side (each method's tokens/s and speed-up over the same run's ``ar``),
then each report in full. A button runs a small benchmark on the embedded pair from the page."""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

from ..analysis.bench import bench, run_facts
from ..analysis.prompts import encode_prompt, select_prompts
from ..analysis.report import ReportError, load_report, loads_report, write_reports
from ..engine.methods import METHOD_SPECS
from ..trace import figures

ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_REPORT = str(ROOT / "reports" / "bench" / "bench.json")
REFERENCE_DIR = ROOT / "assets" / "bench"
# The page's small benchmark: ar, our default method and transformers' assisted generation on two HumanEval prompts.
SMALL_BENCH = {"prompts": "humaneval:0:2", "methods": ("ar", "mcsd-improved", "hf-assisted"), "max_new_tokens": 48}


def report_path() -> str:
    """``$SPEC_EXPLORER_BENCH`` or reports/bench/bench.json (read on every page run)."""
    return os.environ.get("SPEC_EXPLORER_BENCH", DEFAULT_REPORT)


# From this commit's date on (c69729f), ``mcsd-improved`` chooses its root width online; reports made before it name the
# published width so (``mcsd-improved+tree_choice=fixed`` now).
ONLINE_DEFAULT_SINCE = "2026-11-26T20:52:09+00:00"
# From this commit's date on (92a2b13), the bench joins the target's prefill to the first verification of our drafting
# methods (``Engine`` ``joint_prefill``) where forwards are eager; reports made before it prefilled apart.
JOINT_PREFILL_SINCE = "2026-11-27T03:23:38+00:00"
# From this commit's date on (b346e02), ``eagle`` sizes its tree online; reports made before it verified every one of
# ``head_tokens`` nodes (``eagle+tree_choice=fixed`` now).
HEAD_SIZED_SINCE = "2026-11-28T05:14:12+00:00"
# The methods whose eager runs join it: every drafting method but the self-drafting one, whose draft reads the
# target's cache (``machine.joins_prefill``).
DRAFTING = tuple(name for name, spec in METHOD_SPECS.items()
                 if (spec.uses_draft_model or spec.free) and not spec.self_draft)


def label_notes(report: dict) -> list[str]:
    """What a report's method labels meant when it was made, where that differs from today's (by ``meta.date``, an
    ISO time): before ``ONLINE_DEFAULT_SINCE`` ``mcsd-improved`` was the published root width; before
    ``JOINT_PREFILL_SINCE`` an eager run of our drafting methods prefilled the target apart; before
    ``HEAD_SIZED_SINCE`` ``eagle`` verified all its kept nodes."""
    meta = report.get("meta", {})
    date = str(meta.get("date") or "")
    methods = {r.get("method") for r in report.get("summary", [])}
    notes = []
    if "mcsd-improved" in methods and date and date < ONLINE_DEFAULT_SINCE:
        notes.append("In this report `mcsd-improved` is the published tree (two root candidates where the draft is "
                     "unsure): it was made before the default chose its root width online (2026-11-26). The "
                     "published shape is `mcsd-improved+tree_choice=fixed` now.")
    if "eagle" in methods and date and date < HEAD_SIZED_SINCE:
        notes.append("In this report `eagle` verifies every one of its 16 best nodes: it was made before the default "
                     "sized the head's tree online (2026-11-28). That shape is `eagle+tree_choice=fixed` now.")
    drafting = any(str(m).split("+")[0] in DRAFTING for m in methods)
    if drafting and date and date < JOINT_PREFILL_SINCE and not meta.get("graphs"):
        notes.append("In this report our engine prefilled the target apart from the first verification: one target "
                     "forward more per prompt than transformers' assisted generation and prompt lookup, which "
                     "verify their first draft in the prefill. The bench joins them since 2026-11-27 "
                     "(`+prefill=apart` keeps them apart).")
    return notes


COLUMNS = ["temperature", "method", "tokens_per_s", "speedup_vs_ar", "ratio_vs_hf", "ratio_vs_hf_bf16",
           "ratio_vs_hf_lookup",
           "tokens_per_target_call", "acceptance_rate", "mcsd_acceptance_rate", "draft_s", "verify_s", "other_s",
           "overhead_share"]
KIND_COLUMNS = ["temperature", "kind", "method", "tokens_per_s", "speedup_vs_ar", "ratio_vs_hf", "ratio_vs_best_hf",
                "tokens_per_target_call", "plain_step_share"]


def reference_reports(folder: Path = REFERENCE_DIR) -> dict[str, Path]:
    """The shipped reference reports by label (file name without ``.json``)."""
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def reference_sets(folder: Path = REFERENCE_DIR) -> dict[str, dict[str, Path]]:
    """The shipped reference reports by prompt set, then machine: ``gpu-mt-bench.json`` -> ``{"mt-bench": {"gpu":
    path}}``. CPU first, then the rest in name order. A name without a ``-`` is its own set on machine ``""``."""
    out: dict[str, dict[str, Path]] = {}
    for label, path in reference_reports(folder).items():
        machine, _, prompt_set = label.partition("-") if "-" in label else ("", "", label)
        out.setdefault(prompt_set, {})[machine] = path
    return {k: dict(sorted(v.items(), key=lambda kv: (kv[0] != "cpu", kv[0]))) for k, v in out.items()}


def side_by_side(reports: dict[str, dict]) -> list[dict]:
    """One row per (temperature, method) found in any of ``reports`` (machine -> report): each machine's tokens/s,
    speed-up over its own run's ``ar`` and tokens per target call (None where that machine did not run it)."""
    keys = _keys(reports)
    by_machine = {m: {(r["temperature"], r["method"]): r for r in rep["summary"]} for m, rep in reports.items()}
    rows = []
    for temperature, method in keys:
        row = {"temperature": temperature, "method": method}
        for machine, found in by_machine.items():
            r = found.get((temperature, method), {})
            tag = machine.upper() or "report"
            for column, field in (("tok/s", "tokens_per_s"), ("x ar", "speedup_vs_ar"),
                                  ("tokens/call", "tokens_per_target_call")):
                row[f"{tag} {column}"] = None if r.get(field) is None else round(r[field], 2)
        rows.append(row)
    return rows


def _keys(reports: dict[str, dict]) -> list[tuple[float, str]]:
    """Every (temperature, method) of ``reports``, by temperature, methods in the order the reports list them."""
    methods = list(dict.fromkeys(r["method"] for rep in reports.values() for r in rep["summary"]))
    found = {(r["temperature"], r["method"]) for rep in reports.values() for r in rep["summary"]}
    return [(t, m) for t in sorted({t for t, _ in found}) for m in methods if (t, m) in found]


def machines_figure(reports: dict[str, dict]) -> go.Figure:
    """Speed-up over each machine's own ``ar`` per method and temperature, one bar group per machine."""
    fig = go.Figure()
    for machine, rep in reports.items():
        rows = [r for r in rep["summary"] if r.get("speedup_vs_ar") is not None]
        fig.add_trace(go.Bar(name=machine.upper() or "report",
                             x=[f"{r['method']} · T={r['temperature']:g}" for r in rows],
                             y=[r["speedup_vs_ar"] for r in rows],
                             text=[f"{r['speedup_vs_ar']:.2f}x" for r in rows], textposition="outside"))
    fig.add_hline(y=1.0, line=dict(color="#000", width=1, dash="dash"))
    order = [f"{m} · T={t:g}" for t, m in _keys(reports)]  # by temperature, whichever machine ran the method
    fig.update_layout(title="Speed-up over each machine's own ar", barmode="group",
                      height=400, yaxis=dict(title="x ar"), margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(categoryorder="array", categoryarray=order))
    return fig


def show_references(folder: Path = REFERENCE_DIR) -> None:
    """The shipped reference reports: pick a prompt set; where it was measured on several machines, the machines
    side by side, then each report in full (a tab per machine)."""
    sets = reference_sets(folder)
    prompt_set = st.selectbox("Reference prompt set", list(sets), key="bench_reference")
    try:
        reports = {machine: load_report(path) for machine, path in sets[prompt_set].items()}
    except (ReportError, KeyError, TypeError, AttributeError) as exc:
        st.error(f"Cannot show this report: {exc}")
        return
    if len(reports) > 1:
        st.subheader("Side by side")
        st.caption(" · ".join(f"**{m.upper()}**: {html.escape(str(r['meta'].get('machine')))}, "
                              f"{html.escape(str(r['meta'].get('dtype')))}, "
                              f"{'CUDA graphs' if r['meta'].get('graphs') else 'eager'}, "
                              f"{html.escape(str(r['meta'].get('date', ''))[:10])}" for m, r in reports.items()))
        st.dataframe(side_by_side(reports), hide_index=True, width="stretch")
        st.plotly_chart(machines_figure(reports), width="stretch", key="bench_machines")
    tabs = st.tabs([m.upper() or "report" for m in reports]) if len(reports) > 1 else [st.container()]
    for tab, (machine, report) in zip(tabs, reports.items()):
        with tab:
            try:
                show_report(report, f"{machine + '-' if machine else ''}{prompt_set} (reference)",
                            key=f"bench_ref_{machine}")
            except (KeyError, TypeError, AttributeError) as exc:
                st.error(f"Cannot show this report: {exc}")


def show_report(report: dict, source: str, key: str = "bench_chart") -> None:
    """One report: its facts line, the summary table, the charts and the hf-assisted settings (``key``: the
    charts' widget key prefix, one per report shown on a page)."""
    m = report["meta"]
    st.markdown(f"Report **{html.escape(str(source))}** · {html.escape(str(m.get('prompt_set')))} · "
                f"{m.get('max_new_tokens')} new tokens · {html.escape(str(m.get('pair')))} · "
                f"{html.escape(str(m.get('dtype')))} on {html.escape(str(m.get('device')))} · draft "
                f"{html.escape(str(m.get('draft_quant', 'none')))} · {html.escape(str(m.get('machine')))} · "
                f"{html.escape(str(m.get('date', '')))}" + (f" · commit {html.escape(str(m['commit']))}"
                                                           if m.get("commit") else ""))
    for note in label_notes(report):
        st.caption(note)
    st.dataframe([{c: r.get(c) for c in COLUMNS} for r in report["summary"]], hide_index=True, width="stretch")
    if report.get("by_kind"):  # a prompt set of several kinds (--prompt-file kinds): each against its own baselines
        st.markdown("**By kind of prompt** (ratios against the same kind's runs of each baseline)")
        st.dataframe([{c: r.get(c) for c in KIND_COLUMNS} for r in report["by_kind"]], hide_index=True,
                     width="stretch", key=f"{key}_kinds")
    for i, fig in enumerate(figures.bench_figures(report)):
        st.plotly_chart(fig, width="stretch", key=f"{key}_{i}")
    st.caption("hf-assisted settings: " + html.escape(json.dumps(report.get("hf_assisted", {}))))


def run_small_bench() -> None:
    """The page's small benchmark on the embedded pair, with a progress bar; writes ``reports/bench``."""
    # here, not at the top: read at each call, as tests swap common.load_pair_with_progress for a tiny pair
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
        elif os.path.exists(path):
            show_report(load_report(path), path)
        elif reference_reports():
            st.info(f"No report of yours at {path} yet: these are the reference reports shipped with the explorer, "
                    "measured as docs/bench.md says. Run a small benchmark here, run the bench command, or load a "
                    "bench.json.")
            show_references()
            return
        else:
            st.info(f"No report at {path} yet: run the bench command above, or load a bench.json.")
            return
    except (ReportError, KeyError, TypeError, AttributeError) as exc:
        st.error(f"Cannot show this report: {exc}")
    if reference_reports():  # beside the user's own report, the shipped ones stay one click away
        with st.expander("Reference reports shipped with the explorer (CPU and GPU)"):
            show_references()
