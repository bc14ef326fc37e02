"""Prompt lookup decoding: copy what followed earlier occurrences of the last n-gram (Saxena 2023; transformers'
``prompt_lookup_num_tokens``). No model, no training: it wins where the output repeats the prompt or itself (code
edits, quoting, extraction) and proposes nothing elsewhere.

Two changes to transformers' lookup (the first match of the longest n-gram, one chain of a fixed length), both
measured on the embedded pair (docs/bench.md):

* several matches become branches: the most recent occurrences first, longest n-gram first, distinct
  continuations only; shared prefixes merge into one trie when the branches join the tree (``base.merge_free``);
* the copy length adapts (for the best match; runner-ups copy at most ``START_TOKENS``): it starts at
  ``START_TOKENS``, doubles (up to ``lookup_tokens``) after a step that
  accepted a whole branch, and otherwise halves, or falls back to what the last step accepted plus one when that
  is longer (at least ``START_TOKENS``). Long copies are
  where lookup shines (a docstring copied whole), and a long failed branch costs target rows on every step; on the
  CPU the tree's rows are capped where the next row gets dear (``MethodConfig.free_rows``, ``base.merge_free``),
  except on a copy run: after a step that committed its whole best branch, a best branch longer than the cap goes
  alone into the next block of rows (``row_budget``, ``config.FREE_ROWS_CPU_RUN``).

The length depends only on earlier steps' outcomes, so the proposals stay a function of the history: lossless.
"""

from __future__ import annotations

from .base import Drafter, FreeNode

START_TOKENS = 16
"""Copy length of the first step and the floor after a miss (``lookup_tokens`` caps the doubling). 16, not 8: on
the CPU a target row below the 32-row edge costs about 1 ms of a 200 ms forward (``config.FREE_ROWS_CPU``), and on
HumanEval 0-2 (greedy) starting at 16 gave 7.08 tokens per target call against 6.43 (1.26x against 1.16x
transformers' lookup in the same run), MT-bench 0-2 1.00x against 1.04x (lookup rarely matches there;
docs/bench.md, "Prompt lookup: branches and copy length")."""


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
    """Free branches copied from earlier in the prompt and output (``lookup`` nodes).

    Args:
        max_ngram: longest n-gram matched. max_tokens: cap of the adaptive copy length. branches: continuations.
    """

    name = "lookup"

    def __init__(self, max_ngram: int, max_tokens: int, branches: int):
        self.max_ngram, self.max_tokens, self.branches = max_ngram, max_tokens, branches
        self.rewind()

    def rewind(self) -> None:
        self.length = min(START_TOKENS, self.max_tokens)
        self.proposed: list[list[int]] = []  # this step's continuations, for observe()
        self.last_hit = 0  # tokens of the best continuation the last step committed
        self.copy_run = False  # the last step committed the whole best branch
        self.long_copy = False  # this step's best branch may pass the row edge (``row_budget``)
        self.best_ngram = 0  # n-gram length of this step's best match (0: none)

    def free_nodes(self, view) -> list[FreeNode]:
        """The step's lookup chains as FreeNodes (each chain's nodes in order, hanging from the anchor)."""
        nodes: list[FreeNode] = []
        found = lookup_continuations(view.committed, self.max_ngram, self.length, self.branches)
        # only the best match gets the long copy: every row costs target time, and runner-up matches rarely run long
        found = [(tokens if j == 0 else tokens[:START_TOKENS], start, n) for j, (tokens, start, n) in enumerate(found)]
        # a copy run whose best branch is longer than the usual budget holds may take it past the row edge, alone
        # (only where the run's budget is larger: the CPU's auto budget; a hand-set or absent one is the same)
        self.long_copy = (self.copy_run and bool(found) and view.free_rows_run != view.free_rows
                          and len(found[0][0]) > view.free_rows)
        if self.long_copy:
            found = found[:1]
        self.proposed = [tokens for tokens, _, _ in found]
        self.best_ngram = found[0][2] if found else 0
        for tokens, start, n in found:
            parent = -1
            for j, t in enumerate(tokens):
                nodes.append(FreeNode(parent, t, "lookup", {"source": "lookup", "copied_from": start + j, "ngram": n,
                                                            "match_at": start - n,
                                                            "in_prompt": start + j < view.n_prompt}))
                parent = len(nodes) - 1
        return nodes

    def withdraw(self) -> None:
        """Propose nothing this step after all (a hybrid drops a match too short to trust): ``observe`` then leaves
        the copy length as it was."""
        self.proposed, self.long_copy, self.best_ngram = [], False, 0

    def row_budget(self, view) -> int | None:
        """``view.free_rows_run`` when this step's ``free_nodes`` made a long copy (a copy run, the last step
        having committed its whole best branch, with a best branch longer than ``view.free_rows``), else
        ``view.free_rows``."""
        return view.free_rows_run if self.long_copy else view.free_rows

    def info(self, view) -> dict:
        return {"lookup_length": self.length, "lookup_branches": len(self.proposed), "long_copy": self.long_copy}

    def observe(self, step) -> None:
        """Adapt the copy length to how much of the best continuation the step committed."""
        drafted, result = step.drafted, step.verified.result
        new = [drafted.tree.token[i] for i in result.path] + ([result.bonus] if result.bonus is not None else [])
        hits = [next((j for j, (a, b) in enumerate(zip(c, new)) if a != b), min(len(c), len(new)))
                for c in self.proposed]
        self.last_hit = max(hits, default=0)
        self.copy_run = bool(hits) and hits[0] == len(self.proposed[0])
        if not self.proposed:
            return
        whole = any(h == len(c) for h, c in zip(hits, self.proposed))
        self.length = (min(self.max_tokens, 2 * self.length) if whole
                       else max(START_TOKENS, self.last_hit + 1, self.length // 2))
