"""The graph runner: forwards padded to query-size buckets give the logits of unpadded forwards (CPU, padded eager
calls); on a GPU, replayed CUDA graphs give the traces of eager forwards."""

import numpy as np
import pytest
import torch
from method_grid import AUDIT_SAMPLES, GRID, IDS, PROMPT, _case_id, same_traces, session

from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.machine import EngineError
from explorer.engine.runtime.graphs import BUCKETS, GraphRunner, bucket_for, no_collection, padded_mask
from explorer.engine.runtime.kv_cache import DynamicKVCache, StaticKVCache
from explorer.engine.sampling import SamplingConfig
from explorer.engine.tree import DraftTree, step_mask, step_position_ids


def test_no_collection_inside_a_capture_and_the_collector_restored_after():
    """A graph records with the cyclic collector off (a collection inside a capture broke it on an H100); the
    collector comes back as it was, after an error too, and stays off where it was off."""
    import gc

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_buckets_and_padded_masks():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 33, 64, 65, 256)] == [1, 2, 4, 8, 64, 64, 128, 256]
    assert bucket_for(257) is None
    tree_rows = np.array([[True, True, False], [True, True, True]])  # 2 rows after 1 cached column
    m = padded_mask(tree_rows, 1, 2, 4, 8)
    assert m.shape == (4, 8) and (m[:2, :3] == tree_rows).all() and not m[:2, 3:].any()
    assert m[2].tolist() == [False] * 3 + [True] + [False] * 4 and m[3, 4] and m[3].sum() == 1  # own column
    causal = padded_mask(None, 2, 3, 4, 8)
    assert causal[:3, :5].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                       [True] * 5]


@pytest.mark.parametrize("n_tree", [1, 3, 6, 13])
def test_a_padded_tree_forward_gives_the_unpadded_logits(tiny, n_tree):
    """A tree of ``n_tree`` nodes after a cached prompt, through the runner (padded to its bucket) and through a
    plain forward on a dynamic cache: the same logits, and the same cache rows afterwards."""
    prompt = tiny.tokenizer.encode(PROMPT)
    tree = DraftTree()
    parents = [-1] + [max(0, (i - 1) // 2) for i in range(1, n_tree)]  # a binary-ish tree, level by level
    for level in sorted(set(_depths(parents))):
        idx = [i for i, d in enumerate(_depths(parents)) if d == level]
        tree.add_level([parents[i] for i in idx], [40 + i for i in idx])
    past = len(prompt) - 1
    mask = step_mask(past, 1, True, tree.anc, 0, len(tree))
    pos = step_position_ids(past, 1, True, tree.depth, 0, len(tree))
    ids = [prompt[-1]] + tree.token
    runner = GraphRunner(tiny.target, StaticKVCache(tiny.target, 128), capture=False)
    plain = DynamicKVCache()
    with torch.inference_mode():
        runner.forward(prompt[:-1], list(range(past)), None, 1)  # prefill (larger than no bucket: eager)
        tiny.target(input_ids=torch.tensor([prompt[:-1]]), past_key_values=plain.hf, use_cache=True)
        plain.length = past
        got = runner.forward(ids, pos, mask, keep=len(ids)).logits
        attn = torch.zeros(mask.shape).masked_fill_(~torch.from_numpy(mask), torch.finfo(torch.float32).min)
        ref = tiny.target(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                          attention_mask=attn[None, None], past_key_values=plain.hf, use_cache=True).logits[0]
    assert bucket_for(len(ids)) > len(ids) or len(ids) in BUCKETS
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    assert runner.kv.length == past + len(ids)
    plain.length = past + len(ids)
    for (k, v), (k0, v0) in zip(runner.kv.layer_tensors(), plain.layer_tensors()):
        assert torch.allclose(k, k0, atol=1e-5) and torch.allclose(v, v0, atol=1e-5)


def _depths(parents):
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_padded_buckets_give_the_unpadded_traces(tiny, case):
    cfg, temperature = GRID[case]
    same_traces(session(tiny, cfg, temperature, "dynamic"), session(tiny, cfg, temperature, "static", graphs=True))


def test_runners_are_reused_and_released(tiny):
    with pytest.raises(EngineError, match="static"):
        build_engine(tiny, DEFAULTS["sd"], SamplingConfig(), graphs=True)
    ids = tiny.tokenizer.encode(PROMPT)
    first = build_engine(tiny, DEFAULTS["mcsd-improved"], SamplingConfig(), kv_cache="static", graphs=True)
    first.start(ids, 12)
    first.step()
    runners = dict(first.forwards.runners)
    first.release()
    with pytest.raises(EngineError, match="released"):
        first.step()
    second = build_engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), SamplingConfig(), kv_cache="static",
                    graphs=True)
    second.start(ids, 12)  # same width class: the idle runners (and on a GPU their graphs) are taken again
    assert second.forwards.runners["target"] is runners["target"]
    assert second.forwards.runners["draft"] is runners["draft"]
    assert second.state.target_kv.length == len(ids)
    second.run()
    second.release()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(GRID)), ids=IDS)
