"""The classroom's race and speedup curve, from recorded traces only (no torch, no model).

* **The race**: a speculative run and plain decoding (``ar``) on the same prompt as two lanes on one wall-clock axis,
  from their measured step timelines (the prefill, then each step's drafting, verification and commit), with the
  tokens counted as they are committed and both finishing times. A plain step the goodput fallback took is marked
  with its reason. A PEARL run takes two rows, its draft lane and its target lane, on its two-lane clock
  (``trace/lanes.py``: simulated for two devices from the forward costs it measured, or measured where its draft ran
  in a thread of its own), and the title says which.
* **The speedup curve**: the expected speedup of a chain of gamma draft tokens against the acceptance rate alpha,
  for a cost ratio c (a draft forward over a target forward): ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``
  (Leviathan et al. 2023, Theorem 3.8). For a tree, the expected tokens of the run's mean tree shape (``widths``:
  candidates per parent at each level) where each candidate is accepted with probability alpha independently, as
  MCSD's analysis treats its k candidates (Yang et al. 2024): a level is passed with probability
  ``1 - (1 - alpha)^width``, so tokens per target call ``= 1 + sum_l prod_{j<=l} (1 - (1 - alpha)^w_j)`` over
  ``len(widths) c + 1`` target-forward costs (one draft forward per level). With every width 1 this is Leviathan's
  chain. The run's measured point: its acceptance and its speedup over the recorded ``ar`` run (``measured_point``).
  ``speedup_figure`` draws the curve for one cost ratio with the run's point; ``speedup_curves`` is the curve at
  every stop of the lesson player's cost slider (``SPEEDUP_COSTS``), all computed by ``engine.speedup.tree_speedup``:
  the player (``player.py``) only swaps in the curve for the slider's stop.
"""

from __future__ import annotations

import plotly.graph_objects as go

from ..engine.speedup import fitted_alpha, tree_speedup
from ..trace import lanes as two_lanes
from ..trace.records import RunTrace

LANE_PARTS = {"drafting": "draft", "draft forward": "draft", "mask": "verify", "target forward": "verify",
              "odds": "verify", "verification": "verify", "drafter learn": "commit",
              "stop-policy adaptation": "commit", "KV-cache commit": "commit", "trace recording": "commit"}
PART_COLORS = {"prefill": "#7f7f7f", "draft": "#f2b134", "verify": "#3b6fb6", "commit": "#2ca02c",
               "other": "#c7c7c7"}


def lane_segments(run: RunTrace) -> list[dict]:
    """The run on a wall clock: ``[{"part", "start_ms", "ms", "step"}]`` from the prefill through every step's
    timeline segments (merged where consecutive segments belong to the same part); ``step`` is None for the
    prefill. Steps without a timeline count as one ``other`` segment of ``step_ms``. The main thread's segments only
    (a lane's overlap them: ``trace.lanes.lane_rows`` lays those out)."""
    out = [{"part": "prefill", "start_ms": 0.0, "ms": float(run.prefill_ms), "step": None}]
    clock = float(run.prefill_ms)
    for step in run.steps:
        segments = [s for s in step.timeline if "lane" not in s] or [{"phase": "other", "ms": step.step_ms}]
        for seg in segments:
            part = LANE_PARTS.get(seg["phase"], "other")
            if out[-1]["step"] == step.index and out[-1]["part"] == part:
                out[-1]["ms"] += seg["ms"]
            else:
                out.append({"part": part, "start_ms": clock, "ms": float(seg["ms"]), "step": step.index})
            clock += seg["ms"]
    return out


def commit_times(run: RunTrace) -> list[tuple[float, int]]:
    """``(ms since the start, tokens committed so far)`` at the end of every step (a PEARL run's on its two-lane
    clock)."""
    if two_lanes.is_parallel(run):
        return [(e["end_ms"], e["tokens"]) for e in two_lanes.two_lane_clock(run)]
    clock, tokens, out = float(run.prefill_ms), 0, []
    for step in run.steps:
        clock += sum(seg["ms"] for seg in step.timeline if "lane" not in seg) if step.timeline else step.step_ms
        tokens += len(step.committed_ids)
        out.append((clock, tokens))
    return out


