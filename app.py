"""Streamlit UI of the speculative decoding explorer: layout and callbacks only.

Data flows one way: models (cached, shared) -> engine (per session) -> RunTrace -> figures -> this page. The page
never touches the engine's tensors; it reads ``engine.trace``.

Run: ``streamlit run app.py`` (``SPEC_EXPLORER_PAIR=tiny`` starts on the tiny random pair instead of the
embedded one).
"""

from __future__ import annotations

import html
import os

import streamlit as st

from explorer import figures
from explorer.config import DEFAULTS, METHOD_LABELS, METHODS, VERIFIER_LABELS, VERIFIERS
from explorer.metrics import run_metrics
from explorer.prompts import PromptError, humaneval, mt_bench
from explorer.sampling import SamplingConfig
from explorer.stopping import (
    DEFAULT_THRESHOLDS,
    LEARNED_POLICIES,
    STOP_POLICY_LABELS,
    STOP_POLICY_NAMES,
)
from explorer.tree import TreeShapeError, parse_k_config

st.set_page_config(page_title="Speculative decoding explorer", page_icon="🌳", layout="wide")

PAIRS = {"default": "Embedded: Qwen2.5-Coder 0.5B → 1.5B", "tiny": "Tiny random pair (no download, for trying)",
         "custom": "Custom pair (folders, hub ids or .gguf)"}


# ---------------------------------------------------------------------------------------------------- resources

@st.cache_resource(show_spinner=False, max_entries=3)
def get_pair(spec: str, draft: str, target: str, dtype: str):
    """Models are shared by every session: read-only, forwards serialised by ``pair.lock``. No Streamlit calls in
    here: a cached function may not touch page elements created outside it."""
    from explorer.models import load_named_pair

    return load_named_pair(spec, dtype=dtype, draft=draft or None, target=target or None)


@st.cache_data(show_spinner=False)
def example_prompts() -> dict[str, str]:
    out = {}
    try:
        for p in mt_bench():
            out[f"MT-bench {p.id} ({p.category}): {p.text[:60]}"] = p.text
        for p in humaneval():
            out[f"HumanEval {p.id}: {p.text.split('def ', 1)[-1][:50]}"] = p.text
    except PromptError as exc:  # examples are a convenience: the app works without them
        out[f"(examples unavailable: {exc})"] = ""
    return out


def set_error(message: str | None) -> None:
    st.session_state["error"] = message


def load_pair_with_progress(spec: str, draft: str, target: str, dtype: str):
    """First start of the embedded pair: assemble, verify and convert it (on disk, once) with a progress bar;
    then load the cached pair (seconds)."""
    from explorer import models

    if spec == "default":
        missing = [m for m in (models.DEFAULT_DRAFT, models.DEFAULT_TARGET)
                   if not models.is_prepared(m, models.parse_dtype(dtype))]
        if missing:
            bar = st.progress(0.0, text="Preparing the embedded models (first start only)…")
            try:
                for m in missing:
                    models.prepare_embedded(m, models.parse_dtype(dtype), progress=lambda msg, f: bar.progress(
                        min(max(f, 0.0), 1.0), text=msg))
            finally:
                bar.empty()
    with st.spinner("Loading models…"):
        return get_pair(spec, draft, target, dtype)


# ---------------------------------------------------------------------------------------------------- sidebar

