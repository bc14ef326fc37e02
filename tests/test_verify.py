import pytest
import torch

from explorer.engine.drafting import hub_pair
from explorer.engine.tree import DraftTree
from explorer.engine.verify.rules import VerifierError, spechub_node, spechub_plan, verify_longest_branch, verify_tree

V = 6


def onehot(i):
    t = torch.zeros(V)
    t[i] = 1.0
    return t


def two_level_tree():
    tree = DraftTree()
    tree.add_level([-1, -1], [1, 2])  # nodes 0, 1
    tree.add_level([0, 1], [3, 4])  # nodes 2 (under 0), 3 (under 1)
    return tree


def test_greedy_follows_argmax_and_takes_bonus():
    tree = two_level_tree()
    # anchor prefers token 2 (node 1); node 1 prefers 4 (node 3); node 3 prefers 5 -> bonus
    p = torch.stack([onehot(2), onehot(0), onehot(4), onehot(0), onehot(5)])
    r = verify_tree(tree, p, {}, None, rule="greedy")
    assert r.path == [1, 3] and r.bonus == 5 and r.chosen_branch == 1
    assert r.decisions[0].accepted is False and r.decisions[1].accepted is True
    assert r.branch_accepted == {0: 0, 1: 2}


def test_greedy_rejects_all_children():
    tree = two_level_tree()
    p = torch.stack([onehot(5)] * 5)
    r = verify_tree(tree, p, {}, None, rule="greedy")
    assert r.path == [] and r.bonus == 5 and r.chosen_branch is None


def test_rrs_accepts_everything_when_p_equals_q():
    tree = two_level_tree()
    dist = torch.full((V,), 1.0 / V)
    p = torch.stack([dist] * 5)
    q = {0: dist, 1: dist, 2: dist}
    g = torch.Generator().manual_seed(0)
    r = verify_tree(tree, p, q, g, rule="rrs")
    assert r.path == [0, 2]  # first child always accepted (ratio 1)
    assert r.decisions[0].ratio == 1.0


def _rrs_on_two_siblings(p_anchor, below=(0, 0), seed=0):
    """RRS on the anchor's children, tokens 1 and 2, drafted from q half on each; p is ``p_anchor`` at the anchor
    and one-hot on ``below`` at the two children."""
    tree = DraftTree()
    tree.add_level([-1, -1], [1, 2])
    q_anchor = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    p = torch.stack([p_anchor, onehot(below[0]), onehot(below[1])])
    return verify_tree(tree, p, {0: q_anchor}, torch.Generator().manual_seed(seed), rule="rrs")


def test_rrs_rejection_uses_residual_and_removes_the_drafted_token():
    r = _rrs_on_two_siblings(torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]))  # target wants token 3 only
    assert r.path == [] and r.bonus == 3
    assert all(not d.accepted and d.ratio == 0.0 for d in r.decisions.values())
    assert r.decisions[0].residual_top[0][0] == 3


def test_a_sibling_rejected_before_an_accepted_one_keeps_its_residual_in_the_trace():
    """p puts all its mass on token 2, q half on 1 and 2: child 0 (token 1) has ratio 0 and is rejected, the
    residual left is all on token 2, and child 1 (token 2) then passes (q without token 1 is all on 2: ratio 1).
    The rejected sibling's decision shows what its rejection left, though the walk went on below the other."""
    r = _rrs_on_two_siblings(torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]), below=(0, 4))
    assert r.path == [1] and r.bonus == 4
    assert not r.decisions[0].accepted and r.decisions[0].residual_top == [(2, 1.0)]
    assert r.decisions[1].accepted and r.decisions[1].ratio == 1.0 and r.decisions[1].residual_top == []


def test_rrs_without_replacement_second_sibling_faces_renormalised_q():
    # q = (0.5, 0.5) on tokens 1, 2; p = (0.5 on 1, 0.5 on 2): child 1 (token 1) accepted w.p. 1
    r = _rrs_on_two_siblings(torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0]), seed=1)
    assert r.path == [0]