def race_figure(run: RunTrace, baseline: RunTrace, label: str, font: int = 16, machine: str = "") -> go.Figure:
    """Two lanes on one wall-clock axis (ms): ``label`` (the speculative run) above ``ar`` (``baseline``). Bars are
    the parts of each step (draft, verify, commit; the prefill first), the numbers above them the tokens committed
    so far; both finishing times are marked. A plain step of the goodput fallback shows its reason on hover. A PEARL
    run (``label``) takes two rows, ``label · draft`` and ``label · target`` (``trace.lanes.lane_rows``)."""
    fig = go.Figure()
    parallel = two_lanes.is_parallel(run)
    lanes = [(label, run), ("ar (plain decoding)", baseline)]
    seen = set()
    for name, trace in lanes:
        reasons = {s.index: s.fallback.get("reason", "") for s in trace.steps
                   if s.fallback and not s.fallback.get("speculate", True)}
        rows = ({f"{name} · draft": (r := two_lanes.lane_rows(trace))["draft"], f"{name} · target": r["target"]}
                if trace is run and parallel else {name: lane_segments(trace)})
        for row, segments in rows.items():
            by_part: dict[str, list[dict]] = {}
            for seg in segments:
                by_part.setdefault(seg["part"], []).append(seg)
            for part, segs in by_part.items():
                hover = []
                for seg in segs:
                    step = seg["step"]
                    where = f", step {step + 1}" if step is not None else ""
                    text = f"{row}<br>{part}{where}: {seg['ms']:.0f} ms"
                    hover.append(text + (f"<br>plain step (fallback): {reasons[step]}" if step in reasons else ""))
                fig.add_trace(go.Bar(y=[row] * len(segs), x=[seg["ms"] for seg in segs],
                                     base=[seg["start_ms"] for seg in segs], orientation="h", name=part,
                                     marker=dict(color=PART_COLORS[part], line=dict(color="#fff", width=0.5)),
                                     hovertext=hover, hoverinfo="text", showlegend=part not in seen,
                                     legendgroup=part))
                seen.add(part)
        name = f"{name} · target" if trace is run and parallel else name
        times = commit_times(trace)
        fig.add_trace(go.Scatter(x=[t for t, _ in times], y=[name] * len(times), mode="markers",
                                 marker=dict(symbol="line-ns-open", size=26, color="#000"), hoverinfo="text",
                                 hovertext=[f"{n} tokens at {t:.0f} ms" for t, n in times], showlegend=False))
        end, tokens = times[-1] if times else (float(trace.prefill_ms), 0)
        fig.add_annotation(x=end, y=name, text=f"<b>{end / 1e3:.2f} s</b> · {tokens} tokens", showarrow=False,
                           xanchor="left", xshift=6, font=dict(size=font))
    ends = [commit_times(t)[-1][0] for _, t in lanes if t.steps]
    title = "The race: the same prompt, measured step timelines"
    if parallel:
        title = ("The race: PEARL's lanes measured in two threads" if two_lanes.measured_lanes(run)
                 else "The race: PEARL's lanes simulated for two devices")
    fig.update_layout(
        barmode="overlay", height=260 + (50 if parallel else 0), margin=dict(l=10, r=10, t=60, b=10),
        font=dict(size=font),
        title=dict(text=title + (f" ({machine})" if machine else ""), font=dict(size=font + 2)),
        xaxis=dict(title="wall clock (ms)", range=[0, max(ends, default=1) * 1.3]),
        yaxis=dict(autorange="reversed"),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0.5, font=dict(size=font)))
    return _sized(fig, font)


def _sized(fig: go.Figure, font: int) -> go.Figure:
    """Every text of ``fig`` at ``font`` px: axis ticks and titles too (a page's chart theme sets its own)."""
    axis = dict(tickfont=dict(size=font), title_font=dict(size=font))
    return fig.update_layout(font=dict(size=font), legend_font=dict(size=font), xaxis=axis, yaxis=axis)


def mean_widths(run: RunTrace) -> list[float]:
    """The run's mean tree shape: for each level up to the rounded mean depth of the steps that drafted, the mean
    number of candidates per parent (nodes at that level over nodes at the level above) over the steps that
    reached it. A chain gives ``[1.0] * gamma``; ``[]`` when no step drafted."""
    trees = [s.nodes for s in run.steps if len(s.nodes) > 1]
    if not trees:
        return []
    depth = round(sum(max(n.depth for n in nodes) for nodes in trees) / len(trees))
    widths = []
    for level in range(1, depth + 1):
        ratios = []
        for nodes in trees:
            above = sum(n.depth == level - 1 for n in nodes)
            here = sum(n.depth == level for n in nodes)
            if here and above:
                ratios.append(here / above)
        widths.append(sum(ratios) / len(ratios) if ratios else 1.0)
    return widths


def measured_point(run: RunTrace, baseline: RunTrace) -> dict:
    """What the run measured: ``widths`` (``mean_widths``), ``gamma`` (their number: the mean draft depth),
    ``alpha`` (for a chain, accepted over drafted tokens; for a tree, the per-candidate acceptance under which the
    mean tree accepts the run's mean accepted tokens per drafting step: ``alpha_fitted`` True), ``c`` (mean draft
    forward over mean target forward, from the timelines; None without draft forwards) and ``speedup`` (its tokens
    per second over the baseline's)."""
    drafted = sum(s.drafted for s in run.steps)
    accepted = sum(s.accepted_draft_len for s in run.steps)
    widths = mean_widths(run)
    chain = all(abs(w - 1.0) < 1e-9 for w in widths)
    if chain or not widths:
        alpha = accepted / drafted if drafted else 0.0
    else:
        drafting = [s for s in run.steps if len(s.nodes) > 1]
        alpha = fitted_alpha(widths, sum(s.accepted_draft_len for s in drafting) / len(drafting))
    forwards = {"draft forward": [], "target forward": []}
    for s in run.steps + baseline.steps:
        for seg in s.timeline:
            if seg["phase"] in forwards:
                forwards[seg["phase"]].append(seg["ms"])
    draft, target = forwards["draft forward"], forwards["target forward"]
    c = (sum(draft) / len(draft)) / (sum(target) / len(target)) if draft and target else None

    def rate(trace):
        end = commit_times(trace)[-1][0] if trace.steps else 0.0
        return len(trace.generated_ids) / end if end > 0 else 0.0

    return {"alpha": alpha, "alpha_fitted": not chain and bool(widths), "widths": widths, "gamma": len(widths),
            "c": c, "speedup": rate(run) / rate(baseline) if rate(baseline) else 0.0}


