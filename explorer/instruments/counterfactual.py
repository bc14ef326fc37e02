"""Counterfactual steps: re-verify a recorded step from its saved state, as recorded or edited.

The run is replayed up to the step before (``replay.py``, checked token by token), so the models, both KV caches,
the drafter and the random generator are exactly where they were. Then the step runs again:

* with no edit it must reproduce the recorded step: every node's decision and every committed token
  (``identical``);
* a **tree edit** (replace a drafted token, add a branch, remove a branch) changes the tree after drafting: the
  draft model scores the edited tree in one forward (the tree mask) for the q its children now hang from, and the
  verifier runs with the random draws the original step had;
* a **setting edit** (verifier, temperature, seed) reruns the whole step under the new settings.

The recorded trace is never changed: the replay is a new engine with its own trace. After the edited step the
engine can go on decoding (``continue_tokens``): the text that follows the edit, a new branch of the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine.config import VERIFIERS
from ..engine.drafters import Drafted
from ..engine.sampling import LazyRows, RowDists
from ..engine.tree import DraftTree, step_mask, step_position_ids
from ..trace.records import FREE_SOURCES, TOP_K_SHOWN, RunTrace, StepTrace
from .replay import check_step, engine_for_trace, replay_steps


class EditError(ValueError):
    """An edit that cannot apply to this step (no such node, a bad token, an impossible setting)."""


@dataclass
class StepEdit:
    """What to change in one step. Node ids are the trace's (1 = the first drafted node; 0 = the anchor).

    Attributes:
        replace: node id -> new token id (the node keeps its place and its subtree, which the draft rescores).
        add: ``[(parent node id, token id), ...]``: new draft-model children, tested after the existing ones.
        remove: node ids whose whole subtree leaves the tree.
        verifier / temperature / seed: rerun the step with these settings (None = as recorded).
    """

    replace: dict[int, int] = field(default_factory=dict)
    add: list[tuple[int, int]] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    verifier: str | None = None
    temperature: float | None = None
    seed: int | None = None

    @property
    def edits_tree(self) -> bool:
        return bool(self.replace or self.add or self.remove)

    @property
    def edits_settings(self) -> bool:
        return self.verifier is not None or self.temperature is not None or self.seed is not None

    @property
    def empty(self) -> bool:
        return not (self.edits_tree or self.edits_settings)

    def to_dict(self) -> dict:
        return {"replace": {str(k): v for k, v in self.replace.items()}, "add": [list(a) for a in self.add],
                "remove": list(self.remove), "verifier": self.verifier, "temperature": self.temperature,
                "seed": self.seed}


def parse_edits(specs: list[str], tokenizer=None) -> StepEdit:
    """``StepEdit`` from command-line specs: ``replace:NODE=TOKEN``, ``add:PARENT=TOKEN``, ``remove:NODE``,
    ``verifier:NAME``, ``temperature:T``, ``seed:S``. TOKEN is a token id, or text in quotes (``'" the"'``) that
    must encode to exactly one token. Raises EditError with the offending spec."""
    edit = StepEdit()
    for spec in specs:
        kind, _, arg = spec.partition(":")
        try:
            if kind in ("replace", "add"):
                node, _, token = arg.partition("=")
                pair = (int(node), _token(token, tokenizer))
                if kind == "replace":
                    edit.replace[pair[0]] = pair[1]
                else:
                    edit.add.append(pair)
            elif kind == "remove":
                edit.remove.append(int(arg))
            elif kind == "verifier":
                edit.verifier = arg
            elif kind == "temperature":
                edit.temperature = float(arg)
            elif kind == "seed":
                edit.seed = int(arg)
            else:
                raise EditError(f"unknown edit {kind!r}")
        except ValueError as exc:
            raise EditError(f"edit {spec!r}: {exc} (use replace:NODE=TOKEN, add:PARENT=TOKEN, remove:NODE, "
                            "verifier:NAME, temperature:T, seed:S)") from None
    return edit


def _token(text: str, tokenizer) -> int:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        if tokenizer is None:
            raise EditError("a token given as text needs the tokenizer")
        ids = tokenizer.encode(text[1:-1], add_special_tokens=False)
        if len(ids) != 1:
            raise EditError(f"{text} is {len(ids)} tokens, not one")
        return int(ids[0])
    return int(text)


def edited_tree(tree: DraftTree, edit: StepEdit, vocab_size: int) -> tuple[DraftTree, dict[int, int], dict]:
    """The tree with ``edit``'s replacements, additions and removals, breadth-first again.

    Returns ``(tree, old_to_new, provenance)``: tree indices of the kept nodes in the new tree, and new index ->
    the edit's provenance (``{"source": "edited", "edit": "replaced" | "added", "was": old token}``).
    Raises EditError for a node id that is not in the tree, the anchor, or a token outside the vocabulary.
    """
    n = len(tree)
    for node in list(edit.replace) + list(edit.remove) + [p for p, _ in edit.add]:
        if not 0 <= node <= n or (node == 0 and (node in edit.replace or node in edit.remove)):
            raise EditError(f"node {node} is not a drafted node of this step (1..{n})")
    for token in list(edit.replace.values()) + [t for _, t in edit.add]:
        if not 0 <= token < vocab_size:
            raise EditError(f"token id {token} is outside the vocabulary (0..{vocab_size - 1})")
    for node in edit.replace:
        if tree.source[node - 1] == "target":
            raise EditError(f"node {node} is a root sampled from the target: it is not tested, edit its children")
    removed = set()
    for i in range(n):  # parents come first, so a subtree is removed with its root
        if (i + 1) in edit.remove or (tree.parent[i] >= 0 and tree.parent[i] in removed):
            removed.add(i)
    # (old index or None for added, parent as old index or ("new", k), token, source, provenance)
    children: dict = {}
    for i in range(n):
        if i in removed:
            continue
        token = edit.replace.get(i + 1, tree.token[i])
        prov = {"source": "edited", "edit": "replaced", "was": tree.token[i]} if (i + 1) in edit.replace else None
        children.setdefault(tree.parent[i], []).append((i, token, tree.source[i], prov))
    for parent, token in edit.add:
        if parent - 1 in removed:
            raise EditError(f"node {parent} is removed by this edit: it cannot get a child")
        children.setdefault(parent - 1, []).append((None, token, "draft", {"source": "edited", "edit": "added"}))
    for parent, kids in children.items():  # one token per parent: siblings must differ
        tokens = [k[1] for k in kids]
        if len(set(tokens)) != len(tokens):
            where = "the anchor" if parent < 0 else f"node {parent + 1}"
            raise EditError(f"two children of {where} would carry the same token")
    out = DraftTree()
    old_to_new: dict[int, int] = {}
    provenance: dict = {}
    level = [(-1, -1)]  # (old index or key, new index) of the previous level
    while True:
        parents, tokens, sources, olds, provs = [], [], [], [], []
        for key, new_parent in level:
            for old, token, source, prov in children.get(key, []):
                parents.append(new_parent)
                tokens.append(token)
                sources.append(source)
                olds.append(old if old is not None else ("added", len(provenance), token))
                provs.append(prov)
        if not tokens:
            break
        span = out.add_level(parents, tokens, sources)
        level = []
        for new, old, prov in zip(span, olds, provs):
            if isinstance(old, int):
                old_to_new[old] = new
            if prov is not None:
                provenance[new] = prov
            level.append((old, new))
    return out, old_to_new, provenance


def rescored(engine, d: Drafted, tree: DraftTree, old_to_new: dict[int, int], provenance: dict) -> Drafted:
    """``d`` with its tree replaced by ``tree``: the draft model scores the whole edited tree in one forward (tree
    mask, after the committed context it already holds) for the q rows of every node's children; the anchor's row
    is the one drafting computed. Free nodes stay free (q a point mass)."""
    sampling = engine.sampling
    model_roots = [i for i in tree.children(-1) if tree.source[i] not in FREE_SOURCES + ("target",)]
    if model_roots and not sampling.greedy and 0 not in d.q_rows:
        raise EditError("this step has no draft distribution at the anchor to test a new root against")
    if any(tree.source[i] == "draft" for i in range(len(tree))) and (engine.state.draft_kv is None or not d.calls):
        raise EditError("the draft model did not draft this step (a method or step without it): only its own "
                        "(free) tokens can be edited")
    q_rows, q_show, q_top = LazyRows(), {}, {}
    if 0 in d.q_rows:
        q_rows._refs[0] = d.q_rows._refs[0]  # the anchor's row: the same context, the same q
    if 0 in d.q_top:
        q_top[0] = d.q_top[0]
    calls, draft_rows = d.calls, {}
    if engine.state.draft_kv is not None and d.calls and len(tree):
        engine.state.draft_kv.rewind(d.tree_start)  # forget the drafted levels: the edited tree is fed whole
        mask = step_mask(d.tree_start, 0, False, tree.anc, 0, len(tree))
        pos = step_position_ids(d.tree_start, 0, False, tree.depth, 0, len(tree))
        fwd = engine.forwards.forward("draft", list(tree.token), pos, mask, keep=len(tree))
        calls += 1
        draft_rows = {i: i for i in range(len(tree))}
        qd = RowDists(fwd.logits, sampling)
        parents_with_model_kids = sorted({tree.parent[i] for i in range(len(tree))
                                          if tree.source[i] not in FREE_SOURCES and tree.parent[i] >= 0})
        tops = qd.top(parents_with_model_kids, TOP_K_SHOWN)
        for node in parents_with_model_kids:
            q_top[node + 1] = tops[node]
            if not sampling.greedy:
                q_rows.add(node + 1, qd, node)
        anchor_q = d.q_rows.get(0) if 0 in d.q_rows else None
        for i in range(len(tree)):
            if tree.source[i] in FREE_SOURCES or tree.source[i] == "target":
                continue
            if tree.parent[i] >= 0:
                q_show[i] = qd.shown(tree.parent[i], tree.token[i])
            elif anchor_q is not None:
                q_show[i] = float(anchor_q[tree.token[i]])
            else:
                q_show[i] = d.q_show.get(_old_of(old_to_new, i))
    prov = {old_to_new[o]: p for o, p in d.provenance.items() if o in old_to_new}
    prov.update(provenance)
    return replace(d, tree=tree, q_rows=q_rows, q_show=q_show, q_top=q_top, signals=[], calls=calls,
                   draft_rows=draft_rows, features={}, provenance=prov,
                   predicted={old_to_new[o]: p for o, p in d.predicted.items() if o in old_to_new})


def _old_of(old_to_new: dict[int, int], new: int) -> int | None:
    return next((o for o, n in old_to_new.items() if n == new), None)


@dataclass
class Counterfactual:
    """The recorded step, the re-verified (maybe edited) one, and what differs, as plain data."""

    step: int
    edit: dict
    original: StepTrace
    edited: StepTrace
    identical: bool
    differences: list[str]
    continuation_ids: list[int]
    continuation_text: str
    run: RunTrace | None = None  # the replayed run up to the edited step (and its continuation)
    engine: object = None  # the engine after it: it can go on stepping (a new branch of the session)

    def to_dict(self) -> dict:
        return {"step": self.step, "edit": self.edit, "identical": self.identical, "differences": self.differences,
                "original": self.original.to_dict(), "edited": self.edited.to_dict(),
                "continuation_ids": self.continuation_ids, "continuation_text": self.continuation_text}


def _paths(step: StepTrace) -> dict[tuple, object]:
    """Each drafted node keyed by the tokens from the anchor down to it (the same node in two trees)."""
    by_id = {n.id: n for n in step.nodes}
    out = {}
    for n in step.nodes[1:]:
        path, m = [], n
        while m.parent is not None:
            path.append(m.token_id)
            m = by_id[m.parent]
        out[tuple(reversed(path))] = n
    return out


def compare_steps(a: StepTrace, b: StepTrace) -> list[str]:
    """What differs between two steps ([] = the same): nodes (matched by their token path) whose decision changed,
    nodes only one tree has, and the committed tokens."""
    out = []
    pa, pb = _paths(a), _paths(b)
    for key, x in pa.items():
        y = pb.get(key)
        if y is None:
            out.append(f"node {x.id} {x.text!r} ({x.status}) is not in the edited tree")
        elif x.status != y.status:
            out.append(f"node {x.id} {x.text!r}: {x.status} -> {y.status}")
    for key, y in pb.items():
        if key not in pa:
            out.append(f"new node {y.id} {y.text!r}: {y.status}")
    if a.committed_ids != b.committed_ids:
        out.append(f"committed {''.join(a.committed_text)!r} -> {''.join(b.committed_text)!r}")
    return out


def counterfactual(pair, trace: RunTrace, step: int, edit: StepEdit | None = None, continue_tokens: int = 0,
                   decision_model=None) -> Counterfactual:
    """Re-verify step ``step`` (0-based) of ``trace`` on ``pair``, as recorded or with ``edit``; then decode up to
    ``continue_tokens`` more tokens after it.

    Raises ReplayError when the trace does not replay here, EditError for an edit that cannot apply.
    """
    edit = edit or StepEdit()
    check_step(trace, step)
    if edit.verifier is not None and edit.verifier not in VERIFIERS + ("greedy",):
        raise EditError(f"unknown verifier {edit.verifier!r}; use greedy or one of {', '.join(VERIFIERS)}")
    if step:
        *_, (_, engine) = replay_steps(pair, trace, step - 1, decision_model)
    else:
        engine = engine_for_trace(pair, trace, decision_model)
    if edit.edits_settings:
        changes = {}
        if edit.temperature is not None:
            changes["temperature"] = edit.temperature
        if edit.seed is not None:
            changes["seed"] = edit.seed
        try:
            engine.sampling = replace(engine.sampling, **changes) if changes else engine.sampling
        except ValueError as exc:
            raise EditError(str(exc)) from None
        if edit.seed is not None:
            engine.state.generator.manual_seed(int(edit.seed))
        engine.verifier_name = edit.verifier or engine.config.verifier_for(engine.sampling.greedy)
    hook = None
    if edit.edits_tree:
        def hook(eng, d: Drafted) -> Drafted:
            tree, old_to_new, prov = edited_tree(d.tree, edit, pair.vocab_size)
            return rescored(eng, d, tree, old_to_new, prov)
    edited = engine.step(edit=hook)
    original = trace.steps[step]
    differences = compare_steps(original, edited)
    before = engine.n_generated
    while continue_tokens and not engine.finished and engine.n_generated - before < continue_tokens:
        engine.step()
    more = engine.trace.generated_ids[len(engine.trace.generated_ids) - (engine.n_generated - before):] \
        if engine.n_generated > before else []
    return Counterfactual(step=step, edit=edit.to_dict(), original=original, edited=edited,
                          identical=edit.empty and not differences, differences=differences,
                          continuation_ids=more, continuation_text=engine.pair.tokenizer.decode(more),
                          run=engine.trace, engine=engine)

