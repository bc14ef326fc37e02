"""EAGLE-3 heads: the checkpoint format loads and saves, foreign or malformed checkpoints and heads that do not fit
their target are refused with a message that says which, and the head's own KV cache computes what one forward
over the same rows computes."""

import json

import pytest
import torch

from method_grid import AUDIT_SAMPLES
from explorer.models.eagle3 import (ARCHITECTURE, HeadCache, HeadConfig, HeadError, default_aux_layers, load_head,
                                    random_head, save_head)


def _config(tiny, **changes) -> HeadConfig:
    t = tiny.target.config
    base = dict(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=t.num_attention_heads,
                num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                vocab_size=t.vocab_size, draft_vocab_size=64, rope_theta=10000.0, aux_layer_ids=(0, 1, 2))
    return HeadConfig(**{**base, **changes})


def _saved(tiny, tmp_path, **changes):
    head = random_head(_config(tiny, **changes), seed=1, draft_ids=list(range(10, 74)))
    return head, save_head(head, tmp_path / "head")


def test_a_saved_head_loads_back_in_the_checkpoint_format(tiny, tmp_path):
    head, folder = _saved(tiny, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    loaded = load_head(folder, target=tiny.target)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name
    assert loaded.target_ids().tolist() == list(range(10, 74))
    assert loaded.config.aux_layers(2) == (0, 1, 2)
    # the speculators package's names (layers.0.*) load as well
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("midlayer.", "layers.0."): v for k, v in state.items()}, str(folder / "model.safetensors"))
    assert torch.equal(load_head(folder).midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)


def test_a_head_in_vllm_speculators_layout_loads_and_drafts_as_the_same_head(tiny, tmp_path):
    """``save_head(layout="speculators")`` writes speculators' ``Eagle3Speculator`` config and ``layers.0.*``
    names; it loads back as the same head (the same logits), and a speculators checkpoint of the whole vocabulary
    (no d2t / t2d, as speculators writes it) loads too."""
    from safetensors.torch import load_file, save_file

    head = random_head(_config(tiny), seed=1, draft_ids=list(range(10, 74)))
    folder = save_head(head, tmp_path / "spec", layout="speculators", verifier="tiny-target")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"] and config["speculators_model_type"] == "eagle3"
    assert config["transformer_layer_config"]["hidden_size"] == head.config.hidden_size
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny-target"
    assert all(not k.startswith("midlayer.") for k in load_file(str(folder / "model.safetensors")))
    loaded = load_head(folder, target=tiny.target)
    assert loaded.config == head.config
    loaded.to(torch.float32), head.set_embeddings(tiny.target.get_input_embeddings())
    states, tokens = torch.randn(5, 3, head.config.hidden_size), torch.tensor([3, 7, 9, 11, 2])
    with torch.no_grad():
        a, _ = head(tokens, head.features(states), torch.arange(5), HeadCache())
        b, _ = loaded(tokens, loaded.features(states), torch.arange(5), HeadCache())
    assert torch.allclose(a, b.float(), atol=1e-5)

    full = random_head(_config(tiny, draft_vocab_size=tiny.target.config.vocab_size), seed=2)
    folder = save_head(full, tmp_path / "full", layout="speculators")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, str(folder / "model.safetensors"))
    assert load_head(folder).target_ids().tolist() == list(range(tiny.target.config.vocab_size))


def test_a_speculators_head_with_norm_before_residual_takes_the_normed_feature_as_its_residual(tiny):
    plain = random_head(_config(tiny), seed=3)
    with torch.no_grad():
        plain.midlayer.mlp.down_proj.weight.zero_()  # the layer's output: its attention's residual plus attention
    config = _config(tiny, norm_before_residual=True)
    assert HeadConfig.from_dict(config.to_speculators()) == config == HeadConfig.from_dict(config.to_dict())
    normed = random_head(config, seed=3)
    normed.load_state_dict(plain.state_dict())
    for h in (plain, normed):
        h.set_embeddings(tiny.target.get_input_embeddings())
    g, tokens = torch.randn(4, plain.config.hidden_size) * 5, torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        out_plain = plain.midlayer(plain.embed(tokens), g, torch.arange(4), HeadCache(), None)
        out_normed = normed.midlayer(normed.embed(tokens), g, torch.arange(4), HeadCache(), None)
        attn = out_normed - plain.midlayer.hidden_norm(g) - (out_plain - g)  # the same attention on both
    assert not torch.allclose(out_plain, out_normed, atol=1e-3)
    assert torch.allclose(attn, torch.zeros_like(attn), atol=1e-4)


