"""Three instruments on the Explorer page: the tree-attention probe of the step on screen, expected
against realised acceptance over the run, and the optimal tree for the run's measured rates (with a button that
runs it). Trace data and the instruments' plain results in, page out; the work that needs the models (probe,
forward costs) is requested here and done by the page (``explorer_page.run_instrument_requests``)."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Callable
from typing import Any

import streamlit as st

from ..engine.runtime import timeline
from ..instruments import acceptance as acc
from ..instruments import figures as ifig
from ..instruments import optimal_tree as ot
from ..instruments.calibration import calibration_report
from ..trace import lanes as two_lanes
from ..trace.figures import lanes_figure
from ..trace.records import RunTrace, StepTrace
from .layout import chart_columns
from .state import Explorer, ask_for_tree_run

TEACH_PROBE = ("The target checks the whole tree in one pass, with a mask that lets each token see only its own "
               "branch. The probe redoes the check the slow way, one token at a time along each branch, as ordinary "
               "generation does, and compares the two. The numbers differ a little because the computer rounds in "
               "a different order; that only matters when the target's two favourite tokens are closer than the "
               "rounding, and then the tree and ordinary generation can pick different words.")
TEACH_ACCEPTANCE = ("Before the target looks, we can already say how likely each drafted token is to pass: it "
                    "depends on how much the draft's and the target's guesses overlap. Adding those chances up "
                    "gives how many tokens a step should produce on average; the bars show what each step really "
                    "produced. The grid shows how often the first, second, third guess passes at each depth.")
TEACH_TIMELINE = ("Each bar is one piece of the step: the small model drafting, the big model checking, and the "
                  "bookkeeping in between. If speculation is slower than plain generation on your machine, the "
                  "run chart shows why: the drafting and checking passes cost more than the tokens they save.")
TEACH_LANES = ("PEARL keeps both models busy: while the big model checks what the small one drafted last round, the "
               "small one already drafts the next round. Each round's two bars start together, so a round takes as "
               "long as the slower of the two, not their sum. Light rounds begin afresh after a rejection (the big "
               "model checks only the first new token); dark rounds verify a whole block.")
TEACH_CALIBRATION = ("The stop rule guesses, before the target looks, how likely each drafted token is to pass. "
                     "If its guesses are honest, the dots lie on the diagonal. The curve on the right shows how "
                     "well the guesses separate passing from failing tokens, and the last chart what each "
                     "threshold would have cost: fewer draft passes, but fewer tokens per step.")
TEACH_OPTIMAL = ("From how often each guess passes, we can try every tree shape with a given number of nodes and "
                 "keep the one that should produce the most tokens per target pass (Sequoia's dynamic program). "
                 "With the measured cost of each pass on this machine we can also pick the shape that should be "
                 "fastest in tokens per second. The button runs the chosen shape.")

PROBE_HELP = {
    "max |Δ logit|": "largest difference, over the whole vocabulary, between a row's logits from the tree forward "
                     "and from plain decoding (prompt prefilled, then one token per forward along the node's path)",
    "flips": "drafted nodes whose accept / reject decision differs when the same step is verified on the plain "
             "decoding logits with the same random draws",
    "argmax flips": "rows whose most likely token differs between the tree forward and plain decoding",
}
METRIC_HELP = {
    "expected": "sum over the run's steps of the tokens each step commits in expectation given its drafted tree "
                "(the verifier's own coin flips averaged out), divided by target calls; steps that ended the run "
                "are left out",
    "realised": "tokens the same steps committed, divided by their target calls",
    "length": "acceptance length as EAGLE and vLLM report it: mean tokens committed per draft-and-verify step, the "
              "bonus token included (block efficiency also counts the prefill as a call)",
}


def app_button(box, label: str, **kwargs) -> None:
    """A button (``box.button``) whose work needs the whole page: the models (a probe, a what-if), another run (the
    optimal tree's), the sidebar. Its callback asks for the work; inside a fragment (``explorer_page.step_view``) the
    click would rerun that fragment only, so it reruns the app, whose script body does the work."""
    if box.button(label, **kwargs):
        st.rerun(scope="app")


def of_the_run(trace: RunTrace, name: str, build: Callable[[], Any]) -> Any:
    """A figure (or a search) of the whole run, ``build()``, not of the step on screen: built once per length of the
    run and kept for the run on screen (``Explorer.RUN_FIGURES``), so that Back and Forward, which redraw the step
    view, do not build it again. ``name`` names it and whatever else it is drawn from (a budget, a measured cost)."""
    held = Explorer.RUN_FIGURES.get()
    if held is None or held["trace"] is not trace or held["steps"] != len(trace.steps):
        held = {"trace": trace, "steps": len(trace.steps)}
        Explorer.RUN_FIGURES.set(held)
    if name not in held:
        held[name] = build()
    return held[name]


STEPS_KEPT = 16  # the steps whose figures of_the_step keeps: Back and Forward over the last ones build nothing


def of_the_step(trace: RunTrace, step: StepTrace, name: str, build: Callable[[], Any]) -> Any:
    """A figure of one step of the run on screen, ``build()``: a recorded step does not change, so its figures are
    built once (most when the step is new: Step's run draws it) and kept for the ``STEPS_KEPT`` steps drawn last
    (``Explorer.STEP_FIGURES``); going Back and Forward over them builds nothing. ``name`` names the figure and
    whatever else it is drawn from (the node selected, the colouring, a what-if threshold)."""
    held = Explorer.STEP_FIGURES.get()
    if held is None or held["trace"] is not trace:
        held = {"trace": trace, "steps": {}}
        Explorer.STEP_FIGURES.set(held)
    steps = held["steps"]
    built = steps.pop(step.index, None) or {}
    steps[step.index] = built  # the last drawn last
    while len(steps) > STEPS_KEPT:
        del steps[next(iter(steps))]
    if name not in built:
        built[name] = build()
    return built[name]


def teach_caption(text: str) -> None:
    st.markdown(f"<div class='teach-box'><p>{html.escape(text)}</p></div>", unsafe_allow_html=True)


def flagged_nodes(probe: dict | None) -> dict[int, str]:
    """Node id -> hover text for the probe's flipped decisions (empty without a probe)."""
    if not probe:
        return {}
    return {f["node"]: f"probe: {f['status']} here, {f['reference_status']} on plain decoding"
            for f in probe["node_flips"]}


def _request_probe(index: int) -> None:
    Explorer.PROBE_REQUEST.set(index)


def probe_section(step: StepTrace, probe: dict | None, can_probe: bool, teach: bool, prefix: str = "") -> None:
    """The probe's expander for one step: a button (live sessions) and the result when there is one."""
    with st.expander("Tree-attention probe: does the tree forward match plain decoding?", expanded=probe is not None):
        if teach:
            teach_caption(TEACH_PROBE)
        st.caption("Recomputes every node's target logits with plain one-token decoding along its own path (as "
                   "`generate` would), compares them with the tree forward's, re-verifies the step on them with "
                   "the same random draws, and lints the mask the target was sent. Costs one target forward per "
                   "node; older steps are replayed first.")
        if can_probe:
            app_button(st, "Probe this step", key=f"{prefix}probe_btn_{step.index}", on_click=_request_probe,
                       args=(step.index,))
        else:
            st.caption("Needs the models: run the session live, or use `python -m explorer probe --trace FILE`.")
        if probe is None:
            return
        c = st.columns(4)
        c[0].metric("max |Δ logit|", f"{probe['max_delta_logit']:.3g}", help=PROBE_HELP["max |Δ logit|"])
        c[1].metric("Flipped decisions", probe["flips"], help=PROBE_HELP["flips"])
        c[2].metric("Flipped argmaxes", probe["argmax_flips"], help=PROBE_HELP["argmax flips"])
        c[3].metric("Mask lint", "OK" if not probe["lint"] else f"{len(probe['lint'])} problems",
                    help="every row attends to exactly the context, its ancestors and itself, at position "
                         "anchor + depth")
        for p in probe["lint"]:
            st.error(f"Mask: {p}")
        for f in probe["node_flips"]:
            if not f.get("cause", True):
                continue  # below a flip: it follows from that one
            row = next(r for r in probe["rows"] if r["node"] == f["parent"])
            top = row["top2_reference"]
            gap = ("tie exactly (the argmax takes the lower token id)" if row["top2_gap"] == 0 else
                   f"are {row['top2_gap']:.4g} logits = {row['gap_steps']:.1f} {probe['dtype']} rounding steps apart")
            st.warning(f"Node {f['node']} {f['text']!r}: {f['status']} here, {f['reference_status']} on plain "
                       f"decoding. On plain decoding its parent's best two tokens {top[0][1]!r} and {top[1][1]!r} "
                       f"{gap}, while the two forwards differ by up to {row['max_delta_logit']:.3g} on that row.")
        if probe["committed"] != probe["reference_committed"]:
            st.warning("Plain decoding would have committed other tokens at this step: the run leaves `ar`'s "
                       "output here.")
        st.plotly_chart(ifig.probe_figure(probe), width="stretch", key=f"{prefix}probe_chart_{step.index}")
        st.dataframe(ifig.probe_rows(probe), hide_index=True, width="stretch")


def timeline_section(trace: RunTrace, step: StepTrace, costs: dict | None, teach: bool) -> None:
    """The step's waterfall and, over the run, where the time went beside plain decoding's estimated cost."""
    with st.expander("The step's timeline: where the time went"):
        if teach:
            teach_caption(TEACH_TIMELINE)
        if not step.timeline:
            st.info("This trace was recorded before steps kept their timeline.")
            return
        if two_lanes.is_parallel(trace):
            lanes_section(trace, step, teach)
        total = sum(s["ms"] for s in step.timeline if "lane" not in s)
        st.caption(f"Segments from the host clock (the device synchronised at each boundary on CUDA; forwards also "
                   f"carry CUDA-event device time there). Their sum, {total:.1f} ms, covers the step from its first "
                   f"timestamp to the end of what it learned; the step's own timer says {step.step_ms:.1f} ms "
                   "without the trace recording.")
        st.plotly_chart(of_the_step(trace, step, "waterfall", lambda: ifig.waterfall_figure(step)), width="stretch",
                        key=f"timeline_{step.index}")
        steps = [s for s in trace.steps if s.timeline]
        one_row = None
        if costs:
            target = {int(k): v for k, v in costs["target"].items()}
            one_row = target.get(1)
        plain = timeline.plain_decoding_ms(steps, one_row)
        totals = timeline.phase_totals(steps)
        tokens = sum(len(s.committed_ids) for s in steps)
        st.plotly_chart(of_the_run(trace, f"run time {one_row}", lambda: ifig.run_time_figure(totals, plain, tokens)),
                        width="stretch", key="timeline_run")
        spent = sum(totals.values())
        if plain is not None:
            st.caption(f"The steps took {spent / 1e3:.2f} s for {tokens} tokens; plain decoding would take about "
                       f"{plain / 1e3:.2f} s (one-row target forward x tokens"
                       f"{', measured' if one_row else ', the fastest small target forward of this run'}): this "
                       f"run decoded at {plain / spent:.2f}x plain decoding's speed.")
        else:
            st.caption("To compare with plain decoding, measure the forward costs (in the acceptance panel below).")


def lanes_section(trace: RunTrace, step: StepTrace, teach: bool) -> None:
    """PEARL's two lanes over the run up to the step on screen (``trace.lanes``), that step outlined, and what the
    overlap saves."""
    if teach:
        teach_caption(TEACH_LANES)
    upto = dataclasses.replace(trace, steps=trace.steps[: step.index + 1])
    st.plotly_chart(of_the_step(trace, step, "lanes", lambda: lanes_figure(upto, step.index)), width="stretch",
                    key=f"lanes_{step.index}")
    rounds = [r for r in (two_lanes.round_lanes(s) for s in upto.steps) if r]
    one, two = sum(r["one_lane_ms"] for r in rounds), sum(r["round_ms"] for r in rounds)
    how = ("measured: the draft ran in a thread of its own" if two_lanes.measured_lanes(trace)
           else "simulated: this run drafted, then verified, on one device; on two the lanes overlap")
    lost = sum(len(two_lanes.discarded(s)) for s in upto.steps)
    st.caption(f"{len(rounds)} rounds: {one / 1e3:.2f} s one after the other, {two / 1e3:.2f} s on two lanes "
               f"({one / two:.2f}x; {how}). {lost} drafted tokens were discarded after rejections."
               if two else "No round has a timeline.")


TEACH_DISTILL = ("After each prompt, the {who} looks at the places where the target rejected its guesses and "
                 "nudges itself towards what the target wanted there. It never changes in the middle of a prompt, "
                 "so the output stays exactly the target's; over a stream of similar prompts it should guess "
                 "right more often.")


def distill_section(history: list[dict] | None, teach: bool, reset: Callable[[], None], who: str = "head") -> None:
    """The session's head (``who``: head) or draft's LoRA adapter (draft) learning online (``engine/online_distill*``):
    acceptance by request, the version, and a button that starts it afresh (``reset``)."""
    head = who == "head"
    learner = "head" if head else "draft's adapter"
    with st.expander(f"The {who} learning online (OSD)"):
        if teach:
            teach_caption(TEACH_DISTILL.format(who=who))
        if not history:
            st.info(f"No prompt has finished yet: the {learner} learns when a run ends (Step until the end, or "
                    "Run).")
        else:
            figure = ifig.learning_figure(history, "head" if head else "draft adapter")
            st.plotly_chart(figure, width="stretch", key="distill_curve")
            last = history[-1]
            updates = sum(1 for row in history if row.get("updated"))
            st.caption(f"{len(history)} prompts finished; {updates} updates ({learner} version "
                       f"{last['version'] + (1 if last.get('updated') else 0)}). Each point is one prompt's share "
                       "of steps whose first drafted token was accepted.")
        st.button("Reset the head to the shipped one" if head else "Reset the draft (drop its adapter)",
                  key="distill_reset", on_click=reset)


def calibration_section(trace: RunTrace, teach: bool) -> None:
    """Stop-signal calibration over the run: reliability, ROC with the run's operating point, threshold costs."""
    with st.expander("Stop-signal calibration"):
        if teach:
            teach_caption(TEACH_CALIBRATION)
        report = calibration_report([trace])
        if not report["points"]:
            st.info("No drafted token was both scored by a stop policy and tested yet (the static methods score "
                    "with the draft's confidence once a level is checked; step further, or use mcsd-improved).")
            return
        auc = report["roc"]["auc"]
        c = st.columns(3)
        c[0].metric("Scored and tested nodes", report["points"], help="drafted tokens the stop policy scored and the "
                                                                      "verifier tested; accepted ones are positives")
        c[1].metric("ROC-AUC", "–" if auc is None else f"{auc:.3f}",
                    help="probability that an accepted token scored above a rejected one")
        c[2].metric("Brier score", f"{report['brier']:.3f}", help="mean squared error of the score against the "
                                                                   "accept decision (0 = perfect)")
        left, right = chart_columns(2, "instrument_charts_1")
        left.plotly_chart(ifig.reliability_figure(report), width="stretch", key="cal_reliability")
        right.plotly_chart(ifig.roc_figure(report), width="stretch", key="cal_roc")
        st.plotly_chart(ifig.threshold_cost_figure(report), width="stretch", key="cal_costs")
        score = ("the decision model's predicted acceptance of each drafted token"
                 if report["policy"] in ("decision", "prune", "specdec++")
                 else "the draft's probability q(x) of each token")
        st.caption(f"Score: {score} ({report['policy']} policy). Threshold costs come "
                   "from re-running the recorded stop decisions (exact under greedy verification; where a lower "
                   "threshold would draft deeper than recorded they are lower bounds).")


def _request_costs() -> None:
    Explorer.COSTS_REQUEST.set(True)


def acceptance_report(trace: RunTrace, costs: dict | None) -> dict:
    """Expected against realised acceptance over the run (``instruments.acceptance.run_report``; the optimal tree
    reads its measured rates), computed once per length of the run (``of_the_run``)."""
    return of_the_run(trace, f"acceptance {costs is not None}", lambda: acc.run_report([trace], costs=costs))


def acceptance_section(trace: RunTrace, costs: dict | None, can_measure: bool, teach: bool) -> dict:
    """Expected against realised acceptance over the run; returns the report."""
    report = acceptance_report(trace, costs)
    with st.expander("Expected against realised acceptance"):
        if teach:
            teach_caption(TEACH_ACCEPTANCE)
        exp, real = report["expected_tokens_per_call"], report["realised_tokens_per_call"]
        c = st.columns(3)
        c[0].metric("Expected tokens / call", "–" if exp is None else f"{exp:.3f}", help=METRIC_HELP["expected"])
        c[1].metric("Realised tokens / call", "–" if real is None else f"{real:.3f}", help=METRIC_HELP["realised"])
        length = report["acceptance_length"]
        c[2].metric("Acceptance length", "–" if length is None else f"{length:.3f}", help=METRIC_HELP["length"])
        if not report["slots"]:
            st.info("No tested draft tokens yet (or a trace recorded before the odds were kept).")
            return report
        left, right = chart_columns(2, "instrument_charts_2")
        left.plotly_chart(ifig.slot_heatmap(report["slots"], "realised"), width="stretch", key="acc_heat_real")
        right.plotly_chart(ifig.slot_heatmap(report["slots"], "expected"), width="stretch", key="acc_heat_exp")
        st.caption("Rank = order of the test among siblings (0 = tested first). Realised: accepted / tested. "
                   "Expected: the mean over the same tests of the slot's acceptance probability (Σ min(p, q) after "
                   "the earlier siblings), which estimates the same rate with less noise.")
        left, right = chart_columns(2, "instrument_charts_3")
        left.plotly_chart(ifig.expected_realised_figure(report["per_step"]), width="stretch", key="acc_steps")
        right.plotly_chart(ifig.position_figure(report["position_acceptance"]), width="stretch", key="acc_pos")
        if costs:
            st.plotly_chart(ifig.cost_figure(costs), width="stretch", key="acc_costs")
        elif can_measure:
            st.button("Measure forward costs on this machine", key="costs_btn", on_click=_request_costs,
                      help="times one draft and one target forward at 1 to 64 query rows (a few seconds on a GPU, "
                           "about a minute on a CPU); the optimal tree then also gets a tokens/s model")
    return report


def _run_tree(parents: list[int]) -> None:
    ask_for_tree_run(parents)


@st.fragment
def optimal_tree_section(trace: RunTrace, step: StepTrace | None, report: dict, can_run: bool,
                         teach: bool) -> None:
    """The optimal tree for the run's measured rates beside ``step``'s own tree, a fragment: its node budget and
    depth limit rerun this section alone; running a tree reruns the app."""
    with st.expander("The optimal tree for this run"):
        if teach:
            teach_caption(TEACH_OPTIMAL)
        if report.get("acceptance_vector") is None:
            st.info(report.get("optimal_tree_error") or "Run more steps first.")
            return
        c = st.columns(2)
        budget = c[0].slider("Node budget", 1, 64, 32, key="opt_budget")
        depth = c[1].slider("Depth limit", 1, 16, 8, key="opt_depth")
        table = report["acceptance_vector"]
        best = of_the_run(trace, f"optimal {budget} {depth}", lambda: ot.optimal_tree(table, budget, depth))
        costs = report.get("forward_costs_ms")
        used = report["used_tree"]
        lines = [f"Trees this run used: {used['mean_nodes']:.1f} nodes on average, "
                 f"{used['modelled_tokens_per_call']:.3f} tokens per call expected under the measured rates, "
                 f"{report['realised_tokens_per_call'] or 0:.3f} realised."]
        lines.append(f"Optimal for {budget} nodes: {ot.summary(best)}.")
        shown = [("Optimal tree", best)]
        if costs:
            draft, target = ot.cost_curve(costs["draft"]), ot.cost_curve(costs["target"])
            fast = of_the_run(trace, f"fastest {budget} {depth}",
                              lambda: ot.fastest_tree(table, budget, depth, draft, target))
            lines.append(f"Fastest under the measured forward costs: {ot.summary(fast)}.")
            if used.get("modelled_tokens_per_s"):
                lines.append(f"The trees this run used model at {used['modelled_tokens_per_s']:.2f} tokens/s.")
            if fast.parents:
                shown.append(("Fastest tree", fast))
        st.markdown("  \n".join(html.escape(x) for x in lines))
        cols = chart_columns(len(shown) + (1 if step is not None else 0), "optimal_trees")
        for col, (name, tree) in zip(cols, shown):
            figure = of_the_run(trace, f"{name} {budget} {depth} {costs is not None}", lambda t=tree, n=name: (
                ifig.template_figure(list(t.parents), list(t.node_probabilities),
                                     f"{n}: {t.expected_tokens:.2f} tokens per call")))
            col.plotly_chart(figure, width="stretch", key=f"opt_fig_{name}")
            col.code(",".join(map(str, tree.parents)) or "(no tree)", language=None)
            if can_run and tree.parents:
                app_button(col, f"Run mcsd with the {name.lower()}", key=f"opt_run_{name}", on_click=_run_tree,
                           args=(list(tree.parents),),
                           help="switches the sidebar to mcsd with this tree template and runs the prompt")
        if step is not None:
            parents = acc.model_tree_parents(step)
            probs = ot.node_probabilities(parents, table) if parents else []
            title = f"Step {step.index + 1}'s tree: {ot.expected_tokens(parents, table):.2f} tokens per call"
            figure = of_the_run(trace, f"step {step.index}", lambda: ifig.template_figure(parents, probs, title))
            cols[-1].plotly_chart(figure, width="stretch", key="opt_fig_used")
        st.caption("Under Sequoia's positional model: the sibling tested r-th at depth d passes with the measured "
                   "rate of slot (d, r), whatever the token. Slots nobody measured count as never accepted, so "
                   "measure with a wide tree (e.g. k_config 6,3,2,2,1,1) to let the search consider wide ones.")
