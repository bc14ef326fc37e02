"""Static KV caches (preallocated, fixed key width) give the same tokens and traces as dynamic ones; keeping a
tree path moves only that path's rows and leaves the layout of a fresh prefill."""

import pytest
import torch
from method_grid import GRID, IDS, PROMPT, same_traces, session

from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.machine import EngineError
from explorer.engine.runtime.kv_cache import DynamicKVCache, KVCacheError, StaticKVCache
from explorer.engine.sampling import SamplingConfig


@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_static_cache_gives_the_dynamic_cache_traces(tiny, case):
    cfg, temperature = GRID[case]
    dynamic = session(tiny, cfg, temperature, "dynamic")
    static = session(tiny, cfg, temperature, "static")
    assert static[0]["model"]["kv_cache"] == "static"
    same_traces(dynamic, static)


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_kept_path_has_the_layout_of_a_fresh_prefill(tiny, kv_cache):
    """After each step of a wide tree, every cache equals a fresh prefill of the committed tokens it covers."""
    eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2, 2)), SamplingConfig(temperature=1.0, seed=5),
                 kv_cache=kv_cache)
    eng.start(tiny.tokenizer.encode(PROMPT), 30)
    for _ in range(5):
        eng.step()
        for model, kv in ((tiny.target, eng.state.target_kv), (tiny.draft, eng.state.draft_kv)):
            fresh = DynamicKVCache()
            with torch.inference_mode():
                model(input_ids=torch.tensor([eng.state.committed[: kv.length]]), past_key_values=fresh.hf,
                      use_cache=True)
            fresh.length = kv.length
            for (k, v), (k0, v0) in zip(kv.layer_tensors(), fresh.layer_tensors()):
                assert torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5)


def test_keep_moves_rows_in_place(tiny):
    kv = StaticKVCache(tiny.target, 16)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.inference_mode():
        kv.before_forward(6)
        tiny.target(input_ids=ids, past_key_values=kv.hf, cache_position=torch.arange(6), use_cache=True)
        kv.after_forward(6)
    keys = kv.hf.layers[0].keys
    pointer, before = keys.data_ptr(), keys[:, :, :6].clone()
    assert kv.keep(2, [3, 5]) == 4 and kv.length == 4
    assert kv.hf.layers[0].keys.data_ptr() == pointer  # the preallocated buffer is kept
    assert torch.equal(keys[:, :, :4], before[:, :, [0, 1, 3, 5]])
    kv.rewind(1)
    assert kv.length == 1 and list(kv.layer_tensors())[0][0].shape[2] == 1


def test_static_cache_refuses_what_it_cannot_hold(tiny):
    kv = StaticKVCache(tiny.target, 8)
    with pytest.raises(KVCacheError, match="holds 8 positions"):
        kv.before_forward(9)
    with pytest.raises(EngineError, match="unknown KV cache"):
        build_engine(tiny, MethodConfig(method="sd"), SamplingConfig(), kv_cache="paged")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_static_cache_gives_the_dynamic_cache_traces_on_cuda(tiny_cuda, case):
    cfg, temperature = GRID[case]
    same_traces(session(tiny_cuda, cfg, temperature, "dynamic"), session(tiny_cuda, cfg, temperature, "static"))
