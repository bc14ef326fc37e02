"""Row pricing (explorer/engine/drafters/row_pricing.py): free slots kept where their measured acceptance pays for their
verification row, every offered slot observed, and the engine's use of it where rows are dear (greedy tokens,
output law, replay and rewind unchanged)."""

import pytest
from method_grid import AUDIT_SAMPLES, PROMPT

from explorer.analysis.audit import audit
from explorer.engine.config import DEFAULTS
from explorer.engine.drafters.base import FreeNode
from explorer.engine.drafters.row_pricing import RowPricing
from explorer.engine.factory import build_engine, times_verification
from explorer.engine.runtime.forward_costs import row_prices
from explorer.engine.sampling import SamplingConfig
from explorer.engine.tree import rank_decay_parents

WIDTHS = (4, 2, 1, 1)


def _template() -> list[FreeNode]:
    """Token Recycling's template for ``WIDTHS`` with token 100 + slot index at every slot."""
    parents, _ = rank_decay_parents(WIDTHS)
    return [FreeNode(p, 100 + i, "recycled", {}, slot=("recycled", i)) for i, p in enumerate(parents)]


def _chain(nodes: list[FreeNode], depth: int) -> list[int]:
    """The tokens of the best-ranked chain (each level's first child) down to ``depth``."""
    out, at = [], -1
    for _ in range(depth):
        at = next(i for i, n in enumerate(nodes) if n.parent == at)
        out.append(nodes[at].token)
    return out


def test_free_rows_keep_everything_and_dear_rows_keep_nothing_before_any_measurement():
    nodes = _template()
    kept, record = RowPricing(100.0, 0.0).choose(nodes, at=0)
    assert kept == nodes and record["kept"] == record["offered"] == len(nodes)
    kept, record = RowPricing(100.0, 1000.0).choose(nodes, at=0)  # a row costs 10 plain steps: no slot is worth it
    assert kept == [] and record["expected_tokens"] == 1.0


def test_the_even_prior_keeps_the_first_level_where_a_row_costs_a_sixth_of_a_step():
    """Each slot's token continues the text half the time before anything is measured: at 343 ms a step and
    60 ms a row the four 0.5-slots pay for their rows, the 0.25-slots below them do not (a slot pays when its
    acceptance exceeds a row's milliseconds times the tree's tokens per millisecond: 60 x 3 / 583 = 0.31)."""
    nodes = _template()
    kept, record = RowPricing(343.0, 60.0).choose(nodes, at=0)
    assert [n.slot for n in kept] == [("recycled", i) for i in range(4)]
    assert all(n.parent == -1 for n in kept) and record["expected_tokens"] == 3.0


def _steps(pricing: RowPricing, nodes: list[FreeNode], steps: int, commit) -> list[int]:
    """Run ``steps`` choose/commit/observe rounds on one text; ``commit()`` gives each step's committed tokens."""
    text = [1, 2, 3]
    for _ in range(steps):
        pricing.choose(nodes, at=len(text))
        text += commit()
        pricing.observe(text)
    return text


def test_the_kept_tree_is_closed_under_parents_and_reindexed():
    nodes = _template()
    pricing = RowPricing(343.0, 38.0)
    _steps(pricing, nodes, 30, lambda: _chain(nodes, 3) + [7])  # the best chain continues the text 3 deep
    kept, record = pricing.choose(nodes, at=0)
    assert [n.token for n in kept] == _chain(nodes, 3)
    assert [n.parent for n in kept] == [-1, 0, 1]  # re-indexed into the kept list
    assert 3.0 < record["expected_tokens"] < 4.0


def test_a_dropped_slot_is_still_observed_and_comes_back():
    nodes = _template()
    pricing = RowPricing(343.0, 38.0)
    _steps(pricing, nodes, 30, lambda: [_chain(nodes, 1)[0], 7])  # only the first slot matches
    second = nodes[1]  # rank 1 at the first level: measured, and dropped
    assert second not in pricing.choose(nodes, at=0)[0] and pricing.conditional(second.slot) < 0.1
    # the text turns to it: it is observed while it is out of the tree, and comes back
    _steps(pricing, nodes, 30, lambda: [second.token, 7])
    assert second in pricing.choose(nodes, at=0)[0] and pricing.conditional(second.slot) > 0.85


