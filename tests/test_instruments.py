"""The "why" instruments on the tiny pair: the tree-attention probe (and a deliberately wrong mask caught by
it), replaying saved runs, the acceptance report, the field-standard metrics, tree templates, and the commands."""

import json

import numpy as np
import pytest

from explorer.cli.main import main
from explorer.engine import verification as engine_module
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.engine.tree import TreeShapeError, ancestor_matrix, parse_tree_template, step_mask, step_position_ids
from explorer.instruments import acceptance as acc_mod
from explorer.instruments.probe import ProbeError, ReferenceDecoder, lint_mask, probe_last_step, rounding_step
from explorer.instruments.replay import ReplayError, replay_steps
from explorer.trace.metrics import run_metrics
from explorer.trace.records import RunTrace, save_run

PROMPT = "def add(a, b):\n    return"


def _engine(pair, cfg, sampling=None, n=24):
    eng = build_engine(pair, cfg, sampling or SamplingConfig())
    eng.start(pair.tokenizer.encode(PROMPT), n)
    return eng


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0, seed=4)])
def test_probe_finds_no_flip_in_fp32_and_shares_its_reference(tiny, sampling):
    eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2, 2)), sampling)
    ref = None
    for _ in range(4):
        eng.step()
        if ref is None:
            ref = ReferenceDecoder(tiny.target, eng.trace.prompt_ids, tiny.vocab_size)
        pr = probe_last_step(eng, ref)
        assert pr.flips == 0 and not pr.lint
        assert 0 < pr.max_delta_logit < 1e-3  # fp32: kernels differ, values barely
        assert pr.committed == pr.reference_committed == eng.trace.steps[-1].committed_ids
        assert len(pr.rows) == len(eng.trace.steps[-1].nodes)
    # one forward per tree node plus the tokens committed since the last probe: nothing recomputed twice
    assert pr.reference_forwards == len(eng.last_step[0].tree) + len(eng.trace.steps[-2].committed_ids)


def test_probe_catches_a_deliberately_wrong_mask(tiny, monkeypatch):
    right = engine_module.step_mask

    def leaky(past, chain, in_query, anc, start, stop):
        mask = right(past, chain, in_query, anc, start, stop).copy()
        mask[-1, past + chain:] = True  # the last node also sees its cousins
        return mask

    monkeypatch.setattr(engine_module, "step_mask", leaky)
    eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2)))
    eng.step()
    pr = probe_last_step(eng)
    last = len(eng.last_step[0].tree)
    assert any(p.startswith(f"node {last}: also sees") for p in pr.lint)
    assert pr.rows[-1].max_delta_logit > 0.1  # the leak changes the logits, and only the leaking row's
    assert max(r.max_delta_logit for r in pr.rows[:-1]) < 1e-3


def test_lint_accepts_the_engine_mask_and_names_each_fault():
    parents = [-1, -1, 0, 0, 1, 4]
    anc = ancestor_matrix(parents)
    past, chain = 5, 2
    mask = step_mask(past, chain, True, anc, 0, len(parents))
    depth = [1, 1, 2, 2, 2, 3]
    pos = step_position_ids(past, chain, True, depth, 0, len(parents))
    assert lint_mask(mask, past, chain, parents, list(pos)) == []
    bad = mask.copy()
    bad[chain + 2, past + chain + 3] = True  # node 3 sees its sibling node 4
    assert lint_mask(bad, past, chain, parents, list(pos)) == ["node 3: also sees node 4"]
    bad = mask.copy()
    bad[chain + 5, 0] = False
    assert "misses 1" in lint_mask(bad, past, chain, parents, list(pos))[0]
    wrong_pos = list(pos)
    wrong_pos[chain + 5] += 1
    assert "position" in lint_mask(mask, past, chain, parents, wrong_pos)[0]
    assert "shape" in lint_mask(mask[:, 1:], past, chain, parents, list(pos))[0]


def test_rounding_step_is_the_dtype_spacing():
    import torch

    assert rounding_step(12.3, torch.bfloat16) == 0.0625
    assert rounding_step(-1.0, torch.bfloat16) == 2 ** -7
    assert rounding_step(12.3, torch.float32) == pytest.approx(8 * 2 ** -23)


def test_probe_needs_a_step(tiny):
    with pytest.raises(ProbeError):
        probe_last_step(_engine(tiny, DEFAULTS["mcsd"]))


