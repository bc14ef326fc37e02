"""The sidebar: model pair, method and its shape, stop policy, sampling, teach mode. Returns plain settings; its
widgets' keys are ``state.Sidebar``'s."""

from __future__ import annotations

import os

import streamlit as st

from ..engine.config import (DEFAULTS, FREE_ROWS_CPU, MAX_TREE_NODES, METHOD_LABELS, METHOD_SPECS, METHODS,
                             VERIFIER_LABELS, VERIFIERS)
from ..engine.policies.fallback import FALLBACK_MODES
from ..engine.policies.stopping import (ADAPT_MODES, ADAPTABLE, DECISION_MODELS, DEFAULT_THRESHOLDS, LEARNED_POLICIES,
                                        STOP_POLICY_LABELS, STOP_POLICY_NAMES)
from ..models.loading import default_dtype
from .common import PAIRS
from .plugin_list import plugin_section
from .state import Sidebar

SIDEBAR_LABEL_CHARS = 34
"""Characters a sidebar selectbox shows whole at the sidebar's default width (longer values are cut with "...")."""


def short_method_label(method: str) -> str:
    """The method's label as the sidebar's box shows it: whole, or without its parenthesis where longer than
    ``SIDEBAR_LABEL_CHARS`` ("EAGLE-3 head (drafts from the target's features)" -> "EAGLE-3 head")."""
    label = METHOD_LABELS[method]
    return label if len(label) <= SIDEBAR_LABEL_CHARS else label.split(" (", 1)[0]


FALLBACK_LABELS = {"auto": "auto", "goodput": "when slower", "off": "never"}
ADAPT_LABELS = {"off": "off (frozen)", "threshold": "threshold (ROC refit)",
                "last-layer": "decision model's last layer"}
# Short labels (a sidebar selectbox cuts long ones); the widget's help says what each model reads.
DECISION_MODEL_LABELS = {"hidden": "hidden state", "dist": "q's top-10", "path": "path", "context": "context"}
DECISION_MODEL_HELP = ("what the learned model reads: hidden = the draft's last hidden state; q's top-10 = entropy + "
                       "top-10 of q; path = those + q(x), depth, path probability; context (default) = path + matches "
                       "in the context + the target's earlier picks (docs/decision.md)")


