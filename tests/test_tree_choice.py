"""The improved MCSD's root width chosen online (engine/policies/tree_choice.py): the chooser's pricing, the engine's
runs (greedy equality, the trace, carrying between runs, replays that take the recorded costs). Losslessness under
sampling is in tests/test_audit.py."""

import pytest

from explorer.engine.carried import Carried
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.policies.tree_choice import TreeChooser
from explorer.engine.sampling import SamplingConfig
from explorer.instruments.replay import replay_steps
from explorer.lessons.teach import explain_step, tree_choice_words
from explorer.trace.figures import stop_figure
from explorer.trace.records import loads_run

CHEAP_ROWS = {"draft": {1: 10.0, 4: 10.4}, "target": {1: 100.0, 16: 104.0}}  # a GPU-like machine: rows ride along
DEAR_ROWS = {"draft": {1: 10.0, 2: 18.0, 4: 34.0}, "target": {1: 100.0, 2: 110.0, 16: 300.0}}  # an AVX2 CPU's
ONLINE = DEFAULTS["mcsd-improved"].with_(tree_choice="online", fallback="off")
PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):"


def measured(second: float, costs: dict, steps: int = 40) -> TreeChooser:
    """A chooser fed ``steps`` unsure steps: the first root candidate committed on 60 % of them, the second on a
    share ``second`` of the rest, chains accepted at 0.8 and four levels drafted."""
    chooser = TreeChooser(published=2, max_depth=16)
    chooser.costs = costs
    firsts = seconds = misses = 0
    for s in range(steps):
        if firsts < 0.6 * (s + 1):
            firsts, token = firsts + 1, 11
        else:
            misses += 1
            hit = seconds < second * misses
            seconds, token = seconds + hit, (12 if hit else 99)
        chooser.record([11, 12, 13, 14], sure=False, committed_first=token,
                       chain_odds=[(2, 0.8), (3, 0.8), (4, 0.8)], levels=4)
    return chooser


def test_the_published_width_until_the_chooser_has_measured():
    chooser = TreeChooser(published=2, max_depth=16)
    chooser.costs = CHEAP_ROWS
    assert chooser.choose() == 2 and chooser.last["why"] == "warm-up"
    assert "published width" in tree_choice_words(chooser.last)


def test_a_second_root_that_is_accepted_is_drafted_where_rows_are_cheap_and_dropped_where_they_are_dear():
    assert measured(0.3, CHEAP_ROWS).choose() >= 2
    assert measured(0.3, DEAR_ROWS).choose() == 1  # its draft and target rows cost more than it wins
    assert measured(0.0, CHEAP_ROWS).choose() == 1  # never accepted: a row for nothing, even where rows are cheap
    chooser = measured(0.3, CHEAP_ROWS)
    k = chooser.choose()
    prices = {p["k"]: p for p in chooser.last["prices"]}
    assert prices[k]["tokens_per_s"] == max(p["tokens_per_s"] for p in prices.values())
    assert prices[2]["expected_tokens"] > prices[1]["expected_tokens"]  # the second root's hits are counted
    assert f"{k} root candidate" in tree_choice_words(chooser.last)


def test_the_row_floor_prices_a_node_against_a_plain_step():
    """A node's target and draft rows (the mean slope per row) over a one-row target forward."""
    chooser = TreeChooser(published=2, max_depth=16)
    assert chooser.row_floor() is None  # no costs measured yet
    chooser.costs = DEAR_ROWS
    assert chooser.row_floor() == pytest.approx(((300 - 100) / 15 + (34 - 10) / 3) / 100)
    chooser.costs = CHEAP_ROWS
    assert chooser.row_floor() == pytest.approx((4 / 15 + 0.4 / 3) / 100)
    chooser.costs = {"draft": {1: 10.0}, "target": {1: 100.0, 16: 90.0}}  # one row measured; noise, not a discount
    assert chooser.row_floor() == 0.0


def test_sure_roots_are_priced_apart():
    """Steps where the draft is sure draft one root whatever the width: at a high share of them, a wider width
    changes little of the step's price."""
    chooser = measured(0.3, CHEAP_ROWS)
    for _ in range(400):
        chooser.record([11, 12], sure=True, committed_first=11, chain_odds=[], levels=4)
    one, two = chooser.price(1), chooser.price(2)
    assert abs(two["expected_tokens"] - one["expected_tokens"]) < 0.1


def test_the_state_carries_and_refuses_another_shape():
    chooser = measured(0.3, CHEAP_ROWS)
    fresh = TreeChooser(published=2, max_depth=16)
    assert fresh.restore(chooser.state()) and fresh.state() == chooser.state()
    fresh.costs = CHEAP_ROWS
    assert fresh.choose() == chooser.choose()
    assert not TreeChooser(published=2, max_depth=8).restore(chooser.state())
    assert not TreeChooser(roots=(1, 2), published=2, max_depth=16).restore(chooser.state())
    broken = TreeChooser(published=2, max_depth=16)
    assert not broken.restore({"roots": [1, 2, 3, 4], "max_depth": 16}) and broken.steps == 0


