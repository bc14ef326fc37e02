import pytest
import torch

from explorer.sampling import RowDists, SamplingConfig, logits_to_probs


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