@pytest.mark.parametrize("change, message", [
    ({"norm_before_fc": True}, "norm_before_fc"),
    ({"speculators_model_type": "mlp"}, "only eagle3 heads load"),
    ({"transformer_layer_config": {"model_type": "qwen3", "hidden_size": 64}}, "a qwen3 layer"),
])
def test_speculators_options_the_layer_lacks_are_refused_by_name(tiny, change, message):
    with pytest.raises(HeadError, match=message):
        HeadConfig.from_dict(_config(tiny).to_speculators() | change)


def test_the_default_feature_layers_are_vllms_reading():
    assert HeadConfig(8, 8, 2, 2, 4, 10, 10).aux_layers(28) == default_aux_layers(28) == (2, 14, 25)
    assert default_aux_layers(2) == (2, 1, 0)  # a tiny target's layers, all within 0 .. L


@pytest.mark.parametrize("breakage, message", [
    ("no folder", "no head folder"),
    ("no config", "no config.json"),
    ("bad json", "not valid JSON"),
    ("other architecture", "not an EAGLE-3 head"),
    ("two layers", "one decoder layer"),
    ("pickled only", "pickled files"),
    ("missing weight", "missing ['fc.weight']"),
    ("misshapen weight", "weight norm.weight has shape"),
    ("d2t out of range", "d2t maps a draft id outside"),
])
def test_a_malformed_or_foreign_checkpoint_is_refused_with_what_is_wrong(tiny, tmp_path, breakage, message):
    from safetensors.torch import load_file, save_file

    _, folder = _saved(tiny, tmp_path)
    weights = folder / "model.safetensors"
    config = json.loads((folder / "config.json").read_text())
    if breakage == "no folder":
        folder = tmp_path / "nowhere"
    elif breakage == "no config":
        (folder / "config.json").unlink()
    elif breakage == "bad json":
        (folder / "config.json").write_text("{not json")
    elif breakage in ("other architecture", "two layers"):
        config.update({"architectures": ["LlamaForCausalLM"]} if breakage == "other architecture"
                      else {"num_hidden_layers": 2})
        (folder / "config.json").write_text(json.dumps(config))
    elif breakage == "pickled only":
        torch.save(load_file(str(weights)), folder / "pytorch_model.bin")
        weights.unlink()
    else:
        state = load_file(str(weights))
        if breakage == "missing weight":
            del state["fc.weight"]
        elif breakage == "misshapen weight":
            state["norm.weight"] = torch.ones(3)
        else:
            state["d2t"] = state["d2t"] + 10_000
        save_file(state, str(weights))
    with pytest.raises(HeadError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_head(folder, target=tiny.target)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8), "features 32 wide"),
    (dict(vocab_size=300), "vocabulary has 300 tokens"),
    (dict(aux_layer_ids=(0, 1, 5)), "reads target layers"),
])
def test_a_head_that_does_not_fit_its_target_is_refused(tiny, tmp_path, changes, message):
    _, folder = _saved(tiny, tmp_path, **changes)
    with pytest.raises(HeadError, match=message):
        load_head(folder, target=tiny.target)


