"""Where one step's time goes (the step's timeline): contiguous segments from the step's start to the end
of what its observers learn from it, with each forward's query rows.

The engine opens a segment at each phase boundary (``enter``); a forward opens its own segment and reopens the
phase it interrupted, so the segments partition the step and their sum is the step's wall time less only the calls
around it. Phases: ``drafting`` (the drafter's own work: tree, sampling, stop policy), ``draft forward`` /
``target forward`` (with their query rows), ``mask`` (mask and position ids), ``verification`` (the node rules),
``odds`` (expected acceptance), ``KV-cache commit``, ``trace recording``, then the observers' learning
(``drafter learn``, ``stop-policy adaptation``; ``engine/observers.py``).

Lanes. Where the drafter drafts in a thread of its own while the target's forward runs (PEARL, ``Engine``
``lanes="threads"``), the worker keeps its own timeline (``drafting``, ``draft forward``) and the step's takes it in
as a lane (``add_lane``): those segments carry ``"lane": "draft"`` and overlap the main thread's, which partition the
step as before, its wait for the worker included (``draft wait``).

Clocks. On the CPU each boundary reads the host clock. On CUDA each boundary records a CUDA event instead and the
step synchronises once, at its end (a synchronisation per boundary stalled the host at every phase): an
event fires when the device reaches it, which is when the work queued before it is done or, on an idle device,
when the host queued it, so a segment is the time the phase held up the step (a forward's ``gpu_ms`` is its device
time). ``count_syncs`` also counts the step's host synchronisations: on CUDA through torch's sync debug mode (each
becomes a warning; it costs microseconds per synchronisation and is process-wide), on the CPU as the reads of tensor
values into Python that would synchronise on a GPU (``engine/runtime/host_reads.py``; it slows the step several-fold).
Opt-in (bench, tests, scripts).
"""

from __future__ import annotations

import time
import warnings

import torch

from .host_reads import HostReadCounter

PHASES = ("drafting", "draft forward", "mask", "target forward", "draft wait", "verification", "odds",
          "KV-cache commit", "trace recording", "drafter learn", "stop-policy adaptation")
DRAFT_PHASES = ("drafting", "draft forward")
VERIFY_PHASES = ("mask", "target forward", "verification", "odds")


class StepTimeline:
    """Segments of one step. ``device``: where the models run (CUDA: event timing, one synchronisation at the
    end). ``count_syncs``: count the step's host synchronisations (``syncs`` after ``finish``): on CUDA the real
    ones (the step's own one at its end included), on the CPU the value reads that would be ones on a GPU."""

    def __init__(self, device: torch.device, count_syncs: bool = False):
        self.device = device
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[dict, object, object]] = []  # (segment, start mark, end mark)
        self._open: tuple[dict, object] | None = None
        self.syncs: int | None = None
        self._caught = None
        self._reads: HostReadCounter | None = None
        self._lanes: list[tuple[str, StepTimeline]] = []
        if count_syncs and self.cuda:
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        elif count_syncs:
            self._reads = HostReadCounter()
            self._reads.__enter__()
        self.t0 = self._mark()

    def _mark(self):
        """Now: a recorded CUDA event, or the host clock (s)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @property
    def phase(self) -> str | None:
        return self._open[0]["phase"] if self._open else None

    def enter(self, phase: str, **info) -> None:
        """Close the open segment now and open ``phase`` (``info``: e.g. ``rows``)."""
        now = self._mark()
        self._close(now)
        self._open = ({"phase": phase, "start_ms": 0.0, **info}, now)

    def _close(self, now) -> None:
        if self._open is not None:
            segment, start = self._open
            self._spans.append((segment, start, now))
            self._open = None

    def forward(self, role: str, rows: int):
        """Context manager for one model forward: its own segment; the interrupted phase reopens after it."""
        return _ForwardSegment(self, role, rows)

    def _stop_reading(self) -> None:
        if self._reads is not None:
            self._reads.__exit__(None, None, None)
            self.syncs = self._reads.reads
            self._reads = None

    def _stop_counting(self) -> None:
        self._stop_reading()
        if self._caught is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)

    def abort(self) -> None:
        """The step failed: stop counting synchronisations (the debug mode is process-wide); no segments."""
        self._stop_counting()
        self._caught = None

    def add_lane(self, name: str, lane: StepTimeline) -> None:
        """Take in ``lane``, a timeline another thread kept during this step on the same clock (its segments are
        timed from this timeline's start and tagged ``"lane": name``). Call it once that thread is done."""
        lane._close(lane._mark())
        self._lanes.append((name, lane))

    def finish(self) -> list[dict]:
        """Close the last segment and fill in every segment's ``start_ms`` and ``ms`` (on CUDA after the step's
        one synchronisation; forwards also get ``gpu_ms``). Returns the segments, the lanes' after the main
        thread's."""
        self._close(self._mark())
        for name, lane in self._lanes:
            self._spans += [({**segment, "lane": name}, start, end) for segment, start, end in lane._spans]
        self._stop_reading()  # the CPU's count
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self._caught is not None:
                self._stop_counting()
                self.syncs = 1 + sum(1 for w in self._caught if "synchroniz" in str(w.message).lower())
        for segment, start, end in self._spans:
            if self.cuda:
                segment["start_ms"] = float(self.t0.elapsed_time(start))
                segment["ms"] = float(start.elapsed_time(end))
                if segment["phase"].endswith("forward"):
                    segment["gpu_ms"] = segment["ms"]
            else:
                segment["start_ms"] = (start - self.t0) * 1e3
                segment["ms"] = (end - start) * 1e3
        return [segment for segment, _, _ in self._spans]


class _ForwardSegment:
    def __init__(self, timeline: StepTimeline, role: str, rows: int):
        self.tl, self.role, self.rows = timeline, role, rows

    def __enter__(self):
        self.resume = self.tl.phase
        self.tl.enter(f"{self.role} forward", rows=self.rows)
        return self

    def __exit__(self, *exc):
        if self.resume is not None:
            self.tl.enter(self.resume)
        return False


def step_times(segments: list[dict]) -> dict[str, float]:
    """A step's ``draft_ms`` (drafting and draft forwards), ``verify_ms`` (mask, target forward, verification,
    odds), ``forward_ms`` (all forwards) and ``step_ms`` (the main thread's segments but the trace recording: a
    lane's overlap them), from its segments."""
    total = lambda phases: sum(s["ms"] for s in segments if s["phase"] in phases)  # noqa: E731
    return {"draft_ms": total(DRAFT_PHASES), "verify_ms": total(VERIFY_PHASES),
            "forward_ms": sum(s["ms"] for s in segments if s["phase"].endswith("forward")),
            "step_ms": sum(s["ms"] for s in segments if s["phase"] != "trace recording" and "lane" not in s)}


def phase_totals(steps) -> dict[str, float]:
    """Milliseconds per phase summed over ``steps`` (StepTraces with a timeline), in ``PHASES`` order: the main
    thread's segments, which partition each step (a lane's overlap them; its excess is the main's ``draft wait``)."""
    totals: dict[str, float] = {}
    for s in steps:
        for seg in (seg for seg in s.timeline if "lane" not in seg):
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
