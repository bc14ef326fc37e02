"""The EAGLE head's tree sized online (``engine/policies/head_tree.py``): expected tokens of every kept prefix, the
size that pays on a machine whose rows are dear or free, the warm-up and a replay's recorded sizes; and a head run
with the sizer keeps ``ar``'s greedy tokens, samples the target's law and replays step for step."""

import pytest

from method_grid import AUDIT_SAMPLES
from explorer.engine.policies.head_tree import PRIOR_N, Q_EDGES, TreeSizer


def _chain_and_fork():
    """anchor -> 0 (q 0.9) -> 1 (q 0.9) -> 2 (q 0.9); anchor -> 3 (rank 1, q 0.05): kept best first 0, 1, 2, 3."""
    parent, depth, rank, q = [-1, 0, 1, -1], [1, 2, 3, 1], [0, 0, 0, 1], [0.9, 0.9, 0.9, 0.05]
    return [0, 1, 2, 3], parent, depth, rank, q


def test_expected_tokens_multiply_down_a_path_and_past_rejected_siblings():
    sizer = TreeSizer({1: 100.0}, most=4)
    order, parent, depth, rank, q = _chain_and_fork()
    a = [sizer.acceptance(d, r, x) for d, r, x in zip(depth, rank, q)]
    assert a[0] == pytest.approx((0.9 + 1.0) / 2)  # a fresh cell is its q bin's middle
    tokens = sizer.expected_tokens(order, parent, depth, rank, q)
    assert tokens[0] == 1.0  # the bonus token alone
    assert tokens[3] == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert tokens[4] - tokens[3] == pytest.approx((1 - a[0]) * a[3])  # tested only where node 0 was rejected


def test_the_size_that_pays_depends_on_what_rows_cost_and_what_was_accepted():
    order, parent, depth, rank, q = _chain_and_fork()
    free_rows = TreeSizer({1: 100.0, 16: 101.0}, most=4, warmup=0)
    assert free_rows.choose(order, parent, depth, rank, q) == 4  # rows nearly free: keep all
    dear = TreeSizer({1: 100.0, 2: 130.0, 16: 500.0}, most=4, warmup=0)
    for _ in range(50):  # the head's sure tokens are rejected at depth 2 and below
        dear.record([(1, 0, 0.9), (2, 0, 0.9), (3, 0, 0.9), (1, 1, 0.05)], [1.0, 0.0, 0.0, 0.0], draft_ms=10.0)
    assert dear.acceptance(2, 0, 0.9) < 0.05 and dear.draft_ms == pytest.approx(10.0)
    assert dear.choose(order, parent, depth, rank, q) == 1
    assert dear.last["why"] == "fastest" and dear.last["cost_ms"] == pytest.approx(10.0 + 130.0)


def test_the_warm_up_keeps_every_node_and_a_replay_takes_the_recorded_sizes():
    order, parent, depth, rank, q = _chain_and_fork()
    sizer = TreeSizer({1: 100.0, 16: 500.0}, most=3)
    assert sizer.choose(order, parent, depth, rank, q) == 3 and sizer.last["why"] == "warm-up"
    sizer.force([2, 4])
    sizer.reset()
    assert [sizer.choose(order, parent, depth, rank, q) for _ in range(3)] == [2, 4, 3]  # then the most
    assert sizer.last["why"] == "recorded"


def test_a_level_is_drafted_where_its_expected_tokens_pay_for_its_milliseconds():
    # anchor -> 0 (q 0.9), 1 (rank 1, q 0.05); level 2 would expand node 0
    parent, depth, rank, q = [-1, -1], [1, 1], [0, 1], [0.9, 0.05]
    sizer = TreeSizer({1: 100.0}, most=4, warmup=0)
    assert sizer.deepen(2, [0], parent, depth, rank, q, children=2)  # nothing measured yet: every level
    sizer.rate = 0.01  # tokens per ms: 100 ms a token
    for _ in range(20):  # depth 2 accepts its first child half the time, its second never
        sizer.record([(2, 0, 0.5), (2, 1, 0.2)], [0.5, 0.0], draft_ms=None)
    reach = sizer.acceptance(1, 0, 0.9)
    first = sizer.hits[1][0] / sizer.seen[1][0]
    second = sizer.hits[1][1] / sizer.seen[1][1]
    gain = reach * (1 - (1 - first) * (1 - second))
    sizer.record_level(gain / sizer.rate * 0.9)  # a level cheaper than what it adds
    assert sizer.deepen(2, [0], parent, depth, rank, q, children=2)
    sizer.level_ms = gain / sizer.rate * 1.1  # dearer
    assert not sizer.deepen(2, [0], parent, depth, rank, q, children=2)
    sizer.force([3, 3], [1, None])  # a replay: the recorded levels (None: a step recorded before, every level)
    assert not sizer.deepen(2, [0], parent, depth, rank, q, children=2)
    sizer.choose([0, 1], parent, depth, rank, q)
    assert sizer.deepen(9, [0], parent, depth, rank, q, children=2)


