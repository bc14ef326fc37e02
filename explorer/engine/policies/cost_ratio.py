"""The ``goodput`` stop policy's cost ratio r, measured from the run's own steps instead of set by hand.

The goodput rule (``engine/policies/stopping.py``) drafts one more level while its expected gain exceeds
``r (1 + E) / (1 + D r)``, where r is what one draft level costs over the rest of a step (the target forward, the
verification and the engine's host work). That ratio belongs to the machine, not to the method: 0.22 on the
AVX-512-BF16 CPU the default was measured on, 0.18-0.31 on a 2-core AVX2 CPU in fp32 with a level's verification
rows charged (docs/decision.md, "Measured r"), other values on a GPU. ``CostRatioMeter`` reads each finished step's
timeline (``timeline.step_times``):

    level_ms = draft_ms / draft forwards      (draft forwards plus the drafting host work, per level)
    rest_ms  = step_ms - draft_ms             (everything a step costs whether or not it drafts)

keeps exponential moving averages of both (over the speculative steps that drafted with the model) and sets the
next step's r to their ratio, clamped to [0, 1]. Until a step has been measured, r is the configured setting. Like
the goodput fallback (``engine/policies/fallback.py``) it reads wall-clock timings, so two runs of one prompt may draft
differently; the output law never changes (verification does not read the stop policy), and a replay follows the
recorded values (``force``).

A level also costs its rows in the verification. Where rows are nearly free (1.07x for 16 rows on the AVX-512-BF16
CPU) that is noise; where they are dear (2.8x on a 2-core AVX2 CPU in fp32, ``engine/runtime/forward_costs.py``) the
split above charges every drafted row to the rest of the step and under-states r by 5-10x, so the policy drafts deep
trees that the verification then pays for. With ``row_ms`` (the target's marginal milliseconds per query row, measured
once per pair: ``forward_costs.verification_cost``) each level is charged its share of the tree's rows:

    level_ms = (draft_ms + row_ms x tree nodes) / draft forwards
    rest_ms  = step_ms - draft_ms - row_ms x tree nodes
"""

from __future__ import annotations

COST_RATIO_MODES = ("fixed", "measured")


class CostRatioMeter:
    """The goodput policy's r from measured step times.

    Args:
        start: r before the first measured step (the configured setting), in [0, 1].
        alpha: weight of the newest step in the moving averages (0 < alpha <= 1).
        row_ms: the target forward's marginal milliseconds per query row on this machine (>= 0; 0 charges the
            verification's rows to the rest of the step).
    Raises:
        ValueError: ``start`` outside [0, 1], ``alpha`` outside (0, 1] or a negative ``row_ms``.
    """

    def __init__(self, start: float, alpha: float = 0.3, row_ms: float = 0.0):
        if not 0.0 <= start <= 1.0:
            raise ValueError(f"the starting cost ratio must be in [0, 1], got {start}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not row_ms >= 0.0:
            raise ValueError(f"the cost of a verification row must be >= 0 ms, got {row_ms}")
        self.row_ms = round(float(row_ms), 3)
        self.r, self.alpha = round(float(start), 5), float(alpha)
        self.level_ms: float | None = None
        self.rest_ms: float | None = None
        self._forced: list[float | None] | None = None
        self._observed = 0

    def force(self, values: list[float | None]) -> None:
        """Replay: the r each next step sets for the step after it (``StepTrace.cost["next"]``), as recorded."""
        self._forced = list(values)

    def skip(self) -> None:
        """A step not measured (a joint prefill's, whose forward also read the prompt): r stays, and a replay's
        recorded values move on to the next step."""
        self._observed += 1

    def observe(self, draft_ms: float, draft_calls: int, step_ms: float, nodes: int = 0) -> dict:
        """Learn from a finished step that verified ``nodes`` tree nodes; returns its record for the trace
        (``StepTrace.cost``): ``r`` (in force during the step), ``level_ms`` and ``rest_ms`` (this step's, None when
        it drafted nothing with the model), ``row_ms`` (the per-row charge) and ``next`` (r for the next step).
        Times in milliseconds."""
        used = self.r
        level = rest = None
        rows_ms = self.row_ms * max(0, int(nodes))
        if draft_calls > 0 and step_ms - rows_ms > draft_ms > 0:
            level, rest = (draft_ms + rows_ms) / draft_calls, step_ms - draft_ms - rows_ms
            if self.level_ms is None:  # the first measurement starts both averages
                self.level_ms, self.rest_ms = level, rest
            else:
                self.level_ms += self.alpha * (level - self.level_ms)
                self.rest_ms += self.alpha * (rest - self.rest_ms)
            self.r = round(min(1.0, self.level_ms / max(self.rest_ms, 1e-9)), 5)  # as recorded: replays match
        if self._forced is not None and self._observed < len(self._forced):
            forced = self._forced[self._observed]
            if forced is not None:
                self.r = float(forced)
        self._observed += 1
        return {"r": used, "level_ms": None if level is None else round(level, 3),
                "rest_ms": None if rest is None else round(rest, 3), "row_ms": self.row_ms, "next": self.r}
