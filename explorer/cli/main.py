"""Command line of the speculative decoding explorer: ``python -m explorer <subcommand> [options]``.

Subcommands: ``generate``, ``greedy-check``, ``audit``, ``verifiers``, ``bench`` and ``lessons`` (here);
``decision collect | train | calibrate | eval | generalise | ablation`` (``cli/decision.py``); ``heads train``
(``cli/heads.py``); the instruments
``probe``, ``acceptance``, ``calibration``, ``timeline`` and ``counterfactual`` (``cli/instruments.py``).

``generate`` decodes one prompt or a prompt file with one method and prints the text and metrics, or with
``--json`` one JSON object a line per prompt. ``greedy-check`` runs transformers' greedy ``generate``, ``ar`` and
every lossless method on a prompt set and reports where and why outputs differ (see ``analysis/equivalence.py``).
``audit`` samples the first tokens many times from one context and tests them against the target's exact law.
``verifiers`` compares the verification rules on the same trees, ``bench`` times every method against transformers'
baselines (docs/bench.md), ``lessons`` lists, records or times the classroom's lessons.

Methods (``--method``; ``engine/methods.py``): ``ar``, ``sd``, ``mcsd``, ``mcsd-improved`` (``generate``'s
default), ``prompt-lookup``, ``token-recycling``, ``hybrid`` and ``layer-skip``.

Every failure is printed as one line on stderr naming the subcommand and what went wrong: exit status 2 for an
error in the input (a prompt, a tree shape, a model pair, a file), 1 for anything else, 130 when interrupted;
``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from ..analysis.audit import audit
from ..analysis.bench import BENCH_METHODS, HF_ASSISTED_BF16, bench, run_facts, samples_at
from ..analysis.equivalence import check_prompt
from ..analysis.prompts import PromptError, encode_prompt, range_spec, select_prompts
from ..analysis.rules import compare_rules
from ..engine.config import VERIFIERS
from ..engine.machine import EngineError
from ..engine.sampling import SamplingConfig
from ..engine.tree import TreeShapeError
from ..heads.online import stream_prompts
from ..lessons.lesson import LESSONS_DIR, load_lesson, shipped_lessons
from ..lessons.player import export_html, export_index, trace_html
from ..lessons.record import record_lessons, time_lessons
from ..models.head_store import has_head
from ..models.loading import ModelPairError
from ..trace.metrics import run_metrics
from ..plugins.loading import load_plugins, plugin_args
from ..trace.records import save_run
from .args import (add_method_args, add_model_args, add_plugin_args, add_prompt_source_args, add_sampling_args,
                   load_pair_from_args,
                   method_config_from_args, prompts_from_args, runs_from_args, temperature_list)
from .decision import add_decision_parser
from .heads import add_heads_parser
from .forensics import add_forensics_parser
from .instruments import add_instrument_parsers


def cmd_generate(args) -> int:
    config = method_config_from_args(args)
    prompts = prompts_from_args(args)
    pair = load_pair_from_args(args)
    if args.save_distilled and not config.online_distill:
        raise ValueError("--save-distilled saves what --online-distill learned: add --online-distill")
    session: dict = {}
    learner = "head" if config.spec.uses_head else "draft adapter"  # what --online-distill teaches
    for n, prompt, trace in runs_from_args(args, pair, prompts, config, session=session):
        m = run_metrics(trace)
        if args.save_trace:
            out = Path(args.save_trace)
            out.mkdir(parents=True, exist_ok=True)
            save_run(trace, out / f"trace_{n:03d}.json")
        if args.html:  # the run as a page that plays in any browser (lessons/player.py)
            out = Path(args.html)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"trace_{n:03d}.html").write_text(trace_html(trace), encoding="utf-8")
        if args.json:
            print(json.dumps({"prompt_id": prompt.id, "method": config.method, "lossy": config.is_lossy,
                              "token_ids": trace.generated_ids, "text": trace.generated_text,
                              "target_calls": m["target_calls"],
                              "tokens_per_target_call": m["tokens_per_target_call"],
                              "acceptance_rate": m["acceptance_rate"],
                              "mcsd_acceptance_rate": m["mcsd_acceptance_rate"], "tokens_per_s": m["tokens_per_s"],
                              "acceptance_length": m["acceptance_length"],
                              "position_acceptance": m["position_acceptance"],
                              "generated_tokens": m["generated_tokens"], "seconds": m["seconds"],
                              **({"distill": session["distiller"].history[-1]} if config.online_distill else {})},
                             ensure_ascii=False), flush=True)
        else:
            print(f"--- prompt {prompt.id} [{config.method}{' LOSSY' if config.is_lossy else ''}]")
            print(trace.generated_text)
            acc = m["acceptance_rate"]
            print(f"--- {m['generated_tokens']} tokens, {m['target_calls']} target calls, "
                  f"{m['tokens_per_target_call']:.2f} tokens/call, acceptance "
                  f"{'n/a' if acc is None else f'{acc:.2f}'}, {m['tokens_per_s']:.2f} tokens/s", flush=True)
        if config.online_distill:
            row = session["distiller"].history[-1]
            first = row.get("first_acceptance")
            print(f"--- {learner} version {row['version']}: first-position acceptance "
                  f"{'n/a' if first is None else f'{first:.2f}'}, {row['rejections']} rejections kept"
                  + (f"; updated (loss {row['loss']:.3f})" if row.get("updated") else ""), flush=True)
    if args.save_distilled and session.get("distiller") is not None:
        print(f"--- the learned {learner}: {session['distiller'].save(args.save_distilled)}")
    return 0


def cmd_greedy_check(args) -> int:
    prompts = prompts_from_args(args)
    pair = load_pair_from_args(args)
    totals: dict[str, dict] = {}
    for prompt in prompts:
        ids = encode_prompt(pair.tokenizer, prompt.text, chat_template=not args.no_chat_template)
        report = check_prompt(pair, ids, args.max_new_tokens)
        row = {"prompt_id": prompt.id, "source": prompt.source}
        for name, r in report["methods"].items():
            t = totals.setdefault(name, {"prompts": 0, "match": 0, "near_tie": 0, "other": 0})
            t["prompts"] += 1
            div = r["divergence"]
            kind = "match" if div is None else ("near_tie" if div.get("near_tie") else "other")
            t[kind] += 1
            row[name] = {"result": kind, "steps": r["steps"], "seconds": round(r["seconds"], 2)}
            if div:
                row[name]["divergence"] = {k: v for k, v in div.items() if k != "reason" or v}
        print(json.dumps(row, ensure_ascii=False), flush=True)
    print(json.dumps({"summary": totals}), flush=True)
    bad = sum(t["other"] for t in totals.values())
    return 1 if bad else 0


def cmd_audit(args) -> int:
    config = method_config_from_args(args)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    pair = load_pair_from_args(args)
    ids = encode_prompt(pair.tokenizer, args.prompt, chat_template=not args.no_chat_template)
    bar = tqdm(total=args.samples, desc=f"audit {config.method}", unit="sample", file=sys.stderr,
               disable=args.json and not sys.stderr.isatty())
    result = audit(pair, config, sampling, ids, args.samples, two_tokens=not args.one_token, alpha=args.alpha,
                   progress=lambda done, total: bar.update(done - bar.n))
    bar.close()
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        print(f"method {config.method}{' (LOSSY)' if config.is_lossy else ''}, verifier {result.verifier}, "
              f"{args.samples} samples, temperature {sampling.temperature}, top-p {sampling.top_p}")
        for name, cmp in (("first token", result.first), ("first two tokens", result.pairs)):
            if cmp is None:
                continue
            verdict = "consistent with the target" if cmp.p_value > args.alpha else "DIFFERS from the target"
            print(f"  {name}: chi2 {cmp.chi2:.1f} (dof {cmp.dof}), p-value {cmp.p_value:.4g}, "
                  f"TV distance {cmp.tv_distance:.4f} -> {verdict}")
            differs = cmp.p_value <= args.alpha
            if differs:
                print("    the tokens whose frequencies differ most:")
            for row in (cmp.most_different(5) if differs else cmp.top(8)):
                label = result.labels.get(row["category"], row["category"])
                print(f"      {label!r:>24}  empirical {row['empirical']:.4f}  exact {row['exact']:.4f}  "
                      f"(count {row['count']})")
        a = result.adaptation
        if a:
            moved = (f"threshold {a['start_threshold']:.3f} -> {a['threshold']:.3f}" if a["mode"] == "threshold"
                     else f"last layer moved {a['weight_shift']:.3f} from the shipped one")
            print(f"  online adaptation ({a['mode']}) learned across the samples from {a['records']} labelled "
                  f"tokens (window): {moved}")
        print("PASS" if result.passed else "FAIL")
    return 0 if result.passed else 1


def cmd_verifiers(args) -> int:
    """Tokens per target call of every lossless verifier on the same tree shape and prompts, per temperature, and
    of RSD-S's beam tree of about the same size (``analysis/rules.py``)."""
    prompts = prompts_from_args(args)
    pair = load_pair_from_args(args)
    encoded = [encode_prompt(pair.tokenizer, p.text, chat_template=not args.no_chat_template) for p in prompts]
    base = method_config_from_args(args)
    for temperature in temperature_list(args.temperatures):
        sampling = SamplingConfig(temperature=temperature, top_p=args.top_p, seed=args.seed)
        for row in compare_rules(pair, base, sampling, encoded, args.max_new_tokens, args.verifiers.split(","),
                                 args.repeats):
            print(json.dumps({"temperature": temperature, **row, "prompts": len(encoded), "repeats": args.repeats}),
                  flush=True)
    return 0


