"""Online distillation of the draft model through a LoRA adapter (``explorer/engine/online_distill_draft.py``, OSD):
the adapter learns between requests only and the pair's draft stays as loaded, the update trains the logits that
drafted each rejected token, a learned draft is audited lossless, and the adapter saves and loads back."""

import json

import pytest
import torch

from explorer.analysis.audit import audit_engine
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.online_distill_draft import ADAPTER_CONFIG, DISTILL_FILE, DraftDistiller
from explorer.engine.parts import EngineError
from explorer.engine.sampling import SamplingConfig
from explorer.instruments.replay import ReplayError, replay_steps

PROMPT = "def add(a, b):\n    return a + b\n"


def _config(method="sd", **changes):
    base = dict(online_distill=True, distill_lr=3e-3, distill_every=1, fallback="off")
    return DEFAULTS[method].with_(**{**base, **changes})


def _request(tiny, config, distiller=None, temperature=0.0, seed=0, n=32, prompt=PROMPT):
    engine = build_engine(tiny, config, SamplingConfig(temperature=temperature, seed=seed), distiller=distiller)
    engine.start(tiny.tokenizer.encode(prompt), n)
    return engine, engine.run()


def test_the_adapter_learns_between_requests_only_and_the_pairs_draft_stays(tiny):
    before = {k: v.clone() for k, v in tiny.draft.state_dict().items()}
    ar = build_engine(tiny, DEFAULTS["ar"], SamplingConfig(temperature=0.0))
    ar.start(tiny.tokenizer.encode(PROMPT), 32)
    expected = ar.run().generated_ids
    distiller, versions = None, []
    for _ in range(4):
        engine, trace = _request(tiny, _config(), distiller)
        distiller = engine.parts.distiller
        versions.append({s.drafter["draft_adapter"]["version"] for s in trace.steps if "draft_adapter" in s.drafter})
        assert trace.settings["draft_adapter"]["version"] == min(versions[-1])
        assert trace.generated_ids == expected  # greedy: what the target alone writes, whatever the adapter
    assert versions == [{0}, {1}, {2}, {3}]  # one update after each request, none inside one
    assert all(row["rejections"] > 0 and row["updated"] for row in distiller.history)
    losses = [row["loss"] for row in distiller.history]
    assert losses[-1] < losses[0]  # the same prompt again: the adapter fits the target where the draft missed
    assert distiller.history[-1]["first_acceptance"] > distiller.history[0]["first_acceptance"]
    assert all(torch.equal(before[k], v) for k, v in tiny.draft.state_dict().items())  # the pair's draft as loaded
    assert any(float(p.detach().abs().sum()) > 0 for n, p in distiller.model.named_parameters() if "lora_B" in n)


def test_the_update_trains_the_logits_that_drafted_each_rejected_token(tiny):
    """One forward over the committed ids gives back the draft's own probability of every token the verifier
    rejected (the trace's q), at the row before the position the rejection names, for a tree (mcsd) too."""
    for method, changes in (("sd", {}), ("mcsd", {"k_config": (2, 2, 1)})):
        engine = build_engine(tiny, _config(method, distill_every=1000, **changes), SamplingConfig(temperature=0.0))
        engine.start(tiny.tokenizer.encode(PROMPT), 40)
        distiller = engine.parts.distiller
        rejected_q, record = {}, None
        while not engine.finished:
            step = engine.step()
            if not engine.finished:
                record = distiller._current
            drafted, verified = engine.last_step
            path = verified.result.path
            below = path[-1] if path else -1
            position = step.nodes[0].position_id + 1 + len(path)  # nodes[0]: the anchor; its children one further
            for c in drafted.tree.children(below):
                rejected_q.setdefault(position, []).append((drafted.tree.token[c], drafted.q_show[c]))
        assert record is not None and len(record.rejections) >= 3
        record.committed = list(engine.state.committed)
        with torch.no_grad():
            logq = distiller.rejection_logq(record)
        checked = 0
        for i, r in enumerate(record.rejections):
            for token, shown in rejected_q[r.position]:
                assert float(logq[i, token].exp()) == pytest.approx(shown, abs=1e-4), (method, r.position)
                checked += 1
        assert checked >= len(record.rejections)


def test_a_learned_draft_stays_lossless(tiny):
    distiller = None
    for seed in range(3):
        engine, _ = _request(tiny, _config(distill_lr=1e-2), distiller, temperature=1.0, seed=seed)
        distiller = engine.parts.distiller
    assert distiller.version == 3
    engine = build_engine(tiny, _config(distill_every=1000, gamma=3), SamplingConfig(temperature=1.0, seed=55_000),
                          distiller=distiller)
    r = audit_engine(engine, tiny.tokenizer.encode("def f(x):\n    return"), 400)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert {s.drafter["draft_adapter"]["version"] for s in engine.trace.steps} == {3}  # the learned adapter drafted


