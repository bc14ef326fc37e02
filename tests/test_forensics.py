"""Rejection forensics (explorer/analysis/forensics.py, `python -m explorer forensics`): the token classes, tables
that add up to the runs' own counts, expected acceptance equal to the realised one where greedy makes each test
certain, the confusions and the costliest rejections, and a report made from the readable traces of a folder."""

import json

import torch

import pytest
from method_grid import PROMPT

from explorer.analysis.forensics import TOKEN_CLASSES, Forensics, target_entropy, token_class
from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.trace.records import ACCEPTED, REJECTED, save_run


@pytest.mark.parametrize("text, before, kind", [
    ("\n", "x", "newline"), ("\n    ", ":", "newline"), ("    ", "\n", "whitespace"), (" 42", "=", "digits"),
    ("(", "f", "punctuation"), (".append", "x", "punctuation"), (" foo", "x", "word start"),
    ("foo", "(", "word start"), ("bar", "foo", "word continuation"), ("_x", "a", "word continuation"),
    ("<|im_end|>", "", "special"), ("</s>", "x", "special")])
def test_token_classes(text, before, kind):
    assert kind in TOKEN_CLASSES and token_class(text, before) == kind


def test_target_entropy_from_the_top_tokens():
    assert target_entropy([]) is None
    assert target_entropy([[1, "a", 1.0]]) == pytest.approx(0.0)
    two = target_entropy([[1, "a", 0.5], [2, "b", 0.5]])
    assert two == pytest.approx(0.6931, abs=1e-4)
    assert target_entropy([[1, "a", 0.5]]) == pytest.approx(two)  # the rest of the mass as one outcome


def _runs(tiny, temperature):
    out = []
    for seed, prompt in enumerate((PROMPT, "The capital of France is")):
        eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2), fallback="off"),
                           SamplingConfig(temperature=temperature, seed=seed))
        eng.start(tiny.tokenizer.encode(prompt), 24)
        out.append(eng.run())
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_tables_add_up_to_the_runs(tiny, temperature):
    traces = _runs(tiny, temperature)
    f = Forensics()
    for i, trace in enumerate(traces):
        f.add(trace, prompt=f"p{i}", category="code" if i == 0 else "chat")
    data = f.to_dict()
    tested = [n for t in traces for s in t.steps for n in s.nodes
              if n.source in ("draft", "lookup", "recycled") and n.status in (ACCEPTED, REJECTED)]
    accepted = sum(n.status == ACCEPTED for n in tested)
    assert data["nodes"] == len(tested) > 0
    for key in ("by_class", "by_depth", "by_category", "by_confidence", "by_entropy", "by_source"):
        assert sum(t["tested"] for t in data[key].values()) == len(tested), key
        assert sum(t["accepted"] for t in data[key].values()) == accepted, key
    assert accepted == sum(s.accepted_draft_len for t in traces for s in t.steps)
    assert set(data["by_category"]) == {"code", "chat"}
    for t in data["by_class"].values():
        assert t["expected_rate"] is not None and 0 <= t["expected_rate"] <= 1
        if temperature == 0.0:  # greedy: each test passes with probability 0 or 1, and it did what it had to
            assert t["expected_rate"] == pytest.approx(t["rate"])
    rejected = len(tested) - accepted
    confused = sum(c["count"] for c in data["confusions"])
    assert rejected - sum(len(t.steps) for t in traces) <= confused <= rejected
    cuts = [r["expected_tokens_cut"] for r in data["costliest"]]
    assert cuts == sorted(cuts, reverse=True) and len(cuts) == min(20, rejected) and all(c >= 1 for c in cuts)
    assert len(data["prompts"]) == 2
    for p, trace in zip(data["prompts"], traces):
        assert p["steps"] == len(trace.steps) and p["tokens_per_target_call"] >= 1
        assert all(0 <= v <= 1 for v in p["per_position"].values())


