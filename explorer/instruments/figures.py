"""Plotly figures of the instruments' plain data (probe results, acceptance reports, tree templates): data in,
figure out, no model and no torch."""

from __future__ import annotations

import networkx as nx
import plotly.graph_objects as go

from ..trace.figures import token_label, tree_layout


def probe_rows(probe: dict) -> list[dict]:
    """One table row per tree-forward row of a probe (``StepProbe.to_dict()``)."""
    rows = []
    for r in probe["rows"]:
        ref = r["top2_reference"]
        rows.append({"node": r["node"], "token": token_label(r["text"], 20, escape=False),
                     "max |Δ logit|": r["max_delta_logit"],
                     "best (tree)": token_label(r["top2_tree"][0][1], 12, escape=False),
                     "best (plain)": token_label(ref[0][1], 12, escape=False), "argmax flips": r["argmax_flip"],
                     "top-2 gap": r["top2_gap"], "gap (rounding steps)": r["gap_steps"]})
    return rows


def probe_figure(probe: dict) -> go.Figure:
    """Per row: max |delta logit| between the tree forward and plain decoding, beside the row's top-two gap
    (both in logits), log scale; a row whose gap is below its delta can flip."""
    rows = probe["rows"]
    x = [f"{r['node']} {token_label(r['text'], 8)}" for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=[max(r["max_delta_logit"], 1e-9) for r in rows], name="max |Δ logit|",
                         marker_color=["#e377c2" if r["argmax_flip"] else "#1f77b4" for r in rows]))
    fig.add_trace(go.Scatter(x=x, y=[max(r["top2_gap"], 1e-9) for r in rows], mode="markers",
                             name="top-2 gap (plain decoding)", marker=dict(color="#ff7f0e", size=9,
                                                                            symbol="diamond")))
    fig.update_layout(title=f"Step {probe['step'] + 1}: tree forward against plain decoding ({probe['dtype']})",
                      yaxis=dict(type="log", title="logits"), xaxis=dict(title="row (node id, token)"),
                      height=340, margin=dict(l=10, r=10, t=60, b=10),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def slot_heatmap(slots: list[dict], which: str = "realised") -> go.Figure:
    """Acceptance rate by draft depth (rows) and sibling rank in test order (columns): ``realised`` (accepted /
    tested) or ``expected`` (mean slot probability); each cell shows the rate and how many nodes were tested."""
    if not slots:
        return go.Figure().update_layout(title="no tested nodes yet", height=200)
    depths = sorted({c["depth"] for c in slots})
    ranks = sorted({c["rank"] for c in slots})
    z = [[None] * len(ranks) for _ in depths]
    text = [[""] * len(ranks) for _ in depths]
    for c in slots:
        i, j = depths.index(c["depth"]), ranks.index(c["rank"])
        rate = c[f"{which}_rate"]
        z[i][j] = rate
        text[i][j] = f"{rate:.2f}<br>n={c['tested']}"
    fig = go.Figure(go.Heatmap(z=z, x=[f"rank {r}" for r in ranks], y=[f"depth {d}" for d in depths], zmin=0,
                               zmax=1, colorscale="Viridis", text=text, texttemplate="%{text}",
                               hovertemplate="%{y}, %{x}: %{z:.3f}<extra></extra>"))
    fig.update_layout(title=dict(text=f"{which.capitalize()} acceptance",
                                 subtitle=dict(text="by depth and sibling rank")), height=120 + 45 * len(depths),
                      yaxis=dict(autorange="reversed"), margin=dict(l=10, r=10, t=95, b=10))
    return fig


def expected_realised_figure(per_step: list[dict]) -> go.Figure:
    """Tokens each step committed against what it was expected to commit given its tree."""
    x = [r["step"] + 1 for r in per_step]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=[r["realised"] for r in per_step], name="committed", marker_color="#2ca02c",
                         opacity=0.6))
    fig.add_trace(go.Scatter(x=x, y=[r["expected"] for r in per_step], mode="lines+markers", name="expected",
                             line=dict(color="#1f77b4")))
    fig.update_layout(title=dict(text="Tokens per step", subtitle=dict(text="expected given the tree, and committed")),
                      height=300,
                      xaxis=dict(title="step", dtick=max(1, len(x) // 20)), yaxis=dict(title="tokens"),
                      margin=dict(l=10, r=10, t=95, b=10), legend=dict(orientation="h", yanchor="bottom", y=1.0))
    return fig


def position_figure(positions: list[dict]) -> go.Figure:
    """vLLM's per-position acceptance: accepted at draft position i / drafted at position i."""
    fig = go.Figure(go.Bar(x=[p["position"] for p in positions], y=[p["rate"] for p in positions],
                           text=[f"{p['accepted']}/{p['drafted']}" for p in positions], textposition="outside",
                           marker_color="#9467bd"))
    fig.update_layout(title="Acceptance per draft position", height=300, yaxis=dict(range=[0, 1.1], title="rate"),
                      xaxis=dict(title="draft position (depth)", dtick=1), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def cost_figure(costs: dict) -> go.Figure:
    """Measured milliseconds of one forward against its query rows, per model."""
    fig = go.Figure()
    widths: set[int] = set()
    for role, color in (("target", "#d62728"), ("draft", "#9467bd")):
        points = {int(k): v for k, v in (costs.get(role) or {}).items()}
        rows = sorted(points)
        widths.update(rows)
        fig.add_trace(go.Scatter(x=rows, y=[points[k] for k in rows], mode="lines+markers", name=f"{role} forward",
                                 line=dict(color=color)))
    ticks = sorted(widths)
    fig.update_layout(title="Forward cost on this machine", height=300, margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(title="query rows", type="log", tickvals=ticks, ticktext=[str(t) for t in ticks]),
                      yaxis=dict(title="ms", rangemode="tozero"))
    return fig


def template_figure(parents: list[int], probabilities: list[float] | None = None, title: str = "") -> go.Figure:
    """A tree shape (breadth-first ``parents``, -1 = the anchor) drawn like the step trees, nodes coloured by
    their probability of being accepted (``probabilities``, one per node)."""
    g = nx.DiGraph()
    g.add_node(0, depth=0)
    for i, p in enumerate(parents):
        g.add_node(i + 1, depth=g.nodes[p + 1]["depth"] + 1)
        g.add_edge(p + 1, i + 1)
    pos = tree_layout(g)
    ex, ey = [], []
    for a, b in g.edges:
        ex += [pos[a][0], pos[b][0], None]
        ey += [pos[a][1], pos[b][1], None]
    fig = go.Figure(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#999", width=1), hoverinfo="skip",
                               showlegend=False))
    probs = probabilities or [0.0] * len(parents)
    fig.add_trace(go.Scatter(x=[pos[0][0]], y=[pos[0][1]], mode="markers", marker=dict(size=14, color="#7f8c8d"),
                             hovertext=["anchor"], hoverinfo="text", showlegend=False))
    fig.add_trace(go.Scatter(
        x=[pos[i + 1][0] for i in range(len(parents))], y=[pos[i + 1][1] for i in range(len(parents))],
        mode="markers", showlegend=False, hoverinfo="text",
        hovertext=[f"node {i + 1} (parent {p + 1}): P(accepted) {pr:.3f}" for i, (p, pr) in
                   enumerate(zip(parents, probs))],
        marker=dict(size=13, color=probs, cmin=0, cmax=1, colorscale="Viridis",
                    colorbar=dict(title="P(acc.)", thickness=10))))
    leaves = sum(1 for n in g.nodes if g.out_degree(n) == 0)
    fig.update_layout(title=title, height=max(260, min(700, 16 * leaves + 120)), margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(title="depth", dtick=1, zeroline=False), yaxis=dict(visible=False))
    return fig


PHASE_COLORS = {"drafting": "#c5b0d5", "draft forward": "#9467bd", "mask": "#c7c7c7", "target forward": "#d62728",
                "verification": "#2ca02c", "odds": "#98df8a", "drafter learn": "#ff7f0e", "KV-cache commit": "#1f77b4",
                "trace recording": "#7f7f7f"}


def waterfall_figure(step) -> go.Figure:
    """One step's timeline as a waterfall: a bar per segment from its start to its end (ms), forwards with their
    query rows (and device milliseconds on CUDA), a lane's segments (a draft thread of its own) marked."""
    segs = step.timeline
    labels = [f"{i + 1}. {s['phase']}" + (f" ({s['rows']} row{'s' if s['rows'] > 1 else ''})" if s.get("rows") else "")
              + (f" [{s['lane']} lane]" if s.get("lane") else "") for i, s in enumerate(segs)]
    fig = go.Figure(go.Bar(
        y=labels, x=[s["ms"] for s in segs], base=[s["start_ms"] for s in segs], orientation="h",
        marker_color=[PHASE_COLORS.get(s["phase"], "#bcbd22") for s in segs],
        hovertext=[f"{s['phase']}: {s['ms']:.2f} ms from {s['start_ms']:.2f} ms"
                   + (f", device {s['gpu_ms']:.2f} ms" if "gpu_ms" in s else "") for s in segs], hoverinfo="text"))
    total = sum(s["ms"] for s in segs if "lane" not in s)  # a lane's segments overlap the main thread's
    fig.update_layout(title=f"Step {step.index + 1}: where {total:.1f} ms went", height=120 + 24 * len(segs),
                      yaxis=dict(autorange="reversed"), xaxis=dict(title="ms since the step started"),
                      margin=dict(l=10, r=10, t=50, b=10), showlegend=False)
    return fig


def run_time_figure(totals: dict[str, float], plain_ms: float | None, tokens: int) -> go.Figure:
    """Over the run: milliseconds per phase, stacked, beside what plain decoding would have cost for the same
    tokens (one-row target forward x tokens)."""
    fig = go.Figure()
    for phase, ms in totals.items():
        fig.add_trace(go.Bar(x=["this run"], y=[ms / 1e3], name=phase, marker_color=PHASE_COLORS.get(phase)))
    if plain_ms is not None:
        fig.add_trace(go.Bar(x=["plain decoding (estimate)"], y=[plain_ms / 1e3], name="target forwards, 1 row",
                             marker_color="#ff9896"))
    fig.update_layout(barmode="stack", title=f"Where the run's time went ({tokens} tokens)", height=360,
                      yaxis=dict(title="seconds"), margin=dict(l=10, r=10, t=50, b=10))
    return fig


def reliability_figure(report: dict) -> go.Figure:
    """Predicted against realised acceptance per score bin (marker size: nodes), with the diagonal."""
    rows = report["reliability"]
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color="#999", dash="dot"),
                               name="calibrated", hoverinfo="skip"))
    if rows:
        most = max(r["count"] for r in rows)
        fig.add_trace(go.Scatter(x=[r["predicted"] for r in rows], y=[r["realised"] for r in rows],
                                 mode="lines+markers", name="accepted (decision)",
                                 marker=dict(size=[8 + 22 * r["count"] / most for r in rows], color="#1f77b4"),
                                 hovertext=[f"{r['count']} nodes" for r in rows], hoverinfo="text+x+y"))
        fig.add_trace(go.Scatter(x=[r["predicted"] for r in rows], y=[r["realised_soft"] for r in rows],
                                 mode="lines+markers", name="P(accept | token)", marker=dict(color="#2ca02c")))
    fig.update_layout(title=dict(text="Reliability",
                                 subtitle=dict(text=f"{report['policy']} score against acceptance")), height=360,
                      xaxis=dict(title="predicted (score)", range=[0, 1]), yaxis=dict(title="realised", range=[0, 1]),
                      margin=dict(l=10, r=10, t=95, b=10), legend=dict(orientation="h", yanchor="bottom", y=1.0))
    return fig


