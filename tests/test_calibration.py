"""Stop-signal calibration: reliability bins, ROC against a known ordering, threshold costs from the
what-if replay, the command and the app panel, on hand-made points and on the tiny pair."""

import json

import pytest

from explorer.cli.main import main
from explorer.engine.config import MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.instruments.calibration import (calibration_report, operating_point, points, reliability, roc,
                                              threshold_costs)
from explorer.trace.records import save_run


def test_roc_of_a_perfect_a_reversed_and_a_tied_score():
    perfect = [(0.9, 1, 1.0), (0.8, 1, 1.0), (0.3, 0, 0.0), (0.1, 0, 0.0)]
    assert roc(perfect)["auc"] == 1.0
    assert roc([(1 - s, 1 - y, 0.0) for s, y, _ in perfect])["auc"] == 1.0
    assert roc([(s, 1 - y, 0.0) for s, y, _ in perfect])["auc"] == 0.0
    tied = [(0.5, 1, 1.0), (0.5, 0, 0.0)]
    r = roc(tied)
    assert r["auc"] == 0.5 and r["fpr"] == [0.0, 1.0] and r["tpr"] == [0.0, 1.0]
    assert roc([(0.5, 1, 1.0)])["auc"] is None
    op = operating_point(perfect, 0.5)
    assert op["tpr"] == 1.0 and op["fpr"] == 0.0


def test_reliability_bins():
    pts = [(0.05, 0, 0.1), (0.15, 0, 0.2), (0.95, 1, 0.9), (1.0, 1, 1.0), (0.92, 0, 0.4)]
    rows = reliability(pts, bins=10)
    assert [r["count"] for r in rows] == [1, 1, 3]
    last = rows[-1]
    assert last["lo"] == 0.9 and last["realised"] == pytest.approx(2 / 3)
    assert last["predicted"] == pytest.approx((0.95 + 1.0 + 0.92) / 3)
    assert last["realised_soft"] == pytest.approx((0.9 + 1.0 + 0.4) / 3)


@pytest.mark.parametrize("cfg", [
    MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=5, stop="decision", threshold=0.3),
    MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=5, stop="confidence", threshold=0.1),
], ids=lambda c: c.stop)
def test_calibration_of_a_run(tiny, cfg):
    eng = build_engine(tiny, cfg, SamplingConfig(temperature=1.0, seed=2))
    eng.start(tiny.tokenizer.encode("def fib(n):"), 48)
    trace = eng.run()
    pts = points([trace])
    scored = [n for s in trace.steps for n in s.nodes if n.status in ("accepted", "rejected") and n.source == "draft"
              and (n.predicted_accept if cfg.stop == "decision" else n.q) is not None]
    assert len(pts) == len(scored) > 10
    if cfg.stop == "decision":
        assert all(0.0 <= n.predicted_accept <= 1.0 for n in scored)
    report = calibration_report([trace])
    assert report["policy"] == cfg.stop and report["threshold"] == cfg.threshold
    assert sum(r["count"] for r in report["reliability"]) == len(pts)
    assert report["accepted"] == sum(n.status == "accepted" for n in scored)
    costs = report["threshold_costs"]
    at = next(r for r in costs if r["threshold"] == pytest.approx(cfg.threshold))
    recorded_levels = sum(max((n.depth for n in s.nodes if n.source == "draft"), default=0)
                          for s in trace.steps if s.stop_signals)
    assert at["draft_levels"] == recorded_levels  # the run's own threshold reproduces what it drafted
    assert at["tokens"] == sum(len(s.committed_ids) for s in trace.steps if s.stop_signals)
    higher = [r["draft_levels"] for r in costs if r["threshold"] >= cfg.threshold]
    assert higher == sorted(higher, reverse=True)  # a higher threshold never drafts more


def test_a_static_tree_costs_the_same_at_every_threshold(tiny):
    # mcsd never stops early (policy "none"): every threshold replays to the full recorded tree
    eng = build_engine(tiny, MethodConfig(method="mcsd", k_config=(2, 2)), SamplingConfig())
    eng.start(tiny.tokenizer.encode("x"), 8)
    trace = eng.run()
    costs = threshold_costs([trace])
    assert {(r["draft_levels"], r["tokens"]) for r in costs} == {(2 * len(trace.steps), 8)}
    assert all(r["exact_share"] == 1.0 for r in costs)


def test_calibration_command(tiny, tmp_path, capsys):
    eng = build_engine(tiny, MethodConfig(method="mcsd-improved", k_config=(2,), max_depth=5, stop="decision",
                                    threshold=0.3), SamplingConfig(temperature=1.0))
    eng.start(tiny.tokenizer.encode("def fib(n):"), 40)
    path = tmp_path / "t.json"
    save_run(eng.run(), path)
    assert main(["calibration", "--trace", str(path), str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "decision" and out["points"] > 0
    assert out["roc"]["auc"] is None or 0.0 <= out["roc"]["auc"] <= 1.0
    assert len(out["threshold_costs"]) == 21
