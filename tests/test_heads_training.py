"""Training a head on the tiny pair: features cached once, the training-time-test loss falls, a run resumes where
it stopped, and the trained head drafts more accepted tokens than an untrained one (lossless either way)."""

import json

import pytest
import torch

from explorer.engine.config import DEFAULTS
from explorer.engine.drafters.eagle import HeadDrafter
from explorer.engine.factory import build_parts
from explorer.engine.machine import Engine
from explorer.engine.sampling import SamplingConfig
from explorer.heads.data import Sequence, build, chunk, load, swapped_vocabulary, token_counts
from explorer.heads.train import head_config, train_head, ttt_levels, ttt_loss
from explorer.models.eagle3 import HeadCache, load_head, random_head

TEXT = "the cat sat on the mat. the dog sat on the log. " * 12
GREEDY = SamplingConfig(temperature=0.0)


def _tokens_per_call(tiny, head) -> float:
    config = DEFAULTS["prompt-lookup"].with_(fallback="off")
    parts = build_parts(tiny, config, GREEDY)
    parts.drafter = HeadDrafter(head, head.config.aux_layers(2), top_k=2, frontier=2, depth=4, tokens=8)
    eng = Engine(tiny, config, GREEDY, parts)
    eng.start(tiny.tokenizer.encode(TEXT[:60]), 40)
    trace = eng.run()
    return len(trace.generated_ids) / sum(s.target_calls for s in trace.steps)


def test_a_head_trains_resumes_and_drafts_better_than_untrained(tiny, tmp_path):
    ids = tiny.tokenizer.encode(TEXT)
    sequences = chunk([ids], 96)
    data = build(tiny, sequences, (0, 1, 2), tmp_path / "data", progress=False)
    stamp = (data / "manifest.json").stat().st_mtime_ns
    assert build(tiny, sequences, (0, 1, 2), data, progress=False) == data  # cached: not computed again
    assert (data / "manifest.json").stat().st_mtime_ns == stamp
    cached = load(data)
    assert len(cached) == len(sequences) and cached[0].states.shape == (96, 3, tiny.target.config.hidden_size)
    out = tmp_path / "head"
    first = train_head(tiny, data, out, draft_vocab=64, intermediate=64, steps=80, lr=3e-3, ttt=2,
                       save_every=40, progress=False)
    history = json.loads((out / "train_state.json").read_text())["history"]
    assert first["steps"] == 80 and len(history) == 2
    assert history[-1]["loss"] < history[0]["loss"]
    # a run started again on the folder goes on from the last save
    more = train_head(tiny, data, out, draft_vocab=64, intermediate=64, steps=100, lr=3e-3, ttt=2,
                      save_every=20, progress=False)
    assert more["steps"] == 100 and len(json.loads((out / "train_state.json").read_text())["history"]) == 3
    trained = load_head(out, target=tiny.target)
    untrained = random_head(trained.config, seed=5, draft_ids=trained.target_ids().tolist())
    untrained.set_embeddings(tiny.target.get_input_embeddings())
    assert _tokens_per_call(tiny, trained) > _tokens_per_call(tiny, untrained)


