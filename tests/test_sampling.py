from itertools import permutations

import pytest
import torch
from scipy.stats import chi2

from explorer.engine.drafting import (draw_without_replacement, sample_one, sample_with_replacement,
                                      sample_without_replacement)
from explorer.engine.sampling import RowDists, SamplingConfig, logits_to_probs


def test_greedy_is_one_hot_at_argmax():
    p = logits_to_probs(torch.tensor([[0.1, 2.0, -1.0]]), SamplingConfig(temperature=0))
    assert p.tolist() == [[0.0, 1.0, 0.0]]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=1e-6)
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))  # 0.5 < 0.7 -> keep 2
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    p = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.1))  # first token always kept
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    assert hot[0] > 0.5


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_sampling_settings(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)


def test_row_dists_are_lazy_and_offset():
    logits = torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    fixed = {0: (torch.tensor([0.25, 0.75]), torch.tensor([0.0, 0.0]))}
    d = RowDists(logits, SamplingConfig(temperature=1.0), offset=1, fixed=fixed)
    assert d[0].tolist() == [0.25, 0.75]
    assert torch.allclose(d[2], torch.softmax(torch.tensor([3.0, 0.0]), -1))
    g = RowDists(logits, SamplingConfig(temperature=0))
    assert g[1].tolist() == [1.0, 0.0]
    assert abs(g.shown(0, 1) - float(torch.softmax(torch.tensor([0.0, 1.0]), -1)[1])) < 1e-6


# ------------------------------------------------------------------ drawing tokens (engine/drafting.py)


def _chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson's test of observed counts against expected probabilities; cells expecting fewer than 5 are pooled."""
    stat, cells, rare_count, rare_prob = 0.0, 0, 0, 0.0
    for key, prob in expected.items():
        if prob * n >= 5:
            stat += (counts.get(key, 0) - prob * n) ** 2 / (prob * n)
            cells += 1
        else:
            rare_count, rare_prob = rare_count + counts.get(key, 0), rare_prob + prob
    if rare_prob * n >= 1:
        stat += (rare_count - rare_prob * n) ** 2 / (rare_prob * n)
        cells += 1
    return float(chi2.sf(stat, cells - 1))


def _sequential_law(q: torch.Tensor, k: int) -> dict:
    """Exact probabilities of each ordered k-tuple under sampling without replacement."""
    law = {}
    support = [i for i in range(len(q)) if q[i] > 0]
    for tup in permutations(support, k):
        prob, left = 1.0, 1.0
        for t in tup:
            prob *= float(q[t]) / left
            left -= float(q[t])
        law[tup] = prob
    return law


@pytest.mark.parametrize("q_list, top", [
    ([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], 2),  # most second draws and some first draws land in the tail
    ([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], 6),  # the whole row is the top list
    ([1 - 4e-4, 2e-4, 1e-4, 6e-5, 4e-5, 0.0], 3),  # a sure draft: the second draw renormalises from the row
    ([0.9985, 5e-4, 4e-4, 3e-4, 2e-4, 1e-4], 2),  # 0.15 % left: the top walk, then a small tail
])
def test_sample_without_replacement_has_the_sequential_law(q_list, top):
    q = torch.tensor(q_list, dtype=torch.float32)
    vals, ids = torch.topk(q, top)
    g = torch.Generator().manual_seed(7)
    n = 30000
    counts: dict = {}
    for _ in range(n):
        drawn = tuple(sample_without_replacement(ids.tolist(), vals.tolist(), lambda: q, 2, g))
        assert len(set(drawn)) == 2 and all(q[t] > 0 for t in drawn)
        counts[drawn] = counts.get(drawn, 0) + 1
    law = _sequential_law(q, 2)
    # the rare pairs carry no chi-square cells: check the conditional law of the second draw instead
    if q_list[0] > 0.99:
        second = {b: sum(c for (a, b2), c in counts.items() if a == 0 and b2 == b) for b in range(1, 6)}
        expected = {b: float(q[b]) / float(q[1:].sum()) for b in range(1, 6)}
        assert _chi_square_p(second, expected, sum(second.values())) > 1e-3, second
    else:
        assert _chi_square_p(counts, law, n) > 1e-3


