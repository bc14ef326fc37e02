import pytest
import torch

from explorer.analysis.equivalence import hf_greedy
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.machine import EngineError
from explorer.engine.sampling import SamplingConfig
from explorer.engine.tree import TreeShapeError
from explorer.lessons.teach import explain_step
from explorer.trace.metrics import run_metrics
from explorer.trace.records import ACCEPTED, REJECTED, UNVERIFIED, RunTrace

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "x"]
LOSSLESS = [
    MethodConfig(method="sd", gamma=3),
    MethodConfig(method="sd", gamma=6),
    MethodConfig(method="mcsd", k_config=(4, 2, 2)),
    MethodConfig(method="mcsd", k_config=(3, 1, 2, 1)),
    MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs-replacement"),
    MethodConfig(method="mcsd", k_config=(2, 2, 2), verifier="spechub"),
    MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, threshold=0.2),
    MethodConfig(method="mcsd-improved", k_config=(1,), max_depth=4, stop="none"),
    # learned stop policies (the decision model shipped for the tiny pair): stopping never changes the output
    MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38),
    MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="prune", threshold=0.4),
    MethodConfig(method="mcsd-improved", k_config=(3,), max_depth=5, stop="specdec++", threshold=0.85,
                 decision_model="dist"),
    MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38,
                 branch_threshold=0.3),
    MethodConfig(method="mcsd", k_config=(3, 2), branch_threshold=0.25),
]


def run(pair, cfg, prompt_ids, n, sampling=None):
    eng = build_engine(pair, cfg, sampling or SamplingConfig())
    eng.start(prompt_ids, n)
    return eng, eng.run()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ar_matches_transformers_greedy_generate(tiny, prompt):
    ids = tiny.tokenizer.encode(prompt)
    ref = hf_greedy(tiny, ids, 30)
    _, trace = run(tiny, DEFAULTS["ar"], ids, 30)
    assert trace.generated_ids == ref


@pytest.mark.parametrize("cfg", LOSSLESS, ids=lambda c: f"{c.method}-{c.k_config}-{c.gamma}-{c.verifier}-{c.stop}")
@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_lossless_method_matches_ar_when_greedy(tiny, cfg, prompt):
    ids = tiny.tokenizer.encode(prompt)
    _, ar = run(tiny, DEFAULTS["ar"], ids, 40)
    _, tr = run(tiny, cfg, ids, 40)
    assert tr.generated_ids == ar.generated_ids
    assert len(tr.steps) <= len(ar.steps)


def test_speculation_saves_target_calls_on_a_pair_that_agrees(tiny):
    # Draft == target: every draft token must be accepted, so each call commits gamma + 1 tokens.
    from explorer.models.pair import make_pair

    same = make_pair(tiny.target, tiny.target, tiny.tokenizer, name="same", draft_id="t", target_id="t")
    ids = tiny.tokenizer.encode(PROMPTS[0])
    _, tr = run(same, MethodConfig(method="sd", gamma=4), ids, 25)
    assert [len(s.committed_ids) for s in tr.steps] == [5] * 5
    _, tr = run(same, MethodConfig(method="mcsd", k_config=(3, 2)), ids, 24)
    assert all(s.accepted_draft_len == 2 for s in tr.steps)


def _fresh_kv(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("cfg", [MethodConfig(method="mcsd", k_config=(3, 2, 2)),
                                 MethodConfig(method="mcsd-improved", lossy=True, width=3, k_config=(1,), max_depth=3)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_kv_caches_hold_exactly_the_committed_prefix(tiny, cfg, temperature):
    """After every step each trimmed cache equals a fresh prefill of the committed tokens it covers."""
    ids = tiny.tokenizer.encode(PROMPTS[1])
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=temperature, seed=3))
    eng.start(ids, 30)
    for _ in range(6):
        eng.step()
        for model, kv, n in ((tiny.target, eng.state.target_kv, eng.state.target_kv.length),
                             (tiny.draft, eng.state.draft_kv, eng.state.draft_kv.length)):
            expected = len(eng.state.committed) - (0 if (cfg.is_lossy and model is tiny.target) else 1)
            assert n <= len(eng.state.committed)
            if model is tiny.target:
                assert n == expected
            fresh = _fresh_kv(model, eng.state.committed[:n])
            for (keys, values), ref in zip(kv.layer_tensors(), fresh.layers):
                assert torch.allclose(keys, ref.keys, atol=1e-5)
                assert torch.allclose(values, ref.values, atol=1e-5)


def test_tree_forward_logits_equal_sequential_path_logits(tiny):
    """The float tree mask and position ids make every node see exactly its own path."""
    ids = tiny.tokenizer.encode(PROMPTS[0])
    eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(temperature=1.0, seed=1))
    eng.start(ids, 20)
    step = eng.step()
    # rebuild each node's path and score it as a plain sequence
    by_id = {n.id: n for n in step.nodes}
    anchor_ctx = eng.trace.prompt_ids
    for n in step.nodes[1:]:
        path, cur = [], n
        while cur.parent is not None:
            path.append(cur.token_id)
            cur = by_id[cur.parent]
        seq = anchor_ctx + path[::-1]
        with torch.inference_mode():
            logits = tiny.target(input_ids=torch.tensor([seq[:-1]])).logits[0, -1]
        p_seq = float(torch.softmax(logits.float(), -1)[n.token_id])
        assert abs(p_seq - n.p) < 1e-4, (n.id, p_seq, n.p)