def test_the_ttt_loss_has_a_gradient_and_one_agreement_per_level(tiny, tmp_path):
    config = head_config(tiny.target, (0, 1, 2), 64, intermediate=64)
    head = random_head(config, seed=1)
    head.set_embeddings(tiny.target.get_input_embeddings())
    ids = tiny.tokenizer.encode(TEXT[:40])
    seq = load(build(tiny, [ids], (0, 1, 2), tmp_path / "data", progress=False))[0]
    to_draft = torch.full((tiny.target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[head.target_ids()] = torch.arange(64)
    loss, agree = ttt_loss(head, seq, 2, 0.8, to_draft)
    assert loss.requires_grad and len(agree) == 2 and torch.isfinite(loss)


def test_the_training_levels_are_what_drafting_computes(tiny, tmp_path):
    """Level 3 of training-time test at chain start t equals the head drafting from the context ending at t + 1:
    the level-1 rows 0 .. t in its cache, then two tree rows fed one after the other (with the true tokens)."""
    config = head_config(tiny.target, (0, 1, 2), 64, intermediate=64)
    head = random_head(config, seed=2)
    head.set_embeddings(tiny.target.get_input_embeddings())
    ids = tiny.tokenizer.encode(TEXT[:48])
    seq = load(build(tiny, [ids], (0, 1, 2), tmp_path / "data", progress=False))[0]
    with torch.no_grad():
        levels = ttt_levels(head, seq, 3)
        for t in (0, 5, 17):
            cache = HeadCache()
            feats = head.features(seq.states[: t + 1])
            level1, g = head(seq.tokens[1: t + 2], feats, torch.arange(t + 1), cache)
            assert torch.allclose(level1[-1], levels[0][t], atol=1e-4)
            g = g[-1:]
            for j in (2, 3):  # a tree row sees the cached rows, its ancestors' rows and itself
                logits, g = head(seq.tokens[t + j: t + j + 1], g, torch.tensor([t + j - 1]), cache)
                assert torch.allclose(logits[0], levels[j - 1][t], atol=1e-4), (t, j)


def test_the_stdlib_corpus_is_deterministic_and_holds_no_bench_prompt():
    from explorer.analysis.prompts import humaneval
    from explorer.heads.corpus import MAX_CHARS, MIN_CHARS, bench_probes, clean, stdlib_texts

    texts = stdlib_texts(limit_chars=300_000)
    assert texts == stdlib_texts(limit_chars=300_000) and len(texts) > 10
    assert all(MIN_CHARS <= len(t) <= MAX_CHARS and "test" not in name.split("/")[:-1] for name, t in texts)
    probes = bench_probes()
    assert len(probes) > 50
    kept, dropped = clean(texts, probes)
    assert not dropped and len(kept) == len(texts)
    leaky = ("leaky.py", "x = 1\n" + humaneval()[3].text)  # a text that holds a bench prompt is left out
    assert clean(texts[:2] + [leaky], probes) == (texts[:2], ["leaky.py"])


def test_a_fresh_head_starts_as_the_targets_logit_lens_of_its_last_feature_layer(tiny):
    """``init_from_target``: with the layer's output projections at zero and ``fc`` passing the last feature layer
    through, a fresh head's logits are the target's own LM head (restricted to the draft vocabulary) on that layer's
    state; the head then only learns to step one position ahead."""
    from explorer.heads.train import init_from_target

    draft_ids = list(range(20, 84))
    head = random_head(head_config(tiny.target, (0, 1, 1), 64, intermediate=64), seed=2, draft_ids=draft_ids)
    init_from_target(head, tiny.target, draft_ids)
    head.set_embeddings(tiny.target.get_input_embeddings())
    ids = torch.tensor([tiny.tokenizer.encode(TEXT[:30])])
    with torch.no_grad():
        states = torch.stack(tiny.target(input_ids=ids, output_hidden_states=True).hidden_states, dim=2)[0]
        feats = states[:, [0, 1, 1]]
        n = ids.shape[1] - 1
        logits, _ = head(ids[0, 1:], head.features(feats[:n]), torch.arange(n), HeadCache())
        lens = tiny.target.lm_head(tiny.target.model.norm(states[:n, 1]))[:, draft_ids]
    assert torch.allclose(logits, lens.float(), atol=1e-4)


def test_the_assembled_prompts_cover_every_kind_hold_no_bench_prompt_and_repeat():
    from explorer.heads.corpus import bench_probes, leaks
    from explorer.heads.prompts import KINDS, training_prompts

    prompts = training_prompts(per_kind=6, seed=3)
    assert prompts == training_prompts(per_kind=6, seed=3)  # deterministic for one seed
    assert prompts != training_prompts(per_kind=6, seed=4)
    assert {k for k, _ in prompts} == set(KINDS) and len(prompts) == 6 * len(KINDS)
    assert [k for k, _ in prompts[:len(KINDS)]] == list(KINDS)  # interleaved: any prefix covers every kind
    probes = bench_probes()
    assert not any(leaks(p, probes) for _, p in prompts)
    assert len({p for _, p in prompts}) == len(prompts)


def test_prompts_the_target_writes_are_wrapped_as_requests_and_hold_no_bench_prompt():
    """Self-instruct (``heads/selfinstruct.py``): distinct writing instructions per kind, deterministic; what the
    target wrote becomes the user's request (a code block to complete, an article to summarise, sentences to
    translate); unusable writings, repeats and texts holding a bench prompt are left out."""
    import random

    from explorer.analysis.prompts import PROMPT_SETS
    from explorer.heads.selfinstruct import WRITERS, wrap, writing_prompts, written_prompts

    asks = writing_prompts(per_kind=30, seed=1)
    assert asks == writing_prompts(per_kind=30, seed=1) and len({a for _, a in asks}) == len(asks) == 30 * 7
    assert {k for k, _ in asks} == set(WRITERS)
    rng = random.Random(0)
    code = ('```python\ndef area(w: float, h: float) -> float:\n    """The area.\n\n    >>> area(2, 3)\n    6\n'
            '    """\n```')
    assert "def area(w: float, h: float)" in wrap("code", "Here it is:\n" + code, rng)
    assert wrap("code", "def area(w, h): return w * h", rng) is None  # no code block, no docstring
    assert wrap("summarisation", "Too short to summarise.", rng) is None
    asked = wrap("translation", 'Sentences: "The parcel arrived on Monday, thank you so much."', rng)
    assert "The parcel arrived on Monday, thank you so much." in asked and "Sentences" not in asked
    humaneval = PROMPT_SETS["humaneval"]()[0].text
    written = [{"kind": "qa", "response": "Why do tides rise twice a day?"},
               {"kind": "qa", "response": "Why do tides rise twice a day?"},  # a repeat
               {"kind": "math", "response": "Problem: A baker sells 12 loaves a day at $3. What does she earn?"},
               {"kind": "code", "response": humaneval}]  # a bench prompt written back: dropped
    prompts = written_prompts(written, seed=0)
    assert prompts == [("qa", "Why do tides rise twice a day?"),
                       ("math", "A baker sells 12 loaves a day at $3. What does she earn?")]


def test_the_targets_responses_are_written_once_each_and_train_on(tiny, tmp_path, capsys):
    """``heads respond``: one record per prompt (the prompt as the target reads it, chat template applied, then its
    greedy continuation, as ``generate`` gives it alone); a second run skips what is answered; a file of something
    else is refused."""
    from explorer.cli.main import main
    from explorer.heads.data import HeadDataError
    from explorer.heads.respond import respond

    out = tmp_path / "responses.jsonl"
    prompts = [("code", "def add(a, b):"), ("chat", "the cat sat on the"), ("qa", "x")]
    respond(tiny, prompts[:2], out, max_new_tokens=6, batch=2, progress=False)
    respond(tiny, prompts, out, max_new_tokens=6, batch=2, progress=False)  # only the third is new
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == [p for _, p in prompts]
    stops = set(tiny.eos_token_ids)
    tok = tiny.tokenizer
    for r in records:  # the chat template applied, batched with left padding: each as generate gives it alone
        formatted = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tok.encode(formatted, add_special_tokens=False)
        alone = tiny.target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
        ends = [j for j, t in enumerate(alone) if t in stops]
        assert r["text"] == formatted + tok.decode(alone[:ends[0] + 1] if ends else alone)
        assert r["complete"] == bool(ends)
        assert r["response"] == tok.decode(alone[:ends[0] + 1] if ends else alone, skip_special_tokens=True)
    out.write_text("not json\n")
    with pytest.raises(HeadDataError, match="not a response record"):
        respond(tiny, prompts, out, progress=False)
    assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / "cli.jsonl"), "--per-kind", "1",
                 "--max-new-tokens", "4", "--quiet"]) == 0
    assert len((tmp_path / "cli.jsonl").read_text().splitlines()) == 7
    from explorer.heads.selfinstruct import WRITERS, writing_prompts, written_prompts

    assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / "w.jsonl"), "--per-kind", "1",
                 "--max-new-tokens", "4", "--written", "--quiet"]) == 0
    writings = [json.loads(line) for line in (tmp_path / "w.jsonl.writings.jsonl").read_text().splitlines()]
    assert sorted(r["kind"] for r in writings) == sorted(WRITERS)  # one writing per kind, then the usable ones:
    answered = {json.loads(line)["prompt"] for line in (tmp_path / "w.jsonl").read_text().splitlines()}
    assert answered == {p for _, p in written_prompts(writings)}  # wrapped and answered
    # writings of nothing usable (already in the file, so not written again): said, nothing trained on
    (tmp_path / "x.jsonl.writings.jsonl").write_text("".join(
        json.dumps({"kind": k, "prompt": a, "text": a, "response": "", "complete": False}) + "\n"
        for k, a in writing_prompts(1)))
    assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / "x.jsonl"), "--per-kind", "1",
                 "--written", "--quiet"]) == 2
    assert "wrote nothing usable as a prompt" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_sampled_writings_repeat_for_one_seed_and_differ_for_another(tiny, tmp_path):
    """``respond(temperature=...)`` (``--write-temperature``): sampled, so one instruction can give new texts; one
    seed gives the same texts again."""
    from explorer.heads.respond import respond

    prompts = [("chat", "the cat sat on the"), ("qa", "what did the dog")]

    def texts(name: str, **kw) -> list[str]:
        respond(tiny, prompts, tmp_path / name, max_new_tokens=12, batch=2, progress=False, **kw)
        return [json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]

    greedy = texts("g.jsonl")
    first, again = texts("a.jsonl", temperature=1.0, seed=3), texts("b.jsonl", temperature=1.0, seed=3)
    other = texts("c.jsonl", temperature=1.0, seed=4)
    assert first == again and first != other and first != greedy