def test_deep_slots_are_observed_when_the_text_reaches_them_in_later_steps():
    """A step that commits one token still settles its tree's deeper nodes later, from the next steps' text."""
    nodes = _template()
    pricing = RowPricing(343.0, 38.0)
    pricing.choose(nodes, at=3)
    chain = _chain(nodes, 4)
    text = [1, 2, 3, chain[0]]
    pricing.observe(text)  # one token: the first level settled, nothing deeper
    assert set(pricing.seen) == {("recycled", i) for i in range(4)}
    assert pricing.hits[("recycled", 0)] == 1.0 and pricing.hits[("recycled", 1)] == 0.0
    pricing.observe(text + chain[1:3] + [9])  # the text went on along the chain, then left it
    deeper = {n.slot for n in nodes if n.token in chain[1:]}
    assert all(pricing.seen[s] == 1.0 for s in deeper)
    assert [pricing.hits[s] for s in sorted(deeper)] == [1.0, 1.0, 0.0]
    assert ("recycled", 5) in pricing.seen and ("recycled", 6) not in pricing.seen  # under a miss: not observed
    assert pricing._pending == []  # every node settled


def test_a_costly_first_row_makes_a_weak_tree_a_plain_step():
    """Stock float32 weights on a 2-core AVX2 CPU: two rows cost about two plain steps (jump_ms). A template that
    rarely matches does not pay for that jump (no node kept: a plain step), where the same rows without the jump
    would; a chain that keeps matching does."""
    nodes = _template()
    pricing, cheap = RowPricing(373.0, 23.0, jump_ms=337.0), RowPricing(373.0, 23.0)
    assert (pricing.row_price, pricing.jump_price) == (0.06, 0.9)
    for p in (pricing, cheap):
        _steps(p, nodes, 30, lambda: [7])  # nothing matches
    assert pricing.choose(nodes, at=0)[0] == [] and len(cheap.choose(nodes, at=0)[0]) > 0
    _steps(pricing, nodes, 30, lambda: _chain(nodes, 4) + [7])  # the best chain matches 4 deep every step
    kept, record = pricing.choose(nodes, at=0)
    assert [n.token for n in kept] == _chain(nodes, 4) and record["expected_tokens"] > 3


def test_row_prices_come_from_the_measured_forwards(tiny, monkeypatch):
    monkeypatch.setattr(tiny, "measured", {})
    assert row_prices(tiny) is None  # the tiny pair's rows cost hundredths of a millisecond: not priced
    monkeypatch.setitem(tiny.measured, "verification_cost", {"rows": 16, "one_row_ms": 373.0, "two_rows_ms": 733.0,
                                                             "rows_ms": 1052.0, "ratio": 2.82, "dear": True})
    assert row_prices(tiny) == {"one_row_ms": 373.0, "jump_ms": 337.214, "row_ms": 22.786}


def test_unpriced_nodes_are_always_kept():
    nodes = [FreeNode(-1, 5, "lookup", {}), FreeNode(0, 6, "lookup", {})]
    kept, _ = RowPricing(100.0, 1000.0).choose(nodes, at=0)
    assert kept == nodes


def test_bad_costs_are_rejected():
    for args in ((0.0, 1.0), (100.0, -1.0), (100.0, 1.0, -5.0)):
        with pytest.raises(ValueError):
            RowPricing(*args)
    with pytest.raises(ValueError):
        RowPricing(100.0, 1.0, decay=1.0)


@pytest.fixture
def dear(tiny, monkeypatch):
    """The tiny pair as if on a CPU where 16 rows cost 3 one-row forwards (300 against 900 ms: 40 ms a row)."""
    monkeypatch.setitem(tiny.measured, "verification_cost", {"rows": 16, "one_row_ms": 300.0, "rows_ms": 900.0,
                                                             "ratio": 3.0, "dear": True})
    return tiny


