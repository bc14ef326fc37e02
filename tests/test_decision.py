"""Decision models and stop policies: features, files, collect / train / eval, the rules, and what-if replay."""

import json
import math

import numpy as np
import pytest
import torch

from explorer.analysis.prompts import Prompt, select_prompts
from explorer.decision.collect import SHARD_TENSORS, DataError, _to_tensors, collect, load_data, open_data_dir
from explorer.decision.evaluate import evaluate_on
from explorer.decision.train import split_by_prompt, train_models
from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.machine import EngineError
from explorer.engine.policies.stopping import (decide, goodput_threshold, make_stop_policy, recorded_setting, replay,
                                               what_if)
from explorer.engine.sampling import SamplingConfig
from explorer.engine.stop_models.features import (MEMORY_K, SESSION_FEATURE_NAMES, CopyIndex, TargetMemory,
                                                  dist_features, top_candidates)
from explorer.engine.stop_models.model import (DecisionModelError, find_shipped, load_decision_model,
                                               shipped_decision_model)
from explorer.engine.stop_models.scores import score_metrics
from explorer.lessons.teach import explain_step
from explorer.trace.records import StopSignal

PROMPTS = [Prompt(str(i), t, "unit") for i, t in enumerate(
    ["def add(a, b):", "The quick brown fox", "import numpy as np\n", "for i in range(10):"])]


def test_dist_features_entropy_and_sorted_top10():
    logits = torch.zeros(2, 50)
    logits[1, 3] = 10.0
    f = dist_features(logits)
    assert f.shape == (2, 11) and f.dtype == torch.float32
    assert f[0, 0].item() == pytest.approx(math.log(50), rel=1e-5)  # uniform: entropy log V
    assert f[0, 1:].tolist() == pytest.approx([1 / 50] * 10)
    assert f[1, 1].item() > 0.99 and f[1, 0].item() < 0.05
    assert torch.all(f[:, 1:-1] >= f[:, 2:])


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, tiny):
    out = tmp_path_factory.mktemp("decision-data")
    summary = collect(tiny, PROMPTS, out, max_new_tokens=12, progress=False, chat_template=False)
    return out, summary


def test_collect_writes_a_shard_per_prompt_and_resumes(tiny, tiny_data):
    out, summary = tiny_data
    assert summary["prompts_done"] == 4 and summary["records"] > 0
    assert len(list(out.glob("shard-*.safetensors"))) == 4
    again = collect(tiny, PROMPTS, out, max_new_tokens=12, progress=False, chat_template=False)
    assert again == {"prompts_done": 0, "prompts_skipped": 4, "records": 0, "too_long": []}
    meta, t, owners = load_data([out])
    assert meta["hidden_size"] == tiny.draft.config.hidden_size
    assert set(t) == set(SHARD_TENSORS) and t["hidden"].shape == (len(owners), 64)
    assert torch.allclose(t["soft"], torch.clamp(t["p"] / t["q"], max=1.0), atol=1e-5)
    assert torch.all(t["cum_q"] <= t["q"] + 1e-6) and int(t["depth"].min()) == 1
    assert sorted(set(owners)) == [f"unit:{i}" for i in range(4)]