def test_earlier_prompts_are_answered_again_sampled_each_once(tiny, tmp_path, capsys):
    """``heads respond --prompts FILE --temperature T``: the prompts of earlier response files (gzipped or not), each
    once, in their order, answered sampled (one seed repeats, greedy differs); a missing, empty or foreign file and
    ``--written`` with it are refused with a message."""
    import gzip

    from explorer.cli.main import main
    from explorer.heads.data import HeadDataError
    from explorer.heads.respond import prompts_of, records

    rows = [{"kind": "chat", "prompt": "the cat sat on the", "text": "t"}, {"kind": "qa", "prompt": "what did the dog"}]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    (tmp_path / "b.jsonl").write_text(json.dumps(rows[1]) + "\n" + json.dumps({"kind": "code", "prompt": "def f("})
                                      + "\n")
    files = [str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl")]
    assert prompts_of(files) == [("chat", "the cat sat on the"), ("qa", "what did the dog"), ("code", "def f(")]

    def run(name: str, *extra: str) -> list[dict]:
        assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / name), "--prompts", files[0],
                     "--prompts", files[1], "--max-new-tokens", "12", "--quiet", *extra]) == 0
        return records(tmp_path / name)

    greedy, first = run("g.jsonl"), run("s.jsonl", "--temperature", "1", "--seed", "3")
    again = run("s2.jsonl", "--temperature", "1", "--seed", "3")
    assert sorted(r["prompt"] for r in first) == sorted(p for _, p in prompts_of(files))  # batched by length
    assert [r["text"] for r in first] == [r["text"] for r in again] != [r["text"] for r in greedy]
    capsys.readouterr()
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    for bad, says in [("missing.jsonl", "no such file"), ("empty.jsonl", "holds no response record"),
                      ("bad.jsonl.gz", "not a readable JSONL file")]:
        with pytest.raises(HeadDataError, match=says):
            prompts_of([str(tmp_path / bad)])
        assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / "x.jsonl"), "--prompts",
                     str(tmp_path / bad), "--quiet"]) == 2
        assert says in capsys.readouterr().err
    assert main(["heads", "respond", "--models", "tiny", "--out", str(tmp_path / "x.jsonl"), "--prompts", files[0],
                 "--written", "--quiet"]) == 2
    assert "give one of them" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_training_texts_are_read_gzipped_or_not_and_bad_files_are_refused(tmp_path):
    """``heads features --texts``: .txt and .jsonl files, gzipped or not (the response files shipped beside a card),
    read alike; a missing, broken or fieldless file is refused with a message naming it."""
    import gzip

    from explorer.cli.heads import read_texts
    from explorer.heads.data import HeadDataError

    lines = "".join(json.dumps({"kind": "qa", "prompt": "p", "text": t}) + "\n" for t in ("alpha beta", "gamma"))
    (tmp_path / "r.jsonl").write_text(lines)
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(b"one text\nof two lines"))
    assert read_texts([str(tmp_path / "r.jsonl")]) == read_texts([str(tmp_path / "r.jsonl.gz")]) == ["alpha beta",
                                                                                                  "gamma"]
    assert read_texts([str(tmp_path / "t.txt.gz")]) == ["one text\nof two lines"]
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    (tmp_path / "fieldless.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "p"}\n'))
    for name, says in [("missing.jsonl.gz", "cannot read"), ("broken.jsonl.gz", "cannot read"),
                       ("fieldless.jsonl.gz", 'fieldless.jsonl.gz:1 is not a JSON object with a "text" field')]:
        with pytest.raises(HeadDataError, match=says):
            read_texts([str(tmp_path / name)])


def test_features_are_cached_apart_and_trained_on_together_with_a_held_out_measure(tiny, tmp_path, capsys):
    """``heads features`` caches a folder; ``heads train`` reads several (``--data`` repeated), measures each level
    on held-out features at every save, and may run in bfloat16 autocast; folders of other layers are refused."""
    from explorer.cli.main import main
    from explorer.heads.data import HeadDataError, load_all

    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT.replace("cat", "bird"))
    for name in ("a", "b"):
        assert main(["heads", "features", "--models", "tiny", "--texts", str(tmp_path / f"{name}.txt"), "--data",
                     str(tmp_path / name), "--seq-len", "64", "--layers", "0,1,2", "--quiet"]) == 0
    assert "train on it with --data" in capsys.readouterr().out
    assert main(["heads", "train", "--models", "tiny", "--data", str(tmp_path / "a"), "--eval-data",
                 str(tmp_path / "b"), "--out", str(tmp_path / "head"), "--draft-vocab", "48", "--vocab-data-share",
                 "0.5", "--intermediate", "32", "--steps", "6", "--save-every", "3", "--ttt", "2", "--autocast",
                 "bfloat16", "--freeze-lm-head", "--quiet"]) == 0
    card = json.loads((tmp_path / "head" / "card.json").read_text())
    assert card["autocast"] == "bfloat16" and card["draft_vocab"] == 48 and card["freeze_lm_head"]
    assert len(card["held_out_agreement_by_level"]) == 2
    assert all(0.0 <= a <= 1.0 for a in card["held_out_agreement_by_level"])
    history = json.loads((tmp_path / "head" / "train_state.json").read_text())["history"]
    assert [len(h["held_out"]) for h in history] == [2, 2]
    assert main(["heads", "train", "--models", "tiny", "--data", str(tmp_path / "a"), "--out", str(tmp_path / "head"),
                 "--steps", "8", "--ttt", "2", "--freeze-lm-head", "--quiet"]) == 0  # resumed: no moments for lm_head
    head = load_head(tmp_path / "head", target=tiny.target, dtype=torch.float32)
    rows = tiny.target.get_output_embeddings().weight[head.target_ids()].float()
    assert torch.equal(head.lm_head.weight, rows)  # frozen: still the target's rows
    both, manifests = load_all([tmp_path / "a", tmp_path / "b"])
    assert len(both) == sum(m["sequences"] for m in manifests)
    assert main(["heads", "features", "--models", "tiny", "--texts", str(text), "--data", str(tmp_path / "c"),
                 "--seq-len", "64", "--layers", "0,1,1", "--quiet"]) == 0
    with pytest.raises(HeadDataError, match="different targets or layers"):
        load_all([tmp_path / "a", tmp_path / "c"])


