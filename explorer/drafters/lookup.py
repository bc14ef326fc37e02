"""Prompt lookup decoding: copy what followed earlier occurrences of the last n-gram (Saxena 2023; transformers'
``prompt_lookup_num_tokens``). No model, no training: it wins where the output repeats the prompt or itself (code
edits, quoting, extraction) and proposes nothing elsewhere.

Unlike transformers' lookup (the first match of the longest n-gram, one chain), several matches become branches:
the most recent occurrences first, longest n-gram first, distinct continuations only; shared prefixes merge into
one trie when the branches join the tree (``base.merge_free``).
"""

from __future__ import annotations

from ..tree import DraftTree
from .base import Drafted, Drafter, FreeNode, merge_free


def lookup_continuations(context: list[int], max_ngram: int, n_tokens: int, branches: int) -> list[tuple]:
    """Continuations of the last n-gram's earlier occurrences in ``context`` (token ids).

    For n from ``max_ngram`` down to 1, occurrences of ``context[-n:]`` are scanned from the most recent back; each
    gives the up to ``n_tokens`` tokens after it. Continuations already found (or prefixes of one) are skipped.

    Returns:
        up to ``branches`` tuples ``(tokens, start, n)``: the proposed tokens, the position in ``context`` of the
        first copied token, and the n-gram length that matched.
    """
    out: list[tuple] = []
    L = len(context)
    for n in range(min(max_ngram, L - 1), 0, -1):
        pattern = context[L - n:]
        last = pattern[-1]
        for end in range(L - 2, n - 2, -1):  # end: index of the occurrence's last token (not the suffix itself)
            if context[end] != last or context[end - n + 1: end + 1] != pattern:
                continue
            cont = context[end + 1: end + 1 + n_tokens]
            if not cont or any(c[0][: len(cont)] == cont for c in out):
                continue
            out.append((cont, end + 1, n))
            if len(out) >= branches:
                return out
    return out


class LookupDrafter(Drafter):
    """Free branches copied from earlier in the prompt and output (``lookup`` nodes)."""

    name = "lookup"

    def __init__(self, max_ngram: int, n_tokens: int, branches: int):
        self.max_ngram, self.n_tokens, self.branches = max_ngram, n_tokens, branches

    def free_nodes(self, engine) -> list[FreeNode]:
        """The step's lookup chains as FreeNodes (each chain's nodes in order, hanging from the anchor)."""
        nodes: list[FreeNode] = []
        for tokens, start, n in lookup_continuations(engine.committed, self.max_ngram, self.n_tokens, self.branches):
            parent = -1
            for j, t in enumerate(tokens):
                nodes.append(FreeNode(parent, t, "lookup", {"source": "lookup", "copied_from": start + j, "ngram": n,
                                                            "in_prompt": start + j < engine.n_prompt}))
                parent = len(nodes) - 1
        return nodes

    def draft(self, engine) -> Drafted:
        return merge_free(Drafted(DraftTree(), head=len(engine.committed)), self.free_nodes(engine))
