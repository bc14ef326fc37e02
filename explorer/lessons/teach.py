"""Teach mode: a plain-language account of one speculative step, written from its StepTrace alone.

For a classroom: what the draft model proposed, why each branch stopped drafting, what the target accepted and
why, and where the step's last token came from. Plain text (no HTML or Markdown); the UI escapes it.
"""

from __future__ import annotations

from ..engine.config import MethodConfig
from ..trace.records import ACCEPTED, DRAFT_SOURCES, FREE_SOURCES, REJECTED, StepTrace

POLICY_WORDS = {
    "confidence": "the draft's own confidence in its token",
    "decision": "the decision model's predicted chance that the target accepts",
    "prune": "the decision model's predicted chance that the target accepts",
    "specdec++": "the predicted chance that the whole path so far is accepted",
}


def _tok(text: str) -> str:
    """A token as the class reads it: quoted, with whitespace made visible."""
    shown = text.replace("\n", "\\n").replace("\t", "\\t")
    return f"“{shown}”" if shown.strip() else f"“{shown}” (whitespace)"


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f} %"


def fallback_rates(fallback: dict) -> str:
    """The rates a goodput-fallback decision compared (``StepTrace.fallback``), in words."""
    rate = lambda r: "not yet measured" if r is None else f"{r:.1f} tokens/s"  # noqa: E731
    return f"speculation {rate(fallback.get('spec_tok_s'))}, plain decoding {rate(fallback.get('ar_tok_s'))}"