def test_the_draft_vocabulary_takes_the_datas_share_then_the_lowest_ids(tiny, tmp_path):
    from explorer.heads.data import draft_vocabulary

    data = load(build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 2), tmp_path / "d", progress=False))
    vocab = tiny.target.config.vocab_size
    by_data = draft_vocabulary(data, 8, vocab)
    assert len(by_data) == 8 and set(by_data) <= {int(t) for s in data for t in s.tokens.tolist()} | {
        int(t) for s in data for t in s.label_ids[:, 0].tolist()}
    half = draft_vocabulary(data, 8, vocab, data_share=0.5)
    assert len(half) == 8 and half == sorted(half)
    from_data = set(draft_vocabulary(data, 4, vocab))
    assert from_data <= set(half)
    assert set(half) - from_data == set(sorted(set(range(vocab)) - from_data)[: 8 - len(from_data)])
    assert draft_vocabulary(data, 5, vocab, data_share=0.0) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="between 0 and 1"):
        draft_vocabulary(data, 5, vocab, data_share=1.5)


def test_a_trained_head_is_fine_tuned_on_new_data_from_its_own_weights(tiny, tmp_path):
    """``--init``: the run starts at the given head's weights (its loss on its own data is already low), keeps its
    draft vocabulary and shape, and a head of other feature layers than the data's is refused."""
    from explorer.models.eagle3 import HeadError

    first = build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 2), tmp_path / "a", progress=False)
    other = build(tiny, chunk([tiny.tokenizer.encode(TEXT.replace("cat", "bird"))], 96), (0, 1, 2), tmp_path / "b",
                  progress=False)
    base = train_head(tiny, first, tmp_path / "base", draft_vocab=48, intermediate=32, steps=60, lr=3e-3, ttt=2,
                      save_every=60, progress=False)
    fresh = train_head(tiny, first, tmp_path / "fresh", draft_vocab=48, intermediate=32, steps=1, lr=1e-9, ttt=2,
                       save_every=1, progress=False)
    tuned = train_head(tiny, other, tmp_path / "tuned", steps=1, lr=1e-9, ttt=2, save_every=1, progress=False,
                       init=tmp_path / "base", draft_vocab=999, intermediate=999)
    assert tuned["draft_vocab"] == 48 and tuned["init"] == str(tmp_path / "base")
    assert tuned["loss"] < fresh["loss"] and base["loss"] < fresh["loss"]  # a trained start, not the rows
    a = load_head(tmp_path / "base", target=tiny.target, dtype=torch.float32)
    b = load_head(tmp_path / "tuned", target=tiny.target, dtype=torch.float32)
    assert b.config.intermediate_size == a.config.intermediate_size == 32
    assert torch.equal(a.target_ids(), b.target_ids())
    assert torch.allclose(a.fc.weight, b.fc.weight, atol=1e-2)  # a learning rate of 1e-9: still the base's
    moved = build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 1), tmp_path / "c", progress=False)
    with pytest.raises(HeadError, match="reads target layers"):
        train_head(tiny, moved, tmp_path / "x", steps=1, ttt=2, progress=False, init=tmp_path / "base")


