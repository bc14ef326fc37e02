import json
import math

import numpy as np
import pytest

from explorer.instruments.optimal_tree import (OptimalTree, OptimalTreeError, as_k_config, cost_curve, expected_tokens,
                                               fastest_tree, node_probabilities, optimal_tree, optimal_trees,
                                               step_cost_ms, summary)

FLAT = [[0.6, 0.2, 0.1]]
BY_DEPTH = [[0.8, 0.3, 0.15, 0.05], [0.5, 0.2], [0.3, 0.25, 0.2]]  # depth >= 3 reuses the last row
INVERTED = [[0.1, 0.7, 0.0, 0.4], [0.45, 0.0, 0.9]]  # later ranks beating earlier ones; ranks never accepted
TABLES = {"flat": FLAT, "by_depth": BY_DEPTH, "inverted": INVERTED}


# ------------------------------------------------------------------ an independent model: nested trees, DFS order


def forests(n):
    """Every ordered forest (children in rank order) of exactly ``n`` nodes; a node is the tuple of its children."""
    if n == 0:
        return [()]
    out = []
    for first in range(1, n + 1):  # nodes in the first tree
        for below in forests(first - 1):
            for rest in forests(n - first):
                out.append((below, *rest))
    return out


def nested_value(forest, table, depth=1):
    """Expected accepted nodes below an accepted node, straight from the walk's definition."""
    row = table[min(depth, len(table)) - 1]
    total, rejected = 0.0, 1.0
    for rank, child in enumerate(forest):
        a = row[rank] if rank < len(row) else 0.0
        total += rejected * a * (1.0 + nested_value(child, table, depth + 1))
        rejected *= 1.0 - a
    return total


def nested_depth(forest):
    return max((1 + nested_depth(child) for child in forest), default=0)


def dfs_parents(forest, parent=-1, out=None):
    """Depth-first (not breadth-first) parents: exercises 'parents precede children' ordering."""
    out = [] if out is None else out
    for child in forest:
        out.append(parent)
        dfs_parents(child, len(out) - 1, out)
    return out


ALL_FORESTS = [f for n in range(8) for f in forests(n)]


def test_forest_enumeration_counts_are_catalan():
    assert [len(forests(n)) for n in range(8)] == [1, 1, 2, 5, 14, 42, 132, 429]


@pytest.mark.parametrize("name", TABLES)
def test_expected_tokens_matches_the_walk_definition_for_every_small_tree(name):
    table = TABLES[name]
    for forest in ALL_FORESTS:
        assert expected_tokens(dfs_parents(forest), table) == pytest.approx(1.0 + nested_value(forest, table),
                                                                            abs=1e-12)


@pytest.mark.parametrize("name", TABLES)
def test_optimal_tree_equals_brute_force_for_every_budget_and_depth(name):
    table = TABLES[name]
    scored = [(1.0 + nested_value(f, table), len(dfs_parents(f)), nested_depth(f)) for f in ALL_FORESTS]
    table_of_all = optimal_trees(table, 7, 7)
    for budget in range(8):
        for depth in range(1, 8):
            fits = [(v, n) for v, n, d in scored if n <= budget and d <= depth]
            best = max(v for v, _ in fits)
            fewest = min(n for v, n in fits if v >= best - 1e-12)
            tree = optimal_tree(table, budget, depth)
            assert tree.expected_tokens == pytest.approx(best, abs=1e-9), (budget, depth)
            assert expected_tokens(tree.parents, table) == pytest.approx(tree.expected_tokens, abs=1e-12)
            assert tree.nodes == fewest <= budget
            assert tree.depth <= depth
            assert table_of_all[(budget, depth)] == tree


def test_optimal_tree_is_breadth_first_with_consistent_fields():
    tree = optimal_tree(BY_DEPTH, 12, 4)
    depths = []
    for p in tree.parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    assert depths == sorted(depths)  # level by level
    assert [p for p in tree.parents if p >= 0] == sorted(p for p in tree.parents if p >= 0)  # siblings contiguous
    assert tree.level_widths == tuple(depths.count(d) for d in range(1, tree.depth + 1))
    assert tree.depth == max(depths)
    assert list(tree.node_probabilities) == pytest.approx(node_probabilities(tree.parents, BY_DEPTH), abs=1e-15)
    # Each child's probability never exceeds its parent's: the walk must pass through the parent.
    assert all(tree.node_probabilities[i] <= tree.node_probabilities[p] for i, p in enumerate(tree.parents) if p >= 0)


