"""Host reads per step (explorer/engine/runtime/host_reads.py): the CPU's stand-in for the host synchronisations a GPU
step makes (single digits per step). Verification on odds reads a fixed handful of values however large the
tree; the reads that remain scale with draft levels, not with nodes."""

import pytest
import torch

from explorer.analysis.bench import method_for_label
from explorer.engine.factory import build_engine
from explorer.engine.runtime.host_reads import HostReadCounter
from explorer.engine.sampling import RowDists, SamplingConfig
from explorer.engine.tree import DraftTree
from explorer.engine.verify import rules as verify

V = 50


def test_the_counter_counts_reads_of_values_and_nothing_else():
    x = torch.arange(6.0)
    with HostReadCounter(sites=True) as c:
        y = (x * 2 + 1).softmax(-1).cumsum(0)  # device work: no read
        assert c.reads == 0
        y.tolist()
        float(y[0])
        if y[1] > 0:  # bool of a tensor
            pass
        x[x > 2]  # boolean mask: the output's size is a read
        y.argmax().item()
    assert c.reads == 5
    assert not c.sites  # sites name explorer's own lines only; these reads are the test's


def _wide_tree(free_chain: int, seed: int):
    """Model-drafted (3, 2) levels under the anchor and a free (lookup) chain of ``free_chain`` nodes beside them;
    random p and q rows. Returns (tree, p rows ``(N + 1, V)``, q rows)."""
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree()
    tree.add_level([-1] * 4, [1, 2, 3, 7], source=["draft"] * 3 + ["lookup"])
    tree.add_level([0, 0, 1, 3], [4, 5, 6, 8], source=["draft"] * 3 + ["lookup"])
    for i in range(free_chain - 2):
        tree.add_level([len(tree) - 1], [9 + i], source="lookup")
    p = torch.rand(len(tree) + 1, V, generator=g).softmax(-1)
    q = {r: torch.rand(V, generator=g).softmax(-1) for r in (0, 1, 2)}
    return tree, p, q


@pytest.mark.parametrize("rule", ["rrs", "rrs-replacement", "greedy"])
def test_verification_reads_do_not_grow_with_the_tree(rule):
    """The old walk read each tested node's p(x), q(x) and draw (a GPU synchronisation each); on odds the reads
    are the same handful (at most 5) for a 3-node free chain and a 40-node one."""
    counts = {}
    for chain in (3, 40):
        tree, p, q = _wide_tree(chain, seed=chain)
        if rule == "greedy":  # the free chain is the argmax all the way down, so the walk tests every node
            logits = torch.randn(len(tree) + 1, V, generator=torch.Generator().manual_seed(chain))
            for i in [3] + [i for i in range(4, len(tree)) if tree.source[i] == "lookup"]:
                logits[tree.parent[i] + 1, tree.token[i]] = 20.0
            p = RowDists(logits, SamplingConfig(temperature=0.0))  # as the engine hands them: best tokens batched
        with HostReadCounter(sites=True) as c:
            r = verify.run_verifier(rule, tree, p, q, torch.Generator().manual_seed(0))
        counts[chain] = c.reads
        assert all(site.startswith(("engine/verify/rules.py", "engine/verify/expectation.py",
                                    "engine/verify/residuals.py", "engine/drafting.py", "engine/sampling.py"))
                   for site in c.sites), c.sites
        assert r.bonus is not None
        if rule == "greedy":
            assert len(r.path) == chain  # the whole chain accepted: every node was tested
    assert max(counts.values()) <= 5, counts  # odds, draws, residual tops, bonus: not one per node


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_long_lookup_copy_costs_a_handful_of_reads(tiny, temperature):
    """Prompt lookup copying a repeated text: trees of many nodes and no draft forward; on the CPU
    ``build_engine(count_syncs=True)`` records each step's reads, and no step needs more than a handful."""
    text = "def add(a, b):\n    return a + b\n\n" * 4
    eng = build_engine(tiny, method_for_label("prompt-lookup"), SamplingConfig(temperature=temperature, seed=1),
                 count_syncs=True)
    eng.start(tiny.tokenizer.encode(text), 24)
    eng.run()
    steps = eng.trace.steps
    assert steps and all(s.host_syncs is not None for s in steps)
    assert max(len(s.nodes) for s in steps) >= 8  # the copies are long: the old per-node reads would show
    assert max(s.host_syncs for s in steps) <= 8, [(len(s.nodes), s.host_syncs) for s in steps]


@pytest.mark.parametrize("label", ["hybrid", "sd"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_model_drafting_reads_grow_with_levels_not_nodes(tiny, label, temperature):
    """With the draft model, a step reads a few values per draft level (its best tokens, the stop policy's
    inputs, the level's draws; a draw in the tail of the tiny model's flat distribution reads its row) and a fixed
    handful for verification and the trace."""
    eng = build_engine(tiny, method_for_label(label), SamplingConfig(temperature=temperature, seed=1), count_syncs=True)
    eng.start(tiny.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):"), 24)
    eng.run()
    for s in eng.trace.steps:
        assert s.host_syncs <= 10 + 8 * s.draft_calls, (s.index, s.host_syncs, s.draft_calls, len(s.nodes))


def test_attached_values_ride_with_the_rows_best_tokens():
    """A draft level's decision features and draws come to the host in the transfer of its best tokens: one read
    for all three; attaching after that transfer, or a wrong shape, is an error."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g)
    features, draws = torch.randn(3, 11, generator=g), torch.rand(3, 4, generator=g, dtype=torch.float64)
    rows = RowDists(logits, SamplingConfig(temperature=0.7))
    rows.attach("dist", features)
    rows.attach("draws", draws)
    with pytest.raises(ValueError, match="rows, k"):
        rows.attach("flat", torch.rand(12))
    with HostReadCounter() as c:
        top = rows.top([0, 1, 2], 5)
        got_features, got_draws = rows.attached("dist"), rows.attached("draws")
    assert c.reads == 1
    assert top[1][0][0] == int(logits[1].argmax())
    assert torch.equal(torch.tensor(got_features, dtype=torch.float32), features)
    assert torch.equal(torch.tensor(got_draws, dtype=torch.float64), draws)
    with pytest.raises(RuntimeError, match="before the first read"):
        rows.attach("late", torch.zeros(3, 1))
