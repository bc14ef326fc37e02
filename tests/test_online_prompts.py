"""A stream of prompts the target wrote: ``heads respond --written --write-only`` keeps the prompts, and ``heads
online --prompts`` learns from them (the other kinds' held-out prompts stay the templates')."""

import json

import pytest

from explorer.cli.main import main
from explorer.heads.online import stream_prompts, stream_prompts_from


def test_a_given_stream_keeps_its_order_and_the_templates_hold_the_other_kinds():
    given = [("translation", f"t{i}") for i in range(6)] + [("code", "c0"), ("translation", "t6")]
    split = stream_prompts_from(given, "translation", requests=4, held_out=2)
    assert split["stream"] == ["t0", "t1", "t2", "t3"]
    assert split["held_out"]["translation"] == ["t4", "t5"]  # the file's, not the templates'
    drawn = stream_prompts("translation", 4, 2)
    assert {k: v for k, v in split["held_out"].items() if k != "translation"} == \
        {k: v for k, v in drawn["held_out"].items() if k != "translation"}
    with pytest.raises(ValueError, match="hold 1 of kind 'code'"):
        stream_prompts_from(given, "code", requests=1, held_out=1)
    with pytest.raises(ValueError, match="unknown kind"):
        stream_prompts_from(given, "poetry", requests=0, held_out=0)


def test_the_online_command_says_what_is_wrong_with_its_prompts_before_loading(tmp_path, capsys, monkeypatch):
    from explorer.cli import heads

    monkeypatch.setattr(heads, "load_pair_from_args", lambda args: pytest.fail("loaded the pair for bad prompts"))
    assert main(["heads", "online", "--models", "tiny", "--kind", "code", "--prompts", str(tmp_path / "no")]) == 2
    assert "no such file" in capsys.readouterr().err
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"kind": "code", "prompt": "def f():"}) + "\n")
    assert main(["heads", "online", "--models", "tiny", "--kind", "code", "--prompts", str(few)]) == 2
    assert "hold 1 of kind 'code'" in capsys.readouterr().err


def test_write_only_keeps_the_written_prompts_of_the_kinds_asked(tmp_path, capsys, monkeypatch):
    """The target writes only the kinds asked for, and the usable prompts land in OUT as JSONL that ``heads online
    --prompts`` reads (the tiny pair writes nothing usable, so what it wrote is stood in for)."""
    from explorer.cli import heads

    asked = []
    monkeypatch.setattr(heads, "respond", lambda pair, asks, out, **kw: asked.extend(asks) or out)
    monkeypatch.setattr(heads, "records", lambda path: [])
    monkeypatch.setattr(heads, "written_prompts", lambda recs, seed=0: [("translation", "Translate into French: a"),
                                                                          ("translation", "Translate into Dutch: b")])
    out = tmp_path / "w.jsonl"
    assert main(["heads", "respond", "--models", "tiny", "--written", "--write-only", "--kinds", "translation",
                 "--per-kind", "3", "--out", str(out)]) == 0
    assert asked and {kind for kind, _ in asked} == {"translation"} and len(asked) == 3
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == [{"kind": "translation", "prompt": "Translate into French: a"},
                     {"kind": "translation", "prompt": "Translate into Dutch: b"}]
    assert main(["heads", "respond", "--models", "tiny", "--write-only", "--out", str(out)]) == 2
    assert "needs --written" in capsys.readouterr().err
    assert main(["heads", "respond", "--models", "tiny", "--kinds", "poetry", "--out", str(out)]) == 2
    assert "unknown kind 'poetry'" in capsys.readouterr().err