def test_inverted_ranks_keep_a_zero_node_only_to_reach_a_better_rank():
    # Rank 0 is never accepted, rank 1 always: one node is worthless, two give a sure extra token.
    table = [[0.0, 1.0]]
    assert optimal_tree(table, 1).parents == ()
    assert optimal_tree(table, 1).expected_tokens == 1.0
    two = optimal_tree(table, 2, 1)
    assert two.parents == (-1, -1)
    assert two.expected_tokens == 2.0
    assert two.node_probabilities == (0.0, 1.0)


def test_no_useless_nodes():
    assert optimal_tree([[1.0, 0.5]], 3, 1).parents == (-1,)  # rank 1 is never tested after a sure rank 0
    assert optimal_tree([[0.5], [0.0]], 5).parents == (-1,)  # nothing below depth 1 is ever accepted
    assert optimal_tree([[0.0]], 5).nodes == 0
    # One node left after rank 0: a worthless rank 1 would not reach rank 2, so it is left out.
    assert optimal_tree([[0.5, 0.0, 0.5]], 2, 1).parents == (-1,)
    assert optimal_tree([[0.5, 0.0, 0.5]], 3, 1).parents == (-1, -1, -1)


def test_empty_budget_gives_the_empty_tree():
    tree = optimal_tree(FLAT, 0)
    assert tree.parents == () and tree.expected_tokens == 1.0 and tree.depth == 0 and tree.level_widths == ()
    assert expected_tokens([], FLAT) == 1.0


def test_optimal_trees_cover_every_budget_and_depth_fast():
    rng = np.random.default_rng(0)
    table = np.sort(rng.uniform(0.02, 0.9, size=(16, 12)), axis=1)[:, ::-1].tolist()
    trees = optimal_trees(table, 64, 16)
    assert set(trees) == {(n, d) for n in range(65) for d in range(1, 17)}
    values = np.array([[trees[(n, d)].expected_tokens for d in range(1, 17)] for n in range(65)])
    assert np.all(np.diff(values, axis=0) >= -1e-12) and np.all(np.diff(values, axis=1) >= -1e-12)
    assert trees[(64, 16)] == optimal_tree(table, 64, 16)
    assert trees[(64, 16)].nodes == 64 and trees[(64, 16)].expected_tokens > trees[(32, 16)].expected_tokens


# -------------------------------------------------------------------------------------- Monte Carlo and closed forms


def simulate(parents, table, walks, rng):
    """Tokens per call from ``walks`` simulated verifications: children tested in rank order, first success wins."""
    n = len(parents)
    accepted = np.zeros((n, walks), dtype=bool)
    taken = {-1: np.zeros(walks, dtype=bool)}  # parent -> one of its children already accepted
    ranks, depth = {}, []
    for i, p in enumerate(parents):
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        rank = ranks.get(p, 0)
        ranks[p] = rank + 1
        row = table[min(d, len(table)) - 1]
        a = row[rank] if rank < len(row) else 0.0
        reached = (np.ones(walks, dtype=bool) if p < 0 else accepted[p]) & ~taken.setdefault(p, np.zeros(walks, bool))
        accepted[i] = reached & (rng.random(walks) < a)
        taken[p] |= accepted[i]
    return 1.0 + accepted.sum(axis=0)


def test_expected_tokens_matches_monte_carlo_on_an_irregular_tree():
    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 4, 6]  # widths 3-3-3-1, uneven fan-out
    tokens = simulate(parents, BY_DEPTH, 200_000, np.random.default_rng(1234))
    stderr = tokens.std() / math.sqrt(tokens.size)
    assert abs(tokens.mean() - expected_tokens(parents, BY_DEPTH)) < 5 * stderr
    # The simulation tells a wrong model apart: ignoring depth (the first row everywhere) is off by many stderrs.
    assert abs(tokens.mean() - expected_tokens(parents, BY_DEPTH[:1])) > 5 * stderr