def test_collected_features_and_labels_match_plain_forwards(tiny, tiny_data):
    """First step, first level: features are the draft's last hidden state over the prompt, p is the target's."""
    from safetensors import safe_open

    out, _ = tiny_data
    ids = tiny.tokenizer.encode(PROMPTS[0].text)
    with torch.no_grad():
        d = tiny.draft(torch.tensor([ids]), output_hidden_states=True)
        t = tiny.target(torch.tensor([ids]))
    q = d.logits[0, -1].softmax(-1)
    p = t.logits[0, -1].softmax(-1)
    with safe_open(str(next(out.glob("shard-unit-0.*"))), framework="pt") as f:
        rec = {k: f.get_tensor(k) for k in SHARD_TENSORS}
        assert f.metadata()["temperature"] == "0.0"
    first = (rec["step"] == 0) & (rec["depth"] == 1)
    assert int(first.sum()) == 2  # k_config (2, 2, 2): two children of the anchor
    for j in torch.nonzero(first).flatten().tolist():
        x = int(rec["token"][j])
        assert rec["q"][j].item() == pytest.approx(q[x].item(), rel=1e-4)
        assert rec["p"][j].item() == pytest.approx(p[x].item(), rel=1e-4)
        assert int(rec["greedy"][j]) == int(int(p.argmax()) == x)
        assert torch.allclose(rec["hidden"][j].float(), d.hidden_states[-1][0, -1].half().float(), atol=1e-2)
        assert torch.allclose(rec["dist"][j], dist_features(d.logits[0, -1:])[0], atol=1e-5)
        index = CopyIndex()
        index.sync(ids)
        # step 0: the context's n-grams are known, and the target's candidates after the prompt's last token (and
        # its last two) come from the prefill's last row: the target memory is primed from the prompt
        best = p.topk(MEMORY_K).indices.tolist()
        rank = 1.0 / (best.index(x) + 1) if x in best else 0.0
        logp = math.log(max(float(p[x]) if x in best else 0.0, 1e-4))
        want = [*index.features([x]), rank, 1.0, rank, 1.0, logp, float(p.max()), logp, float(p.max())]
        assert rec["session"][j].tolist() == pytest.approx(want, rel=1e-4, abs=1e-5)
    later = torch.nonzero(rec["step"] > 0).flatten()
    assert rec["session"][later, 3].min() >= 0 and rec["session"][later, 3].max() == 1.0  # rows remembered


def test_target_memory_ranks():
    m = TargetMemory(k=3)
    floor = math.log(1e-4)
    assert m.features(4, 5, 7) == (0.0, 0.0, 0.0, 0.0, floor, 0.0, floor, 0.0)
    m.update([(4, 5), (5, 6)], [[(7, 0.5), (8, 0.2), (9, 0.1), (10, 0.05)], [(1, 0.9)]])
    assert [t for t, _ in m.rows[5]] == [7, 8, 9]  # k = 3 kept
    l2, l5 = math.log(0.2), math.log(0.5)
    assert m.features(4, 5, 8) == pytest.approx((0.5, 1.0, 0.5, 1.0, l2, 0.5, l2, 0.5))
    assert m.features(4, 5, 10) == pytest.approx((0.0, 1.0, 0.0, 1.0, floor, 0.5, floor, 0.5))  # beyond k: absent
    assert m.features(3, 5, 8) == pytest.approx((0.5, 1.0, 0.0, 0.0, floor, 0.0, l2, 0.5))  # another pair
    m.update([(3, 5)], [[(9, 0.6)]])  # a later verdict replaces the token's row, not the other pair's
    l6 = math.log(0.6)
    assert m.features(3, 5, 9) == pytest.approx((1.0, 1.0, 1.0, 1.0, l6, 0.6, l6, 0.6))
    assert m.features(4, 5, 7) == pytest.approx((0.0, 1.0, 1.0, 1.0, l5, 0.5, floor, 0.6))
    seeded = TargetMemory(k=2)
    seeded.prime([1, 2, 3], 1, [[(5, 0.7)], [(6, 0.4)]])  # candidates after the tokens at positions 1 and 2
    assert seeded.bigrams == {(1, 2): [(5, 0.7)], (2, 3): [(6, 0.4)]} and seeded.rows == {2: [(5, 0.7)], 3: [(6, 0.4)]}
    copy = seeded.copy()
    copy.update([(0, 2)], [[(9, 0.9)]])
    assert seeded.rows[2] == [(5, 0.7)] and copy.rows[2] == [(9, 0.9)]


def test_top_candidates_are_plain_softmax_in_chunks():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = top_candidates(logits, lambda rows: rows, k=3, chunk=2)  # the "head" here: logits are the rows
    probs = logits.float().softmax(-1)
    for row, pairs in zip(probs, got):
        vals, ids = row.topk(3)
        assert [t for t, _ in pairs] == ids.tolist()
        assert [p for _, p in pairs] == pytest.approx(vals.tolist(), rel=1e-5)
    assert top_candidates(logits[:0], lambda rows: rows) == []


