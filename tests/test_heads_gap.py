"""The gap between a head's teacher-forced agreement and its acceptance in the engine (``heads/gap.py``): on the tiny
pair the engine's first level is exactly what the head computes teacher-forced on the same text, so any gap on a real
pair is the data's (out-of-vocabulary tokens, other kinds of text), not a serving mismatch."""

import json

from explorer.cli.main import main
from explorer.heads.data import build, chunk
from explorer.heads.gap import compare, measure, summarise
from explorer.heads.train import train_head
from explorer.models.eagle3 import load_head

TEXT = "the cat sat on the mat. the dog sat on the log. " * 12


def _head(tiny, tmp_path):
    data = build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 2), tmp_path / "data", progress=False)
    train_head(tiny, data, tmp_path / "head", draft_vocab=48, intermediate=32, steps=40, lr=3e-3, ttt=2,
               save_every=40, progress=False)
    return tmp_path / "head"


def test_the_engines_first_level_is_the_heads_teacher_forced_level_one(tiny, tmp_path):
    folder = _head(tiny, tmp_path)
    head = load_head(folder, target=tiny.target)
    got = compare(tiny, head, TEXT[:40], max_new_tokens=32, head_path=str(folder))
    c, rates = got["counts"], summarise(got["counts"])
    assert c["steps"] >= 5 and c["positions"] == c["tokens"] == 32
    assert rates["same_top1"] == 1.0  # the engine's best depth-1 token is the teacher-forced top-1 at every step
    assert c["engine_first"] == c["step_topk"]  # greedy: accepted exactly where the target's token is in the top-k
    assert c["step_top1"] <= c["step_topk"] and c["top1"] <= c["positions"]
    assert abs(rates["oov_miss"] + rates["in_vocab_miss"] + rates["teacher_forced_top1"] - 1.0) < 1e-3
    assert TEXT[:40] in got["text"]  # chat-formatted with its prompt, as heads respond writes a record


def test_heads_gap_reports_by_kind_and_writes_the_answers(tiny, tmp_path, capsys):
    folder = _head(tiny, tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"kind": k, "prompt": p}) + "\n"
                               for k, p in [("code", TEXT[:30]), ("chat", TEXT[10:50]), ("code", TEXT[5:45])]))
    assert main(["heads", "gap", "--models", "tiny", "--prompts", str(prompts), "--head", str(folder),
                 "--max-new-tokens", "12", "--out", str(tmp_path / "gap.json"), "--answers",
                 str(tmp_path / "answers.jsonl"), "--quiet"]) == 0
    report = json.loads((tmp_path / "gap.json").read_text())
    assert set(report["by_kind"]) == {"code", "chat"} and report["all"]["positions"] == 36
    assert report["by_kind"]["code"]["positions"] == 24
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [a["kind"] for a in answers] == ["code", "chat", "code"] and all(a["text"] for a in answers)
    assert "engine" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["heads", "gap", "--models", "tiny", "--prompts", str(bad), "--quiet"]) == 2
    assert "not a response record" in capsys.readouterr().err


def test_measure_pools_the_prompts_of_a_kind(tiny, tmp_path):
    folder = _head(tiny, tmp_path)
    report = measure(tiny, [{"kind": "qa", "prompt": TEXT[:20]}, {"kind": "qa", "prompt": TEXT[20:40]}],
                     head_path=str(folder), max_new_tokens=10)
    assert list(report["by_kind"]) == ["qa"] and report["by_kind"]["qa"] == report["all"]
    assert report["all"]["positions"] == 20


def test_heads_are_compared_teacher_forced_on_earlier_answers(tiny, tmp_path, capsys):
    folder = _head(tiny, tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"kind": k, "prompt": p}) + "\n"
                               for k, p in [("code", TEXT[:30]), ("chat", TEXT[10:50])]))
    answers, out = tmp_path / "answers.jsonl", tmp_path / "tf.json"
    assert main(["heads", "gap", "--models", "tiny", "--prompts", str(prompts), "--head", str(folder),
                 "--max-new-tokens", "12", "--out", str(tmp_path / "gap.json"), "--answers", str(answers),
                 "--quiet"]) == 0
    engine = json.loads((tmp_path / "gap.json").read_text())
    other = tmp_path / "other"
    train_head(tiny, build(tiny, chunk([tiny.tokenizer.encode(TEXT)], 96), (0, 1, 2), tmp_path / "d2",
                           progress=False), other, draft_vocab=40, intermediate=32, steps=2, lr=1e-3, ttt=2,
               save_every=2, progress=False)
    capsys.readouterr()
    assert main(["heads", "gap", "--models", "tiny", "--answers-from", str(answers), "--head", str(folder),
                 "--head", str(other), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {str(folder), str(other)}
    mine = report[str(folder)]["all"]
    # the same texts, the same head: the engine run's teacher-forced figures again
    assert mine["positions"] == engine["all"]["positions"] == 24
    assert mine["teacher_forced_top1"] == engine["all"]["teacher_forced_top1"]
    assert mine["engine_first"] is None and str(other) in capsys.readouterr().out
