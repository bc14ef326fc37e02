"""Falling back to plain decoding when speculation does not pay on this hardware.

SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using Goodput",
arXiv 2406.14066) speculates only as far as it raises *goodput*: committed tokens per second of execution, measured, not
assumed. At batch size 1 the choice that matters most is binary: speculate this step, or run a plain decoding step
(an empty draft tree, one target row). On a GPU a small pair is bound by kernel launches (docs/bench.md,
"Machines"): a draft forward costs nearly what a target forward does, so on prompts where little is accepted (MT-bench)
every speculative method ran at 0.5-0.95x of plain decoding in docs/bench.md.

``GoodputFallback`` keeps, for each mode, exponential moving averages of the tokens a step committed and of the
step's wall milliseconds (the step timeline's total, host work included). It speculates unless speculation's rate
(tokens per millisecond) falls below ``margin`` times plain decoding's, and returns to speculation as soon as it
measures at least plain decoding's rate again (hysteresis: one unlucky step in a good stretch does not switch).
The losing mode is probed now and then so that a change in the text (a code block inside a chat answer) is noticed:
speculation after ``probe_every`` plain steps (doubling after each failed probe, up to ``max_probe_every``), plain
decoding every ``ar_probe_every`` speculative steps. A probe's measurement replaces that mode's stale average (after
at least ``probe_every`` / ``ar_probe_every`` steps of the other mode) instead of blending into it: the first GPU
measurement (docs/bench.md) blended it, and one slow first step kept ``sd`` in plain decoding for 85 % of a
HumanEval run because each later probe moved the average only 30 % of the way and the probes grew rarer. A probe of
speculation lasts ``warmup`` steps and is judged on their mean step: a step of the hybrid commits a long copy or next
to nothing, and one step alone said little.

A run can start from the rates an earlier run of the session measured (``state``, passed back as ``carried``),
as Token Recycling's matrix is carried: the run then skips the warm-up of ``warmup`` speculative steps and starts
in the mode that paid. On the H100 a 128-token MT-bench run made 6-7 speculative steps (the warm-up and the
probes), and those were its whole loss against plain decoding: plain steps cost what ``ar`` steps do
(docs/bench.md, "H100 with CUDA graphs"). The carried rates count as stale: the first measurement of a mode after
``probe_every`` / ``ar_probe_every`` steps of the other replaces them, so a prompt unlike the last one is noticed at
the first probe.

The decision depends only on earlier steps (and earlier runs), never on this step's draws, so the output law is
unchanged (a stop rule that reads the past). It is timing-driven, hence not reproducible across runs; a replay
follows the recorded decisions (``force``).
"""

from __future__ import annotations

from dataclasses import dataclass

FALLBACK_MODES = ("auto", "goodput", "off")  # auto: goodput on CUDA and on CPUs where rows are dear


def fallback_active(mode: str, device_type: str, rows_are_dear=None) -> bool:
    """Whether ``mode`` (``FALLBACK_MODES``) falls back on a device of type ``device_type`` ("cuda", "cpu").

    ``auto`` is on on CUDA, and on a CPU only where ``rows_are_dear()`` (a callable, asked only then:
    ``forward_costs.rows_are_dear`` measures once per pair) says a verification's extra rows cost several plain
    steps. On the AVX-512-BF16 CPUs a 16-row verification costs 1.07-1.6x a plain step and speculation paid in every
    measured cell (docs/bench.md), so there a timing-driven rule would only make runs, tests and classroom demos
    differ from run to run; on a 2-core AVX2 CPU in fp32 it costs 2.8x and the default ``mcsd-improved`` ran
    MT-bench at 0.77x plain decoding, 0.96x with the rule (docs/bench.md, "Plain-decoding fallback (goodput)")."""
    if mode not in FALLBACK_MODES:
        raise ValueError(f"unknown fallback mode {mode!r}; expected one of {', '.join(FALLBACK_MODES)}")
    if asks_row_costs(mode, device_type):
        return rows_are_dear is not None and bool(rows_are_dear())
    return mode != "off"


def asks_row_costs(mode: str, device_type: str) -> bool:
    """Whether ``fallback_active(mode, device_type, ...)`` asks ``rows_are_dear``: ``auto`` off CUDA."""
    return mode == "auto" and device_type != "cuda"