def test_the_heads_cache_gives_what_one_forward_over_the_rows_gives(tiny):
    """Rows fed one at a time through the head's KV cache equal the same rows fed at once with a causal mask; a
    tree mask that hides a sibling row gives that row's chain result."""
    head = random_head(_config(tiny), seed=2)
    head.set_embeddings(tiny.target.get_input_embeddings())
    gen = torch.Generator().manual_seed(0)
    n, h = 6, head.config.hidden_size
    tokens = torch.randint(0, 250, (n,), generator=gen)
    g = torch.randn(n, h, generator=gen)
    pos = torch.arange(n)
    with torch.no_grad():
        whole, whole_g = head(tokens, g, pos, HeadCache())
        cache, rows = HeadCache(), []
        for i in range(n):
            rows.append(head(tokens[i:i + 1], g[i:i + 1], pos[i:i + 1], cache)[0])
        assert cache.length == n
        assert torch.allclose(torch.cat(rows), whole, atol=1e-5)
        # two siblings at the same position after 4 rows: each sees the 4 rows and itself only
        cache.rewind(4)
        mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 1]], dtype=torch.bool)
        twins, _ = head(tokens[4:6], g[4:6], torch.tensor([4, 4]), cache, mask)
        assert torch.allclose(twins[0], whole[4], atol=1e-5)
        alone = HeadCache()
        head(tokens[:4], g[:4], pos[:4], alone)
        second, _ = head(tokens[5:6], g[5:6], torch.tensor([4]), alone)
        assert torch.allclose(twins[1], second[0], atol=1e-5)


def test_target_logits_give_no_mass_outside_the_draft_vocabulary(tiny):
    head = random_head(_config(tiny), seed=3, draft_ids=list(range(100, 164)))
    logits = torch.randn(2, 64)
    full = head.to_target_logits(logits, vocab=tiny.vocab_size)
    assert full.shape == (2, tiny.vocab_size)
    assert torch.isinf(full[:, :100]).all() and torch.isinf(full[:, 164:]).all()
    assert torch.equal(full[:, 100:164], logits)
    assert head.t2d[100:164].all() and not head.t2d[:100].any()


# ------------------------------------------------------------------------------------------------ the head drafter

def _head_engine(tiny, sampling, joint: bool = False, **shape):
    from explorer.engine.config import DEFAULTS
    from explorer.engine.drafters.eagle import HeadDrafter
    from explorer.engine.factory import build_parts
    from explorer.engine.machine import Engine

    head = random_head(_config(tiny), seed=4, draft_ids=list(range(32, 96)))  # printable bytes only
    head.set_embeddings(tiny.target.get_input_embeddings())
    config = DEFAULTS["prompt-lookup"].with_(fallback="off")
    parts = build_parts(tiny, config, sampling)
    parts.drafter = HeadDrafter(head, head.config.aux_layers(tiny.target.config.num_hidden_layers), **shape)
    return Engine(tiny, config, sampling, parts, joint_prefill=joint)


@pytest.mark.parametrize("joint", [False, True])
def test_head_drafting_keeps_the_greedy_tokens_and_reads_every_committed_position(tiny, joint):
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig

    greedy = SamplingConfig(temperature=0.0)
    ids = tiny.tokenizer.encode("def add(a, b):\n    return a + b\n")
    plain = build_engine(tiny, DEFAULTS["ar"], greedy)
    plain.start(ids, 40)
    want = plain.run().generated_ids
    eng = _head_engine(tiny, greedy, joint=joint, top_k=3, frontier=2, depth=4, tokens=10)
    eng.start(ids, 40)
    drafter = eng.parts.drafter
    while not eng.finished:
        before = len(eng.state.committed)
        step = eng.step()
        if step.drafted:  # the head read every committed position whose next token was committed, no tree row
            assert drafter.cache.length == before - 1
    trace = eng.trace
    assert trace.generated_ids == want
    drafted = [s for s in trace.steps if s.drafted]
    assert drafted and all(s.drafted <= 10 and max(n.depth for n in s.nodes) <= 4 for s in drafted)
    assert all(n.q is not None for s in drafted for n in s.nodes[1:])  # the head's q of every node it drafted
    assert all(s.drafter["head"]["target_layers"] == [0, 1, 2] for s in drafted)
    # the head's rows are timed as draft forwards: one catch-up and one per expanded level
    assert all(sum(1 for seg in s.timeline if seg["phase"] == "draft forward") == s.draft_calls for s in drafted)
    # a token outside the head's draft vocabulary (bytes 32-95) was committed by the target all the same
    assert any(t < 32 or t >= 96 for t in trace.generated_ids)
    if joint:
        assert not trace.steps[0].drafted  # no target state before the prompt is read: a plain first step