def explain_step(step: StepTrace, method: dict | None = None, decision: dict | None = None,
                 plugins: list | None = None) -> list[str]:
    """Sentences describing ``step``, in order: drafting, stopping, verification, the bonus token, the outcome.

    Works for every method (``ar`` has no draft) and for saved traces (no model needed). ``method``: the run's
    method settings (``RunTrace.settings["method"]``), which let it explain the adaptive width; ``decision``: where
    its stop model came from (``RunTrace.settings["decision_model"]``: ``{"kind", "how", "trained_on"}``);
    ``plugins``: the plugins the run used (``RunTrace.settings["plugins"]``), whose own words open the account.
    """
    nodes = {n.id: n for n in step.nodes}
    anchor = nodes[0]
    drafted = _drafted(step)
    roots = [n for n in step.nodes if n.parent == 0]
    out = plugin_words(plugins or []) + rsd_c_words(step)
    fallback = step.fallback or {}
    if step.method == "ar":
        out.append(f"Autoregressive step: the target model reads the last token {_tok(anchor.text)} and picks the "
                   f"next one itself. No draft, so one target call gives exactly one token.")
    elif not fallback.get("speculate", True):
        out.append(f"Plain decoding step ({fallback.get('reason')}): the engine drafted nothing and the target "
                   f"picked the token after {_tok(anchor.text)} itself. SmartSpec's goodput rule runs plain steps "
                   f"while speculation measures slower than plain decoding on this machine, and measures each mode "
                   f"now and then; so far {fallback_rates(fallback)}.")
    else:
        target_roots = any(n.source == "target" for n in roots)
        model = [n for n in drafted if n.source == "draft"]
        levels = max((n.depth for n in model), default=0) - (1 if target_roots else 0)  # draft levels only
        if model and step.drafter.get("head"):
            out.append(head_words(step, anchor.text, len(model), levels))
        elif model:
            out.append(f"Drafting: after the last committed token {_tok(anchor.text)}, the small draft model proposed "
                       f"{len(model)} token(s) over {levels} level(s) in {step.draft_calls} draft call(s) "
                       f"(one call per level: every branch of a level is fed at once).")
        if step.drafter.get("layer_skip"):
            out.append(layer_skip_words(step.drafter["layer_skip"]))
        if step.drafter.get("tree_choice"):
            out.append(tree_choice_words(step.drafter["tree_choice"]))
        out.extend(_free_drafts(step, anchor, bool(model)))
        if len(roots) > 1:
            firsts = ", ".join(f"branch {n.branch} starts with {_tok(n.text)}" for n in roots)
            out.append(f"The tree has {len(roots)} branches: {firsts}.")
        if target_roots:
            out.append("Its roots were sampled from the target's own distribution (the lossy mode of Lu et al. 2024).")
        out.extend(_adaptive_width(step, method or {}, target_roots))
        out.extend(_room_left(step))
        if model or step.stop_signals:
            out.extend(_stopping(step, levels))
            out.extend(_borrowed_model(step, decision or {}))
        out.append(f"Verification: the target model scored all {len(step.mask_node_ids)} tokens in one forward pass. "
                   "The tree attention mask lets each token see only its own ancestors, and each gets the position "
                   "id of its depth, so every branch is scored as if it were the only text.")
        out.extend(_verdicts(step, nodes))
    n = len(step.committed_ids)
    if step.bonus_token is not None and step.method != "ar":
        bonus = "".join(step.committed_text[-1:])
        if step.accepted_draft_len == 0 and step.verifier == "greedy":
            out.append(f"The target then supplied the token itself: {_tok(bonus)}, its own top choice.")
        elif step.accepted_draft_len == 0:
            out.append(f"The target then supplied the token itself: {_tok(bonus)} (after a rejection it comes from "
                       "the residual distribution, so the output still follows the target exactly).")
        else:
            out.append(f"Bonus token: the target's distribution after the last accepted token was already computed "
                       f"in the same pass, so it adds {_tok(bonus)} for free.")
    if step.prefill_rows:
        out.append(f"That target forward also read the prompt's {step.prefill_rows} tokens: the prefill joined to the "
                   "first verification, as transformers' assisted generation does, so the run spends one target "
                   "forward fewer; the first tree was drafted before the target had seen the prompt.")
    calls = "one target call" if step.target_calls == 1 else f"{step.target_calls} target calls"
    out.append(f"Outcome: {n} token(s) committed ({_tok(''.join(step.committed_text))}) for {calls}"
               + (f" and {step.draft_calls} draft call(s)." if step.draft_calls else "."))
    if fallback.get("carried"):
        out.append(f"The fallback's goodput rule started this run from the rates an earlier run of the session "
                   f"measured ({fallback_rates(fallback)}), so it did not spend the run's first steps measuring "
                   "speculation again; its next probe of the other mode replaces the carried figure.")
    if fallback.get("unmeasured") == "prefill":
        out.append("The fallback's goodput rule did not count this step's time: most of it was the prompt's prefill, "
                   "which says nothing about either mode's rate.")
    if fallback.get("unmeasured") == "graph capture":
        out.append("This step recorded CUDA graphs for a forward size not seen before, a one-time cost many times "
                   "a replayed forward, so the fallback's goodput rule did not count its time.")
    if step.finished:
        out.append("The run ended here (end of sequence or the new-token limit).")
    return out


def plugin_words(plugins: list) -> list[str]:
    """What the run's plugins say of themselves (the trace's ``settings["plugins"]``): the method's summary and its
    drafter's docstring, the verifier or stop policy and where each was loaded from."""
    out = []
    for p in plugins:
        if not isinstance(p, dict):
            continue
        where = ("" if p.get("bundled") else
                 f" comes from the plugin {p.get('name')}, loaded from {p.get('loaded_from')}")
        texts = [t.strip().rstrip(".") for t in (p.get("summary"), p.get("doc")) if isinstance(t, str) and t.strip()]
        said = " ".join(t + "." for t in dict.fromkeys(texts))  # the summary is often the docstring's start
        if p.get("method"):
            name = p.get("label") or p["method"]
            out.append(f"This method, {name},{where}: {said}" if where else f"This method, {name}: {said}")
        if p.get("verifier"):
            out.append(f"The verification rule {p['verifier']}{where}: {said}" if where else
                       f"The verification rule {p['verifier']}: {said}")
            if not p.get("bundled"):
                out.append("The losslessness audit judges whether a plugin's rule samples exactly from the target.")
        if p.get("stop"):
            out.append(f"The stop policy {p['stop']}{where}." + (f" {said}" if said else ""))
    return out