def test_replay_retraces_a_saved_run_and_reports_where_it_leaves_it(tiny, tmp_path):
    sampling = SamplingConfig(temperature=0.8, seed=5)
    eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), sampling)
    trace = eng.run()
    path = tmp_path / "t.json"
    save_run(trace, path)
    loaded = RunTrace.from_dict(json.loads(path.read_text()))
    replayed = [i for i, _ in replay_steps(tiny, loaded, len(loaded.steps) - 1)]
    assert replayed == list(range(len(trace.steps)))
    *_, (_, engine) = replay_steps(tiny, loaded, 2)
    live = _engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), sampling)
    for _ in range(3):
        live.step()
    assert probe_last_step(engine).to_dict() == probe_last_step(live).to_dict()
    loaded.steps[1].committed_ids = [t + 1 for t in loaded.steps[1].committed_ids]
    with pytest.raises(ReplayError, match="step 2"):
        list(replay_steps(tiny, loaded, 3))
    with pytest.raises(ReplayError, match="not in the trace"):
        list(replay_steps(tiny, loaded, 999))


def test_a_joint_prefill_run_replays_and_its_first_step_probes_clean(tiny):
    """A run whose first verification read the prompt (``joint_prefill``) replays step for step (its first tree was
    drafted without the prompt's memory, and so is the replay's), and the probe lints that step's mask as any other."""
    cfg = MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=5, stop="decision", threshold=0.38)
    sampling = SamplingConfig(temperature=0.8, seed=5)
    eng = build_engine(tiny, cfg, sampling, joint_prefill=True)
    eng.start(tiny.tokenizer.encode(PROMPT), 24)
    first = eng.step()
    probe = probe_last_step(eng)
    assert first.prefill_rows == len(eng.trace.prompt_ids) and probe.lint == []
    trace = eng.run()
    loaded = RunTrace.from_dict(json.loads(json.dumps(trace.to_dict())))
    replayed = [i for i, _ in replay_steps(tiny, loaded, len(loaded.steps) - 1)]
    assert replayed == list(range(len(trace.steps)))
    (_, engine), = replay_steps(tiny, loaded, 0)
    assert engine.trace.steps[0].prefill_rows == first.prefill_rows


def test_acceptance_report_counts_slots_and_matches_expectation(tiny):
    runs = []
    for seed in range(3):
        eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(temperature=1.0, seed=seed),
                      n=48)
        runs.append(eng.run())
    cells = acc_mod.slot_table(runs)
    tested = sum(1 for r in runs for s in r.steps for n in s.nodes if n.status in ("accepted", "rejected"))
    assert sum(c.tested for c in cells.values()) == tested
    assert {d for d, _ in cells} <= {1, 2} and {r for _, r in cells} <= {0, 1, 2}
    report = acc_mod.run_report(runs, budget=8, max_depth=3)
    exp, real = report["expected_tokens_per_call"], report["realised_tokens_per_call"]
    assert abs(exp - real) < 0.25 * exp  # the same law, sampled: close, not equal
    assert report["optimal_tree"]["nodes"] <= 8 and report["optimal_tree"]["depth"] <= 3
    # the optimal tree is at least as good as the trees the run used, under the same rates
    assert report["optimal_tree"]["expected_tokens"] >= report["used_tree"]["modelled_tokens_per_call"] - 1e-9 or \
        report["used_tree"]["mean_nodes"] > 8
    assert "goodput_r" not in report  # no costs measured
    # with forward costs: the goodput stop policy's r is a one-row draft over the mean tree's verification
    costs = {"draft": {1: 50.0, 16: 80.0}, "target": {1: 400.0, 16: 1300.0}}
    g = acc_mod.run_report(runs, budget=8, max_depth=3, costs=costs)["goodput_r"]
    rows = round(report["used_tree"]["mean_nodes"]) + 1
    assert g["rows"] == rows and g["r"] == pytest.approx(50.0 / (400.0 + (rows - 1) * 900.0 / 15))


def test_acceptance_vector_falls_back_and_refuses_too_little_data():
    cells = {(1, 0): acc_mod.Cell(1, 0, tested=10, accepted=5, expected=4.0),
             (2, 0): acc_mod.Cell(2, 0, tested=2, accepted=2, expected=1.8),
             (1, 1): acc_mod.Cell(1, 1, tested=6, accepted=1, expected=1.2)}
    table = acc_mod.acceptance_vector(cells)
    assert np.allclose(table, [[0.4, 0.2]])  # depth 2 has too few tests: the search reuses depth 1's row
    assert acc_mod.acceptance_vector(cells, use="realised")[0][0] == 0.5
    with pytest.raises(ValueError, match="too few"):
        acc_mod.acceptance_vector({(1, 0): acc_mod.Cell(1, 0, tested=1, accepted=1, expected=1.0)})


