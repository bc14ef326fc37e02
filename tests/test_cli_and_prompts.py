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
