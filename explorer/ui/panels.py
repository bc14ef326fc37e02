"""Panels that draw one step or one run from a trace: metrics, text, tree (click a node to inspect it), mask,
node inspector, branches, stop signals with the what-if slider, teach-mode account. Trace data in, page out."""

from __future__ import annotations

import html

import streamlit as st

from ..engine.policies.stopping import SETTING_NAMES, recorded_setting, what_if
from ..lessons.teach import explain_step, fallback_rates, layer_skip_words, tree_choice_words
from ..trace import figures
from ..trace.metrics import run_metrics
from ..trace.records import FREE_SOURCES, SOURCE_LABELS, RunTrace, StepTrace
from .instruments_panel import flagged_nodes, of_the_run, of_the_step, probe_section, teach_caption
from .layout import chart_columns
from .state import Explorer

def code(text: str) -> str:
    """A token or text as a Markdown code span for ``st.markdown`` without HTML (Streamlit shows any markup in it
    as text; HTML entities would show literally inside a code span, so nothing is escaped, only backticks)."""
    return "`" + repr(text).replace("`", "ˋ") + "`"


def metrics_row(trace: RunTrace, upto: int | None = None) -> None:
    """Run metrics over steps ``[0, upto]`` (all when None); their labels wrap where the page draws
    ``layout.LAYOUT_CSS``."""
    shown = trace if upto is None else RunTrace(settings=trace.settings, model=trace.model, prompt=trace.prompt,
                                                prompt_ids=trace.prompt_ids, steps=trace.steps[: upto + 1],
                                                prefill_ms=trace.prefill_ms)
    m = run_metrics(shown)
    # a wrapping row of metrics 150 px wide or more: seven columns at a projector's 1280 px with the sidebar open
    # were about 110 px, less than "Acceptance" at teach mode's size
    row = st.container(horizontal=True, key="metrics_row", gap="medium")
    cols = [row.container(width=150) for _ in range(7)]
    acc, mcsd_acc = m["acceptance_rate"], m["mcsd_acceptance_rate"]
    cols[0].metric("Generated tokens", m["generated_tokens"])
    cols[1].metric("Target calls", m["target_calls"])
    cols[2].metric("Tokens / target call", "–" if not m["target_calls"] else f"{m['tokens_per_target_call']:.2f}",
                   help="block efficiency: comparable across all methods")
    cols[3].metric("Acceptance (Lu et al.)", "–" if acc is None else f"{acc:.2f}",
                   help="mean over steps of longest accepted draft length / maximum draft length (Lu et al. 2024)")
    cols[4].metric("Acceptance (MCSD)", "–" if mcsd_acc is None else f"{mcsd_acc:.2f}",
                   help="accepted draft tokens / drafted tokens (Yang et al. 2024)")
    length = m["acceptance_length"]
    cols[5].metric("Acceptance length", "–" if length is None else f"{length:.2f}",
                   help="as EAGLE and vLLM report it: mean tokens committed per draft-and-verify step, the bonus "
                        "token included (tokens / target call also counts the prefill as a call)")
    cols[6].metric("Tokens / s", "–" if not m["tokens_per_s"] else f"{m['tokens_per_s']:.1f}",
                   help="wall clock, prefill included; the UI adds no time to it")


def step_caption(step: StepTrace, total: int) -> None:
    committed = "".join(step.committed_text)
    st.markdown(
        f"**Step {step.index + 1} of {total}** · committed {len(step.committed_ids)} token(s): "
        f"{code(committed)} · accepted draft tokens {step.accepted_draft_len} (depth cap {step.max_draft_len})"
        f" · draft {step.draft_ms:.0f} ms ({step.draft_calls} calls) · verify {step.verify_ms:.0f} ms · "
        f"verifier `{step.verifier}`")
    skip = step.drafter.get("layer_skip")
    if skip:
        st.caption(layer_skip_words(skip))
    if step.drafter.get("tree_choice"):
        st.caption(tree_choice_words(step.drafter["tree_choice"]))
    fb = step.fallback
    if fb and not fb.get("speculate", True):
        st.caption(f"Plain decoding step (goodput fallback: {fb.get('reason')}): this step drafted nothing and the "
                   f"target wrote one token. Measured so far on this machine: {fallback_rates(fb)}.")