def test_cells_and_bad_settings():
    assert TreeSizer.cell(1, 0, 0.0) == 0 and TreeSizer.cell(1, 0, 1.0) == len(Q_EDGES)
    assert TreeSizer.cell(9, 9, 0.5) == TreeSizer.cell(3, 2, 0.5)  # depth 3+ and rank 2+ share cells
    assert PRIOR_N > 0
    with pytest.raises(ValueError, match="at least one node"):
        TreeSizer({1: 1.0}, most=0)
    with pytest.raises(ValueError, match="at least one node"):
        TreeSizer({}, most=4)


# ------------------------------------------------------------------------------------------------ with a head

def _saved_head(tiny, tmp_path):
    from explorer.models.eagle3 import HeadConfig, random_head, save_head

    t = tiny.target.config
    config = HeadConfig(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                        vocab_size=t.vocab_size, draft_vocab_size=64, rope_theta=10000.0, aux_layer_ids=(0, 1, 2))
    return save_head(random_head(config, seed=4, draft_ids=list(range(32, 96))), tmp_path / "head")


def _online(folder):
    from explorer.engine.config import DEFAULTS

    return DEFAULTS["eagle"].with_(head=str(folder), head_topk=3, head_depth=4, head_tokens=10, tree_choice="online",
                                   fallback="off")


def test_a_sized_head_run_keeps_the_greedy_tokens_and_replays_its_sizes(tiny, tmp_path):
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.instruments.replay import engine_for_trace
    from explorer.lessons.teach import explain_step

    greedy = SamplingConfig(temperature=0.0)
    ids = tiny.tokenizer.encode("def add(a, b):\n    return a + b\n")
    plain = build_engine(tiny, DEFAULTS["ar"], greedy)
    plain.start(ids, 40)
    want = plain.run().generated_ids
    eng = build_engine(tiny, _online(_saved_head(tiny, tmp_path)), greedy)
    sizer = eng.parts.drafter.sizer
    sizer.warmup = 1
    measured = sizer.record_level
    # levels as dear as the machine is slow: from the third step on, the head stops after its first level
    sizer.record_level = lambda ms: measured(ms if len(eng.trace.steps) < 2 else 1e9)
    eng.start(ids, 40)
    trace = eng.run()
    assert trace.generated_ids == want
    sized = [s for s in trace.steps if s.drafted]
    assert sized and all(s.drafter["head"]["size"]["tokens"] == s.drafted <= 10 for s in sized)
    assert {s.drafter["head"]["size"]["why"] for s in sized} == {"warm-up", "fastest"}
    levels = [s.drafter["head"]["size"]["levels"] for s in sized]
    assert levels[0] == 4 and levels[-1] == 1 and all(max(n.depth for n in s.nodes) <= k
                                                      for s, k in zip(sized, levels))
    chosen = next(s for s in sized if s.drafter["head"]["size"]["why"] == "fastest")
    words = " ".join(explain_step(chosen, trace.settings["method"]))
    assert f"the {chosen.drafted} best of up to 10 node(s), expected" in words
    assert "It drafted 1 of up to 4 levels" in " ".join(explain_step(sized[-1], trace.settings["method"]))
    assert trace.model["tree_costs"]["target"]  # what the sizes were priced with
    again = engine_for_trace(tiny, trace)  # a replay takes the recorded sizes, whatever this machine times
    assert again.parts.drafter.sizer._forced == [s.drafted for s in sized]
    assert again.parts.drafter.sizer._forced_levels == levels
    replayed = again.run()
    assert [s.drafted for s in replayed.steps] == [s.drafted for s in trace.steps]
    assert [s.drafter["head"]["size"].get("levels") for s in replayed.steps if s.drafted] == levels
    assert replayed.generated_ids == want
    # another version of the head in the same folder: the replay says so rather than leaving the run at some step
    from explorer.instruments.replay import ReplayError
    from explorer.models.eagle3 import load_head, random_head, save_head

    folder = _saved_head(tiny, tmp_path)
    save_head(random_head(load_head(folder).config, seed=9, draft_ids=list(range(32, 96))), folder)
    tiny.heads.clear()
    with pytest.raises(ReplayError, match="another version of the EAGLE-3 head"):
        engine_for_trace(tiny, trace)


def test_a_sized_head_run_samples_the_targets_law(tiny, tmp_path):
    from explorer.analysis.audit import audit_engine
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig

    config = _online(_saved_head(tiny, tmp_path)).with_(head_topk=2, head_depth=3, head_tokens=6)
    eng = build_engine(tiny, config, SamplingConfig(temperature=1.0, seed=7))
    eng.parts.drafter.sizer.warmup = 1
    result = audit_engine(eng, tiny.tokenizer.encode("a b c a b c a b"), samples=AUDIT_SAMPLES)
    assert result.passed, result.summary()