def _seq(tokens: list[int], best: list[int]) -> Sequence:
    n = len(tokens)
    return Sequence(torch.tensor(tokens), torch.zeros(n, 3, 4), torch.tensor(best).view(n, 1), torch.ones(n, 1))


def test_a_vocabulary_swap_takes_the_datas_frequent_missing_tokens_for_the_least_used():
    """``swapped_vocabulary``: the most frequent tokens outside come in (at least ``min_count`` times), the least
    used go out (ties: the highest id), never a token for a rarer one, and the size stays."""
    # counts: 7 -> 6 (3 tokens + 3 best), 8 -> 4, 9 -> 2, 10 -> 1; inside: 1 -> 2, 2 -> 4, 3..6 -> 0
    data = [_seq([7, 7, 7, 8, 8, 9, 1, 2, 2, 10], [7, 7, 7, 8, 8, 9, 1, 2, 2, 11])]
    inside = [1, 2, 3, 4, 5, 6]
    assert swapped_vocabulary(data, inside, 16, 2) == [1, 2, 3, 4, 7, 8]  # 6 and 5 out (unused, highest first)
    assert swapped_vocabulary(data, inside, 16, 9) == [1, 2, 3, 7, 8, 9]  # 10 and 11 seen once: below min_count
    assert swapped_vocabulary(data, inside, 16, 9, min_count=1) == [1, 2, 7, 8, 9, 10]  # 11 (1) not for 1 (2)
    assert swapped_vocabulary(data, inside, 16, 0) == inside
    full = [1, 2, 7, 8]  # nothing the data lacks is more frequent than what it would replace
    assert swapped_vocabulary(data, full, 16, 3, min_count=1) == full
    with pytest.raises(ValueError, match="negative"):
        swapped_vocabulary(data, inside, 16, -1)


