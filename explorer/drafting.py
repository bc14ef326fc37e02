"""How candidate tokens are chosen for a node: the children of a tree node, or the target-initialized roots.

Every function takes one distribution and returns token ids, using the engine's ``torch.Generator`` so that the
same seed gives the same tree.

* Greedy (temperature 0): the top-k tokens of the raw logits (ties broken by index), as in greedy MCSD.
* Without replacement: the Gumbel-top-k trick (Kool et al. 2019): ``topk(log q + Gumbel)`` draws k distinct tokens
  with exactly the law of sequential sampling without replacement, which the MCSD verifier assumes.
* With replacement: k i.i.d. draws from q (SpecInfer's setting; duplicates allowed).
* Hub pairs: SpecHub's two children, one of them the draft's argmax (``hub_pair``).
"""

from __future__ import annotations

import torch


def greedy_candidates(logits: torch.Tensor, k: int) -> list[int]:
    """Top-``k`` token ids of ``logits`` (``(vocab,)``), best first."""
    return torch.topk(logits.float(), k).indices.tolist()


def gumbel_top_k(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` distinct tokens drawn from ``probs`` (``(vocab,)`` float32) without replacement, in draw order.

    Fewer than ``k`` come back when fewer than ``k`` tokens have non-zero probability (top-k / top-p cut).
    """
    u = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(min=1e-20)
    # topk of p / E with E = -log u ~ Exp(1) is topk of log p + Gumbel (log of it), in fewer passes over the
    # vocabulary; tokens with p = 0 get key 0 and are cut below.
    keys = probs / u.log_().neg_()
    vals, ids = torch.topk(keys, k)
    return [int(i) for i, v in zip(ids.tolist(), vals.tolist()) if v > 0]


def sample_with_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` i.i.d. draws from ``probs`` (``(vocab,)``)."""
    return torch.multinomial(probs, k, replacement=True, generator=generator).tolist()


def sample_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (``(vocab,)``); the argmax when ``probs`` is one-hot."""
    return int(torch.multinomial(probs, 1, generator=generator))


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


DRAFT_RULES = {"rrs": "without", "mcns": "without", "longest-branch": "without", "rrs-replacement": "with",
               "spechub": "hub", "greedy": "greedy"}
"""How children are drawn for each verifier: the drafting must match what the verifier assumes."""


def candidates(dists, row: int, k: int, *, verifier: str, generator: torch.Generator) -> list[int]:
    """Children (or roots) for one row of a ``sampling.RowDists``, drawn the way ``verifier`` expects."""
    rule = DRAFT_RULES[verifier]
    if rule == "greedy":
        return dists.top_ids(row, k)
    if rule == "with":
        return sample_with_replacement(dists[row], k, generator)
    if rule == "hub" and k == 2:
        return hub_pair(dists[row], generator)
    return gumbel_top_k(dists[row], k, generator)
