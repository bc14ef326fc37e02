"""Rejection forensics (explorer/analysis/forensics.py, `python -m explorer forensics`): the token classes, tables
that add up to the runs' own counts, expected acceptance equal to the realised one where greedy makes each test
certain, the confusions and the costliest rejections, and a report made from the readable traces of a folder."""

import json

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