def test_fine_tuning_with_a_vocabulary_swap_keeps_the_kept_rows_and_starts_new_ones_from_the_target(tiny, tmp_path):
    """``--init --swap-vocab``: the data's missing tokens become draftable, a kept token keeps its trained
    ``lm_head`` row, an incoming one starts at the target's output row, and the saved head maps its ids by them."""
    data = build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 2), tmp_path / "a", progress=False)
    train_head(tiny, data, tmp_path / "base", draft_vocab=48, vocab_data_share=0.0, intermediate=32, steps=20,
               lr=3e-3, ttt=2, save_every=20, progress=False)
    base = load_head(tmp_path / "base", target=tiny.target, dtype=torch.float32)
    assert base.target_ids().tolist() == list(range(48))  # the lowest ids: the text's tokens mostly outside
    counts = token_counts(load(data), tiny.target.config.vocab_size)  # the text's tokens and the target's best
    card = train_head(tiny, data, tmp_path / "tuned", steps=1, lr=1e-9, ttt=2, save_every=1, progress=False,
                      init=tmp_path / "base", swap_vocab=1000)
    tuned = load_head(tmp_path / "tuned", target=tiny.target, dtype=torch.float32)
    ids = tuned.target_ids().tolist()
    assert len(ids) == 48 and ids == sorted(ids) and card["draft_vocab"] == 48
    came = set(ids) - set(range(48))
    assert came and all(counts[t] >= 2 for t in came) and card["vocab_swapped"] == len(came)
    assert int(tuned.t2d.sum()) == 48 and tuned.t2d[ids].all()
    out = tiny.target.get_output_embeddings().weight.float()
    for i, t in enumerate(ids):
        want = base.lm_head.weight[t] if t < 48 else out[t]
        assert torch.allclose(tuned.lm_head.weight[i], want, atol=1e-3), t
    with pytest.raises(ValueError, match="needs a trained head"):
        train_head(tiny, data, tmp_path / "new", draft_vocab=48, steps=1, ttt=2, progress=False, swap_vocab=8)