def rsd_c_words(step: StepTrace) -> list[str]:
    """Names RSD-C where it runs: an ``mcsd`` tree (constant branching) drawn without replacement and verified by
    ``rrs`` is the constant-branching tree of Jeon et al. 2024 (arXiv 2402.14160)."""
    if step.method == "mcsd" and step.verifier == "rrs":
        return ["This k_config tree with children drawn without replacement and verified by recursive rejection "
                "sampling is RSD-C, the constant-branching tree of Jeon et al. 2024; their RSD-S (method rsd-s) grows "
                "a stochastic beam instead."]
    return []


def _room_left(step: StepTrace) -> list[str]:
    """Why a tree near the new-token limit is shallow (``drafters.base.Reach``), when the limit bound it."""
    left = step.drafter.get("tokens_left")
    if left is None or left - 1 >= step.max_draft_len:
        return []
    if left == 1:
        return ["Only one token remained before the new-token limit, so nothing was drafted: the target writes the "
                "last token itself."]
    return [f"Only {left} tokens remained before the new-token limit, so no token was drafted deeper than {left - 1}: "
            "a path that deep plus the target's bonus token fills the room, and a deeper token could never be "
            "committed."]


def _free_drafts(step: StepTrace, anchor, model: bool) -> list[str]:
    """Sentences about the free (deterministic) drafts: prompt lookup and Token Recycling."""
    out = []
    lookup = [n for n in step.nodes if n.source == "lookup"]
    recycled = [n for n in step.nodes if n.source == "recycled"]
    who = "EAGLE-3 head" if step.method == "eagle-hybrid" else "draft model"
    if step.drafter.get("lookup_trusted"):
        out.append(f"The {who} sat this step out: prompt lookup found something to copy, and where it does, "
                   f"the {who}'s forwards cost more than the tokens they add.")
    dropped = step.drafter.get("lookup_dropped_ngram")
    if dropped:
        out.append(f"Prompt lookup matched only the last {dropped} token(s), too short a match to trust: such copies "
                   f"are rarely accepted and cost target rows, so the {who} drafted instead.")
    if lookup:
        prov = lookup[0].provenance or {}
        out.append(f"Prompt lookup copied {len(lookup)} token(s) for free: the last {prov.get('ngram', '?')} "
                   f"token(s) also appear earlier in the {'prompt' if prov.get('in_prompt') else 'text'}, and it "
                   "proposes what followed them there. Outputs often repeat their prompt (code, quotes, names).")
        if step.drafter.get("long_copy"):
            out.append("This copy is on a run (the last step accepted its whole copy), so it may go past the row "
                       "budget alone: on the CPU a second block of 32 target rows costs less than a second step.")
    if recycled:
        out.append(f"Token Recycling proposed {len(recycled)} token(s) for free from its matrix: for each token, the "
                   "target's top candidates the last time it scored that token. Why it works: every verification "
                   "computes the target's whole distribution at every tree node, but keeps one token per position; "
                   "the runners-up are what the target tends to say after that token, and text keeps reusing its "
                   "local patterns, so they come back.")
    elif "recycling_row" in step.drafter and not step.drafter["recycling_row"]["candidates"]:
        out.append(f"Token Recycling had no row for {_tok(anchor.text)} yet, so it proposed nothing; this step's "
                   "verification writes one.")
    priced = step.drafter.get("row_pricing")
    if priced and priced["kept"] < priced["offered"]:
        cost = (f"on this machine a verification row costs {priced['row_ms']:.0f} ms "
                + (f"(the first one {priced['row_ms'] + priced.get('jump_ms', 0):.0f} ms) " if priced.get("jump_ms")
                   else "") + f"against {priced['one_row_ms']:.0f} ms for a plain step")
        kept = (f"{priced['kept']} made the tree" if priced["kept"] else
                "none was worth its row, so this step verified no tree: a plain decoding step")
        out.append(f"Of the {priced['offered']} free proposals, {kept}: {cost}, and a template slot keeps its row "
                   "only while its measured acceptance pays for it. The others are still checked against the text "
                   "as it is committed, and come back when they start to match.")
    if (lookup or recycled) and not model:
        out.append("Free drafts cost no draft-model forward: only extra rows in the target's one verification pass.")
    return out