def test_target_memory_is_primed_from_the_prompt_only_when_features_are_computed(tiny):
    """A learned stop policy primes the memory from the prefill's prompt rows; rewind returns there; a run
    without decision features keeps only the prefill's last row."""
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick")
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="decision", threshold=0.0)
    eng = build_engine(tiny, cfg, SamplingConfig())
    eng.start(ids, 12)
    memory = eng.parts.drafter.memory
    with torch.no_grad():
        logits = tiny.target(torch.tensor([ids])).logits[0].float()
    last = len(ids) - 1 - ids[::-1].index(ids[4])  # the latest occurrence of a repeated token wins
    assert [t for t, _ in memory.rows[ids[4]]] == logits[last].topk(MEMORY_K).indices.tolist()
    pairs = memory.bigrams[(ids[-2], ids[-1])]
    assert [p for _, p in pairs] == pytest.approx(logits[-1].softmax(-1).topk(MEMORY_K).values.tolist(), rel=1e-4)
    seeded = (dict(memory.rows), dict(memory.bigrams))
    eng.step()
    assert (eng.parts.drafter.memory.rows, eng.parts.drafter.memory.bigrams) != seeded  # the verification taught it
    eng.rewind()
    assert (eng.parts.drafter.memory.rows, eng.parts.drafter.memory.bigrams) == seeded
    plain = build_engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), SamplingConfig())
    plain.start(ids, 4)
    assert plain.parts.drafter.memory.rows == {}


def test_memory_probabilities_are_plain_softmax_when_sampling(tiny):
    """The memory stores temperature-1 probabilities whatever the run's temperature (the models were trained so)."""
    ids = tiny.tokenizer.encode("Once upon a time")
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=3, stop="decision", threshold=0.0)
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=0.5, top_p=0.9, seed=3))
    eng.start(ids, 8)
    eng.step()
    d, v = eng.last_step
    top = v.p_rows.plain_top([0], 4)[0]
    row = v.p_rows.row_logits(0).float().softmax(-1)
    assert [t for t, _ in top] == row.topk(4).indices.tolist()
    assert [p for _, p in top] == pytest.approx(row.topk(4).values.tolist(), rel=1e-4)
    assert eng.parts.drafter.memory.bigrams[(ids[-2], ids[-1])][:4] == pytest.approx(top, rel=1e-4)


def test_copy_index_match_lengths():
    index = CopyIndex()
    index.sync([1, 2, 3, 4, 5, 1, 2, 3])
    assert index.features([4]) == (4, 3)  # "1 2 3 4" occurs; "1 2 3" occurs followed (by 4)
    assert index.features([9]) == (0, 3)  # the context suggests 4, the draft says 9
    assert index.features([4, 5]) == (5, 4) and index.features([4, 6]) == (0, 4)
    index.sync([1, 2, 3, 4, 5, 1, 2, 3, 4, 5])  # grows in place
    assert index.features([1]) == (6, 5)
    index.sync([7, 8])  # not an extension (a new run): rebuilt
    assert index.tokens == [7, 8] and index.features([8]) == (0, 0) and index.features([7]) == (1, 0)
    index.sync([7, 8, 7])
    assert index.features([8]) == (2, 1)


def test_collect_refuses_a_folder_of_other_settings(tiny, tiny_data):
    out, _ = tiny_data
    meta = json.loads((out / "meta.json").read_text())
    assert meta["draft_quant"] == tiny.draft_quant
    older = {**meta, "method": {k: v for k, v in meta["method"].items() if k != "branch_threshold"}}
    open_data_dir(out, older)  # a folder from before a setting existed still resumes (the setting's default)
    with pytest.raises(DataError, match="draft_quant"):
        open_data_dir(out, {**meta, "draft_quant": "int8" if meta["draft_quant"] != "int8" else "none"})
    meta["max_new_tokens"] = 999
    with pytest.raises(DataError, match="max_new_tokens"):
        open_data_dir(out, meta)


