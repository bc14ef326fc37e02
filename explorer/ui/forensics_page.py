"""The Forensics page: which drafted tokens the target rejects over a prompt set, where and why.

Prompts from a built-in set or an uploaded JSONL file run with the sidebar's pair, method and sampling, one after the
other with a progress bar (Stop ends the batch after the current prompt: the report keeps the prompts done); or
uploaded traces are read as they are (a file that cannot be read is named and left out). The figures and tables are
``analysis/forensics_report.py``'s, as in the command's ``forensics.html``; the report downloads as JSON and HTML.
Session state: ``state.Forensics``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import streamlit as st

from ..analysis.forensics import Forensics as Aggregate
from ..analysis.forensics import run_category
from ..analysis.forensics_report import (CONFUSION_COLUMNS, COSTLIEST_COLUMNS, DIFF_COLUMNS, PROMPT_COLUMNS,
                                         PROMPT_DIFF_COLUMNS, ForensicsError, check_forensics, diff, diff_figure,
                                         diff_rows, forensics_figures, forensics_html, settings_text)
from ..analysis.prompts import PromptError, parse_prompt_lines, select_prompts
from ..engine.machine import EngineError
from ..trace.records import MAX_TRACE_BYTES, TraceError, loads_run
from .common import guarded, make_engine, pair_or_message
from .state import Forensics, engine_lock, keep_learned, open_in_explorer

BUILT_IN = {"HumanEval, first 5": "humaneval:0:5", "MT-bench, first 5": "mt-bench:0:5",
            "HumanEval and MT-bench, 5 each": "humaneval:0:5,mt-bench:0:5"}
MAX_PROMPT_FILE_BYTES = 2 * 1024 * 1024
SOURCES = ("Built-in set", "Prompt file (JSONL)", "Saved traces")


def _prompts(source: str, built_in: str, upload) -> list:
    """The prompts to run. Raises PromptError for a file that is not a prompt set."""
    if source == SOURCES[0]:
        return select_prompts(BUILT_IN[built_in].split(","))
    if upload is None:
        raise PromptError("upload a JSONL prompt file first ('turns' list or 'prompt' string a line)")
    if upload.size > MAX_PROMPT_FILE_BYTES:
        raise PromptError(f"{upload.name} is {upload.size / 1e6:.1f} MB; prompt files are limited to "
                          f"{MAX_PROMPT_FILE_BYTES / 1e6:.0f} MB")
    try:
        prompts = parse_prompt_lines(upload.getvalue().decode("utf-8").splitlines(), upload.name)
    except UnicodeDecodeError:
        raise PromptError(f"{upload.name} is not UTF-8 text") from None
    if not prompts:
        raise PromptError(f"{upload.name} holds no prompt")
    return prompts


def _run(settings, prompts: list) -> None:
    """Each prompt's run, added as it finishes (an interrupted batch keeps what it did)."""
    pair = pair_or_message(settings)
    if pair is None:
        return
    agg, runs, refused = Aggregate(), {}, []
    bar = st.progress(0.0, text=f"0 of {len(prompts)} prompts")
    for n, prompt in enumerate(prompts, 1):
        name = f"prompt {prompt.id}"
        try:
            with engine_lock():  # an interrupted batch may still be stepping (see state.engine_lock)
                engine = make_engine(pair, settings, prompt.text, True)
                trace = engine.run()
                keep_learned(engine)
        except (EngineError, PromptError) as exc:  # too long for these models, say: named, the rest still run
            refused.append(f"{name}: {exc}")
        else:
            trace.prompt_info = prompt.info()
            agg.add(trace, prompt=prompt.id, category=run_category(trace), source=name)
            runs[name] = trace
        _keep(agg.to_dict() if agg.prompts else None, runs, refused)
        bar.progress(n / len(prompts), text=f"{n} of {len(prompts)} prompts")
    bar.empty()