def test_a_learned_adapter_saves_and_loads_and_its_trace_replays_with_it(tiny, tmp_path, capsys):
    out = tmp_path / "adapter"
    assert main(["generate", "--models", "tiny", "--method", "mcsd", "--k-config", "2,2", "--online-distill",
                 "--distill-every", "1", "--distill-lr", "1e-2", "--prompt", PROMPT, "--no-chat-template",
                 "--max-new-tokens", "24", "--save-distilled", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "draft adapter version 0" in printed and "updated (loss" in printed
    assert json.loads((out / ADAPTER_CONFIG).read_text())["peft_type"] == "LORA"
    saved = json.loads((out / DISTILL_FILE).read_text())
    assert saved["version"] == 1 and len(saved["history"]) == 1

    loaded = DraftDistiller.for_draft(tiny.draft, tiny.vocab_size, adapter=out)
    ids = torch.tensor([tiny.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        assert torch.allclose(loaded.model(input_ids=ids).logits, _learned_logits(tiny, out, ids), atol=1e-5)
        assert not torch.allclose(loaded.model(input_ids=ids).logits, tiny.draft(input_ids=ids).logits, atol=1e-4)
    config = DEFAULTS["mcsd"].with_(k_config=(2, 2), draft_adapter=str(out))
    engine, trace = _request(tiny, config, n=16)
    assert trace.settings["draft_adapter"]["path"] == str(out) and engine.parts.distiller is None
    assert len([s for _, s in replay_steps(tiny, trace, len(trace.steps) - 1)]) == len(trace.steps)

    engine, _ = _request(tiny, config.with_(online_distill=True, distill_every=1), n=16)
    _, learned = _request(tiny, config.with_(online_distill=True), engine.parts.distiller, n=16)
    assert learned.settings["draft_adapter"]["version"] == 1  # drafted by weights no folder holds
    with pytest.raises(ReplayError, match="--draft-adapter DIR"):
        next(replay_steps(tiny, learned, 0))


def _learned_logits(tiny, folder, ids):
    """The adapter in ``folder`` applied by peft itself (``PeftModel.from_pretrained``) to a copy of the draft."""
    import copy

    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(tiny.draft), str(folder))
    return model(input_ids=ids).logits


def test_an_int8_draft_learns_on_float_layers_shared_by_every_session(tiny):
    """The CPU's int8 draft has no gradients: a session's adapter sits on float32 copies of its linear layers,
    dequantized once per draft and shared, and the run stays greedy-equal."""
    from explorer.engine.online_distill_draft import float_linears
    from explorer.models.loading import quantize_draft

    int8 = quantize_draft(tiny, "int8")
    engine, trace = _request(int8, _config(), n=16)
    first = engine.parts.distiller
    assert first.version == 1 and first.history[0]["rejections"] > 0
    engine2, _ = _request(int8, _config(), n=16)
    layers = float_linears(int8.draft)
    assert layers and all(any(m is layer for m in first.model.modules()) for layer in layers.values())
    assert all(any(m is layer for m in engine2.parts.distiller.model.modules()) for layer in layers.values())
    ar = build_engine(int8, DEFAULTS["ar"], SamplingConfig(temperature=0.0))
    ar.start(tiny.tokenizer.encode(PROMPT), 16)
    assert ar.run().generated_ids == trace.generated_ids


def test_drafts_that_cannot_take_an_adapter_are_clear_errors(tiny, tmp_path):
    import copy
    import dataclasses

    from explorer.models.packed_weights import can_pack, pack_linear_weights

    draft = copy.deepcopy(tiny.draft)
    if can_pack(draft):  # oneDNN-packed weights keep no plain weight to adapt
        pack_linear_weights(draft)
        with pytest.raises(EngineError, match="--packed-weights off"):
            build_engine(dataclasses.replace(tiny, draft=draft), _config(), SamplingConfig(temperature=0.0))
    with pytest.raises(ValueError, match="has neither"):
        DEFAULTS["prompt-lookup"].with_(online_distill=True)
    with pytest.raises(ValueError, match="has neither to adapt"):
        DEFAULTS["layer-skip"].with_(draft_adapter=str(tmp_path))
    (tmp_path / ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(EngineError, match="cannot read a draft adapter"):
        build_engine(tiny, DEFAULTS["sd"].with_(draft_adapter=str(tmp_path)), SamplingConfig(temperature=0.0))


def test_the_stream_experiment_learns_the_drafts_adapter(tiny, monkeypatch, capsys):
    """``heads online --method sd``: held-out prompts before, a stream with the adapter learning, the same prompts
    after with the adapter saved and loaded back (short prompts: the tiny pair holds 512 positions)."""
    from explorer.heads import online

    monkeypatch.setattr(online, "stream_prompts", lambda kind, n, held, seed: {
        "stream": [PROMPT] * n, "held_out": {"code": ["def f(x):\n    return"], "chat": ["hello there"]}})
    report = online.online_stream(tiny, "code", requests=2, held_out=1, lr=1e-2, every=1, max_new_tokens=12,
                                  method="sd", progress=lambda msg: None)
    assert report["settings"]["method"] == "sd" and report["settings"]["version"] == 2
    assert set(report["before"]) == set(report["after"]) == {"code", "chat"} and len(report["history"]) == 2
    assert main(["heads", "online", "--models", "tiny", "--method", "token-recycling", "--kind", "code"]) == 2
    assert "cannot learn online" in capsys.readouterr().err
