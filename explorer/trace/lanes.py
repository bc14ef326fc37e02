"""PEARL's two lanes (``plugins/bundled/pearl.py``) from a run's recorded step timelines: plain data, no torch.

In a PEARL round the draft's forwards do not depend on the target's forward, so on two devices they overlap: the
round takes ``max(draft lane, target lane)`` and then what needs both (verification, the odds, the cache commit, the
observers). The **draft lane** is the segments ``drafting`` and ``draft forward``; the **target lane** ``mask`` and
``target forward``; the rest comes **after** both.

* A run on **one lane** (the engine's default: drafting, then verification, on one clock) gets the *simulated*
  two-device time: each round's lanes as it measured them, overlapped.
* A run whose draft ran in **its own thread** (``Engine`` ``lanes="threads"``) recorded the draft lane's segments
  with ``"lane": "draft"`` beside the main thread's; its step time is *measured*, the overlap real.

``two_lane_clock`` lays a run out on one wall clock from the prefill on; ``two_lane_seconds`` is its end.
"""

from __future__ import annotations

from .records import ACCEPTED, CONTEXT, RunTrace, StepTrace

DRAFT_LANE = ("drafting", "draft forward")
TARGET_LANE = ("mask", "target forward")
NOT_TIMED = ("trace recording",)  # recorded after the step's clock (``step_ms`` leaves it out)


def is_parallel(run: RunTrace) -> bool:
    """Whether the run's steps are PEARL rounds (their drafter records ``pearl``)."""
    return any("pearl" in (s.drafter or {}) for s in run.steps)


def measured_lanes(run: RunTrace) -> bool:
    """Whether the run's draft lane ran concurrently for real (its own thread), not simulated."""
    return any(seg.get("lane") == "draft" for s in run.steps for seg in (s.timeline or []))


def round_lanes(step: StepTrace) -> dict | None:
    """One PEARL round's lanes, ms: ``draft_ms``, ``target_ms``, ``after_ms`` (what needs both), ``round_ms`` (the
    round on two devices: simulated ``max(draft, target) + after``, or the measured step time where the draft ran in
    its own thread), ``one_lane_ms`` (the same work one after the other), ``measured``, and the round's ``mode``
    (``pre``/``post``). None for a step without PEARL's record or a timeline."""
    info = (step.drafter or {}).get("pearl")
    if info is None or not step.timeline:
        return None
    segs = [s for s in step.timeline if s["phase"] not in NOT_TIMED]
    measured = any(s.get("lane") == "draft" for s in segs)
    draft = sum(s["ms"] for s in segs if s["phase"] in DRAFT_LANE and (s.get("lane") == "draft" or not measured))
    target = sum(s["ms"] for s in segs if s["phase"] in TARGET_LANE and s.get("lane") != "draft")
    main = [s for s in segs if s.get("lane") != "draft"]
    if measured:  # the main thread's segments are the round's wall time, its wait for the draft included
        round_ms = sum(s["ms"] for s in main)
        after = sum(s["ms"] for s in main if s["phase"] not in TARGET_LANE and s["phase"] != "draft wait")
    else:
        after = sum(s["ms"] for s in segs if s["phase"] not in DRAFT_LANE + TARGET_LANE)
        round_ms = max(draft, target) + after
    return {"mode": info.get("mode"), "draft_ms": draft, "target_ms": target, "after_ms": after,
            "round_ms": round_ms, "one_lane_ms": draft + target + after, "measured": measured}


def two_lane_clock(run: RunTrace) -> list[dict]:
    """The run on a two-device wall clock: one entry per step, ``{"step", "start_ms", "lanes"
    (round_lanes), "end_ms", "tokens" (committed so far), "committed", "mode"}``, the prefill first (its end is the
    first start). A step without lanes (not PEARL's, no timeline) takes its ``step_ms`` on one lane."""
    clock, tokens, out = float(run.prefill_ms), 0, []
    for step in run.steps:
        lanes = round_lanes(step)
        ms = lanes["round_ms"] if lanes else float(step.step_ms)
        tokens += len(step.committed_ids)
        out.append({"step": step.index, "start_ms": clock, "lanes": lanes, "end_ms": clock + ms, "tokens": tokens,
                    "committed": len(step.committed_ids), "mode": lanes["mode"] if lanes else None})
        clock += ms
    return out


def lane_rows(run: RunTrace) -> dict[str, list[dict]]:
    """A PEARL run on its two-lane clock (``two_lane_clock``): ``{"draft": [...], "target": [...]}``, segments
    ``{"part": prefill | draft | verify | commit | other, "start_ms", "ms", "step"}``. Each round's draft lane and
    target lane start together, and what needs both (verification, commit) follows on the target's row. The prefill
    is the target's."""
    rows = {"draft": [], "target": [{"part": "prefill", "start_ms": 0.0, "ms": float(run.prefill_ms), "step": None}]}
    for entry in two_lane_clock(run):
        start, lanes, step = entry["start_ms"], entry["lanes"], entry["step"]
        if lanes is None:
            rows["target"].append({"part": "other", "start_ms": start, "ms": entry["end_ms"] - start, "step": step})
            continue
        rows["draft"].append({"part": "draft", "start_ms": start, "ms": lanes["draft_ms"], "step": step})
        rows["target"].append({"part": "verify", "start_ms": start, "ms": lanes["target_ms"], "step": step})
        rows["target"].append({"part": "commit", "start_ms": entry["end_ms"] - lanes["after_ms"],
                               "ms": lanes["after_ms"], "step": step})
    return rows


def two_lane_seconds(run: RunTrace) -> float | None:
    """The run's time on two devices (s): the prefill, then every round as ``round_lanes`` times it; None for a run
    that is not PEARL's."""
    if not is_parallel(run):
        return None
    clock = two_lane_clock(run)
    return (clock[-1]["end_ms"] if clock else float(run.prefill_ms)) / 1e3


def discarded(step: StepTrace) -> list[int]:
    """The draft tokens a PEARL round threw away: after a rejection, the chain's nodes past it and every new draft
    but the tested first; a fully accepted round discards none (its other drafts are carried to the next round)."""
    info = (step.drafter or {}).get("pearl")
    if info is None:
        return []
    chain = [n for n in step.nodes if n.source != CONTEXT]
    if chain and all(n.status == ACCEPTED for n in chain) and info.get("unfed_leaf"):
        return []
    lost = [n.token_id for n in chain if n.status != ACCEPTED]
    new = info.get("drafted") or []
    return lost + list(new[1:])
