"""Online distillation of the EAGLE-3 head (``explorer/engine/online_distill.py``, OSD): what a request leaves, the
update between requests only, the logits it trains being those that drafted the rejected tokens, a learned head
audited lossless, saved and loaded back."""

import json

import pytest
import torch

from explorer.analysis.audit import audit_engine
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.online_distill import DISTILL_FILE, chain_logits
from explorer.engine.sampling import SamplingConfig
from explorer.models.eagle3 import HeadConfig, random_head, save_head
from explorer.models.head_store import head_for

PROMPT = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def head_dir(tiny, tmp_path):
    t = tiny.target.config
    config = HeadConfig(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                        vocab_size=t.vocab_size, draft_vocab_size=64, rope_theta=10000.0, aux_layer_ids=(0, 1, 2))
    return str(save_head(random_head(config, seed=4, draft_ids=list(range(32, 96))), tmp_path / "head"))


def _config(head_dir, **changes) -> MethodConfig:
    base = dict(head=head_dir, online_distill=True, distill_lr=3e-3, distill_every=1, fallback="off",
                head_topk=2, head_depth=3, head_tokens=6)
    return DEFAULTS["eagle"].with_(**{**base, **changes})


def _request(tiny, config, distiller=None, temperature=0.0, seed=0, n=32, prompt=PROMPT):
    engine = build_engine(tiny, config, SamplingConfig(temperature=temperature, seed=seed), distiller=distiller)
    engine.start(tiny.tokenizer.encode(prompt), n)
    return engine, engine.run()


def test_the_head_learns_between_requests_only_and_the_pairs_head_stays(tiny, head_dir):
    shared, _ = head_for(tiny, head_dir)
    before = {k: v.clone() for k, v in shared.state_dict().items()}
    distiller, versions = None, []
    for _ in range(4):
        engine, trace = _request(tiny, _config(head_dir), distiller)
        distiller = engine.parts.distiller
        drafted = {s.drafter["head"]["version"] for s in trace.steps if "head" in s.drafter}
        versions.append(drafted)
        assert trace.settings["head"]["distilled"]["version"] == min(drafted)
    assert versions == [{0}, {1}, {2}, {3}]  # one update after each request, none inside one
    assert distiller.version == 4 and len(distiller.history) == 4
    assert all(row["rejections"] > 0 and row["updated"] for row in distiller.history)
    losses = [row["loss"] for row in distiller.history]
    assert losses[-1] < losses[0]  # the same prompt again: the head fits the target where it missed
    assert all(torch.equal(before[k], v) for k, v in shared.state_dict().items())  # the pair's copy as loaded
    assert not all(torch.equal(before[k], v) for k, v in distiller.head.state_dict().items() if k in before)


def test_an_update_waits_for_its_interval(tiny, head_dir):
    distiller = None
    for _ in range(3):
        engine, _ = _request(tiny, _config(head_dir, distill_every=2), distiller)
        distiller = engine.parts.distiller
    assert distiller.version == 1 and [r.get("updated", False) for r in distiller.history] == [False, True, False]
    assert len(distiller.buffer) == 1  # the third request's rejections wait for the next update


def test_a_replay_window_learns_from_earlier_requests_again(tiny, head_dir):
    """``distill_replay`` R: an update learns from the requests since the last one and the R before them (the
    buffer keeps them), so each update after the first has R + 1 requests' rejections; 0 empties the buffer."""
    distiller, taken = None, []
    for n in range(4):
        engine, _ = _request(tiny, _config(head_dir, distill_replay=2), distiller, prompt=PROMPT + "#" * n)
        distiller = engine.parts.distiller
        if n == 0:
            def counting(d=distiller, update=distiller.update):
                taken.append(len(d.buffer))
                return update()
            distiller.update = counting
    assert taken == [2, 3, 3] and len(distiller.buffer) == 2 and distiller.version == 4
    assert distiller.describe()["replay"] == 2
    engine, _ = _request(tiny, _config(head_dir, distill_replay=0), distiller)  # settings changed: no replay
    assert engine.parts.distiller is distiller and distiller.buffer == [] and distiller.version == 5
    with pytest.raises(ValueError, match="distill_replay"):
        DEFAULTS["eagle"].with_(online_distill=True, distill_replay=65)


