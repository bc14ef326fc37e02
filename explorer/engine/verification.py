"""Verification of one step's draft tree: one target forward over the uncached committed tokens (the anchor, or a
joint prefill's whole prompt) and the tree, the odds of every node, then the verifier's walk (``verify/``).

The tree's rows get the topology-aware mask and position ids ``L - 1 + depth`` (``engine/tree.py``). Where the
drafter names target layers (``Drafter.target_layers``), the same forward returns their hidden states, and the step
keeps those of the committed rows it read: the uncached committed tokens, then the accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forwarding import Forwards
from .parts import EngineError
from .run_state import RunState
from .sampling import LazyRows, RowDists, SamplingConfig
from .tree import DraftTree, step_mask, step_position_ids
from .verify import expectation
from .verify import rules as verify


@dataclass(kw_only=True)
class VerifiedStep:
    """What verification produced for one step: what the step's observers learn from and instruments read
    (``Engine.last_step``: the latest step's ``(Drafted, VerifiedStep)``). Tensors live on the pair's device; N is
    the number of tree nodes, R the rows of the step's own mask (the anchor, when fed, and the N nodes), vocab the
    pair's shared vocabulary.

    Attributes:
        result: the walk's outcome (``verify.VerifyResult``): the accepted path (tree indices), the bonus token,
            each tested node's ``NodeDecision``, per-branch accepted counts, the chosen branch.
        p_rows: the target's processed distributions (``sampling.RowDists``): row 0 the anchor, row i + 1 tree
            node i, each float32 ``(vocab,)`` (one-hot when greedy), computed when read.
        mask: numpy bool ``(R, R)``: the step's own columns of the mask sent to the target (True = attend).
        position_ids: R ints, ``L - 1 + depth`` (the anchor, when fed, at ``L - 1``).
        past: cached context columns every row also attends to.
        anchor_fed: whether the anchor was a row of this forward (it was not in the target's cache yet).
        calls: target forwards this verification took: 1, or 0 on a first ``ar`` step (nothing to feed).
        tree_start: the target cache's length before the tree rows (``past`` plus the anchor when fed), tokens.
        parent_rows: sorted p rows with children in the tree (batched in ``p_rows``; their top tokens are traced).
        anchor_token: the last committed token id, root of the tree.
        anchor_logits: ``(vocab,)`` the target's logits at the anchor: model dtype when the anchor was fed, else
            float32 (kept from the prefill or the previous lossy step).
        node_logits: ``(N, vocab)`` model dtype: the target's logits at every tree node, tree order.
        odds: tree index -> ``expectation.NodeOdds`` (``accept_prob``, ``slot_prob`` in [0, 1], ``order``,
            ``ratio``): what the rule implies about each tested node.
        expected_tokens: tokens the step commits in expectation over the verifier's draws (bonus included).
        rng_state: uint8 CPU tensor, the generator's state right before verification (the probe re-verifies).
        full_mask: numpy bool ``(R, past + R)``: the whole mask the target was sent (the probe lints it).
        prompt_top: with the prefill joined to this verification, the target's best candidates ``[(id, plain
            probability)]`` at the prompt's last rows (the decision features' memory of the prompt), else None. The
            prompt's rows before the anchor are not part of ``mask``, ``full_mask``, ``position_ids`` or ``R``:
            ``past`` counts them as cached context.
        prefill_rows: the prompt's tokens this forward read (a joint prefill), else 0.
        target_states: where the drafter names target layers, their hidden states at the committed rows this
            forward read, model dtype ``(rows, len(target_layers), hidden_size)``: the uncached committed tokens
            (the anchor last) then the accepted path's nodes; the bonus token is not among them (the next step
            reads it). None where no layer is named or no forward ran.
        states_start: the position of ``target_states``' first row.
    """

    result: verify.VerifyResult
    p_rows: RowDists
    mask: object
    position_ids: list[int]
    past: int
    anchor_fed: bool
    calls: int
    tree_start: int
    parent_rows: list[int]
    anchor_token: int
    anchor_logits: torch.Tensor
    node_logits: torch.Tensor
    odds: dict
    expected_tokens: float
    rng_state: torch.Tensor
    full_mask: object
    prompt_top: list | None = None
    prefill_rows: int = 0
    target_states: torch.Tensor | None = None
    states_start: int = 0

    @property
    def fed(self) -> int:
        """Tree nodes this forward read (the first ``fed`` in tree order): N, or N - 1 with an unfed leaf
        (``Drafted.unfed_leaf``), whose row is in none of the above."""
        return int(self.node_logits.shape[0])


@dataclass
class TargetRead:
    """The target's forward of one step, before any test (``read_tree``): over the uncached committed tokens and
    the first ``len(tokens)`` tree nodes. ``logits`` ``(rows, vocab)`` model dtype (row 0 the anchor when it was
    uncached), ``states`` the named layers' hidden states or None, ``mask`` / ``pos`` the rows' mask and position
    ids, ``past`` the cached context, ``calls`` 1 or 0 (nothing to read), ``prompt_top`` a joint prefill's
    candidates at the prompt's last rows."""

    tokens: list[int]
    uncached: list[int]
    past: int
    mask: object
    pos: list[int]
    calls: int
    logits: torch.Tensor
    states: torch.Tensor | None
    prompt_top: list | None


