"""Counterfactual steps on the tiny pair: an unedited re-verification reproduces the recorded step
exactly, an edit never changes the recorded run, and edits change the outcome the way the rules say."""

import json

import pytest

from explorer.cli.main import main
from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.instruments.counterfactual import EditError, StepEdit, counterfactual, parse_edits
from explorer.trace.records import save_run

PROMPT = "def add(a, b):\n    return"
CASES = [
    (MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig()),
    (MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(temperature=1.0, seed=3)),
    (MethodConfig(method="sd", gamma=3), SamplingConfig(temperature=0.7, top_p=0.9, seed=1)),
    (MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=4, stop="decision", threshold=0.38),
     SamplingConfig(temperature=1.0, seed=2)),
    (MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=3, lossy=True, width=2), SamplingConfig()),
    (MethodConfig(method="hybrid", k_config=(2,), max_depth=4, stop="none"), SamplingConfig(temperature=1.0)),
    (MethodConfig(method="token-recycling"), SamplingConfig(temperature=1.0, seed=5)),
]


def _run(pair, cfg, sampling, n=24):
    eng = build_engine(pair, cfg, sampling)
    eng.start(pair.tokenizer.encode(PROMPT), n, prompt_text=PROMPT)
    return eng.run()


@pytest.mark.parametrize("cfg, sampling", CASES, ids=lambda x: getattr(x, "method", None) or str(x.temperature))
def test_unedited_reverification_reproduces_every_recorded_step(tiny, cfg, sampling):
    trace = _run(tiny, cfg, sampling)
    before = json.dumps(trace.to_dict())
    for k in range(len(trace.steps)):
        cf = counterfactual(tiny, trace, k)
        assert cf.identical and cf.differences == [], (k, cf.differences)
        assert cf.edited.committed_ids == trace.steps[k].committed_ids
        assert [n.status for n in cf.edited.nodes] == [n.status for n in trace.steps[k].nodes]
    assert json.dumps(trace.to_dict()) == before  # the recorded run is untouched


def _rejected_with_a_better_token(trace):
    for k, s in enumerate(trace.steps):
        for n in s.nodes:
            siblings = {m.token_id for m in s.nodes if m.parent == n.parent}
            if n.status == "rejected" and n.p_top and n.p_top[0][0] not in siblings:
                return k, n
    raise AssertionError("no rejected node in this run")


def test_a_rejected_node_replaced_by_the_targets_token_is_accepted(tiny):
    trace = _run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(), n=40)
    before = json.dumps(trace.to_dict())
    k, node = _rejected_with_a_better_token(trace)
    best = node.p_top[0][0]  # the target's argmax at the node's parent
    cf = counterfactual(tiny, trace, k, StepEdit(replace={node.id: best}), continue_tokens=6)
    new = next(n for n in cf.edited.nodes if n.parent == node.parent and n.token_id == best)
    assert new.status == "accepted" and new.provenance["source"] == "edited" and new.provenance["was"] == node.token_id
    assert cf.edited.committed_ids[: len(trace.steps[k].committed_ids) - 1] == trace.steps[k].committed_ids[:-1]
    assert best in cf.edited.committed_ids and not cf.identical
    assert any(d.startswith("new node") and "accepted" in d for d in cf.differences)
    assert 0 < len(cf.continuation_ids) <= 6 + 8  # the next step may commit several tokens at once
    assert json.dumps(trace.to_dict()) == before