def _keep(data: dict | None, runs: dict, skipped: list) -> None:
    """The report, and of the runs only those its costliest rejections come from (to open them)."""
    wanted = {row["trace"] for row in data["costliest"]} if data else set()
    Forensics.RESULT.set(data)
    Forensics.TRACES.set({k: v for k, v in runs.items() if k in wanted})
    Forensics.SKIPPED.set(skipped)


def _read_traces(uploads) -> None:
    agg, skipped, runs = Aggregate(), [], {}
    for up in uploads:
        try:
            if up.size > MAX_TRACE_BYTES:
                raise TraceError(f"{up.size / 1e6:.1f} MB; traces are limited to {MAX_TRACE_BYTES / 1e6:.0f} MB")
            runs[up.name] = loads_run(up.getvalue())
            trace = runs[up.name]
            agg.add(trace, prompt=trace.prompt_info.get("id") or Path(up.name).stem, category=run_category(trace),
                    source=up.name)
        except TraceError as exc:
            skipped.append(f"{up.name}: {exc}")
    _keep(agg.to_dict() if agg.prompts else None, runs, skipped)


def forensics_page(settings) -> None:
    st.title("Rejection forensics")
    st.caption("Over a prompt set: acceptance by token class, depth, prompt category, the draft's confidence, the "
               "target's entropy and draft source, realised and expected (the verification rule's odds: realised "
               "below expected is bad luck, both low is the draft's miss); what the target committed instead; the "
               "rejections that cost the most. Runs use the sidebar's pair, method and sampling.")
    source = st.radio("Prompts", SOURCES, horizontal=True, key="fo_source")
    built_in, upload, traces = next(iter(BUILT_IN)), None, []
    if source == SOURCES[0]:
        built_in = st.selectbox("Set", list(BUILT_IN), key="fo_set")
    elif source == SOURCES[1]:
        upload = st.file_uploader("Prompt file", type=["jsonl", "json"], key="fo_prompts")
    else:
        traces = st.file_uploader("Trace files (Download trace, generate --save-trace)", type=["json"],
                                  accept_multiple_files=True, key="fo_traces") or []
    c = st.columns([1, 1, 5])
    if c[0].button("Read traces" if source == SOURCES[2] else "Run", type="primary", key="fo_run"):
        if source == SOURCES[2]:
            guarded(_read_traces, traces, error_key=Forensics.ERROR)
        else:
            prompts = guarded(_prompts, source, built_in, upload, error_key=Forensics.ERROR)
            if prompts:
                guarded(_run, settings, prompts, error_key=Forensics.ERROR)
    c[1].button("Stop", key="fo_stop", help="ends the batch after the prompt running now; the report keeps the "
                                            "prompts done")
    if Forensics.ERROR.get():
        st.error(Forensics.ERROR.get())
    for problem in Forensics.SKIPPED.get() or []:
        st.warning(f"Left out {problem}")
    data = Forensics.RESULT.get()
    if data is None:
        st.info("Run a prompt set, or read saved traces, to see where the target rejects the draft.")
        return
    show(data)


def show(data: dict) -> None:
    """The report on the page: the figures, the tables, the comparison with report A and the downloads."""
    st.markdown(f"**{data['nodes']}** tested drafted nodes in **{len(data['prompts'])}** runs"
                f"{settings_text(data.get('settings', {}))} (the numbers above the bars: nodes tested).")
    figs = forensics_figures(data)
    for left, right in zip(figs[0::2], figs[1::2] + [None]):
        cols = st.columns(2)
        cols[0].plotly_chart(left, width="stretch", config={"displayModeBar": False})
        if right is not None:
            cols[1].plotly_chart(right, width="stretch", config={"displayModeBar": False})
    for title, rows, columns in (("Confusions: drafted token, and what the target committed instead",
                                  data["confusions"][:40], CONFUSION_COLUMNS),
                                 ("The costliest rejections", data["costliest"], COSTLIEST_COLUMNS),
                                 ("Per prompt", data["prompts"], PROMPT_COLUMNS)):
        st.subheader(title)
        _table(rows, columns)
        if rows is data["costliest"] and rows:
            _open_one(rows)
    _compare(data)
    c = st.columns([1, 1, 4])
    c[0].download_button("forensics.json", data=lambda: json.dumps(data, ensure_ascii=False, indent=1),
                         file_name="forensics.json", mime="application/json", key="fo_json", on_click="ignore")
    c[1].download_button("forensics.html", data=lambda: forensics_html(data), file_name="forensics.html",
                         mime="text/html", key="fo_html", on_click="ignore")


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """``rows`` as a table of ``columns`` (key, label), numbers to two decimals."""
    def cell(v):
        return round(v, 2) if isinstance(v, float) else v

    st.dataframe(pd.DataFrame([{label: cell(r.get(key)) for key, label in columns} for r in rows]), hide_index=True,
                 width="stretch")


