"""Forensics as figures and a self-contained HTML report, and the diff of two forensics.

Reads the plain data of ``Forensics.to_dict`` (``forensics.json``) only: the app's Forensics page, the command's
``forensics.html`` and a report opened again later draw the same figures. ``diff`` compares two forensics of the same
prompts (two pairs, methods, stop policies or temperatures): per token class and per depth, B's acceptance against
A's, and per prompt B's tokens per target call against A's.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import plotly.graph_objects as go

from .forensics import FORENSICS_SCHEMA, TOKEN_CLASSES

FONT = 15
REALISED, EXPECTED = "#3b6fb6", "#f2b134"


class ForensicsError(ValueError):
    """A forensics file that cannot be read: the message says why."""


def load_forensics(path: str | Path) -> dict:
    """A ``forensics.json`` (or the folder holding one). Raises ForensicsError for an unreadable or other file."""
    p = Path(path)
    p = p / "forensics.json" if p.is_dir() else p
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ForensicsError(f"{p}: cannot be read as forensics ({exc})") from None
    return check_forensics(data, str(p))


def check_forensics(data, name: str) -> dict:
    """``data`` if it is a forensics report of this schema with the tables a diff reads; raises ForensicsError
    naming ``name`` otherwise."""
    if not isinstance(data, dict) or data.get("forensics_schema") != FORENSICS_SCHEMA:
        raise ForensicsError(f"{name}: not a forensics.json of schema {FORENSICS_SCHEMA}")
    tables = [data.get(k) for k in ("by_class", "by_depth")]
    prompts = data.get("prompts")
    if not (all(isinstance(t, dict) and all(isinstance(r, dict) for r in t.values()) for t in tables)
            and isinstance(prompts, list) and all(isinstance(p, dict) and "prompt" in p for p in prompts)):
        raise ForensicsError(f"{name}: a forensics.json without its tables (by_class, by_depth, prompts)")
    return data


def _rates_figure(table: dict, title: str, xtitle: str | None = None, order: list | None = None) -> go.Figure:
    """Realised and expected acceptance of each group, the nodes tested written above the realised bar."""
    keys = [k for k in (order or list(table)) if k in table]
    rows = [table[k] for k in keys]
    fig = go.Figure()
    fig.add_bar(x=keys, y=[r["rate"] for r in rows], name="accepted (realised)", marker_color=REALISED,
                text=[f"{r['tested']}" for r in rows], textposition="outside",
                hovertemplate="%{x}: %{y:.2f} of %{text} tested<extra></extra>")
    if any(r["expected_rate"] is not None for r in rows):
        fig.add_bar(x=keys, y=[r["expected_rate"] for r in rows], name="expected (the rule's odds)",
                    marker_color=EXPECTED, hovertemplate="%{x}: %{y:.2f} expected<extra></extra>")
    fig.update_layout(title=title, barmode="group", height=360, font=dict(size=FONT),
                      yaxis=dict(title="acceptance", range=[0, 1.1]), xaxis=dict(title=xtitle, type="category"),
                      legend=dict(orientation="h", y=-0.3), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def _calibration_figure(table: dict) -> go.Figure:
    """Realised acceptance against the draft's confidence q (deciles): a calibrated draft follows the diagonal only
    where its q is the target's p; what the gap shows is where q is over- or under-confident for the target."""
    keys = sorted(k for k in table if k != "-")
    mids = [sum(map(float, k.split("-"))) / 2 for k in keys]
    fig = go.Figure()
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(dash="dash", color="#999"), name="q = acceptance")
    fig.add_scatter(x=mids, y=[table[k]["rate"] for k in keys], mode="lines+markers+text", name="accepted",
                    text=[str(table[k]["tested"]) for k in keys], textposition="top center",
                    line=dict(color=REALISED, width=3))
    fig.update_layout(title="Acceptance against the draft's q", height=360,
                      font=dict(size=FONT), xaxis=dict(title="draft probability q of the drafted token", range=[0, 1]),
                      yaxis=dict(title="acceptance", range=[0, 1.12]), legend=dict(orientation="h", y=-0.3),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def forensics_figures(data: dict) -> list[go.Figure]:
    """By token class, by depth, against the draft's confidence, against the target's entropy, by category (where
    there is more than one) and, with a ``diff`` in ``data``, B against A."""
    figs = [_rates_figure(data["by_class"], "Acceptance by token class", None, list(TOKEN_CLASSES)),
            _rates_figure(data["by_depth"], "Acceptance by depth", "depth"),
            _calibration_figure(data["by_confidence"]),
            _rates_figure(data["by_entropy"], "Acceptance by the target's entropy (nats)", None,
                          ["<0.1", "<0.5", "<1.0", "<2.0", ">=2.0"])]
    if len(data["by_category"]) > 1:
        figs.append(_rates_figure(data["by_category"], "Acceptance by prompt category"))
    if data.get("diff"):
        figs.append(diff_figure(data["diff"]))
    return figs


def diff(a: dict, b: dict) -> dict:
    """B against A (two ``forensics.json`` contents): per token class and per depth ``{"a", "b", "delta",
    "tested_a", "tested_b"}`` (acceptance rates; delta = b - a where both exist); per prompt present in both, the
    tokens per target call of each; ``a_settings`` and ``b_settings``: what each side's runs were."""
    def side(key):
        out = {}
        for g in sorted(set(a[key]) | set(b[key]), key=lambda k: (len(k), k)):
            ra, rb = a[key].get(g, {}), b[key].get(g, {})
            x, y = ra.get("rate"), rb.get("rate")
            out[g] = {"a": x, "b": y, "delta": None if x is None or y is None else y - x,
                      "tested_a": ra.get("tested", 0), "tested_b": rb.get("tested", 0)}
        return out

    pa = {p["prompt"]: p for p in a["prompts"]}
    prompts = [{"prompt": p["prompt"], "a": pa[p["prompt"]].get("tokens_per_target_call"),
                "b": p.get("tokens_per_target_call")} for p in b["prompts"] if p["prompt"] in pa]
    return {"by_class": side("by_class"), "by_depth": side("by_depth"), "prompts": prompts,
            "a_settings": a.get("settings", {}), "b_settings": b.get("settings", {})}


def diff_figure(d: dict) -> go.Figure:
    """B's acceptance minus A's, by token class and by depth (bars above 0: where B gains)."""
    fig = go.Figure()
    for key, name in (("by_class", "token class"), ("by_depth", "depth")):
        groups = [g for g, r in d[key].items() if r["delta"] is not None]
        fig.add_bar(x=[f"{name} {g}" if key == "by_depth" else g for g in groups],
                    y=[d[key][g]["delta"] for g in groups], name=name,
                    marker_color=[REALISED if d[key][g]["delta"] >= 0 else "#d62728" for g in groups])
    fig.update_layout(title="B against A: acceptance of B minus A", height=360, font=dict(size=FONT),
                      yaxis=dict(title="difference in acceptance"), showlegend=False,
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


def settings_text(settings: dict) -> str:
    """`` of <settings line>`` (or ``of: a; b``) for a report's heading; empty for a report without them."""
    lines = list(settings)
    return "" if not lines else f" of {lines[0]}" if len(lines) == 1 else " of: " + "; ".join(lines)


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.2f}"
        return html.escape(repr(v) if isinstance(v, str) and v.strip() != v or v == "" else str(v))

    header = "".join(f"<th>{html.escape(t)}</th>" for _, t in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k, _ in columns) + "</tr>" for r in rows)
    return f"<table><tr>{header}</tr>{body}</table>"