def test_the_update_trains_the_logits_that_drafted_each_rejected_token(tiny, head_dir):
    """Recomputed chains give back the head's own probability of every rejected token of the run (the trace's q)
    at the level and row the rejection names: the training-time test matches drafting, level 1 and deeper (the head
    first learns this prompt a little, so that some first tokens pass and deeper ones are rejected)."""
    distiller = None
    for _ in range(3):
        engine, _ = _request(tiny, _config(head_dir, distill_lr=1e-2), distiller, n=40)
        distiller = engine.parts.distiller
    engine = build_engine(tiny, _config(head_dir, distill_every=1000), SamplingConfig(temperature=0.0),
                          distiller=distiller)
    engine.start(tiny.tokenizer.encode(PROMPT), 40)
    distiller = engine.parts.distiller
    rejected_q, record = {}, None
    while not engine.finished:
        step = engine.step()
        if not engine.finished:
            record = distiller._current
        drafted = engine.last_step[0]
        path = engine.last_step[1].result.path
        level = len(path) + 1
        below = path[-1] if path else -1
        row = step.nodes[0].position_id - 1  # the root row: the anchor's position less one
        for c in drafted.tree.children(below):
            rejected_q.setdefault((row, level), []).append((drafted.tree.token[c], drafted.q_show[c]))
    assert record is not None and {r.level for r in record.rejections} >= {1, 2}
    record.tokens = engine.state.committed[record.start + 1:]
    with torch.no_grad():
        levels = chain_logits(distiller.head, record)
    to_draft = {int(t): i for i, t in enumerate(distiller.head.target_ids().tolist())}
    checked = 0
    for r in record.rejections:
        logits, rows = levels[r.level]
        q = logits[rows.index(r.row)].softmax(-1)
        for token, shown in rejected_q[(r.row, r.level)]:
            assert float(q[to_draft[token]]) == pytest.approx(shown, abs=1e-4)
            checked += 1
    assert checked >= 3


def test_a_learned_head_stays_lossless(tiny, head_dir):
    distiller = None
    for seed in range(3):
        engine, _ = _request(tiny, _config(head_dir, distill_lr=1e-2), distiller, temperature=1.0, seed=seed)
        distiller = engine.parts.distiller
    assert distiller.version == 3
    # No update inside the audit: a sample that ends its run (EOS, or a whole tree accepted) ends a request, and how
    # many do depends on the online tree's timings; every 1,000 requests keeps the learned version for 400 samples.
    config = _config(head_dir, distill_every=1000, head_topk=3)
    engine = build_engine(tiny, config, SamplingConfig(temperature=1.0, seed=55_000), distiller=distiller)
    r = audit_engine(engine, tiny.tokenizer.encode("def f(x):\n    return"), 400)
    assert r.first.p_value > 0.001 and r.pairs.p_value > 0.001, (r.first.p_value, r.pairs.p_value)
    assert {s.drafter["head"]["version"] for s in engine.trace.steps if "head" in s.drafter} == {3}  # the learned one