def test_cuda_graphs_give_the_eager_traces(tiny_cuda, case):
    def runners():  # the idle ones: every session gives its runners back
        return [r for idle in tiny_cuda.graph_runners.values() for r in idle]

    cfg, temperature = GRID[case]
    replays = sum(r.replays for r in runners())
    # The full distribution, not top-p 0.95: which tokens a nucleus keeps is a step function of the logits, and
    # graphed and eager kernels round differently. On the H100 a row's mass before its boundary token was 0.95 +
    # 6e-8 eager and 0.95 exactly graphed (a reused runner prefills through a bucket graph, a fresh one eagerly):
    # 37 tokens kept against 36, a visible change in p. The CPU's padded-bucket test keeps top-p.
    same_traces(session(tiny_cuda, cfg, temperature, "static", top_p=1.0),
                session(tiny_cuda, cfg, temperature, "static", graphs=True, top_p=1.0))
    assert runners() and all(r.capture for r in runners()) and sum(r.replays for r in runners()) > replays
    assert all(r.captures <= 2 * len(BUCKETS) for r in runners())


def test_capturing_all_buckets_is_a_no_op_off_cuda(tiny):
    eng = build_engine(tiny, DEFAULTS["hybrid"], SamplingConfig(), kv_cache="static", graphs=True)
    eng.start(tiny.tokenizer.encode(PROMPT), 8)
    assert eng.capture_graphs() == 0 and eng.state.target_kv.length == len(tiny.tokenizer.encode(PROMPT))
    eng.run()
    eng.release()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [i for i, (c, t) in enumerate(GRID) if t == 0.0 and (
    c.method == "hybrid" or (c.method == "mcsd-improved" and c.decision_model == "hidden"))])
def test_buckets_captured_up_front_leave_no_capture_to_the_run(tiny_cuda, case):
    """The bench's warm-up (``bench.warm_graphs``): every bucket captured after the prefill (with the draft's
    hidden states where the stop policy reads them), so no step of the run pays a capture, and the traces are
    those of lazily captured graphs."""
    from explorer.analysis.bench import warm_graphs

    def captures():
        return sum(r.captures for idle in tiny_cuda.graph_runners.values() for r in idle)

    cfg, temperature = GRID[case]
    lazy = session(tiny_cuda, cfg, temperature, "static", graphs=True)
    tiny_cuda.graph_runners.clear()  # fresh runners: nothing captured yet
    ids = tiny_cuda.tokenizer.encode(PROMPT)
    assert warm_graphs(tiny_cuda, cfg, ids, 24) >= len(BUCKETS)
    assert warm_graphs(tiny_cuda, cfg, ids, 24) == 0  # the same runners, all captured
    before = captures()
    same_traces(lazy, session(tiny_cuda, cfg, temperature, "static", graphs=True))
    assert captures() == before


# Chain replays: the levels of one child per node run several at a time, tokens chosen on the device.
# Each case drafts chains at least three levels deep on the tiny pair in some step, so replays run.
_improved = MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=6, fallback="off")
CHAINS = [(c, t) for c, t in GRID if c.method == "sd"] + [
    (_improved.with_(stop="confidence", threshold=0.1), 0.0),
    (_improved.with_(max_depth=8, stop="prune", threshold=0.35), 0.0),  # branches pruned, decision features read
    (_improved.with_(lossy=True, width=2, k_config=(1,), max_depth=5, stop="none"), 0.0),
    (DEFAULTS["hybrid"].with_(max_depth=6, stop="none", fallback="off"), 0.0),
    (_improved.with_(stop="none"), 0.8),
    (_improved.with_(stop="specdec++"), 0.8),
    (_improved.with_(stop="goodput", threshold=0.1), 0.8),
    (_improved.with_(verifier="spechub", stop="confidence"), 0.8),
    (DEFAULTS["hybrid"].with_(max_depth=6, stop="confidence", verifier="mcns", fallback="off"), 0.8),
]
CHAIN_IDS = [_case_id(c, t) for c, t in CHAINS]
REPLAY_KEYS = {"chain_replays", "chain_levels", "draft_calls"}  # what a replay may add or change in a trace