def test_the_command_reads_a_folder_and_names_what_it_skipped(tiny, tmp_path, capsys):
    from explorer.cli.main import main

    folder = tmp_path / "traces"
    folder.mkdir()
    for i, trace in enumerate(_runs(tiny, 0.0)):
        save_run(trace, folder / f"run{i}.json")
    (folder / "broken.json").write_text('{"not": "a trace"')
    assert main(["forensics", "--trace", str(folder), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "broken.json" in err
    data = json.loads((tmp_path / "out" / "forensics.json").read_text())
    assert data["forensics_schema"] == 1 and len(data["prompts"]) == 2 and len(data["skipped"]) == 1
    assert all(r["trace"].endswith(".json") for r in data["costliest"])
    (folder / "run0.json").unlink()
    (folder / "run1.json").unlink()
    assert main(["forensics", "--trace", str(folder), "--out", str(tmp_path / "out2")]) == 2
    many = tmp_path / "many"  # 200 saved runs in one call, counted as the sum of their parts
    many.mkdir()
    text = (tmp_path / "out" / "forensics.json").read_text()
    one = json.loads(text)
    runs = _runs(tiny, 0.0)
    for i in range(200):
        save_run(runs[i % 2], many / f"t{i:03d}.json")
    assert main(["forensics", "--trace", str(many), "--out", str(tmp_path / "out3")]) == 0
    data = json.loads((tmp_path / "out3" / "forensics.json").read_text())
    assert len(data["prompts"]) == 200 and data["nodes"] == 100 * one["nodes"] and not data["skipped"]


def test_the_report_and_the_diff_of_two_runs(tiny, tmp_path, capsys):
    """The command writes forensics.html (figures and tables, offline) and with --compare the diff against an
    earlier forensics of the same prompts: greedy against sampled runs of the same prompts."""
    from explorer.analysis.forensics_report import ForensicsError, diff, load_forensics
    from explorer.cli.main import main

    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        folder = tmp_path / name
        folder.mkdir()
        for i, trace in enumerate(_runs(tiny, temperature)):
            save_run(trace, folder / f"run{i}.json")
    assert main(["forensics", "--trace", str(tmp_path / "greedy"), "--out", str(tmp_path / "a")]) == 0
    assert main(["forensics", "--trace", str(tmp_path / "sampled"), "--out", str(tmp_path / "b"),
                 "--compare", str(tmp_path / "a")]) == 0
    a, b = load_forensics(tmp_path / "a"), load_forensics(tmp_path / "b" / "forensics.json")
    d = b["diff"]
    assert d == diff(a, {k: v for k, v in b.items() if k != "diff"})
    for group, r in d["by_class"].items():
        if r["delta"] is not None:
            assert r["delta"] == pytest.approx(b["by_class"][group]["rate"] - a["by_class"][group]["rate"])
    assert [p["prompt"] for p in d["prompts"]] == ["run0", "run1"]
    page = (tmp_path / "b" / "forensics.html").read_text(encoding="utf-8")
    assert "B against A" in page and "Acceptance by token class" in page and "<script" in page
    assert "src=\"http" not in page  # Plotly.js inlined: opens offline
    (tmp_path / "bad.json").write_text('{"forensics_schema": 7}')
    with pytest.raises(ForensicsError, match="schema"):
        load_forensics(tmp_path / "bad.json")
    assert main(["forensics", "--trace", str(tmp_path / "greedy"), "--out", str(tmp_path / "c"),
                 "--compare", str(tmp_path / "bad.json")]) == 2


def test_the_forensics_page_runs_a_built_in_set(tiny):
    """The app's Forensics page on the tiny pair: a built-in prompt set runs with the sidebar's settings and the page
    shows the report's figures and tables (uploads are read by the same ``Forensics.add`` the command uses)."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.query_params["page"] = "forensics"
    at.session_state["max_new"] = 12
    at.run()
    assert not at.exception and at.session_state["page"] == "Forensics"
    at.selectbox(key="fo_set").set_value("MT-bench, first 5").run()
    at.button(key="fo_run").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    data = at.session_state["fo_result"]
    assert len(data["prompts"]) == 5 and data["nodes"] > 0
    assert {p["category"] for p in data["prompts"]} <= {"writing", "roleplay", "reasoning", "math", "coding",
                                                         "extraction", "stem", "humanities", "mt-bench"}
    assert len(at.get("plotly_chart")) >= 4 and len(at.dataframe) == 3
    row = data["costliest"][at.selectbox(key="fo_pick").value]
    at.button(key="fo_open").click().run()  # that rejection's step, replayed on the Explorer page
    assert not at.exception and at.session_state["page"] == "Explorer"
    assert at.session_state["replay"] == row["trace"] and at.session_state["cursor"] == row["step"]


def _plant(model, rule):
    """A forward hook that rewrites ``model``'s logits: at each kept position whose input token ``t`` has
    ``rule(t)`` not None, that token becomes the top one (the rest of the distribution unchanged)."""
    def hook(module, args, kwargs, out):
        logits = out.logits
        ids = kwargs["input_ids"][:, -logits.shape[1]:]
        for b, i in zip(*torch.nonzero(torch.ones_like(ids, dtype=torch.bool), as_tuple=True)):
            favourite = rule(int(ids[b, i]))
            if favourite is not None:
                logits[b, i, favourite] = logits[b, i].max() + 8.0
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def test_a_planted_confusion_tops_the_table():
    """A tiny pair whose draft always proposes one fixed token after a newline, where the target always writes
    another (and writes a newline after every third byte, so newlines are common): that pair of tokens is the top
    confusion, and newline-led rejections are all its own."""
    from explorer.models.tiny import tiny_pair

    pair = tiny_pair(seed=3)
    tok = pair.tokenizer
    newline, planted, wanted = (tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in ("\n", "Q", "#"))
    hooks = [_plant(pair.draft, lambda t: planted if t == newline else None),
             _plant(pair.target, lambda t: wanted if t == newline else newline if t % 3 == 0 and t != wanted
                    else None)]
    try:
        f = Forensics()
        for seed, prompt in enumerate(("def f(x):\n", "Once upon a time", "1, 2, 3,")):
            eng = build_engine(pair, MethodConfig(method="mcsd", k_config=(2, 2), fallback="off"),
                               SamplingConfig(temperature=0.0, seed=seed))
            eng.start(tok.encode(prompt), 40)
            f.add(eng.run(), prompt=f"p{seed}")
    finally:
        for h in hooks:
            h.remove()
    data = f.to_dict()
    top = data["confusions"][0]
    assert (top["drafted_id"], top["committed_id"]) == (planted, wanted), data["confusions"][:3]
    assert (top["drafted"], top["committed"]) == ("Q", "#")
    by_drafted = {}
    for c in data["confusions"]:
        by_drafted[c["drafted_id"]] = by_drafted.get(c["drafted_id"], 0) + c["count"]
    assert max(by_drafted, key=by_drafted.get) == planted
    assert top["count"] >= 5 and top["mean_q"] > 0.9 and top["mean_p"] < 0.1


def test_a_prompt_too_long_for_the_pair_is_named_and_the_rest_reported(tmp_path, capsys):
    """The tiny pair holds 512 positions: a prompt of 600 bytes is refused by name, the others make the report, and
    the saved traces keep their prompt's id and category (forensics of them groups by it)."""
    from explorer.analysis.forensics_report import ForensicsError, check_forensics
    from explorer.cli.main import main

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in (
        {"id": "short", "category": "chat", "prompt": "The capital of France is"},
        {"id": "long", "category": "chat", "prompt": "word " * 120},
        {"id": "code", "category": "code", "prompt": "def add(a, b):"})))
    assert main(["forensics", "--models", "tiny", "--prompt-file", str(prompts), "--max-new-tokens", "12",
                 "--save-traces", str(tmp_path / "traces"), "--out", str(tmp_path / "out")]) == 0
    assert "skipped prompt long: the prompt has" in capsys.readouterr().err
    data = json.loads((tmp_path / "out" / "forensics.json").read_text())
    assert [p["prompt"] for p in data["prompts"]] == ["short", "code"] and len(data["skipped"]) == 1
    assert main(["forensics", "--trace", str(tmp_path / "traces"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "forensics.json").read_text())
    assert [p["prompt"] for p in again["prompts"]] == ["short", "code"]
    assert set(again["by_category"]) == {"chat", "code"} and again["by_class"] == data["by_class"]
    assert check_forensics(again, "again") is again
    for broken in ({"forensics_schema": 1}, {"forensics_schema": 1, "by_class": {}, "by_depth": [], "prompts": []},
                   {"forensics_schema": 1, "by_class": {}, "by_depth": {}, "prompts": [{"steps": 2}]}):
        with pytest.raises(ForensicsError, match="without its tables"):
            check_forensics(broken, "x.json")