def test_only_recycled_branches_with_the_automatic_budget_are_priced_where_rows_cost_time(dear):
    for name in ("token-recycling", "hybrid"):
        assert build_engine(dear, DEFAULTS[name], SamplingConfig()).parts.row_pricing is not None, name
        assert build_engine(dear, DEFAULTS[name].with_(free_rows=16), SamplingConfig()).parts.row_pricing is None, name
    assert times_verification(DEFAULTS["token-recycling"].with_(fallback="off"), "cpu")
    assert not times_verification(DEFAULTS["token-recycling"].with_(fallback="off"), "cuda")
    for name in ("prompt-lookup", "mcsd-improved", "ar"):
        assert build_engine(dear, DEFAULTS[name], SamplingConfig()).parts.row_pricing is None, name
    pricing = build_engine(dear, DEFAULTS["token-recycling"], SamplingConfig()).parts.row_pricing
    assert (pricing.one_row_ms, pricing.row_ms) == (300.0, 40.0)


def test_priced_runs_keep_the_greedy_tokens_record_their_prices_and_replay(dear):
    from explorer.instruments.replay import replay_steps

    ids = dear.tokenizer.encode(PROMPT * 3)  # repeats give recycled rows
    runs = {}
    for rows in (0, 32):
        eng = build_engine(dear, DEFAULTS["token-recycling"].with_(fallback="off", free_rows=rows),
                     SamplingConfig(temperature=0.0))
        eng.start(ids, 40)
        eng.run()
        runs[rows] = eng
    assert runs[0].state.committed == runs[32].state.committed
    trace = runs[0].trace
    assert trace.model["row_pricing"] == {"one_row_ms": 300.0, "jump_ms": 0.0, "row_ms": 40.0}
    records = [s.drafter["row_pricing"] for s in trace.steps]
    assert all(r["kept"] <= r["offered"] for r in records) and any(r["kept"] < r["offered"] for r in records)
    assert sum(s.drafted for s in trace.steps) < sum(s.drafted for s in runs[32].trace.steps)
    for i, replayed in replay_steps(dear, trace, len(trace.steps) - 1):
        assert replayed.trace.steps[i].drafter["row_pricing"] == records[i]


def test_a_rewound_priced_run_retraces_its_steps(dear):
    eng = build_engine(dear, DEFAULTS["token-recycling"].with_(fallback="off"), SamplingConfig(temperature=0.9, seed=4))
    eng.start(dear.tokenizer.encode(PROMPT * 3), 30)
    first = [(s.committed_ids, s.drafter["row_pricing"]) for s in eng.run().steps]
    eng.rewind()
    assert [(s.committed_ids, s.drafter["row_pricing"]) for s in eng.run().steps] == first


def test_priced_trees_keep_the_output_law(dear):
    """The second token's tree depends on what the first step measured: the two-token law still holds."""
    cfg = DEFAULTS["token-recycling"].with_(fallback="off")
    r = audit(dear, cfg, SamplingConfig(temperature=1.0, seed=5), dear.tokenizer.encode(PROMPT * 3), AUDIT_SAMPLES)
    assert r.passed, r.summary()


def test_the_hybrid_prices_its_recycled_branches_only_and_keeps_the_greedy_tokens(dear):
    """Beside the model's tree the recycled slots are priced; lookup's copies and the model's nodes are not."""
    ids = dear.tokenizer.encode(PROMPT * 3)
    runs = {}
    for rows in (0, 32):
        eng = build_engine(dear, DEFAULTS["hybrid"].with_(fallback="off", free_rows=rows, stop="none", max_depth=3),
                     SamplingConfig(temperature=0.0))
        eng.start(ids, 40)
        runs[rows] = eng.run()
    assert runs[0].generated_ids == runs[32].generated_ids
    priced = [s for s in runs[0].steps if "row_pricing" in s.drafter]
    assert priced and all(not s.drafter["lookup_trusted"] for s in priced)  # only steps where the model drafted
    assert any(s.drafter["row_pricing"]["kept"] < s.drafter["row_pricing"]["offered"] for s in priced)
    for s in priced:
        recycled = sum(1 for n in s.nodes if n.source == "recycled")
        assert recycled <= s.drafter["row_pricing"]["kept"]  # kept slots may merge into the model's nodes
    assert not any("row_pricing" in s.drafter for s in runs[32].steps)


def test_the_priced_hybrid_keeps_the_output_law(dear):
    cfg = DEFAULTS["hybrid"].with_(fallback="off", stop="none", max_depth=2)
    r = audit(dear, cfg, SamplingConfig(temperature=1.0, seed=6), dear.tokenizer.encode(PROMPT * 3), AUDIT_SAMPLES)
    assert r.passed, r.summary()