def teach_box(step: StepTrace, method: dict | None = None, decision: dict | None = None,
              plugins: list | None = None) -> None:
    """The plain-language account of the step (escaped: token text is user data); ``method``: the run's method
    settings; ``decision``: where its stop model came from; ``plugins``: the plugins the run used
    (``teach.explain_step``)."""
    sentences = explain_step(step, method, decision, plugins)
    st.markdown("<div class='teach-box'>" + "".join(f"<p>{html.escape(s)}</p>" for s in sentences) + "</div>",
                unsafe_allow_html=True)


def selected_node(event, step_index: int, prefix: str = "") -> int | None:
    """The node id a click on step ``step_index``'s tree selected (from ``st.plotly_chart(on_select=...)``), kept
    per step (``Explorer.INSPECT``; ``prefix``: the caller's widget prefix)."""
    try:
        points = event.selection.points if event else []
    except AttributeError:
        points = []
    for p in points:
        node = p.get("customdata")
        if isinstance(node, list):
            node = node[0] if node else None
        if isinstance(node, (int, float)):
            Explorer.INSPECT.set(step_index, int(node), within=prefix)
            break
    return Explorer.INSPECT.get(step_index, within=prefix)


def step_panels(trace: RunTrace, step: StepTrace, teach: bool, prefix: str = "", probe: dict | None = None,
                can_probe: bool = False) -> None:
    """Everything about one step: tree (click to inspect), mask with the inspected row, inspector, details, and
    the tree-attention probe (``probe``: its result for this step, if any; ``can_probe``: the models are here)."""
    step_caption(step, len(trace.steps))
    if teach:
        teach_box(step, trace.settings.get("method"), trace.settings.get("decision_model"),
                  trace.settings.get("plugins"))
    tree_and_inspector(trace, step, prefix, probe)
    priced = step.drafter.get("row_pricing")
    if priced:
        st.caption(f"Row pricing: {priced['kept']} of {priced['offered']} free proposals kept, expected "
                   f"{priced['expected_tokens']:.2f} tokens (bonus included); a verification row costs "
                   f"{priced['row_ms']:.0f} ms here (the first {priced.get('jump_ms', 0):.0f} ms more), a plain "
                   f"step {priced['one_row_ms']:.0f} ms.")
    if "recycling_row" in step.drafter:
        matrix_row_panel(step)
    with st.expander("Why each node was accepted or rejected"):
        st.caption("A node x is accepted when u ≤ p(x)/q(x) (the SpecHub rule uses its transport plan's "
                   "probability instead); after a rejection the next sibling, or the replacement token, is drawn "
                   "from the residual distribution.")
        st.dataframe(figures.node_rows(step), hide_index=True, width="stretch")
    probe_section(step, probe, can_probe, teach, prefix)
    c1, c2, c3 = chart_columns(3, f"{prefix}step_charts")
    c1.plotly_chart(of_the_step(trace, step, "branches", lambda: figures.branch_figure(step)), width="stretch",
                    key=f"{prefix}branch_chart")
    with c2:
        stop_panel(trace, step, prefix)
    c3.plotly_chart(of_the_run(trace, "run", lambda: figures.run_figure(trace)), width="stretch",
                    key=f"{prefix}run_chart")
    if step.adaptation:
        adaptation_panel(trace, step, teach, prefix)
    if step.cost:
        st.plotly_chart(of_the_run(trace, f"cost ratio {step.index}", lambda: figures.cost_ratio_figure(
            trace, current=step.index)), width="stretch", key=f"{prefix}cost_ratio_chart")


def shapes_legend(trace: RunTrace) -> str:
    """The tree's node shapes where free drafts join it: circles are the EAGLE-3 head's in a run that drafts with
    one (``eagle-hybrid``), else the draft model's."""
    circles = "EAGLE-3 head" if trace.settings.get("head") else "draft model"
    plugin = ", ⬢ a plugin's drafter" if trace.settings.get("plugins") else ""
    return f"Shapes: ● {circles}, ■ prompt lookup, ▲ token recycling{plugin}."