def _synthetic(folder, n_prompts=12, per_prompt=200, seed=0, source="syn", kinds=("chat",), noise=0.0):
    """A data folder whose soft label is a known function of the features: a model must learn it.
    ``noise`` > 0 adds that much unseen noise to the latent behind the labels (a folder that is harder to rank)."""
    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    open_data_dir(folder, {"format": 1, "pair": {"name": "syn", "draft_id": "d", "target_id": "t"},
                           "method": {}, "max_new_tokens": 1, "hidden_size": 16})
    from safetensors.torch import save_file

    for k in range(n_prompts):
        z = torch.randn(per_prompt, generator=gen)  # one latent that both feature sets carry
        hidden = torch.randn(per_prompt, 16, generator=gen)
        hidden[:, 3] = z
        dist = torch.rand(per_prompt, 11, generator=gen)
        dist[:, 1] = torch.sigmoid(z)
        soft = torch.sigmoid(4 * (z + noise * torch.randn(per_prompt, generator=gen) if noise else z))
        rows = {"hidden": list(hidden.half()), "dist": list(dist), "depth": [1] * per_prompt,
                "cum_q": [0.5] * per_prompt, "q": [0.5] * per_prompt, "p": (soft * 0.5).tolist(),
                "soft": soft.tolist(), "greedy": (soft > 0.5).int().tolist(), "step": [0] * per_prompt,
                "token": [1] * per_prompt,
                "session": (z[:, None] > 0).float().repeat(1, len(SESSION_FEATURE_NAMES)).tolist()}
        save_file(_to_tensors(rows, 16), str(folder / f"shard-{source}-{k}.safetensors"),
                  metadata={"prompt_id": str(k), "source": source, "temperature": "0",
                            "kind": kinds[k % len(kinds)]})


def test_training_learns_a_known_signal_and_writes_a_card(tmp_path):
    _synthetic(tmp_path / "data")
    card = train_models([tmp_path / "data"], tmp_path / "model", epochs=40, patience=4,
                        layers={"hidden": (32, 16), "dist": (16, 8)})
    meta, t, owners = load_data([tmp_path / "data"])
    val = np.array([o in set(card["data"]["val_prompts"]) for o in owners])
    oracle = score_metrics(t["soft"][val].numpy(), t["soft"][val].numpy(), t["greedy"][val].numpy(), 0.5)
    for kind in ("hidden", "dist"):  # within a whisker of the best possible ranking of random acceptances
        assert card["models"][kind]["roc_auc"] > oracle["roc_auc"] - 0.02, (kind, oracle["roc_auc"])
    assert set(card["data"]["train_prompts"]).isdisjoint(card["data"]["val_prompts"])
    assert card["data"]["records"] == 12 * 200 and card["pair"]["draft_id"] == "d"
    m = load_decision_model(tmp_path / "model", "hidden")
    x = torch.randn(5, 16)
    assert m.predict(hidden=x).shape == (5,)
    # prompts used for training or validation are never scored by eval
    with pytest.raises(DataError, match="every prompt"):
        evaluate_on(tmp_path / "model", [tmp_path / "data"])
    _synthetic(tmp_path / "fresh", n_prompts=3, seed=1, source="new")
    report = evaluate_on(tmp_path / "model", [tmp_path / "fresh"])
    assert report["prompts"] == 3 and report["models"]["hidden"]["roc_auc"] > oracle["roc_auc"] - 0.03
    assert report["models"]["hidden"]["ece"] < 0.2
    assert report["by_kind"]["chat"]["records"] == 600
    assert report["by_kind"]["chat"]["hidden"] == pytest.approx(report["models"]["hidden"]["roc_auc"])


def test_leaving_a_kind_out_scores_it_with_models_that_never_saw_it(tmp_path):
    from explorer.decision.generalise import leave_one_kind_out, markdown_table

    _synthetic(tmp_path / "data", n_prompts=9, per_prompt=150, kinds=("code", "math", "chat"))
    report = leave_one_kind_out([tmp_path / "data"], models=("dist", "context"), epochs=30, patience=4)
    assert report["kinds"] == {"chat": 3, "code": 3, "math": 3}
    assert {(r["held_out"], r["model"]) for r in report["rows"]} == {(k, m) for k in ("chat", "code", "math")
                                                                     for m in ("dist", "context")}
    for r in report["rows"]:  # the signal is the same in every kind: a model trained on the others finds it
        assert r["records"] == 450 and r["train_prompts"] == 6 and r["roc_auc"] > 0.85, r
    assert report["worst"]["dist"] == min(r["roc_auc"] for r in report["rows"] if r["model"] == "dist")
    table = markdown_table(report)
    assert "| math | 3 | 450 |" in table and "**worst**" in table
    with pytest.raises(ValueError, match="no prompts of kind"):
        leave_one_kind_out([tmp_path / "data"], held_out=["poetry"], models=("dist",))
    # train can leave kinds out too; its card says which
    card = train_models([tmp_path / "data"], tmp_path / "model", epochs=5, exclude_kinds=["math"])
    assert card["data"]["excluded_kinds"] == ["math"] and card["data"]["prompt_kinds"] == ["chat", "code"]
    assert card["data"]["prompts"] == 6
    assert report["worst_by_data"] == {} and all(r["by_data"] == {} for r in report["rows"])


