"""Plotly figures built from traces only (no torch, no model): the draft tree, the topology-aware mask, per-branch
acceptance, stop signals, and the run so far.

Every token string that reaches a figure goes through ``token_label`` (visible whitespace, HTML-escaped: Plotly
renders a subset of HTML in labels, so a token like ``<br>`` must not become markup).
"""

from __future__ import annotations

import html
import math

import networkx as nx
import plotly.graph_objects as go

from . import lanes as two_lanes
from .records import ACCEPTED, CONTEXT, DRAFTED, REJECTED, SOURCE_LABELS, UNVERIFIED, RunTrace, StepTrace

STATUS_COLORS = {CONTEXT: "#7f8c8d", DRAFTED: "#f2b134", ACCEPTED: "#2ca02c", REJECTED: "#d62728",
                 UNVERIFIED: "#c7c7c7"}
STATUS_LABELS = {CONTEXT: "last committed token", DRAFTED: "drafted, not yet verified", ACCEPTED: "accepted",
                 REJECTED: "rejected", UNVERIFIED: "not verified"}
BONUS_COLOR = "#1f77b4"
SOURCE_SYMBOLS = {CONTEXT: "circle", "draft": "circle", "target": "diamond", "lookup": "square",
                  "recycled": "triangle-up", "plugin": "hexagon"}
SOURCE_COLORS = {CONTEXT: "#7f8c8d", "draft": "#9467bd", "target": "#8c564b", "lookup": "#ff7f0e",
                 "recycled": "#17becf", "plugin": "#bcbd22"}


def token_label(text: str, limit: int = 16, escape: bool = True) -> str:
    """Printable label for a token: whitespace made visible, long tokens shortened, HTML-escaped unless
    ``escape=False`` (for widgets that show text verbatim, such as tables). Quotes stay as they are: Plotly
    decodes only a few named entities (``&lt;``, ``&gt;``, ``&amp;``), so ``&quot;`` would show literally, and a
    quote cannot open a tag without ``<``."""
    shown = text.replace("\n", "↵").replace("\t", "⇥")
    if not text.strip():  # an all-whitespace token: show its spaces
        shown = shown.replace(" ", "␣")
    if shown == "":
        shown = "∅"
    if len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return html.escape(shown, quote=False) if escape else shown


def node_label(node) -> str:
    """Unique label "(id) token" (Plotly merges duplicate axis labels)."""
    return f"({node.id}) {token_label(node.text, 12)}"