def method_widgets(box, method: str, prefix: str = "") -> dict:
    """Widgets for one method's settings in ``box`` (the sidebar, or a column of the compare page); ``prefix``
    keeps two sets of widgets apart. Returns the changes to ``DEFAULTS[method]`` (``k_config`` and
    ``recycling_widths`` as typed; ``carry_matrix`` is the session's choice, not a method setting)."""
    d = DEFAULTS[method]
    spec = METHOD_SPECS[method]
    changes: dict = {}
    if spec.model_tree == "chain":
        changes["gamma"] = box.slider("Draft length γ", 1, 12, d.gamma, key=Sidebar.GAMMA.widget_key(prefix))
    if spec.model_tree in ("tree", "stoppable"):
        lossy = False
        if method == "mcsd-improved":
            lossy = box.checkbox("Lossy mode of Lu et al. 2024 (target-initialized roots, longest branch)",
                                 key=Sidebar.LOSSY.widget_key(prefix),
                                 help="Lu et al. 2024: w roots sampled from the target, each with a draft chain; "
                                      "the longest accepted branch wins. This biases the output distribution.")
        default_k = "1" if lossy else ",".join(map(str, d.k_config))
        changes["k_config"] = box.text_input("k_config (children per level)", default_k,
                                             key=Sidebar.K_CONFIG.name(f"{method}_{lossy}", within=prefix),
                                             help="e.g. 4,2,2 = 4 children of the anchor, 2 under each, 2 under each")
        if method == "mcsd":
            changes["tree"] = box.text_input(
                "Tree template (replaces the k_config tree)", key=Sidebar.TREE_TEMPLATE.widget_key(prefix),
                placeholder="e.g. -1,-1,0,0,1 · empty = k_config",
                help="each node's parent in breadth-first order, -1 for the anchor's children, siblings in rank "
                     "order; the optimal tree panel fills this in")
        if method == "mcsd-improved" and not lossy:
            online = box.checkbox("Choose the root width online", value=d.tree_choice == "online",
                                  key=Sidebar.TREE_CHOICE.widget_key(prefix),
                                  help="each step drafts 1-4 root candidates, whichever the acceptance and forward "
                                       "costs measured so far say is fastest (the first k_config entry is where it "
                                       "starts); off: the published width. Never changes the output law")
            changes["tree_choice"] = "online" if online else "fixed"
        changes["branch_threshold"] = box.slider(
            "Adaptive width: branch where top q <", 0.0, 1.0, d.branch_threshold, 0.05,
            key=Sidebar.BRANCH_THRESHOLD.name(method, within=prefix),
            help="a node gets its level's k children only where the draft's top probability is below this, "
                 "else one child; 1.0 keeps the fixed k_config")
        if spec.has_stop_policy:
            if method == "mcsd-improved":
                changes["lossy"] = lossy
            if lossy:
                changes["width"] = box.slider("Target roots w", 1, 8, d.width, key=Sidebar.WIDTH.widget_key(prefix))
            changes["max_depth"] = box.slider("Max draft depth", 1, 16, d.max_depth,
                                              key=Sidebar.MAX_DEPTH.widget_key(prefix))
            stop = box.selectbox("Stop policy", list(STOP_POLICY_NAMES), index=STOP_POLICY_NAMES.index(d.stop),
                                 format_func=STOP_POLICY_LABELS.get, key=Sidebar.STOP.widget_key(prefix),
                                 help="when drafting stops early: the draft's own confidence, or a learned decision "
                                      "model's predicted acceptance (the rule of Lu et al. 2024, per-branch pruning, "
                                      "SpecDec++'s cumulative rule, or the expected gain of one more level "
                                      "against its cost)")
            changes["stop"] = stop
            changes["threshold"] = box.slider(
                {"specdec++": "Threshold h (stop when P(reject) > h)",
                 "goodput": "Cost ratio r (a draft forward ÷ a target forward)"}.get(stop, "Threshold τ"), 0.0, 1.0,
                DEFAULT_THRESHOLDS[stop], 0.05, key=Sidebar.THRESHOLD.name(stop, within=prefix),
                disabled=stop == "none")
            if stop == "goodput":
                measured = box.checkbox("Measure r on this machine", value=d.cost_ratio == "measured",
                                        key=Sidebar.COST_RATIO.widget_key(prefix),
                                        help="r from each step's own timeline: a draft level's milliseconds over the "
                                             "rest of the step's, averaged over the run; the slider is where it "
                                             "starts. Timing-driven, so two runs may draft differently; the output "
                                             "law never changes")
                changes["cost_ratio"] = "measured" if measured else "fixed"
            if stop in LEARNED_POLICIES:
                changes["decision_model"] = box.selectbox("Decision model", DECISION_MODELS,
                                                          key=Sidebar.DECISION_MODEL.widget_key(prefix),
                                                          format_func=DECISION_MODEL_LABELS.get,
                                                          help=DECISION_MODEL_HELP)
            modes = [m for m in ADAPT_MODES if stop in ADAPTABLE[m]]
            changes["adapt"] = box.selectbox(
                "Online adaptation", modes, index=modes.index(d.adapt) if d.adapt in modes else 0,
                format_func=ADAPT_LABELS.get, key=Sidebar.ADAPT.name(stop, within=prefix), disabled=len(modes) == 1,
                help="learn from every verified step during the run: refit the threshold from the run's ROC curve, "
                     "or the decision model's last layer; changes how much is drafted, never the output law")
    if "lookup" in spec.free:
        changes["lookup_tokens"] = box.slider("Lookup: longest copy", 1, 64, d.lookup_tokens,
                                              key=Sidebar.LOOKUP_TOKENS.widget_key(prefix),
                                              help="the copy length adapts (doubles after a whole accepted copy, "
                                                   "halves after a miss; starts at 16) up to this")
        changes["lookup_branches"] = box.slider("Lookup: matches as branches", 1, 8, d.lookup_branches,
                                                key=Sidebar.LOOKUP_BRANCHES.widget_key(prefix))
        changes["lookup_ngram"] = box.slider("Lookup: longest n-gram matched", 1, 6, d.lookup_ngram,
                                             key=Sidebar.LOOKUP_NGRAM.widget_key(prefix))
        if spec.lookup_hybrid:
            changes["lookup_alone"] = box.slider(
                "Lookup: shortest match copied alone", 1, 6, d.lookup_alone,
                key=Sidebar.LOOKUP_ALONE.widget_key(prefix),
                help="on a match of at least this many tokens lookup's copies are the whole step; on a shorter one "
                     "the draft model or head drafts instead (at most the longest n-gram matched)")
    if spec.uses_head:
        changes["head"] = box.text_input(
            "EAGLE-3 head folder", key=Sidebar.HEAD_PATH.widget_key(prefix),
            placeholder="empty: the head shipped for the target",
            help="an EAGLE-3 checkpoint (config.json + model.safetensors, as SpecForge writes it) for this target; "
                 "`python -m explorer heads train` makes one").strip()
        changes["head_topk"] = box.slider("Head: children per node", 1, 8, d.head_topk,
                                          key=Sidebar.HEAD_TOPK.widget_key(prefix),
                                          help="EAGLE-2's dynamic tree: each level expands this many best nodes, "
                                               "drawing this many children each")
        changes["head_depth"] = box.slider("Head: most draft levels", 1, 12, d.head_depth,
                                           key=Sidebar.HEAD_DEPTH.widget_key(prefix),
                                           help="the tree's deepest level (sized online: a step may stop sooner)")
        changes["head_tokens"] = box.slider("Head: most draft tokens verified", 1, 64, d.head_tokens,
                                            key=Sidebar.HEAD_TOKENS.widget_key(prefix),
                                            help="the best nodes by cumulative draft probability (with their "
                                                 "ancestors) are verified in one target pass")
        online = box.checkbox("Head: size the tree online", value=d.tree_choice == "online",
                              key=Sidebar.HEAD_ONLINE.widget_key(prefix),
                              help="each step drafts as many levels and verifies as many of those nodes as the "
                                   "acceptance measured so far and this machine's costs (a head level, a target "
                                   "row) say pay; off: every level and node. Never changes the output law")
        changes["tree_choice"] = "online" if online else "fixed"
        _distill_widgets(box, changes, prefix, "Head", "the session's own copy of the head")
    if d.distils_draft:
        _distill_widgets(box, changes, prefix, "Draft", "a LoRA adapter of the session's on the draft (on float "
                         "layers where the draft is int8)")
    if "recycling" in spec.free:
        changes["recycling_widths"] = box.text_input(
            "Recycling tree template (widths per level)", ",".join(map(str, d.recycling_widths)),
            key=Sidebar.RECYCLING_WIDTHS.widget_key(prefix),
            help="a node at level l with sibling rank r gets floor(w_l / (r + 1)) children")
        changes["recycling_k"] = box.slider("Recycling: candidates per token", 1, 16, d.recycling_k,
                                            key=Sidebar.RECYCLING_K.widget_key(prefix))
        changes["carry_matrix"] = box.checkbox("Carry the matrix over to the next run", value=True,
                                               key=Sidebar.RECYCLING_CARRY.widget_key(prefix),
                                               help="Token Recycling keeps learning across the session's runs")
    if spec.free:
        changes["free_rows"] = box.number_input(
            "Free branches: most target rows (0 = auto)", 0, MAX_TREE_NODES + 1, d.free_rows,
            key=Sidebar.FREE_ROWS.widget_key(prefix),
            help=f"free branches fill the tree up to this many verification rows, best first; auto: {FREE_ROWS_CPU} "
                 "on the CPU, where a forward's 33rd row costs as much as rows 2-32 together, no limit on CUDA; on "
                 "a CPU where a verification row costs 5 ms or more, Token Recycling keeps only the template "
                 "slots whose measured acceptance pays for their rows")
    if spec.name != "ar" and not changes.get("lossy"):
        changes["fallback"] = box.selectbox(
            "Fall back to plain decoding", FALLBACK_MODES, format_func=FALLBACK_LABELS.get,
            key=Sidebar.FALLBACK.widget_key(prefix),
            help="SmartSpec's goodput rule: take plain decoding steps while speculation measures slower than plain "
                 "decoding on this machine (probing speculation now and then); never changes the output law. auto: "
                 "on a GPU, and on a CPU where verifying costs many plain steps; when slower: always; never: off")
        changes["verifier"] = box.selectbox("Verifier", ("auto",) + VERIFIERS, format_func=VERIFIER_LABELS.get,
                                            key=Sidebar.VERIFIER.widget_key(prefix),
                                            help="at temperature 0 every rule is greedy matching; free drafts "
                                                 "(lookup, recycled) are tested after the rule's own children")
    return changes