def test_same_seed_same_trace_and_different_seed_differs(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[1])
    cfg = MethodConfig(method="mcsd", k_config=(3, 2))
    traces = [run(tiny, cfg, ids, 30, SamplingConfig(temperature=1.0, seed=s))[1] for s in (5, 5, 6)]
    strip = lambda t: [{k: v for k, v in s.to_dict().items() if not k.endswith("_ms") and k != "timeline"}  # noqa: E731
                       for s in t.steps]
    assert strip(traces[0]) == strip(traces[1])
    assert traces[0].generated_ids != traces[2].generated_ids


def test_step_trace_is_consistent(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[0])
    eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(4, 2)), SamplingConfig(temperature=0.8, seed=2))
    eng.start(ids, 40)
    L = len(ids)
    for _ in range(5):
        s = eng.step()
        nodes = s.nodes
        assert nodes[0].parent is None and nodes[0].position_id == L - 1
        assert len(nodes) == 1 + 4 + 8
        for n in nodes[1:]:
            assert n.position_id == L - 1 + n.depth
            assert n.status in (ACCEPTED, REJECTED, UNVERIFIED)
            assert 0.0 <= n.q <= 1.0 and 0.0 <= n.p <= 1.0
        committed_nodes = [n for n in nodes[1:] if n.committed]
        assert [n.token_id for n in committed_nodes] == s.committed_ids[: len(committed_nodes)]
        assert len(s.committed_ids) == len(committed_nodes) + 1  # the bonus token
        # the first step's anchor (last prompt token) is already cached by the prefill: no row for it
        assert s.mask_node_ids[0] == (0 if s.index else 1) and len(s.mask) == len(nodes) - (0 if s.index else 1)
        assert s.position_ids == [nodes[i].position_id for i in s.mask_node_ids]
        for r, i in enumerate(s.mask_node_ids):  # each row attends to exactly its ancestors and itself
            allowed = set()
            cur = nodes[i]
            while cur is not None:
                allowed.add(cur.id)
                cur = nodes[cur.parent] if cur.parent is not None else None
            assert {s.mask_node_ids[c] for c, v in enumerate(s.mask[r]) if v} == allowed & set(s.mask_node_ids)
        L += len(s.committed_ids)


def test_max_new_tokens_and_eos_end_the_run(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[2])
    eng, tr = run(tiny, MethodConfig(method="mcsd", k_config=(4, 2, 2)), ids, 7)
    assert len(tr.generated_ids) == 7 and eng.finished and tr.steps[-1].finished
    with pytest.raises(EngineError):
        eng.step()
    from explorer.models.pair import make_pair

    pair = make_pair(tiny.draft, tiny.target, tiny.tokenizer, name="t", draft_id="d", target_id="t")
    first = run(pair, DEFAULTS["ar"], ids, 5)[1].generated_ids
    pair.eos_token_ids = (first[2],)
    eng, tr = run(pair, DEFAULTS["sd"], ids, 50)
    assert tr.generated_ids == first[:3] and eng.finished


def test_bad_input_is_refused_with_a_clear_error(tiny):
    eng = build_engine(tiny, DEFAULTS["mcsd"], SamplingConfig())
    with pytest.raises(EngineError, match="empty"):
        eng.start([], 10)
    with pytest.raises(EngineError, match="positions"):
        eng.start([1] * 600, 10)
    with pytest.raises(EngineError, match="start"):
        build_engine(tiny, DEFAULTS["mcsd"], SamplingConfig()).step()
    with pytest.raises(TreeShapeError):
        MethodConfig(method="mcsd", k_config=(0, 2))
    with pytest.raises(TreeShapeError):
        MethodConfig(method="sd", gamma=0)
    with pytest.raises(ValueError, match="unknown method"):
        MethodConfig(method="beam")