def _fmt(x, digits=3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def provenance_text(node) -> str | None:
    """Where a free node (prompt lookup, Token Recycling) or an edited one came from, in one plain sentence; None
    for others."""
    prov = node.provenance or {}
    if prov.get("source") == "edited":
        return ("added by hand (a counterfactual edit)" if prov.get("edit") == "added" else
                f"replaced by hand (a counterfactual edit; the draft had proposed token {prov.get('was')})")
    if prov.get("source") == "lookup":
        where = "the prompt" if prov.get("in_prompt") else "the output so far"
        return (f"copied from position {prov['copied_from']} ({where}): it followed an earlier "
                f"“{token_label(prov.get('match_text', '?'), 30, escape=False)}” ({prov['ngram']}-gram match at "
                f"position {prov['match_at']})")
    if prov.get("gumbel_key") is not None:  # RSD-S's stochastic beam search (plugins/bundled/rsd.py)
        return (f"drawn by stochastic beam search (RSD-S): Gumbel key {prov['gumbel_key']:.3f}; siblings are "
                "verified in descending key order, the order they were drawn in")
    if prov.get("pearl") == "carried":  # PEARL (plugins/bundled/pearl.py): drafted last round, read by the target now
        return (f"drafted in step {prov['drafted_in_step'] + 1} while the target verified, and verified in this one: "
                "PEARL's post-verify")
    if prov.get("pearl") == "new":
        return ("drafted in this step while the target ran: the target's forward could not read it, so it is "
                "tested from its parent's row and, accepted, has no bonus token after it")
    if prov.get("plugin"):  # a plugin's node: its name, then what the plugin said of it
        said = ", ".join(f"{k} {v}" for k, v in prov.items() if k not in ("plugin", "source"))
        return f"proposed by the plugin {prov['plugin']}" + (f" ({said})" if said else "")
    if prov.get("source") == "recycled":
        row_text = token_label(prov.get("row_text", "?"), 20, escape=False)
        row = f"candidate #{prov['rank'] + 1} in the matrix row of “{row_text}”"
        if prov["step"] == -2:
            return f"{row}, filled from the prompt (it follows that token at prompt position {prov['node']})"
        if prov["step"] == -1:
            return f"{row}, carried over from an earlier run of this session"
        return f"{row}, written by the target's top-k at node {prov['node']} of step {prov['step'] + 1}"
    return None


def node_rows(step: StepTrace) -> list[dict]:
    """One plain row per node for a table: token, where it sits, p, q, the test and its outcome."""
    rows = []
    for n in step.nodes:
        rows.append({
            "id": n.id, "parent": n.parent, "token": token_label(n.text, 24, escape=False), "depth": n.depth,
            "position id": n.position_id, "branch": n.branch, "source": n.source, "status": n.status,
            "committed": n.committed, "p (target)": n.p, "q (draft)": n.q, "p/q": n.ratio, "u": n.u,
            "P(accept)": n.accept_prob, "slot P(accept)": n.slot_prob,
            "from": provenance_text(n) or "",
            "residual top": ", ".join(f"{token_label(t, 10, escape=False)} {pr:.2f}"
                                      for _, t, pr in n.residual_top[:3]),
        })
    return rows


def tree_graph(step: StepTrace) -> nx.DiGraph:
    """The step's tree as a networkx DiGraph (edges parent -> child), node attributes = NodeTrace fields."""
    g = nx.DiGraph()
    for n in step.nodes:
        g.add_node(n.id, **n.__dict__)
    for n in step.nodes:
        if n.parent is not None:
            g.add_edge(n.parent, n.id)
    return g


def tree_layout(g: nx.DiGraph, root: int = 0) -> dict[int, tuple[float, float]]:
    """Tidy layered layout: x = depth, leaves on successive rows, a parent centred on its children."""
    row: dict[int, float] = {}
    next_row = 0.0
    for node in nx.dfs_postorder_nodes(g, root):
        kids = list(g.successors(node))
        if kids:
            row[node] = sum(row[k] for k in kids) / len(kids)
        else:
            row[node] = next_row
            next_row += 1.0
    return {node: (float(g.nodes[node]["depth"]), -y) for node, y in row.items()}


def _last_committed(step: StepTrace):
    """The deepest committed node of ``step``: the bonus token hangs off it."""
    return max((n for n in step.nodes if n.committed), key=lambda n: n.depth)


def _layout_with_bonus(g: nx.DiGraph, step: StepTrace):
    """``tree_layout`` of the step's tree, where its bonus token is drawn (None without one) and how many rows the
    layout has (its leaves). The bonus token goes one depth beyond the deepest committed node, on its row; where
    that node has drafted children (rejected ones), it is laid out as one more child, on a row of its own, so it
    never sits on a child and its label (a middle or only child shares the parent's row). Every phase of a step gets
    the same layout: nodes keep their places."""
    leaves = sum(1 for n in g.nodes if g.out_degree(n) == 0)
    if step.bonus_token is None or not any(n.committed for n in step.nodes):
        return tree_layout(g), None, leaves
    last = _last_committed(step)
    if g.out_degree(last.id) == 0:
        pos = tree_layout(g)
        return pos, (pos[last.id][0] + 1, pos[last.id][1]), leaves
    slot = max(g.nodes) + 1
    spaced = g.copy()
    spaced.add_node(slot, depth=g.nodes[last.id]["depth"] + 1)
    spaced.add_edge(last.id, slot)
    pos = tree_layout(spaced)
    return pos, pos.pop(slot), leaves + 1


def _hover(n) -> str:
    lines = [f"<b>{token_label(n.text, 40)}</b> (id {n.token_id})", f"status: {STATUS_LABELS.get(n.status, n.status)}"
             + (" · committed" if n.committed and n.status != CONTEXT else ""),
             f"depth {n.depth} · position id {n.position_id}"
             + (f" · branch {n.branch}" if n.branch is not None else "")]
    if n.status != CONTEXT:
        lines.append(f"p (target) {_fmt(n.p)} · q (draft) {_fmt(n.q)}")
        if n.source == "target":
            lines.append("root sampled from the target (target-initialized)")
        prov = provenance_text(n)
        if prov:
            lines.append(f"{SOURCE_LABELS[n.source]}: {html.escape(prov, quote=False)}")
        if n.ratio is not None or n.u is not None:
            lines.append(f"p/q {_fmt(n.ratio)} · u {_fmt(n.u)}")
        if n.accept_prob is not None:
            lines.append(f"P(accepted | reached) {_fmt(n.accept_prob)} · slot average {_fmt(n.slot_prob)}")
        if n.residual_top:
            lines.append("residual: " + ", ".join(f"{token_label(t, 10)} {pr:.2f}" for _, t, pr in n.residual_top[:3]))
    return "<br>".join(lines)


def tree_figure(step: StepTrace, height: int | None = None, selected: int | None = None,
                color_by: str = "status", flagged: dict[int, str] | None = None, shown: dict[int, str] | None = None,
                font: int | None = None, final: bool | None = None, draft_vocab: set[int] | None = None,
                fit_labels: bool = True) -> go.Figure:
    """The draft token tree of one step, coloured by verification status (``color_by="status"``) or by draft
    source (``"source"``: draft model, target root, prompt lookup, token recycling; rejected and unverified nodes
    faded). The marker's shape always tells the source (circle: draft model, diamond: target root, square: lookup,
    triangle: recycled). Committed nodes get a thick outline, and the bonus token hangs off the committed path as a
    blue star. Each node marker carries its node id as ``customdata`` (clicks select it); ``selected`` gets an
    orange ring; ``flagged`` (node id -> why, e.g. the probe's flipped decisions) a magenta square.

    ``shown`` (the classroom's phases, ``phases.shown_status``): node id -> the status to draw it with
    (``phases.DRAFTED`` before its test); nodes absent are not drawn, and the commit's outline and bonus star appear
    only when ``final`` (default: once every drawn node shows its own status). The layout is the whole tree's, so
    nodes keep their places from phase to phase. ``font``: the text size in px of labels, titles and legend
    (default: the desk sizes); markers grow with it. ``draft_vocab``: an EAGLE-3 head's draft vocabulary (target
    ids, ``RunTrace.settings["head"]["draft_ids"]``): a bonus token outside it is drawn as an open star, a token the
    head could never have proposed; the title names the target layers the head read. ``fit_labels``: where the
    depths are too close for whole labels (``label_room``), labels alternate above and below their nodes and are
    shortened; False leaves every label whole above its node, for a page that fits them to the width it knows
    (the lesson player's ``fitTree``)."""
    g = tree_graph(step)
    pos, bonus_at, leaves = _layout_with_bonus(g, step)
    by_id = {n.id: n for n in step.nodes}
    if shown is not None:
        step_nodes = [by_id[i] for i in sorted(shown)]
        status_of = dict(shown)
        if final is None:
            final = all(status_of[n.id] == n.status for n in step_nodes)
    else:
        step_nodes, status_of, final = step.nodes, {n.id: n.status for n in step.nodes}, True
    drawn = {n.id for n in step_nodes}
    scale = (font or 11) / 11
    depth = max(n.depth for n in step.nodes) + (1 if step.bonus_token is not None else 0)
    chars, staggered = label_room(depth, font or 11) if fit_labels else (10, False)
    traces = []  # the figure is made once at the end: Plotly's update_layout costs more than the figure
    ex, ey = [], []
    for a, b in g.edges:
        if a in drawn and b in drawn:
            ex += [pos[a][0], pos[b][0], None]
            ey += [pos[a][1], pos[b][1], None]
    traces.append(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#999", width=1), hoverinfo="skip",
                             showlegend=False))
    if color_by == "source":
        groups = [(SOURCE_LABELS[src], SOURCE_COLORS[src], [n for n in step_nodes if n.source == src])
                  for src in SOURCE_COLORS]
    else:
        groups = [(STATUS_LABELS[status], STATUS_COLORS[status], [n for n in step_nodes if status_of[n.id] == status])
                  for status in (CONTEXT, DRAFTED, ACCEPTED, REJECTED, UNVERIFIED)]
    for name, color, nodes in groups:
        if not nodes:
            continue
        faded = color_by == "source"
        outlined = [final and n.committed and n.status != CONTEXT for n in nodes]
        traces.append(go.Scatter(
            x=[pos[n.id][0] for n in nodes], y=[pos[n.id][1] for n in nodes], mode="markers+text",
            name=name, text=[token_label(n.text, chars) if chars else "" for n in nodes],
            textposition=(["bottom center" if n.depth % 2 else "top center" for n in nodes] if staggered
                          else "top center"),
            textfont=dict(size=font or 11), cliponaxis=False,  # the top node's label reaches into the margin
            customdata=[n.id for n in nodes], hovertext=[_hover(n) for n in nodes], hoverinfo="text",
            marker=dict(size=16 * scale, color=color, symbol=[SOURCE_SYMBOLS.get(n.source, "circle") for n in nodes],
                        opacity=[0.35 if faded and n.status in (REJECTED, UNVERIFIED) else 1.0 for n in nodes],
                        line=dict(color=["#000" if o else "#fff" for o in outlined],
                                  width=[3 if o else 1 for o in outlined]))))
    if selected is not None and selected in pos:
        traces.append(go.Scatter(x=[pos[selected][0]], y=[pos[selected][1]], mode="markers", hoverinfo="skip",
                                 name="inspected", marker=dict(size=30, color="rgba(0,0,0,0)", symbol="circle",
                                                               line=dict(color="#ff7f0e", width=4))))
    flagged = {k: v for k, v in (flagged or {}).items() if k in pos}
    if flagged:
        traces.append(go.Scatter(x=[pos[k][0] for k in flagged], y=[pos[k][1] for k in flagged], mode="markers",
                                 name="flips on plain decoding (probe)", hovertext=list(flagged.values()),
                                 hoverinfo="text", marker=dict(size=34, color="rgba(0,0,0,0)", symbol="square",
                                                               line=dict(color="#e377c2", width=4))))
    if step.bonus_token is not None and final:
        last = _last_committed(step)
        x, y = bonus_at
        # from the node to the star: level where the star shares the node's row, like a tree edge where it has its own
        traces.append(go.Scatter(x=[pos[last.id][0], x], y=[pos[last.id][1], y], mode="lines", hoverinfo="skip",
                                 line=dict(color=BONUS_COLOR, dash="dot"), showlegend=False))
        text = step.committed_text[-1]
        unreachable = draft_vocab is not None and step.bonus_token not in draft_vocab
        traces.append(go.Scatter(x=[x], y=[y], mode="markers+text",
                                 name="bonus token (from target" + (", outside the head's vocabulary)"
                                                                    if unreachable else ")"),
                                 text=[token_label(text, 10)], textposition="middle right",
                                 textfont=dict(size=font or 12),
                                 hovertext=[f"<b>{token_label(text, 40)}</b><br>bonus token sampled from the "
                                            "target after the accepted path" + (
                                                "<br>outside the head's draft vocabulary: the head could never "
                                                "have proposed it" if unreachable else "")], hoverinfo="text",
                                 marker=dict(size=18 * scale, color=BONUS_COLOR,
                                             symbol="star-open" if unreachable else "star",
                                             line=dict(color=BONUS_COLOR, width=3 if unreachable else 1))))
    subtitle = _head_title(step)
    # the legend's rows come out of it: a phone's five legend rows left 22 px a leaf at 34 px, too few for a label
    height = height or max(420, min(1000, 40 * leaves + 240))
    # a subtitle's line sits just above the plot, where the top node's label reaches: a label's height more room
    top = 80 + (font or 12) if subtitle else 50
    # the legend under the axis's ticks and title (about 60 px), in plot-area units: the plot area is what the title,
    # the axis and (on a phone, five rows) the legend leave, about 190 px less than the figure; a fixed fraction put
    # the legend's first row over the axis title of a short tree on a phone
    legend_y = -min(0.9, 70 / max(60, height - top - 190))
    size = font or None  # None: Plotly's own sizes
    return go.Figure(data=traces, layout=dict(
        # the head's layers on a line of their own: beside the step's title they ran past a phone's width
        title=dict(text=f"Step {step.index + 1}: draft tree ({len(step.nodes) - 1} nodes)"
                   + (" · LOSSY rule" if step.lossy else ""), subtitle=dict(text=subtitle), y=0.98,
                   font=dict(size=font + 2 if font else None)),
        height=height, margin=dict(l=10, r=10, t=top, b=10), font=dict(size=size),
        xaxis=dict(title=dict(text="depth (position id - anchor position)", font=dict(size=size)), dtick=1,
                   range=[-0.5, depth + 1.2], zeroline=False, tickfont=dict(size=size)),
        # the legend under the axis: above the plot it wrapped into the title on a phone
        # half a row of room above the top row and below the bottom one, where alternating labels reach
        yaxis=dict(visible=False, range=[-(leaves - 1) - 0.5, 0.5]),
        legend=dict(orientation="h", yanchor="top", y=legend_y, x=0, font=dict(size=size)),
        hoverlabel=dict(align="left", font=dict(size=size)),
        clickmode="event+select"))


