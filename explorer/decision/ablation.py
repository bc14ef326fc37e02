"""The stop-policy ablation: ``ar`` and ``mcsd-improved`` under each stop policy, same prompts, same run.

For every temperature and prompt the methods run back to back (``ar`` first), so machine drift hits them alike;
tokens/s are aggregated as total tokens over total seconds, and the speed-up is over ``ar`` in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..analysis.bench import aggregate, run_engine
from ..engine.config import DEFAULTS, MethodConfig
from ..engine.sampling import SamplingConfig


def _runs(pair, configs: dict[str, MethodConfig], prompts_ids: list[list[int]], temperature: float,
          max_new_tokens: int, seed: int, decision, progress) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in configs}
    for n, ids in enumerate(prompts_ids):
        for name, config in configs.items():
            model = decision.get(config.decision_model) if decision else None
            out[name].append(run_engine(pair, config, ids, max_new_tokens,
                                        SamplingConfig(temperature=temperature, seed=seed + n), model))
            progress(f"T={temperature} prompt {n + 1}/{len(prompts_ids)} {name}")
    return out


def ablation(pair, prompts_ids: list[list[int]], *, policies, temperatures, max_new_tokens: int = 64,
             base: MethodConfig | None = None, thresholds: dict | None = None, decision: dict | None = None,
             seed: int = 0, progress=lambda msg: None) -> list[dict]:
    """Rows ``{"temperature", "method", "stop", "threshold", ...aggregate, "speedup_vs_ar"}`` for ``ar`` and
    ``base`` (default: the ``mcsd-improved`` defaults) under each policy in ``policies``.

    ``decision``: ``{"hidden": DecisionModel, "dist": ...}`` to use instead of the shipped models.
    """
    base = base or DEFAULTS["mcsd-improved"]
    configs = {"ar": DEFAULTS["ar"]}
    for policy in policies:
        changes = {"stop": policy}
        if thresholds and policy in thresholds:
            changes["threshold"] = thresholds[policy]
        configs[policy] = base.with_(**changes)
    if prompts_ids:  # warm-up: first calls pay for kernel selection and allocations
        for config in configs.values():
            run_engine(pair, config, prompts_ids[0], 4, SamplingConfig(),
                       decision.get(config.decision_model) if decision else None)
    rows = []
    for temperature in temperatures:
        runs = _runs(pair, configs, prompts_ids, temperature, max_new_tokens, seed, decision, progress)
        ar = aggregate(runs["ar"])
        for name, config in configs.items():
            agg = aggregate(runs[name])
            rows.append({"temperature": temperature, "method": config.method,
                         "stop": "–" if name == "ar" else config.stop,
                         "threshold": None if name == "ar" else config.threshold,
                         "decision_model": config.decision_model if config.stop in ("decision", "prune", "specdec++")
                         and name != "ar" else None,
                         **agg, "speedup_vs_ar": (agg["tokens_per_s"] / ar["tokens_per_s"]
                                                  if agg["tokens_per_s"] and ar["tokens_per_s"] else None)})
    return rows


def markdown_table(rows: list[dict], title: str = "") -> str:
    header = ("| T | method | stop policy | τ / h | tokens/s | speed-up vs ar | tokens / target call | "
            "acceptance (Lu et al.) | acceptance (MCSD) | draft calls |\n|---|---|---|---|---|---|---|---|---|---|\n")

    def f(x, nd=2):
        return "–" if x is None else f"{x:.{nd}f}"

    body = "".join(
        f"| {r['temperature']:g} | {r['method']} | {r['stop']}"
        f"{' (' + r['decision_model'] + ')' if r.get('decision_model') else ''} | {f(r['threshold'])} | "
        f"{f(r['tokens_per_s'])} | {f(r['speedup_vs_ar'])}x | {f(r['tokens_per_target_call'])} | "
        f"{f(r['acceptance_rate'])} | {f(r['mcsd_acceptance_rate'])} | {r['draft_calls']} |\n" for r in rows)
    return (f"**{title}**\n\n" if title else "") + header + body


def write_report(rows: list[dict], path: str | Path, meta: dict) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1), encoding="utf-8")