def test_draw_without_replacement_returns_only_tokens_with_mass():
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([0.0, 0.7, 0.0, 0.3])
    for _ in range(200):
        drawn = draw_without_replacement(q, 3, g)
        assert sorted(drawn) == [1, 3]
    assert draw_without_replacement(torch.tensor([0.0, 1.0, 0.0]), 2, g) == [1]


def test_sample_one_and_with_replacement_have_the_law_and_skip_zeros():
    g = torch.Generator().manual_seed(3)
    q = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    n = 20000
    draws = sample_with_replacement(q, n, g)
    counts = {t: draws.count(t) for t in set(draws)}
    assert set(counts) <= {1, 3, 4}
    assert _chi_square_p(counts, {1: 0.5, 3: 0.3, 4: 0.2}, n) > 1e-3
    assert sample_one(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    assert sample_one(torch.tensor([0.0, 3.0, 1.0]), g) in (1, 2)  # unnormalised weights
    with pytest.raises(ValueError):
        sample_one(torch.zeros(4), g)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_row_dists_batched_rows_agree_with_single_rows(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 50, generator=g).to(torch.bfloat16)
    cfg = SamplingConfig(temperature=temperature)
    part = RowDists(logits, cfg, stat_rows=[0, 3])  # rows 1, 2, 4 computed one by one
    whole = RowDists(logits, cfg)
    for r in range(5):
        got, want = part.top([r], 8)[r], whole.top([r], 8)[r]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [p for _, p in got] == pytest.approx([p for _, p in want], rel=1e-5)
        ref = torch.softmax(logits[r].float() / (temperature or 1.0), -1)
        assert part.shown(r, 7) == pytest.approx(float(ref[7]), rel=1e-4)
        assert part.top_ids(r, 3) == torch.topk(logits[r].float(), 3).indices.tolist()
        if temperature:
            ids, probs = part.top_processed(r, 4)
            assert ids == torch.topk(ref, 4).indices.tolist()
            assert probs == pytest.approx(torch.topk(ref, 4).values.tolist(), rel=1e-4)


def test_row_dists_with_a_fixed_anchor_row_and_a_subset_of_batched_rows():
    """The engine's target rows: row 0 kept from the previous step, rows 1.. from the forward, only parents batched."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g)  # rows 1..4
    anchor = torch.randn(30, generator=g)
    cfg = SamplingConfig(temperature=0.7)
    d = RowDists(logits, cfg, offset=1, fixed={0: (logits_to_probs(anchor, cfg), anchor)}, stat_rows=[0, 2, 4])
    for r, lg in [(0, anchor)] + [(i + 1, logits[i]) for i in range(4)]:
        ref = torch.softmax(lg / 0.7, -1)
        assert torch.allclose(d[r], ref, atol=1e-6)
        assert d.shown(r, 5) == pytest.approx(float(ref[5]), rel=1e-5)
        ids, probs = d.top_processed(r, 3)
        assert ids == torch.topk(ref, 3).indices.tolist()
        assert probs == pytest.approx(torch.topk(ref, 3).values.tolist(), rel=1e-5)
        assert d.log_normalizer(r) == pytest.approx(float(torch.logsumexp(lg, -1)), rel=1e-6)


def test_the_greedy_token_is_the_lowest_id_among_tied_logits():
    """Greedy verification takes its best tokens from the batched top-k transfer; on an exact tie it must still pick
    what ``argmax`` (plain decoding, transformers) picks: the lowest id."""
    logits = torch.zeros(2, 40)
    logits[0, 7] = logits[0, 30] = 5.0  # tie
    logits[1, 12] = 3.0  # no tie
    rows = RowDists(logits, SamplingConfig(temperature=0.0))
    assert rows.argmax(0) == 7 and rows.argmax(1) == 12