def _without_replay_records(trace):
    """A trace (``to_dict``) less what chain replays add or change: their record and the draft forwards counted
    (levels a replay computes past the policy's stop count too)."""
    if isinstance(trace, dict):
        return {k: _without_replay_records(v) for k, v in trace.items() if k not in REPLAY_KEYS}
    if isinstance(trace, list):
        return [_without_replay_records(v) for v in trace]
    return trace


def _replays(traces) -> list[dict]:
    return [r for t in traces for s in t["steps"] for r in (s.get("drafter") or {}).get("chain_replays", [])]


@pytest.mark.parametrize("case", [i for i, (c, t) in enumerate(CHAINS) if t == 0.0], ids=lambda i: CHAIN_IDS[i])
def test_chain_replays_draft_the_trees_of_level_by_level_drafting(tiny, case):
    """Greedy: the tokens chosen on the device are the level loop's, so the trees, verifications and outputs are
    the same; the replays ran, and read no level they did not compute."""
    cfg, temperature = CHAINS[case]
    plain = session(tiny, cfg, temperature, "static", graphs=True)
    chained = session(tiny, cfg, temperature, "static", graphs=True, chain_levels=8)
    replays = _replays(chained)
    assert replays and all(2 <= r["levels"] <= 8 and 1 <= r["read"] <= r["levels"] for r in replays), replays
    assert chained[0]["model"]["chain_levels"] == 8
    same_traces(_without_replay_records(plain), _without_replay_records(chained))
    calls = [sum(s["draft_calls"] for t in traces for s in t["steps"]) for traces in (plain, chained)]
    assert calls[1] - calls[0] == sum(r["levels"] - r["read"] for r in replays)  # the levels past the stop


@pytest.mark.parametrize("case", [i for i, (c, t) in enumerate(CHAINS) if t > 0.0], ids=lambda i: CHAIN_IDS[i])
def test_sampled_chain_replays_run_and_replay_deterministically(tiny, case):
    """Sampling: the replay draws from the same q with uniforms of the run's generator, so one seed gives one
    trace; every drafted chain node records the q it was drawn from."""
    cfg, temperature = CHAINS[case]
    first = session(tiny, cfg, temperature, "static", graphs=True, chain_levels=4)
    assert _replays(first)
    same_traces(first, session(tiny, cfg, temperature, "static", graphs=True, chain_levels=4))
    for trace in first:
        for step in trace["steps"]:
            assert all(n["q"] is not None and n["q"] > 0 for n in step["nodes"][1:] if n["source"] == "draft")


@pytest.mark.parametrize("cfg", [MethodConfig(method="sd", gamma=4, verifier="rrs", fallback="off"),
                                 MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=4, stop="confidence",
                                              threshold=0.1, fallback="off")], ids=["sd", "mcsd-improved"])
def test_chain_replays_sample_from_the_target(tiny, cfg):
    """The audit (first token and token pairs against the exact target law, fixed seeds): a chain node drawn on the
    device keeps speculative sampling lossless."""
    from explorer.analysis.audit import audit_engine

    sampling = SamplingConfig(temperature=0.8, seed=777_000)
    engine = build_engine(tiny, cfg, sampling, kv_cache="static", graphs=True, chain_levels=4)
    r = audit_engine(engine, tiny.tokenizer.encode("def f(x):\n    return"), AUDIT_SAMPLES)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert r.pairs.dof >= 3


def test_chain_replays_need_graphs(tiny):
    with pytest.raises(EngineError, match="chain_levels"):
        build_engine(tiny, DEFAULTS["sd"], SamplingConfig(), kv_cache="static", chain_levels=4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(CHAINS)), ids=CHAIN_IDS)
def test_cuda_chain_replays(tiny_cuda, case):
    """On a GPU: greedy chain replays give the level loop's traces; sampled ones run; every chain shape the run
    can use is captured up front (``capture_graphs``), so the run captures none."""
    cfg, temperature = CHAINS[case]
    chained = session(tiny_cuda, cfg, temperature, "static", graphs=True, chain_levels=8)
    assert _replays(chained)
    if temperature == 0.0:
        same_traces(_without_replay_records(session(tiny_cuda, cfg, temperature, "static", graphs=True)),
                    _without_replay_records(chained))
    tiny_cuda.graph_runners.clear()
    eng = build_engine(tiny_cuda, cfg, SamplingConfig(temperature=temperature, top_p=0.95, seed=3),
                       kv_cache="static", graphs=True, chain_levels=8)
    eng.start(tiny_cuda.tokenizer.encode(PROMPT), 24)
    assert eng.capture_graphs() > 0
    before = eng.forwards.captures
    eng.run()
    assert eng.forwards.captures == before
    eng.release()
