"""PEARL (``explorer/plugins/bundled/pearl.py``): rounds that carry drafts to the next, the unfed leaf, the two lanes
(simulated from one device's timeline, or a draft thread of its own), the figures, the bench's labels. Its lossless
audits are in the audit's grid (tests/test_audit.py) and the family matrix (tests/test_families.py)."""

import pytest

from explorer.analysis.audit import audit
from explorer.analysis.bench import lanes_of, method_for_label
from explorer.cli.main import main
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.parts import EngineError
from explorer.engine.sampling import SamplingConfig
from explorer.lessons.race import commit_times, race_figure
from explorer.plugins import register_method, unregister
from explorer.plugins.bundled.pearl import PearlDrafter
from explorer.trace import lanes
from explorer.trace.figures import lanes_figure, provenance_text

PROMPT = "def f(x):\n    return"


def _run(pair, config, temperature=0.0, seed=0, n=40, **options):
    engine = build_engine(pair, config, SamplingConfig(temperature=temperature, seed=seed), **options)
    engine.start(pair.tokenizer.encode(PROMPT), n)
    return engine.run()


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_greedy_pearl_equals_ar_on_either_lanes(tiny, gamma):
    expected = _run(tiny, DEFAULTS["ar"].with_(fallback="off")).generated_ids
    one = _run(tiny, DEFAULTS["pearl"].with_(gamma=gamma))
    threads = _run(tiny, DEFAULTS["pearl"].with_(gamma=gamma), lanes="threads")
    assert one.generated_ids == expected and threads.generated_ids == expected
    if gamma > 1:  # the run really carried drafts: some post-verify rounds
        assert {s.drafter["pearl"]["mode"] for s in one.steps} == {"pre", "post"}


def test_sampled_runs_are_the_same_on_one_lane_and_on_two_threads(tiny):
    for seed in (1, 2):
        one = _run(tiny, DEFAULTS["pearl"].with_(gamma=3), temperature=0.8, seed=seed)
        two = _run(tiny, DEFAULTS["pearl"].with_(gamma=3), temperature=0.8, seed=seed, lanes="threads")
        assert one.generated_ids == two.generated_ids
        assert not lanes.measured_lanes(one) and lanes.measured_lanes(two)


def test_each_round_checks_what_the_last_carried_and_accounts_for_every_draft(tiny):
    run = _run(tiny, DEFAULTS["pearl"].with_(gamma=4), temperature=0.8, seed=5, n=60)
    carried = 0
    for step in run.steps:
        info = step.drafter["pearl"]
        assert info["checked"] == carried and info["mode"] == ("post" if carried else "pre")
        chain = [n for n in step.nodes[1:]]
        assert len(chain) == carried + (1 if info["drafted"] else 0)  # the carried chain and the first new draft
        assert all(n.provenance["pearl"] == "carried" for n in chain[:carried])
        if info["drafted"]:
            assert chain[-1].provenance["pearl"] == "new" and info["unfed_leaf"]
            assert chain[-1].token_id == info["drafted"][0]
            # the target read the anchor and the carried chain only (nothing in the first round: the prefill's row)
            assert len(step.mask_node_ids) == (carried + 1 if step.target_calls else 0)
        whole = all(n.status == "accepted" for n in chain) and info["unfed_leaf"]
        assert (step.bonus_token is None) == whole  # a wholly accepted round has no bonus token
        lost = lanes.discarded(step)
        carried = len(info["drafted"]) - 1 if whole else 0
        assert step.accepted_draft_len + len(lost) + carried == info["checked"] + len(info["drafted"])
        assert len(step.committed_ids) == step.accepted_draft_len + (0 if whole else 1) or step.finished


def test_greedy_expected_tokens_count_no_bonus_after_the_unfed_leaf(tiny):
    run = _run(tiny, DEFAULTS["pearl"].with_(gamma=3))
    for step in run.steps[:-1]:  # the last step may be cut at the budget
        assert step.expected_tokens == len(step.committed_ids)


class _Reseeded(PearlDrafter):
    """The reference code's draws: the generator reseeded from the position before each round, so two samples of
    one prompt draw the same numbers."""

    def draft(self, view):
        view.generator.manual_seed(1234 + len(view.committed))
        return super().draft(view)


def test_the_audit_catches_draws_reseeded_by_position(tiny):
    register_method("pearl-reseeded", _Reseeded, model_tree="chain", defaults={"gamma": 3, "fallback": "off"})
    try:
        r = audit(tiny, DEFAULTS["pearl-reseeded"], SamplingConfig(temperature=1.0, seed=7),
                  tiny.tokenizer.encode(PROMPT), 200)
    finally:
        unregister("pearl-reseeded")
    assert r.first.p_value < 1e-6 and max(r.first.counts) == 200  # every sample drew the same first token


def test_pearl_refuses_a_rule_that_tests_drafts_otherwise(tiny):
    with pytest.raises(EngineError, match="speculative decoding"):
        _run(tiny, DEFAULTS["pearl"].with_(verifier="mcns"), temperature=0.8)
    with pytest.raises(EngineError, match="lanes"):
        _run(tiny, DEFAULTS["pearl"], lanes="three")