def test_only_the_lossless_improved_mcsd_chooses_its_tree_online():
    with pytest.raises(ValueError, match="tree choice"):
        MethodConfig(method="mcsd-improved", tree_choice="sometimes")
    with pytest.raises(ValueError, match="lossy"):
        MethodConfig(method="mcsd-improved", lossy=True, tree_choice="online")
    with pytest.raises(ValueError, match="sd keeps"):
        MethodConfig(method="sd", tree_choice="online")
    # room for the widest tree the choice may draft
    published = DEFAULTS["mcsd-improved"].with_(tree_choice="fixed")
    assert ONLINE.max_nodes() == 4 * ONLINE.max_depth > published.max_nodes()
    # the default chooses online; Lu et al.'s lossy mode, set without a tree choice, takes the published shape
    assert DEFAULTS["mcsd-improved"].tree_choice == "online"
    assert DEFAULTS["mcsd-improved"].with_(lossy=True).tree_choice == "fixed"
    with pytest.raises(ValueError, match="lossy"):
        DEFAULTS["mcsd-improved"].with_(lossy=True, tree_choice="online")


def _run(pair, config, temperature=0.0, carried=None, tokens=40):
    engine = build_engine(pair, config, SamplingConfig(temperature=temperature, seed=5), carried=carried)
    engine.start(pair.tokenizer.encode(PROMPT), tokens)
    return engine, engine.run()


def test_an_online_run_is_greedy_equal_to_ar_and_records_each_choice(tiny):
    engine, trace = _run(tiny, ONLINE)
    _, plain = _run(tiny, DEFAULTS["ar"])
    assert trace.generated_ids == plain.generated_ids
    choices = [s.drafter["tree_choice"] for s in trace.steps if "tree_choice" in s.drafter]
    assert len(choices) == len(trace.steps)
    assert [c["why"] for c in choices[:4]] == ["warm-up"] * 4 and choices[4]["why"] == "fastest"
    for step, choice in zip(trace.steps, choices):  # the tree drafted has at most the chosen width at its root
        assert sum(1 for n in step.nodes if n.depth == 1) <= choice["k"]
    assert {"draft", "target"} <= set(trace.model["tree_costs"])
    assert "Tree chosen online" in " ".join(explain_step(trace.steps[5]))
    # the next run starts from what this one measured: no warm-up
    _, second = _run(tiny, ONLINE, carried=engine.carried())
    assert second.steps[0].drafter["tree_choice"]["why"] == "fastest"
    assert second.settings["tree_carried"]["steps"] == sum(1 for s in trace.steps if s.drafted)


def test_a_replay_prices_with_the_recorded_costs(tiny):
    """The costs are timed; a replay on a machine that times otherwise still makes the recorded choices."""
    _, trace = _run(tiny, ONLINE, temperature=0.8)
    recorded = [s.drafter["tree_choice"]["k"] for s in trace.steps]
    trace = loads_run(trace.to_json())
    saved = tiny.measured.pop("tree_costs")
    tiny.measured["tree_costs"] = {"draft": {1: 1.0, 4: 400.0}, "target": {1: 1.0, 16: 900.0}}  # would pick 1
    try:
        replayed = [engine.last_step[0].info["tree_choice"]["k"]
                    for _, engine in replay_steps(tiny, trace, len(trace.steps) - 1)]
    finally:
        tiny.measured["tree_costs"] = saved
    assert replayed == recorded and len(set(recorded)) >= 1


def test_carried_records_keep_the_tree_chooser():
    old = Carried(tree={"key": "a", "state": {}})
    assert old.updated(Carried(fallback={"key": "b", "rates": {}})).tree == old.tree
    assert old.without_recycling().tree == old.tree


def test_side_branches_stop_where_their_rows_cannot_pay(tiny):
    """Where a node's rows cost more than a plain step (row floor above 1) no side branch grows past its root:
    every deeper node hangs under one root, the signals name the branches stopped for it, and the text stays
    greedy-equal. With rows nearly free the same run keeps side branches growing. (Threshold 0: the tiny pair's
    decision model would stop every branch at its root.)"""
    config = ONLINE.with_(threshold=0.0)
    saved = tiny.measured.pop("tree_costs", None)
    try:
        tiny.measured["tree_costs"] = {"draft": {1: 1.0, 4: 4.0}, "target": {1: 10.0, 16: 400.0}}  # floor 2.9
        _, trace = _run(tiny, config)
        tiny.measured["tree_costs"] = CHEAP_ROWS
        _, cheap = _run(tiny, config)
    finally:
        tiny.measured.pop("tree_costs")
        if saved is not None:
            tiny.measured["tree_costs"] = saved
    _, plain = _run(tiny, DEFAULTS["ar"])
    assert trace.generated_ids == plain.generated_ids == cheap.generated_ids

    def deep_branches(step):
        return {n.branch for n in step.nodes if n.depth >= 2}

    wide = [s for s in trace.steps if sum(1 for n in s.nodes if n.depth == 1) >= 2]
    assert wide, "the warm-up drafts the published two roots"
    assert all(len(deep_branches(s)) <= 1 for s in trace.steps)
    stopped = [sig for s in wide for sig in s.stop_signals if sig.cost_pruned]
    assert stopped and all(sig.row_floor > 1 and set(sig.cost_pruned) <= set(sig.pruned) for sig in stopped)
    assert all(sig.chances[b] < sig.row_floor for sig in stopped for b in sig.cost_pruned)
    step = next(s for s in wide if any(sig.cost_pruned for sig in s.stop_signals))
    assert "chance of holding the accepted path" in " ".join(explain_step(step))
    hover = [t for tr in stop_figure(step).data if tr.name.endswith("pruned") for t in tr.hovertext]
    assert any("its rows cost more" in t for t in hover)
    assert any(len(deep_branches(s)) >= 2 for s in cheap.steps)
