"""Benchmark reports: JSON (everything), CSV (one line per run), Markdown (the summary table) and a self-contained
HTML page with Plotly charts. Plain data in, files out; no torch, so the app's Benchmarks page can read them.
"""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path

from ..trace import figures
from ..trace.jsonfile import parse_json, read_file

REPORT_NAME = "bench"
CSV_FIELDS = ("temperature", "method", "prompt", "generated_tokens", "seconds", "tokens_per_s", "target_calls",
              "tokens_per_target_call", "acceptance_rate", "mcsd_acceptance_rate", "draft_ms", "verify_ms",
              "forward_ms", "step_ms", "steps", "plain_steps", "host_syncs_per_step", "cost_ratio")


class ReportError(ValueError):
    """A benchmark report that cannot be read: the message says what is wrong."""


def _label(row: dict) -> str:
    """A summary row's method, marked where it ran without the CUDA graphs the run asked for (a self-draft)."""
    return f"{row['method']} (eager)" if row.get("eager") else row["method"]


def _f(x, nd=2, suffix=""):
    return "–" if x is None else f"{x:.{nd}f}{suffix}"


def _pct(x):
    return None if x is None else 100 * x


def markdown_table(report: dict) -> str:
    """The summary as a Markdown table, with the run's facts on top."""
    m = report["meta"]
    samples = m.get("samples", 1)
    per_prompt = f", {samples} samples per prompt at T > 0" if samples > 1 else ""
    lines = [f"**{m['prompt_set']}**, {m['max_new_tokens']} new tokens{per_prompt}, {m['pair']}, {m['dtype']} on "
             f"{m['device']}, draft {m.get('draft_quant', 'none')} ({m['machine']}; torch {m['torch']}, "
             f"transformers {m['transformers']})", "",
             "| T | method | tokens/s | speed-up vs ar | ratio vs hf-assisted | ratio vs hf-assisted-bf16 | "
             "ratio vs hf-prompt-lookup | tokens / target call | acceptance (Lu et al.) | acceptance (MCSD) | "
             "draft s | verify s | other s | engine overhead | plain steps | host syncs / step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["summary"]:
        lines.append(f"| {r['temperature']:g} | {_label(r)} | {_f(r['tokens_per_s'])} | "
                     f"{_f(r['speedup_vs_ar'], suffix='x')} | {_f(r['ratio_vs_hf'], suffix='x')} | "
                     f"{_f(r.get('ratio_vs_hf_bf16'), suffix='x')} | "
                     f"{_f(r.get('ratio_vs_hf_lookup'), suffix='x')} | "
                     f"{_f(r['tokens_per_target_call'])} | {_f(r['acceptance_rate'])} | "
                     f"{_f(r['mcsd_acceptance_rate'])} | {_f(r['draft_s'], 1)} | {_f(r['verify_s'], 1)} | "
                     f"{_f(r['other_s'], 1)} | {_f(_pct(r.get('overhead_share')), 1, ' %')} | "
                     f"{_f(_pct(r.get('plain_step_share')), 0, ' %')} | {_f(r.get('host_syncs_per_step'), 1)} |")
    return "\n".join(lines) + "\n"


def kind_table(report: dict) -> str:
    """The summary per kind of prompt (``by_kind``) as a Markdown table; empty without one. Ratios divide by the
    same kind's runs of each baseline; "x best transformers" by the fastest of the transformers baselines run."""
    if not report.get("by_kind"):
        return ""
    lanes = any(r.get("two_lane_tokens_per_s") for r in report["by_kind"])  # PEARL's two lanes, where run
    lines = ["| T | kind | method | tokens/s | x ar | x hf-assisted | x best transformers | tokens / target call | "
             "plain steps |" + (" tokens/s on two lanes |" if lanes else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if lanes else "")]
    for r in report["by_kind"]:
        lines.append(f"| {r['temperature']:g} | {r['kind']} | {_label(r)} | {_f(r['tokens_per_s'])} | "
                     f"{_f(r['speedup_vs_ar'], suffix='x')} | {_f(r['ratio_vs_hf'], suffix='x')} | "
                     f"{_f(r.get('ratio_vs_best_hf'), suffix='x')} | {_f(r['tokens_per_target_call'])} | "
                     f"{_f(_pct(r.get('plain_step_share')), 0, ' %')} |"
                     + (f" {_f(r.get('two_lane_tokens_per_s'))} |" if lanes else ""))
    return "\n".join(lines) + "\n"


def lanes_table(report: dict) -> str:
    """PEARL's rows on two lanes (``trace/lanes.py``) as a Markdown table; empty where no row has them. A label with
    ``+lanes=threads`` ran its draft in a thread of its own (measured); the others ran on one lane, their two-lane
    time simulated from the forward costs they measured."""
    rows = [r for r in report["summary"] if r.get("two_lane_tokens_per_s")]
    if not rows:
        return ""
    lines = ["| T | method | lanes | tokens/s as run | tokens/s on two lanes | x ar | x sd | tokens / target call |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        how = "two threads, measured" if "lanes=threads" in r["method"] else "one, two simulated"
        lines.append(f"| {r['temperature']:g} | {_label(r)} | {how} | {_f(r['tokens_per_s'])} | "
                     f"{_f(r['two_lane_tokens_per_s'])} | {_f(r.get('two_lane_speedup_vs_ar'), suffix='x')} | "
                     f"{_f(r.get('two_lane_ratio_vs_sd'), suffix='x')} | {_f(r['tokens_per_target_call'])} |")
    return "\n".join(lines) + "\n"


def _html_table(md: str) -> str:
    """A Markdown table (header, rule, rows) as an HTML table."""
    lines = [line for line in md.splitlines() if line.startswith("|")]
    cells = [[html.escape(c.strip()) for c in line.strip("|").split("|")] for line in lines]
    header = "".join(f"<th>{c}</th>" for c in cells[0])
    rows = "".join(f"<tr>{''.join(f'<td>{c}</td>' for c in row)}</tr>" for row in cells[2:])
    return f"<table><tr>{header}</tr>{rows}</table>"


def write_reports(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.csv``, ``bench.md`` and ``bench.html`` into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"{REPORT_NAME}.{ext}" for ext in ("json", "csv", "md", "html")}
    paths["json"].write_text(json.dumps(report, indent=1), encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(report["runs"])
    table, kinds, lanes = markdown_table(report), kind_table(report), lanes_table(report)
    paths["md"].write_text(table + (f"\nPEARL on two lanes:\n\n{lanes}" if lanes else "")
                           + (f"\nBy kind of prompt:\n\n{kinds}" if kinds else ""), encoding="utf-8")
    charts = [fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False)
              for i, fig in enumerate(figures.bench_figures(report))]
    by_kind = (f"<h2>PEARL on two lanes</h2>{_html_table(lanes)}" if lanes else "") + (
        f"<h2>By kind of prompt</h2>{_html_table(kinds)}" if kinds else "")
    paths["html"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Speculative decoding benchmark</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 8px;border-bottom:1px solid #ddd}"
        "</style></head><body><h1>Speculative decoding benchmark</h1>"
        f"<p>{html.escape(table.splitlines()[0].replace('**', ''))}</p>"
        f"{_html_table(table)}{by_kind}{''.join(charts)}</body></html>", encoding="utf-8")
    return paths


MAX_REPORT_BYTES = 20 * 1024 * 1024


def loads_report(text: str | bytes) -> dict:
    """Parse a ``bench.json``. Raises ReportError when too large, not JSON, or not a benchmark report."""
    data = parse_json(text, ReportError, "report", MAX_REPORT_BYTES)
    if not isinstance(data, dict) or not {"meta", "summary", "runs"} <= set(data) \
            or not isinstance(data["summary"], list):
        raise ReportError("this is not a benchmark report (needs meta, summary and runs from `explorer bench`)")
    return data


def load_report(path: str | Path) -> dict:
    """Read a ``bench.json`` file. Raises ReportError when unreadable or not a benchmark report."""
    return loads_report(read_file(path, ReportError))
