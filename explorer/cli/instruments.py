"""``python -m explorer probe | acceptance | calibration | timeline | counterfactual``: the instruments
on the command line.

``probe``, ``acceptance`` and ``calibration`` take ``generate``'s model, method, sampling and prompt options, or
``--trace`` for saved runs (replayed on the models for the probe, read as they are for the others); ``timeline``
runs prompts; ``counterfactual`` replays one saved run. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

from ..analysis.bench import bench
from ..analysis.prompts import encode_prompt
from ..engine.config import DEFAULTS
from ..engine.factory import build_engine
from ..engine.runtime.timeline import phase_totals, plain_decoding_ms
from ..engine.sampling import SamplingConfig
from ..instruments.acceptance import measure_forward_costs, run_report
from ..instruments.calibration import calibration_report
from ..instruments.counterfactual import counterfactual, parse_edits
from ..instruments.probe import ReferenceDecoder, probe_last_step
from ..instruments.replay import replay_steps
from ..trace.records import load_run
from .args import (add_method_args, add_model_args, add_prompt_or_trace_args, add_sampling_args,
                   decision_model_from_args, load_pair_from_args, method_config_from_args, prompts_from_args)

NEAR_TIE_STEPS = 4.0  # rows whose best two logits are this many rounding steps apart or closer are listed


def _runs_from_args(args, pair):
    """Yield ``(prompt_id, engine, step_ms)`` after each step of each prompt's run (``--prompt`` /
    ``--prompt-file``); ``step_ms``: the wall time of that ``engine.step()``, measured around it."""
    config = method_config_from_args(args)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    decision = decision_model_from_args(args, config)
    for prompt in prompts_from_args(args):
        ids = encode_prompt(pair.tokenizer, prompt.text, chat_template=not args.no_chat_template)
        engine = build_engine(pair, config, sampling, decision_model=decision)
        engine.start(ids, args.max_new_tokens, prompt_text=prompt.text)
        while not engine.finished:
            t0 = time.perf_counter()
            engine.step()
            yield prompt.id, engine, (time.perf_counter() - t0) * 1e3


def _finished_runs(args, pair, label: str) -> list:
    """Every prompt's run to its end: their RunTraces (progress on stderr, ``[label]``)."""
    runs = []
    for prompt_id, engine, _ in _runs_from_args(args, pair):
        if not runs or runs[-1] is not engine.trace:
            runs.append(engine.trace)
        print(f"[{label}] {prompt_id}: step {len(engine.trace.steps)}", file=sys.stderr, flush=True)
    return runs


def _probe_summary(prompt_id, probes: list, method: str) -> dict:
    flips, divergences, near = [], [], []
    for pr in probes:
        rows = {r.node: r for r in pr.rows}
        for f in pr.node_flips:
            row = rows[f.parent]
            flips.append({"step": pr.step + 1, "node": f.node, "text": f.text, "cause": f.cause, "status": f.status,
                          "reference_status": f.reference_status, "parent_row": f.parent,
                          "gap": row.top2_gap, "gap_steps": row.gap_steps, "max_delta_logit": row.max_delta_logit,
                          "top2_reference": row.top2_reference, "top2_tree": row.top2_tree})
        if pr.committed != pr.reference_committed:
            divergences.append({"step": pr.step + 1, "committed": pr.committed,
                                "reference_committed": pr.reference_committed})
        near += [{"step": pr.step + 1, "node": r.node, "text": r.text, "gap_steps": r.gap_steps,
                  "argmax_flip": r.argmax_flip, "max_delta_logit": r.max_delta_logit}
                 for r in pr.rows if r.gap_steps <= NEAR_TIE_STEPS]
    return {"prompt_id": prompt_id, "method": method, "dtype": probes[0].dtype if probes else None,
            "steps_probed": len(probes), "flips": len(flips), "cause_flips": sum(f["cause"] for f in flips),
            "argmax_flips": sum(r.argmax_flip for pr in probes for r in pr.rows),
            "max_delta_logit": max((pr.max_delta_logit for pr in probes), default=0.0),
            "rows_compared": sum(len(pr.rows) for pr in probes),
            "reference_forwards": sum(pr.reference_forwards for pr in probes),
            "lint": sorted({f"step {pr.step + 1}: {p}" for pr in probes for p in pr.lint}),
            "flipped_nodes": flips, "divergences": divergences, "near_ties": near}


