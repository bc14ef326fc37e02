"""What a forward costs on this machine, by query width, and whether a verification's extra rows are dear here.

Speculative decoding buys tokens with target rows: a step verifies a tree of k rows where plain decoding feeds one.
How much the extra rows cost is a fact of the machine, not of the method (docs/bench.md):

* AVX-512-BF16 CPU, bf16 target: a 16-row forward costs 1.07x a one-row forward (the weights' memory traffic
  dominates; rows ride along);
* AVX2 CPU without bf16 kernels, fp32 target: 2.8-3.3x (the matrix multiplies are compute-bound on two cores), so
  a verification must earn about three tokens before it beats a plain step;
* GPU: about 1.2x, with the launch overhead bound in (docs/bench.md, "Machines").

``measure_forward_costs`` times forwards at several widths (the instruments' cost model). ``verification_cost``
times one-row and ``DEAR_ROWS``-row target forwards once per loaded pair (cached on it) so that the engine can
decide, without a hand-set switch, whether plain-decoding fallback (``engine/policies/fallback.py``) is worth having
on this CPU, and so that the goodput stop policy's measured cost ratio charges each draft level its verification rows
(``row_ms``, ``engine/policies/cost_ratio.py``).
"""

from __future__ import annotations

import statistics
import time

import torch

from .graphs import eager_forward
from .kv_cache import DynamicKVCache

COST_WIDTHS = (1, 2, 4, 8, 16, 32, 33, 64)
# 32 and 33 both: on the CPU the bf16 GEMMs work in 32-row blocks and the 33rd row costs about as much as rows 2-32
# together (config.FREE_ROWS_CPU); the cost curve interpolates linearly, so without 33 it would not see the edge.

DEAR_ROWS = 16
"""Query rows of the verification ``verification_cost`` times against one row (a typical tree of the defaults)."""
DEAR_RATIO = 1.7
"""Rows are dear when a ``DEAR_ROWS``-row target forward costs at least this many one-row forwards ... (measured:
2.7-3.0x with stock float32 weights on a 2-core AVX2 CPU, 1.8-2.0x there with packed ones
(``models/packed_weights.py``), 1.1-1.6x on a 2-core AVX-512-BF16 CPU, whose one-row bf16 forward is the noisy one:
195-370 ms against 180-240 ms for two rows. At 1.5 that CPU's least-of-three timing crossed the bound in some
processes and not in others (22-71 % plain steps where speculation paid; medians of interleaved rounds measured
1.29-1.61 in three processes, 2026-11-27); at 2.5 the AVX2 CPU with packed weights had no fallback, and a method
whose tree that CPU's rows do not pay for ran below plain decoding: ``mcsd`` 0.82x ``ar`` on translation,
docs/bench.md, "Every kind of prompt")."""
DEAR_EXTRA_MS = 20.0
"""... and at least this many milliseconds more than one (below that, timing noise and tiny test models)."""


def measure_forward_costs(pair, context: list[int], widths=COST_WIDTHS, repeats: int = 5,
                          roles=("draft", "target"), fastest: bool = False) -> dict:
    """Median (``fastest``: least) wall milliseconds of one forward of ``w`` query rows (a chain under the causal
    mask) after ``context`` tokens, per role and width: ``{"draft": {w: ms}, "target": {w: ms}}``. The widths are
    timed in turn, ``repeats`` rounds after one that warms their kernels up, so a slow spell of the machine lands on
    every width alike. The caches are this function's own; the pair's lock is held around each forward. Raises
    ValueError for an empty context."""
    if not context:
        raise ValueError("measuring forward costs needs a non-empty context")
    out: dict = {}
    for role in roles:
        model = pair.target if role == "target" else pair.draft
        device = pair.device if role == "target" else pair.draft_at
        kv = DynamicKVCache()
        with torch.inference_mode(), pair.lock:
            eager_forward(model, kv, list(context), list(range(len(context))), None, keep=1)
        base = kv.length
        times: dict[int, list[float]] = {w: [] for w in widths}
        for round_ in range(repeats + 1):
            for w in widths:
                ids = [int(context[i % len(context)]) for i in range(w)]
                with torch.inference_mode(), pair.lock:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    eager_forward(model, kv, ids, list(range(base, base + w)), None, keep=w)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if round_:
                        times[w].append((time.perf_counter() - t0) * 1e3)
                kv.rewind(base)
        out[role] = {w: (min if fastest else statistics.median)(t) for w, t in times.items()}
    return out


PRICED_ROW_MS = 5.0
"""Rows are priced (``row_prices``) when each extra one costs at least this many ms; below, a row is within timing
noise (tiny test pairs: 0.02 ms; an AVX-512-BF16 CPU: about 1 ms) and a tree keeps its whole template."""


VERIFICATION_ROUNDS = 5
"""Rounds of ``verification_cost``: each times a one-row, a two-row and a ``DEAR_ROWS``-row forward in turn."""