def test_two_lanes_overlap_the_draft_and_the_target(tiny):
    simulated = _run(tiny, DEFAULTS["pearl"].with_(gamma=4))
    for step in simulated.steps:
        r = lanes.round_lanes(step)
        assert r["round_ms"] == pytest.approx(max(r["draft_ms"], r["target_ms"]) + r["after_ms"])
        assert r["round_ms"] <= r["one_lane_ms"] + 1e-9 and not r["measured"]
        assert r["one_lane_ms"] == pytest.approx(step.step_ms, rel=1e-6)
    assert lanes.two_lane_seconds(simulated) < (simulated.prefill_ms + sum(s.step_ms for s in simulated.steps)) / 1e3
    measured = _run(tiny, DEFAULTS["pearl"].with_(gamma=4), lanes="threads")
    for step in measured.steps:
        main_segments = [s for s in step.timeline if "lane" not in s and s["phase"] != "trace recording"]
        assert step.step_ms == pytest.approx(sum(s["ms"] for s in main_segments))
        assert {s["phase"] for s in step.timeline if s.get("lane") == "draft"} <= {"drafting", "draft forward"}
        assert lanes.round_lanes(step)["round_ms"] == pytest.approx(step.step_ms)
    assert lanes.two_lane_seconds(_run(tiny, DEFAULTS["sd"].with_(fallback="off"))) is None


def test_the_figures_draw_both_lanes(tiny):
    run = _run(tiny, DEFAULTS["pearl"].with_(gamma=4))
    fig = lanes_figure(run, current=2)
    assert {y for t in fig.data for y in t.y} == {"draft", "target"}
    assert {t.name for t in fig.data} >= {"draft, pre-verify", "draft, post-verify", "verify + commit"}
    assert "simulated" in fig.layout.title.text
    assert "measured" in lanes_figure(_run(tiny, DEFAULTS["pearl"], lanes="threads")).layout.title.text
    baseline = _run(tiny, DEFAULTS["ar"].with_(fallback="off"))
    race = race_figure(run, baseline, "pearl")
    rows = {y for t in race.data for y in (t.y or ())}
    assert {"pearl · draft", "pearl · target", "ar (plain decoding)"} <= rows
    assert commit_times(run)[-1] == (lanes.two_lane_clock(run)[-1]["end_ms"], len(run.generated_ids))
    carried = next(n for s in run.steps for n in s.nodes if (n.provenance or {}).get("pearl") == "carried")
    assert "drafted in step" in provenance_text(carried)


def test_bench_labels_name_the_lanes():
    assert lanes_of("pearl+gamma=6+lanes=threads") == "threads" and lanes_of("pearl") == "one"
    assert method_for_label("pearl+gamma=6+lanes=threads") == DEFAULTS["pearl"].with_(gamma=6)
    assert isinstance(method_for_label("pearl"), MethodConfig)


def test_generate_runs_pearl_in_two_threads(capsys):
    assert main(["generate", "--models", "tiny", "--method", "pearl", "--lanes", "threads", "--gamma", "3",
                 "--prompt", PROMPT, "--max-new-tokens", "12", "--no-chat-template"]) == 0
    assert "tokens/call" in capsys.readouterr().out


def test_a_round_cannot_be_edited_and_reverified_alone(tiny):
    engine = build_engine(tiny, DEFAULTS["pearl"], SamplingConfig(temperature=0.0))
    engine.start(tiny.tokenizer.encode(PROMPT), 8)
    with pytest.raises(EngineError, match="cannot be edited"):
        engine.step(edit=lambda eng, drafted: drafted)


def test_a_pearl_trace_replays_step_by_step(tiny):
    from explorer.instruments.replay import replay_steps

    run = _run(tiny, DEFAULTS["pearl"].with_(gamma=3), temperature=0.8, seed=4, n=24)
    replayed = [engine.trace.steps[i].committed_ids for i, engine in replay_steps(tiny, run, len(run.steps) - 1)]
    assert replayed == [s.committed_ids for s in run.steps]


def test_a_draft_on_a_device_of_its_own_drafts_the_same(tiny, capsys):
    """``place_draft`` / ``--draft-device``: the draft on a device of its own, e.g. the CPU beside a GPU target,
    where PEARL's lanes overlap for real. This machine has one device, so the draft is marked as elsewhere (meta)
    while it stays on the CPU: what the split changes runs (no graph runner for the draft, its outputs brought to
    the target's device, the draft lane's own clock, the trace's record); the copy between two real devices is
    checked on a GPU (scripts/gpu_check.sh, part pearl-split)."""
    import dataclasses

    import torch

    from explorer.models.early_exit import self_draft_pair
    from explorer.models.loading import ModelPairError, place_draft

    expected = _run(tiny, DEFAULTS["ar"].with_(fallback="off")).generated_ids
    pair = dataclasses.replace(tiny, graph_runners={}, measured={})
    assert place_draft(pair, "cpu") is pair and not pair.split  # the target's device: nothing moves
    pair.draft_device = torch.device("meta")
    assert pair.split and pair.draft_at.type == "meta"
    config = DEFAULTS["pearl"].with_(gamma=3)
    engine = build_engine(pair, config, SamplingConfig(temperature=0.0), lanes="threads", kv_cache="static",
                          graphs=True)
    engine.start(pair.tokenizer.encode(PROMPT), 40)
    run = engine.run()
    assert run.generated_ids == expected and lanes.measured_lanes(run)
    assert set(engine.forwards.runners) == {"target"}  # the draft runs eagerly where it is
    assert run.model["draft_device"] == "meta" and "draft_device" not in _run(tiny, config).model
    assert self_draft_pair(pair).draft_device is None  # the target's own layers run where the target does
    with pytest.raises(ModelPairError, match="target's own first layers"):
        place_draft(self_draft_pair(tiny), "meta")
    with pytest.raises(ModelPairError, match="cannot place the draft on 'nowhere'"):
        place_draft(tiny, "nowhere")
    assert main(["generate", "--models", "tiny", "--prompt", "x", "--draft-device", "nowhere"]) == 2
    assert "cannot place the draft" in capsys.readouterr().err