SPEEDUP_ALPHAS = tuple(i / 50 for i in range(51))  # the curve's acceptance rates: 0 to 1 in steps of 0.02
SPEEDUP_COSTS = tuple(i / 50 for i in range(51))  # the player's cost slider: c from 0 to 1 in steps of 0.02
SPEEDUP_DIGITS = 4  # the curve's speedups are rounded to this many decimals (a page holds 51 curves per lane)


def speedup_points(widths: list[float], c: float) -> list[float]:
    """The expected speedup (``engine.speedup.tree_speedup``) of a tree of ``widths`` per level (a chain where every
    width is 1; ``[]``, a run that never drafted, counts as a chain of one) at every acceptance rate of
    ``SPEEDUP_ALPHAS``, at cost ratio ``c``, rounded to ``SPEEDUP_DIGITS`` decimals."""
    widths = list(widths) or [1.0]
    return [round(tree_speedup(alpha, widths, c), SPEEDUP_DIGITS) for alpha in SPEEDUP_ALPHAS]


def speedup_curve(widths: list[float], c: float) -> go.Scatter:
    """The expected speedup against acceptance at cost ratio ``c`` (``speedup_points``): the curve the cost slider
    moves."""
    return go.Scatter(x=list(SPEEDUP_ALPHAS), y=speedup_points(widths, c), mode="lines", name=f"expected, c = {c:.2f}",
                      line=dict(width=3, color="#3b6fb6"))


def speedup_curves(point: dict) -> list[go.Scatter]:
    """``speedup_curve`` of the run's mean tree (``measured_point``'s ``widths``) at every ``SPEEDUP_COSTS`` stop."""
    return [speedup_curve(point["widths"], c) for c in SPEEDUP_COSTS]


def slider_stop(c: float | None) -> int:
    """The index in ``SPEEDUP_COSTS`` nearest to a measured cost ratio ``c`` (0.2 where none was measured; a ratio
    above 1 at the slider's end)."""
    c = 0.2 if c is None else c
    return min(range(len(SPEEDUP_COSTS)), key=lambda i: abs(SPEEDUP_COSTS[i] - c))


def speedup_figure(point: dict, c: float, font: int = 16) -> go.Figure:
    """Expected speedup against acceptance for the run's mean tree (``measured_point``): the curve at cost ratio
    ``c`` first (``speedup_curve``: the trace the player's slider replaces), the curve at the measured cost ratio
    (dotted, where one was measured), and the run's own point (a star labelled with its measured speedup); the
    break-even line at 1."""
    fig = go.Figure(speedup_curve(point["widths"], c))
    if point["c"] is not None:
        fig.add_trace(go.Scatter(x=list(SPEEDUP_ALPHAS), y=speedup_points(point["widths"], point["c"]), mode="lines",
                                 name=f"at the measured c = {point['c']:.2f}", line=dict(dash="dot", color="#888")))
    fig.add_trace(go.Scatter(x=[point["alpha"]], y=[point["speedup"]], mode="markers+text", name="this run",
                             text=[f"{point['speedup']:.2f}x"], cliponaxis=False,
                             textposition="top left" if point["alpha"] > 0.85 else "top center",
                             marker=dict(size=16, color="#d62728", symbol="star")))
    tree = point["alpha_fitted"]  # a tree's alpha is per candidate (MCSD's independent candidates)
    fig.update_layout(
        title=dict(text="Speedup against acceptance: " + ("a tree" if tree else "a chain"), font=dict(size=font + 2),
                   yref="container", y=0.99, yanchor="top"),
        margin=dict(l=60, r=20, t=50, b=50), hoverlabel=dict(font=dict(size=font)),
        xaxis=dict(title=dict(text="acceptance rate α" + (" per candidate" if tree else "")), range=[0, 1],
                   automargin=True),
        yaxis=dict(title=dict(text="speedup over ar"), automargin=True),
        shapes=[dict(type="line", xref="paper", x0=0, x1=1, y0=1, y1=1, line=dict(dash="dash", width=1))],
        legend=dict(x=0.01, y=0.99, bgcolor="rgba(255,255,255,0.8)"))
    return _sized(fig, font)


__all__ = ["SPEEDUP_ALPHAS", "SPEEDUP_COSTS", "commit_times", "lane_segments", "mean_widths", "measured_point",
           "race_figure", "slider_stop", "speedup_curve", "speedup_curves", "speedup_figure", "speedup_points"]