def verification_cost(pair) -> dict:
    """The target's ``DEAR_ROWS``-row and two-row forwards against its one-row forward on this machine, measured
    once per pair (after a short synthetic context; about 6 s for the embedded pair on a 2-core AVX-512-BF16 CPU,
    more on a 2-core AVX2 one in fp32) and cached in ``pair.measured``: ``{"rows", "one_row_ms", "two_rows_ms",
    "rows_ms", "ratio", "dear"}`` (ms; ``dear`` per ``DEAR_RATIO`` and ``DEAR_EXTRA_MS``).

    Each width's figure is the median of ``VERIFICATION_ROUNDS`` rounds that time the three widths in turn
    (``measure_forward_costs``), so that a decision made once per process comes out the same from one process to the
    next (the least of three per width, timed width after width, did not on an AVX-512-BF16 CPU)."""
    if "verification_cost" not in pair.measured:
        context = [(100 + i) % pair.vocab_size for i in range(8)]
        ms = measure_forward_costs(pair, context, widths=(1, 2, DEAR_ROWS), repeats=VERIFICATION_ROUNDS,
                                   roles=("target",))["target"]
        one, rows = ms[1], ms[DEAR_ROWS]
        ratio = rows / max(one, 1e-9)
        pair.measured["verification_cost"] = {
            "rows": DEAR_ROWS, "one_row_ms": round(one, 3), "two_rows_ms": round(ms[2], 3), "rows_ms": round(rows, 3),
            "ratio": round(ratio, 3), "dear": bool(ratio >= DEAR_RATIO and rows - one >= DEAR_EXTRA_MS)}
    return pair.measured["verification_cost"]


def tree_costs(pair) -> dict:
    """What the online tree choice (``policies/tree_choice.py``) prices a step with: ``{"draft": {rows: ms},
    "target": {rows: ms}}``, the draft's 1-, 2- and 4-row forwards (the least of three after a short synthetic
    context) and the target's 1-, 2- and ``DEAR_ROWS``-row ones (``verification_cost``), measured once per pair and
    cached in ``pair.measured`` (eager forwards: under CUDA graphs both models are cheaper by about the same factor)."""
    if "tree_costs" not in pair.measured:
        context = [(100 + i) % pair.vocab_size for i in range(8)]
        draft = measure_forward_costs(pair, context, widths=(1, 2, 4), repeats=3, roles=("draft",),
                                      fastest=True)["draft"]
        pair.measured["tree_costs"] = {"draft": {w: round(ms, 3) for w, ms in draft.items()},
                                       **head_tree_costs(pair)}
    return pair.measured["tree_costs"]


def head_tree_costs(pair) -> dict:
    """What the EAGLE head's online tree size (``policies/head_tree.py``) prices a step's verification with:
    ``{"target": {rows: ms}}``, the target's 1-, 2- and ``DEAR_ROWS``-row forwards (``verification_cost``; no draft
    model is timed: a head drafts without one)."""
    cost = verification_cost(pair)
    return {"target": {1: cost["one_row_ms"], 2: cost["two_rows_ms"], cost["rows"]: cost["rows_ms"]}}


def row_prices(pair) -> dict | None:
    """What a verification's rows cost on this machine, for pricing free rows (``drafters/row_pricing.py``):
    ``{"one_row_ms", "jump_ms", "row_ms"}``, a tree of n >= 1 nodes costing ``one_row_ms + jump_ms + n * row_ms``
    (``verification_cost``: ``row_ms`` from the two- and ``DEAR_ROWS``-row forwards; ``jump_ms`` what a second
    row costs beyond that, where the BLAS switches kernels: 0.9 plain steps with stock float32 weights on a 2-core
    AVX2 CPU, 0.05 with packed ones). None where a row costs less than ``PRICED_ROW_MS``."""
    cost = verification_cost(pair)
    one = cost["one_row_ms"]
    two = cost.get("two_rows_ms", one + (cost["rows_ms"] - one) / (cost["rows"] - 1))
    per_row = max(0.0, (cost["rows_ms"] - two) / (cost["rows"] - 2))
    if per_row < PRICED_ROW_MS:
        return None
    return {"one_row_ms": one, "jump_ms": round(max(0.0, two - one - per_row), 3), "row_ms": round(per_row, 3)}


def row_ms(pair) -> float:
    """The target forward's marginal milliseconds per query row on this machine (``verification_cost``: the
    ``DEAR_ROWS``-row forward less the one-row forward, over the extra rows; >= 0)."""
    cost = verification_cost(pair)
    return max(0.0, (cost["rows_ms"] - cost["one_row_ms"]) / (cost["rows"] - 1))


def rows_are_dear(pair) -> bool:
    """Whether a verification's extra rows cost this machine so much that speculation can lose to plain
    decoding on prompts that accept little (``verification_cost``)."""
    return verification_cost(pair)["dear"]
