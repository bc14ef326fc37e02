"""The Forensics page (issue 44): which drafted tokens the target rejects over a prompt set, where and why.

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
from ..analysis.forensics_report import (CONFUSION_COLUMNS, COSTLIEST_COLUMNS, PROMPT_COLUMNS, forensics_figures,
                                         forensics_html)
from ..analysis.prompts import PromptError, parse_prompt_lines, select_prompts
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
    agg, runs = Aggregate(), {}
    bar = st.progress(0.0, text=f"0 of {len(prompts)} prompts")
    for n, prompt in enumerate(prompts, 1):
        with engine_lock():  # an interrupted batch may still be stepping (see state.engine_lock)
            engine = make_engine(pair, settings, prompt.text, True)
            trace = engine.run()
            keep_learned(engine)
        name = f"prompt {prompt.id}"
        agg.add(trace, prompt=prompt.id, category=prompt.category or prompt.source, source=name)
        runs[name] = trace
        _keep(agg.to_dict(), runs, [])
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
            agg.add(runs[up.name], prompt=Path(up.name).stem, source=up.name)
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
    """The report on the page: the figures, the tables and the downloads."""
    st.markdown(f"**{data['nodes']}** tested drafted nodes in **{len(data['prompts'])}** runs (the numbers above "
                "the bars: nodes tested).")
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
        frame = pd.DataFrame([{label: r.get(key) for key, label in columns} for r in rows])
        st.dataframe(frame, hide_index=True, width="stretch")
        if rows is data["costliest"] and rows:
            _open_one(rows)
    c = st.columns([1, 1, 4])
    c[0].download_button("forensics.json", data=lambda: json.dumps(data, ensure_ascii=False, indent=1),
                         file_name="forensics.json", mime="application/json", key="fo_json", on_click="ignore")
    c[1].download_button("forensics.html", data=lambda: forensics_html(data), file_name="forensics.html",
                         mime="text/html", key="fo_html", on_click="ignore")


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