def test_the_online_size_belongs_to_eagle_and_mcsd_improved():
    from explorer.engine.config import DEFAULTS

    assert DEFAULTS["eagle"].with_(tree_choice="online").online_branching(3) == []
    with pytest.raises(ValueError, match="eagle's tree size"):
        DEFAULTS["sd"].with_(tree_choice="online")


# ------------------------------------------------------------------------------------------------ eagle-hybrid

def test_the_head_with_prompt_lookup_keeps_the_greedy_tokens_and_replays(tiny, tmp_path):
    """``eagle-hybrid``: lookup's copies where the context has a match, else the head's tree; ``ar``'s greedy tokens,
    the head named in the trace, its sizes forced in a replay, which commits the same tokens step for step."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.instruments.replay import engine_for_trace
    from explorer.lessons.teach import explain_step
    import dataclasses

    from explorer.ui.panels import shapes_legend

    greedy = SamplingConfig(temperature=0.0)
    ids = tiny.tokenizer.encode("a b c a b c a b c a b c d e f g a b c")
    plain = build_engine(tiny, DEFAULTS["ar"], greedy)
    plain.start(ids, 40)
    want = plain.run().generated_ids
    config = _online(_saved_head(tiny, tmp_path)).with_(method="eagle-hybrid")
    eng = build_engine(tiny, config, greedy)
    eng.parts.drafter.sizer.warmup = 1
    eng.start(ids, 40)
    trace = eng.run()
    assert trace.generated_ids == want
    assert trace.settings["head"]["draft_vocab_size"] == 64 and eng.parts.drafter.target_layers == (0, 1, 2)
    copied = [s for s in trace.steps if s.drafter.get("lookup_trusted")]
    headed = [s for s in trace.steps if s.drafted and not s.drafter.get("lookup_trusted")]
    assert copied and headed and all(s.drafter["head"]["size"]["tokens"] == s.drafted for s in headed)
    assert "The EAGLE-3 head sat this step out" in " ".join(explain_step(copied[0], trace.settings["method"]))
    assert "one-layer head read" in " ".join(explain_step(headed[-1], trace.settings["method"]))
    assert "● EAGLE-3 head" in shapes_legend(trace)  # the tree's circles are the head's, not a draft model's
    assert "● draft model" in shapes_legend(dataclasses.replace(trace, settings={**trace.settings, "head": None}))
    again = engine_for_trace(tiny, trace)
    assert again.parts.drafter.sizer._forced == [s.drafted for s in headed]
    replayed = again.run()
    assert [s.committed_ids for s in replayed.steps] == [s.committed_ids for s in trace.steps]


def test_a_match_shorter_than_lookup_alone_is_dropped_for_the_heads_tree(tiny, tmp_path):
    """``lookup_alone``: lookup's copies go alone only on a match of that many tokens; on a shorter one the head
    drafts (no lookup node; the dropped match's length recorded and explained), and lookup's copy length is left as
    it was. The greedy tokens stay ``ar``'s."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.lessons.teach import explain_step

    greedy = SamplingConfig(temperature=0.0)
    ids = tiny.tokenizer.encode("a b c a b c a b c a b c d e f g a b c")
    plain = build_engine(tiny, DEFAULTS["ar"], greedy)
    plain.start(ids, 40)
    want = plain.run().generated_ids
    config = _online(_saved_head(tiny, tmp_path)).with_(method="eagle-hybrid", lookup_alone=2)
    eng = build_engine(tiny, config, greedy)
    lookup = next(f for f in eng.parts.drafter.free if f.name == "lookup")
    lengths = []
    observe = lookup.observe
    lookup.observe = lambda step: (observe(step), lengths.append((step.drafted.info.get("lookup_dropped_ngram"),
                                                                 lookup.length)))
    eng.start(ids, 40)
    trace = eng.run()
    assert trace.generated_ids == want
    dropped = [s for s in trace.steps if s.drafter.get("lookup_dropped_ngram")]
    copied = [s for s in trace.steps if s.drafter.get("lookup_trusted")]
    assert dropped and copied
    assert all(s.drafter["lookup_dropped_ngram"] == 1 and not any(n.source == "lookup" for n in s.nodes)
               for s in dropped)
    assert all(min(n.provenance["ngram"] for n in s.nodes if n.source == "lookup") >= 2 for s in copied)
    assert "too short a match to trust" in " ".join(explain_step(dropped[0], trace.settings["method"]))
    for (_, before), (now, after) in zip(lengths, lengths[1:]):
        if now:
            assert after == before  # a withdrawn proposal does not move the copy length


def test_the_head_with_prompt_lookup_samples_the_targets_law(tiny, tmp_path):
    from explorer.analysis.audit import audit_engine
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig

    config = _online(_saved_head(tiny, tmp_path)).with_(method="eagle-hybrid", head_topk=2, head_depth=3,
                                                         head_tokens=6)
    eng = build_engine(tiny, config, SamplingConfig(temperature=1.0, seed=7))
    result = audit_engine(eng, tiny.tokenizer.encode("a b c a b c a b"), samples=AUDIT_SAMPLES)
    assert result.passed, result.summary()