def test_leaving_a_kind_out_scores_each_collection_alone(tmp_path):
    """Two collections (say int8 and bf16 draft): trained on both, each held-out kind scored on each one's tokens."""
    from explorer.decision.generalise import leave_one_kind_out, markdown_table

    kinds = ("code", "math", "chat")
    _synthetic(tmp_path / "clean", n_prompts=9, per_prompt=150, kinds=kinds)
    _synthetic(tmp_path / "noisy", n_prompts=9, per_prompt=100, kinds=kinds, seed=1, source="noisy", noise=3.0)
    folders = [tmp_path / "clean", tmp_path / "noisy"]
    report = leave_one_kind_out(folders, models=("dist",), epochs=30, patience=4)
    clean, noisy = (str(f) for f in folders)
    for r in report["rows"]:
        assert set(r["by_data"]) == {clean, noisy}
        assert (r["by_data"][clean]["records"], r["by_data"][noisy]["records"]) == (450, 300) and r["records"] == 750
        # the noisy collection's labels hide the signal: its tokens alone rank worse than the clean ones
        assert r["by_data"][clean]["roc_auc"] > 0.85 > r["by_data"][noisy]["roc_auc"] + 0.1, r
        assert r["by_data"][noisy]["roc_auc"] < r["roc_auc"] < r["by_data"][clean]["roc_auc"]
    assert report["worst_by_data"][noisy]["dist"] == min(r["by_data"][noisy]["roc_auc"] for r in report["rows"])
    assert f"| worst on {noisy} alone |" in markdown_table(report)


def test_split_is_by_prompt_and_reproducible():
    owners = [f"p{i % 7}" for i in range(70)]
    a = split_by_prompt(owners, 0.3, seed=3)
    assert a == split_by_prompt(owners, 0.3, seed=3)
    assert len(a[1]) == 3 and set(a[0]) | set(a[1]) == {f"p{i}" for i in range(7)}
    with pytest.raises(ValueError):
        split_by_prompt(["only"], 0.2, 0)


def test_score_metrics_on_known_values():
    pred = np.array([0.9, 0.8, 0.2, 0.1])
    soft = np.array([1.0, 1.0, 0.0, 0.0])
    m = score_metrics(pred, soft, np.array([1, 1, 0, 0]), 0.5)
    assert m["roc_auc"] == 1.0 and m["roc_auc_greedy"] == 1.0
    assert m["precision"] == 1.0 and m["recall"] == 1.0
    assert m["ece"] == pytest.approx(0.15)
    flipped = score_metrics(1 - pred, soft, np.array([1, 1, 0, 0]), 0.5)
    assert flipped["roc_auc"] == 0.0 and flipped["recall"] == 0.0


def test_model_files_are_checked_and_never_unpickled(tmp_path):
    src = find_shipped("tiny-draft-0", "tiny-target-0")
    assert src is not None
    m = load_decision_model(src, "dist")
    m.save(tmp_path)
    (tmp_path / "card.json").write_text((src / "card.json").read_text())
    x = torch.rand(4, 11)
    assert torch.equal(load_decision_model(tmp_path, "dist").predict(dist=x), m.predict(dist=x))
    # a pickle where safetensors belongs is refused, not executed
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    (tmp_path / "dist.safetensors").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(DecisionModelError):
        load_decision_model(tmp_path, "dist")
    (tmp_path / "card.json").write_text("{not json")
    with pytest.raises(DecisionModelError, match="not valid JSON"):
        load_decision_model(tmp_path, "dist")
    with pytest.raises(DecisionModelError, match="features per token"):
        m.predict(dist=torch.rand(2, 7))
    with pytest.raises(DecisionModelError, match="no decision model ships"):
        shipped_decision_model("someone/draft", "someone/target")


