"""A recorded step told in phases, for the classroom: drafting level by level, the mask the target receives, the
verification walking the tree node by node, and the commit. Pure functions of a ``StepTrace``: no torch, no model.

Phases of one step, in order:

* ``draft`` (one per drafted level): the nodes up to that depth appear, with the draft's top candidates at the new
  nodes' parents and the stop policy's signal after that level (keep drafting or stop);
* ``mask``: the whole tree and the tree attention mask the target is sent (each row sees the cached context, its
  ancestors and itself), position ids ``anchor position + depth``;
* ``verify`` (one per tested node, in the walk's order: by depth, siblings in test order): p against q, the uniform
  draw, accepted or rejected, and after a rejection the residual distribution the next test faces;
* ``commit``: the accepted path, the bonus token, and the KV caches cut to the context plus the path.

A step without a tree (``ar``, a plain step of the goodput fallback) has only its commit phase.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..trace.lanes import discarded
from ..trace.records import ACCEPTED, CONTEXT, DRAFTED, FREE_SOURCES, REJECTED, UNVERIFIED, RunTrace, StepTrace

PHASE_KINDS = ("draft", "mask", "verify", "commit")
SOURCE_WORDS = {"draft": "the draft model", "target": "the target (a root sampled from it)",
                "lookup": "prompt lookup (copied)", "recycled": "Token Recycling (the target's earlier top-k)",
                "plugin": "a plugin's drafter"}


@dataclass(frozen=True)
class Phase:
    """One phase of one step: ``kind`` (``PHASE_KINDS``), ``step`` (index in the run), ``level`` (draft: the level
    just drafted, 1-based) and ``node`` (verify: the id of the node tested)."""

    kind: str
    step: int
    level: int | None = None
    node: int | None = None

    @property
    def label(self) -> str:
        if self.kind == "draft":
            return f"drafting, level {self.level}"
        if self.kind == "verify":
            return "verification"
        return {"mask": "the mask", "commit": "commit"}[self.kind]


def _tested(step: StepTrace) -> list:
    """The nodes the verification tested, in the order the walk tested them."""
    nodes = [n for n in step.nodes if n.status in (ACCEPTED, REJECTED) and n.source != "target"]
    return sorted(nodes, key=lambda n: (n.depth, n.test_order if n.test_order is not None else 0, n.id))


def _has_tree(step: StepTrace) -> bool:
    return len(step.nodes) > 1


def step_phases(step: StepTrace) -> list[Phase]:
    """The phases of ``step``, in teaching order."""
    if not _has_tree(step):
        return [Phase("commit", step.index)]
    depth = max(n.depth for n in step.nodes)
    return ([Phase("draft", step.index, level=d) for d in range(1, depth + 1)] + [Phase("mask", step.index)]
            + [Phase("verify", step.index, node=n.id) for n in _tested(step)] + [Phase("commit", step.index)])


def run_phases(run: RunTrace) -> list[Phase]:
    """Every phase of every step of ``run``, in order."""
    return [p for step in run.steps for p in step_phases(step)]


def visible_nodes(step: StepTrace, phase: Phase) -> set[int]:
    """Node ids drawn in ``phase``: while drafting, the anchor and the nodes up to the level; afterwards all."""
    if phase.kind == "draft":
        return {n.id for n in step.nodes if n.depth <= phase.level}
    return {n.id for n in step.nodes}


def shown_status(step: StepTrace, phase: Phase) -> dict[int, str]:
    """Node id -> the status a node shows in ``phase``: ``DRAFTED`` until its test (or the commit) reveals it.
    Target roots of the lossy rule are accepted by construction and show so from the start."""
    by_id = {n.id: n for n in step.nodes}
    revealed: set[int] = set()
    if phase.kind == "commit":
        revealed = set(by_id)
    elif phase.kind == "verify":
        order = [n.id for n in _tested(step)]
        revealed = set(order[: order.index(phase.node) + 1])
    out = {}
    for i in visible_nodes(step, phase):
        n = by_id[i]
        if n.status == CONTEXT or n.source == "target" or i in revealed:
            out[i] = n.status
        else:
            out[i] = DRAFTED
    return out


def mask_rows(step: StepTrace, phase: Phase) -> list[int]:
    """The ids of the mask rows (and columns) drawn in ``phase``: while drafting, the slice of the levels so far
    (breadth-first order makes it the top-left block: Lu et al.'s dynamic sliced mask), afterwards the whole mask."""
    shown = visible_nodes(step, phase)
    return [i for i in step.mask_node_ids if i in shown]


def committed_path(step: StepTrace) -> list:
    """The committed nodes of the tree, root first (the bonus token is not a node)."""
    return sorted((n for n in step.nodes if n.committed and n.status != CONTEXT), key=lambda n: n.depth)


def quote_token(text: str) -> str:
    """A token quoted for the classroom's words: newlines, tabs and a blank token's spaces made visible."""
    shown = text.replace("\n", "↵").replace("\t", "⇥")
    return f"‘{shown if shown.strip() else shown.replace(' ', '␣')}’"


def _top(rows: list, k: int = 3) -> str:
    return ", ".join(f"{quote_token(text)} {prob:.0%}" for _, text, prob in rows[:k])


def account(step: StepTrace, phase: Phase, greedy: bool) -> list[str]:
    """What is happening in ``phase``, in plain words: a few short sentences (markdown-safe token quotes)."""
    by_id = {n.id: n for n in step.nodes}
    anchor = by_id[0]
    pearl = (step.drafter or {}).get("pearl")
    if pearl is not None and phase.kind in ("draft", "mask", "commit"):
        return _pearl_account(step, phase, pearl, anchor)
    if phase.kind == "draft":
        return _draft_account(step, phase, by_id, anchor)
    if phase.kind == "mask":
        n = len(step.mask_node_ids)
        return [f"The target now scores all {len(step.nodes) - 1} proposed tokens in **one forward** "
                f"({n} rows).",
                "Each row of the mask is one token: it may look at the "
                f"{step.mask_context_len} cached context tokens, at its ancestors and at itself, never at a sibling "
                "or a cousin. So every branch is scored as if it were the only continuation.",
                f"Position ids are the anchor's position ({anchor.position_id}) plus the depth: siblings share one."]
    if phase.kind == "verify":
        return _verify_account(step, by_id[phase.node], greedy)
    return _commit_account(step)


def _draft_account(step: StepTrace, phase: Phase, by_id: dict, anchor) -> list[str]:
    new = [n for n in step.nodes if n.depth == phase.level]
    sources = sorted({n.source for n in new})
    lines = []
    if phase.level == 1:
        lines.append(f"The last committed token is {quote_token(anchor.text)}. Drafting starts there.")
    by_head = bool(step.drafter.get("head"))  # an EAGLE-3 head's q, not a draft model's
    words = ", ".join("the EAGLE-3 head" if by_head and s == "draft" else SOURCE_WORDS.get(s, s) for s in sources)
    lines.append(f"Level {phase.level}: {len(new)} new token{'s' if len(new) != 1 else ''} from {words}: "
                 + ", ".join(quote_token(n.text) for n in new[:6]) + (" …" if len(new) > 6 else "") + ".")
    parents = sorted({n.parent for n in new if n.source == "draft"})
    for pid in parents[:2]:
        q_top = next((n.q_top for n in new if n.parent == pid and n.q_top), [])
        if q_top:
            lines.append(f"After {quote_token(by_id[pid].text)} the {'head' if by_head else 'draft'}'s top "
                         f"candidates: {_top(q_top)}.")
    signal = next((s for s in step.stop_signals if s.level == phase.level), None)
    if signal is not None and signal.policy != "none":
        verdict = "keep drafting" if signal.keep_drafting else "**stop drafting**"
        lines.append(f"Stop policy ({signal.policy}): best score {signal.score:.2f} against the threshold "
                     f"{signal.threshold:.2f}: {verdict}.")
    elif phase.level == max(n.depth for n in step.nodes):
        lines.append("This is the tree's last level.")
    return lines


def _verify_account(step: StepTrace, node, greedy: bool) -> list[str]:
    ok = node.status == ACCEPTED
    lines = []
    if node.source in FREE_SOURCES:
        lines.append(f"{quote_token(node.text)} was proposed for free by {SOURCE_WORDS[node.source]}: its q is a point "
                     "mass, so the test accepts it with probability p.")
    if greedy:
        best = node.p_top[0][1] if node.p_top else None
        lines.append(f"Testing {quote_token(node.text)}: the target's own top token here is "
                     f"{quote_token(best) if best is not None else '?'}"
                     + (f" (p {node.p_top[0][2]:.0%})." if node.p_top else "."))
        lines.append("Same token: **accepted**, the walk goes one level deeper." if ok else
                     "Different: **rejected**. Nothing below it can be committed.")
        return lines
    p = f"{node.p:.3f}" if node.p is not None else "?"
    q = f"{node.q:.3f}" if node.q is not None else "?"
    ratio = f"{node.ratio:.2f}" if node.ratio is not None else "?"
    u = f"{node.u:.2f}" if node.u is not None else "?"
    if step.verifier == "spectr" and node.source == "draft":  # SpecTr's K-SEQ: the ratio is p/(rho q)
        rho = node.p / (node.q * node.ratio) if node.p and node.q and node.ratio else None
        siblings = sum(1 for n in step.nodes if n.parent == node.parent and n.source == "draft")
        lines.append(f"Testing {quote_token(node.text)}: target p = {p}, draft q = {q}. SpecTr tests each of the "
                     f"{siblings} independent drafts here with min(1, p/(ρ q)), ρ = "
                     f"{'?' if rho is None else f'{rho:.2f}'} for {siblings} drafts: min(1, {ratio}).")
        lines.append(f"The uniform draw is u = {u}: " + ("u < p/(ρ q), **accepted**." if ok else
                                                         "u ≥ p/(ρ q), **rejected**."))
        if not ok and node.residual_top:
            lines.append("Where every draft here is rejected, the next token comes from SpecTr's residual, which "
                         f"puts back exactly the mass the tests took: {_top(node.residual_top)}.")
        return lines
    lines.append(f"Testing {quote_token(node.text)}: target p = {p}, draft q = {q}, so it is accepted with probability "
                 f"min(1, p/q) = min(1, {ratio}).")
    lines.append(f"The uniform draw is u = {u}: " + ("u < p/q, **accepted**." if ok else "u ≥ p/q, **rejected**."))
    if not ok and node.residual_top:
        lines.append("The next token must now come from the residual norm(max(p − q, 0)): "
                     f"{_top(node.residual_top)}. This correction is why the output is exactly the target's.")
    return lines


def _pearl_account(step: StepTrace, phase: Phase, info: dict, anchor) -> list[str]:
    """PEARL's round (``plugins/bundled/pearl.py``) told as its two lanes: what the target reads while the draft
    drafts, and what the round commits, carries or discards."""
    chain = [n for n in step.nodes if n.source != CONTEXT]
    carried = [n for n in chain if (n.provenance or {}).get("pearl") == "carried"]
    new = [n for n in chain if (n.provenance or {}).get("pearl") == "new"]
    drafted = [quote_token(n.text) for n in new] + ([f"and {len(info['drafted']) - 1} more"]
                                                     if len(info.get("drafted", [])) > 1 else [])
    if phase.kind == "draft":
        node = next((n for n in chain if n.depth == phase.level), None)
        lines = []
        if phase.level == 1:
            since = carried[0].provenance["drafted_in_step"] + 1 if carried else None
            lines.append(
                f"**Post-verify**: {len(carried)} tokens drafted in step {since} wait to be checked. The target's "
                f"forward reads them now while the draft, at the same time, drafts {info['gamma']} more after them: "
                + " ".join(drafted) + "."
                if carried else
                f"**Pre-verify**: nothing waits to be checked. The target's forward reads only the context after "
                f"{quote_token(anchor.text)} while the draft, at the same time, drafts {len(info.get('drafted', []))}"
                " tokens: " + " ".join(drafted) + ".")
        if node is not None and node in carried:
            lines.append(f"{quote_token(node.text)} was drafted last round, while the target was busy.")
        elif node is not None:
            lines.append(f"{quote_token(node.text)} is the round's first new draft: the target's forward started "
                         "before it existed, so it is tested from its parent's row and has no row of its own.")
        return lines
    if phase.kind == "mask":
        return [f"The target's forward reads {len(step.mask_node_ids)} rows: the last committed token and the "
                f"{len(carried)} carried tokens; never the new draft, which the draft was still writing.",
                "The draft's lane and the target's lane run side by side: the round takes as long as the slower, "
                "not both (the timeline's two lanes)."]
    whole = bool(chain) and all(n.status == ACCEPTED for n in chain) and info.get("unfed_leaf")
    text = "".join(step.committed_text)
    if whole:
        return [f"All {len(chain)} checked tokens accepted: {quote_token(text)} committed with **no bonus token** "
                "(the target never read the new draft's position, so it has no next distribution there).",
                f"The draft's other {len(info['drafted']) - 1} new tokens are carried to the next round, which "
                "post-verifies them: the draft never waited."]
    if all(n.status == ACCEPTED for n in chain):  # nothing new was drafted (end of text, or of the budget)
        return [f"All checked tokens accepted, then the target's own next token: {quote_token(text)} committed."]
    lost = len(discarded(step))
    return [f"Committed {quote_token(text)}: the accepted tokens and the target's own token after the rejection.",
            f"{lost} drafted token{'s' if lost != 1 else ''} thrown away, drafted in parallel for nothing. The next "
            "round starts afresh in pre-verify."]


def _commit_account(step: StepTrace) -> list[str]:
    path = committed_path(step)
    rejected = sum(1 for n in step.nodes if n.status == REJECTED)
    unverified = sum(1 for n in step.nodes if n.status == UNVERIFIED)
    text = "".join(step.committed_text)
    lines = []
    if not _has_tree(step):
        lines.append(f"No draft this step: the target wrote one token, {quote_token(text)}, as plain decoding does.")
    else:
        lines.append(f"Committed {len(step.committed_ids)} token{'s' if len(step.committed_ids) != 1 else ''} "
                     f"from one target call: {quote_token(text)}.")
        if step.bonus_token is not None:
            lines.append(f"{len(path)} came from the draft tree; the last, {quote_token(step.committed_text[-1])}, "
                         "is the **bonus token**, drawn from the target's own distribution after the accepted path.")
        lines.append(f"Both KV caches keep the context plus the accepted path; the rows of {rejected} rejected and "
                     f"{unverified} unverified tokens are dropped.")
    if step.lossy:
        lines.append("This method is LOSSY: the longest branch wins, which biases the output.")
    return lines


__all__ = ["DRAFTED", "PHASE_KINDS", "Phase", "account", "committed_path", "mask_rows", "run_phases",
           "quote_token", "shown_status", "step_phases", "visible_nodes"]
