"""RSD-S (Jeon et al. 2024, arXiv 2402.14160) as the method ``rsd-s``: a draft tree grown by stochastic beam
search over the draft's sequence probabilities (Kool et al. 2019), verified by recursive rejection sampling without
replacement (``rrs``).

Each level keeps the ``W`` best (node, token) pairs by Gumbel keys conditioned on their parent's key: a child's
unconditioned key is ``phi + g`` (``phi`` the log-probability of its whole path under the processed q, ``g`` a
standard Gumbel draw from the run's generator), and the children of one node are shifted so that their maximum is the
parent's key (the stable form of Kool et al.: ``u = T - G + log1p(-exp(G - Z))``, ``key = T - relu(u) -
log1p(exp(-|u|))``, ``T`` the parent's key, ``Z`` the children's maximum). Within one node the shift keeps the order,
so a node's children are a prefix of its Gumbel-top-k order, the law of drawing without replacement: verified in
that draw order (descending key) by ``rrs``, each rejected sibling removed from q, the method is lossless although
nodes get different numbers of children. Re-sorting siblings by q instead is lossy (``SORTED_BY_Q``, which the tests
audit). Greedy (temperature 0), the keys are the paths' log-probabilities: a plain beam search.

The tree's settings are ``k_config = (W, 1, ..., 1)`` with ``L`` levels (``--beam W --depth L`` on the command
line): ``W * L`` nodes at most, the size of the ``mcsd`` tree of the same ``k_config``. RSD-C, the constant-branching
tree of the same paper, is the project's ``mcsd`` with ``rrs``.
"""

from __future__ import annotations

import torch

from explorer.engine.parts import EngineError
from explorer.engine.sampling import LazyRows, RowDists
from explorer.engine.tree import DraftTree, step_mask, step_position_ids
from explorer.plugins import Drafted, ModelDrafter, register_method

TOP_SHOWN = 8


def shifted_keys(perturbed: torch.Tensor, parent_key: torch.Tensor) -> torch.Tensor:
    """Keys ``(n, V)`` of each row's children conditioned on their maximum being the row's ``parent_key`` ``(n,)``
    (Kool et al. 2019, the stable form); ``-inf`` stays ``-inf``."""
    z = perturbed.max(dim=-1, keepdim=True).values
    t = parent_key[:, None]
    u = t - perturbed + torch.log1p(-torch.exp(torch.clamp(perturbed - z, max=0.0)))
    keys = t - torch.relu(u) - torch.log1p(torch.exp(-u.abs()))
    return torch.where(torch.isfinite(perturbed), keys, torch.full_like(keys, float("-inf")))


class RSDSDrafter(ModelDrafter):
    """RSD-S's stochastic beam tree (module docstring): ``W`` nodes a level, ``L`` levels, children in draw order."""

    name = "rsd-s"
    sort_by_q = False  # re-sort each node's children by q (lossy; the tests' control)

    def draft(self, view) -> Drafted:
        if not view.sampling.greedy and view.verifier_name != "rrs":
            raise EngineError(f"rsd-s draws each node's children without replacement in key order, which only rrs "
                              f"verifies; {view.verifier_name} would not be lossless: use --verifier auto or rrs")
        shape = list(view.branching)
        beam, depth = shape[0], min(len(shape), view.reach.max_depth)
        sampling, gen = view.sampling, view.generator
        committed = list(view.committed)
        uncached = committed[view.draft.cache.length:]
        past = len(committed) - len(uncached)
        tree, q_rows, q_show, q_top = DraftTree(), LazyRows(), {}, {}
        rows_of: dict[int, int] = {}
        frontier = [-1]  # the level's nodes (-1: the anchor)
        phi = torch.zeros(1, device=gen.device, dtype=torch.float64)  # their paths' log-probabilities
        key = torch.zeros(1, device=gen.device, dtype=torch.float64)  # their conditioned Gumbel keys
        calls, next_row = 0, 0
        keys_of: dict[int, float] = {}
        for level in range(depth):
            start, stop = (tree.level_starts[level - 1], tree.level_starts[level]) if level else (0, 0)
            first = calls == 0
            ids = (uncached if first else []) + tree.token[start:stop]
            mask = None if (first and level == 0) else step_mask(past, len(uncached), first, tree.anc, start, stop)
            pos = step_position_ids(past, len(uncached), first, tree.depth, start, stop)
            fwd = view.draft.forward(ids, pos, mask, keep=max(stop - start, 1))
            calls += 1
            rows_of.update({node: next_row + c for c, node in enumerate(range(start, stop))})
            next_row += stop - start
            qd = RowDists(fwd.logits, sampling)
            rows = list(range(len(frontier)))
            for r, node in zip(rows, frontier):
                q_top[node + 1] = qd.top([r], TOP_SHOWN)[r]
                if not sampling.greedy:
                    q_rows.add(node + 1, qd, r)
            live = [r for r, node in zip(rows, frontier) if node < 0 or tree.token[node] not in view.reach.ends]
            if not live:
                break
            logq = torch.log(torch.stack([qd[r] for r in live]).double())  # (n, V), -inf off q's support
            paths = phi[live][:, None] + logq
            if sampling.greedy:
                keys = paths
            else:
                gumbel = -torch.log(-torch.log(torch.rand(paths.shape, generator=gen, device=gen.device,
                                                          dtype=torch.float64).clamp_min(1e-300)))
                keys = shifted_keys(paths + gumbel, key[live])
            take = min(beam, int(torch.isfinite(keys).sum()))  # the beam capped at q's support
            if take == 0:
                break
            best = torch.topk(keys.flatten(), take)
            vocab = keys.shape[1]
            chosen = sorted(((live[int(i) // vocab], int(i) % vocab, float(k)) for i, k in
                             zip(best.indices.tolist(), best.values.tolist())),
                            key=lambda c: (c[0], -c[2]))  # by parent, then draw order (descending key)
            if self.sort_by_q:
                chosen.sort(key=lambda c: (c[0], -float(logq[live.index(c[0]), c[1]])))
            parents = [frontier[r] for r, _, _ in chosen]
            tokens = [t for _, t, _ in chosen]
            new = tree.add_level(parents, tokens, source="draft")
            for i, (r, t, k) in zip(new, chosen):
                q_show[i] = qd.shown(r, t)
                keys_of[i] = round(k, 4)
            phi = torch.stack([paths[live.index(r), t] for r, t, _ in chosen])
            key = torch.tensor([k for _, _, k in chosen], device=gen.device, dtype=torch.float64)
            frontier = list(new)
        return Drafted(tree, q_rows=q_rows, q_show=q_show, calls=calls, draft_rows=rows_of,
                       tree_start=past + len(uncached), q_top=q_top,
                       provenance={i: {"source": "draft", "gumbel_key": k} for i, k in keys_of.items()},
                       info={"rsd": {"beam": beam, "depth": depth}})


register_method("rsd-s", RSDSDrafter, label="RSD-S (stochastic beam tree)", model_tree="tree",
                summary="a tree grown by stochastic beam search over the draft's sequence probabilities, W nodes a "
                        "level, verified by RRS without replacement in draw order",
                defaults={"k_config": (4, 1, 1, 1)})