def test_remove_and_add_branches_and_settings(tiny):
    trace = _run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(temperature=1.0, seed=3))
    step = trace.steps[1]
    roots = [n for n in step.nodes if n.parent == 0]
    cf = counterfactual(tiny, trace, 1, StepEdit(remove=[roots[0].id]))
    assert len(cf.edited.nodes) == len(step.nodes) - 1 - sum(1 for n in step.nodes if n.parent == roots[0].id)
    token = next(t for t in range(200) if t not in {n.token_id for n in roots})
    cf = counterfactual(tiny, trace, 1, StepEdit(add=[(0, token)]))
    added = [n for n in cf.edited.nodes if (n.provenance or {}).get("edit") == "added"]
    assert len(added) == 1 and added[0].parent == 0 and added[0].q is not None
    cf = counterfactual(tiny, trace, 1, StepEdit(verifier="mcns", seed=9))
    assert cf.edited.verifier == "mcns"
    cf = counterfactual(tiny, trace, 1, StepEdit(temperature=0.0))
    assert cf.edited.verifier == "greedy"


@pytest.mark.parametrize("edit, message", [
    (StepEdit(replace={99: 1}), "not a drafted node"),
    (StepEdit(remove=[0]), "not a drafted node"),
    (StepEdit(replace={1: 10**7}), "outside the vocabulary"),
    (StepEdit(remove=[1], add=[(1, 5)]), "removed"),
    (StepEdit(verifier="nope"), "unknown verifier"),
    (StepEdit(temperature=-1.0), "temperature"),
])
def test_bad_edits_are_refused_with_a_message(tiny, edit, message):
    trace = _run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig())
    with pytest.raises(ValueError, match=message):
        counterfactual(tiny, trace, 0, edit)


def test_sibling_tokens_must_differ(tiny):
    trace = _run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig())
    roots = [n for n in trace.steps[0].nodes if n.parent == 0]
    with pytest.raises(EditError, match="same token"):
        counterfactual(tiny, trace, 0, StepEdit(replace={roots[0].id: roots[1].token_id}))


def test_parse_edits(tiny):
    e = parse_edits(["replace:3=17", "add:0='a'", "remove:5", "verifier:rrs", "temperature:0.5", "seed:4"],
                    tiny.tokenizer)
    assert e.replace == {3: 17} and e.add == [(0, tiny.tokenizer.encode("a")[0])] and e.remove == [5]
    assert (e.verifier, e.temperature, e.seed) == ("rrs", 0.5, 4)
    for bad in ("replace:x=1", "grow:1", "add:0='ab'"):
        with pytest.raises(EditError):
            parse_edits([bad], tiny.tokenizer)


def test_counterfactual_command(tiny, tmp_path, capsys):
    trace = _run(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(), n=40)
    path = tmp_path / "t.json"
    save_run(trace, path)
    assert main(["counterfactual", "--models", "tiny", "--trace", str(path), "--step", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["differences"] == []
    assert out["edited"]["committed_ids"] == out["original"]["committed_ids"] == trace.steps[1].committed_ids
    k, node = _rejected_with_a_better_token(trace)
    assert main(["counterfactual", "--models", "tiny", "--trace", str(path), "--step", str(k + 1), "--edit",
                 f"replace:{node.id}={node.p_top[0][0]}", "--continue", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is False and out["continuation_ids"]
    assert main(["counterfactual", "--models", "tiny", "--trace", str(path), "--step", "99"]) == 2
    assert main(["counterfactual", "--models", "tiny", "--trace", str(path), "--step", "1", "--edit",
                 "replace:1=x"]) == 2


def test_free_drafts_can_be_edited_but_not_given_draft_model_children(tiny):
    trace = _run(tiny, MethodConfig(method="token-recycling"), SamplingConfig(), n=32)
    k = next(i for i, s in enumerate(trace.steps) if len(s.nodes) > 2)
    node = trace.steps[k].nodes[1]
    siblings = {n.token_id for n in trace.steps[k].nodes if n.parent == node.parent}
    token = next(t for t in range(256) if t not in siblings)
    cf = counterfactual(tiny, trace, k, StepEdit(replace={node.id: token}))
    edited = next(n for n in cf.edited.nodes if (n.provenance or {}).get("source") == "edited")
    assert edited.source == "recycled" and edited.token_id == token
    with pytest.raises(EditError, match="did not draft"):
        counterfactual(tiny, trace, k, StepEdit(add=[(0, token)]))