@pytest.mark.parametrize("joint", [False, True])
def test_the_engine_reads_the_features_the_head_trained_on(tiny, tmp_path, joint):
    """A mismatch between training and serving features (another layer, a norm, what the KV cache and the tree
    mask do to the rows) would cost acceptance unseen: the target states the engine hands the head at every
    committed position equal the cached training features of the same text (``heads.data.build``: one plain
    forward with ``output_hidden_states``), for the head's layers including the last (the final norm's output)."""
    from explorer.engine.factory import build_engine
    from explorer.models.eagle3 import HeadConfig, save_head

    t = tiny.target.config
    layers = (0, 1, t.num_hidden_layers)
    config = HeadConfig(hidden_size=t.hidden_size, intermediate_size=96, num_attention_heads=t.num_attention_heads,
                        num_key_value_heads=t.num_key_value_heads, head_dim=t.hidden_size // t.num_attention_heads,
                        vocab_size=t.vocab_size, draft_vocab_size=64, aux_layer_ids=layers)
    folder = save_head(random_head(config, seed=5, draft_ids=list(range(32, 96))), tmp_path / "head")
    run = DEFAULTS["eagle"].with_(head=str(folder), online_distill=True, distill_every=1000, fallback="off",
                                  head_topk=2, head_depth=3, head_tokens=6)
    engine = build_engine(tiny, run, GREEDY, joint_prefill=joint)
    engine.start(tiny.tokenizer.encode(TEXT[:60]), 30)
    record = None
    while not engine.finished:
        record = engine.parts.distiller._current  # the rows the head read, as the engine gave them
        engine.step()
    served = torch.cat(record.states)
    assert served.shape[0] >= 20
    cached = load(build(tiny, [list(engine.state.committed)], layers, tmp_path / "features", progress=False))[0]
    trained = cached.states[record.start: record.start + served.shape[0]].float()
    assert torch.allclose(served, trained, atol=1e-4), (served - trained).abs().amax(dim=(0, 2))
