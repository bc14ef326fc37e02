"""``python -m explorer decision collect | train | calibrate | eval | generalise | ablation``: the decision
models' pipeline on the command line (``explorer/decision/``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..analysis.bench import run_facts
from ..analysis.prompts import encode_prompt, range_spec, select_prompts
from ..decision.calibrate import calibrate
from ..decision.collect import collect
from ..decision.evaluate import evaluate
from ..decision.train import train_models
from ..engine.config import DEFAULTS
from ..engine.policies.stopping import DECISION_MODELS
from ..engine.stop_models.model import KINDS, load_decision_model
from .args import add_model_args, load_pair_from_args, temperature_list


def cmd_collect(args) -> int:
    prompts = select_prompts(args.prompts)
    pair = load_pair_from_args(args)
    out = Path(args.out)
    temps = tuple(temperature_list(args.temperatures))
    summary = collect(pair, prompts, out, max_new_tokens=args.max_new_tokens, temperatures=temps, seed=args.seed,
                      chat_template=not args.no_chat_template, progress=not args.quiet)
    print(json.dumps({"out": str(out), **summary}))
    return 0


def cmd_train(args) -> int:
    layers = {}
    if args.hidden_layers:
        layers["hidden"] = tuple(int(x) for x in args.hidden_layers.split(","))
    if args.dist_layers:
        layers["dist"] = tuple(int(x) for x in args.dist_layers.split(","))
    card = train_models(args.data, args.out, val_fraction=args.val_fraction, seed=args.seed, epochs=args.epochs,
                        patience=args.patience, layers=layers, progress=not args.quiet,
                        exclude_kinds=[k for k in (args.exclude_kinds or "").split(",") if k])
    print(json.dumps({k: {m: card["models"][k][m] for m in ("val_loss", "roc_auc", "roc_auc_greedy", "threshold")}
                      for k in card["models"]}, indent=1))
    return 0


def cmd_calibrate(args) -> int:
    pair = load_pair_from_args(args)

    def say(message: str, fraction: float) -> None:
        if not args.quiet:
            print(f"[calibrate {fraction:4.0%}] {message}", file=sys.stderr, flush=True)

    card = calibrate(pair, prompts=args.prompts, max_new_tokens=args.max_new_tokens, seed=args.seed, on_progress=say)
    print(json.dumps({"folder": card["folder"], "pair": card["pair"], "records": card["data"]["records"],
                      "models": {k: {m: card["models"][k][m] for m in ("roc_auc", "threshold")}
                                 for k in card["models"]}}, indent=1))
    return 0


def cmd_eval(args) -> int:
    report = evaluate(args, load_pair=lambda: load_pair_from_args(args))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for kind, r in report["models"].items():
            greedy = "-" if r["roc_auc_greedy"] is None else f"{r['roc_auc_greedy']:.3f}"
            print(f"{kind:7s} ROC-AUC {r['roc_auc']:.3f} (greedy label {greedy})  "
                  f"threshold {r['threshold']:.2f}: precision {r['precision']:.3f} recall {r['recall']:.3f}  "
                  f"ECE {r['ece']:.3f}  ({r['records']} tokens, {report['prompts']} prompts)")
        if len(report["by_kind"]) > 1:
            print("ROC-AUC (soft labels) per prompt kind:")
            for pk, row in report["by_kind"].items():
                print(f"  {pk:14s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "records")
                      + f"  ({row['records']} tokens)")
    return 0


def cmd_generalise(args) -> int:
    # here, not at the top: decision.ablation has a markdown_table too
    from ..decision.generalise import leave_one_kind_out, markdown_table

    held = [k for k in (args.held_out or "").split(",") if k]
    models = [m for m in args.models.split(",") if m]
    report = leave_one_kind_out(args.data, held_out=held or None, models=models, seed=args.seed,
                                progress=lambda msg: print(f"[generalise] {msg}", file=sys.stderr, flush=True))
    print(markdown_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


def cmd_ablation(args) -> int:
    # here, not at the top: decision.generalise has a markdown_table too
    from ..decision.ablation import ablation, markdown_table, write_report

    spec = range_spec(args.prompt_file, args.range)
    prompts = select_prompts([spec])
    policies = [p for p in args.policies.split(",") if p]
    thresholds = {}
    for item in filter(None, args.thresholds.split(",")):
        name, _, value = item.partition("=")
        thresholds[name] = float(value)
    pair = load_pair_from_args(args)
    decision = None
    if args.decision_dir:
        decision = {k: load_decision_model(args.decision_dir, k) for k in KINDS}
    ids = [encode_prompt(pair.tokenizer, p.text, chat_template=not args.no_chat_template) for p in prompts]
    temps = temperature_list(args.temperatures)
    base = DEFAULTS["mcsd-improved"]
    if args.decision_model:
        base = base.with_(decision_model=args.decision_model)
    rows = ablation(pair, ids, policies=policies, temperatures=temps, max_new_tokens=args.max_new_tokens, base=base,
                    thresholds=thresholds, decision=decision, seed=args.seed,
                    progress=lambda msg: print(f"[ablation] {msg}", file=sys.stderr, flush=True))
    for r in rows:
        r["prompt_set"] = spec
    print(markdown_table(rows, f"{spec}, {args.max_new_tokens} new tokens, {pair.name}, "
                               f"{str(pair.dtype).removeprefix('torch.')} on {pair.device}"))
    if args.json:
        write_report(rows, args.json, {"prompt_set": spec, "prompts": [p.id for p in prompts],
                                       "max_new_tokens": args.max_new_tokens, **run_facts(pair),
                                       "decision_dir": args.decision_dir or "shipped"})
    return 0


def add_decision_parser(sub) -> None:
    dec = sub.add_parser("decision", help="collect data for, train and evaluate the early-stop decision models")
    dsub = dec.add_subparsers(dest="decision_command", required=True)

    col = dsub.add_parser("collect", help="record draft features and acceptance labels of wide, deep draft trees")
    col.add_argument("--prompts", action="append", required=True, metavar="SOURCE[:START:STOP]",
                     help="humaneval, mt-bench or a JSONL file, optionally sliced; repeat for several sets")
    col.add_argument("--out", required=True, help="data folder (created; an existing one is resumed)")
    col.add_argument("--max-new-tokens", type=int, default=40)
    col.add_argument("--temperatures", default="0,1", help="cycled over the prompts (0 = greedy)")
    col.add_argument("--seed", type=int, default=0)
    col.add_argument("--no-chat-template", action="store_true")
    col.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(col)
    col.set_defaults(func=cmd_collect)

    tr = dsub.add_parser("train", help="train the decision models (hidden, dist, path, context) on collected data")
    tr.add_argument("--data", action="append", required=True, help="data folder from collect (repeatable)")
    tr.add_argument("--out", required=True, help="folder for hidden.safetensors, dist.safetensors, card.json")
    tr.add_argument("--val-fraction", type=float, default=0.15, help="share of prompts held out for validation")
    tr.add_argument("--epochs", type=int, default=60)
    tr.add_argument("--patience", type=int, default=5, help="early stopping: epochs without a better val loss")
    tr.add_argument("--hidden-layers", help="hidden sizes of the hidden-state MLP (default 512,256)")
    tr.add_argument("--dist-layers", help="hidden sizes of the distribution MLP (default 64,32)")
    tr.add_argument("--exclude-kinds", help="prompt kinds left out of training, comma-separated (e.g. math)")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--quiet", action="store_true")
    tr.set_defaults(func=cmd_train)

    ca = dsub.add_parser("calibrate", help="collect and train decision models for this pair and keep them in the "
                                           "model cache, where the learned stop policies find them")
    ca.add_argument("--prompts", type=int, default=24, help="prompts of the calibration mix (at least 4)")
    ca.add_argument("--max-new-tokens", type=int, default=32)
    ca.add_argument("--seed", type=int, default=0)
    ca.add_argument("--quiet", action="store_true")
    add_model_args(ca)
    ca.set_defaults(func=cmd_calibrate)

    ev = dsub.add_parser("eval", help="ROC-AUC, precision/recall at the threshold and calibration on new prompts")
    src = ev.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", help="humaneval, mt-bench or a JSONL file (collected on the fly)")
    src.add_argument("--data", action="append", help="evaluate on already collected data folders instead")
    ev.add_argument("--range", default="", metavar="START:STOP", help="slice of the prompt file")
    ev.add_argument("--model", help="decision-model folder (default: the one shipped or calibrated for the pair)")
    ev.add_argument("--keep-data", help="keep the collected features in this folder (default: a temp folder)")
    ev.add_argument("--max-new-tokens", type=int, default=40)
    ev.add_argument("--temperatures", default="0,1")
    ev.add_argument("--no-chat-template", action="store_true")
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--quiet", action="store_true")
    add_model_args(ev)
    ev.set_defaults(func=cmd_eval)

    ge = dsub.add_parser("generalise", help="leave one prompt kind out: train without it, ROC-AUC on it, per model")
    ge.add_argument("--data", action="append", required=True, help="data folder from collect (repeatable)")
    ge.add_argument("--held-out", help="kinds to hold out, comma-separated (default: every kind in the data)")
    ge.add_argument("--models", default=",".join(KINDS), help="model kinds to train")
    ge.add_argument("--seed", type=int, default=0)
    ge.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ge.set_defaults(func=cmd_generalise)

    ab = dsub.add_parser("ablation", help="tokens/s and tokens per target call of each stop policy against ar")
    ab.add_argument("--prompt-file", required=True, help="humaneval, mt-bench or a JSONL file")
    ab.add_argument("--range", default="0:3", metavar="START:STOP", help="slice of the prompt file")
    ab.add_argument("--policies", default="none,confidence,decision,prune,specdec++")
    ab.add_argument("--thresholds", default="", help="per-policy thresholds, e.g. decision=0.4,specdec++=0.5")
    ab.add_argument("--decision-dir", help="decision-model folder (default: the shipped one)")
    ab.add_argument("--decision-model", choices=DECISION_MODELS, help="model the learned policies read")
    ab.add_argument("--temperatures", default="0,0.7")
    ab.add_argument("--max-new-tokens", type=int, default=64)
    ab.add_argument("--seed", type=int, default=0)
    ab.add_argument("--no-chat-template", action="store_true")
    ab.add_argument("--json", metavar="FILE", help="also write the rows and run facts as JSON")
    add_model_args(ab)
    ab.set_defaults(func=cmd_ablation)