CONFUSION_COLUMNS = [("drafted", "drafted"), ("committed", "committed instead"), ("count", "count"),
                     ("mean_p", "mean p"), ("mean_q", "mean q"), ("near_tie_share", "near ties")]
COSTLIEST_COLUMNS = [("expected_tokens_cut", "expected tokens cut"), ("token", "token"), ("class", "class"),
                     ("depth", "depth"), ("source", "source"), ("p", "p"), ("q", "q"), ("prompt", "prompt"),
                     ("step", "step (0-based)"), ("trace", "trace")]
DIFF_COLUMNS = [("group", "group"), ("a", "A accepted"), ("b", "B accepted"), ("delta", "B - A"),
                ("tested_a", "A tested"), ("tested_b", "B tested")]
PROMPT_DIFF_COLUMNS = [("prompt", "prompt"), ("a", "A tokens / target call"), ("b", "B tokens / target call")]


def diff_rows(d: dict) -> list[dict]:
    """The diff's groups as rows: token classes, then depths (``depth N``), with A's and B's rates."""
    return ([{"group": g, **r} for g, r in d["by_class"].items()]
            + [{"group": f"depth {g}", **r} for g, r in d["by_depth"].items()])


PROMPT_COLUMNS = [("prompt", "prompt"), ("category", "category"), ("steps", "steps"),
                  ("tokens_per_target_call", "tokens / target call"), ("acceptance_length", "acceptance length")]


def forensics_html(data: dict, title: str = "Rejection forensics") -> str:
    """The report as one HTML page: the figures (Plotly.js inlined once: the page opens offline) and the tables of
    confusions, costliest rejections and prompts."""
    charts = [fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False)
              for i, fig in enumerate(forensics_figures(data))]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
            "body{font-family:system-ui,sans-serif;margin:16px;}table{border-collapse:collapse;margin:8px 0 24px;}"
            "td,th{border:1px solid #ccc;padding:3px 8px;font-size:14px;}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{data['nodes']} tested drafted nodes in {len(data['prompts'])} runs"
            f"{html.escape(settings_text(data.get('settings', {})))} "
            "(the numbers above the bars: nodes tested). "
            "Expected acceptance: the verification rule's probability that each node passes once its parent is "
            "reached; realised below expected is bad luck, both low is the draft's miss.</p>"
            + "".join(charts)
            + "<h2>Confusions: drafted token, and what the target committed instead</h2>"
            + _table(data["confusions"][:40], CONFUSION_COLUMNS)
            + "<h2>The costliest rejections</h2>" + _table(data["costliest"], COSTLIEST_COLUMNS)
            + "<h2>Per prompt</h2>" + _table(data["prompts"], PROMPT_COLUMNS) + _diff_html(data.get("diff"))
            + "</body></html>")


def _diff_html(d: dict | None) -> str:
    if not d:
        return ""
    return (f"<h2>B against A</h2><p>A:{html.escape(settings_text(d.get('a_settings', {})))}. "
            f"B:{html.escape(settings_text(d.get('b_settings', {})))}.</p>"
            + _table(diff_rows(d), DIFF_COLUMNS) + _table(d["prompts"], PROMPT_DIFF_COLUMNS))


def write_forensics_report(data: dict, out_dir: str | Path, title: str = "Rejection forensics") -> Path:
    """``OUT/forensics.html`` (``forensics_html``). Returns its path. Raises OSError where it cannot be written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "forensics.html"
    path.write_text(forensics_html(data, title), encoding="utf-8")
    return path


__all__ = ["ForensicsError", "check_forensics", "diff", "diff_figure", "diff_rows", "forensics_figures",
           "forensics_html", "load_forensics", "settings_text", "write_forensics_report"]