def _compare(data: dict) -> None:
    """Two settings on the same prompts: keep this report as A (or upload an earlier forensics.json), change the
    sidebar's pair, method, stop policy or temperature, run again: B (the report shown) against A."""
    st.subheader("Compare two settings")
    c = st.columns([1.3, 3, 1], vertical_alignment="bottom")
    c[0].button("Keep this report as A", key="fo_keep_a", on_click=Forensics.BASELINE.set, args=(data,),
                help="then change the sidebar's settings and run the same prompts again: the page shows where the "
                     "new run (B) gains and loses against A")
    upload = c[1].file_uploader("or an earlier forensics.json as A", type=["json"], key="fo_a_file")
    if upload is not None and c[2].button("Use as A", key="fo_use_a"):
        guarded(_read_baseline, upload, error_key=Forensics.ERROR)
        st.rerun()
    a = Forensics.BASELINE.get()
    if a is None:
        st.caption("No report A yet.")
        return
    if a is data:
        st.info(f"This report is A ({len(a['prompts'])} runs{settings_text(a.get('settings', {}))}): change the "
                "sidebar's settings and run the same prompts again to see B against it.")
        return
    d = guarded(diff, a, data, error_key=Forensics.ERROR)  # an uploaded A holds whatever its file held
    if d is None:
        st.error(f"Report A cannot be compared: {Forensics.ERROR.get()}")
        return
    st.markdown(f"**A**: {len(a['prompts'])} runs{settings_text(d['a_settings'])}. **B** (this report): "
                f"{len(data['prompts'])} runs{settings_text(d['b_settings'])}. {len(d['prompts'])} prompts in both.")
    st.plotly_chart(diff_figure(d), width="stretch", config={"displayModeBar": False})
    cols = st.columns([3, 2])
    with cols[0]:
        _table(diff_rows(d), DIFF_COLUMNS)
    with cols[1]:
        _table(d["prompts"], PROMPT_DIFF_COLUMNS)


def _read_baseline(upload) -> None:
    """An uploaded forensics.json as report A. Raises ForensicsError for a file that is not one."""
    try:
        data = json.loads(upload.getvalue().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ForensicsError(f"{upload.name} cannot be read as forensics ({exc})") from None
    check_forensics(data, upload.name)
    Forensics.BASELINE.set(data)


def _open_one(rows: list[dict]) -> None:
    """Pick one of the costliest rejections and open its step in the Explorer (its run replayed, no model)."""
    runs = Forensics.TRACES.get()
    c = st.columns([4, 1.4], vertical_alignment="bottom")
    i = c[0].selectbox("A costly rejection", range(len(rows)), key="fo_pick",
                       format_func=lambda i: f"{rows[i]['token']!r} ({rows[i]['class']}, depth {rows[i]['depth']}), "
                                             f"{rows[i]['trace']} step {rows[i]['step'] + 1}")
    row = rows[i]
    c[1].button("Open in the Explorer", key="fo_open", disabled=row["trace"] not in runs, on_click=open_in_explorer,
                args=(runs.get(row["trace"]), row["trace"], row["step"]), width="stretch",
                help="replays that run on the Explorer page, at the step of this rejection, with no model loaded")
