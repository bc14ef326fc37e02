"""How candidate tokens are chosen for a node: the children of a tree node, or the target-initialized roots.

Every function takes one distribution and returns token ids, using the engine's ``torch.Generator`` so that the
same seed gives the same tree.

* Greedy (temperature 0): the top-k tokens of the raw logits (ties broken by index), as in greedy MCSD.
* Without replacement: the Gumbel-top-k trick (Kool et al. 2019): ``topk(log q + Gumbel)`` draws k distinct tokens
  with exactly the law of sequential sampling without replacement, which the MCSD verifier assumes.
* With replacement: k i.i.d. draws from q (SpecInfer's setting; duplicates allowed).
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
    support = int((probs > 0).sum())
    k = min(k, support)
    u = torch.rand(probs.shape, generator=generator, device=probs.device).clamp_(min=1e-20)
    keys = probs.log() - (-u.log()).log()
    return torch.topk(keys, k).indices.tolist()


def sample_with_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """``k`` i.i.d. draws from ``probs`` (``(vocab,)``)."""
    return torch.multinomial(probs, k, replacement=True, generator=generator).tolist()


def sample_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (``(vocab,)``); the argmax when ``probs`` is one-hot."""
    return int(torch.multinomial(probs, 1, generator=generator))


def candidates(dists, row: int, k: int, *, greedy: bool, replacement: bool, generator: torch.Generator) -> list[int]:
    """Children (or roots) for one row of a ``sampling.RowDists``: the rule chosen by the decoding mode."""
    if greedy:
        return greedy_candidates(dists.row_logits(row), k)
    if replacement:
        return sample_with_replacement(dists[row], k, generator)
    return gumbel_top_k(dists[row], k, generator)
