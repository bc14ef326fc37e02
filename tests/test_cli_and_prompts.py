import json
import subprocess
import sys

import pytest

from explorer.analysis.prompts import (PromptError, encode_prompt, humaneval, load_prompt_file, mt_bench,
                                       parse_prompt_lines)
from explorer.cli.main import main


def test_prompt_sets_load():
    mt = mt_bench()
    assert len(mt) == 80 and mt[0].text.startswith("Compose an engaging travel blog")
    he = humaneval()
    assert len(he) == 164 and "def " in he[0].text


def test_prompt_file_formats_and_errors(tmp_path):
    assert [p.text for p in parse_prompt_lines(['{"turns": ["a", "b"]}', "", '{"prompt": "c"}'], "f")] == ["a", "c"]
    for bad, msg in [("{", "line 1: not valid JSON"), ('{"x": 1}', "needs a 'turns'"), ('{"prompt": " "}', "empty"),
                     ("[1]", "JSON object")]:
        with pytest.raises(PromptError, match=msg):
            parse_prompt_lines([bad], "f")
    with pytest.raises(PromptError, match="no prompts"):
        parse_prompt_lines([""], "f")
    with pytest.raises(PromptError, match="cannot read"):
        load_prompt_file(tmp_path / "missing.jsonl")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PromptError, match="UTF-8"):
        load_prompt_file(binary)


def test_encode_prompt_chat_template(tiny):
    ids = encode_prompt(tiny.tokenizer, "hi")
    assert tiny.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.tokenizer.decode(encode_prompt(tiny.tokenizer, "hi", chat_template=False)) == "hi"
    with pytest.raises(PromptError):
        encode_prompt(tiny.tokenizer, "   ")


def test_generate_json_output(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"turns": ["def f(x):"]}\n{"prompt": "hello"}\n')
    rc = main(["generate", "--models", "tiny", "--prompt-file", str(f), "--method", "mcsd", "--k-config", "3,2",
               "--max-new-tokens", "12", "--json", "--save-trace", str(tmp_path / "traces")])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2
    for row in rows:
        for key in ("token_ids", "text", "target_calls", "tokens_per_target_call", "acceptance_rate", "tokens_per_s"):
            assert key in row
        assert len(row["token_ids"]) == 12
    assert len(list((tmp_path / "traces").glob("*.json"))) == 2


def test_generate_greedy_methods_agree_through_the_cli(capsys):
    out = {}
    for method in ("ar", "sd", "mcsd", "mcsd-improved"):
        assert main(["generate", "--models", "tiny", "--prompt", "abc", "--method", method, "--max-new-tokens", "16",
                     "--json"]) == 0
        out[method] = json.loads(capsys.readouterr().out)["token_ids"]
    assert out["sd"] == out["ar"] == out["mcsd"] == out["mcsd-improved"]


