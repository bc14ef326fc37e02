"""Expected against realised acceptance over runs, and the optimal tree for the measured rates.

From step traces alone (``engine/verify/expectation.py`` recorded every node's odds during the run):

* ``slot_table``: per (draft depth, sibling rank in test order), the nodes tested there, how many were accepted
  (the realised rate) and the mean ``slot_prob`` (the expected rate: the same quantity with less noise);
* ``expected_vs_realised``: per step the tokens it was expected to commit given its tree (``expected_tokens``)
  beside what it committed, and the totals per target call;
* ``acceptance_vector``: the table as Sequoia's acceptance probabilities ``acc[depth - 1][rank]``, which
  ``optimal_tree.optimal_tree`` / ``fastest_tree`` turn into the best tree for a node budget.

``forward_costs.measure_forward_costs`` (re-exported here) times one draft and one target forward at several query
widths on this machine (the cost model of ``optimal_tree.step_cost_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.runtime.forward_costs import COST_WIDTHS, measure_forward_costs  # noqa: F401  (re-exported)
from ..trace.metrics import acceptance_length, position_acceptance
from ..trace.records import ACCEPTED, DRAFT_SOURCES, REJECTED, RunTrace, StepTrace
from . import optimal_tree as ot

MIN_TESTS = 5  # tested nodes a (depth, rank) cell needs before its rate is used for the optimal tree


@dataclass
class Cell:
    """One (depth, rank) slot over the runs: ``tested`` nodes had a test there, ``accepted`` passed it,
    ``expected`` is the sum of their ``slot_prob``."""

    depth: int
    rank: int
    tested: int = 0
    accepted: int = 0
    expected: float = 0.0

    @property
    def realised_rate(self) -> float | None:
        return self.accepted / self.tested if self.tested else None

    @property
    def expected_rate(self) -> float | None:
        return self.expected / self.tested if self.tested else None

    def to_dict(self) -> dict:
        return {"depth": self.depth, "rank": self.rank, "tested": self.tested, "accepted": self.accepted,
                "realised_rate": self.realised_rate, "expected_rate": self.expected_rate}


def _steps(runs) -> list[StepTrace]:
    return [s for run in runs for s in (run.steps if isinstance(run, RunTrace) else [run])]


def slot_table(runs) -> dict[tuple[int, int], Cell]:
    """Cells keyed by (depth, rank) over the tested proposed nodes of ``runs`` (RunTraces or StepTraces).
    Nodes from traces recorded before odds were kept are skipped."""
    cells: dict[tuple[int, int], Cell] = {}
    for s in _steps(runs):
        for n in s.nodes:
            if n.source not in DRAFT_SOURCES or n.status not in (ACCEPTED, REJECTED) or n.test_order is None:
                continue
            c = cells.setdefault((n.depth, n.test_order), Cell(n.depth, n.test_order))
            c.tested += 1
            c.accepted += n.status == ACCEPTED
            c.expected += n.slot_prob or 0.0
    return dict(sorted(cells.items()))


def acceptance_vector(cells: dict[tuple[int, int], Cell], use: str = "expected",
                      min_tests: int = MIN_TESTS) -> list[list[float]]:
    """``acc[depth - 1][rank]`` for ``optimal_tree``: the expected (or ``use="realised"``) rate of each cell with
    at least ``min_tests`` tests; a sparser cell takes its rank's rate pooled over all depths, and a rank never
    tested that often gets 0 (the search cannot credit a slot nobody measured). Raises ValueError when no cell has
    enough tests."""
    if use not in ("expected", "realised"):
        raise ValueError(f"use must be 'expected' or 'realised', got {use!r}")
    pooled: dict[int, Cell] = {}
    for (_depth, r), c in cells.items():
        p = pooled.setdefault(r, Cell(0, r))
        p.tested += c.tested
        p.accepted += c.accepted
        p.expected += c.expected

    def rate(c: Cell) -> float:
        return c.expected_rate if use == "expected" else c.realised_rate

    ranks = [r for r, c in sorted(pooled.items()) if c.tested >= min_tests]
    if not ranks:
        raise ValueError(f"too few tested nodes to estimate acceptance rates (each slot needs {min_tests}); "
                         "generate more tokens or use more prompts")
    depth = max(d for (d, _r), c in cells.items() if c.tested >= min_tests) if cells else 1
    table = []
    for d in range(1, depth + 1):
        row = []
        for r in range(max(ranks) + 1):
            c = cells.get((d, r))
            if c is not None and c.tested >= min_tests:
                row.append(min(1.0, max(0.0, rate(c))))
            elif r in ranks:
                row.append(min(1.0, max(0.0, rate(pooled[r]))))
            else:
                row.append(0.0)
        table.append(row)
    return table


def expected_vs_realised(runs) -> dict:
    """Expected (given each step's tree, over the verifier's draws) against realised tokens per target call.

    Steps that ended the run are left out (EOS or the length limit cut what they committed), as are steps from
    traces without ``expected_tokens``. Returns ``{"steps": [{"step", "expected", "realised"}], "target_calls",
    "expected_tokens_per_call", "realised_tokens_per_call"}`` (the last two None without steps).
    """
    rows, calls, expected, realised = [], 0, 0.0, 0
    for s in _steps(runs):
        if s.finished or s.expected_tokens is None or not s.target_calls:
            continue
        rows.append({"step": s.index, "expected": s.expected_tokens, "realised": len(s.committed_ids)})
        calls += s.target_calls
        expected += s.expected_tokens
        realised += len(s.committed_ids)
    return {"steps": rows, "target_calls": calls,
            "expected_tokens_per_call": expected / calls if calls else None,
            "realised_tokens_per_call": realised / calls if calls else None}


def model_tree_parents(step: StepTrace) -> list[int]:
    """The breadth-first parents (-1 = the anchor) of a step's proposed nodes, in the optimal-tree convention."""
    ids = [n.id for n in step.nodes[1:] if n.source in DRAFT_SOURCES]
    index = {node_id: i for i, node_id in enumerate(ids)}
    by_id = {n.id: n for n in step.nodes}
    return [index.get(by_id[i].parent, -1) for i in ids]