def _distill_widgets(box, changes: dict, prefix: str, who: str, learner: str) -> None:
    """The online distillation's widgets (``engine/online_distill*.py``) for ``who`` (Head or Draft), which learns
    through ``learner``, into ``changes``."""
    changes["online_distill"] = box.checkbox(
        f"{who}: learn online between prompts (OSD)", value=False, key=Sidebar.HEAD_DISTILL.widget_key(prefix),
        help=f"after each finished prompt {learner} learns the target's distribution where the drafted tokens were "
             "rejected (online speculative decoding); never inside a run, so the output law never changes. The "
             "Explorer's 'learning online' panel shows acceptance by prompt")
    if changes["online_distill"]:
        changes["distill_every"] = box.select_slider(f"{who}: prompts between updates", [1, 2, 4, 8], 1,
                                                     key=Sidebar.DISTILL_EVERY.widget_key(prefix))
        changes["distill_lr"] = box.select_slider(f"{who}: learning rate", [1e-5, 3e-5, 1e-4, 3e-4, 1e-3], 1e-4,
                                                  format_func=lambda v: f"{v:.0e}",
                                                  key=Sidebar.DISTILL_LR.widget_key(prefix))
        changes["distill_replay"] = box.select_slider(
            f"{who}: earlier prompts replayed", [0, 2, 4, 8, 16], 0, key=Sidebar.DISTILL_REPLAY.widget_key(prefix),
            help="each update also learns again from the rejections of this many earlier prompts (0: only those "
                 "since the last update, as OSD does)")