@pytest.mark.parametrize("args, message", [
    (["--prompt", "", "--models", "tiny"], "prompt is empty"),
    (["--prompt", "x", "--models", "tiny", "--method", "mcsd", "--k-config", "4,0"], "k_config"),
    (["--prompt", "x", "--models", "tiny", "--method", "mcsd", "--k-config", "2.5"], "not an integer"),
    (["--prompt", "x", "--models", "custom", "--draft", "/no/such/draft", "--target", "/no/such/target"],
     "cannot load model"),
    (["--prompt-file", "/no/such/file.jsonl", "--models", "tiny"], "cannot read prompt file"),
    (["--prompt", "x", "--models", "tiny", "--method", "mcsd-improved", "--cost-ratio", "measured"],
     "goodput stop policy's r"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# One bad input for every subcommand (``{d}``: the test's folder, holding ``bad.json``, which is not JSON, and
# ``bad.jsonl``, a prompt line without a prompt): each ends in one line that names the subcommand and what is wrong.
BAD_INPUTS = {
    "generate": (["generate", "--models", "tiny", "--prompt-file", "{d}/nowhere.jsonl"], "cannot read prompt file"),
    "greedy-check": (["greedy-check", "--models", "tiny", "--prompt", " "], "prompt is empty"),
    "audit": (["audit", "--models", "tiny", "--k-config", "2,0"], "k_config entries must be >= 1"),
    "verifiers": (["verifiers", "--models", "tiny", "--prompt", "x", "--temperatures", "warm"], "'warm' is not a"),
    "bench": (["bench", "--models", "tiny", "--prompt-file", "{d}/bad.jsonl"], "needs a 'turns' list"),
    "lessons export": (["lessons", "export", "--out", "{d}/bad.json/inside"], "Not a directory"),
    "decision collect": (["decision", "collect", "--models", "tiny", "--prompts", "{d}/none.jsonl", "--out",
                          "{d}/o"], "cannot read prompt file"),
    "decision train": (["decision", "train", "--data", "{d}/bad.json", "--out", "{d}/o"], "not a decision data"),
    "decision eval": (["decision", "eval", "--data", "{d}/bad.json"], "name the decision-model folder"),
    "decision generalise": (["decision", "generalise", "--data", "{d}/nowhere"], "not a decision data folder"),
    "decision ablation": (["decision", "ablation", "--models", "tiny", "--prompt-file", "{d}/nowhere.jsonl"],
                          "cannot read prompt file"),
    "heads features": (["heads", "features", "--models", "tiny", "--texts", "{d}/nowhere.jsonl", "--data", "{d}/f"],
                       "cannot read"),
    "heads train": (["heads", "train", "--models", "tiny", "--data", "{d}/nowhere", "--out", "{d}/h"],
                    "holds no head training data"),
    "heads respond": (["heads", "respond", "--models", "tiny", "--out", "{d}/bad.json/x"], "File exists"),
    "heads online": (["heads", "online", "--models", "tiny", "--kind", "poetry"], "unknown kind"),
    "heads export": (["heads", "export", "--head", "{d}/nowhere", "--out", "{d}/h"], "no head folder"),
    "heads gap": (["heads", "gap", "--models", "tiny", "--prompts", "{d}/bad.json"], "not a response record"),
    "heads vocab": (["heads", "vocab", "--data", "{d}/nowhere"], "holds no head training data"),
    "probe": (["probe", "--models", "tiny", "--trace", "{d}/bad.json"], "trace is not valid JSON"),
    "acceptance": (["acceptance", "--models", "tiny", "--trace", "{d}/bad.json"], "trace is not valid JSON"),
    "calibration": (["calibration", "--models", "tiny", "--trace", "{d}/bad.json"], "trace is not valid JSON"),
    "timeline": (["timeline", "--models", "tiny", "--prompt", "x", "--k-config", "a,b"], "is not an integer"),
    "counterfactual": (["counterfactual", "--models", "tiny", "--trace", "{d}/bad.json", "--step", "1"],
                       "trace is not valid JSON"),
    "forensics": (["forensics", "--models", "tiny", "--trace", "{d}/nowhere"], "no run to read"),
}


def test_every_subcommand_turns_bad_input_into_a_message(capsys, tmp_path):
    """Every subcommand the parser has is fed a bad input here; each exits 2 with a message and no traceback."""
    from explorer.cli.main import build_parser

    (tmp_path / "bad.json").write_text("not json\n")
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    parser = build_parser()
    commands = []
    for action in parser._subparsers._group_actions[0].choices.items():  # every subcommand, nested ones too
        name, sub = action
        nested = [a for a in sub._actions if isinstance(a, type(parser._subparsers._group_actions[0]))]
        if nested:
            commands += [f"{name} {n}" for n in nested[0].choices if n != "calibrate"]  # calibrate: as collect
        elif name == "lessons":
            commands.append("lessons export")
        else:
            commands.append(name)
    assert sorted(commands) == sorted(BAD_INPUTS)  # a new subcommand needs its bad input here
    for command, (args, message) in BAD_INPUTS.items():
        status = main([a.replace("{d}", str(tmp_path)) for a in args])
        err = capsys.readouterr().err
        assert status == 2, (command, err)
        assert message in err and "Traceback" not in err, (command, err)
        assert err.strip().splitlines()[-1].startswith("error:"), (command, err)


def test_an_unexpected_failure_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    import explorer.cli.main as cli

    def broken(args):
        raise RuntimeError("the draft tree fell over\nsecond line")

    monkeypatch.setattr(cli, "cmd_generate", broken)
    args = ["generate", "--models", "tiny", "--prompt", "x"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("error: generate failed (RuntimeError): the draft tree fell over. Run it again with "
                           "--debug for the traceback, and report it with that if the cause is not in your input")
    with pytest.raises(RuntimeError, match="fell over"):
        main([*args, "--debug"])
    with pytest.raises(RuntimeError, match="fell over"):
        main(["--debug", *args])


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "explorer", "generate", "--models", "tiny", "--prompt", "x",
                          "--max-new-tokens", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["token_ids"]) == 3


def test_the_kinds_set_holds_two_prompts_of_seven_kinds_the_decision_models_never_saw():
    from collections import Counter

    from explorer.analysis.prompts import KINDS_SET, select_prompts

    prompts = select_prompts(["kinds"])
    assert Counter(p.category for p in prompts) == {kind: 2 for kind, _, _ in KINDS_SET}
    assert len({p.id for p in prompts}) == 14 and all(p.text.strip() for p in prompts)
    # docs/decision.md trains on humaneval:0:10, mt-bench 0:2, 10:12, 20:24, 30:34, 40:44, 50:54, 60:62, 70:72 and
    # prompt-mix 0:10, 12:22, 24:34, 36:46, 48:58, 60:66
    trained = {"humaneval": range(0, 10), "mt-bench": [*range(0, 2), *range(10, 12), *range(20, 24),
                                                       *range(30, 34), *range(40, 44), *range(50, 54),
                                                       *range(60, 62), *range(70, 72)],
               "prompt-mix": [*range(0, 10), *range(12, 22), *range(24, 34), *range(36, 46), *range(48, 58),
                              *range(60, 66)]}
    assert not any(i in trained[name] for _, name, picks in KINDS_SET for i in picks)
