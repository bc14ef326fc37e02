"""Run metrics computed from step traces (plain data; no torch).

* block efficiency = generated tokens / target calls (tokens per target call), the prefill counted as a call since
  it scores the first new token (so ``ar`` is exactly 1.0); comparable across all methods. A prefill joined to the
  first verification (``StepTrace.prefill_rows``) is that step's call, not one more.
* acceptance rate (Lu et al. 2024) = mean over steps of longest accepted draft length / maximum draft
  length.
* acceptance rate (MCSD, Yang et al. 2024) = accepted draft tokens / drafted tokens.
* tokens/s = generated tokens / wall-clock seconds (prefill included).
* engine overhead = share of the steps' wall time spent outside model forwards.
* acceptance length (EAGLE's tau, vLLM's "mean acceptance length") = mean tokens committed per step (one
  draft-and-verify cycle, one target call), the bonus token counted: accepted draft tokens + 1 for a lossless
  step. Unlike block efficiency the prefill is not counted; ``ar`` is exactly 1.0 on both.
* acceptance per draft position (vLLM's per-position counters) = for draft depth i, steps that committed a
  proposed token at depth i / steps whose tree had a proposed token at depth i.
* committed and proposed tokens per draft source (draft model, prompt lookup, token recycling): how much each
  drafter of a hybrid contributes; summed over the sources they are ``accepted_draft_tokens`` and
  ``drafted_tokens``.
"""

from __future__ import annotations

from .records import DRAFT_SOURCES, RunTrace, StepTrace


def run_metrics(run: RunTrace) -> dict:
    """Metrics of a run; acceptance rates are None for ``ar`` (nothing drafted)."""
    steps = run.steps
    generated = sum(len(s.committed_ids) for s in steps)
    target_calls = sum(s.target_calls for s in steps) + prefill_calls(steps)
    drafted = sum(s.drafted for s in steps)
    accepted = sum(s.accepted_draft_len for s in steps)
    with_draft = [s for s in steps if s.max_draft_len > 0]
    seconds = (run.prefill_ms + sum(s.step_ms for s in steps)) / 1e3
    return {
        "generated_tokens": generated,
        "steps": len(steps),
        "target_calls": target_calls,
        "draft_calls": sum(s.draft_calls for s in steps),
        "tokens_per_target_call": generated / target_calls if target_calls else None,
        "acceptance_rate": (sum(s.accepted_draft_len / s.max_draft_len for s in with_draft) / len(with_draft)
                            if with_draft else None),
        "mcsd_acceptance_rate": accepted / drafted if drafted else None,
        "drafted_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds > 0 else None,
        "prefill_ms": run.prefill_ms,
        "draft_ms": sum(s.draft_ms for s in steps),
        "verify_ms": sum(s.verify_ms for s in steps),
        "forward_ms": (sum(s.forward_ms for s in steps)
                       if steps and all(s.forward_ms is not None for s in steps) else None),
        "step_ms": sum(s.step_ms for s in steps),
        "acceptance_length": acceptance_length(steps),
        "position_acceptance": position_acceptance(steps),
    }


def prefill_calls(steps: list[StepTrace]) -> int:
    """Target calls of the prefill beyond the steps' own: 1 (it scores the first new token), or 0 without steps
    or where the first step's forward read the prompt (a joint prefill)."""
    return 1 if steps and not steps[0].prefill_rows else 0


def acceptance_length(steps: list[StepTrace]) -> float | None:
    """Mean tokens committed per step (bonus included; prefill excluded); None without steps."""
    return sum(len(s.committed_ids) for s in steps) / len(steps) if steps else None


def position_acceptance(steps: list[StepTrace], sources=DRAFT_SOURCES) -> list[dict]:
    """Per draft depth i = 1, 2, ...: ``{"position", "drafted", "accepted", "rate"}``, where ``drafted`` counts
    steps with a proposed node at depth i and ``accepted`` steps that committed one there; ``sources``: the draft
    sources counted (e.g. ``("draft",)``: an EAGLE head's or the draft model's nodes alone)."""
    drafted: dict[int, int] = {}
    accepted: dict[int, int] = {}
    for s in steps:
        depths = {n.depth for n in s.nodes if n.source in sources}
        for d in depths:
            drafted[d] = drafted.get(d, 0) + 1
        for d in {n.depth for n in s.nodes if n.source in sources and n.committed}:
            accepted[d] = accepted.get(d, 0) + 1
    return [{"position": d, "drafted": drafted[d], "accepted": accepted.get(d, 0),
             "rate": accepted.get(d, 0) / drafted[d]} for d in sorted(drafted)]


def first_acceptance(steps: list[StepTrace], sources=("draft",)) -> dict:
    """``position_acceptance``'s first position over ``steps`` (by default the draft model's or head's nodes alone):
    ``{"drafted", "accepted", "rate"}``, the rate None where no step drafted there."""
    first = next((row for row in position_acceptance(steps, sources) if row["position"] == 1), None)
    return ({"drafted": first["drafted"], "accepted": first["accepted"], "rate": first["rate"]} if first
            else {"drafted": 0, "accepted": 0, "rate": None})


def draft_source_counts(steps: list[StepTrace]) -> dict[str, tuple[int, int]]:
    """Per draft source (``DRAFT_SOURCES``) that proposed anything: ``(committed, proposed)`` tokens over
    ``steps``, in the order the sources first appear."""
    out: dict[str, tuple[int, int]] = {}
    for step in steps:
        for n in step.nodes:
            if n.source in DRAFT_SOURCES:
                committed, proposed = out.get(n.source, (0, 0))
                out[n.source] = (committed + int(n.committed), proposed + 1)
    return out