@st.fragment
def tree_and_inspector(trace: RunTrace, step: StepTrace, prefix: str = "", probe: dict | None = None) -> None:
    """The step's tree beside its mask, and the inspector of the node clicked, a fragment: a click on a node (or
    another colouring) redraws these three alone, with the node highlighted in the tree and its row in the mask."""
    chart_key = Explorer.TREE_CHART.name(step.index, within=prefix)  # per step: a click stays with its step
    event = Explorer.TREE_CHART.get(step.index, within=prefix)  # the click that caused this rerun
    chosen = selected_node(event, step.index, prefix)
    chosen = chosen if chosen in {n.id for n in step.nodes} else None
    free = any(n.source in FREE_SOURCES for n in step.nodes)
    left, right = chart_columns([3, 2], f"{prefix}tree_mask_{step.index}")
    with left:
        color_by = "status"
        if free:  # free drafters mix sources in one tree: let the colours tell them apart
            color_by = st.radio("Colour the tree by", ["status", "source"], horizontal=True,
                                key=f"{prefix}color_by", format_func={"status": "verification status",
                                                                      "source": "draft source"}.get)
        head = trace.settings.get("head") or {}
        vocab = set(head["draft_ids"]) if head.get("draft_ids") else None
        flagged = flagged_nodes(probe)
        tree = of_the_step(trace, step, f"tree {chosen} {color_by} {sorted(flagged.items())}", lambda: (
            figures.tree_figure(step, selected=chosen, color_by=color_by, flagged=flagged, draft_vocab=vocab)))
        st.plotly_chart(tree, width="stretch", key=chart_key, on_select="rerun", selection_mode="points")
        st.caption("Click a node to inspect it." + (f" {shapes_legend(trace)}" if free else ""))
    with right:
        st.plotly_chart(of_the_step(trace, step, f"mask {chosen}", lambda: figures.mask_figure(step, highlight=chosen)),
                        width="stretch", key=f"{prefix}mask_chart")
    if chosen is not None:
        inspector(step, chosen)


TEACH_ADAPTATION = ("Every check by the big model tells us, for free, which drafted tokens it would accept. The stop "
                    "rule learns from that as the text goes on: on easy text it learns to keep drafting, on hard "
                    "text to stop sooner. It only changes how much is drafted; the big model still decides every "
                    "token, so the text comes out exactly as likely as before. What it learned carries over to "
                    "your next run of the same method, so a session keeps getting better at your kind of text.")


def adaptation_panel(trace, step: StepTrace, teach: bool, prefix: str = "") -> None:
    """The stop policy's online adaptation over the run, and what this step taught it."""
    a = step.adaptation
    st.plotly_chart(of_the_run(trace, f"adaptation {step.index}", lambda: figures.adaptation_figure(
        trace, current=step.index)), width="stretch", key=f"{prefix}adaptation_chart")
    if not a.get("tokens"):  # nothing drafted by the model (a plain step of the fallback, or only free drafts)
        note = (f"This step drafted nothing for the stop policy to learn from; the threshold stays "
                f"{a['threshold']:.3f}.")
    elif a["mode"] == "threshold":
        note = (f"This step labelled {a['tokens']} drafted tokens (mean acceptance {_num(a.get('label_mean'))}); "
                f"refitted from the latest {a['records']}, the threshold for the next step is {a['threshold']:.3f}.")
    else:
        note = (f"This step labelled {a['tokens']} drafted tokens: accepted {_num(a.get('label_mean'))} on average, "
                f"predicted {_num(a.get('pred_before'))} by the adapting model ({_num(a.get('pred_frozen'))} by the "
                f"shipped one); after the refit on the latest {a['records']} it predicts {_num(a.get('pred_after'))} "
                "for them.")
    carried = trace.settings.get("adaptation_carried")
    if carried:
        note += (f" The run started from what this session's previous run of the method learned "
                 f"({len(carried.get('labels', []))} labelled tokens), not from the shipped model.")
    st.caption(note)
    if teach:
        teach_caption(TEACH_ADAPTATION)