def _goodput_words(last, levels: int) -> str:
    """The goodput rule's last decision: expected tokens against what one more draft forward costs."""
    gain = (f"one more level was expected to add {last.score:.2f} token(s) (each branch's chance of being "
            f"accepted all the way times its next token's, summed: one path is accepted), and after "
            f"{last.forwards} draft forward(s) with {last.expected:.2f} token(s) expected so far it had to add "
            f"{last.threshold:.2f} to pay for its draft forward")
    if not last.keep_drafting:
        return f"Drafting stopped after level {last.level}: {gain}, so it would have lowered tokens per second."
    return f"Drafting went on to the maximum depth ({levels} level(s)): at the last check {gain}, and it did."


def tree_choice_words(choice: dict) -> str:
    """One sentence on a step's root width chosen online (``StepTrace.drafter["tree_choice"]``,
    ``engine/policies/tree_choice.py``), for the Explorer and the lessons."""
    k = choice.get("k")
    roots = f"{k} root candidate{'s' if k != 1 else ''}"
    if choice.get("why") != "fastest":
        return f"Tree chosen online: {roots}, the published width, while the first steps are measured."
    prices = {p["k"]: p for p in choice.get("prices", [])}
    best = prices.get(k, {})
    others = "; ".join(f"{p['k']}: {p['expected_tokens']:.2f} tokens in {p['cost_ms']:.0f} ms"
                       for kk, p in sorted(prices.items()) if kk != k)
    return (f"Tree chosen online: {roots} with chains of about {choice.get('depth')} levels, expected "
            f"{best.get('expected_tokens', 0):.2f} tokens in {best.get('cost_ms', 0):.0f} ms, the most tokens per "
            f"second from the acceptance and forward costs measured so far (other widths: {others}).")


def head_words(step: StepTrace, anchor: str, drafted: int, levels: int) -> str:
    """How an EAGLE-3 head drafted a step (``StepTrace.drafter["head"]``), in plain words."""
    head = step.drafter["head"]
    layers = ", ".join(str(i) for i in head.get("target_layers", []))
    return (f"Drafting from the target's own features: there is no draft model. A one-layer head read what the "
            f"target had computed inside itself for the text so far (the hidden states entering its layers "
            f"{layers}), with the last committed token {_tok(anchor)}, and guessed the next token; it then fed its "
            f"own output back to guess further. It expanded the {head.get('frontier', head.get('top_k'))} likeliest "
            f"branches at each level ({head.get('top_k')} guesses each, {step.draft_calls} head call(s), each far "
            f"cheaper than a draft model's forward) and kept the {drafted} token(s) over {levels} level(s) whose "
            f"paths it found likeliest (EAGLE-2's dynamic tree). The head proposes only the "
            f"{head.get('draft_vocab', 'most frequent')} tokens of its draft vocabulary; any other token comes from "
            f"the target itself."
            + (" " + head_size_words(head["size"], head.get("tokens"), head.get("depth"))
               if head.get("size") else ""))


def head_size_words(size: dict, most: int | None, depth: int | None = None) -> str:
    """One or two sentences on how many of the head's best nodes a step verified and how deep it drafted, both
    chosen online (``StepTrace.drafter["head"]["size"]``, ``engine/policies/head_tree.py``)."""
    n = size.get("tokens")
    levels = size.get("levels")
    shallow = (f" It drafted {levels} of up to {depth} levels: a deeper level was not expected to add tokens worth "
               f"its milliseconds." if levels and depth and levels < depth and size.get("why") == "fastest" else "")
    if size.get("why") == "warm-up":
        return f"Tree sized online: all {n} best nodes, while the first steps are measured."
    if size.get("why") == "recorded":
        return f"Tree sized online: {n} node(s), as the recorded run chose."
    return (f"Tree sized online: the {n} best of up to {most} node(s), expected {size.get('expected_tokens', 0):.2f} "
            f"tokens in {size.get('cost_ms', 0):.0f} ms (all {most}: {size.get('expected_all', 0):.2f} tokens), the "
            f"most tokens per second from the acceptance measured so far and what a target row costs here." + shallow)


