"""Where one step's time goes (issue 16, "the step's timeline"): contiguous segments measured with the host clock
(synchronising the device at each boundary on CUDA) and, on CUDA, the device time of every forward from CUDA
events.

The engine opens a segment at each phase boundary (``enter``); a forward opens its own segment and reopens the
phase it interrupted, so the segments partition the step from its first to its last timestamp and their sum is the
step's wall time less only the calls around it. Phases: ``drafting`` (the drafter's own work: tree, sampling,
stop policy), ``draft forward`` / ``target forward`` (with their query rows), ``mask`` (mask and position ids),
``verification`` (the node rules), ``odds`` (expected acceptance), ``drafter learn``, ``KV-cache commit`` and
``trace recording``.
"""

from __future__ import annotations

import time

import torch

PHASES = ("drafting", "draft forward", "mask", "target forward", "verification", "odds", "drafter learn",
          "KV-cache commit", "trace recording")


class StepTimeline:
    """Segments of one step. ``device``: where the models run (CUDA: each boundary synchronises it, and forwards
    also get CUDA event pairs for their device time)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.segments: list[dict] = []
        self._events: list[tuple[int, object, object]] = []  # (segment index, start event, end event)
        self._open: dict | None = None
        self.syncs = 0
        self.t0 = self._clock()

    def _clock(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.syncs += 1
        return time.perf_counter()

    @property
    def phase(self) -> str | None:
        return self._open["phase"] if self._open else None

    def enter(self, phase: str, **info) -> None:
        """Close the open segment now and open ``phase`` (``info``: e.g. ``rows``)."""
        now = self._clock()
        self._close(now)
        self._open = {"phase": phase, "start_ms": (now - self.t0) * 1e3, **info}

    def _close(self, now: float) -> None:
        if self._open is not None:
            self._open["ms"] = (now - self.t0) * 1e3 - self._open["start_ms"]
            self.segments.append(self._open)
            self._open = None

    def forward(self, role: str, rows: int):
        """Context manager for one model forward: its own segment (with CUDA events on a GPU); the interrupted
        phase reopens after it."""
        return _ForwardSegment(self, role, rows)

    def finish(self) -> list[dict]:
        """Close the last segment; fill in the forwards' device milliseconds (CUDA). Returns the segments."""
        self._close(self._clock())
        for index, start, end in self._events:
            self.segments[index]["gpu_ms"] = float(start.elapsed_time(end))
        return self.segments


class _ForwardSegment:
    def __init__(self, timeline: StepTimeline, role: str, rows: int):
        self.tl, self.role, self.rows = timeline, role, rows

    def __enter__(self):
        self.resume = self.tl.phase
        self.tl.enter(f"{self.role} forward", rows=self.rows)
        if self.tl.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        return self

    def __exit__(self, *exc):
        if self.tl.cuda:
            self.end.record()
            self.tl._events.append((len(self.tl.segments), self.start, self.end))
        if self.resume is not None:
            self.tl.enter(self.resume)
        return False


def phase_totals(steps) -> dict[str, float]:
    """Milliseconds per phase summed over ``steps`` (StepTraces with a timeline), in ``PHASES`` order."""
    totals: dict[str, float] = {}
    for s in steps:
        for seg in s.timeline:
            totals[seg["phase"]] = totals.get(seg["phase"], 0.0) + seg["ms"]
    return {p: totals[p] for p in PHASES if p in totals} | {p: v for p, v in totals.items() if p not in PHASES}


def plain_decoding_ms(steps, one_row_ms: float | None = None) -> float | None:
    """What plain decoding would have cost for the tokens these steps committed: target forward time per token x
    tokens. ``one_row_ms``: a measured one-row target forward; without it, the fastest target forward of at most
    two rows in the steps' timelines (None when there is none)."""
    if one_row_ms is None:
        small = [seg["ms"] for s in steps for seg in s.timeline
                 if seg["phase"] == "target forward" and seg.get("rows", 99) <= 2]
        one_row_ms = min(small) if small else None
    if one_row_ms is None:
        return None
    return one_row_ms * sum(len(s.committed_ids) for s in steps)