def sidebar():
    sb = st.sidebar
    sb.header("Model pair")
    initial = os.environ.get("SPEC_EXPLORER_PAIR", "default")
    spec = sb.radio("Pair", list(PAIRS), index=list(PAIRS).index(initial) if initial in PAIRS else 0,
                    format_func=PAIRS.get, key="pair_spec")
    draft = target = ""
    if spec == "custom":
        draft = sb.text_input("Draft model", key="draft_path", placeholder="path, hub id or file.gguf")
        target = sb.text_input("Target model", key="target_path", placeholder="path, hub id or file.gguf")
    dtype = sb.selectbox("dtype", ["bf16", "fp32"], key="dtype", disabled=spec == "tiny",
                         help="bf16 is fast on CPUs with AVX-512-BF16; fp32 makes tree verification expensive")

    sb.header("Method")
    method = sb.selectbox("Method", METHODS, index=METHODS.index("mcsd-improved"), format_func=METHOD_LABELS.get,
                          key="method")
    d = DEFAULTS[method]
    changes: dict = {}
    if method == "sd":
        changes["gamma"] = sb.slider("Draft length γ", 1, 12, d.gamma, key="gamma")
    if method in ("mcsd", "mcsd-improved"):
        lossy = False
        if method == "mcsd-improved":
            lossy = sb.checkbox("Seed's lossy mode (target-initialized roots, longest branch)", key="lossy",
                                help="Lu et al. 2024: w roots sampled from the target, each with a draft chain; "
                                     "the longest accepted branch wins. This biases the output distribution.")
        default_k = "1" if lossy else ",".join(map(str, d.k_config))
        changes["k_config"] = sb.text_input("k_config (children per level)", default_k,
                                            key=f"k_config_{method}_{lossy}",
                                            help="e.g. 4,2,2 = 4 children of the anchor, 2 under each, 2 under each")
        if method == "mcsd-improved":
            changes["lossy"] = lossy
            if lossy:
                changes["width"] = sb.slider("Target roots w", 1, 8, d.width, key="width")
            changes["max_depth"] = sb.slider("Max draft depth", 1, 12, d.max_depth, key="max_depth")
            stop = sb.selectbox("Stop policy", STOP_POLICY_NAMES, index=STOP_POLICY_NAMES.index(d.stop),
                                format_func=STOP_POLICY_LABELS.get, key="stop",
                                help="when drafting stops early: the draft's own confidence, or a learned decision "
                                     "model's predicted acceptance (the seed's rule, per-branch pruning, or "
                                     "SpecDec++'s cumulative rule)")
            changes["stop"] = stop
            changes["threshold"] = sb.slider(
                "Threshold h (stop when P(reject) > h)" if stop == "specdec++" else "Threshold τ", 0.0, 1.0,
                DEFAULT_THRESHOLDS[stop], 0.05, key=f"threshold_{stop}", disabled=stop == "none")
            if stop in LEARNED_POLICIES:
                changes["decision_model"] = sb.selectbox(
                    "Decision model", ["dist", "path", "hidden"], key="decision_model",
                    format_func={"hidden": "MLP on the draft's hidden state",
                                 "dist": "MLP on entropy + top-10 of q",
                                 "path": "MLP on entropy + top-10 + q(x), depth, path prob"}.get)
    if method in ("sd", "mcsd", "mcsd-improved") and not changes.get("lossy"):
        changes["verifier"] = sb.selectbox("Verifier", ("auto",) + VERIFIERS, format_func=VERIFIER_LABELS.get,
                                           key="verifier", help="at temperature 0 every rule is greedy matching")

    sb.header("Sampling")
    temperature = sb.slider("Temperature (0 = greedy)", 0.0, 1.5, 0.0, 0.05, key="temperature")
    top_k = sb.number_input("top-k (0 = off)", 0, 1000, 0, key="top_k")
    top_p = sb.slider("top-p", 0.05, 1.0, 1.0, 0.05, key="top_p")
    seed = sb.number_input("Seed", 0, 2**31 - 1, 0, key="seed")
    max_new = sb.slider("Max new tokens", 1, 512, 64, key="max_new")
    return {"spec": spec, "draft": draft, "target": target, "dtype": dtype, "method": method, "changes": changes,
            "sampling": dict(temperature=temperature, top_k=int(top_k), top_p=top_p, seed=int(seed)),
            "max_new": int(max_new)}


def build_config(settings):
    changes = dict(settings["changes"])
    if "k_config" in changes:
        changes["k_config"] = parse_k_config(changes["k_config"])
    return DEFAULTS[settings["method"]].with_(**changes)


# ---------------------------------------------------------------------------------------------------- actions

def start_engine(pair, settings, prompt_text: str, chat: bool):
    from explorer.engine import Engine
    from explorer.prompts import encode_prompt

    config = build_config(settings)
    sampling = SamplingConfig(**settings["sampling"])
    ids = encode_prompt(pair.tokenizer, prompt_text, chat_template=chat)
    engine = Engine(pair, config, sampling)
    engine.start(ids, settings["max_new"], prompt_text=prompt_text)
    st.session_state["engine"] = engine
    st.session_state["run_settings"] = settings