@pytest.mark.parametrize("a", [0.3, 0.8])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_closed_forms(a, k):
    chain = [-1] + list(range(k - 1))
    assert expected_tokens(chain, [[a]]) == pytest.approx(sum(a ** i for i in range(k + 1)), abs=1e-12)
    fan = [-1] * k
    assert expected_tokens(fan, [[a] * k]) == pytest.approx(2.0 - (1.0 - a) ** k, abs=1e-12)
    # With one rank per node only chains pay: the optimum is the longest chain allowed.
    assert optimal_tree([[a]], 10, k).parents == tuple(chain)


def test_deeper_than_the_table_reuses_the_last_row_and_missing_ranks_are_zero():
    assert node_probabilities([-1, 0, 1, 2], [[0.5], [0.4]]) == pytest.approx([0.5, 0.2, 0.08, 0.032])
    assert node_probabilities([-1, -1, -1], [[0.5, 0.5]]) == pytest.approx([0.5, 0.25, 0.0])


# -------------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [[], [[]], [[0.5], []], [[1.5]], [[-0.1]], [[float("nan")]], [[float("inf")]],
                                 [0.5, 0.3], "0.5", [["0.5"]], [[True]], None, 3])
def test_bad_tables_are_rejected(bad):
    with pytest.raises(OptimalTreeError):
        expected_tokens([-1], bad)
    with pytest.raises(OptimalTreeError):
        optimal_tree(bad, 3)


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0.5], [-1, None], "ab", None, [True]])
def test_bad_parents_are_rejected(bad):
    with pytest.raises(OptimalTreeError):
        expected_tokens(bad, FLAT)
    with pytest.raises(OptimalTreeError):
        step_cost_ms(bad, lambda r: 1.0, lambda r: 1.0)
    with pytest.raises(OptimalTreeError):
        as_k_config(bad)


def test_parents_only_need_to_precede_children():
    # Depth-first order, same tree as breadth-first [-1, -1, 0, 1]: same value.
    assert expected_tokens([-1, 0, -1, 2], BY_DEPTH) == pytest.approx(expected_tokens([-1, -1, 0, 1], BY_DEPTH))


def test_bad_budgets_and_depths_are_rejected():
    for call in (lambda: optimal_tree(FLAT, -1), lambda: optimal_tree(FLAT, 2.0), lambda: optimal_tree(FLAT, 3, 0),
                 lambda: optimal_tree(FLAT, 3, -2), lambda: optimal_trees(FLAT, -1, 3),
                 lambda: fastest_tree(FLAT, -1, 2, lambda r: 1.0, lambda r: 1.0)):
        with pytest.raises(OptimalTreeError, match="budget|max_depth"):
            call()
    assert isinstance(OptimalTreeError("x"), ValueError)


def test_bad_costs_are_rejected():
    for bad in ({}, {0: 1.0}, {2: -1.0}, {2: float("nan")}, {1.5: 2.0}):
        with pytest.raises(OptimalTreeError):
            cost_curve(bad)
    with pytest.raises(OptimalTreeError):
        step_cost_ms([-1], 3.0, lambda r: 1.0)
    with pytest.raises(OptimalTreeError):
        step_cost_ms([-1], lambda r: -1.0, lambda r: 1.0)
    with pytest.raises(OptimalTreeError, match="positive"):
        fastest_tree(FLAT, 2, 2, lambda r: 0.0, lambda r: 0.0)


# ------------------------------------------------------------------------------------------------------------- costs


def test_step_cost_counts_rows_per_forward():
    draft_rows, target_rows = [], []

    def draft(rows):
        draft_rows.append(rows)
        return 1.0 * rows

    def target(rows):
        target_rows.append(rows)
        return 100.0 + rows

    parents = [-1, -1, 0, 0, 1, 2]  # level widths 2-3-1
    assert step_cost_ms(parents, draft, target) == pytest.approx((1 + 2 + 3) + 100 + 7)
    assert draft_rows == [1, 2, 3] and target_rows == [7]
    draft_rows.clear(), target_rows.clear()
    assert step_cost_ms([], draft, target) == 101.0
    assert draft_rows == [] and target_rows == [1]


