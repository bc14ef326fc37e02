"""Features of a drafted token, as the decision models of the seed paper read them.

For a token ``x`` drafted from the draft's distribution ``q`` at its parent row:

* ``hidden``: the draft's last hidden state at the parent row (the row whose output ``q`` is), ``(hidden_size,)``;
* ``dist``: 11 numbers describing ``q`` itself: its entropy (nats) and its 10 largest probabilities, descending;
* ``depth`` of the token in the draft tree, and the cumulative path probability ``prod q`` of the tokens from the
  first drafted level down to ``x`` (recorded for analysis; the two models read ``hidden`` and ``dist``).

``q`` here is the plain softmax of the draft's logits (temperature 1), whatever the sampling settings, so the same
model serves greedy and sampled decoding. Labels (``collect.py``): the soft label ``min(1, p(x)/q(x))`` with
both distributions at temperature 1, and the greedy label ``x == argmax p``.
"""

from __future__ import annotations

import torch

N_TOP = 10
N_DIST_FEATURES = 1 + N_TOP
DIST_FEATURE_NAMES = ["entropy"] + [f"top{i + 1}" for i in range(N_TOP)]


def dist_features(logits: torch.Tensor) -> torch.Tensor:
    """Entropy and top-10 probabilities of ``softmax(logits)``.

    Args:
        logits: ``(rows, vocab)`` any float dtype.
    Returns:
        float32 ``(rows, 11)``: column 0 the entropy in nats, columns 1..10 the largest probabilities, descending.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nan_to_num().sum(-1, keepdim=True)  # 0 * -inf counts as 0
    top = p.topk(min(N_TOP, p.shape[-1]), dim=-1).values
    if top.shape[-1] < N_TOP:
        top = torch.nn.functional.pad(top, (0, N_TOP - top.shape[-1]))
    return torch.cat([entropy, top], dim=-1)
