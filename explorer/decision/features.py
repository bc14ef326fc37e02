"""Features of a drafted token, as the decision models of the seed paper read them.

For a token ``x`` drafted from the draft's distribution ``q`` at its parent row:

* ``hidden``: the draft's last hidden state at the parent row (the row whose output ``q`` is), ``(hidden_size,)``;
* ``dist``: 11 numbers describing ``q`` itself: its entropy (nats) and its 10 largest probabilities, descending;
* ``depth`` of the token in the draft tree, and the cumulative path probability ``prod q`` of the tokens from the
  first drafted level down to ``x``;
* ``path``: ``dist`` plus ``log q(x)``, ``depth`` and ``log prod q`` (14 numbers). The seed's two models read
  ``hidden`` and ``dist``, which are the same for all children of one node, so siblings get one score; ``path``
  (beyond the seed) tells a tree's siblings apart.

``q`` here is the plain softmax of the draft's logits (temperature 1), whatever the sampling settings, so the same
model serves greedy and sampled decoding. Labels (``collect.py``): the soft label ``min(1, p(x)/q(x))`` with
both distributions at temperature 1, and the greedy label ``x == argmax p``.
"""

from __future__ import annotations

import torch

N_TOP = 10
N_DIST_FEATURES = 1 + N_TOP
DIST_FEATURE_NAMES = ["entropy"] + [f"top{i + 1}" for i in range(N_TOP)]
PATH_FEATURE_NAMES = DIST_FEATURE_NAMES + ["log_q", "depth", "log_cum_q"]


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
    p_t = torch.tensor(p, dtype=torch.float32)
    q_t = torch.tensor(q1, dtype=torch.float32)
    soft = torch.where(q_t > 0, torch.clamp(p_t / q_t.clamp_min(1e-30), max=1.0), torch.zeros_like(p_t))
    return p_t, soft, torch.tensor(greedy, dtype=torch.uint8)