TREE_WIDTH_PX = 560
"""The width a tree's labels are fitted to: about the narrowest plot area the Explorer gives a tree (its column at
1280 px with the sidebar open; a phone's is 360) and less than the lesson player's; wider screens get room to spare."""


def label_room(depth: int, font: float) -> tuple[int, bool]:
    """How many characters a tree node's label may have, and whether labels alternate above and below the nodes
    (odd depths below), so that neighbours along a chain do not overprint: a label gets the space between its node
    and the next depth's (``TREE_WIDTH_PX`` over the depths shown), twice that where they alternate. Returns
    ``(chars, staggered)``; ``chars`` 0: no labels at all (the hover and the inspector still name every token)."""
    per_depth = TREE_WIDTH_PX / (depth + 1.7)  # the x range runs from -0.5 to depth + 1.2
    char_px = 0.62 * font  # an average glyph of Plotly's default sans-serif
    if 10 * char_px <= 0.9 * per_depth:
        return 10, False
    chars = min(10, int(1.8 * per_depth / char_px))
    return (chars if chars >= 2 else 0), True


def _head_title(step: StepTrace) -> str:
    """The subtitle of a step an EAGLE-3 head drafted: the target layers whose states it read ("" otherwise)."""
    head = step.drafter.get("head") if isinstance(step.drafter, dict) else None
    if not head or not head.get("target_layers"):
        return ""
    return "head read target layers " + ", ".join(str(i) for i in head["target_layers"])