def test_lossy_method_is_labelled_and_commits_root_plus_branch(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[0])
    cfg = MethodConfig(method="mcsd-improved", lossy=True, width=3, k_config=(1,), max_depth=3)
    eng, tr = run(tiny, cfg, ids, 30, SamplingConfig(temperature=1.0, seed=0))
    assert tr.settings["verifier"] == "longest-branch"
    for s in tr.steps:
        assert s.lossy and s.bonus_token is None
        roots = [n for n in s.nodes if n.source == "target"]
        assert len(roots) == 3 and all(n.parent == 0 for n in roots)
        chosen = [b for b in s.branches if b["chosen"]]
        assert len(chosen) == 1
        if not s.finished:
            assert len(s.committed_ids) == 1 + chosen[0]["accepted"]
    assert RunTrace.from_dict(tr.to_dict()).generated_ids == tr.generated_ids


def test_step_texts_join_to_the_decoded_output(tiny):
    """Byte tokens that split a multi-byte character add "" until the character is complete."""
    ids = tiny.tokenizer.encode("héllo wörld")
    _, tr = run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), ids, 60, SamplingConfig(temperature=1.0, seed=9))
    full = tiny.tokenizer.decode(tr.generated_ids)
    joined = tr.generated_text
    assert full.startswith(joined) and len(full) - len(joined) <= 1
    assert "\ufffd" not in joined or "\ufffd" in full[: len(joined)]


def test_rewind_reproduces_a_fresh_run(tiny):
    ids = tiny.tokenizer.encode(PROMPTS[0])
    cfg = MethodConfig(method="mcsd", k_config=(2, 2), verifier="spechub")
    fresh = {s: run(tiny, cfg, ids, 12, SamplingConfig(temperature=1.0, seed=s))[1].generated_ids for s in (3, 4)}
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=1.0, seed=0))
    eng.start(ids, 12)
    eng.run()
    for s in (3, 4, 3):
        eng.rewind(seed=s)
        assert eng.n_generated == 0 and eng.state.target_kv.length == len(ids)
        assert eng.run().generated_ids == fresh[s]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_branch_threshold_gives_one_child_where_the_draft_is_sure(tiny, temperature):
    """Adaptive width: a node gets its level's k children only where q's top probability is below the threshold."""
    ids = tiny.tokenizer.encode(PROMPTS[1])
    k_config = (3, 2)
    _, tr = run(tiny, MethodConfig(method="mcsd", k_config=k_config, branch_threshold=0.3), ids, 40,
                SamplingConfig(temperature=temperature, seed=1))
    seen = set()
    for step in tr.steps:
        kids: dict = {}
        for n in step.nodes[1:]:
            kids.setdefault(n.parent, []).append(n)
        for parent, children in kids.items():
            top_q = children[0].q_top[0][2]  # q at the parent, best token first
            k = k_config[children[0].depth - 1]
            sure = top_q >= 0.3
            assert len(children) == (1 if sure else k), (step.index, parent, top_q, len(children))
            seen.add(sure)
    assert seen == {True, False}  # both cases happened
    _, fixed = run(tiny, MethodConfig(method="mcsd", k_config=k_config), ids, 10)
    before = [sum(len(s.committed_ids) for s in fixed.steps[:i]) for i in range(len(fixed.steps))]
    # 1.0 (default) keeps the fixed shape, wherever the room left holds a depth-2 path and the bonus token
    assert all(len(s.nodes) == 1 + 3 + 6 for s, b in zip(fixed.steps, before) if 10 - b >= 3)


def test_branch_threshold_is_validated():
    with pytest.raises(ValueError, match="branch_threshold"):
        MethodConfig(method="mcsd", branch_threshold=1.5)


def test_what_a_run_learned_is_one_plain_record(tiny):
    """``Engine.carried()``: the three kinds of learned state in one typed record of plain data; ``updated`` keeps a
    kind the newer run did not learn."""
    import json

    from explorer.engine.carried import Carried

    engine = build_engine(tiny, DEFAULTS["hybrid"].with_(fallback="goodput", adapt="threshold", stop="confidence"),
                          SamplingConfig())
    engine.start(tiny.tokenizer.encode(PROMPTS[0]), 12)
    engine.run()
    learned = engine.carried()
    assert learned.recycling["rows"] and learned.fallback["key"] and learned.adapter["key"]
    assert json.loads(json.dumps(learned.__dict__)) == learned.__dict__  # plain data: a session or trace can hold it
    ar = build_engine(tiny, DEFAULTS["ar"], SamplingConfig())
    ar.start(tiny.tokenizer.encode(PROMPTS[0]), 4)
    ar.run()
    assert ar.carried() == Carried()
    assert learned.updated(ar.carried()) == learned and Carried().updated(learned) == learned
    assert learned.without_recycling() == Carried(fallback=learned.fallback, adapter=learned.adapter)