def roc_figure(report: dict) -> go.Figure:
    """The score's ROC curve against the accept decision, the operating point of the run's threshold marked."""
    r = report["roc"]
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color="#999", dash="dot"),
                               showlegend=False, hoverinfo="skip"))
    auc = r["auc"]
    fig.add_trace(go.Scatter(x=r["fpr"], y=r["tpr"], mode="lines", name=f"ROC (AUC {auc:.3f})" if auc else "ROC",
                             line=dict(color="#d62728")))
    op = report.get("operating_point")
    if op and op["tpr"] is not None and op["fpr"] is not None:
        fig.add_trace(go.Scatter(x=[op["fpr"]], y=[op["tpr"]], mode="markers", name=f"threshold {op['threshold']:.2f}",
                                 marker=dict(size=14, color="#ff7f0e", symbol="x")))
    fig.update_layout(title=dict(text="ROC", subtitle=dict(text="the score as a predictor of acceptance")), height=360,
                      xaxis=dict(title="false positive rate (rejected, kept drafting)", range=[0, 1]),
                      yaxis=dict(title="true positive rate (accepted, kept)", range=[0, 1]),
                      margin=dict(l=10, r=10, t=95, b=10), legend=dict(orientation="h", yanchor="bottom", y=1.0))
    return fig