def do_step(pair, settings, prompt_text, chat, run_to_end=False):
    engine = st.session_state.get("engine")
    if engine is None:
        start_engine(pair, settings, prompt_text, chat)
        engine = st.session_state["engine"]
    if engine.finished:
        set_error("This run has finished. Press Reset to start a new one.")
        return
    if not run_to_end:
        engine.step()
        return
    bar = st.progress(0.0, text="Running to the end…")
    stop_at = engine.max_new_tokens

    def progress(_step):
        bar.progress(min(1.0, engine.n_generated / stop_at), text=f"{engine.n_generated}/{stop_at} tokens")

    engine.run(on_step=progress)
    bar.empty()


def guarded(action, *args, **kwargs):
    """Run an action; any failure becomes a message on the page (never a traceback) and the app keeps going."""
    from explorer.engine import EngineError
    from explorer.models import ModelPairError

    try:
        set_error(None)
        action(*args, **kwargs)
    except (PromptError, TreeShapeError, ModelPairError, EngineError, ValueError) as exc:
        set_error(str(exc))
    except Exception as exc:  # noqa: BLE001 - the page must stay up whatever a model does
        set_error(f"unexpected error ({type(exc).__name__}): {exc}")


# ---------------------------------------------------------------------------------------------------- page

def show_run(trace):
    m = run_metrics(trace)
    cols = st.columns(6)
    acc, mcsd_acc = m["acceptance_rate"], m["mcsd_acceptance_rate"]
    cols[0].metric("Generated tokens", m["generated_tokens"])
    cols[1].metric("Target calls", m["target_calls"])
    cols[2].metric("Tokens / target call", "–" if not m["target_calls"] else f"{m['tokens_per_target_call']:.2f}",
                   help="block efficiency: comparable across all methods")
    cols[3].metric("Acceptance (seed)", "–" if acc is None else f"{acc:.2f}",
                   help="mean over steps of longest accepted draft length / maximum draft length (Lu et al. 2024)")
    cols[4].metric("Acceptance (MCSD)", "–" if mcsd_acc is None else f"{mcsd_acc:.2f}",
                   help="accepted draft tokens / drafted tokens (Yang et al. 2024)")
    cols[5].metric("Tokens / s", "–" if not m["tokens_per_s"] else f"{m['tokens_per_s']:.1f}",
                   help="wall clock, prefill included; the UI adds no time to it")
    st.markdown("**Generated text** (each step's tokens shaded; bonus tokens underlined in blue)")
    st.markdown(figures.text_html(trace, current=len(trace.steps) - 1 if trace.steps else None),
                unsafe_allow_html=True)
    if not trace.steps:
        return
    step = trace.steps[-1]
    committed = "".join(step.committed_text)
    st.markdown(
        f"**Step {step.index + 1}** · committed {len(step.committed_ids)} token(s): "
        f"`{html.escape(committed)!r}` · accepted draft tokens {step.accepted_draft_len}/{step.max_draft_len} · "
        f"draft {step.draft_ms:.0f} ms ({step.draft_calls} calls) · verify {step.verify_ms:.0f} ms · "
        f"verifier `{step.verifier}`")
    left, right = st.columns([3, 2])
    with left:
        st.plotly_chart(figures.tree_figure(step), width="stretch", key="tree_chart")
    with right:
        st.plotly_chart(figures.mask_figure(step), width="stretch", key="mask_chart")
    with st.expander("Why each node was accepted or rejected"):
        st.caption("A node x is accepted when u ≤ p(x)/q(x) (the SpecHub rule uses its transport plan's "
                   "probability instead); after a rejection the next sibling, or the replacement token, is drawn "
                   "from the residual distribution.")
        st.dataframe(figures.node_rows(step), hide_index=True, width="stretch")
    c1, c2, c3 = st.columns(3)
    c1.plotly_chart(figures.branch_figure(step), width="stretch", key="branch_chart")
    with c2:
        stop_panel(step)
    c3.plotly_chart(figures.run_figure(trace), width="stretch", key="run_chart")