def sidebar() -> dict:
    """All sidebar widgets; returns ``{"spec", "draft", "target", "dtype", "method", "changes", "sampling",
    "max_new", "teach"}``."""
    sb = st.sidebar
    sb.header("Model pair")
    initial = os.environ.get("SPEC_EXPLORER_PAIR", "default")
    spec = sb.radio("Pair", list(PAIRS), index=list(PAIRS).index(initial) if initial in PAIRS else 0,
                    format_func=PAIRS.get, key=Sidebar.PAIR_SPEC.name)
    draft = target = ""
    if spec == "custom":
        draft = sb.text_input("Draft model", key=Sidebar.DRAFT_PATH.name, placeholder="empty: the target's own layers",
                              help="a folder, hub id or .gguf file sharing the target's tokenizer; left empty, the "
                                   "target drafts with its own first layers (an early exit)")
        target = sb.text_input("Target model", key=Sidebar.TARGET_PATH.name, placeholder="path, hub id or file.gguf")
    auto = str(default_dtype()).removeprefix("torch.")
    dtype = sb.selectbox("dtype", ["auto", "bf16", "fp32"], key=Sidebar.DTYPE.name, disabled=spec == "tiny",
                         format_func=lambda d: f"auto ({auto} here)" if d == "auto" else d,
                         help="auto: bf16 on a GPU and on CPUs with native bf16 (AVX-512-BF16, AMX), fp32 on "
                              "other CPUs, where bf16 has no matrix kernels and a tree costs twice as much")

    sb.header("Method")
    method = sb.selectbox("Method", list(METHODS), index=METHODS.index("mcsd-improved"), format_func=short_method_label,
                          key=Sidebar.METHOD.name)
    if short_method_label(method) != METHOD_LABELS[method]:
        sb.caption(METHOD_LABELS[method])  # what the box had no room for
    changes = method_widgets(sb, method)

    sb.header("Sampling")
    temperature = sb.slider("Temperature (0 = greedy)", 0.0, 1.5, 0.0, 0.05, key=Sidebar.TEMPERATURE.name)
    top_k = sb.number_input("top-k (0 = off)", 0, 1000, 0, key=Sidebar.TOP_K.name)
    top_p = sb.slider("top-p", 0.05, 1.0, 1.0, 0.05, key=Sidebar.TOP_P.name)
    seed = sb.number_input("Seed", 0, 2**31 - 1, 0, key=Sidebar.SEED.name)
    max_new = sb.slider("Max new tokens", 1, 512, 64, key=Sidebar.MAX_NEW.name)

    sb.header("Display")
    teach = sb.toggle("Teach mode", key=Sidebar.TEACH.name,
                      help="large type for projectors and a plain-language account of every step")
    plugin_section(sb)
    return {"spec": spec, "draft": draft, "target": target, "dtype": dtype, "method": method, "changes": changes,
            "sampling": dict(temperature=temperature, top_k=int(top_k), top_p=top_p, seed=int(seed)),
            "max_new": int(max_new), "teach": teach}