def test_a_learned_head_saves_and_loads_as_any_head(tiny, head_dir, tmp_path, capsys):
    out = tmp_path / "learned"
    assert main(["generate", "--models", "tiny", "--method", "eagle", "--head", head_dir, "--online-distill",
                 "--distill-every", "1", "--distill-lr", "3e-3", "--prompt", PROMPT, "--no-chat-template",
                 "--max-new-tokens", "24", "--save-distilled", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "head version 0" in printed and "updated (loss" in printed
    saved = json.loads((out / DISTILL_FILE).read_text())
    assert saved["version"] == 1 and saved["history"][0]["rejections"] > 0
    learned, _ = head_for(tiny, str(out))
    original, _ = head_for(tiny, head_dir)
    assert not torch.equal(learned.lm_head.weight, original.lm_head.weight)
    _, trace = _request(tiny, DEFAULTS["eagle"].with_(head=str(out), fallback="off"))
    assert trace.generated_ids  # drafts with it, as any head


def test_only_a_head_or_a_draft_model_distils():
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        MethodConfig(method="token-recycling", online_distill=True)
    assert MethodConfig(method="mcsd", online_distill=True).distils_draft  # a LoRA adapter: test_online_distill_draft
    with pytest.raises(ValueError, match="distill_every"):
        DEFAULTS["eagle"].with_(online_distill=True, distill_every=0)


def test_a_lesson_learns_its_head_on_a_stream_before_its_runs(tiny, head_dir, tmp_path):
    from explorer.heads.online import stream_prompts
    from explorer.lessons.record import (GREEDY, LEARNED_HEAD, LEARNING_LESSON, LEARNING_PROMPT, LessonSpec,
                                         _learned_runs)

    before = DEFAULTS["eagle"].with_(head=head_dir, fallback="off", tree_choice="fixed")
    spec = LessonSpec("x", "t", "q", PROMPT, (("before", before, GREEDY), ("after", before.with_(head=LEARNED_HEAD),
                                                                            GREEDY)),
                      lambda runs, info: [], max_new_tokens=16, learn=("code", 3, 3e-3, 1))
    runs, history = _learned_runs(tiny, spec, str(tmp_path), stream=lambda kind, n: [PROMPT] * n)
    assert runs[0][1].head == head_dir and runs[1][1].head == str(tmp_path) and (tmp_path / DISTILL_FILE).exists()
    assert len(history) == 3 and history[-1]["updated"]
    with pytest.raises(ValueError, match="stream"):
        _learned_runs(tiny, spec, str(tmp_path))
    # lesson 10's prompt is held out: the one after the stream it learns from
    lesson = LEARNING_LESSON
    kind, requests, _, _ = lesson.learn
    assert LEARNING_PROMPT == lesson.prompt == stream_prompts(kind, requests, 1)["held_out"][kind][0]
    assert LEARNING_PROMPT not in stream_prompts(kind, requests, 1)["stream"]


def test_a_lessons_learned_run_says_what_taught_it_and_goes_on_live_with_the_head_it_started_from(tiny, head_dir):
    """The learned head is not kept: the recorded run names its stream in place of a temporary folder, a replay
    refuses it with that reason, and the Classroom's Continue live goes on from its text with the starting head."""
    from explorer.instruments.replay import ReplayError, engine_after_text, replay_steps
    from explorer.lessons.lesson import Note
    from explorer.lessons.record import GREEDY, LEARNED_HEAD, LessonSpec, record_lesson

    before = DEFAULTS["eagle"].with_(head=head_dir, fallback="off", tree_choice="fixed")
    spec = LessonSpec("x", "t", "q", PROMPT, (("before", before, GREEDY), ("after", before.with_(head=LEARNED_HEAD),
                                                                            GREEDY)),
                      lambda runs, info: [Note(0, 0, "draft", "a note")], max_new_tokens=12, learn=("code", 2, 3e-3, 1))
    lesson = record_lesson(tiny, spec, progress=lambda msg: None, stream=lambda kind, n: [PROMPT] * n)
    learned = lesson.runs[1].trace
    assert learned.settings["head"]["learned"] == {"kind": "code", "requests": 2, "lr": 3e-3, "every": 1,
                                                   "version": 2}
    assert learned.settings["method"]["head"] == head_dir and "path" not in learned.settings["head"]
    assert lesson.recorded["threads"] == torch.get_num_threads()
    with pytest.raises(ReplayError, match="learned online on 2 code prompts"):
        next(replay_steps(tiny, learned, 0))
    assert len(list(replay_steps(tiny, lesson.runs[0].trace, len(lesson.runs[0].trace.steps) - 1))) == len(
        lesson.runs[0].trace.steps)
    engine = engine_after_text(tiny, learned, 1)
    assert engine.trace.settings["head"]["path"] == head_dir


def test_the_stream_experiment_pairs_the_two_heads_on_the_held_out_answers(tiny, head_dir, tmp_path, monkeypatch):
    """``heads online``: the learned head is kept with ``save`` and loads as any head; ``paired_top1`` counts both
    heads teacher-forced at the same answer positions (after = before + gained - lost). On an answer made of the
    first head's own top-1 tokens, it is right everywhere, and a head that differs loses what it misses."""
    from explorer.heads import online
    from explorer.heads.data import target_features
    from explorer.heads.gap import level1_logits

    monkeypatch.setattr(online, "stream_prompts", lambda kind, n, held, seed: {
        "stream": [PROMPT] * n, "held_out": {"code": ["def f(x):\n    return"], "chat": ["hello there"]}})
    kept = tmp_path / "learned"
    report = online.online_stream(tiny, "code", requests=2, held_out=1, lr=1e-2, every=1, max_new_tokens=12,
                                  head=head_dir, save=str(kept), progress=lambda msg: None)
    paired = report["paired_top1"]
    assert set(paired) == {"code", "chat"} and all(c["positions"] >= 12 for c in paired.values())
    assert all(c["after"] == c["before"] + c["gained"] - c["lost"] for c in paired.values())
    learned, _ = head_for(tiny, str(kept))
    original, _ = head_for(tiny, head_dir)
    assert json.loads((kept / DISTILL_FILE).read_text())["version"] == 2
    assert not torch.equal(learned.lm_head.weight, original.lm_head.weight)
    ids, layers = tiny.tokenizer.encode(PROMPT), tuple(original.config.aux_layers(3))
    n_prompt = len(ids)
    for _ in range(8):  # each token the head's own top-1 at its row (the target is causal: earlier rows stay)
        seq = target_features(tiny, ids + [0], layers)
        ids.append(int(original.target_ids().cpu()[level1_logits(original, seq.states, seq.tokens)[-2].argmax()]))
    answers = [{"kind": "code", "ids": ids, "prompt_tokens": n_prompt}]
    same = online.paired_top1(tiny, original, original, answers)["code"]
    assert same == {"positions": 8, "before": 8, "after": 8, "gained": 0, "lost": 0}
    other = online.paired_top1(tiny, original, learned, answers)["code"]
    assert other["before"] == 8 and other["lost"] == 8 - other["after"] and other["gained"] == 0
    assert online.paired_top1(tiny, learned, original, answers)["code"]["gained"] == 8 - other["after"]
