"""The what-if panel of a step: edit the step (replace a drafted token, add or remove a branch, change
the verifier, temperature or seed), re-verify it from its saved state, and see it beside the recorded one; then go
on from the edit as a new run of the session. The panel only asks (``Explorer.CF_REQUEST``); the page does the work
with the models (``explorer_page.run_instrument_requests``) and keeps the result as plain data
(``Explorer.COUNTERFACTUALS``)."""

from __future__ import annotations

import html

import streamlit as st

from ..engine.config import VERIFIERS
from ..trace import figures
from ..trace.records import StepTrace
from .instruments_panel import app_button, teach_caption
from .state import Explorer

TEACH_WHAT_IF = ("What would the target have done if the draft had proposed another word here? Pick a drafted "
                 "token and replace it (for instance with the target's own favourite, listed first), add a branch "
                 "or remove one, then re-verify: the step runs again from exactly where it was, with the same "
                 "random numbers, and the two trees are shown side by side. The original run is kept.")
ACTIONS = {"replace": "replace a drafted token", "add": "add a child", "remove": "remove a branch",
           "settings": "change verifier / temperature / seed", "none": "nothing: re-verify as recorded"}


def _node_label(n) -> str:
    return f"{n.id} {n.text!r} ({n.status})" if n.id else "0 (the anchor)"


def _token_choice(step: StepTrace, parent_id: int, key: str):
    """A token for a child of ``parent_id``: one of the target's best there (when the trace has them) or typed."""
    tops = next((n.p_top for n in step.nodes if n.parent == parent_id and n.p_top), [])
    options = [f"{t} {text!r} (p {p:.2f})" for t, text, p in tops] + ["other…"]
    pick = st.selectbox("New token (the target's best at that place first)", options, key=f"{key}_pick")
    if pick != "other…":
        return pick.split(" ", 1)[0]
    return st.text_input("Token id, or text in quotes (one token)", key=f"{key}_typed", placeholder="e.g. 42 or ' the'")


@st.fragment
def counterfactual_section(step: StepTrace, result: dict | None, can_edit: bool, teach: bool,
                           temperature: float = 0.0) -> None:
    """The what-if expander of ``step``, a fragment: choosing the edit reruns this section alone; re-verifying it,
    or going on from it, reruns the app (the work needs the models). ``result``: the latest re-verification of this
    step, if any; ``temperature``: the run's (the settings edit starts from it)."""
    with st.expander("What if: edit this step and re-verify it", expanded=result is not None):
        if teach:
            teach_caption(TEACH_WHAT_IF)
        if not can_edit:
            st.caption("Needs the models: run the session live, or use `python -m explorer counterfactual --trace "
                       "FILE --step N --edit ...`.")
        else:
            _edit_form(step, temperature)
        if result is not None:
            _show(step, result)


def _edit_form(step: StepTrace, temperature: float) -> None:
    key = f"cf_{step.index}"
    action = st.radio("Change", list(ACTIONS), format_func=ACTIONS.get, horizontal=True, key=f"{key}_action")
    drafted = [n for n in step.nodes[1:] if n.source != "target"]
    specs: list[str] = []
    if action == "replace" and drafted:
        first_rejected = next((i for i, n in enumerate(drafted) if n.status == "rejected"), 0)
        node = st.selectbox("Node (a rejected one first)", drafted, index=first_rejected, format_func=_node_label,
                            key=f"{key}_node")
        token = _token_choice(step, node.parent, key)
        specs = [f"replace:{node.id}={token}"] if token else []
    elif action == "add":
        node = st.selectbox("Parent", step.nodes, format_func=_node_label, key=f"{key}_parent")
        token = _token_choice(step, node.id, key)
        specs = [f"add:{node.id}={token}"] if token else []
    elif action == "remove" and drafted:
        node = st.selectbox("Node (its whole subtree goes)", drafted, format_func=_node_label, key=f"{key}_rm")
        specs = [f"remove:{node.id}"]
    elif action == "settings":
        c = st.columns(3)
        verifier = c[0].selectbox("Verifier", ["as recorded", "greedy", *VERIFIERS], key=f"{key}_verifier")
        temperature = c[1].number_input("Temperature", 0.0, 2.0, float(temperature), 0.05, key=f"{key}_temp")
        seed = c[2].number_input("Seed", 0, 2**31 - 1, 0, key=f"{key}_seed")
        specs = [f"temperature:{temperature}", f"seed:{int(seed)}"]
        if verifier != "as recorded":
            specs.append(f"verifier:{verifier}")
    more = st.slider("Then decode more tokens from the edit", 0, 64, 16, key=f"{key}_more")
    app_button(st, "Re-verify this step", key=f"{key}_go", on_click=_request,
               args=({"step": step.index, "edits": specs, "continue": more},))


def _request(request: dict) -> None:
    Explorer.CF_REQUEST.set(request)


def _continue_from_edit(step_index: int) -> None:
    Explorer.CF_BRANCH.set(step_index)


def _show(step: StepTrace, result: dict) -> None:
    edited = StepTrace.from_dict(result["edited"])
    if result["identical"]:
        st.success("Re-verified as recorded: every node's decision and every committed token match the recorded step.")
    elif result["differences"]:
        st.markdown("**What changed**\n" + "\n".join(f"- {html.escape(d)}" for d in result["differences"]))
    else:
        st.info("The edit changed nothing the verifier decided.")
    left, right = st.columns(2)
    left.plotly_chart(figures.tree_figure(step), width="stretch", key=f"cf_orig_{step.index}")
    left.markdown(f"Recorded: commits `{''.join(step.committed_text)!r}`")
    right.plotly_chart(figures.tree_figure(edited), width="stretch", key=f"cf_edit_{step.index}")
    right.markdown(f"Edited: commits `{''.join(edited.committed_text)!r}`")
    left, right = st.columns(2)
    left.plotly_chart(figures.mask_figure(step), width="stretch", key=f"cf_orig_mask_{step.index}")
    right.plotly_chart(figures.mask_figure(edited), width="stretch", key=f"cf_edit_mask_{step.index}")
    if result.get("continuation_text"):
        st.markdown(f"**Then** (decoding on from the edit): `{result['continuation_text']!r}`")
    if result.get("engine") is not None:
        app_button(st, "Continue from the edit as a new run", key=f"cf_branch_{step.index}",
                   on_click=_continue_from_edit, args=(step.index,),
                   help="the session keeps the original run; switch between its runs above the buttons")
