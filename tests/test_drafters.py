"""Free drafters (prompt lookup, Token Recycling, the hybrid) and the point-mass verification of their drafts."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from explorer.engine.carried import Carried
from explorer.engine.config import (DEFAULTS, FREE_ROWS_CPU, FREE_ROWS_CPU_RUN, MAX_TREE_NODES, MethodConfig,
                                    free_row_budget)
from explorer.engine.drafters import (Drafted, FreeNode, LookupDrafter, lookup_continuations,
                                      merge_free)
from explorer.engine.drafters.lookup import START_TOKENS
from explorer.engine.factory import build_engine
from explorer.engine.sampling import LazyRows, SamplingConfig
from explorer.engine.tree import DraftTree, TreeShapeError, rank_decay_parents
from explorer.engine.verify.rules import verify_tree

REPEATING = "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return a + "


# ------------------------------------------------------------------------------------------------ prompt lookup


def test_lookup_takes_the_longest_ngram_and_the_most_recent_match_first():
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    found = lookup_continuations(ctx, max_ngram=3, n_tokens=2, branches=3)
    # "2 3" (n=2) matches twice: position 5-6 (most recent, then 7 8) and 1-2 (then 9 1); then "3" alone adds none new
    assert found[0] == ([7, 8], 7, 2)
    assert found[1] == ([9, 1], 3, 2)
    assert len(found) == 2


def test_lookup_skips_continuations_it_already_has_and_respects_the_branch_limit():
    ctx = [4, 5, 6, 4, 5, 6, 4, 5]
    found = lookup_continuations(ctx, max_ngram=2, n_tokens=3, branches=5)
    assert [f[0] for f in found] == [[6, 4, 5]]  # the older match gives the same continuation: one branch
    assert lookup_continuations([1, 2, 3], 3, 4, 2) == []  # nothing repeats
    assert len(lookup_continuations([1, 1, 1, 1, 2, 1, 3, 1], 1, 1, 2)) == 2


def test_lookup_copy_length_doubles_after_a_whole_branch_and_shrinks_after_a_miss(tiny):
    engine = build_engine(tiny, MethodConfig(method="prompt-lookup", lookup_tokens=32), SamplingConfig())
    engine.start(tiny.tokenizer.encode(REPEATING), 40)
    lookup = engine.parts.drafter
    lengths = []
    for _ in range(8):
        before = lookup.length
        step = engine.step()
        lengths.append(before)
        proposed = [n for n in step.nodes if n.source == "lookup"]
        if proposed:
            assert max(n.depth for n in proposed) <= before
        hit = lookup.last_hit
        if any(hit == len(c) for c in lookup.proposed):
            assert lookup.length == min(32, 2 * before)
        elif lookup.proposed:
            assert lookup.length == max(START_TOKENS, hit + 1, before // 2)
    assert all(START_TOKENS <= n <= 32 for n in lengths)


# ------------------------------------------------------------------------------------------------ trees


def test_rank_decay_template_sizes_and_validation():
    parents, ranks = rank_decay_parents((3, 2, 1))
    # anchor: 3 children (ranks 0, 1, 2); rank 0 gets 2, rank 1 gets 1, rank 2 none; then rank-0 nodes get one
    assert parents == [-1, -1, -1, 0, 0, 1, 3, 5]
    assert ranks == [0, 1, 2, 0, 1, 0, 0, 0]
    assert len(rank_decay_parents((8, 3, 2, 1, 1, 1, 1, 1))[0]) == 40
    with pytest.raises(TreeShapeError, match="recycling_k"):
        MethodConfig(method="token-recycling", recycling_widths=(9,), recycling_k=8)
    with pytest.raises(ValueError, match="lossy"):
        MethodConfig(method="hybrid", lossy=True)
    with pytest.raises(ValueError, match="lookup_alone 4 is longer than the longest n-gram"):
        MethodConfig(method="eagle-hybrid", lookup_alone=4, lookup_ngram=3)
    with pytest.raises(TreeShapeError, match="lookup_alone must be an integer in"):
        MethodConfig(method="hybrid", lookup_alone=0)
    assert MethodConfig(method="prompt-lookup", lookup_alone=4, lookup_ngram=3).lookup_alone == 4  # not a hybrid


def test_free_branches_merge_into_the_tree_as_a_trie_keeping_model_rows():
    tree = DraftTree()
    tree.add_level([-1, -1], [10, 11])
    tree.add_level([0, 1], [12, 13])
    q_rows = LazyRows()
    d = Drafted(tree, q_rows=q_rows, q_show={0: 0.5, 1: 0.2, 2: 0.9, 3: 0.4}, draft_rows={0: 0, 1: 1, 2: 2, 3: 3},
                q_top={0: "anchor", 1: "row1", 3: "row3"})
    free = [FreeNode(-1, 10, "lookup", {"i": 0}), FreeNode(0, 14, "lookup", {"i": 1}),  # 10 merges, 14 joins under it
            FreeNode(1, 15, "lookup", {"i": 2}), FreeNode(-1, 20, "recycled", {"i": 3})]
    out = merge_free(d, free)
    t = out.tree
    assert t.token == [10, 11, 20, 12, 13, 14, 15]
    assert t.parent == [-1, -1, -1, 0, 1, 0, 5]
    assert t.source == ["draft", "draft", "recycled", "draft", "draft", "lookup", "lookup"]
    assert out.draft_rows == {0: 0, 1: 1, 3: 2, 4: 3}  # model nodes keep their draft-cache rows
    assert out.q_show == {0: 0.5, 1: 0.2, 3: 0.9, 4: 0.4}
    assert out.q_top == {0: "anchor", 1: "row1", 4: "row3"}  # rows are node + 1: old node 2 is new node 3
    assert out.provenance == {2: {"i": 3}, 5: {"i": 1}, 6: {"i": 2}}  # the merged free node keeps the model's node
    assert t.branch_ids() == [0, 1, 2, 0, 1, 0, 0]


def test_free_branches_stop_at_the_row_budget_and_take_their_subtrees_with_them():
    tree = DraftTree()
    tree.add_level([-1], [10])
    d = Drafted(tree, draft_rows={0: 0})
    free = [FreeNode(-1, 10, "lookup", {}), FreeNode(0, 11, "lookup", {}), FreeNode(1, 12, "lookup", {}),
            FreeNode(-1, 20, "lookup", {}), FreeNode(3, 21, "lookup", {})]
    # 5 rows: the anchor, the model's 10 (the free 10 merges into it, costing no row), 11, 12, 20; 21 has no room
    out = merge_free(d, free, max_rows=5)
    assert sorted(out.tree.token) == [10, 11, 12, 20]
    # 3 rows: 11 fits, 12 does not, nor 20; 21 goes with its parent 20
    out = merge_free(d, free, max_rows=3)
    assert sorted(out.tree.token) == [10, 11]
    assert sorted(merge_free(d, free, max_rows=None).tree.token) == [10, 11, 12, 20, 21]
    # a budget below the model's own tree adds nothing and removes nothing
    assert merge_free(d, free, max_rows=1).tree.token == [10]


def test_free_nodes_past_the_room_left_or_after_an_end_of_sequence_are_left_out():
    tree = DraftTree()
    tree.add_level([-1], [10])
    d = Drafted(tree, draft_rows={0: 0})
    free = [FreeNode(-1, 10, "lookup", {}), FreeNode(0, 11, "lookup", {}), FreeNode(1, 12, "lookup", {}),
            FreeNode(-1, 2, "lookup", {}), FreeNode(3, 21, "lookup", {}), FreeNode(-1, 30, "lookup", {})]
    out = merge_free(d, free, max_depth=2)  # 12 sits at depth 3: a depth-2 path and the bonus fill the room
    assert sorted(out.tree.token) == [2, 10, 11, 21, 30] and max(out.tree.depth) == 2
    out = merge_free(d, free, ends=frozenset({2}))  # nothing under an EOS (token 2) can be committed
    assert sorted(out.tree.token) == [2, 10, 11, 12, 30]
    assert merge_free(d, free, max_depth=0).tree.token == [10]  # room for the bonus only: no free node


@pytest.mark.parametrize("method", ["sd", "mcsd", "hybrid", "token-recycling", "prompt-lookup"])
def test_no_step_drafts_deeper_than_the_room_left(tiny, method):
    """A node deeper than the tokens left (less the bonus token) could never be committed; the step before the
    last token drafts nothing. Greedy tokens stay those of a run with room to spare."""
    ids = tiny.tokenizer.encode(REPEATING)
    # the goodput fallback off: where this machine measures verification rows dear, a timing-driven plain step
    # would draft nothing and record no room
    engine = build_engine(tiny, DEFAULTS[method].with_(fallback="off"), SamplingConfig())
    engine.start(ids, 9)
    trace = engine.run()
    from explorer.lessons.teach import explain_step

    done = 0
    for s in trace.steps:
        room = 9 - done
        assert max((n.depth for n in s.nodes), default=0) <= room - 1, (s.index, room)
        assert room > 1 or (s.draft_calls == 0 and len(s.nodes) == 1)
        assert s.drafter["tokens_left"] == room
        said = " ".join(explain_step(s))  # teach mode says why, where the limit bound the tree
        assert ("new-token limit" in said) == (room - 1 < s.max_draft_len)
        assert room > 1 or "Only one token remained" in said
        done += len(s.committed_ids)
    assert any(9 - sum(len(t.committed_ids) for t in trace.steps[:i]) <= 4 for i in range(len(trace.steps)))
    longer = build_engine(tiny, DEFAULTS[method], SamplingConfig())
    longer.start(ids, 40)
    assert longer.run().generated_ids[:9] == trace.generated_ids


def test_the_draft_model_gives_an_end_of_sequence_node_no_children(tiny):
    import dataclasses

    ids = tiny.tokenizer.encode(REPEATING)
    config = MethodConfig(method="sd", gamma=4, fallback="off")
    engine = build_engine(tiny, config, SamplingConfig())
    engine.start(ids, 20)
    first = [n.token_id for n in engine.step().nodes[1:]]
    assert len(first) == 4
    ended = dataclasses.replace(tiny, eos_token_ids=(first[1],))  # the second drafted token ends the sequence
    engine = build_engine(ended, config, SamplingConfig())
    engine.start(ids, 20)
    step = engine.step()
    assert [n.token_id for n in step.nodes[1:]] == first[:2] and step.draft_calls == 2


def test_the_free_row_budget_caps_every_step_and_keeps_greedy_output(tiny):
    ids = tiny.tokenizer.encode(REPEATING)
    want = None
    for rows in (MAX_TREE_NODES + 1, 6):
        engine = build_engine(tiny, DEFAULTS["prompt-lookup"].with_(free_rows=rows, lookup_tokens=16), SamplingConfig())
        engine.start(ids, 40)
        trace = engine.run()
        assert max(len(s.nodes) for s in trace.steps) <= rows  # nodes include the anchor: one per target row
        if rows == 6:
            assert trace.generated_ids == want
        else:
            assert max(len(s.nodes) for s in trace.steps) > 6  # without the budget the copies run longer
            want = trace.generated_ids
    engine = build_engine(tiny, DEFAULTS["prompt-lookup"], SamplingConfig())
    assert engine.parts.free_rows == FREE_ROWS_CPU  # auto, on the CPU


def test_a_copy_run_takes_its_best_branch_alone_past_the_row_edge():
    class Ctx:  # what a free drafter reads of the engine
        committed = [1, 2, 3, 60, 61] + [1, 2, 3] + list(range(10, 40)) + [1, 2, 3]
        n_prompt = 10
        free_rows, free_rows_run = 8, 16

    lookup = LookupDrafter(max_ngram=3, max_tokens=32, branches=2)
    lookup.length = 12
    nodes = lookup.free_nodes(Ctx)
    assert not lookup.long_copy and lookup.row_budget(Ctx) == 8  # no copy run yet: the usual budget
    assert len(lookup.proposed) == 2 and lookup.proposed[0][:2] == [10, 11]  # the most recent match first
    assert len(merge_free(Drafted(DraftTree()), nodes, lookup.row_budget(Ctx)).tree) == 7
    lookup.copy_run = True  # the last step committed its whole best branch
    nodes = lookup.free_nodes(Ctx)
    assert lookup.long_copy and lookup.row_budget(Ctx) == 16
    assert len(lookup.proposed) == 1  # the runner-ups would sit past the edge: left out
    assert len(merge_free(Drafted(DraftTree()), nodes, lookup.row_budget(Ctx)).tree) == 12
    lookup.length = 8  # a best branch that fits the usual budget: nothing passes the edge
    lookup.free_nodes(Ctx)
    assert not lookup.long_copy and lookup.row_budget(Ctx) == 8
    lookup.length = 12
    Ctx.free_rows_run = 8  # a budget set by hand holds on a copy run too: no long copy, runner-ups stay
    lookup.free_nodes(Ctx)
    assert not lookup.long_copy and len(lookup.proposed) == 2
    # auto budgets: the CPU's two row blocks; none on CUDA; a budget set by hand holds on a copy run too
    assert free_row_budget(0, "cpu", copy_run=True) == FREE_ROWS_CPU_RUN
    assert free_row_budget(0, "cuda", copy_run=True) is None
    assert free_row_budget(20, "cpu", copy_run=True) == 20


# ------------------------------------------------------------------------------------------------ recycling


def test_recycling_fills_rows_from_the_prompt_and_learns_the_targets_top_k(tiny):
    ids = tiny.tokenizer.encode(REPEATING)
    engine = build_engine(tiny, DEFAULTS["token-recycling"], SamplingConfig())
    engine.start(ids, 12)
    rec = engine.parts.drafter
    # every prompt token but the last has a row filled from the prompt whose first candidate followed it most recently
    last_next = {ids[i]: ids[i + 1] for i in range(len(ids) - 1)}
    assert all(rec.rows[t][0] == nxt for t, nxt in last_next.items())
    assert engine.trace.settings["recycling_initial"]["rows"][str(ids[0])] == rec.rows[ids[0]]
    step = engine.step()
    recycled = [n for n in step.nodes if n.source == "recycled"]
    # step 0 reads only rows filled from the prompt
    assert recycled and all(n.provenance["step"] == -2 for n in recycled)
    # after the step, the rows of the anchor and of every tree node hold the target's top-k at those rows
    _, v = engine.last_step
    d, _ = engine.last_step
    top = torch.topk(v.node_logits.float(), rec.k, dim=-1).indices.tolist()
    for i, tok in enumerate(d.tree.token):
        if tok not in d.tree.token[i + 1:]:  # a later duplicate overwrites
            assert rec.rows[tok] == top[i] and rec.origin[tok] == (0, i + 1)
    anchor = engine.state.committed[-1]
    step2 = engine.step()
    assert step2.drafter["recycling_row"]["token"] == anchor
    # a later anchor equal to a token the first step scored is expanded from the row that step wrote
    tok = d.tree.token[-1]
    nodes = rec.free_nodes(type("Ctx", (), {"committed": engine.state.committed + [tok]})())
    first_level = [n for n in nodes if n.parent == -1]
    assert [n.token for n in first_level] == rec.rows[tok][: len(first_level)]
    assert first_level and all(n.provenance["row_token"] == tok and n.provenance["step"] in (0, 1) for n in first_level)
    # a rewind forgets what the run learned
    engine.rewind()
    assert all(o[0] == -2 for o in rec.origin.values())


def test_recycling_state_carries_over_to_the_next_run(tiny):
    ids = tiny.tokenizer.encode(REPEATING)
    first = build_engine(tiny, DEFAULTS["token-recycling"], SamplingConfig())
    first.start(ids, 16)
    first.run()
    state = first.carried().recycling
    second = build_engine(tiny, DEFAULTS["token-recycling"], SamplingConfig(), carried=Carried(recycling=state))
    second.start(tiny.tokenizer.encode("x = 1"), 4)
    carried = second.trace.settings["recycling_initial"]
    assert carried["carried_rows"] == len(state["rows"]) > 0
    rec = second.parts.drafter
    assert any(o[0] == -1 for o in rec.origin.values())


# ------------------------------------------------------------------------------------------------ losslessness


@pytest.mark.parametrize("rule", ["rrs", "rrs-replacement", "mcns", "greedy"])
def test_free_children_after_model_children_keep_the_target_law(rule):
    """One node: two children drawn from q (as the rule's drafting does) and two fixed free children, one of them
    possibly equal to a model child's token. The first committed token must follow p exactly (chi-square)."""
    from explorer.engine import drafting

    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    counts = np.zeros(6)
    n = 6000 if rule != "greedy" else 50
    for _ in range(n):
        if rule == "rrs-replacement":
            kids = drafting.sample_with_replacement(q, 2, g)
        elif rule == "greedy":
            kids = [1, 3]
        else:
            kids = drafting.draw_without_replacement(q, 2, g)
        tree = DraftTree()
        free = [t for t in (0, 2) if t not in kids]
        sources = ["draft"] * len(kids) + ["lookup"] * len(free)
        tree.add_level([-1] * len(sources), kids + free, source=sources)
        rows = torch.stack([p] * (len(tree) + 1))
        r = verify_tree(tree, rows, {0: q}, g, rule=rule)
        first = tree.token[r.path[0]] if r.path else r.bonus
        counts[first] += 1
    if rule == "greedy":
        assert counts[0] == n  # argmax p is token 0: only the free child 0 can be accepted
        return
    expected = p.double().numpy() * n
    stat = chisquare(counts, expected * counts.sum() / expected.sum())
    assert stat.pvalue > 0.001, (counts, stat)
    assert counts[[0, 2]].sum() > 0.15 * n  # the free children really were accepted at their share


def test_every_new_method_reproduces_ar_greedily_on_the_tiny_pair(tiny):
    ids = tiny.tokenizer.encode(REPEATING)
    ar = build_engine(tiny, DEFAULTS["ar"], SamplingConfig())
    ar.start(ids, 40)
    want = ar.run().generated_ids
    for method in ("prompt-lookup", "token-recycling", "hybrid"):
        engine = build_engine(tiny, DEFAULTS[method], SamplingConfig())
        engine.start(ids, 40)
        trace = engine.run()
        assert trace.generated_ids == want, method
        free = [n for s in trace.steps for n in s.nodes if n.source in ("lookup", "recycled")]
        assert free, f"{method} proposed no free tokens on a repeating prompt"
        assert all(n.provenance and n.provenance["source"] == n.source for n in free)


# ------------------------------------------------------------------------------------------------ trace -> figures


def _trace(tiny, method, temperature=0.0, steps=4, **changes):
    engine = build_engine(tiny, DEFAULTS[method].with_(**changes), SamplingConfig(temperature=temperature, seed=1))
    engine.start(tiny.tokenizer.encode(REPEATING), 30)
    return engine.run(max_steps=steps)


def _hybrid_trace(tiny, temperature=0.0, steps=4):
    return _trace(tiny, "hybrid", temperature, steps, k_config=(2,), max_depth=3, stop="none")


@pytest.mark.parametrize("method, source, label", [("prompt-lookup", "lookup", "prompt lookup"),
                                                   ("token-recycling", "recycled", "token recycling")])
def test_a_saved_free_drafting_trace_replays_with_provenance_and_source_colours(tiny, tmp_path, method, source,
                                                                               label):
    from explorer.lessons.teach import explain_step
    from explorer.trace import figures
    from explorer.trace.records import load_run, save_run

    save_run(_trace(tiny, method), tmp_path / "t.json")
    trace = load_run(tmp_path / "t.json")  # no model from here on
    step = trace.steps[0]
    node = next(n for n in step.nodes if n.source == source)
    fig = figures.tree_figure(step, color_by="source")
    assert label in {t.name for t in fig.data}
    said = figures.provenance_text(node)
    assert figures.node_rows(step)[node.id]["from"] == said
    story = " ".join(explain_step(step, trace.settings["method"]))
    if source == "lookup":
        assert f"position {node.provenance['copied_from']}" in said and "gram match" in said
        assert node.provenance["match_text"] and "Prompt lookup copied" in story
    else:
        assert "matrix row of" in said and "filled from the prompt" in said
        assert "Token Recycling proposed" in story and "Why it works" in story
        row = step.drafter["recycling_row"]
        assert row["token"] == step.nodes[0].token_id and len(row["candidate_texts"]) == len(row["candidates"])


def test_teach_mode_names_a_rejected_free_token_by_its_point_mass_test(tiny):
    from explorer.lessons.teach import explain_step

    trace = _hybrid_trace(tiny, temperature=1.0, steps=6)
    found = False
    for step in trace.steps:
        story = " ".join(explain_step(step, trace.settings["method"]))
        rejected = [n for n in step.nodes if n.source in ("lookup", "recycled") and n.status == "rejected"
                    and n.parent in {0} | {m.id for m in step.nodes if m.committed}]
        if rejected:
            assert "a free token is accepted with the target's probability" in story
            found = True
    assert found