def layer_skip_words(skip: dict) -> str:
    """Which of the target's layers drafted a ``layer-skip`` step (``StepTrace.drafter["layer_skip"]``), and why
    that exit."""
    exit_layer, layers = skip["exit_layer"], skip["layers"]
    if exit_layer is None:
        return (f"No exit of the target's {layers} layers was expected to beat plain decoding from the acceptance "
                "measured so far, so this step drafted nothing (a plain decoding step); each exit is tried again "
                "after a while.")
    rates = ", ".join(f"{e} layers: {c['alpha']:.0%} accepted, {c['speedup']:.2f}x expected"
                      for e, c in skip.get("candidates", {}).items())
    return (f"The target drafted for itself with its first {exit_layer} of {layers} layers, then its final norm and "
            f"LM head (an early exit; the other {layers - exit_layer} layers were skipped). The exit is chosen from "
            f"each exit's measured acceptance against its cost, {exit_layer}/{layers} of a target forward: {rates}.")


def _borrowed_model(step: StepTrace, decision: dict) -> list[str]:
    """A stop model trained on another pair, said where its predictions were used."""
    if decision.get("how") != "transferred" or not any(s.policy in POLICY_WORDS or s.policy == "goodput"
                                                        for s in step.stop_signals):
        return []
    return [f"This pair has no decision model of its own: the one used was trained on {decision.get('trained_on')}. "
            "Its inputs (probabilities, depth, what the run has seen) mean the same for any pair, so it serves as "
            "a prior, and online adaptation refits its last layer to this pair's verdicts as the run goes."]


def _stopping(step: StepTrace, levels: int) -> list[str]:
    sigs = step.stop_signals
    if not sigs or sigs[0].policy == "none":
        return [f"Drafting ran to the configured depth ({step.max_draft_len} level(s)); this method never stops "
                "early." if levels >= step.max_draft_len else
                f"Drafting ended after {levels} level(s) (the tree shape or the token limit)."]
    pol = sigs[0].policy
    what = POLICY_WORDS.get(pol, pol)
    if pol == "goodput":  # one decision for the whole tree, in tokens rather than chances
        out = [_goodput_words(sigs[-1], levels)]
        if step.cost:
            out.append(f"The cost of a draft forward was measured, not set: on this machine a draft level has cost "
                       f"{step.cost['r']:.3f} of the rest of a step so far (r), averaged over the run's steps.")
        return out
    out = []
    for s in sigs:
        for b in s.pruned:
            score = s.scores.get(str(b), s.scores.get(b))
            if str(b) in s.cost_pruned:
                out.append(f"Branch {b} stopped after level {s.level}: its chance of holding the accepted path was "
                           f"{_pct(s.chances.get(str(b)))}, less than the {_pct(s.row_floor)} of a step that its "
                           "target and draft rows cost on this machine; the likeliest branch drafts on.")
                continue
            out.append(f"Branch {b} stopped after level {s.level}: {what} was {_pct(score)}, below the threshold "
                       f"{_pct(s.threshold)}.")
    last = sigs[-1]
    if not last.keep_drafting:
        out.append(f"Drafting stopped after level {last.level}: {what} was at best {_pct(last.score)}, below the "
                   f"threshold {_pct(last.threshold)}, so more draft tokens were unlikely to be accepted.")
    else:
        out.append(f"Drafting went on to the maximum depth ({levels} level(s)): {what} stayed at or above the "
                   f"threshold {_pct(last.threshold)}.")
    return out


