"""``layer-skip``: the target drafts with its own first layers (an early exit), the exit chosen from measured
acceptance, the KV cache of the layers it shares copied from the target's. Lossless (greedy equality with
transformers' ``generate`` and the audit at T = 1), on several families and on the embedded target."""

import json
from pathlib import Path

import pytest
import torch

from explorer.analysis.audit import audit
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS
from explorer.engine.drafters.layer_skip import ExitChooser, candidate_exits
from explorer.engine.factory import build_engine
from explorer.engine.runtime.kv_cache import DynamicKVCache, copy_layers
from explorer.engine.sampling import SamplingConfig
from explorer.models.early_exit import EarlyExitDraft, self_draft_pair
from explorer.models.tiny import save_pair, tiny_family_pair

PROMPT = "def area(w, h):\n    return w * h\n\ndef perimeter(w, h):\n    return 2 * "
GREEDY = SamplingConfig(temperature=0.0)
APP = str(Path(__file__).resolve().parent.parent / "app.py")


def generate(model, ids, n):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_layer_skip_equals_generate_while_its_exit_moves(family):
    pair = tiny_family_pair(family, target_layers=8)
    ids = pair.tokenizer.encode(PROMPT)
    engine = build_engine(pair, DEFAULTS["layer-skip"].with_(fallback="off"), GREEDY)
    engine.start(ids, 32)
    engine.run()
    assert engine.committed[len(ids):] == generate(pair.target, ids, 32)
    exits = [s.drafter["layer_skip"]["exit_layer"] for s in engine.trace.steps]
    assert set(candidate_exits(8)) <= set(exits)  # every candidate was tried, deepest first
    assert exits[0] > engine.pair.draft.n_layers // 2  # deeper than the prefill's exit: its layers were copied
    # no second copy of any weight: the draft's parameters are the target's
    assert all(a is b for a, b in zip(engine.pair.draft.parameters(), pair.target.parameters()))


def test_copied_layers_hold_what_a_prefill_at_that_exit_computes():
    pair = self_draft_pair(tiny_family_pair("llama", target_layers=8))
    ids = pair.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        target_kv = DynamicKVCache()
        pair.target(input_ids=torch.tensor([ids]), past_key_values=target_kv.hf, use_cache=True)
        target_kv.length = len(ids)
        pair.draft.set_exit(6)
        fresh = DynamicKVCache()
        pair.draft(input_ids=torch.tensor([ids]), past_key_values=fresh.hf, use_cache=True)
        copied = DynamicKVCache()
        copied.length = len(ids)
        copy_layers(target_kv, copied, range(0, 6))
    assert len(copied.hf.layers) == 6
    for a, b in zip(fresh.hf.layers, copied.hf.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_layer_skip_passes_the_audit(family):
    pair = tiny_family_pair(family, target_layers=6)
    ids = pair.tokenizer.encode(PROMPT[:40])
    r = audit(pair, DEFAULTS["layer-skip"].with_(fallback="off", gamma=3), SamplingConfig(temperature=1.0, seed=5),
              ids, 1200)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert len(r.first.exact) >= 4


def test_the_chooser_takes_the_exit_with_the_best_expected_speedup():
    chooser = ExitChooser(n_layers=16, gamma=4, revisit=100)
    assert chooser.candidates == [6, 8, 10, 12]
    for e in reversed(chooser.candidates):  # untried exits come first, deepest first
        assert chooser.choose() == e
        chooser.record(e, accepted={6: 0, 8: 5, 10: 20, 12: 20}[e], drafted=20)
    assert chooser.choose() == 10  # as accepted as 12, and cheaper


def test_exits_that_do_not_pay_give_plain_steps_and_are_tried_ever_less_often():
    poor = ExitChooser(n_layers=16, gamma=4, revisit=2)
    for _ in range(4):
        poor.record(poor.choose(), accepted=0, drafted=40)
    assert poor.choose() is None  # no exit beats plain decoding: a plain step
    poor.plain_step()
    assert poor.choose() == 12  # the deepest exit is due again (2 x 2 steps after its try)
    for _ in range(4):
        exit_layer = poor.choose()
        assert exit_layer is not None
        poor.record(exit_layer, accepted=0, drafted=40)
    plain = 0
    while (exit_layer := poor.choose()) is None:
        poor.plain_step()
        plain += 1
    assert exit_layer == 12 and plain == 5  # it failed again: now it waits 8 steps


def test_a_target_alone_drafts_for_itself_on_the_command_line(tmp_path, capsys):
    pair = tiny_family_pair("qwen3", target_layers=6)
    _, target = save_pair(pair, tmp_path)
    rc = main(["generate", "--target", target, "--method", "layer-skip", "--prompt", PROMPT, "--no-chat-template",
               "--max-new-tokens", "20", "--save-trace", str(tmp_path / "traces")])
    assert rc == 0, capsys.readouterr().err
    [saved] = [json.loads(p.read_text()) for p in (tmp_path / "traces").glob("*.json")]
    generated = [t for step in saved["steps"] for t in step["committed_ids"]]
    assert generated == generate(pair.target, pair.tokenizer.encode(PROMPT), 20)
    assert "own first layers" in saved["model"]["draft_id"]
    from explorer.models.loading import load_named_pair

    alone = load_named_pair("custom", target=target)
    assert isinstance(alone.draft, EarlyExitDraft) and alone.draft.target is alone.target
    assert alone.draft_quant == "none"  # nothing of its own to quantize


def test_the_app_steps_a_target_with_the_draft_left_empty(tmp_path):
    from streamlit.testing.v1 import AppTest

    _, target = save_pair(tiny_family_pair("llama", target_layers=6), tmp_path)
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.sidebar.radio(key="pair_spec").set_value("custom").run()
    at.sidebar.text_input(key="target_path").set_value(target).run()
    at.sidebar.selectbox(key="method").set_value("layer-skip").run()
    at.text_area(key="prompt_text").set_value("def add(a, b):")
    at.button(key="step_btn").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("drafted for itself with its first" in c.value for c in at.caption)


@pytest.mark.real
def test_layer_skip_on_the_embedded_target_equals_ar(real_pair):
    ids = real_pair.tokenizer.encode("def fibonacci(n):\n    ")
    plain = build_engine(real_pair, DEFAULTS["ar"], GREEDY)
    plain.start(ids, 24)
    plain.run()
    engine = build_engine(real_pair, DEFAULTS["layer-skip"].with_(fallback="off"), GREEDY)
    engine.start(ids, 24)
    engine.run()
    assert engine.committed == plain.committed
    assert {s.drafter["layer_skip"]["layers"] for s in engine.trace.steps} == {28}