def test_learned_policy_without_a_model_of_its_kind_is_a_clear_error(tiny):
    """A pair with no model of its own borrows the embedded pair's pair-independent kinds (test_families.py); the
    hidden-state model cannot be borrowed, and the message says how to get one."""
    from explorer.models.pair import make_pair

    other = make_pair(tiny.draft, tiny.target, tiny.tokenizer, name="other", draft_id="x", target_id="y")
    with pytest.raises(EngineError, match="decision calibrate"):
        build_engine(other, MethodConfig(method="mcsd-improved", stop="prune", decision_model="hidden"),
                     SamplingConfig())
    engine = build_engine(other, MethodConfig(method="mcsd-improved", stop="prune"), SamplingConfig())
    assert engine.parts.decision_model.source["how"] == "transferred"


def _sig(level, scores, policy="prune", threshold=0.5):
    keep, pruned = decide(policy, scores, threshold)
    return StopSignal(level=level, scores=scores, score=max(scores.values()), threshold=threshold,
                      keep_drafting=keep, policy=policy, pruned=pruned)


def test_decide_rules():
    assert decide("decision", {"0": 0.2, "1": 0.6}, 0.5) == (True, [])
    assert decide("decision", {"0": 0.2, "1": 0.4}, 0.5) == (False, ["0", "1"])
    assert decide("prune", {"0": 0.2, "1": 0.6, "2": 0.1}, 0.5) == (True, ["0", "2"])
    assert decide("prune", {"0": 0.2}, 0.5) == (False, ["0"])
    assert decide("none", {"0": 0.0}, 0.9) == (True, [])


def test_replay_with_another_threshold():
    sigs = [_sig(1, {"0": 0.9, "1": 0.45}), _sig(2, {"0": 0.7}), _sig(3, {"0": 0.3})]
    assert [s.pruned for s in sigs] == [["1"], [], ["0"]]
    same = replay(sigs, 0.5)
    assert [r["pruned"] for r in same] == [["1"], [], ["0"]] and not same[-1]["keep_drafting"]
    strict = replay(sigs, 0.8)  # branch 0 now stops at level 2
    assert [r["pruned"] for r in strict] == [["1"], ["0"]] and len(strict) == 2
    loose = replay(sigs, 0.4)  # branch 1 survives level 1: its later scores were never computed
    assert loose[0]["pruned"] == [] and loose[1]["unknown"] == ["1"]


def test_replay_keeps_the_side_branches_the_row_floor_stopped():
    """The row floor (tree chosen online) reads no threshold: a replay at any threshold keeps those branches
    stopped while drafting goes on."""
    first = _sig(1, {"0": 0.9, "1": 0.8, "2": 0.7}, policy="decision", threshold=0.75)
    first.cost_pruned, first.pruned = ["2"], ["2"]
    sigs = [first, _sig(2, {"0": 0.9, "1": 0.5}, policy="decision", threshold=0.75)]
    for threshold in (0.75, 0.3):
        rows = replay(sigs, threshold)
        assert rows[0]["pruned"] == ["2"] and rows[0]["active"] == ["0", "1"]
    assert replay(sigs, 0.95)[0]["pruned"] == ["0", "1", "2"]  # the rule itself stops everything


def _chain_step(tiny, cfg, ids):
    """One greedy step of a chain config with a learned policy: the engine, the StepTrace and the engine's decision
    model's prediction for every node of the step's tree (node i at level i + 1)."""
    eng = build_engine(tiny, cfg, SamplingConfig(), capture_features=True)
    eng.start(ids, 8)
    step = eng.step()
    d, _ = eng.last_step
    acc = [float(eng.parts.decision_model.predict(hidden=d.features[i][0][None])[0]) for i in range(len(d.tree))]
    return eng, step, acc