def run_report(runs, budget: int = 32, max_depth: int = 8, costs: dict | None = None, use: str = "expected") -> dict:
    """Everything the ``acceptance`` command prints, as plain data.

    Args:
        runs: RunTraces (one method, one pair).
        budget, max_depth: the optimal tree's node budget and depth limit.
        costs: ``{"draft": {rows: ms}, "target": {rows: ms}}`` from ``measure_forward_costs``; with it the report
            also has the fastest tree (tokens/s under this cost model) and every tree's modelled speed.
        use: which rates feed the tree search (``acceptance_vector``).
    Returns a dict with ``expected_tokens_per_call``, ``realised_tokens_per_call``, ``acceptance_length``,
    ``position_acceptance``, ``slots`` (cells), ``acceptance_vector``, ``used_tree`` (the model's expectation of the
    trees the run used), ``optimal_tree`` and, with costs, ``fastest_tree``, ``forward_costs_ms`` and ``goodput_r``
    (``{"rows", "r"}``: a one-row draft forward over a target forward of the run's mean tree, the ``goodput`` stop
    policy's setting for this machine).
    """
    steps = _steps(runs)
    cells = slot_table(steps)
    out = {**expected_vs_realised(steps), "acceptance_length": acceptance_length(steps),
           "position_acceptance": position_acceptance(steps), "slots": [c.to_dict() for c in cells.values()],
           "steps_analysed": len(steps)}
    out.pop("steps")
    out["per_step"] = expected_vs_realised(steps)["steps"]
    try:
        acc = acceptance_vector(cells, use=use)
    except ValueError as exc:
        out["acceptance_vector"] = None
        out["optimal_tree_error"] = str(exc)
        return out
    out["acceptance_vector"] = acc
    used = [model_tree_parents(s) for s in steps if not s.finished]
    used_expectations = [ot.expected_tokens(p, acc) for p in used]
    out["used_tree"] = {"steps": len(used), "mean_nodes": sum(map(len, used)) / len(used) if used else None,
                        "modelled_tokens_per_call": (sum(used_expectations) / len(used_expectations)
                                                     if used_expectations else None)}
    best = ot.optimal_tree(acc, budget, max_depth)
    out["optimal_tree"] = {**best.to_dict(), "budget": budget, "max_depth": max_depth,
                           "k_config": ot.as_k_config(best.parents), "summary": ot.summary(best)}
    if costs:
        draft, target = ot.cost_curve(costs["draft"]), ot.cost_curve(costs["target"])
        fast = ot.fastest_tree(acc, budget, max_depth, draft, target)
        out["fastest_tree"] = {**fast.to_dict(), "k_config": ot.as_k_config(fast.parents),
                               "summary": ot.summary(fast)}
        out["optimal_tree"]["cost_ms"] = ot.step_cost_ms(best.parents, draft, target)
        out["optimal_tree"]["tokens_per_s"] = 1e3 * best.expected_tokens / out["optimal_tree"]["cost_ms"]
        if used:
            cost = sum(ot.step_cost_ms(p, draft, target) for p in used) / len(used)
            out["used_tree"]["cost_ms"] = cost
            out["used_tree"]["modelled_tokens_per_s"] = 1e3 * out["used_tree"]["modelled_tokens_per_call"] / cost
            # the goodput stop policy's setting for this machine: a one-row draft forward over a verification of
            # the run's mean tree (its nodes plus the anchor row), within the setting's range [0, 1]
            rows = max(1, round(out["used_tree"]["mean_nodes"]) + 1)
            out["goodput_r"] = {"rows": rows, "r": min(1.0, draft(1) / max(target(rows), 1e-9))}
        out["forward_costs_ms"] = costs
    return out
