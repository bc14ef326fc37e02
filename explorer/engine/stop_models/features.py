"""Features of a drafted token, as the decision models of Lu et al. 2024 read them.

For a token ``x`` drafted from the draft's distribution ``q`` at its parent row:

* ``hidden``: the draft's last hidden state at the parent row (the row whose output ``q`` is), ``(hidden_size,)``;
* ``dist``: 11 numbers describing ``q`` itself: its entropy (nats) and its 10 largest probabilities, descending;
* ``depth`` of the token in the draft tree, and the cumulative path probability ``prod q`` of the tokens from the
  first drafted level down to ``x``;
* ``path``: ``dist`` plus ``log q(x)``, ``depth`` and ``log prod q`` (14 numbers). Lu et al.'s two models read
  ``hidden`` and ``dist``, which are the same for all children of one node, so siblings get one score; ``path``
  (beyond the paper) tells a tree's siblings apart.
* ``session`` (10 numbers), what the run so far says about x beyond the draft's own distribution:
  two n-gram match lengths against the committed context (``CopyIndex``): ``copy_len``, the longest n <= 8 such
  that the last n tokens of context + path *including* x occur in the context, and ``ctx_len``, the longest n such
  that the n tokens *before* x occur in the context followed by some token (``copy_len = ctx_len + 1``: x continues
  the longest earlier occurrence of what precedes it, what prompt lookup would propose); and eight from the target's
  own earlier verdicts (``TargetMemory``, Token Recycling's adjacency matrix used as evidence, filled from the
  prompt's rows of the target's prefill): ``target_rank``, 1 / rank of x among the target's top candidates the last
  time it scored x's parent token (0 when absent), and ``target_known``, whether it has scored that token yet; the
  same keyed by the two tokens before x (``bigram_rank``, ``bigram_known``), with the target's probability of x
  there (``bigram_logp``, log of it floored at 1e-4; 0 probability when absent or unknown) and its best
  candidate's (``bigram_top1``, 0 when unknown); and those two for the row of the parent token alone
  (``target_logp``, ``target_top1``).
* ``context``: ``path`` plus ``session`` (24 numbers).

``q`` here is the plain softmax of the draft's logits (temperature 1), whatever the sampling settings, so the same
model serves greedy and sampled decoding. Labels (``collect.py``): the soft label ``min(1, p(x)/q(x))`` with
both distributions at temperature 1, and the greedy label ``x == argmax p``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..sampling import plain_topk

N_TOP = 10
N_DIST_FEATURES = 1 + N_TOP
DIST_FEATURE_NAMES = ["entropy"] + [f"top{i + 1}" for i in range(N_TOP)]
PATH_FEATURE_NAMES = DIST_FEATURE_NAMES + ["log_q", "depth", "log_cum_q"]
SESSION_FEATURE_NAMES = ["copy_len", "ctx_len", "target_rank", "target_known", "bigram_rank", "bigram_known",
                         "bigram_logp", "bigram_top1", "target_logp", "target_top1"]
CONTEXT_FEATURE_NAMES = PATH_FEATURE_NAMES + SESSION_FEATURE_NAMES
MAX_COPY_NGRAM = 8
MEMORY_K = 8  # target candidates remembered per token
PROMPT_MEMORY_ROWS = 512  # the prompt's last rows whose target candidates prime the memory
LOGP_FLOOR = 1e-4


class NodeFeatures(NamedTuple):
    """What the drafter records for one drafted node (temperature-1 quantities, host or device tensors).

    hidden: ``(H,)`` the draft's last hidden state at the parent row (on the models' device), or None when not
    asked for; dist: ``(11,)`` (on the host: it comes with the draft level's best tokens); q: q(x) at temperature
    1; cum_q: prod q over the drafted path; session: the 10 ``session`` features (``SESSION_FEATURE_NAMES``).
    """

    hidden: object
    dist: torch.Tensor
    q: float
    cum_q: float
    session: tuple


class CopyIndex:
    """The n-grams (n <= ``MAX_COPY_NGRAM``) of a token sequence that are followed by another token, kept in
    step with the committed context as it grows (``sync``), to compute the ``copy`` features of drafted tokens.
    Only followed n-grams count, for both lengths: the context's own last n-gram is where the draft starts, not an
    earlier occurrence.
    """

    def __init__(self, n_max: int = MAX_COPY_NGRAM):
        self.n_max = n_max
        self.tokens: list[int] = []
        self.follow: set[tuple] = set()  # n-grams ending before the last token

    def sync(self, context) -> None:
        """Catch up with ``context`` (the committed tokens, a list or tuple); rebuilds when it is not an extension
        of the last one (a rewind, a new run)."""
        L = len(self.tokens)
        if len(context) < L or list(context[max(0, L - self.n_max):L]) != self.tokens[max(0, L - self.n_max):]:
            self.tokens, self.follow, L = [], set(), 0
        self.tokens = list(context)
        for end in range(max(0, L - 1), len(context) - 1):  # n-grams ending at `end` are followed by end + 1
            for n in range(1, min(self.n_max, end + 1) + 1):
                self.follow.add(tuple(context[end - n + 1:end + 1]))

    def features(self, path: list[int]) -> tuple[int, int]:
        """``(copy_len, ctx_len)`` of the last token of ``path`` (drafted tokens after the context, x last)."""
        s = self.tokens[-self.n_max:] + list(path)

        def longest(seq: list[int]) -> int:
            best = 0
            for n in range(1, min(self.n_max, len(seq)) + 1):
                if tuple(seq[-n:]) not in self.follow:
                    break  # a longer n-gram cannot occur (followed) where its own suffix does not
                best = n
            return best

        return longest(s), longest(s[:-1])


def dist_features(logits: torch.Tensor, lse: torch.Tensor | None = None,
                  top: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy and top-10 probabilities of ``softmax(logits)``.

    Args:
        logits: ``(rows, vocab)`` any float dtype.
        lse, top: optional, already computed: ``logsumexp`` of the rows ``(rows,)`` and their largest
            probabilities, descending ``(rows, >= 10)`` (the engine has both from ``RowDists.stats``).
    Returns:
        float32 ``(rows, 11)``: column 0 the entropy in nats, columns 1..10 the largest probabilities, descending.
    """
    lf = logits.float()
    if lse is None:
        lse = torch.logsumexp(lf, dim=-1)
    p = torch.exp(lf - lse[:, None])
    entropy = (lse - (p * lf).nansum(-1))[:, None]  # H = lse - sum p * logit; 0 * -inf counts as 0
    if top is None or top.shape[-1] < min(N_TOP, p.shape[-1]):
        top = p.topk(min(N_TOP, p.shape[-1]), dim=-1).values
    top = top[:, :N_TOP].float()
    if top.shape[-1] < N_TOP:
        top = torch.nn.functional.pad(top, (0, N_TOP - top.shape[-1]))
    return torch.cat([entropy, top], dim=-1)


def path_features(dist: torch.Tensor, q: torch.Tensor, depth: torch.Tensor, cum_q: torch.Tensor) -> torch.Tensor:
    """``dist`` ``(n, 11)`` plus ``log q(x)``, ``depth`` and ``log prod q`` of each token: float32 ``(n, 14)``.
    Probabilities are floored at 1e-12 before the log."""
    cols = [q.float().clamp_min(1e-12).log(), depth.float(), cum_q.float().clamp_min(1e-12).log()]
    return torch.cat([dist.float(), torch.stack(cols, dim=-1)], dim=-1)


class TargetMemory:
    """The target's top ``k`` next tokens after each token id and after each pair of tokens, from the latest
    verification (or the prompt's prefill) that scored them: the adjacency matrix of Token Recycling (Luo et al.
    2024), read here as evidence for the stop policy. Rows hold ``(id, plain probability)`` pairs, best first, keyed
    by the parent token (``rows``) and by (previous token, parent token) (``bigrams``)."""

    def __init__(self, k: int = MEMORY_K):
        self.k = k
        self.rows: dict[int, list[tuple[int, float]]] = {}
        self.bigrams: dict[tuple[int, int], list[tuple[int, float]]] = {}

    def update(self, keys: list[tuple[int, int]], candidates: list[list[tuple[int, float]]]) -> None:
        """Overwrite the rows of ``keys`` ((previous token, token); previous -1 at the sequence's start) with the
        target's candidates after them, ``(id, plain probability)`` best first (later entries win)."""
        for (prev, tok), c in zip(keys, candidates):
            c = [(int(t), float(p)) for t, p in c[: self.k]]
            self.rows[int(tok)] = c
            self.bigrams[(int(prev), int(tok))] = c

    def prime(self, tokens: list[int], first: int, candidates: list[list[tuple[int, float]]]) -> None:
        """Remember the target's candidates at positions ``first, first + 1, ...`` of ``tokens`` (the prompt's rows
        of its prefill: ``candidates[j]`` follows ``tokens[first + j]``)."""
        keys = [(tokens[i - 1] if i else -1, tokens[i]) for i in range(first, first + len(candidates))]
        self.update(keys, candidates)

    def copy(self) -> TargetMemory:
        out = TargetMemory(self.k)
        out.rows, out.bigrams = dict(self.rows), dict(self.bigrams)
        return out

    def features(self, prev_token: int, parent_token: int, token: int) -> tuple[float, ...]:
        """The eight target features of ``token`` drafted after ``prev_token, parent_token``, in
        ``SESSION_FEATURE_NAMES`` order: ``(target_rank, target_known, bigram_rank, bigram_known, bigram_logp,
        bigram_top1, target_logp, target_top1)``; ranks are 1 / rank (0 if absent)."""
        rank, known, logp, top1 = _row_features(self.rows.get(int(parent_token)), token)
        b_rank, b_known, b_logp, b_top1 = _row_features(self.bigrams.get((int(prev_token), int(parent_token))), token)
        return rank, known, b_rank, b_known, b_logp, b_top1, logp, top1


def _row_features(pairs: list[tuple[int, float]] | None, token: int) -> tuple[float, float, float, float]:
    """``(1 / rank, known, log p floored, top-1 p)`` of ``token`` in a memory row (all 0, log floor, when unknown)."""
    if pairs is None:
        return 0.0, 0.0, math.log(LOGP_FLOOR), 0.0
    for r, (t, p) in enumerate(pairs):
        if t == token:
            return 1.0 / (r + 1), 1.0, math.log(max(p, LOGP_FLOOR)), pairs[0][1]
    return 0.0, 1.0, math.log(LOGP_FLOOR), (pairs[0][1] if pairs else 0.0)


def top_candidates(hidden: torch.Tensor, lm_head, k: int = MEMORY_K, chunk: int = 64) -> list[list[tuple[int, float]]]:
    """Each row's ``k`` best tokens with their plain-softmax (temperature 1) probabilities, best first.

    Args:
        hidden: ``(rows, hidden_size)`` last hidden states (the prompt's rows of a prefill: up to
            ``PROMPT_MEMORY_ROWS``); lm_head: maps ``chunk`` rows of them to logits ``(chunk, vocab)`` (the model's lm
            head), so a long prompt never holds the logits of all its rows at once.
    Returns:
        one list of ``(token id, probability)`` per row, brought to the host in one transfer.
    """
    ids, probs = [], []
    for start in range(0, hidden.shape[0], chunk):
        idx, p = plain_topk(lm_head(hidden[start:start + chunk]), k)
        ids.append(idx)
        probs.append(p)
    if not ids:
        return []
    ids_t, probs_t = torch.cat(ids), torch.cat(probs)
    packed = torch.cat([ids_t.double(), probs_t.double()], 1).tolist()  # float64 holds every token id exactly
    w = ids_t.shape[1]
    return [[(int(t), p) for t, p in zip(line[:w], line[w:])] for line in packed]


def model_inputs(features: dict, nodes: list[int], depth: list[int], hidden: bool = False) -> dict:
    """Every decision model's inputs for ``nodes`` from the drafter's ``NodeFeatures`` (``features[node]``):
    ``{"dist": (n, 11), "path": (n, 14), "context": (n, 24)}`` float32 on the features' device, plus
    ``"hidden"`` ``(n, H)`` when asked for. ``depth``: each node's depth."""
    dist = torch.stack([features[i].dist for i in nodes]).float()
    at = dist.device
    # The host scalars of every node in one copy (each copy to a GPU is a host synchronisation).
    scalars = torch.tensor([[features[i].q, float(d), features[i].cum_q, *features[i].session]
                            for i, d in zip(nodes, depth)], device=at, dtype=torch.float64)
    path = path_features(dist, scalars[:, 0].float(), scalars[:, 1].long(), scalars[:, 2].float())
    session = scalars[:, 3:].float()
    out = {"dist": dist, "path": path, "context": torch.cat([path, session], dim=-1)}
    if hidden:
        out["hidden"] = torch.stack([features[i].hidden for i in nodes]).float()
    return out


def token_labels(tree, nodes: list[int], q1: list[float], p_rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels of drafted tokens from one verification: what every target forward gives for free.

    Args:
        tree: the step's ``DraftTree``; nodes: node indices to label; q1: each node's q(x) at temperature 1.
        p_rows: the verification's ``sampling.RowDists`` (row = parent node + 1; 0 = the anchor).
    Returns:
        ``(p, soft, greedy)``, each ``(len(nodes),)``: float32 p(x) at temperature 1, float32 ``min(1, p/q)``
        (0 where q is 0) and uint8 ``x == argmax p``. One log-softmax per distinct parent row.
    """
    logp_of: dict[int, torch.Tensor] = {}
    p, greedy = [], []
    for i in nodes:
        r = tree.parent[i] + 1
        if r not in logp_of:
            logp_of[r] = torch.log_softmax(p_rows.row_logits(r).float(), dim=-1)
        row, x = logp_of[r], tree.token[i]
        p.append(float(torch.exp(row[x])))
        greedy.append(int(int(torch.argmax(row)) == x))
    host = torch.device("cpu")  # labels are host data, wherever the models run
    p_t = torch.tensor(p, dtype=torch.float32, device=host)
    q_t = torch.tensor(q1, dtype=torch.float32, device=host)
    soft = torch.where(q_t > 0, torch.clamp(p_t / q_t.clamp_min(1e-30), max=1.0), torch.zeros_like(p_t))
    return p_t, soft, torch.tensor(greedy, dtype=torch.uint8, device=host)