def stop_panel(step):
    """The stop chart, and a slider that re-runs the step's stop decisions with another threshold (no model)."""
    from explorer.stopping import score_threshold, what_if

    sigs = step.stop_signals
    policy = sigs[0].policy if sigs else "none"
    if not sigs or policy == "none":
        st.plotly_chart(figures.stop_figure(step), width="stretch", key="stop_chart")
        return
    recorded = score_threshold(policy, sigs[0].threshold)  # back from the score scale (1 - (1 - h) = h)
    tau = st.slider("What if the threshold were… (" + ("h" if policy == "specdec++" else "τ") + ")", 0.0, 1.0,
                    float(round(recorded, 2)), 0.05, key=f"whatif_{policy}",
                    help="re-runs this step's stop decisions on the recorded scores; nothing is recomputed")
    result = what_if(step, tau)
    st.plotly_chart(figures.stop_figure(step, {"threshold": score_threshold(policy, tau), "rows": result["rows"]}),
                    width="stretch", key="stop_chart")
    pruned = [f"branch {b} at level {r['level']}" for r in result["rows"] for b in r["pruned"]]
    note = (f"With {'h' if policy == 'specdec++' else 'τ'} = {tau:.2f}: {result['drafted']} draft tokens over "
            f"{result['draft_levels']} levels (recorded {step.drafted}), {result['tokens']} token(s) committed "
            f"(recorded {len(step.committed_ids)}).")
    if pruned:
        note += " Stops: " + "; ".join(pruned) + "."
    if result["deeper"]:
        note += " It would draft deeper than this step did, which the trace cannot show."
    if not result["exact"]:
        note += " Sampled verification: the committed count is the recorded path cut at the new depth."
    st.caption(note)


def audit_panel(pair, settings, prompt_text: str, chat: bool):
    """Sample the first two tokens many times and test them against the target's exact distribution."""
    from explorer.audit import audit
    from explorer.prompts import encode_prompt

    with st.expander("Losslessness audit: does this method sample exactly from the target?"):
        st.caption("Samples the first two committed tokens N times from the prompt (one speculative step each) and "
                   "compares them with the target's exact probabilities (chi-square test, total variation). Needs "
                   "a temperature above 0. On the embedded pair each sample costs about half a second.")
        samples = st.slider("Samples", 100, 5000, 1000 if settings["spec"] == "tiny" else 200, 100, key="audit_n")
        if st.button("Run audit", key="audit_btn"):
            bar = st.progress(0.0, text="Sampling…")
            try:
                config = build_config(settings)
                sampling = SamplingConfig(**settings["sampling"])
                ids = encode_prompt(pair.tokenizer, prompt_text, chat_template=chat)
                result = audit(pair, config, sampling, ids, samples,
                               progress=lambda d, t: bar.progress(d / t, text=f"{d}/{t} samples"))
                st.session_state["audit"] = result.to_dict()
            except (PromptError, TreeShapeError, ValueError) as exc:
                st.session_state.pop("audit", None)
                st.error(str(exc))
            finally:
                bar.empty()
        result = st.session_state.get("audit")
        if result:
            verdict = "passes" if result["passed"] else "FAILS"
            st.markdown(f"**{html.escape(result['method']['method'])}** with verifier `{result['verifier']}` "
                        f"{verdict} at α = {result['alpha']} over {result['samples']} samples.")
            c1, c2 = st.columns(2)
            c1.plotly_chart(figures.audit_figure(result, "first"), width="stretch", key="audit_first")
            if result.get("pairs"):
                c2.plotly_chart(figures.audit_figure(result, "pairs"), width="stretch", key="audit_pairs")


BENCH_REPORT = os.environ.get("SPEC_EXPLORER_BENCH", os.path.join(os.path.dirname(__file__), "reports", "bench",
                                                                   "bench.json"))