def test_field_standard_metrics(tiny):
    ar = _engine(tiny, DEFAULTS["ar"]).run()
    m = run_metrics(ar)
    assert m["acceptance_length"] == 1.0 and m["position_acceptance"] == []
    sd = _engine(tiny, MethodConfig(method="sd", gamma=3), n=40).run()
    m = run_metrics(sd)
    steps = [s for s in sd.steps]
    assert m["acceptance_length"] == pytest.approx(sum(len(s.committed_ids) for s in steps) / len(steps))
    pos = {p["position"]: p for p in m["position_acceptance"]}
    # a step drafts no deeper than the room left less the bonus token (the last steps of the run drafted less)
    assert set(pos) == {1, 2, 3}
    assert all(p["drafted"] == sum(1 for s in steps if s.drafted >= j) for j, p in pos.items())
    assert pos[1]["accepted"] == sum(1 for s in steps if s.accepted_draft_len >= 1)
    assert pos[1]["accepted"] >= pos[2]["accepted"] >= pos[3]["accepted"]  # a chain: accepted at 3 implies 1, 2


def test_tree_template_runs_as_drafted_and_stays_exact(tiny):
    template = (-1, -1, -1, 0, 0, 1, 3, 3, 5, 6)
    eng = _engine(tiny, MethodConfig(method="mcsd", tree=template), n=40)
    trace = eng.run()
    ar = _engine(tiny, DEFAULTS["ar"], n=40).run()
    assert trace.generated_ids == ar.generated_ids
    depth = []
    for p in template:
        depth.append(1 if p < 0 else depth[p] + 1)
    done = 0
    for s in trace.steps:  # the template, down to the room left less the bonus token (a breadth-first prefix)
        reach = sum(1 for d in depth if d <= 40 - done - 1)
        assert tuple(n.parent - 1 for n in s.nodes[1:]) == template[:reach]
        done += len(s.committed_ids)
    assert sum(len(s.nodes) == len(template) + 1 for s in trace.steps) >= len(trace.steps) - 4
    assert parse_tree_template("-1, -1, 0") == (-1, -1, 0)
    for bad in ("", "0", "-1,1", "-1,-1,1,0", "x", [-2]):
        with pytest.raises(TreeShapeError):
            parse_tree_template(bad)
    with pytest.raises(ValueError, match="mcsd"):
        MethodConfig(method="sd", tree=(-1,))
    with pytest.raises(TreeShapeError, match="SpecHub"):
        MethodConfig(method="mcsd", tree=(-1, -1, -1), verifier="spechub")


def test_probe_and_acceptance_commands_print_their_json(tiny, tmp_path, capsys):
    assert main(["probe", "--models", "tiny", "--prompt", PROMPT, "--method", "mcsd", "--max-new-tokens", "8",
                 "--no-chat-template", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flips"] == 0 and 0 < out["max_delta_logit"] < 1e-3 and out["lint_problems"] == 0
    eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(3, 2)), SamplingConfig(temperature=1.0), n=40)
    path = tmp_path / "t.json"
    save_run(eng.run(), path)
    assert main(["acceptance", "--models", "tiny", "--trace", str(path), "--budget", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["expected_tokens_per_call"] > 1 and out["realised_tokens_per_call"] > 1
    assert len(out["optimal_tree"]["parents"]) <= 6
    # measured forward costs (the tiny pair, here): the text report names the goodput policy's r for this machine
    assert main(["acceptance", "--models", "tiny", "--trace", str(path), "--budget", "6", "--costs"]) == 0
    assert "goodput stop policy, r for this machine" in capsys.readouterr().out
    assert main(["probe", "--models", "tiny", "--trace", str(path), "--step", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["steps_probed"] == 1 and out["flips"] == 0
    assert main(["acceptance", "--models", "tiny", "--trace", str(tmp_path / "missing.json")]) == 2


def test_expectation_overhead_keeps_greedy_rows_cheap(tiny):
    # greedy odds read one argmax per parent row: every node's odds are 0 or 1 and sum to at most 1 per parent
    eng = _engine(tiny, MethodConfig(method="mcsd", k_config=(4, 2)))
    eng.step()
    d, v = eng.last_step
    per_parent: dict = {}
    for i, o in v.odds.items():
        per_parent[d.tree.parent[i]] = per_parent.get(d.tree.parent[i], 0.0) + o.accept_prob
    assert all(s in (0.0, 1.0) for s in per_parent.values())
    assert np.isclose(v.expected_tokens, len(eng.trace.steps[-1].committed_ids))


def test_generate_takes_a_tree_template(capsys):
    assert main(["generate", "--models", "tiny", "--method", "mcsd", "--tree=-1,-1,0,2", "--prompt", PROMPT,
                 "--no-chat-template", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["acceptance_length"] >= 1.0 and out["position_acceptance"][0]["position"] == 1
    assert {p["position"] for p in out["position_acceptance"]} <= {1, 2, 3}
    assert main(["generate", "--models", "tiny", "--method", "mcsd", "--tree=-1,1", "--prompt", PROMPT]) == 2