def _adaptive_width(step: StepTrace, method: dict, target_roots: bool) -> list[str]:
    """Where the adaptive width gave a node one candidate instead of its level's k, and where it branched."""
    threshold = method.get("branch_threshold", 1.0)
    if not isinstance(threshold, (int, float)) or threshold >= 1.0:
        return []
    try:
        branching = MethodConfig(**method).draft_branching()
    except (TypeError, ValueError):
        return []
    kids: dict = {}
    for n in _drafted(step):
        kids.setdefault(n.parent, []).append(n)
    sure, unsure = [], []
    for children in kids.values():
        level = children[0].depth - 1 - (1 if target_roots else 0)
        if level < len(branching) and branching[level] > 1 and children[0].q_top:
            top = children[0].q_top[0][2]  # the draft's best probability where these children were drawn
            (sure if top >= threshold else unsure).append((top, len(children), branching[level]))
    out = []
    if sure:
        tops = ", ".join(_pct_against(t, threshold) for t, _, _ in sure[:4]) + (" …" if len(sure) > 4 else "")
        ks = sorted({k for _, _, k in sure})
        instead = f"{ks[0]}" if len(ks) == 1 else f"their level's {' or '.join(map(str, ks))}"
        out.append(f"Adaptive width: the draft was sure at {len(sure)} place(s) (top probability {tops}, at or above "
                   f"{_pct(threshold)}), so each got one candidate instead of {instead}: another one would rarely "
                   "be accepted and would cost a draft row on every later level.")
    for top, n, _k in unsure[:3]:
        out.append(f"Adaptive width: the draft was unsure at one place (top probability {_pct_against(top, threshold)}"
                   f" < {_pct(threshold)}), so it drew {n} candidate(s) there.")
    return out


def _pct_against(x: float, threshold: float) -> str:
    """``x`` as a percentage, with a decimal when whole percents would read as equal to ``threshold``."""
    return f"{100 * x:.1f} %" if round(100 * x) == round(100 * threshold) else _pct(x)


def _verdicts(step: StepTrace, nodes: dict) -> list[str]:
    path = [n for n in step.nodes if n.committed and n.id != 0 and n.source in DRAFT_SOURCES]
    greedy = step.verifier in ("greedy", "longest-branch") and all(n.u is None for n in step.nodes)
    out = []
    if path:
        out.append(f"Accepted: {', '.join(_tok(n.text) for n in path)} ({len(path)} of {len(_drafted(step))} "
                   "draft tokens).")
    rejected = [n for n in step.nodes if n.status == REJECTED]
    on_path_parents = {0} | {n.id for n in step.nodes if n.committed}
    for n in rejected:
        if n.parent not in on_path_parents:
            continue
        if greedy:
            out.append(f"Rejected {_tok(n.text)} at depth {n.depth}: greedy decoding keeps a draft token only if it "
                       f"is the target's own top choice, and the target gave it {_pct(n.p)}"
                       + (f" (draft: {_pct(n.q)})." if n.q is not None else "."))
        elif n.source in FREE_SOURCES and n.u is not None and n.ratio is not None:
            out.append(f"Rejected {_tok(n.text)} at depth {n.depth}: a free token is accepted with the target's "
                       f"probability of it (here {n.ratio:.2f}, after any rejected siblings), and the draw u = "
                       f"{n.u:.2f} was above it.")
        elif n.u is not None and n.ratio is not None:
            out.append(f"Rejected {_tok(n.text)} at depth {n.depth}: the draw u = {n.u:.2f} was above its "
                       f"acceptance ratio {n.ratio:.2f} (p/q for a first child; for later siblings the residual's, "
                       f"for SpecHub the transport plan's; target {_pct(n.p)}, draft {_pct(n.q)}).")
        else:
            out.append(f"Rejected {_tok(n.text)} at depth {n.depth} (target {_pct(n.p)}, draft {_pct(n.q)}).")
    if not path and not rejected:
        out.append("Nothing was accepted.")
    unverified = sum(1 for n in step.nodes if n.source in DRAFT_SOURCES and n.status not in (ACCEPTED, REJECTED))
    if unverified:
        out.append(f"{unverified} token(s) were never checked: they hang below a rejected token or in a branch the "
                   "verifier did not walk.")
    return out


def _drafted(step: StepTrace) -> list:
    return [n for n in step.nodes if n.source in DRAFT_SOURCES]