BENCH_METHODS_ARG = ",".join(BENCH_METHODS)


class TraceKeeper:
    """``bench``'s ``keep_trace``: each timed run of our engine saved as ``DIR/<label>/t<T>-<prompt id>-s<seed>.json``
    with its prompt's set, id and kind (what ``forensics --trace DIR/<label>`` groups by)."""

    def __init__(self, folder: str, ids: list[list[int]], prompts):
        self.folder, self.prompts = Path(folder), {tuple(i): p for i, p in zip(ids, prompts)}

    def __call__(self, label: str, sampling, trace) -> None:
        prompt = self.prompts.get(tuple(trace.prompt_ids))
        if prompt is not None:
            trace.prompt_info = prompt.info()
        name = f"t{sampling.temperature:g}-{prompt.id if prompt else 'prompt'}-s{sampling.seed}.json"
        out = self.folder / label.replace("/", "_")
        out.mkdir(parents=True, exist_ok=True)
        save_run(trace, out / name.replace("/", "_"))


def cmd_bench(args) -> int:
    """Benchmark methods against ar and hf-assisted on one prompt set; write JSON, CSV, Markdown and HTML."""
    # here, not at the top: its figures (plotly, networkx: 0.3 s) would slow every command's start
    from ..analysis.report import write_reports

    default_range = "" if args.prompt_file == "kinds" else "0:4"
    spec = range_spec(args.prompt_file, default_range if args.range is None else args.range)
    prompts = select_prompts([spec])
    methods = [m for m in args.methods.split(",") if m]
    temps = temperature_list(args.temperatures)
    pair = load_pair_from_args(args, keep_unquantized=HF_ASSISTED_BF16 in methods)
    if args.methods == BENCH_METHODS_ARG and not has_head(pair):  # the default list: eagle where a head is shipped
        methods = [m for m in methods if m != "eagle"]
    ids = [encode_prompt(pair.tokenizer, p.text, chat_template=not args.no_chat_template) for p in prompts]
    kinds = [p.category or p.source for p in prompts]  # a set of several kinds is summarised per kind too
    runs_per_method = sum(len(ids) * samples_at(t, args.samples) for t in temps)
    bar = tqdm(total=runs_per_method * len(methods), desc="bench", unit="run")

    def progress(msg):
        bar.update(1)
        bar.set_postfix_str(msg)

    result = bench(pair, ids, methods=methods, temperatures=temps, max_new_tokens=args.max_new_tokens,
                   seed=args.seed, warmup=args.warmup, top_p=args.top_p,
                   kv_cache="static" if args.graphs else args.kv_cache, graphs=args.graphs,
                   decision_dir=args.decision_dir, samples=args.samples, chain_levels=args.chain_levels,
                   kinds=kinds if len(set(kinds)) > 1 else None, progress=progress,
                   keep_trace=TraceKeeper(args.save_traces, ids, prompts) if args.save_traces else None)
    bar.close()
    result["meta"] = {
        "prompt_set": spec, "prompts": [p.id for p in prompts], "max_new_tokens": args.max_new_tokens,
        "methods": methods, "temperatures": temps, "top_p": args.top_p, "seed": args.seed, "samples": args.samples,
        "warmup": args.warmup,
        "kv_cache": "static" if args.graphs else args.kv_cache, "graphs": args.graphs,
        "chain_levels": args.chain_levels,
        "decision_dir": args.decision_dir or "shipped", **run_facts(pair)}
    paths = write_reports(result, args.out)
    print(Path(paths["md"]).read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def cmd_lessons(args) -> int:
    if args.action == "list":
        for path in shipped_lessons():
            lesson = load_lesson(path)
            steps = sum(len(r.trace.steps) for r in lesson.runs)
            print(f"{lesson.id}: {lesson.title} ({len(lesson.runs)} run(s), {steps} steps, "
                  f"{len(lesson.phases())} phases; recorded {lesson.recorded.get('date', '?')[:10]} on "
                  f"{lesson.recorded.get('machine', '?')}, {lesson.recorded.get('dtype', '?')}; race timed on "
                  f"{', '.join(lesson.race_lanes()) or 'no machine'})")
        return 0
    only = args.only.split(",") if args.only else None
    if args.action == "export":  # no model: the lesson files hold everything the page draws
        out = Path(args.out if args.out != str(LESSONS_DIR) else "reports/lessons")
        lessons = [load_lesson(path) for path in shipped_lessons()]
        for lesson in lessons:
            if only is None or lesson.id in only:
                written = export_html(lesson, out)
                print(f"{written} ({written.stat().st_size / 1e6:.1f} MB)")
        # the index links every shipped lesson whose page is in the folder (those of an earlier export too)
        print(export_index(lessons, out))
        return 0

    pair = load_pair_from_args(args)
    stream = lambda kind, n: stream_prompts(kind, n, 1)["stream"]  # noqa: E731 - a lesson's learning prompts
    if args.action == "time":
        time_lessons(pair, Path(args.out), only=only, graphs=args.graphs,
                     progress=lambda msg: print(msg, file=sys.stderr), stream=stream)
        return 0
    written = record_lessons(pair, Path(args.out), only=only, progress=lambda msg: print(msg, file=sys.stderr),
                             stream=stream)
    for path in written:  # each lesson file gets its page beside it
        print(export_html(load_lesson(path), Path(args.out)), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # the console script and ``python -m explorer`` are one program; usage lines name the one that was typed
    prog = "spec-explorer" if Path(sys.argv[0]).name == "spec-explorer" else "python -m explorer"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help="on a failure, show the traceback instead of one line (also after the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="decode prompts with one method and report metrics")
    add_prompt_source_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object a line per prompt")
    gen.add_argument("--save-trace", metavar="DIR", help="write each run's step trace as JSON into DIR")
    gen.add_argument("--html", metavar="DIR", help="write each run as one HTML page that plays its steps in any "
                                                   "browser, offline (DIR/trace_NNN.html, about 1.6 MB each)")
    gen.add_argument("--save-distilled", metavar="DIR", help="with --online-distill: write the learned head into DIR "
                     "(loads with --head DIR), or the draft's learned LoRA adapter (loads with --draft-adapter DIR)")
    add_method_args(gen)
    add_sampling_args(gen)
    add_model_args(gen)
    gen.set_defaults(func=cmd_generate)

    chk = sub.add_parser("greedy-check", help="greedy equivalence of every lossless method with ar and HF generate")
    add_prompt_source_args(chk)
    chk.add_argument("--max-new-tokens", type=int, default=64)
    chk.add_argument("--no-chat-template", action="store_true")
    add_model_args(chk)
    chk.set_defaults(func=cmd_greedy_check)

    aud = sub.add_parser("audit", help="sample the first tokens N times and test them against the target's law")
    aud.add_argument("--prompt", default="def fibonacci(n):", help="the context to sample from")
    aud.add_argument("--samples", type=int, default=2000)
    aud.add_argument("--one-token", action="store_true", help="test the first token only")
    aud.add_argument("--alpha", type=float, default=0.001, help="significance level of the chi-square test")
    aud.add_argument("--json", action="store_true")
    add_method_args(aud)
    add_sampling_args(aud)
    add_model_args(aud)
    aud.set_defaults(func=cmd_audit, models="tiny", temperature=1.0, method="mcsd")

    ver = sub.add_parser("verifiers", help="tokens per target call of each verifier on the same trees and prompts")
    add_prompt_source_args(ver)
    ver.add_argument("--verifiers", default=",".join(VERIFIERS))
    ver.add_argument("--temperatures", default="0.7,1.0")
    ver.add_argument("--repeats", type=int, default=1, help="seeds per prompt")
    add_method_args(ver)
    add_sampling_args(ver)
    add_model_args(ver)
    ver.set_defaults(func=cmd_verifiers, method="mcsd", k_config="2,2,2")

    bn = sub.add_parser("bench", help="tokens/s of each method against ar and hf-assisted, same run; reports")
    bn.add_argument("--prompt-file", required=True,
                    help="humaneval, mt-bench, prompt-mix, kinds (two prompts of each of seven kinds) or a JSONL file")
    bn.add_argument("--range", metavar="START:STOP", help="slice of the prompt file (default 0:4; all of kinds)")
    bn.add_argument("--save-traces", metavar="DIR", help="keep each timed run of our engine (DIR/<method>/*.json), "
                                                         "e.g. for forensics --trace DIR/eagle")
    bn.add_argument("--methods", default=BENCH_METHODS_ARG,
                    help="comma-separated; a method may carry settings, e.g. mcsd-improved+adapt=last-layer")
    bn.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    bn.add_argument("--top-p", type=float, default=1.0)
    bn.add_argument("--max-new-tokens", type=int, default=128)
    bn.add_argument("--warmup", type=int, default=1, help="short warm-up runs of every method before timing")
    bn.add_argument("--seed", type=int, default=0)
    bn.add_argument("--samples", type=int, default=1,
                    help="runs of every prompt at each temperature above 0, each with its own seed (greedy: one)")
    bn.add_argument("--no-chat-template", action="store_true")
    bn.add_argument("--out", default="reports/bench", help="folder for bench.json / .csv / .md / .html")
    bn.add_argument("--kv-cache", default="dynamic", choices=["dynamic", "static"],
                    help="our engine's KV cache: dynamic (grows) or static (preallocated, fixed shapes)")
    bn.add_argument("--decision-dir", help="decision-model folder for the learned stop policies (default: shipped)")
    bn.add_argument("--graphs", action="store_true",
                    help="our forwards through CUDA graphs per query-size bucket (implies --kv-cache static)")
    bn.add_argument("--chain-levels", type=int, default=0,
                    help="with --graphs: draft levels of chains run in one graph replay, next tokens chosen on the "
                         "device (0 = one forward per level; a label's +chain=N sets it for that label)")
    add_model_args(bn)
    add_plugin_args(bn)
    bn.set_defaults(func=cmd_bench)

    les = sub.add_parser("lessons", help="the classroom's lessons: list them, record them on a real pair, time "
                                         "their runs on this machine for the race (time), or write each as one "
                                         "HTML page that plays in any browser, with an index page (export)")
    les.add_argument("action", choices=["list", "record", "time", "export"])
    les.add_argument("--only", help="comma-separated lesson ids to record, time or export (default: all)")
    les.add_argument("--graphs", action="store_true",
                     help="time: our forwards through CUDA graphs (a static KV cache), as bench --graphs")
    les.add_argument("--out", default=str(LESSONS_DIR),
                     help="folder for the lesson files (default: assets/lessons; export: reports/lessons, with an "
                          "index.html linking the pages)")
    add_model_args(les)
    les.set_defaults(func=cmd_lessons)

    add_decision_parser(sub)
    add_heads_parser(sub)
    add_instrument_parsers(sub)
    add_forensics_parser(sub)
    return parser


# What a user typed or pointed at was wrong: the message says what, exit status 2. HeadError and TraceError are
# ValueErrors; OSError is a file that cannot be read or written.
INPUT_ERRORS = (PromptError, TreeShapeError, ModelPairError, EngineError, ValueError, OSError)
DEBUG_FLAG = "--debug"


def error_line(command: str, exc: BaseException) -> str:
    """The one line a failed subcommand prints: the input's own message, or for an unexpected failure its type and
    message and where to look further."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror and exc.filename:  # not "[Errno 20] Not a directory: '...'"
        message = f"cannot use {exc.filename}: {exc.strerror}"
    if isinstance(exc, INPUT_ERRORS):
        return f"error: {command}: {message}"
    return (f"error: {command} failed ({type(exc).__name__}): {message}. Run it again with {DEBUG_FLAG} for the "
            "traceback, and report it with that if the cause is not in your input")


def main(argv=None) -> int:
    """Run one subcommand; returns its exit status (``error_line``'s statuses on failure)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv  # accepted before or after the subcommand, as users type it
    specs, no_plugins = plugin_args(argv)
    try:  # before the parser: --method and --verifier take the plugins' names, --help lists them
        load_plugins(specs, use_env=not no_plugins, entry_points=not no_plugins)
    except Exception as exc:  # noqa: BLE001 - a plugin that cannot load: one line, unless --debug
        if debug:
            raise
        print(error_line("plugin", exc), file=sys.stderr)
        return 2 if isinstance(exc, INPUT_ERRORS) else 1
    parser = build_parser()
    args = parser.parse_args([a for a in argv if a != DEBUG_FLAG])
    command = " ".join(str(getattr(args, k)) for k in ("command", "action", "decision_command", "heads_command")
                       if isinstance(getattr(args, k, None), str))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"error: {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, unless --debug
        if debug:
            raise
        print(error_line(command, exc), file=sys.stderr)
        return 2 if isinstance(exc, INPUT_ERRORS) else 1


if __name__ == "__main__":
    sys.exit(main())