def test_longest_branch_commits_the_longest_accepted_branch():
    tree = DraftTree()
    tree.add_level([-1, -1], [1, 2], source="target")  # roots 0, 1
    tree.add_level([0, 1], [3, 4])  # 2 under root 0, 3 under root 1
    # greedy: root 0's child (3) is rejected (target wants 5), root 1's child (4) accepted
    p = torch.stack([onehot(1), onehot(5), onehot(4), onehot(0), onehot(0)])
    r = verify_longest_branch(tree, p, {}, None, greedy=True)
    assert r.path == [1, 3] and r.bonus is None and r.chosen_branch == 1
    assert r.branch_accepted == {0: 0, 1: 1}
    assert int(r.next_dist.argmax()) == 0 and r.next_row == 4


def test_mcns_emits_the_target_sample():
    tree = DraftTree()
    tree.add_level([-1, -1], [1, 2])
    p = torch.stack([onehot(2), onehot(0), onehot(4)])
    r = verify_tree(tree, p, {0: torch.full((V,), 1 / V)}, torch.Generator().manual_seed(0), rule="mcns")
    assert r.path == [1] and r.bonus == 4
    p = torch.stack([onehot(5), onehot(0), onehot(0)])
    r = verify_tree(tree, p, {0: torch.full((V,), 1 / V)}, torch.Generator().manual_seed(0), rule="mcns")
    assert r.path == [] and r.bonus == 5


def test_hub_pair_always_contains_the_hub_and_matches_its_joint():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = {}
    n = 20000
    for _ in range(n):
        pair = tuple(hub_pair(q, g))
        assert 0 in pair and len(set(pair)) == 2
        counts[pair] = counts.get(pair, 0) + 1
    # P(i, a) = q(i); P(a, i) = q(a) q(i) / (1 - q(a))
    expected = {(1, 0): 0.3, (2, 0): 0.2, (0, 1): 0.5 * 0.3 / 0.5, (0, 2): 0.5 * 0.2 / 0.5}
    for pair, prob in expected.items():
        assert abs(counts.get(pair, 0) / n - prob) < 0.015
    assert hub_pair(torch.tensor([0.0, 1.0, 0, 0, 0, 0]), g) == [1]


@pytest.mark.parametrize("seed", range(5))
def test_spechub_plan_is_exactly_lossless(seed):
    """Sum over the drafting law of P(accept each token) plus P(reject) * residual equals p, token by token."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 3
    p /= p.sum()
    q = torch.rand(V, generator=g) ** 3
    q /= q.sum()
    plan = spechub_plan(p, q)
    a = plan["hub"]
    out = torch.zeros(V, dtype=torch.float64)
    reject = 0.0
    qa = float(q[a])
    for i in range(V):
        if i == a:
            continue
        for prob, alpha, beta in ((float(q[i]), float(plan["alpha1"][i]), plan["beta1"]),
                                  (qa * float(q[i]) / (1 - qa), float(plan["alpha2"][i]), plan["beta2"])):
            out[i] += prob * alpha
            out[a] += prob * (1 - alpha) * beta
            reject += prob * (1 - alpha) * (1 - beta)
    residual = plan["residual"].double()
    assert abs(float(residual.sum()) - reject) < 1e-5
    out += reject * residual / residual.sum()
    assert torch.allclose(out, p.double(), atol=1e-5)


def test_spechub_node_needs_its_hub_drafting():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
    p = torch.full((V,), 1 / V)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(VerifierError, match="hub"):
        spechub_node([1, 2], p, q, g)
    with pytest.raises(VerifierError, match="two drafts"):
        spechub_node([1, 2, 0], p, q, g)
    idx, dist, decisions = spechub_node([1, 0], p, q, g)
    assert set(decisions) <= {0, 1}
