"""``layer-skip``: the target drafts with its own first layers (an early exit), the exit chosen from measured
acceptance, the KV cache of the layers it shares copied from the target's. Lossless (greedy equality with
transformers' ``generate`` and the audit at T = 1), on several families and on the embedded target."""

import json
from pathlib import Path

import pytest
import torch

from method_grid import AUDIT_SAMPLES
from explorer.analysis.audit import audit
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS
from explorer.engine.drafters import layer_skip
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


def _lossless_exits(pair, n: int):
    """``layer-skip`` greedy for ``n`` tokens of PROMPT, its text checked against the target's ``generate``:
    the engine and each step's exit layer (None: a plain step)."""
    ids = pair.tokenizer.encode(PROMPT)
    engine = build_engine(pair, DEFAULTS["layer-skip"].with_(fallback="off"), GREEDY)
    engine.start(ids, n)
    engine.run()
    assert engine.state.committed[len(ids):] == generate(pair.target, ids, n)
    return engine, [s.drafter["layer_skip"]["exit_layer"] for s in engine.trace.steps]


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_layer_skip_equals_generate_while_its_exit_moves(family, monkeypatch):
    # every exit tried, deepest first, whatever it measures: the exit moves up and down the layers
    monkeypatch.setattr(layer_skip, "EXPLORE_START", 1e9)
    monkeypatch.setattr(layer_skip.ExitChooser, "_could_pay", lambda self, e: True)
    pair = tiny_family_pair(family, target_layers=8)
    engine, exits = _lossless_exits(pair, 32)
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
              ids, AUDIT_SAMPLES)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert len(r.first.exact) >= 4


def test_the_chooser_takes_the_exit_with_the_best_expected_speedup():
    chooser = ExitChooser(n_layers=16, gamma=4, revisit=100)
    assert chooser.candidates == [6, 8, 10, 12]
    seen = []
    while (e := chooser.choose()) not in seen:
        seen.append(e)
        chooser.record(e, accepted={8: 5, 10: 20, 12: 20}[e], drafted=20)
    assert seen == [12, 10, 8]  # deepest first; 6 is skipped: exit 8 accepts too little for 6 to pay
    assert e == 10  # as accepted as 12, and cheaper


def test_exits_that_do_not_pay_give_plain_steps_and_are_tried_ever_less_often():
    poor = ExitChooser(n_layers=16, gamma=4, revisit=2, explore_start=100.0)  # budget enough for every try here
    assert poor.choose() == 12  # untried: the deepest exit first
    poor.record(12, accepted=2, drafted=40)
    # a shallower exit accepts no more than a deeper one: 3 in 41 at best cannot pay even exit 6's cost
    assert poor.choose() is None
    poor.plain_step()
    waited = 0
    while (exit_layer := poor.choose()) is None:
        poor.plain_step()
        waited += 1
    assert exit_layer == 12 and waited == 3  # due again once its wait (2 x 2 steps) has passed
    poor.record(12, accepted=0, drafted=40)
    waited = 0
    while (exit_layer := poor.choose()) is None:
        poor.plain_step()
        waited += 1
    assert exit_layer == 12 and waited == 8  # it failed again: now it waits 8 steps


def test_an_untrained_exit_is_expected_to_accept_nothing_and_tries_stay_within_budget():
    """The prior expects nothing: before any try no exit pays; while none pays, the tries cost at most the start
    allowance plus 1 % of the steps in target forwards, whatever the schedule would want."""
    fresh = ExitChooser(n_layers=28, gamma=4)
    assert all(fresh.speedup(e) < 1.0 for e in fresh.candidates)
    assert fresh.choose() == 21  # one try, of the deepest exit: gamma * 21/28 = 3 target forwards
    fresh.record(21, accepted=0, drafted=4)
    cost = 3.0
    for _ in range(2000):
        e = fresh.choose()
        if e is None:
            fresh.plain_step()
        else:
            cost += 4 * e / 28
            fresh.record(e, accepted=0, drafted=4)
    assert cost == pytest.approx(fresh.spent) and cost <= 4.0 + 0.01 * fresh.steps
    assert fresh.steps == 2001 and 1 <= sum(fresh.drafted.values()) // 4 <= 10