def cmd_probe(args) -> int:
    pair = load_pair_from_args(args)
    summaries = []
    if args.trace:
        trace = load_run(args.trace)
        last = (args.step - 1) if args.step else len(trace.steps) - 1
        probes, ref = [], None
        for i, engine in replay_steps(pair, trace, last):
            if args.step and i != last:
                continue
            if ref is None:
                ref = ReferenceDecoder(pair.target, engine.trace.prompt_ids, pair.vocab_size, pair.lock)
            probes.append(probe_last_step(engine, ref))
        summaries.append(_probe_summary(args.trace, probes, trace.settings["method"]["method"]))
    else:
        current, probes, ref = None, [], None
        for prompt_id, engine, _ in _runs_from_args(args, pair):
            if prompt_id != current:
                if current is not None:
                    summaries.append(_probe_summary(current, probes, engine.config.method))
                current, probes = prompt_id, []
                ref = ReferenceDecoder(pair.target, engine.trace.prompt_ids, pair.vocab_size, pair.lock)
            if not args.step or len(engine.trace.steps) == args.step:
                probes.append(probe_last_step(engine, ref))
            print(f"[probe] {prompt_id}: step {len(engine.trace.steps)}", file=sys.stderr, flush=True)
        if current is not None:
            summaries.append(_probe_summary(current, probes, args.method))
    total = {"prompts": len(summaries), "flips": sum(s["flips"] for s in summaries),
             "argmax_flips": sum(s["argmax_flips"] for s in summaries),
             "max_delta_logit": max((s["max_delta_logit"] for s in summaries), default=0.0),
             "divergences": sum(len(s["divergences"]) for s in summaries),
             "lint_problems": sum(len(s["lint"]) for s in summaries), "runs": summaries}
    if args.json:
        print(json.dumps(total, ensure_ascii=False))
    else:
        for s in summaries:
            print(f"--- {s['prompt_id']} ({s['method']}, {s['dtype']}): {s['steps_probed']} steps, "
                  f"{s['rows_compared']} rows, max |delta logit| {s['max_delta_logit']:.4g}, "
                  f"{s['flips']} flipped decisions ({s['cause_flips']} where a flip starts), "
                  f"{s['argmax_flips']} flipped argmaxes")
            for p in s["lint"]:
                print(f"    MASK: {p}")
            for f in s["flipped_nodes"]:
                if not f["cause"]:
                    continue  # it follows from a flip above it
                top = f["top2_reference"]
                print(f"    step {f['step']} node {f['node']} {f['text']!r}: {f['status']} in the tree, "
                      f"{f['reference_status']} on plain decoding; its parent's row (node {f['parent_row']}) has "
                      f"{top[0][1]!r} {top[0][2]:.4f} vs {top[1][1]!r} {top[1][2]:.4f} = "
                      f"{f['gap_steps']:.1f} rounding steps apart (|delta logit| up to {f['max_delta_logit']:.3g})")
            for d in s["divergences"]:
                print(f"    step {d['step']}: commits {d['committed']}, plain decoding would commit "
                      f"{d['reference_committed']}")
        print(f"total: {total['flips']} flips, max |delta logit| {total['max_delta_logit']:.4g}, "
              f"{total['lint_problems']} mask problems")
    return 0


def cmd_acceptance(args) -> int:
    if args.trace:
        runs = [load_run(p) for p in args.trace]
        pair = load_pair_from_args(args) if (args.costs or args.bench) else None
    else:
        pair = load_pair_from_args(args)
        runs = _finished_runs(args, pair, "acceptance")
    if not runs:
        raise ValueError("no runs to analyse")
    costs = None
    if args.costs:
        print("[acceptance] measuring forward costs", file=sys.stderr, flush=True)
        costs = measure_forward_costs(pair, runs[0].prompt_ids + runs[0].generated_ids)
    report = run_report(runs, budget=args.budget, max_depth=args.max_depth, costs=costs, use=args.rates)
    report["method"] = runs[0].settings["method"]
    if args.bench and report.get("optimal_tree"):
        report["bench"] = _bench_trees(args, pair, runs, report, method_config_from_args(args))
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    _print_report(report)
    return 0