JOINED = [MethodConfig(method="sd", gamma=3), MethodConfig(method="mcsd", k_config=(3, 2)),
          MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38),
          DEFAULTS["hybrid"], DEFAULTS["prompt-lookup"]]


@pytest.mark.parametrize("cfg", JOINED, ids=lambda c: c.method)
def test_a_joint_prefill_reads_the_prompt_in_the_first_verification(tiny, cfg):
    """joint_prefill: the target reads the prompt in the first step's forward, one target forward fewer per run,
    and greedy output, the step's own mask and the caches are what a prefill apart gives."""
    ids = tiny.tokenizer.encode(PROMPTS[0])
    _, apart = run(tiny, cfg, ids, 30)
    eng = build_engine(tiny, cfg, SamplingConfig(), joint_prefill=True)
    eng.start(ids, 30)
    assert eng.state.target_kv.length == 0 and eng.state.next_dist is None and eng.trace.settings["joint_prefill"]
    first = eng.step()
    assert first.prefill_rows == len(ids) and eng.state.target_kv.length == len(eng.state.committed) - 1
    rows = len(first.mask_node_ids)
    assert rows == len(first.nodes) and len(first.mask) == rows and all(len(r) == rows for r in first.mask)
    assert first.mask_context_len == len(ids) - 1 and first.position_ids[0] == len(ids) - 1
    assert any("prefill joined to the first verification" in line for line in explain_step(first))
    trace = eng.run()
    assert trace.generated_ids == apart.generated_ids
    assert [s.prefill_rows for s in trace.steps[1:]] == [0] * (len(trace.steps) - 1)
    assert run_metrics(trace)["target_calls"] == len(trace.steps)  # no prefill call beside the steps'
    assert run_metrics(apart)["target_calls"] == sum(s.target_calls for s in apart.steps) + 1
    fresh = _fresh_kv(tiny.target, eng.state.committed[:eng.state.target_kv.length])
    for (keys, _), ref in zip(eng.state.target_kv.layer_tensors(), fresh.layers):
        assert torch.allclose(keys, ref.keys, atol=1e-5)


def test_a_joint_prefill_primes_the_memory_as_a_prefill_apart_does(tiny):
    """The decision features' memory of the prompt's rows comes from the first verification's forward: the same
    candidates a prefill apart reads at start; a rewind keeps it and reads the prompt again."""
    ids = tiny.tokenizer.encode(PROMPTS[1])
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38)
    apart = build_engine(tiny, cfg, SamplingConfig())
    apart.start(ids, 20)
    joint = build_engine(tiny, cfg, SamplingConfig(), joint_prefill=True)
    joint.start(ids, 20)
    assert joint.parts.drafter.memory.rows == {}  # nothing primed before the target has read the prompt
    joint.step()
    seeded = joint.parts.drafter._after_prompt.rows
    assert set(seeded) == set(apart.parts.drafter.memory.rows)
    for tok, cands in apart.parts.drafter.memory.rows.items():
        assert [t for t, _ in seeded[tok]] == [t for t, _ in cands]
        assert [p for _, p in seeded[tok]] == pytest.approx([p for _, p in cands], abs=1e-4)
    text = joint.run().generated_ids
    joint.rewind()
    assert joint.state.target_kv.length == 0 and joint.state.prompt_rows == 0
    assert joint.parts.drafter.memory.rows == seeded
    assert joint.run().generated_ids == text and joint.trace.steps[0].prefill_rows == len(ids)


@pytest.mark.parametrize("cfg", [DEFAULTS["ar"], MethodConfig(method="mcsd-improved", lossy=True, width=2,
                                                               k_config=(1,), max_depth=3)], ids=["ar", "lossy"])
def test_a_prefill_joins_no_step_that_needs_the_targets_prediction(tiny, cfg):
    """ar's first step is the prefill's prediction, and target-initialized roots are read from it: both prefill
    apart."""
    ids = tiny.tokenizer.encode(PROMPTS[1])
    eng = build_engine(tiny, cfg, SamplingConfig(), joint_prefill=True)
    eng.start(ids, 5)
    assert eng.state.target_kv.length == len(ids) and "joint_prefill" not in eng.trace.settings
    assert eng.step().prefill_rows == 0


def test_a_joint_prefill_rewound_before_its_first_step_still_reads_the_prompts_rows(tiny):
    """The audit rewinds before stepping: the prompt's rows must still come with the first verification then."""
    ids = tiny.tokenizer.encode(PROMPTS[1])
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38)
    joint = build_engine(tiny, cfg, SamplingConfig(), joint_prefill=True)
    joint.start(ids, 20)
    joint.rewind(seed=3)
    assert joint.state.prompt_rows > 0 and joint.state.prefill_pending
    joint.step()
    assert joint.parts.drafter._after_prompt.rows and joint.state.prompt_rows == 0
