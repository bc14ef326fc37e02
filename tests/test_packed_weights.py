"""Packed float32 weights (explorer/models/packed_weights.py): the same model to float rounding, the same greedy tokens
from our engine as from transformers' generate on the packed modules, and clear errors where packing cannot run."""

import pytest
import torch
from method_grid import PROMPT

from explorer.analysis.bench import run_hf_assisted
from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.models.loading import ModelPairError, load_named_pair, pack_weights
from explorer.models.packed_weights import PackedLinear, can_pack, pack_linear_weights
from explorer.models.tiny import tiny_pair

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


@needs_onednn
def test_a_packed_linear_computes_what_the_linear_did():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        want = lin(x)
        got = PackedLinear(lin)(x)
    assert got.shape == want.shape == (2, 5, 96)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_packing_a_pair_keeps_its_logits_and_greedy_tokens():
    stock, packed = tiny_pair(seed=3), tiny_pair(seed=3)
    assert pack_weights(packed, "on") is packed and packed.packed_weights
    assert not any(type(m) is torch.nn.Linear for m in packed.target.modules())
    assert any(isinstance(m, PackedLinear) for m in packed.draft.modules())
    ids = torch.tensor([stock.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        a, b = stock.target(ids).logits, packed.target(ids).logits
    assert (a - b).abs().max().item() < 1e-4
    prompt = stock.tokenizer.encode(PROMPT)
    runs = []
    for name in ("ar", "mcsd", "token-recycling"):
        eng = build_engine(packed, DEFAULTS[name].with_(fallback="off"), SamplingConfig(temperature=0.0))
        eng.start(prompt, 24)
        eng.run()
        runs.append(eng.state.committed[eng.state.n_prompt:])
        assert eng.trace.model["packed_weights"] is True
    hf = run_hf_assisted(packed, prompt, 24, SamplingConfig(temperature=0.0), helper="plain")
    assert runs[0] == runs[1] == runs[2] == hf["token_ids"]
    assert pack_weights(packed, "on") is packed  # once


def test_modes_and_errors():
    assert not load_named_pair("tiny").packed_weights  # auto: the tiny pair stays stock
    with pytest.raises(ModelPairError, match="packed-weights mode"):
        pack_weights(tiny_pair(), "sometimes")
    half = tiny_pair(dtype=torch.bfloat16)
    assert not can_pack(half.target)
    with pytest.raises(ModelPairError, match="float32 target"):
        pack_weights(half, "on")
    assert pack_weights(half, "auto") is half and not half.packed_weights
    with pytest.raises(ValueError, match="float32"):
        pack_linear_weights(half.target)


def test_dropped_file_pages_read_back_the_same_weights(tmp_path):
    """Packing gives back the pages of each weight it replaced (``drop_file_pages``); a page read again comes back
    from the weights file, so even a tensor still in use would keep its values."""
    from transformers import AutoModelForCausalLM

    from explorer.models.packed_weights import drop_file_pages, file_mappings
    from explorer.models.tiny import tiny_config

    big = AutoModelForCausalLM.from_config(tiny_config(4096, 1))  # an lm head of 4096 x 64 floats: 256 pages
    big.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    weight = loaded.lm_head.weight
    before = weight.detach().clone()
    mapped = file_mappings()
    assert any(lo <= weight.data_ptr() < hi for lo, hi in mapped)  # the weight is a view of the file
    assert drop_file_pages(weight, mapped) > 0
    assert torch.equal(weight.detach(), before)
    assert drop_file_pages(before, mapped) == 0  # not file-backed: left alone