def threshold_cost_figure(report: dict) -> go.Figure:
    """Draft forwards and committed tokens of the recorded steps under each threshold (what-if replay)."""
    rows = report["threshold_costs"]
    x = [r["threshold"] for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[r["draft_levels"] for r in rows], mode="lines+markers", name="draft forwards",
                             line=dict(color="#9467bd")))
    fig.add_trace(go.Scatter(x=x, y=[r["tokens"] for r in rows], mode="lines+markers", name="committed tokens",
                             line=dict(color="#2ca02c")))
    if report.get("threshold") is not None:
        fig.add_vline(x=report["threshold"], line=dict(color="#ff7f0e", dash="dash"))
    fig.update_layout(title=dict(text="What each threshold would have cost",
                                 subtitle=dict(text="over the recorded steps")), height=360,
                      xaxis=dict(title="threshold"), yaxis=dict(title="count", rangemode="tozero"),
                      margin=dict(l=10, r=10, t=95, b=10), legend=dict(orientation="h", yanchor="bottom", y=1.0))
    return fig


def learning_figure(history: list[dict], who: str = "head") -> go.Figure:
    """An online-distilled head's (``who``: head) or draft adapter's (``who``: draft adapter) acceptance by request
    (the distiller's ``history``, ``engine/online_distill*.py``): the first-position acceptance of each finished
    request, coloured by the version that drafted it, and the update's loss where one followed."""
    xs = [row["request"] for row in history]
    fig = go.Figure(go.Scatter(
        x=xs, y=[row.get("first_acceptance") for row in history], mode="lines+markers", name="first-position "
        "acceptance", marker=dict(color=[row["version"] for row in history], colorscale="Viridis", size=9,
                                  colorbar=dict(title=f"{who} version", thickness=10)),
        hovertext=[f"request {row['request']}, {who} version {row['version']}: {row['rejections']} rejections kept"
                   + (f"; update, loss {row['loss']:.3f}" if row.get("updated") else "") for row in history],
        hoverinfo="text+y"))
    fig.update_layout(title=f"The {who} learning: acceptance by request", height=320,
                      xaxis=dict(title="request", dtick=max(1, len(xs) // 8)),
                      yaxis=dict(title="first-position acceptance", range=[0, 1.05]),
                      margin=dict(l=10, r=10, t=50, b=10), showlegend=False)
    return fig