def read_tree(forwards: Forwards, state: RunState, tree: DraftTree, n: int,
              target_layers: tuple[int, ...] = ()) -> TargetRead:
    """One target forward over the uncached committed tokens and the first ``n`` nodes of ``tree`` (a prefix of it
    in tree order, closed under parents), appending their rows to the target's cache. PEARL's engine step calls it
    with the chain the last round left pending while the draft drafts in another thread."""
    timeline = forwards.timeline
    L = len(state.committed)
    uncached = state.committed[state.target_kv.length:]
    past = L - len(uncached)
    timeline.enter("mask")
    mask = step_mask(past, len(uncached), True, tree.anc, 0, n)
    pos = step_position_ids(past, len(uncached), True, tree.depth, 0, n)
    calls = 1 if uncached or n else 0
    prompt_rows = state.prompt_rows if state.prefill_pending else 0  # the memory's prompt rows, then the tree's
    prompt_top, states = None, None
    if calls:
        fwd = forwards.forward("target", uncached + tree.token[:n], pos, mask if n else None,
                               keep=n + (1 if uncached else 0), hidden=prompt_rows > 0,
                               hidden_rows=(prompt_rows + n) or None, layers=target_layers)
        logits, states = fwd.logits, fwd.states
        if prompt_rows:  # what the drafter learns of the prompt, timed as its learning (as a prefill apart's)
            timeline.enter("drafter learn")
            prompt_top = forwards.prompt_candidates(fwd.hidden[:prompt_rows])
    else:  # first `ar` step: the prefill already gave the anchor's distribution
        logits = torch.empty(0, forwards.pair.vocab_size, device=forwards.pair.device)
    return TargetRead(tree.token[:n], uncached, past, mask, pos, calls, logits, states, prompt_top)


def verify_tree(forwards: Forwards, state: RunState, tree: DraftTree, q_rows: LazyRows, sampling: SamplingConfig,
                verifier_name: str, lossy: bool, target_layers: tuple[int, ...] = (),
                unfed_leaf: bool = False, read: TargetRead | None = None) -> VerifiedStep:
    """One target forward over the uncached committed tokens and the whole ``tree``, then ``verifier_name``'s walk
    with draws from ``state.generator``. ``q_rows``: the draft's distributions the tree's children were drawn from
    (``Drafted.q_rows``); ``lossy``: the target-initialized method (its rule keeps the longest accepted branch).
    The forward appends its rows to the target's cache (``commit`` keeps the accepted path's); the generator draws;
    nothing else of ``state`` changes. Segments go to ``forwards.timeline``. ``unfed_leaf``: the tree's last node
    is not fed to the target (``Drafted.unfed_leaf``): it is tested from its parent's row and, accepted, ends the
    step with no bonus token. ``read``: the forward, already run (``read_tree``) over what the tree feeds.
    Raises EngineError where ``read`` read other tokens than the tree feeds."""
    n = len(tree) - (1 if unfed_leaf and len(tree) else 0)  # the nodes fed to the target
    if read is None:
        read = read_tree(forwards, state, tree, n, target_layers)
    elif read.tokens != tree.token[:n]:
        raise EngineError(f"the target read {read.tokens} ahead of drafting, but the tree feeds {tree.token[:n]}")
    timeline = forwards.timeline
    uncached, past, mask, pos, calls = read.uncached, read.past, read.mask, read.pos, read.calls
    logits, states, prompt_top = read.logits, read.states, read.prompt_top
    # The prompt's rows before the anchor (a joint prefill) count as cached context in the step's record.
    skip = max(0, len(uncached) - 1)
    shown_past, shown_mask, shown_pos = past + skip, mask[skip:], pos[skip:]
    timeline.enter("odds")
    parents = sorted({p + 1 for p in tree.parent})  # rows with children: their best tokens go into the trace
    if uncached:  # logits row 0 = anchor (p row 0), row 1 + i = node i
        p_rows = RowDists(logits, sampling, stat_rows=parents)
    else:  # the anchor is cached: its distribution was kept from the prefill or the previous (lossy) step
        p_rows = RowDists(logits, sampling, offset=1, fixed={0: (state.next_dist, state.next_logits)},
                          stat_rows=parents)
    # every node's test, computed on the device and read in one transfer; the walk below compares them with draws
    odds = expectation.node_odds(tree, p_rows, q_rows, verifier_name, greedy=sampling.greedy)
    expected = expectation.expected_tokens(tree, odds, lossy=lossy)
    leaf = len(tree) - 1 if n < len(tree) else None
    if leaf is not None and leaf in odds:  # accepted, the unfed leaf has no bonus token after it
        expected -= expectation.tested_probs(tree, odds)[leaf] * odds[leaf].accept_prob
    timeline.enter("verification")
    rng_state = state.generator.get_state()
    result = verify.run_verifier(verifier_name, tree, p_rows, q_rows, state.generator, greedy=sampling.greedy,
                                 odds=odds, unfed_leaf=leaf)
    if states is not None:  # the committed rows: the uncached tokens, then the accepted path
        rows = list(range(len(uncached))) + [len(uncached) + i for i in result.path if i < n]
        states = states[torch.tensor(rows, dtype=torch.long, device=states.device)]
    return VerifiedStep(
        result=result, p_rows=p_rows, mask=shown_mask[:, shown_past:], position_ids=shown_pos, past=shown_past,
        anchor_fed=bool(uncached), calls=calls, tree_start=past + len(uncached), parent_rows=parents,
        anchor_token=state.committed[-1], anchor_logits=logits[0] if uncached else state.next_logits,
        node_logits=logits[1:] if uncached else logits, odds=odds, expected_tokens=expected, rng_state=rng_state,
        full_mask=shown_mask, prompt_top=prompt_top, prefill_rows=len(uncached) if skip else 0,
        target_states=states, states_start=past)