def test_prune_and_specdecpp_in_the_engine(tiny):
    ids = tiny.tokenizer.encode("def add(a, b):")
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="prune", threshold=0.4,
                       decision_model="hidden")
    eng = build_engine(tiny, cfg, SamplingConfig())
    eng.start(ids, 30)
    trace = eng.run()
    pruned_somewhere = False
    for step in trace.steps:
        for sig in step.stop_signals:
            for b in sig.pruned:
                pruned_somewhere = True
                deeper = [n for n in step.nodes if n.branch == int(b) and n.depth > sig.level]
                assert deeper == [], "a pruned branch got children"
                assert all(b not in later.scores for later in step.stop_signals if later.level > sig.level)
    assert pruned_somewhere
    # SpecDec++: a node's score is the product of the model's predictions along its path
    cfg = MethodConfig(method="mcsd-improved", k_config=(1,), max_depth=4, stop="specdec++", threshold=1.0,
                       decision_model="hidden")
    _, step, acc = _chain_step(tiny, cfg, ids)
    assert [s.scores["0"] for s in step.stop_signals] == pytest.approx(
        [float(np.prod(acc[: s.level])) for s in step.stop_signals], rel=1e-5)
    assert step.stop_signals[0].threshold == 0.0  # h = 1: the score threshold is 1 - h


def test_goodput_threshold_is_where_one_more_draft_forward_stops_paying():
    for r in (0.05, 0.22, 0.9):
        for forwards in (0, 1, 4, 9):
            for expected in (0.0, 0.7, 3.5):
                g = goodput_threshold(r, forwards, expected)
                rate = (1 + expected) / (1 + forwards * r)  # tokens per target-forward unit now
                for gain, pays in ((g * 1.01, True), (g * 0.99, False)):
                    assert ((1 + expected + gain) / (1 + (forwards + 1) * r) > rate) == pays
    assert goodput_threshold(0.22, 3, 2.0) > goodput_threshold(0.22, 1, 0.5)  # a grown step asks for more


def test_goodput_policy_scores_expected_gain_against_its_cost(tiny):
    ids = tiny.tokenizer.encode("def add(a, b):")
    cfg = MethodConfig(method="mcsd-improved", k_config=(1,), max_depth=6, stop="goodput", threshold=0.05,
                       decision_model="hidden")
    eng, step, acc = _chain_step(tiny, cfg, ids)
    assert len(step.stop_signals) >= 2  # E and D grow over levels
    for s in step.stop_signals:  # a chain: the node at level l has reach prod(acc[:l])
        reach = [float(np.prod(acc[:lv])) for lv in range(1, s.level + 1)]
        assert s.scores["0"] == pytest.approx(reach[-1] * acc[s.level - 1], rel=1e-5)
        assert s.forwards == s.level and s.expected == pytest.approx(sum(reach), rel=1e-5)
        assert s.threshold == pytest.approx(goodput_threshold(0.05, s.level, s.expected))
        assert s.keep_drafting == (s.scores["0"] >= s.threshold)
    # replaying with the recorded r reproduces the decisions; r = 0 (free drafts) never stops
    assert [r["keep_drafting"] for r in replay(step.stop_signals, 0.05)] == [
        s.keep_drafting for s in step.stop_signals]
    assert all(r["keep_drafting"] for r in replay(step.stop_signals, 0.0))
    assert make_stop_policy("goodput", 0.3, model=eng.parts.decision_model).score_threshold == 0.3
    assert recorded_setting(step.stop_signals[-1]) == pytest.approx(0.05)  # r back from a level's threshold
    words = " ".join(explain_step(step))
    assert "expected to add" in words and f"{step.stop_signals[-1].threshold:.2f}" in words