def inspector(step: StepTrace, node_id: int) -> None:
    """The node inspector: p and q top-k at the parent, p/q, the uniform draw, the residual, position id."""
    node = next(n for n in step.nodes if n.id == node_id)
    st.markdown(f"#### Node inspector: node {node.id} {code(node.text)}")
    facts = [f"status **{html.escape(node.status)}**" + (" · committed" if node.committed else ""),
             f"depth {node.depth}", f"position id **{node.position_id}**",
             f"source {html.escape(node.source)}", f"branch {node.branch if node.branch is not None else '–'}"]
    if node.parent is not None:
        facts += [f"p (target) {_num(node.p)}", f"q (draft) {_num(node.q)}",
                  f"acceptance ratio {_num(node.ratio)}", f"uniform draw u {_num(node.u)}"]
    st.markdown(" · ".join(facts))
    if node.parent is None:
        st.caption("The anchor: the last committed token. The tree grows from it; its row in the mask (when fed) "
                   "gives the target's distribution for the first drafted level.")
        return
    prov = figures.provenance_text(node)
    if prov and (node.provenance or {}).get("source") == "edited":
        st.markdown(f"**Edited**: {html.escape(prov)}; the draft model rescored the edited tree for q.")
    elif prov and node.source == "draft":  # a drafted node's own story (RSD-S's key)
        order = "" if node.test_order is None else f" It is tested {_ordinal(node.test_order + 1)} among its siblings."
        st.markdown(f"**Draft model**: {html.escape(prov)}.{order}")
    elif prov:
        st.markdown(f"**{SOURCE_LABELS[node.source].capitalize()}** (a free draft: no draft-model forward, q is a "
                    f"point mass): {html.escape(prov)}.")
    if node.source == "target":
        st.caption("A root sampled from the target itself (the lossy mode of Lu et al. 2024): not tested.")
    elif node.source in FREE_SOURCES and node.u is not None and node.ratio is not None:
        verdict = "accepted: u < p" if node.u < node.ratio else "rejected: u ≥ p"
        st.caption(f"Point-mass test: u = {node.u:.3f} against p = {node.ratio:.3f} (the target's probability of "
                   f"this token after its earlier siblings were rejected) → {verdict}.")
    elif step.verifier == "spectr" and node.u is not None and node.ratio is not None:
        verdict = "accepted: u < ratio" if node.u < node.ratio else "rejected: u ≥ ratio"
        rho = (node.p / (node.q * node.ratio)) if node.p and node.q and node.ratio else None
        siblings = sum(1 for n in step.nodes if n.parent == node.parent and n.source == "draft")
        st.caption(f"SpecTr K-SEQ: the {siblings} i.i.d. drafts at this node are tested in draw order, each with "
                   f"min(1, p/(ρ* q)); ρ* = {_num(rho)} solves 1 - (1 - β(ρ))^{siblings} = ρ β(ρ), the largest "
                   f"acceptance that keeps the output exact. u = {node.u:.3f} against the scaled ratio "
                   f"{node.ratio:.3f} (p/q = {_num(node.p / node.q if node.p and node.q else None)}) → {verdict}.")
    elif node.u is not None and node.ratio is not None:
        verdict = "accepted: u ≤ ratio" if node.u <= node.ratio else "rejected: u > ratio"
        st.caption(f"Test: u = {node.u:.3f} against the acceptance ratio {node.ratio:.3f} → {verdict} (the ratio is "
                   "p/q for a first child; for later siblings the residual's, for SpecHub its transport plan's).")
    elif step.verifier == "greedy" and node.status in ("accepted", "rejected"):
        st.caption("Greedy verification: a draft token is accepted exactly when it is the target's top token.")
    elif step.verifier == "mcns" and node.status in ("accepted", "rejected"):
        st.caption("MCNS: one token y is drawn from p; the child equal to y, if any, is accepted.")
    elif node.status in ("accepted", "rejected"):
        st.caption(f"Verified by the {step.verifier} rule.")
    if node.p_top or node.q_top:
        st.plotly_chart(figures.inspector_figure(node), width="stretch", key=f"inspector_{step.index}_{node.id}")
    else:
        st.caption("This trace has no top-k distributions for the node (saved by an older version).")


