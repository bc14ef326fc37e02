"""Fused kernels (explorer/models/fused_kernels.py): a pair whose norms, MLPs and rotary embedding run compiled gives
the stock pair's logits to rounding and its greedy tokens, says so in its traces, and is undone cleanly (the rotary
function is shared by every model of the family in the process)."""

import sys

import pytest
import torch
from method_grid import PROMPT

from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.models.fused_kernels import fusable_modules, unfuse_kernels
from explorer.models.loading import ModelPairError, fuse_pair, pack_weights
from explorer.models.tiny import tiny_pair


def test_a_fused_pair_keeps_its_logits_and_greedy_tokens():
    stock, fused = tiny_pair(seed=3), tiny_pair(seed=3)
    family = sys.modules[type(fused.target).__module__]
    rotary = family.apply_rotary_pos_emb
    # the target's 2 layers: 2 norms and an MLP each, and the final norm; the draft's 1 layer: 3 + 1
    assert len(fusable_modules(fused.target)) == 7 and len(fusable_modules(fused.draft)) == 4
    try:
        assert fuse_pair(fused) is fused and fused.fused_kernels
        assert family.apply_rotary_pos_emb is not rotary  # compiled, for the whole family
        assert all("forward" in m.__dict__ for m in fusable_modules(fused.target))
        ids = torch.tensor([stock.tokenizer.encode(PROMPT)])
        with torch.inference_mode():
            a, b = stock.target(ids).logits, fused.target(ids).logits
        assert (a - b).abs().max().item() < 1e-4
        prompt = stock.tokenizer.encode(PROMPT)
        for name in ("ar", "mcsd-improved"):
            tokens = []
            for pair in (stock, fused):
                eng = build_engine(pair, DEFAULTS[name].with_(fallback="off"), SamplingConfig(temperature=0.0))
                eng.start(prompt, 24)
                eng.run()
                tokens.append(eng.state.committed[eng.state.n_prompt:])
                assert eng.trace.model.get("fused_kernels", False) is pair.fused_kernels
            assert tokens[0] == tokens[1], name
        assert fuse_pair(fused) is fused  # once
    finally:
        for model in (fused.target, fused.draft):
            unfuse_kernels(model)
    assert family.apply_rotary_pos_emb is rotary  # the last fused model of the family gave it back
    assert not any("forward" in m.__dict__ for m in fusable_modules(fused.target))


def test_modes_and_what_is_left_alone():
    with pytest.raises(ModelPairError, match="fused-kernels mode"):
        fuse_pair(tiny_pair(), "sometimes")
    pair = tiny_pair()
    assert fuse_pair(pair, "off") is pair and not pair.fused_kernels
    if torch.backends.mkldnn.is_available():  # an MLP of packed (opaque oneDNN) linears is not compiled; norms are
        pack_weights(pair, "on")
        kinds = {type(m).__name__ for m in fusable_modules(pair.target)}
        assert kinds == {"Qwen2RMSNorm"}
