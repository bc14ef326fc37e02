"""How candidate tokens are chosen for a node: the children of a tree node, or the target-initialized roots.

Every function takes one distribution and returns token ids, using the engine's ``torch.Generator`` so that the
same seed gives the same tree.

* Greedy (temperature 0): the top-k tokens of the raw logits (ties broken by index), as in greedy MCSD.
* Without replacement: k distinct tokens with the law of sequential sampling without replacement, which the MCSD
  verifier assumes (the law the Gumbel-top-k trick draws, Kool et al. 2019). Each draw is an inverse-CDF draw over
  the row's best tokens, and only a draw that lands in the remaining tail reads the whole row: with a sharp
  distribution most draws never touch the other 150,000 tokens.
* With replacement: k i.i.d. draws from q (SpecInfer's setting; duplicates allowed).
* Hub pairs: SpecHub's two children, one of them the draft's argmax (``hub_pair``).
"""

from __future__ import annotations

import torch

from .sampling import TOP_CACHED, inverse_cdf, sample_one, uniforms
from .verify.registry import view

# The draws (``uniforms``, ``sample_one``) live in sampling.py, re-exported here, so that the verifiers' node rules
# draw without importing this module, which reads the verifier registry (no import circle).


def greedy_candidates(logits: torch.Tensor, k: int) -> list[int]:
    """Top-``k`` token ids of ``logits`` (``(vocab,)``), best first."""
    return torch.topk(logits.float(), k).indices.tolist()


PRECISE_REST = 1e-3
"""Below this remaining mass, ``1 - taken`` (float32 probabilities) is too coarse to split: draw from the row."""


def sample_without_replacement(top_ids: list[int], top_probs: list[float], full_row, k: int,
                               generator: torch.Generator, draws: list[float] | None = None) -> list[int]:
    """``k`` distinct tokens drawn one after another, each from the distribution left after removing the tokens
    already drawn: the law of sequential sampling without replacement (and of Gumbel-top-k), up to float32
    rounding of the probabilities (about 1e-7 of mass, as for any float32 softmax).

    A draw walks the best tokens' probabilities (inverse CDF) and reads the whole row only when it lands in the
    tail beyond them, or when the tokens already drawn hold nearly all the mass (``PRECISE_REST``), where the rest
    is renormalised from the row itself so that the second choice of a sure draft is drawn exactly.

    Args:
        top_ids, top_probs: the row's most likely tokens and their probabilities (all > 0), best first.
        full_row: a callable returning the whole ``(vocab,)`` float32 distribution (sums to 1).
        k: how many tokens to draw.
        draws: at least ``k`` U[0, 1) draws already on the host (a draft level's, which came with its best tokens);
            None draws them here, in one transfer.
    Returns:
        token ids in draw order; fewer than ``k`` when fewer tokens have non-zero probability.
    Raises:
        ValueError: fewer than ``k`` ``draws`` were given.
    """
    left = dict(zip(top_ids, top_probs))  # best tokens not drawn yet
    chosen: list[int] = []
    taken = 0.0  # probability mass of the tokens drawn so far

    def from_row(exclude: list[int]) -> tuple[int, float] | None:
        """A token drawn from the whole row less ``exclude``, with its probability; None when nothing is left."""
        row = full_row().clone()
        if exclude:
            row[torch.tensor(exclude, dtype=torch.long, device=row.device)] = 0
        try:
            ids, weights = inverse_cdf(row, 1, generator)
        except ValueError:  # no mass left
            return None
        return ids[0], weights[0]

    if draws is not None and len(draws) < k:
        raise ValueError(f"{k} tokens to draw need {k} uniform draws, got {len(draws)}")
    draws = uniforms(generator, k).tolist() if draws is None else draws[:k]  # one transfer for the k draws
    for draw in draws:
        rest = 1.0 - taken
        pick = tail = None
        if rest > PRECISE_REST:
            u = draw * rest
            for t, p in left.items():
                u -= p
                if u < 0:
                    pick = t
                    break
            else:  # beyond the best tokens: a tail token, in proportion to q
                tail = from_row(top_ids + chosen)
                if tail is None and left:  # only float rounding put u there: the tail has no mass
                    pick = max(left, key=left.get)
        else:
            tail = from_row(chosen)
        if tail is not None:
            pick = tail[0]
        if pick is None:
            break
        p = left.pop(pick) if pick in left else tail[1]
        chosen.append(pick)
        taken += p
    return chosen


def draw_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` distinct tokens drawn from a whole distribution ``probs`` (``(vocab,)`` float32, e.g. the target's
    at the anchor for target-initialized roots) without replacement, in draw order. Fewer than ``k`` come back when
    fewer than ``k`` tokens have non-zero probability (top-k / top-p cut)."""
    vals, ids = torch.topk(probs, min(TOP_CACHED, probs.shape[-1]))
    kept = [(t, p) for t, p in zip(ids.tolist(), vals.tolist()) if p > 0]
    return sample_without_replacement([t for t, _ in kept], [p for _, p in kept], lambda: probs, k, generator)


def sample_with_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` i.i.d. draws from ``probs`` (``(vocab,)``)."""
    return inverse_cdf(probs, k, generator)[0]


def hub_pair(probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """SpecHub's drafting of two children (Sun et al. 2024): one of them is always the hub ``a = argmax q``.

    Draws ``y ~ q``; if ``y != a`` the pair is ``(y, a)``, else ``(a, i)`` with ``i ~ q`` restricted to non-hub
    tokens. So ``P(i, a) = q(i)`` and ``P(a, i) = q(a) q(i) / (1 - q(a))``, the sparse joint that
    ``verify.spechub_plan`` verifies. A q with a single token of support gives just ``[a]``.
    """
    a = int(probs.argmax())
    if int((probs > 0).sum()) < 2:
        return [a]
    y = sample_one(probs, generator)
    if y != a:
        return [y, a]
    rest = probs.clone()
    rest[a] = 0
    return [a, sample_one(rest / rest.sum(), generator)]


DRAFT_RULES = view(lambda v: v.draws)
"""How children are drawn for each verifier (``without``, ``with``, ``hub`` or ``greedy``): the drafting must match
what the verifier assumes. A read-only view of ``verify.registry``, where each verifier states it."""


def candidates(dists, row: int, k: int, *, verifier: str, generator: torch.Generator,
               draws: list[float] | None = None) -> list[int]:
    """Children (or roots) for one row of a ``sampling.RowDists``, drawn the way ``verifier`` expects. ``draws``:
    the row's uniform draws when the caller has them on the host (sampling without replacement only)."""
    rule = DRAFT_RULES[verifier]
    if rule == "greedy":
        return dists.top_ids(row, k)
    if rule == "with":
        return sample_with_replacement(dists[row], k, generator)
    if rule == "hub" and k == 2:
        return hub_pair(dists[row], generator)
    ids, probs = dists.top_processed(row)
    return sample_without_replacement(ids, probs, lambda: dists[row], k, generator, draws=draws)