def test_cost_curve_interpolates_and_extrapolates():
    curve = cost_curve({8: 12.0, 4: 8.0})
    assert curve(4) == 8.0 and curve(6) == pytest.approx(10.0) and curve(8) == 12.0
    assert curve(1) == 8.0  # flat below the narrowest measurement
    assert curve(10) == pytest.approx(14.0)  # the last segment's slope beyond the widest
    assert cost_curve({4: 8.0})(100) == 8.0
    assert cost_curve({1: 10.0, 2: 9.0})(5) == 9.0  # a falling last segment extrapolates flat
    # step_cost_ms takes the measurements directly.
    assert step_cost_ms([-1, -1], {1: 2.0, 3: 4.0}, {1: 10.0, 5: 18.0}) == pytest.approx(2.0 + 14.0)


def test_fastest_tree_with_free_drafting_and_flat_target_is_the_biggest_optimum():
    tree = fastest_tree(BY_DEPTH, 10, 4, lambda r: 0.0, lambda r: 10.0)
    best = optimal_tree(BY_DEPTH, 10, 4)
    assert tree.parents == best.parents and tree.nodes == 10
    assert tree.cost_ms == 10.0
    assert tree.tokens_per_s == pytest.approx(best.expected_tokens * 100.0)


def test_fastest_tree_with_a_steep_target_drafts_nothing():
    # Any tree makes the target forward cost 1000 ms for at most 5 tokens, below 1 token in 10 ms.
    tree = fastest_tree(FLAT, 4, 4, lambda r: 1.0, lambda r: 10.0 if r == 1 else 1000.0)
    assert tree.parents == () and tree.cost_ms == 10.0 and tree.tokens_per_s == pytest.approx(100.0)


def test_fastest_tree_trades_depth_against_draft_forwards():
    # One rank at 0.5: optima are chains, k levels give 2 - 0.5**k tokens for 10 + k ms (1 ms per draft forward):
    # k=0: 100, k=1: 136.4, k=2: 145.8, k=3: 144.2, k=4: 138.4 tokens/s, so the 2-chain wins.
    tree = fastest_tree([[0.5]], 6, None, {1: 1.0}, {1: 10.0})
    assert tree.parents == (-1, 0)
    assert tree.cost_ms == pytest.approx(12.0)
    assert tree.tokens_per_s == pytest.approx(1.75 / 12.0 * 1000.0)
    assert summary(tree) == "2 nodes, depth 2, level widths 1-1, 1.75 expected tokens per call, " \
                            "12.00 ms per step, 145.8 tokens/s"
    # At 2 ms per draft forward k=1 and k=2 tie exactly (1.5 / 12 = 1.75 / 14): the smaller tree wins.
    tie = fastest_tree([[0.5]], 6, None, lambda r: 2.0, lambda r: 10.0)
    assert tie.parents == (-1,) and tie.tokens_per_s == 125.0


# ------------------------------------------------------------------------------------------------------ descriptions


def test_as_k_config_round_trips_and_rejects_irregular_trees():
    from explorer.engine.tree import k_config_parents

    for k_config in [(4, 2, 2), (3,), (2, 1, 3)]:
        assert as_k_config(k_config_parents(k_config)) == k_config
    assert as_k_config([-1, -1, 0]) is None  # uneven fan-out
    assert as_k_config([-1, -1, 0, 0, 1, 1, 2]) is None  # a partial last level
    assert as_k_config([-1, 0, -1, 2]) is None  # a (2, 1) tree, but depth-first
    assert as_k_config([]) is None


def test_summary_and_to_dict():
    tree = OptimalTree(parents=(-1, -1, 0), expected_tokens=2.5, node_probabilities=(0.5, 0.25, 0.75), depth=2,
                       level_widths=(2, 1))
    assert summary(tree) == "3 nodes, depth 2, level widths 2-1, 2.50 expected tokens per call"
    data = optimal_tree(BY_DEPTH, 5, 3).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["nodes"] == len(data["parents"]) == 5 and data["cost_ms"] is None
    assert summary(optimal_tree(FLAT, 0)).startswith("0 nodes, depth 0, level widths none")