def test_head_drafting_samples_the_targets_law(tiny):
    from explorer.analysis.audit import audit_engine
    from explorer.engine.sampling import SamplingConfig

    eng = _head_engine(tiny, SamplingConfig(temperature=1.0, seed=7), top_k=2, frontier=2, depth=3, tokens=6)
    result = audit_engine(eng, tiny.tokenizer.encode("a b c a b c a b"), samples=AUDIT_SAMPLES)
    assert result.passed, result.summary()


def test_the_rerank_keeps_ancestors_and_earlier_siblings():
    from explorer.engine.drafters.eagle import _best_closed

    # anchor -> 0 (rank 0, -1.0), 1 (rank 1, -0.5: better, but drawn second); 0 -> 2 (-1.1); 1 -> 3 (-0.6)
    parent, score, rank = [-1, -1, 0, 1], [-1.0, -0.5, -1.1, -0.6], [0, 1, 0, 0]
    assert _best_closed(parent, score, rank, 1) == [0]  # 1 cannot come before its earlier-drawn sibling
    assert _best_closed(parent, score, rank, 3) == [0, 1, 3]
    assert sorted(_best_closed(parent, score, rank, 9)) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------ the eagle method

def test_eagle_is_a_method_that_takes_a_head_folder_and_records_it(tiny, tmp_path, capsys):
    """``--method eagle --head DIR`` on every command that takes a method: the run keeps ``ar``'s greedy tokens and
    its trace names the head (folder, config hash, draft vocabulary, feature layers); without a head for the target
    the command says so."""
    from explorer.cli.main import main
    from explorer.trace.records import load_run

    _, folder = _saved(tiny, tmp_path)
    args = ["generate", "--models", "tiny", "--prompt", "def add(a, b):", "--no-chat-template",
            "--max-new-tokens", "24", "--method", "eagle", "--head", str(folder), "--head-topk", "2",
            "--head-depth", "3", "--head-tokens", "6", "--save-trace", str(tmp_path / "traces"), "--json"]
    assert main(args) == 0, capsys.readouterr().err
    [saved] = list((tmp_path / "traces").glob("*.json"))
    trace = load_run(saved)
    head = trace.settings["head"]
    assert head["path"] == str(folder.resolve()) and head["draft_vocab_size"] == 64
    assert len(head["config_sha256"]) == 16 and head["target_layers"] == [0, 1, 2]
    assert trace.settings["method"]["head_tokens"] == 6
    assert all(s.drafted <= 6 for s in trace.steps)
    capsys.readouterr()
    assert main(["generate", "--models", "tiny", "--prompt", "x", "--method", "eagle"]) == 2
    assert "no EAGLE-3 head is shipped for" in capsys.readouterr().err
    assert main(["generate", "--models", "tiny", "--prompt", "x", "--method", "eagle", "--head",
                 str(tmp_path / "nowhere")]) == 2
    assert "no head folder at" in capsys.readouterr().err


def test_the_eagle_configs_shape_bounds_its_tree():
    from explorer.engine.config import DEFAULTS
    from explorer.engine.tree import TreeShapeError

    config = DEFAULTS["eagle"].with_(head_tokens=20, head_depth=5)
    assert config.max_nodes() == 20 and config.max_draft_depth() == 5
    assert not config.spec.uses_draft_model and config.spec.uses_head
    with pytest.raises(TreeShapeError, match="head_topk 4"):
        DEFAULTS["eagle"].with_(verifier="spechub")
    DEFAULTS["eagle"].with_(verifier="spechub", head_topk=2)
    with pytest.raises(TreeShapeError, match="head_tokens"):
        DEFAULTS["eagle"].with_(head_tokens=0)