def mask_figure(step: StepTrace, highlight: int | None = None, rows: list[int] | None = None,
                font: int | None = None, height: int | None = None) -> go.Figure:
    """The topology-aware attention mask sent to the target in this step (the step's own rows and columns; every
    row also attends to all ``mask_context_len`` cached context tokens, not drawn). ``highlight``: a node id whose
    row is outlined in orange (the node inspector's). ``rows``: draw only these node ids' rows and columns (the
    classroom's slice of the levels drafted so far, ``phases.mask_rows``). ``font``: text size in px (default: the
    desk sizes); where the rows are too many for labels of that size in ``height`` px, every k-th row is labelled."""
    by_id = {n.id: n for n in step.nodes}
    keep = [k for k, i in enumerate(step.mask_node_ids) if rows is None or i in set(rows)]
    ids = [step.mask_node_ids[k] for k in keep]
    z = [[step.mask[r][c] for c in keep] for r in keep]
    labels = [f"{node_label(by_id[i])} @{step.position_ids[k]}" for i, k in zip(ids, keep)]
    cols = [node_label(by_id[i]) for i in ids]
    hover = [[f"row {labels[r]}<br>col {cols[c]}<br>{'attends' if v else 'masked'}"
              for c, v in enumerate(row)] for r, row in enumerate(z)]
    heatmap = go.Heatmap(z=z, x=cols, y=labels, colorscale=[[0, "#f4f4f4"], [1, "#3b6fb6"]], zmin=0, zmax=1,
                         showscale=False, xgap=1, ygap=1, hovertext=hover, hoverinfo="text")
    n, full = len(z), len(step.mask)
    dims = f"{n}×{n}" + (f" of {full}×{full}" if n < full else "")
    tick = font or 10
    height = height or max(300, min(900, 22 * n + 160))
    size = font or None  # None: Plotly's own sizes
    xaxis = dict(title=dict(text="key", font=dict(size=size)), tickangle=-60, tickfont=dict(size=tick))
    yaxis = dict(autorange="reversed", title=dict(text="query (node @ position id)", font=dict(size=size)),
                 tickfont=dict(size=tick))
    if font:
        every = max(1, -(-n * (font + 4) // max(1, height - 200)))  # rows per label that still fit
        if every > 1:
            yaxis.update(tickmode="array", tickvals=labels[::every], ticktext=labels[::every])
            xaxis.update(tickmode="array", tickvals=cols[::every], ticktext=cols[::every])
    shapes = []
    if highlight in ids:
        r = ids.index(highlight)
        shapes.append(dict(type="rect", x0=-0.5, x1=n - 0.5, y0=r - 0.5, y1=r + 0.5,
                           line=dict(color="#ff7f0e", width=3)))
    # made in one go: Plotly's update_layout costs more than the figure
    return go.Figure(data=[heatmap], layout=dict(
        # the rows and columns on the second line: on one line the title ran past a phone's or a column's width
        title=dict(text=f"Tree attention mask sent to the target<br><sup>{dims} · +{step.mask_context_len} cached "
                   "context columns, all attended (not drawn)</sup>", font=dict(size=font + 2 if font else None)),
        height=height, margin=dict(l=10, r=10, t=70, b=10), font=dict(size=size),
        hoverlabel=dict(font=dict(size=size)), xaxis=xaxis, yaxis=yaxis, shapes=shapes))


def inspector_figure(node) -> go.Figure:
    """Top tokens of p (target) and q (draft) at the node's parent, side by side; the node's own token is marked
    with a star in its label, and after a rejection the residual distribution is a third series."""
    series = [("p (target)", node.p_top, "#3182bd"), ("q (draft)", node.q_top, "#fdae6b"),
              ("residual after rejection", node.residual_top, "#d62728")]
    order: list[int] = []
    text_of: dict[int, str] = {}
    for _, top, _ in series:
        for tok, text, _ in top:
            if tok not in text_of:
                order.append(tok)
                text_of[tok] = text
    if node.token_id not in text_of:
        order.append(node.token_id)
        text_of[node.token_id] = node.text
    labels = [("★ " if t == node.token_id else "") + f"{token_label(text_of[t], 12)} ({t})" for t in order]
    fig = go.Figure()
    for name, top, color in series:
        if not top:
            continue
        probs = {tok: pr for tok, _, pr in top}
        fig.add_trace(go.Bar(x=labels, y=[probs.get(t) for t in order], name=name, marker_color=color,
                             hovertemplate="%{x}<br>" + name + " %{y:.3f}<extra></extra>"))
    fig.update_layout(barmode="group", height=320, margin=dict(l=10, r=10, t=60, b=10),
                      title=f"Node {node.id} {token_label(node.text, 20)}: top tokens at its parent",
                      yaxis=dict(title="probability", range=[0, 1]), xaxis=dict(tickangle=-40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    return fig


def legend_below() -> dict:
    """A horizontal legend at the bottom of the figure (``yref="container"``), under the x axis's title: placed in
    plot-area units below the axis it sat on the axis title wherever the plot area was short."""
    return dict(orientation="h", yref="container", yanchor="bottom", y=0.0, x=0)


def whole_ticks(top: float, most: int = 8) -> int:
    """A ``dtick`` for a count axis from 0 to ``top``: 1, or the step that keeps at most ``most`` ticks (17 ticks of
    one draft token each overprinted on a 300 px chart)."""
    return max(1, math.ceil(top / most))


def branch_figure(step: StepTrace) -> go.Figure:
    """Drafted vs accepted draft tokens per branch (the anchor's children); the committed branch is marked."""
    rows = step.branches
    x = [f"b{r['branch']}: {token_label(r['root_text'], 10)}" + (" ✔" if r["chosen"] else "") for r in rows]
    fig = go.Figure([
        go.Bar(name="drafted", x=x, y=[r["drafted"] for r in rows], marker_color="#c7c7c7"),
        go.Bar(name="accepted", x=x, y=[r["accepted"] for r in rows], marker_color=STATUS_COLORS[ACCEPTED]),
    ])
    fig.update_layout(barmode="overlay", height=320, margin=dict(l=10, r=10, t=50, b=10),
                      title="Per-branch acceptance" + ("<br><sup>each branch verified on its own: LOSSY</sup>"
                                                       if step.lossy else ""),
                      yaxis=dict(title="draft tokens", dtick=whole_ticks(max([r["drafted"] for r in rows] or [1]))),
                      legend=legend_below())
    if not rows:
        fig.add_annotation(text="no draft tree in this step (autoregressive)", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
    return fig


STOP_WORDS_UP_TO = 8  # levels up to which the stop chart names every decision


def stop_figure(step: StepTrace, what_if: dict | None = None) -> go.Figure:
    """Stop-policy score per level and branch against its threshold, the decision after each level, and the
    branches pruned there (crosses). ``what_if``: ``{"rows": stopping.replay(...)}`` draws a second threshold
    (each row's, on the score scale) and the decisions it would have made."""
    fig = go.Figure()
    sigs = step.stop_signals
    branches = sorted({b for s in sigs for b in s.scores}, key=int)
    for b in branches:
        pts = [(s.level, s.scores[b]) for s in sigs if b in s.scores]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=f"branch {b}", legendgroup=b))
        cut = [s for s in sigs if b in s.pruned and b in s.scores]
        if cut and any(s.keep_drafting for s in sigs if b in s.pruned):  # pruned alone, not the whole tree
            why = {True: ": its rows cost more than its chance pays", False: ""}  # the row floor's, or the rule's
            fig.add_trace(go.Scatter(x=[s.level for s in cut], y=[s.scores[b] for s in cut], mode="markers",
                                     marker=dict(symbol="x", size=14, color="#d62728"), legendgroup=b,
                                     name=f"branch {b} pruned", hoverinfo="text",
                                     hovertext=[f"branch {b} stops drafting here{why[b in s.cost_pruned]}"
                                                for s in cut]))
    if sigs:
        policy = sigs[0].policy
        if policy == "goodput" and len(branches) > 1:  # the rule compares the branches' summed gain
            fig.add_trace(go.Scatter(x=[s.level for s in sigs], y=[s.score for s in sigs], mode="lines+markers",
                                     name="all branches (the rule's gain)", line=dict(color="#555", width=3)))
        label = {"specdec++": "1 − h", "goodput": "r(1+E)/(1+Dr)"}.get(policy, "τ")
        fig.add_trace(go.Scatter(x=[s.level for s in sigs], y=[s.threshold for s in sigs], mode="lines",
                                 name=f"threshold {label} ({policy})", line=dict(color="#000", dash="dash")))
        wordy = len(sigs) <= STOP_WORDS_UP_TO  # beyond it the "continue" labels overlap: only stops are named
        for s in sigs:
            if wordy or not s.keep_drafting:
                fig.add_annotation(x=s.level, y=1.08, text="continue" if s.keep_drafting else "<b>stop</b>",
                                   showarrow=False, font=dict(color="#2ca02c" if s.keep_drafting else "#d62728"))
        if what_if is not None:
            rows = what_if["rows"]  # each level's threshold (goodput's rises with the step)
            fig.add_trace(go.Scatter(x=[r["level"] for r in rows], y=[r["threshold"] for r in rows], mode="lines",
                                     name=f"what-if {label}", line=dict(color="#9467bd", dash="dot", width=3)))
            for row in what_if["rows"]:
                if wordy or not row["keep_drafting"]:
                    fig.add_annotation(x=row["level"], y=-0.08, showarrow=False, font=dict(color="#9467bd"),
                                       text="go on" if row["keep_drafting"] else "<b>stop</b>")
    else:
        fig.add_annotation(text="no early-stop decisions in this step (static depth)", showarrow=False, x=0.5,
                           y=0.5, xref="paper", yref="paper")
    fig.update_layout(title="Stop signal per draft level", height=360, margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(title="draft level", dtick=whole_ticks(max([s.level for s in sigs] or [1]), 12)),
                      yaxis=dict(title="score", range=[-0.15, 1.15]), legend=legend_below())
    return fig


def adaptation_figure(run: RunTrace, current: int | None = None) -> go.Figure:
    """Online adaptation of the stop policy over a run (``StepTrace.adaptation``): the threshold in force at each
    step; the mean label of the step's drafted tokens (their acceptance probability under the run's verification:
    what the target accepted); for ``last-layer`` the mean
    predicted acceptance of the same tokens by the shipped model and by the adapting one that drafted them; for
    ``threshold`` the mean score. ``current``: the step shown in the explorer (0-based), marked."""
    fig = go.Figure()
    steps = [s for s in run.steps if s.adaptation]
    if not steps:
        fig.add_annotation(text="online adaptation is off in this run", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
        fig.update_layout(height=300, title="Stop-policy adaptation")
        return fig
    mode = steps[0].adaptation["mode"]
    xs = [s.index + 1 for s in steps]

    def line(key, name, **style):
        ys = [s.adaptation.get(key) for s in steps]
        if any(y is not None for y in ys):
            fig.add_trace(go.Scatter(x=xs, y=ys, name=name, **style))

    # the threshold a step was drafted with is the one in force after the previous step's refit; the first step's
    # is the setting, or where the session's previous run left a refitted threshold it carried over
    carried = run.settings.get("adaptation_carried") or {}
    start = (carried if carried.get("mode") == "threshold" else run.settings.get("method", {})).get("threshold")
    used = [start] + [s.adaptation.get("threshold") for s in steps[:-1]]
    goodput = run.settings.get("method", {}).get("stop") == "goodput"  # its threshold setting is r
    fig.add_trace(go.Scatter(x=xs, y=used, mode="lines", line=dict(color="#000", dash="dash", shape="hv"),
                             name="threshold τ (adapting)" if mode == "threshold" else
                             "cost ratio r" if goodput else "threshold τ"))
    line("label_mean", "accepted (mean P(accept))", mode="markers", marker=dict(color=STATUS_COLORS[ACCEPTED]))
    if mode == "last-layer":
        line("pred_frozen", "predicted, shipped model", mode="lines", line=dict(color="#7f7f7f"))
        line("pred_before", "predicted, adapting model", mode="lines+markers", line=dict(color="#1f77b4"))
    else:
        line("score_mean", "mean score", mode="lines+markers", line=dict(color="#1f77b4"))
    if current is not None:
        fig.add_vline(x=current + 1, line=dict(color="#9467bd", width=1, dash="dot"))
    fig.update_layout(title=f"Stop-policy adaptation over the run ({mode})", height=300,
                      margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(title="step", rangemode="tozero", dtick=max(1, round(max(xs) / 10))),  # whole steps
                      yaxis=dict(title="probability / score", range=[0, 1.05]), legend=legend_below())
    return fig


def cost_ratio_figure(run: RunTrace, current: int | None = None) -> go.Figure:
    """The goodput stop policy's measured cost ratio over a run (``StepTrace.cost``): the r each step drafted
    with, and each step's own measurement (a draft level's ms over the rest of the step's) that the moving average
    took in. ``current``: the step shown in the explorer (0-based), marked."""
    steps = [s for s in run.steps if s.cost]
    xs = [s.index + 1 for s in steps]
    own = [s.cost["level_ms"] / s.cost["rest_ms"] if s.cost.get("level_ms") else None for s in steps]
    fig = go.Figure([go.Scatter(x=xs, y=[s.cost["r"] for s in steps], mode="lines+markers", name="r in force",
                                line=dict(color="#000", dash="dash", shape="hv")),
                     go.Scatter(x=xs, y=own, mode="markers", name="this step: draft level ÷ rest of the step",
                                marker=dict(color="#ff7f0e"))])
    if current is not None:
        fig.add_vline(x=current + 1, line=dict(color="#9467bd", width=1, dash="dot"))
    fig.update_layout(title="Goodput cost ratio r, measured on this machine", height=300,
                      margin=dict(l=10, r=10, t=50, b=10),
                      xaxis=dict(title="step", rangemode="tozero", dtick=whole_ticks(max(xs or [1]), 12)),
                      yaxis=dict(title="r", rangemode="tozero"), legend=legend_below())
    return fig


def run_figure(run: RunTrace) -> go.Figure:
    """Tokens committed per step: accepted draft tokens, target roots and the bonus token, stacked."""
    xs = [s.index + 1 for s in run.steps]
    bonus = [1 if s.bonus_token is not None else 0 for s in run.steps]
    accepted = [s.accepted_draft_len for s in run.steps]
    roots = [len(s.committed_ids) - a - b for s, a, b in zip(run.steps, accepted, bonus)]
    fig = go.Figure([go.Bar(name="accepted draft tokens", x=xs, y=accepted, marker_color=STATUS_COLORS[ACCEPTED]),
                     go.Bar(name="target root", x=xs, y=roots, marker_color="#9467bd"),
                     go.Bar(name="bonus token", x=xs, y=bonus, marker_color=BONUS_COLOR)])
    top = max([len(s.committed_ids) for s in run.steps] or [1])
    fig.update_layout(barmode="stack", height=300, margin=dict(l=10, r=10, t=40, b=10),
                      title="Tokens committed per target call", xaxis=dict(title="step"),
                      yaxis=dict(title="tokens", dtick=whole_ticks(top, 6)), legend=legend_below())
    return fig


MODE_COLORS = {"pre": "#f7d488", "post": "#d98c00"}  # PEARL's draft lane: pre-verify light, post-verify dark
MODE_WORDS = {"pre": "pre-verify: the target checks the first draft token while the draft drafts the rest",
              "post": "post-verify: the target verifies the last block while the draft drafts the next"}


def lanes_figure(run: RunTrace, current: int | None = None, height: int = 300) -> go.Figure:
    """PEARL's rounds on two lanes (``trace.lanes``): the draft's row and the target's, each round's bars starting
    together, the draft's coloured by the round's mode (pre- or post-verify), what needs both (verification,
    commit) after them on the target's row; the ``current`` step outlined. The title says whether the overlap is
    simulated from one device's measured costs or was measured in two threads. Hover: what each round read, checked,
    committed and discarded."""
    clock = two_lanes.two_lane_clock(run)
    by_index = {s.index: s for s in run.steps}
    fig = go.Figure()
    for mode in ("pre", "post"):
        entries = [e for e in clock if e["mode"] == mode]
        if not entries:
            continue
        hover = [_round_hover(by_index[e["step"]], e) for e in entries]
        outline = [3 if e["step"] == current else 0.5 for e in entries]
        fig.add_trace(go.Bar(y=["draft"] * len(entries), x=[e["lanes"]["draft_ms"] for e in entries],
                             base=[e["start_ms"] for e in entries], orientation="h", name=f"draft, {mode}-verify",
                             marker=dict(color=MODE_COLORS[mode], line=dict(color="#000", width=outline)),
                             hovertext=hover, hoverinfo="text"))
        fig.add_trace(go.Bar(y=["target"] * len(entries), x=[e["lanes"]["target_ms"] for e in entries],
                             base=[e["start_ms"] for e in entries], orientation="h", name=f"target, {mode}-verify",
                             marker=dict(color="#3b6fb6" if mode == "post" else "#9fbbe0",
                                         line=dict(color="#000", width=outline)),
                             hovertext=hover, hoverinfo="text"))
    after = [e for e in clock if e["lanes"]]
    fig.add_trace(go.Bar(y=["target"] * len(after), x=[e["lanes"]["after_ms"] for e in after],
                         base=[e["end_ms"] - e["lanes"]["after_ms"] for e in after], orientation="h",
                         name="verify + commit", marker_color=STATUS_COLORS[ACCEPTED], hoverinfo="skip"))
    measured = two_lanes.measured_lanes(run)
    title = "PEARL's two lanes (measured)" if measured else "PEARL's two lanes (simulated)"
    fig.update_layout(barmode="overlay", height=height, margin=dict(l=10, r=10, t=50, b=10), title=title,
                      xaxis=dict(title="ms since the prompt (prefill included)"),
                      yaxis=dict(autorange="reversed"), legend=legend_below())
    return fig


def _round_hover(step: StepTrace, entry: dict) -> str:
    info = step.drafter.get("pearl", {})
    lanes, mode = entry["lanes"], info.get("mode", "?")
    lost = two_lanes.discarded(step)
    return (f"step {step.index + 1}, {html.escape(MODE_WORDS.get(mode, mode))}<br>"
            f"target read {len(step.mask_node_ids)} rows ({info.get('checked', 0)} drafted "
            f"last round); draft drafted {len(info.get('drafted', []))}<br>"
            f"committed {entry['committed']}, discarded {len(lost)}<br>"
            f"draft {lanes['draft_ms']:.0f} ms · target {lanes['target_ms']:.0f} ms · after {lanes['after_ms']:.0f} ms "
            f"→ round {lanes['round_ms']:.0f} ms (one lane: {lanes['one_lane_ms']:.0f})")


def text_html(run: RunTrace, current: int | None = None) -> str:
    """The generated text with each step's tokens in alternating shades; bonus tokens underlined in blue and the
    ``current`` step outlined. All text is HTML-escaped."""
    parts = []
    for s in run.steps:
        shade = "#e8f4e8" if s.index % 2 == 0 else "#e6eef8"
        outline = "outline:2px solid #ff7f0e;" if current == s.index else ""
        toks = []
        for j, t in enumerate(s.committed_text):
            esc = html.escape(t).replace("\n", "↵\n")
            if s.bonus_token is not None and j == len(s.committed_text) - 1:
                esc = f'<span style="border-bottom:2px solid {BONUS_COLOR}">{esc}</span>'
            toks.append(esc)
        parts.append(f'<span title="step {s.index + 1}" style="background:{shade};{outline}border-radius:3px">'
                     + "".join(toks) + "</span>")
    body = "".join(parts) or "<i>nothing generated yet: press Step</i>"
    return f'<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">{body}</div>'


RULE_NAMES = {"rrs": "RRS without replacement (RSD-C)", "rrs-replacement": "RRS with replacement (SpecInfer)",
              "mcns": "MCNS", "spechub": "SpecHub", "spectr": "SpecTr K-SEQ", "rsd-s": "RSD-S (beam tree)"}


def rules_figure(rows: list[dict]) -> go.Figure:
    """Tokens per target call of each rule from ``analysis.rules.compare_rules`` rows (skipped rules left out),
    best first, each bar labelled with its tree's draft nodes."""
    ran = sorted((r for r in rows if r.get("tokens_per_target_call") is not None),
                 key=lambda r: -r["tokens_per_target_call"])
    fig = go.Figure(go.Bar(
        x=[r["tokens_per_target_call"] for r in ran], y=[RULE_NAMES.get(r["label"], r["label"]) for r in ran],
        orientation="h", marker_color=BONUS_COLOR, text=[f"{r['tokens_per_target_call']:.2f} · {r['tree_nodes']} "
                                                         "nodes" for r in ran], textposition="auto"))
    fig.update_layout(height=60 + 44 * max(len(ran), 1), margin=dict(l=10, r=10, t=40, b=10),
                      title="tokens per target call, same prompt and seed", yaxis=dict(autorange="reversed"),
                      xaxis=dict(title="tokens per target call", rangemode="tozero"))
    return fig


RULE_SHORT = {"rrs": "RSD-C", "rrs-replacement": "SpecInfer", "mcns": "MCNS", "spechub": "SpecHub",
              "spectr": "SpecTr", "rsd-s": "RSD-S"}
"""Short rule names for the paired chart's groups (narrow screens)."""


def same_drafts_figure(rows: list[dict]) -> go.Figure | None:
    """The paired comparison of ``analysis.rules.compare_rules`` rows: for each run whose trees some other rule can
    test too (``same_drafts``), the expected tokens per drafting step of each such rule on those very trees, one
    group of horizontal bars per run. None when no row has two rules to compare (greedy, or SpecHub alone)."""
    groups = [r for r in rows if len(r.get("same_drafts") or {}) > 1]
    if not groups:
        return None
    rules = list(dict.fromkeys(rule for r in groups for rule in r["same_drafts"]))
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
    fig = go.Figure()
    for n, rule in enumerate(rules):
        have = [r for r in groups if rule in r["same_drafts"]]
        fig.add_trace(go.Bar(
            name=RULE_NAMES.get(rule, rule), orientation="h", marker_color=palette[n % len(palette)],
            y=[f"{RULE_SHORT.get(r['label'], r['label'])}'s trees" for r in have],
            x=[r["same_drafts"][rule] for r in have], text=[f"{r['same_drafts'][rule]:.2f}" for r in have],
            textposition="outside", cliponaxis=False))
    bars = sum(len(r["same_drafts"]) for r in groups)
    fig.update_layout(barmode="group", height=140 + 34 * bars, margin=dict(l=10, r=30, t=40, b=10),
                      title="the same trees, rule by rule",
                      xaxis=dict(title="expected tokens per step", rangemode="tozero"),
                      yaxis=dict(autorange="reversed"), legend=dict(orientation="h", y=-0.2, x=0))
    return fig


def audit_figure(result: dict, which: str = "first", top: int = 20) -> go.Figure:
    """Empirical against exact probabilities from an audit result (``AuditResult.to_dict()``), most likely first."""
    cmp = result[which]
    labels = result.get("labels", {})
    order = sorted(range(len(cmp["categories"])), key=lambda i: -cmp["exact"][i])[:top]
    names = [token_label(labels.get(cmp["categories"][i], cmp["categories"][i]), 18) + f" [{i}]" for i in order]
    n = cmp["n"]
    fig = go.Figure([
        go.Bar(name="exact (target)", x=names, y=[cmp["exact"][i] for i in order], marker_color="#7f7f7f"),
        go.Bar(name="empirical", x=names, y=[cmp["counts"][i] / n for i in order], marker_color=BONUS_COLOR),
    ])
    verdict = "consistent with the target" if cmp["p_value"] > result["alpha"] else "DIFFERS from the target"
    title = "first token" if which == "first" else "first two tokens"
    fig.update_layout(barmode="group", height=340, margin=dict(l=10, r=10, t=60, b=10),
                      title=f"{title}: p-value {cmp['p_value']:.3g}, TV {cmp['tv_distance']:.3f} ({verdict})",
                      yaxis=dict(title="probability"), legend=dict(orientation="h", y=1.12, x=0))
    return fig


def bench_figures(report: dict) -> list[go.Figure]:
    """Benchmark charts: tokens/s per method and temperature (with ``ar`` as a dashed line), and where the time of
    each method went (drafting, verification, everything else)."""
    rows = report["summary"]
    temps = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    speed = go.Figure()
    for t in temps:
        sel = [r for r in rows if r["temperature"] == t]
        speed.add_trace(go.Bar(name=f"T = {t:g}", x=[r["method"] for r in sel],
                               y=[r["tokens_per_s"] or 0 for r in sel],
                               text=[("" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x")
                                     for r in sel], textposition="outside"))
    speed.update_layout(title="Tokens per second (label: speed-up over ar in the same run)", barmode="group",
                        height=380, yaxis=dict(title="tokens/s"), margin=dict(l=10, r=10, t=50, b=10))
    split = go.Figure()
    by_key = {(r["method"], r["temperature"]): r for r in rows}
    keys = [(m, t) for t in temps for m in methods if (m, t) in by_key]  # not every method runs at every T
    labels = [f"{m} · T={t:g}" for m, t in keys]
    def part_seconds(r, part):
        if r.get("draft_s") is None:  # hf-assisted: no split, the whole wall time counts as "other"
            return (r.get("seconds") or 0) if part == "other_s" else 0
        return r.get(part) or 0

    for part, color in (("draft_s", "#9ecae1"), ("verify_s", "#3182bd"), ("other_s", "#fdae6b")):
        split.add_trace(go.Bar(name=part.removesuffix("_s"), x=labels, marker_color=color,
                               y=[part_seconds(by_key[k], part) for k in keys]))
    split.update_layout(title="Where the time went (seconds; hf-assisted: wall time only, as 'other')",
                        barmode="stack", height=380, margin=dict(l=10, r=10, t=50, b=10))
    return [speed, split]