@dataclass
class _Rate:
    """Moving averages of tokens and milliseconds per step for one mode."""

    tokens: float | None = None
    ms: float | None = None
    steps: int = 0

    def add(self, tokens: int, ms: float, alpha: float, fresh: bool = False) -> None:
        """Blend one step in; ``fresh``: the average is stale (a probe after a gap), replace it."""
        if self.tokens is None or fresh:
            self.tokens, self.ms = float(tokens), float(ms)
        else:
            self.tokens += alpha * (tokens - self.tokens)
            self.ms += alpha * (ms - self.ms)
        self.steps += 1

    @property
    def tok_s(self) -> float | None:
        """Committed tokens per second (None before the first step)."""
        return None if self.tokens is None else 1e3 * self.tokens / max(self.ms, 1e-6)


class GoodputFallback:
    """Chooses, before each step, between speculating and a plain decoding step, by measured goodput.

    Args:
        alpha: weight of the newest step in the moving averages.
        margin: fall back only when speculation's rate is below ``margin`` x plain decoding's.
        probe_every: plain steps before speculation is tried again (doubles after each probe that loses, up to
            ``max_probe_every``; back to ``probe_every`` once speculation wins).
        ar_probe_every: speculative steps between plain-decoding probes (plain decoding's rate barely moves).
        replay_only: follow forced decisions only and speculate after them, as an engine without the rule does
            (a replay of a run on a device where the rule is off, continued past the recorded steps).
        warmup: speculative steps measured before plain decoding is first tried, and the length of each probe of
            speculation (judged on its steps together). A run's first step is rarely typical: on HumanEval it
            committed 2 tokens in 735 ms and the next ones 17 in 1.7 s (2-core AVX2 CPU, fp32), and judged on it
            alone the rule ran the next 8 steps plain (docs/bench.md, "Plain-decoding fallback (goodput)"); a
            hybrid's step commits a long copy or next to nothing, and one-step probes kept it plain for 50-96 % of
            the steps of prompts where it ran at 1.1-3.3x plain decoding without the rule (docs/bench.md).
        carried: ``state()`` of an earlier run's fallback (the same method and sampling, on the same pair): its
            rates start this run's averages, and a speculation rate counts as warmed up.

    Raises:
        ValueError: ``carried`` is not a dict of the shape ``state()`` returns.
    """

    def __init__(self, alpha: float = 0.3, margin: float = 0.9, probe_every: int = 8, max_probe_every: int = 64,
                 ar_probe_every: int = 32, replay_only: bool = False, warmup: int = 3, carried: dict | None = None):
        self.replay_only = replay_only
        self.warmup = max(1, int(warmup))
        self.alpha, self.margin = alpha, margin
        self.base_probe, self.max_probe, self.ar_probe_every = probe_every, max_probe_every, ar_probe_every
        self.spec, self.ar = _Rate(), _Rate()
        self.probe_every = probe_every
        self.since_spec = 0  # plain steps since the last speculative one
        self.since_ar = 0  # speculative steps since the last plain one
        self._forced: list[bool] | None = None
        self._last: dict = {}
        self._probe: list | None = None  # [tokens, ms, steps] of a probe of speculation under way
        self.carried = self._carry(carried) if carried else None

    def _carry(self, carried: dict) -> dict:
        """Start the averages from ``carried`` (see ``state``); returns the carried rates in tokens/s."""
        try:
            for name in ("spec", "ar"):
                rate = carried.get(name)
                if rate is not None:
                    tokens, ms = float(rate["tokens"]), float(rate["ms"])
                    if not (tokens >= 0 and ms > 0):
                        raise ValueError(f"{name}: tokens {tokens}, ms {ms}")
                    # a carried speculation rate is a measured one: no warm-up before plain decoding is tried
                    setattr(self, name, _Rate(tokens, ms, self.warmup if name == "spec" else 1))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"carried fallback state is malformed ({exc}); pass GoodputFallback.state()") from None
        return {"spec_tok_s": _rounded(self.spec.tok_s), "ar_tok_s": _rounded(self.ar.tok_s)}

    def state(self) -> dict:
        """The averages this run measured, plain data for the next run's ``carried``: ``{"spec": {"tokens",
        "ms"} or None, "ar": ...}`` (tokens per step, wall ms per step)."""
        return {name: None if rate.tokens is None else {"tokens": rate.tokens, "ms": rate.ms}
                for name, rate in (("spec", self.spec), ("ar", self.ar))}

    def force(self, decisions: list[bool]) -> None:
        """Replay: take these decisions (True = speculate) for the next steps instead of deciding."""
        self._forced = list(decisions)

    def decide(self, step_index: int) -> bool:
        """True to speculate in step ``step_index`` (0-based), False for a plain decoding step."""
        spec, ar = self.spec.tok_s, self.ar.tok_s
        if self._forced is not None and step_index < len(self._forced):
            speculate, reason = self._forced[step_index], "replayed"
        elif self.replay_only:
            self._last = {}
            return True
        elif spec is None or self.spec.steps < self.warmup:
            speculate, reason = True, "measuring speculation"
        elif self._probe is not None:  # a probe of speculation lasts ``warmup`` steps
            speculate, reason = True, "probing speculation"
        elif ar is None:
            speculate, reason = False, "measuring plain decoding"
        elif spec >= (1.0 if self.since_spec else self.margin) * ar:  # hysteresis: leave plain decoding at 1x
            speculate = self.since_ar < self.ar_probe_every
            reason = "speculation pays" if speculate else "probing plain decoding"
        else:
            speculate = self.since_spec >= self.probe_every
            reason = "probing speculation" if speculate else "speculation does not pay"
            if speculate:
                self._probe = [0, 0.0, 0]  # tokens, ms and steps of the probe so far
        self._last = {"speculate": speculate, "reason": reason, "spec_tok_s": _rounded(spec),
                      "ar_tok_s": _rounded(ar)}
        if self.carried and step_index == 0:  # the run's first decision read an earlier run's rates
            self._last["carried"] = True
        return speculate

    def observe(self, speculated: bool, tokens: int, ms: float, one_off: str | None = None) -> dict:
        """Learn from the finished step (``tokens`` committed in ``ms`` wall milliseconds); returns the step's
        record for the trace: the decision, its reason and the rates it compared (tokens/s).

        ``one_off``: what one-time cost the step paid, if any: ``"graph capture"`` (CUDA graphs for a new query
        size: about 100-200 ms against 5 ms for a graphed forward on an H100) or ``"prefill"`` (the prompt read in
        the step's target forward). Its time says nothing about the mode's rate, so it is not measured (the record
        says why): on the H100 one capturing step measured plain decoding at 8.7 tokens/s against about 170, and
        the hybrid then speculated for the whole run."""
        if one_off:
            return {**self._last, "unmeasured": one_off}
        if speculated and self._probe is not None:  # one step of a probe: its steps are judged together
            self._probe = [self._probe[0] + tokens, self._probe[1] + ms, self._probe[2] + 1]
            self.since_ar += 1
            if self._probe[2] < self.warmup:
                return dict(self._last)
            (total, total_ms, n), self._probe = self._probe, None
            # the probe's mean step replaces the stale average (after a stretch of plain steps)
            self.spec.add(total / n, total_ms / n, self.alpha, fresh=self.since_spec >= self.base_probe)
            self.spec.steps += n - 1
            self.since_spec = 0
            lost = self.spec.tok_s < (self.ar.tok_s or 0.0)  # a probe that still loses waits twice as long
            self.probe_every = min(2 * self.probe_every, self.max_probe) if lost else self.base_probe
        elif speculated:
            # stale after a stretch of plain steps (a probe), not after one plain-decoding probe
            self.spec.add(tokens, ms, self.alpha, fresh=self.since_spec >= self.base_probe)
            self.since_spec, self.since_ar = 0, self.since_ar + 1
        else:
            self.ar.add(tokens, ms, self.alpha, fresh=self.since_ar >= self.ar_probe_every)
            self.since_spec, self.since_ar = self.since_spec + 1, 0
        return dict(self._last)


def _rounded(tok_s: float | None) -> float | None:
    return None if tok_s is None else round(tok_s, 2)
