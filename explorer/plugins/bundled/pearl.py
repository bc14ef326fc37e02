"""PEARL (Liu et al., ICLR 2025, arXiv 2408.11850; the reference code is ``parallel_speculative_decoding`` in
smart-lty/ParallelSpeculativeDecoding, ``src/engine.py``) as the method ``pearl``: the draft drafts while the
target verifies, so that neither waits for the other.

A round of PEARL is one step of this engine: one target forward and ``gamma`` draft forwards that do not depend on
it (they run in parallel on two devices; ``explorer.trace.lanes`` lays out the two lanes and the time they
would take). The round's target forward reads the tokens the *previous* round drafted and left unverified
(``pending``), never this round's drafts:

* **pre-verify** (nothing pending): the target's forward reads only the committed context and yields the
  distribution after the anchor, which checks the first of this round's ``gamma`` drafts. Rejected, the residual's
  token is committed and the other drafts are discarded; accepted, it is committed and the other ``gamma - 1``
  drafts become pending: the next round is a post-verify round.
* **post-verify** (pending tokens): the target's forward reads the anchor and the pending tokens (``gamma``
  rows) while the draft drafts ``gamma`` more after them. The pending tokens and the first new draft are checked in
  order; all accepted, they are committed *with no bonus token* (the target never read the new draft) and the other
  new drafts are pending (the draft length grows by itself while blocks are accepted); a rejection commits the
  accepted prefix and the residual's token, discards the rest (pending and new), and the next round is pre-verify.

The rule is speculative decoding's (``rrs`` on one child; ``greedy`` at temperature 0), each token tested against
the draft distribution it was drawn from, so the method is lossless. The first new draft is the tree's
*unfed leaf* (``Drafted.unfed_leaf``): tested from its parent's row, with no row of its own. Draws come from the run's
generator like every method's (the reference code reseeds per position: two samples of one prompt would share
their draws).
"""

from __future__ import annotations

from explorer.engine.drafting import candidates
from explorer.engine.parts import EngineError
from explorer.engine.sampling import LazyRows, RowDists
from explorer.engine.tree import DraftTree
from explorer.plugins import Drafted, ModelDrafter, register_method

TOP_SHOWN = 8
RULES = ("rrs", "rrs-replacement", "greedy")  # the rules that test one child as speculative decoding does


class PearlDrafter(ModelDrafter):
    """PEARL's rounds (module docstring): ``gamma`` new draft tokens a round after the committed context and the
    tokens the last round left pending; the tree is the pending chain plus the first new draft (unfed)."""

    name = "pearl"

    def __init__(self):
        super().__init__()
        self._reset()

    def _reset(self) -> None:
        self.pending: list[int] = []  # drafted last round, verified this round (the target reads them now)
        self._pending_rows: list[tuple] = []  # per pending token: (RowDists, row, q shown, q top) it was drawn from
        self._pending_step: int | None = None  # the step that drafted them
        self._new: list[int] = []  # this round's drafts
        self._new_rows: list[tuple] = []
        self._cache = None  # the draft's KV cache (cut in ``observe``)

    def start(self, view) -> None:
        super().start(view)
        self._reset()

    def rewind(self) -> None:
        super().rewind()
        self._reset()

    def reads_ahead(self) -> list[int]:
        """The pending chain: the round's target forward reads it while the draft drafts."""
        return list(self.pending)

    def draft(self, view) -> Drafted:
        if view.verifier_name not in RULES:
            raise EngineError(f"pearl tests one draft at a time as speculative decoding does; {view.verifier_name} "
                              f"does not: use --verifier auto, rrs or greedy")
        gamma, sampling, gen = view.config.gamma, view.sampling, view.generator
        ends, tokens_left = view.reach.ends, view.reach.max_depth + 1
        cache = self._cache = view.draft.cache
        context = list(view.committed) + self.pending
        if not self.pending:
            n_new = min(gamma, max(1, tokens_left))
        elif self.pending[-1] in ends:  # nothing follows an EOS: the round only checks the pending chain
            n_new = 0
        else:  # drafts past the run's budget could never be committed
            n_new = min(gamma, max(0, tokens_left - len(self.pending)))
        self._new, self._new_rows = [], []
        feed = context[cache.length:]
        for _ in range(n_new):
            start = cache.length
            fwd = view.draft.forward(feed, list(range(start, start + len(feed))), None, keep=1)
            qd = RowDists(fwd.logits, sampling)
            token = candidates(qd, 0, 1, verifier=view.verifier_name, generator=gen)[0]
            self._new.append(token)
            self._new_rows.append((qd, 0, qd.shown(0, token), qd.top([0], TOP_SHOWN)[0]))
            if token in ends:
                break
            feed = [token]
        tree, q_rows, q_show, q_top, provenance = DraftTree(), LazyRows(), {}, {}, {}
        chain = [(t, r, "carried") for t, r in zip(self.pending, self._pending_rows)]
        if self._new:
            chain.append((self._new[0], self._new_rows[0], "new"))
        for i, (token, (qd, row, shown, top), kind) in enumerate(chain):
            (node,) = tree.add_level([i - 1], [token], source="draft")
            if not sampling.greedy:
                q_rows.add(node, qd, row)  # node i's parent row is i: the anchor's is 0
            q_show[node], q_top[node] = shown, top
            provenance[node] = {"source": "draft", "pearl": kind,
                                "drafted_in_step": self._pending_step if kind == "carried" else view.steps_done}
        unfed = bool(self._new)
        info = {"pearl": {"mode": "post" if self.pending else "pre", "gamma": gamma, "checked": len(self.pending),
                          "drafted": list(self._new), "unfed_leaf": unfed}}
        return Drafted(tree, q_rows=q_rows, q_show=q_show, calls=len(self._new), tree_start=len(view.committed),
                       q_top=q_top, provenance=provenance, info=info, unfed_leaf=unfed, own_draft_cache=True)

    def observe(self, step) -> None:
        """Carry the round's other drafts to the next round when its whole chain was accepted; otherwise drop them
        and cut the draft's cache back to the tokens it shares with the committed context."""
        super().observe(step)
        tree, path = step.drafted.tree, step.verified.result.path
        whole = bool(self._new) and len(path) == len(tree)
        if whole:
            self.pending, self._pending_rows = self._new[1:], self._new_rows[1:]
            self._pending_step = step.record.index
        else:
            self.pending, self._pending_rows, self._pending_step = [], [], None
            if self._cache is not None:  # the cache holds context + pending + new drafts; the path is its prefix
                self._cache.rewind(min(self._cache.length, len(step.context) + len(path)))
        self._new, self._new_rows = [], []


register_method("pearl", PearlDrafter, label="PEARL (drafting while the target verifies)", model_tree="chain",
                summary="the draft drafts the next block while the target verifies the last one (post-verify), or "
                        "while it checks the first draft token (pre-verify); two lanes in parallel",
                defaults={"gamma": 4, "fallback": "off"})