def test_goodput_adds_the_chances_of_a_trees_exclusive_paths(tiny):
    """In a tree exactly one path is accepted: the chance of reaching a level is the sum over its nodes' paths
    (capped by the level above), E sums those, and a level's gain sums every branch's new nodes."""
    ids = tiny.tokenizer.encode("def add(a, b):")
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="goodput", threshold=0.01,
                       decision_model="hidden", branch_threshold=1.0)
    eng = build_engine(tiny, cfg, SamplingConfig(), capture_features=True)
    eng.start(ids, 8)
    step = eng.step()
    tree = eng.last_step[0].tree
    acc = [float(eng.parts.decision_model.predict(hidden=eng.last_step[0].features[i][0][None])[0])
           for i in range(len(tree))]

    def reach(i):
        return acc[i] * (reach(tree.parent[i]) if tree.parent[i] >= 0 else 1.0)

    branch_of, mass = tree.branch_ids(), [1.0]
    assert len(step.stop_signals) >= 2 and len(list(tree.level(1))) == 2
    for s in step.stop_signals:
        nodes = list(tree.level(s.level))
        mass.append(min(mass[-1], sum(reach(i) for i in nodes)))
        gain = {}
        for i in nodes:
            gain[str(branch_of[i])] = gain.get(str(branch_of[i]), 0.0) + reach(i) * acc[i]
        scale = min(1.0, mass[-1] / sum(gain.values()))
        assert s.scores == pytest.approx({b: g * scale for b, g in gain.items()}, rel=1e-5)
        assert s.score == pytest.approx(sum(s.scores.values())) and s.score > max(s.scores.values())
        assert s.expected == pytest.approx(sum(mass[1:]), rel=1e-5) and s.forwards == s.level
        assert s.keep_drafting == (s.score >= s.threshold) and not s.pruned
    assert [r["keep_drafting"] for r in replay(step.stop_signals, 0.01)] == [
        s.keep_drafting for s in step.stop_signals]
    from explorer.trace.figures import stop_figure

    total = [t for t in stop_figure(step).data if t.name.startswith("all branches")]
    assert len(total) == 1 and list(total[0].y) == pytest.approx([s.score for s in step.stop_signals])
    assert "summed" in " ".join(explain_step(step))
    assert decide("goodput", {"0": 0.3, "1": 0.3}, 0.5) == (True, [])  # neither branch alone pays; both do
    assert decide("goodput", {"0": 0.2, "1": 0.2}, 0.5) == (False, ["0", "1"])


def test_what_if_on_a_recorded_step(tiny):
    ids = tiny.tokenizer.encode("The quick brown fox")
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.0)
    eng = build_engine(tiny, cfg, SamplingConfig())
    eng.start(ids, 30)
    step = eng.step()
    assert all(s.keep_drafting for s in step.stop_signals)
    same = what_if(step, 0.0)
    assert same["drafted"] == step.drafted and same["tokens"] == len(step.committed_ids) and not same["deeper"]
    first_only = what_if(step, 1.0)  # nothing reaches 1: stop after the first level
    assert first_only["draft_levels"] == 1 and first_only["drafted"] == 2
    assert first_only["tokens"] == min(len(step.committed_ids), step.accepted_draft_len, 1) + 1 \
        or first_only["tokens"] == len(step.committed_ids)
    assert first_only["exact"]


def test_config_thresholds_follow_the_policy():
    cfg = MethodConfig(method="mcsd-improved", stop="confidence")
    assert cfg.threshold == 0.3
    assert cfg.with_(stop="specdec++").threshold == 0.5
    model = load_decision_model(find_shipped("tiny-draft-0", "tiny-target-0"), "dist")
    assert make_stop_policy("specdec++", 0.7, model=model).score_threshold == pytest.approx(0.3)
    assert cfg.with_(stop="prune", threshold=0.7).threshold == 0.7
    with pytest.raises(ValueError, match="unknown stop policy"):
        MethodConfig(method="mcsd-improved", stop="sometimes")
    with pytest.raises(ValueError, match="decision model"):
        MethodConfig(method="mcsd-improved", decision_model="vibes")


def test_select_prompts_specs():
    assert len(select_prompts(["mt-bench:0:3", "mt-bench:78:"])) == 5
    from explorer.analysis.prompts import PromptError

    with pytest.raises(PromptError):
        select_prompts(["mt-bench:5:5"])


def test_path_model_tells_siblings_apart(tiny):
    """dist / hidden features belong to the parent row, so a node's children share one score; path adds q(x)."""
    ids = tiny.tokenizer.encode("def add(a, b):")
    first = {}
    for kind in ("dist", "path"):
        cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=3, stop="decision", threshold=0.0,
                           decision_model=kind)
        eng = build_engine(tiny, cfg, SamplingConfig())
        eng.start(ids, 8)
        first[kind] = eng.step().stop_signals[0].scores  # level 1: branch i is the anchor's child i alone
    assert first["dist"]["0"] == first["dist"]["1"]
    assert first["path"]["0"] != first["path"]["1"]