def test_a_head_step_is_explained_and_drawn_from_its_trace_alone(tiny, tmp_path):
    """Teach mode says the head drafted from the target's features (no draft model), and the tree figure names the
    layers it read and marks a bonus token outside its draft vocabulary, all from the saved trace."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.lessons.teach import explain_step
    from explorer.trace.figures import tree_figure
    from explorer.trace.records import loads_run

    _, folder = _saved(tiny, tmp_path)
    eng = build_engine(tiny, DEFAULTS["eagle"].with_(head=str(folder), fallback="off"), SamplingConfig())
    eng.start(tiny.tokenizer.encode("def add(a, b):\n    return a + b\n"), 24)
    trace = loads_run(eng.run().to_json())
    vocab = set(trace.settings["head"]["draft_ids"])
    assert vocab == set(range(10, 74))
    step = next(s for s in trace.steps if s.drafted)
    words = " ".join(explain_step(step, trace.settings["method"]))
    assert "no draft model" in words and "layers 0, 1, 2" in words
    fig = tree_figure(step, draft_vocab=vocab)
    assert fig.layout.title.subtitle.text == "head read target layers 0, 1, 2"
    outside = [s for s in trace.steps if s.bonus_token is not None and s.bonus_token not in vocab]
    assert outside, "the tiny target commits tokens outside bytes 10-73"
    stars = [t for t in tree_figure(outside[0], draft_vocab=vocab).data if t.name and t.name.startswith("bonus")]
    assert stars[0].marker.symbol == "star-open" and "outside the head's" in stars[0].name


# ------------------------------------------------------------------------------------------------ on a GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HEAD_PROMPT = "def add(a, b):\n    return a + b\n"


def _eagle_on(pair, tmp_path, **changes):
    """``eagle`` with a random head saved for ``pair``'s target (loaded through ``head_for`` on its device)."""
    from explorer.engine.config import DEFAULTS

    _, folder = _saved(pair, tmp_path)
    return DEFAULTS["eagle"].with_(head=str(folder), head_tokens=8, fallback="off", **changes)


def _greedy_run(pair, config, kv_cache: str):
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig

    eng = build_engine(pair, config, SamplingConfig(temperature=0.0), kv_cache=kv_cache.removesuffix("+graphs"),
                       graphs=kv_cache.endswith("+graphs"))
    eng.start(pair.tokenizer.encode(HEAD_PROMPT), 40)
    return eng.run()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kv_cache", ["dynamic", "static", "static+graphs"])
@pytest.mark.parametrize("tree_choice", ["fixed", "online"])
def test_the_head_keeps_ars_greedy_tokens_on_cuda(tiny_cuda, tmp_path, kv_cache, tree_choice):
    """The head's forwards, its tree and the target's verification with the layers it reads (captured in the
    target's bucket graphs under ``static+graphs``) on the GPU: ``ar``'s greedy tokens, drafts made and verified."""
    from explorer.engine.config import DEFAULTS

    want = _greedy_run(tiny_cuda, DEFAULTS["ar"], kv_cache).generated_ids
    trace = _greedy_run(tiny_cuda, _eagle_on(tiny_cuda, tmp_path, tree_choice=tree_choice), kv_cache)
    assert trace.model["device"].startswith("cuda")
    assert trace.generated_ids == want
    assert sum(s.drafted for s in trace.steps) > 0 and all(s.drafted <= 8 for s in trace.steps)


@pytest.mark.cuda
@cuda
def test_the_head_passes_the_audit_on_cuda(tiny_cuda, tmp_path):
    from explorer.analysis.audit import audit
    from explorer.engine.sampling import SamplingConfig

    r = audit(tiny_cuda, _eagle_on(tiny_cuda, tmp_path, tree_choice="fixed"),
              SamplingConfig(temperature=1.0, seed=7_000), tiny_cuda.tokenizer.encode("a b c a b c a b"), 600)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)


def test_heads_export_writes_either_layout_and_each_loads_back(tiny, tmp_path, capsys):
    from explorer.cli.main import main

    head, folder = _saved(tiny, tmp_path)
    for layout in ("speculators", "specforge"):
        out = tmp_path / layout
        assert main(["heads", "export", "--head", str(folder if layout == "speculators" else tmp_path / "speculators"),
                     "--out", str(out), "--format", layout, "--verifier", "tiny"]) == 0
        assert f"the head in the {layout} layout" in capsys.readouterr().out
        loaded = load_head(out, target=tiny.target)
        assert torch.equal(loaded.midlayer.self_attn.q_proj.weight.float(),
                           head.midlayer.self_attn.q_proj.weight.float())
    assert json.loads((tmp_path / "specforge" / "config.json").read_text())["architectures"] == [ARCHITECTURE]
    assert main(["heads", "export", "--head", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "no head folder" in capsys.readouterr().err