def test_a_paying_exit_drafts_and_the_others_are_still_measured():
    rich = ExitChooser(n_layers=16, gamma=4, revisit=100)
    assert rich.choose() == 12
    rich.record(12, accepted=39, drafted=40)
    tried = [rich.choose()]  # exit 12 pays: the untried shallower exits are tried (no budget needed)
    rich.record(tried[-1], accepted=38, drafted=40)
    assert tried == [10] and rich.speedup(10) > rich.speedup(12) > 1.0
    while (e := rich.choose()) in (6, 8):
        rich.record(e, accepted=0, drafted=40)
    assert e == 10  # the best measured


def test_the_chooser_carries_across_runs():
    """``state`` and ``restore`` continue a session: the restored chooser makes the choices the original makes;
    a state of another depth or chain length, or a malformed one, is not taken."""
    a = ExitChooser(n_layers=16, gamma=4, revisit=4)
    for accepted in (0, 30, 2, 5, 0, 1):
        e = a.choose()
        a.record(e, accepted=accepted, drafted=40) if e is not None else a.plain_step()
    b = ExitChooser(n_layers=16, gamma=4, revisit=4)
    assert b.restore(json.loads(json.dumps(a.state())))
    for _ in range(50):
        e = a.choose()
        assert b.choose() == e
        for c in (a, b):
            c.record(e, accepted=1, drafted=4) if e is not None else c.plain_step()
    assert a.state() == b.state()
    for other in (ExitChooser(n_layers=20, gamma=4), ExitChooser(n_layers=16, gamma=3)):
        assert not other.restore(a.state()) and other.steps == 0
    assert not b.restore({"layers": 16, "gamma": 4, "exits": "?"}) and b.steps == 0


def test_a_session_carries_the_chooser_from_run_to_run_and_a_run_replays():
    from explorer.engine.carried import Carried
    from explorer.instruments.replay import engine_for_trace

    pair = tiny_family_pair("llama", target_layers=8)
    config = DEFAULTS["layer-skip"].with_(fallback="off")
    carried = Carried()
    traces = []
    for prompt in (PROMPT, PROMPT[:30]):
        engine = build_engine(pair, config, GREEDY, carried=carried)
        engine.start(pair.tokenizer.encode(prompt), 16)
        traces.append(engine.run())
        carried = carried.updated(engine.carried())
    first, second = traces
    assert "layer_skip_carried" not in first.settings
    state = second.settings["layer_skip_carried"]
    assert state["steps"] == len(first.steps)  # the second run went on from where the first stopped
    assert carried.layer_skip["state"]["steps"] == len(first.steps) + len(second.steps)
    replay = engine_for_trace(pair, second)
    replay.run()
    assert [s.drafter["layer_skip"]["exit_layer"] for s in replay.trace.steps] == \
        [s.drafter["layer_skip"]["exit_layer"] for s in second.steps]
    other = build_engine(pair, config.with_(gamma=3), GREEDY, carried=carried)  # another method: starts afresh
    other.start(pair.tokenizer.encode(PROMPT), 4)
    assert "layer_skip_carried" not in other.trace.settings


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
def test_layer_skip_on_the_embedded_target_equals_ar(real_pair, real_prompt, real_greedy):
    engine = build_engine(real_pair, DEFAULTS["layer-skip"].with_(fallback="off"), GREEDY)
    engine.start(real_prompt, 12)
    engine.run()
    assert engine.trace.generated_ids == real_greedy(real_prompt, 12)
    assert {s.drafter["layer_skip"]["layers"] for s in engine.trace.steps} == {28}


def test_a_try_after_plain_steps_copies_the_exits_cache_and_stays_lossless(monkeypatch):
    """While no exit pays the draft cache is not fed; the next try copies the exit's layers from the target's cache
    (more than ``CATCH_UP_ROWS`` tokens behind) and the text is still the target's own."""
    monkeypatch.setattr(layer_skip, "EXPLORE_START", 1e9)  # the schedule alone decides when the exit is tried
    _, exits = _lossless_exits(tiny_family_pair("llama", target_layers=8), 40)
    retry = next(i for i, e in enumerate(exits) if i > 0 and e is not None)
    assert exits[0] == 6 and retry > layer_skip.CATCH_UP_ROWS + 1 and set(exits[1:retry]) == {None}