def _bench_trees(args, pair, runs, report, config) -> list[dict]:
    """The run's method, ``mcsd`` with the optimal tree (and the fastest one) and ``ar``, back to back on the same
    prompts (``bench.bench``): measured tokens per target call and tokens/s beside the expectations."""
    configs = {"ar": DEFAULTS["ar"], f"{config.method} (as run)": config}
    for name, key in (("mcsd optimal tree", "optimal_tree"), ("mcsd fastest tree", "fastest_tree")):
        if (report.get(key) or {}).get("parents"):  # an empty tree is plain decoding: ar already runs
            configs[name] = DEFAULTS["mcsd"].with_(tree=tuple(report[key]["parents"]))
    temps = [runs[0].settings["sampling"]["temperature"]]
    result = bench(pair, [r.prompt_ids for r in runs], methods=list(configs), configs=configs, temperatures=temps,
                   max_new_tokens=args.max_new_tokens, seed=args.seed, warmup=1, top_p=args.top_p,
                   progress=lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    keep = ("method", "tokens_per_s", "tokens_per_target_call", "speedup_vs_ar", "generated_tokens", "seconds")
    return [{k: row[k] for k in keep} for row in result["summary"]]


def _print_report(r: dict) -> None:
    m = r["method"]
    print(f"method {m['method']}: {r['steps_analysed']} steps")
    exp, real = r["expected_tokens_per_call"], r["realised_tokens_per_call"]
    if exp is not None:
        print(f"tokens per target call: expected {exp:.3f}, realised {real:.3f} ({real / exp:.3f}x)")
    if r["acceptance_length"] is not None:
        print(f"acceptance length (tokens per step's target call, bonus included): {r['acceptance_length']:.3f}")
    print("acceptance per draft position: " + ", ".join(
        f"{p['position']}: {p['rate']:.2f} ({p['accepted']}/{p['drafted']})" for p in r["position_acceptance"]))
    print("slots (depth, rank): realised / expected rate, tests")
    for c in r["slots"]:
        print(f"  ({c['depth']}, {c['rank']}): {c['realised_rate']:.3f} / {c['expected_rate']:.3f}, {c['tested']}")
    if r.get("optimal_tree"):
        u, o = r["used_tree"], r["optimal_tree"]
        print(f"trees used: {u['mean_nodes']:.1f} nodes on average, {u['modelled_tokens_per_call']:.3f} tokens per "
              "call under the measured rates")
        print(f"optimal tree ({o['budget']} nodes, depth <= {o['max_depth']}): {o['summary']}")
        print(f"  parents: {','.join(map(str, o['parents']))}" + (f"  (k_config {o['k_config']})" if o['k_config']
                                                                   else ""))
        if r.get("fastest_tree"):
            f = r["fastest_tree"]
            print(f"fastest tree under the measured costs: {f['summary']}")
            print(f"  parents: {','.join(map(str, f['parents']))}")
        if r.get("goodput_r"):
            g = r["goodput_r"]
            print(f"goodput stop policy, r for this machine: {g['r']:.3f} (a one-row draft forward over a "
                  f"{g['rows']}-row verification; --stop goodput --threshold {g['r']:.2f})")
    else:
        print(r.get("optimal_tree_error", ""))
    for row in r.get("bench", []):
        print(f"bench {row['method']}: {row['tokens_per_s']:.2f} tokens/s, "
              f"{row['tokens_per_target_call'] or 0:.3f} tokens per call, {row['speedup_vs_ar'] or 0:.2f}x ar")


def cmd_counterfactual(args) -> int:
    trace = load_run(args.trace)
    pair = load_pair_from_args(args)
    edit = parse_edits(args.edit or [], pair.tokenizer)
    cf = counterfactual(pair, trace, args.step - 1, edit, continue_tokens=args.continue_tokens)
    if args.json:
        print(json.dumps(cf.to_dict(), ensure_ascii=False))
        return 0
    what = "re-verified as recorded" if edit.empty else "edited: " + json.dumps(cf.edit)
    print(f"step {args.step} {what}")
    print("identical to the recorded step" if cf.identical else "differences:\n  " + "\n  ".join(
        cf.differences or ["none"]))
    print(f"recorded commits {''.join(cf.original.committed_text)!r}, now {''.join(cf.edited.committed_text)!r}")
    if cf.continuation_ids:
        print(f"then: {cf.continuation_text!r}")
    return 0


def cmd_calibration(args) -> int:
    if args.trace:
        runs = [load_run(p) for p in args.trace]
    else:
        runs = _finished_runs(args, load_pair_from_args(args), "calibration")
    report = calibration_report(runs)
    if args.json:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    auc = report["roc"]["auc"]
    print(f"policy {report['policy']} (threshold {report['threshold']}): {report['points']} scored and tested "
          f"nodes, {report['accepted']} accepted; ROC-AUC {'n/a' if auc is None else f'{auc:.3f}'}, Brier "
          f"{report['brier'] if report['brier'] is None else round(report['brier'], 4)}")
    op = report["operating_point"]
    if op and op["tpr"] is not None:
        print(f"operating point at {op['threshold']}: keeps {op['tpr']:.2f} of accepted, {op['fpr']:.2f} of "
              "rejected nodes")
    print("reliability (bin: predicted -> realised, n):")
    for r in report["reliability"]:
        print(f"  [{r['lo']:.1f}, {r['hi']:.1f}): {r['predicted']:.3f} -> {r['realised']:.3f} "
              f"(soft {r['realised_soft']:.3f}), {r['count']}")
    print("threshold: draft levels / drafted / committed tokens")
    for r in report["threshold_costs"]:
        print(f"  {r['threshold']:.2f}: {r['draft_levels']} / {r['drafted']} / {r['tokens']}")
    return 0


def cmd_timeline(args) -> int:
    """Each step's timeline, with the step's wall time measured around ``engine.step()`` from outside."""
    pair = load_pair_from_args(args)
    rows, steps = [], []
    for prompt_id, engine, wall in _runs_from_args(args, pair):
        step = engine.trace.steps[-1]
        parts = sum(seg["ms"] for seg in step.timeline)
        rows.append({"prompt_id": prompt_id, "step": step.index + 1, "wall_ms": wall, "sum_of_parts_ms": parts,
                     "ratio": parts / wall if wall else None, "segments": step.timeline})
        steps.append(step)
    totals = phase_totals(steps)
    plain = plain_decoding_ms(steps)
    summary = {"steps": len(rows), "wall_ms": sum(r["wall_ms"] for r in rows),
               "sum_of_parts_ms": sum(r["sum_of_parts_ms"] for r in rows),
               "worst_ratio": min((r["ratio"] for r in rows if r["ratio"]), default=None), "phase_ms": totals,
               "plain_decoding_ms_estimate": plain}
    if args.json:
        print(json.dumps({**summary, "per_step": rows}, ensure_ascii=False))
        return 0
    for r in rows:
        parts = ", ".join(f"{s['phase']}{'/' + str(s['rows']) if s.get('rows') else ''} {s['ms']:.1f}"
                          for s in r["segments"])
        print(f"{r['prompt_id']} step {r['step']}: wall {r['wall_ms']:.1f} ms, parts {r['sum_of_parts_ms']:.1f} ms "
              f"({r['ratio']:.3f}): {parts}")
    print("phases (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items()))
    if plain is not None:
        print(f"plain decoding estimate {plain:.0f} ms against {summary['sum_of_parts_ms']:.0f} ms of steps")
    return 0


def add_instrument_parsers(sub) -> None:
    def prompt_args(p):
        add_prompt_or_trace_args(p, many=p.prog.endswith(("acceptance", "calibration")))
        p.add_argument("--json", action="store_true", help="print one JSON object")

    pr = sub.add_parser("probe", help="tree forward against plain decoding: logit deltas, flips, mask lint")
    prompt_args(pr)
    pr.add_argument("--step", type=int, help="probe only this step (1-based; default every step)")
    add_method_args(pr)
    add_sampling_args(pr)
    add_model_args(pr)
    pr.set_defaults(func=cmd_probe, max_new_tokens=32)

    ac = sub.add_parser("acceptance", help="expected against realised acceptance, and the optimal tree")
    prompt_args(ac)
    ac.add_argument("--budget", type=int, default=32, help="the optimal tree's node budget")
    ac.add_argument("--max-depth-tree", dest="max_depth", type=int, default=8,
                    help="the optimal tree's depth limit")
    ac.add_argument("--rates", choices=["expected", "realised"], default="expected",
                    help="which per-slot rates feed the tree search (expected: mean slot probability)")
    ac.add_argument("--costs", action="store_true",
                    help="measure draft and target forward costs per width here; adds the fastest tree")
    ac.add_argument("--bench", action="store_true",
                    help="then run the method, mcsd with the optimal (and fastest) tree and ar on the same prompts")
    add_method_args(ac)
    add_sampling_args(ac)
    add_model_args(ac)
    ac.set_defaults(func=cmd_acceptance, method="mcsd")

    ca = sub.add_parser("calibration", help="stop-signal calibration: reliability, ROC, cost of each threshold")
    prompt_args(ca)
    add_method_args(ca)
    add_sampling_args(ca)
    add_model_args(ca)
    ca.set_defaults(func=cmd_calibration, max_new_tokens=64)

    tl = sub.add_parser("timeline", help="each step's timeline against its wall time measured from outside")
    src = tl.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="JSONL file, or mt-bench / humaneval")
    tl.add_argument("--limit", type=int, default=0)
    tl.add_argument("--json", action="store_true")
    add_method_args(tl)
    add_sampling_args(tl)
    add_model_args(tl)
    tl.set_defaults(func=cmd_timeline, max_new_tokens=32)

    cf = sub.add_parser("counterfactual", help="re-verify a recorded step, as recorded or edited; JSON of both")
    cf.add_argument("--trace", required=True, help="a saved trace")
    cf.add_argument("--step", type=int, required=True, help="the step to re-verify (1-based)")
    cf.add_argument("--edit", action="append", metavar="EDIT",
                    help="replace:NODE=TOKEN, add:PARENT=TOKEN (0 = the anchor), remove:NODE, verifier:NAME, "
                         "temperature:T, seed:S; TOKEN an id or quoted text (one token); repeatable")
    cf.add_argument("--continue", dest="continue_tokens", type=int, default=0,
                    help="then decode this many more tokens from the edited step")
    cf.add_argument("--json", action="store_true")
    add_model_args(cf)
    cf.set_defaults(func=cmd_counterfactual)