def benchmarks_page():
    """The latest `python -m explorer bench` report (or an uploaded bench.json): table and charts, no model."""
    import json

    from explorer.report import ReportError, load_report, loads_report

    st.title("Benchmarks")
    st.caption("Our methods against autoregressive decoding and Hugging Face assisted generation "
               "(`generate(assistant_model=draft)`), measured in one run. Produce a report with "
               "`python -m explorer bench --prompt-file humaneval --temperatures 0,0.7` (see docs/bench.md).")
    upload = st.file_uploader("Load a benchmark report (bench.json)", type=["json"], key="bench_upload")
    try:
        if upload is not None:
            report, source = loads_report(upload.getvalue()), upload.name
        elif os.path.exists(BENCH_REPORT):
            report, source = load_report(BENCH_REPORT), BENCH_REPORT
        else:
            st.info(f"No report at {BENCH_REPORT} yet: run the bench command above, or load a bench.json.")
            return
        m = report["meta"]
        st.markdown(f"Report **{html.escape(str(source))}** · {html.escape(str(m.get('prompt_set')))} · "
                    f"{m.get('max_new_tokens')} new tokens · {html.escape(str(m.get('pair')))} · "
                    f"{html.escape(str(m.get('dtype')))} on {html.escape(str(m.get('device')))} · "
                    f"{html.escape(str(m.get('machine')))} · {html.escape(str(m.get('date', '')))}")
        cols = ["temperature", "method", "tokens_per_s", "speedup_vs_ar", "ratio_vs_hf", "tokens_per_target_call",
                "acceptance_rate", "mcsd_acceptance_rate", "draft_s", "verify_s", "other_s"]
        st.dataframe([{c: r.get(c) for c in cols} for r in report["summary"]], hide_index=True, width="stretch")
        for i, fig in enumerate(figures.bench_figures(report)):
            st.plotly_chart(fig, width="stretch", key=f"bench_chart_{i}")
        st.caption("hf-assisted settings: " + html.escape(json.dumps(report.get("hf_assisted", {}))))
    except (ReportError, KeyError, TypeError) as exc:
        st.error(f"Cannot show this report: {exc}")


def main():
    if st.sidebar.radio("Page", ["Explorer", "Benchmarks"], horizontal=True, key="page") == "Benchmarks":
        benchmarks_page()
        return
    st.title("Speculative decoding explorer")
    st.caption("Draft a token tree with a small model, verify it with the large one in a single pass, and watch "
               "every decision. Methods: AR, SD, MCSD, and the improved MCSD of Lu et al. 2024.")
    settings = sidebar()

    if settings["spec"] == "custom" and not (settings["draft"] and settings["target"]):
        st.info("Enter a draft and a target model in the sidebar (local folders, hub ids or .gguf files).")
        return
    pair = None
    try:
        pair = load_pair_with_progress(settings["spec"], settings["draft"], settings["target"], settings["dtype"])
    except Exception as exc:  # noqa: BLE001 - shown, not raised: the user can pick another pair
        st.error(f"Cannot load this model pair: {exc}")
        return
    st.caption(f"Models: **{html.escape(pair.name)}** · {str(pair.dtype).removeprefix('torch.')} on {pair.device}")

    examples = example_prompts()

    def use_example():
        choice = st.session_state.get("example")
        if choice and examples.get(choice):
            st.session_state["prompt_text"] = examples[choice]

    st.selectbox("Example prompt", [""] + list(examples), key="example", on_change=use_example,
                 format_func=lambda s: s or "— pick an example, or type below —")
    prompt_text = st.text_area("Prompt", key="prompt_text", height=110,
                               placeholder="Write a Python function that checks whether a number is prime.")
    chat = st.checkbox("Apply the chat template", value=True, key="chat")

    b1, b2, b3, _ = st.columns([1, 1, 1, 5])
    if b1.button("Step", type="primary", key="step_btn"):
        guarded(do_step, pair, settings, prompt_text, chat)
    if b2.button("Run to end", key="run_btn"):
        guarded(do_step, pair, settings, prompt_text, chat, run_to_end=True)
    if b3.button("Reset", key="reset_btn"):
        st.session_state.pop("engine", None)
        set_error(None)

    if st.session_state.get("error"):
        st.error(st.session_state["error"])
    audit_panel(pair, settings, prompt_text, chat)
    engine = st.session_state.get("engine")
    if engine is not None and engine.pair is not pair:  # the pair changed under a run: it cannot go on
        st.session_state.pop("engine", None)
        engine = None
    if engine is None:
        st.info("Press **Step** to draft and verify one speculative round on the prompt.")
        return
    if st.session_state.get("run_settings") != settings:
        st.info("Settings changed since this run started: press Reset to apply them.")
    trace = engine.trace
    if trace.settings["method"]["lossy"]:
        st.warning("Lossy mode: the seed's longest-branch rule does not preserve the target's distribution.")
    if engine.finished:
        st.success("Run finished (max new tokens or end of sequence). Press Reset to start again.")
    show_run(trace)


main()
