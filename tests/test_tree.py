import numpy as np
import pytest

from explorer.engine.tree import (DraftTree, TreeShapeError, ancestor_matrix, depths, k_config_parents, parse_k_config,
                                  step_mask, step_position_ids, tree_size)


def test_parse_k_config_accepts_lists_and_strings():
    assert parse_k_config("4,2,2") == (4, 2, 2)
    assert parse_k_config(" 3, 1 ") == (3, 1)
    assert parse_k_config([2, 2.0]) == (2, 2)


@pytest.mark.parametrize("bad", ["", "4,0", "4,-1", "a,b", "2.5", [], [1.5], [True], "4,,x", None])
def test_parse_k_config_rejects_bad_shapes(bad):
    with pytest.raises(TreeShapeError):
        parse_k_config(bad)


def test_parse_k_config_rejects_huge_trees():
    with pytest.raises(TreeShapeError, match="nodes"):
        parse_k_config([16, 16, 16, 16])


def test_tree_size_and_bfs_parents():
    assert tree_size((4, 2, 2)) == 4 + 8 + 16
    assert k_config_parents((2, 2)) == [-1, -1, 0, 0, 1, 1]
    assert k_config_parents((3, 1)) == [-1, -1, -1, 0, 1, 2]
    assert depths([-1, -1, 0, 0, 1, 1]) == [1, 1, 2, 2, 2, 2]


def test_ancestor_matrix_hand_built():
    # anchor -> a(0), b(1); a -> c(2), d(3); b -> e(4); c -> f(5)
    parents = [-1, -1, 0, 0, 1, 2]
    expected = np.array([
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=bool)
    assert (ancestor_matrix(parents) == expected).all()


def test_ancestor_matrix_rejects_child_before_parent():
    with pytest.raises(TreeShapeError):
        ancestor_matrix([-1, 2, -1])


def test_draft_tree_levels_match_static_matrix_and_slicing():
    tree = DraftTree()
    tree.add_level([-1, -1], [10, 11])
    tree.add_level([0, 0, 1, 1], [12, 13, 14, 15])
    tree.add_level([2, 3, 4, 5], [16, 17, 18, 19])
    full = ancestor_matrix(tree.parent)
    assert (tree.anc == full).all()
    assert tree.depth == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    # A prefix of whole levels is a closed subtree: its mask is the top-left slice of the full mask.
    for s in range(1, tree.n_levels + 1):
        cum = tree.level_starts[s]
        assert (ancestor_matrix(tree.parent[:cum]) == full[:cum, :cum]).all()
    assert tree.branch_ids() == [0, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert tree.children(-1) == [0, 1] and tree.children(1) == [4, 5]


def test_draft_tree_rejects_parent_outside_previous_level():
    tree = DraftTree()
    tree.add_level([-1], [1])
    with pytest.raises(TreeShapeError):
        tree.add_level([-1], [2])


def test_step_mask_target_verification_layout():
    # 3 cached tokens, 1 chain token (the anchor), tree: anchor -> 0, 1; 0 -> 2
    tree = DraftTree()
    tree.add_level([-1, -1], [5, 6])
    tree.add_level([0], [7])
    m = step_mask(3, 1, True, tree.anc, 0, 3)
    expected = np.array([
        # c0 c1 c2 anc n0 n1 n2
        [1, 1, 1, 1, 0, 0, 0],  # anchor row: causal
        [1, 1, 1, 1, 1, 0, 0],  # n0
        [1, 1, 1, 1, 0, 1, 0],  # n1: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # n2: parent n0
    ], dtype=bool)
    assert (m == expected).all()
    assert step_position_ids(3, 1, True, tree.depth, 0, 3) == [3, 4, 4, 5]


def test_step_mask_level_slice_for_drafting_and_chain_catch_up():
    tree = DraftTree()
    tree.add_level([-1, -1], [5, 6])
    tree.add_level([0, 1], [7, 8])
    # second draft forward: past = 4 cached + 2 chain tokens fed earlier, query = level 2 only
    m = step_mask(4, 2, False, tree.anc, 2, 4)
    assert m.shape == (2, 4 + 2 + 4)
    assert m[:, :6].all()
    assert (m[:, 6:] == np.array([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=bool)).all()
    assert step_position_ids(4, 2, False, tree.depth, 2, 4) == [7, 7]
    # first forward with a 2-token chain: chain rows are causal
    m0 = step_mask(4, 2, True, tree.anc, 0, 0)
    assert (m0 == np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)).all()