def matrix_row_panel(step: StepTrace) -> None:
    """Token Recycling: the adjacency-matrix row of this step's anchor, the candidates its first level came from."""
    row = step.drafter["recycling_row"]
    texts = row.get("candidate_texts") or [str(t) for t in row["candidates"]]
    anchor = figures.token_label(row.get("token_text", str(row["token"])), 24, escape=False)
    with st.expander(f"Token Recycling: the matrix row of “{anchor}”", expanded=False):
        if not row["candidates"]:
            st.caption("No row yet: the target has not scored this token in this session, so recycling proposes "
                       "nothing here (the row is written when this step's verification scores it).")
            return
        written = {-2: "filled from the prompt (the tokens that follow it there)",
                   -1: "carried over from an earlier run"}.get(row["step"],
                                                               f"written at step {row['step'] + 1}, node {row['node']}")
        st.caption(f"The row holds the target's top-{len(row['candidates'])} next tokens the last time it scored "
                   f"this token ({written}). The tree's first level is read from it, deeper levels from the rows of "
                   "those candidates.")
        st.dataframe([{"rank": i + 1, "token": figures.token_label(t, 24, escape=False), "id": c}
                      for i, (t, c) in enumerate(zip(texts, row["candidates"]))], hide_index=True, width="stretch")


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def _num(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def cost_ratio_words(cost: dict) -> str:
    """The goodput policy's measured r for one step (``StepTrace.cost``), in words."""
    text = f"r measured on this machine: {cost['r']:.3f} during this step"
    if cost.get("level_ms") is not None:
        rows = f" (its rows in the verification at {cost['row_ms']:.1f} ms each)" if cost.get("row_ms") else ""
        text += (f"; this step, a draft level took {cost['level_ms']:.1f} ms{rows} and the rest of the step "
                 f"{cost['rest_ms']:.1f} ms")
    return text + f"; r for the next step: {cost['next']:.3f} (moving averages over the run)."


@st.fragment
def stop_panel(trace: RunTrace, step: StepTrace, prefix: str = "") -> None:
    """The stop chart, and a slider that re-runs the step's stop decisions with another threshold (no model), a
    fragment: the slider redraws this panel alone."""
    sigs = step.stop_signals
    policy = sigs[0].policy if sigs else "none"
    if not sigs or policy == "none":
        st.plotly_chart(of_the_step(trace, step, "stop", lambda: figures.stop_figure(step)), width="stretch",
                        key=f"{prefix}stop_chart")
        return
    recorded = recorded_setting(sigs[0])  # back from the score scale (1 - (1 - h) = h)
    if step.cost:
        st.caption(cost_ratio_words(step.cost))
    name = SETTING_NAMES.get(policy, "τ")
    # a measured r differs per step: a slider per recorded value starts from the step's own r
    key = f"{prefix}whatif_{policy}" + (f"_{recorded:.2f}" if step.cost else "")
    tau = st.slider(f"What if the {'cost ratio' if policy == 'goodput' else 'threshold'} were… ({name})", 0.0, 1.0,
                    float(round(recorded, 2)), 0.05, key=key,
                    help="re-runs this step's stop decisions on the recorded scores; nothing is recomputed")
    result = what_if(step, tau)
    chart = of_the_step(trace, step, f"stop {tau!r}", lambda: figures.stop_figure(step, {"rows": result["rows"]}))
    st.plotly_chart(chart, width="stretch", key=f"{prefix}stop_chart")
    pruned = [f"branch {b} at level {r['level']}" for r in result["rows"] for b in r["pruned"]]
    note = (f"With {name} = {tau:.2f}: {result['drafted']} draft tokens over "
            f"{result['draft_levels']} levels (recorded {step.drafted}), {result['tokens']} token(s) committed "
            f"(recorded {len(step.committed_ids)}).")
    if pruned:
        note += " Stops: " + "; ".join(pruned) + "."
    if result["deeper"]:
        note += " It would draft deeper than this step did, which the trace cannot show."
    if not result["exact"]:
        note += " Sampled verification: the committed count is the recorded path cut at the new depth."
    st.caption(note)
