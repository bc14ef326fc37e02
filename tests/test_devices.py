"""Every tensor lives on the device it is used on.

CI has no GPU, so the CPU guard runs the method grid under ``torch.device("meta")`` as the default device: the tiny
pair stays on the CPU, and any factory call (``torch.tensor``, ``torch.empty``, a module's parameters) that forgets
its ``device=`` makes a meta tensor, which fails loudly the moment it meets a real one. The ``cuda`` tests run the
same grid, greedy equality with ``ar``, the audit and the embedded pair on a GPU (skipped without one).
"""

import os

import pytest
import torch
from method_grid import GRID, IDS, PROMPT

from explorer.analysis.audit import audit
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig


def _exercise(pair, cfg: MethodConfig, temperature: float, capture_features: bool = False,
              kv_cache: str = "dynamic"):
    """Start, three steps, rewind with a new seed, one more step: every code path of a session."""
    graphs = kv_cache == "static+graphs"
    eng = build_engine(pair, cfg, SamplingConfig(temperature=temperature, top_p=0.95, seed=3),
                 capture_features=capture_features, kv_cache=kv_cache.removesuffix("+graphs"), graphs=graphs)
    eng.start(pair.tokenizer.encode(PROMPT), 16)
    eng.run(max_steps=3)
    eng.rewind(seed=4)
    eng.step()
    return eng


# ---------------------------------------------------------------------------------------------------- CPU guard

@pytest.mark.parametrize("kv_cache", ["dynamic", "static", "static+graphs"])
@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_no_tensor_is_made_on_the_default_device(tiny, case, kv_cache):
    cfg, temperature = GRID[case]
    with torch.device("meta"):
        eng = _exercise(tiny, cfg, temperature, kv_cache=kv_cache)
    assert all(n.status for s in eng.trace.steps for n in s.nodes)
    assert eng.trace.steps[-1].committed_ids


def test_the_guard_catches_a_factory_call_without_its_device(tiny):
    """The guard itself: a tensor built without ``device=`` inside the engine fails under the meta default."""
    import explorer.engine.stop_models.features as engine_module  # the model drafter builds its features through it

    original = engine_module.path_features

    def forgetful(dist, q, depth, cum_q):  # what the model drafter did before: host tensors beside device features
        return original(dist, torch.tensor(q.tolist()), depth, cum_q)

    engine_module.path_features = forgetful
    try:
        with torch.device("meta"), pytest.raises((RuntimeError, NotImplementedError)):
            _exercise(tiny, MethodConfig(method="mcsd-improved", max_depth=4, stop="decision"), 0.0)
    finally:
        engine_module.path_features = original


@pytest.mark.parametrize("adapt,stop", [("threshold", "decision"), ("last-layer", "prune")])
def test_online_adaptation_under_the_guard(tiny, adapt, stop):
    with torch.device("meta"):
        eng = _exercise(tiny, MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop=stop,
                                           threshold=0.3, adapt=adapt), 0.8)
    assert eng.trace.steps[-1].adaptation["records"] > 0


def test_audit_and_feature_capture_under_the_guard(tiny):
    from explorer.decision.collect import _to_tensors, step_records

    with torch.device("meta"):
        r = audit(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), SamplingConfig(temperature=1.0, seed=5),
                  tiny.tokenizer.encode(PROMPT), 20)
        eng = _exercise(tiny, MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="none"), 0.8,
                        capture_features=True)
        shard = _to_tensors(step_records(eng), tiny.draft.config.hidden_size)
    assert r.samples == 20
    assert all(t.device.type == "cpu" for t in shard.values()) and shard["dist"].shape[0] > 0


# ---------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kv_cache", ["dynamic", "static", "static+graphs"])
@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_every_method_runs_on_cuda(tiny_cuda, case, kv_cache):
    cfg, temperature = GRID[case]
    eng = _exercise(tiny_cuda, cfg, temperature, kv_cache=kv_cache)
    assert eng.trace.model["device"].startswith("cuda")
    assert sum(len(s.committed_ids) for s in eng.trace.steps) >= 1


@pytest.mark.cuda
@cuda
def test_greedy_methods_reproduce_ar_on_cuda(tiny_cuda):
    ids = tiny_cuda.tokenizer.encode(PROMPT)

    def run(cfg):
        eng = build_engine(tiny_cuda, cfg, SamplingConfig(temperature=0.0))
        eng.start(ids, 40)
        return eng.run().generated_ids

    ar = run(DEFAULTS["ar"])
    assert len(ar) == 40 or ar[-1] in tiny_cuda.eos_token_ids
    for cfg, temperature in GRID:
        if temperature == 0.0 and not cfg.is_lossy:
            assert run(cfg) == ar, cfg


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("verifier", ["rrs", "rrs-replacement", "mcns", "spechub"])
def test_the_audit_passes_on_cuda(tiny_cuda, verifier):
    r = audit(tiny_cuda, MethodConfig(method="mcsd", k_config=(2, 2), verifier=verifier),
              SamplingConfig(temperature=1.0, seed=7_000), tiny_cuda.tokenizer.encode(PROMPT), 600)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)


@pytest.mark.cuda
@pytest.mark.real
@cuda
def test_embedded_pair_on_cuda():
    """The embedded pair on the GPU (bf16): ``ar`` reproduces transformers' ``generate``; every lossless default
    method reproduces ``ar`` up to bf16 near-ties and accepts drafts; the default method's decision model runs."""
    from explorer.analysis.equivalence import check_prompt
    from explorer.analysis.prompts import encode_prompt, humaneval
    from explorer.models.loading import load_default_pair
    from explorer.trace.metrics import run_metrics

    pair = load_default_pair(device="cuda")
    assert pair.device.type == "cuda" and pair.dtype == torch.bfloat16
    ids = encode_prompt(pair.tokenizer, humaneval()[2].text)
    report = check_prompt(pair, ids, 48)
    assert report["methods"]["ar"]["matches"], report["methods"]["ar"]["divergence"]
    for name, r in report["methods"].items():
        assert r["matches"] or r["divergence"]["near_tie"], (name, r["divergence"])
        if name != "ar":
            assert r["steps"] < len(r["ids"]), (name, r["steps"])  # more than one token per target call
    eng = build_engine(pair, DEFAULTS["mcsd-improved"], SamplingConfig(temperature=0.7, seed=1))
    eng.start(ids, 48)
    m = run_metrics(eng.run())
    assert m["tokens_per_target_call"] > 1.5 and any(s.stop_signals for s in eng.trace.steps)
    if os.environ.get("SPEC_EXPLORER_REPORT"):
        print({k: (v["matches"], v["steps"], round(v["seconds"], 2)) for k, v in report["methods"].items()}, m)
