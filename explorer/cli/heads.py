"""``python -m explorer heads train``: an EAGLE-3 head for the loaded pair's target, trained here on texts (the
target's features computed once and cached; ``explorer/heads/``)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import torch

from ..heads.gap import measure, teacher_forced
from ..heads.online import online_stream, stream_prompts_from
from ..engine.parts import EngineError
from ..heads.corpus import clean, pydoc_texts, stdlib_range, stdlib_texts
from ..heads.data import HeadDataError, build, chunk, coverage, load_all, read_text
from ..heads.prompts import training_prompts
from ..heads.respond import prompts_of, records, respond
from ..heads.selfinstruct import WRITE_TOKENS, writing_prompts, written_prompts
from ..heads.train import train_head
from ..models.eagle3 import LAYOUTS, HeadError, default_aux_layers, load_head, read_config, save_head
from ..models.head_store import head_for
from .args import add_model_args, load_pair_from_args

GAP_PROMPTS = Path(__file__).resolve().parents[2] / "assets" / "heads" / "gap" / "prompts.jsonl"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def read_texts(paths: list[str]) -> list[str]:
    """Texts from ``.txt`` files (one text each), ``.jsonl`` files (a ``text`` field per line), either gzipped
    (``.txt.gz``, ``.jsonl.gz``: the response files shipped beside a head's card), ``stdlib`` (the
    Python standard library's modules, ``heads/corpus.py``; ``stdlib:N`` its first N characters, ``stdlib:A-B`` the
    modules ``stdlib:B`` adds to ``stdlib:A``) or ``pydoc`` (its reference topics); any text holding a bench prompt
    is dropped. Raises HeadDataError for a missing or malformed file."""
    texts = []
    for name in paths:
        if name == "pydoc":
            texts.extend(text for _, text in pydoc_texts())
            continue
        if name == "stdlib" or name.startswith("stdlib:"):
            limit = name.partition(":")[2]
            if not re.fullmatch(r"(\d+-)?\d+", limit or "0"):
                raise HeadDataError(f"--texts {name}: write stdlib:N (its first N characters) or stdlib:A-B (the "
                                    "modules stdlib:B adds to stdlib:A)")
            start, _, end = limit.rpartition("-")
            chosen = stdlib_range(int(start), int(end)) if start else stdlib_texts(int(end)) if end else stdlib_texts()
            texts.extend(text for _, text in chosen)
            continue
        path = Path(name)
        try:
            raw = read_text(path)
        except (OSError, EOFError, UnicodeDecodeError) as exc:
            raise HeadDataError(f"cannot read {path}: {exc}") from None
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            for i, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise HeadDataError(f"{path}:{i} is not a JSON object with a \"text\" field") from None
                texts.append(str(text))
        else:
            texts.append(raw)
    kept, dropped = clean([(str(i), t) for i, t in enumerate(texts)])
    if dropped:
        print(f"left out {len(dropped)} texts holding a bench prompt", file=sys.stderr)
    return [t for _, t in kept]


def _features(pair, args) -> Path:
    """Cache the target's features on ``args.texts`` in the first ``--data`` folder (``heads/data.build``)."""
    texts = read_texts(args.texts)
    sequences = chunk([pair.tokenizer.encode(t) for t in texts], args.seq_len)
    n_layers = pair.target.config.num_hidden_layers
    layers = args.layers or default_aux_layers(n_layers)
    if len(layers) != 3 or not all(0 <= i <= n_layers for i in layers):
        raise HeadError(f"--layers takes three target layers from 0 to {n_layers}, got {list(layers)}")
    return build(pair, sequences, layers, args.data[0], progress=not args.quiet)


def cmd_features(args) -> int:
    pair = load_pair_from_args(args)
    try:
        folder = _features(pair, args)
    except (HeadDataError, HeadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    manifest = json.loads((folder / "manifest.json").read_text())
    print(f"{folder}: the target's features on {manifest['sequences']} sequences, {manifest['tokens']} tokens "
          f"(train on it with --data {folder})")
    return 0


def cmd_train(args) -> int:
    pair = load_pair_from_args(args)
    try:
        if args.texts:
            _features(pair, args)
        card = train_head(pair, args.data, args.out, draft_vocab=args.draft_vocab, intermediate=args.intermediate,
                          steps=args.steps, lr=args.lr, ttt=args.ttt, seed=args.seed, device=args.train_device,
                          save_every=args.save_every, save_dtype=DTYPES[args.save_dtype] if args.save_dtype else None,
                          progress=not args.quiet, command="python -m explorer " + shlex.join(sys.argv[1:]),
                          vocab_data_share=args.vocab_data_share, autocast=args.autocast,
                          eval_folders=args.eval_data or [], freeze_lm_head=args.freeze_lm_head, init=args.init,
                          swap_vocab=args.swap_vocab, tie_lm_head=args.tie_lm_head, grow_vocab=args.grow_vocab,
                          grow_mlp=args.grow_mlp, epochs=args.epochs, patience=args.patience,
                          loss_on=args.loss_on)
    except (HeadDataError, HeadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: card[k] for k in ("steps", "seconds", "sequences", "tokens", "draft_vocab", "loss",
                                           "agreement_by_level", "held_out_agreement_by_level", "parameters")},
                     indent=1))
    return 0


def cmd_respond(args) -> int:
    try:
        if args.prompts and args.written:
            raise HeadDataError("--prompts answers an earlier file's prompts and --written has the target write new "
                                "ones: give one of them")
        if args.write_only and not args.written:
            raise HeadDataError("--write-only keeps the prompts the target writes: it needs --written")
        kinds = args.kinds.split(",") if args.kinds else list(WRITE_TOKENS)
        if unknown := [k for k in kinds if k not in WRITE_TOKENS]:
            raise HeadDataError(f"unknown kind {unknown[0]!r}; use some of {', '.join(WRITE_TOKENS)}")
        # the same prompts again, e.g. sampled (--temperature); read first: a bad file is said before the pair loads
        prompts = prompts_of(args.prompts) if args.prompts else None
        pair = load_pair_from_args(args)
        if prompts is None and args.written:  # self-instruct: the target writes prompts first (heads/selfinstruct.py)
            writings = Path(str(args.out) + ".writings.jsonl")
            asks = writing_prompts(args.per_kind, seed=args.seed)
            for kind, limit in WRITE_TOKENS.items():
                if kind in kinds:
                    respond(pair, [a for a in asks if a[0] == kind], writings, max_new_tokens=limit,
                            batch=args.batch, progress=not args.quiet, temperature=args.write_temperature,
                            seed=args.seed)
            prompts = written_prompts(records(writings), seed=args.seed)
            if not prompts:
                raise HeadDataError(f"the target wrote nothing usable as a prompt ({writings}): a chat model "
                                    "writes requests, a random or base model rarely does")
            if args.write_only:
                _write(args.out, "".join(json.dumps({"kind": k, "prompt": p}) + "\n" for k, p in prompts))
                print(f"{args.out}: {len(prompts)} prompts the target wrote (heads online --prompts {args.out})")
                return 0
        elif prompts is None:
            prompts = [(k, p) for k, p in training_prompts(args.per_kind, seed=args.seed) if k in kinds]
        out = respond(pair, prompts, args.out, max_new_tokens=args.max_new_tokens, batch=args.batch,
                      progress=not args.quiet, temperature=args.temperature, seed=args.seed)
    except HeadDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: the target's responses to {len(prompts)} prompts (train on it with --texts {out})")
    return 0


def cmd_online(args) -> int:
    try:
        prompts = prompts_of(args.prompts) if args.prompts else None  # a bad file is said before the pair loads
        if prompts is not None:
            stream_prompts_from(prompts, args.kind, args.requests, args.held_out, args.seed)
        pair = load_pair_from_args(args)
        report = online_stream(pair, args.kind, requests=args.requests, held_out=args.held_out, lr=args.lr,
                               every=args.every, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               head=args.head or "", seed=args.seed, method=args.method, prompts=prompts,
                               replay=args.replay, save=args.save or "",
                               progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (EngineError, HeadError, HeadDataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        _write(args.out, json.dumps(report, indent=1))
    for kind in report["before"]:
        b, a = report["before"][kind], report["after"][kind]
        print(f"{kind:12s} first-position acceptance {b['first_acceptance']['rate']:.3f} -> "
              f"{a['first_acceptance']['rate']:.3f}, tokens/call {b['tokens_per_call']:.2f} -> "
              f"{a['tokens_per_call']:.2f}")
    for kind, c in (report["paired_top1"] or {}).items():
        n = max(c["positions"], 1)
        print(f"{kind:12s} teacher-forced top-1 at {c['positions']} answer positions {c['before'] / n:.3f} -> "
              f"{c['after'] / n:.3f} ({(c['after'] - c['before']) / n:+.3f} +- "
              f"{(c['gained'] + c['lost']) ** 0.5 / n:.3f}, paired)")
    return 0


def _write(path: str, text: str) -> None:
    """Write a report's ``text`` to ``path`` (UTF-8), its folder made first."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")


def _gap_row(kind: str, r: dict) -> str:
    engine = (f"{r['engine_first']:7.3f} {r['step_top1']:8.3f} {r['step_topk']:8.3f} {r['same_top1']:6.3f} "
              f"{r['steps']:6d}") if r["steps"] else ""
    return (f"{kind:14s} {r['teacher_forced_top1']:8.3f} {r['oov_miss']:6.3f} {r['in_vocab_miss']:8.3f} "
            f"{r['in_vocab_top1']:8.3f} {r['positions']:6d} | {engine}")


def _gap_compare(args) -> int:
    """``heads gap --answers-from``: teacher-forced agreement of several heads on earlier answers."""
    try:
        answers = records(Path(args.answers_from))
        if not answers or not all(isinstance(a.get("ids"), list) and isinstance(a.get("prompt_tokens"), int)
                                  for a in answers):
            raise HeadDataError(f"{args.answers_from} holds no answers with their token ids (heads gap --answers)")
        pair = load_pair_from_args(args)
        heads = {path or "shipped": head_for(pair, path)[0] for path in (args.head or [""])}
        report = teacher_forced(pair, heads, answers)
    except (HeadDataError, HeadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        _write(args.out, json.dumps(report, indent=1) + "\n")
    for name, r in report.items():
        print(f"{name}\n{'kind':14s} {'tf top1':>8s} {'oov':>6s} {'iv miss':>8s} {'iv top1':>8s} {'pos':>6s}")
        for kind, row in list(r["by_kind"].items()) + [("all", r["all"])]:
            print(_gap_row(kind, row))
    return 0


def cmd_gap(args) -> int:
    """The head's teacher-forced agreement beside its first-position acceptance in the engine (``heads/gap.py``)."""
    if args.answers_from:
        return _gap_compare(args)
    if args.head and len(args.head) > 1:
        print("error: the engine runs one head: give several --head with --answers-from", file=sys.stderr)
        return 2
    try:
        prompts = records(Path(args.prompts))
        if not prompts:
            raise HeadDataError(f"{args.prompts} holds no prompt record")
        kept, dropped = clean([(str(i), r["prompt"]) for i, r in enumerate(prompts)])
        if dropped:
            raise HeadDataError(f"{len(dropped)} of the prompts hold a bench prompt: the gap is measured on new "
                                "texts")
        pair = load_pair_from_args(args)
        report = measure(pair, prompts, head_path=(args.head or [""])[0], max_new_tokens=args.max_new_tokens,
                         progress=None if args.quiet else lambda m: print(m, file=sys.stderr, flush=True))
    except (HeadDataError, HeadError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.answers:
        _write(args.answers, "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in report["answers"]))
    report = {k: v for k, v in report.items() if k != "answers"}
    if args.out:
        _write(args.out, json.dumps(report, indent=1) + "\n")
    print(f"{'kind':14s} {'tf top1':>8s} {'oov':>6s} {'iv miss':>8s} {'iv top1':>8s} {'pos':>6s} | "
          f"{'engine':>7s} {'tf@step':>8s} {'tf top-k':>8s} {'same':>6s} {'steps':>6s}")
    for kind, r in list(report["by_kind"].items()) + [("all", report["all"])]:
        print(_gap_row(kind, r))
    return 0


def cmd_export(args) -> int:
    """A head checkpoint written again in the layout ``--format`` names (``eagle3.save_head``); a head whose output
    layer is the target's gets it written out (read from the pair's target) unless ``--keep-tied``."""
    try:
        tied = read_config(args.head).lm_head_from_verifier  # its output layer lives in the target: load the pair
        head = load_head(args.head, target=load_pair_from_args(args).target if tied else None)
        folder = save_head(head, args.out, layout=args.format, verifier=args.verifier or "",
                           materialise=not args.keep_tied)
    except HeadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{folder}: the head in the {args.format} layout"
          + (", its output layer written out from the target's rows" if tied and not args.keep_tied else "")
          + f" (it loads with --head {folder})")
    return 0


def cmd_vocab(args) -> int:
    """The coverage curve a draft vocabulary's size is chosen from (``data.coverage``)."""
    try:
        data, manifests = load_all(args.data)
        held = load_all(args.eval_data)[0] if args.eval_data else []
    except HeadDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    vocab = args.vocab or max(max(int(s.label_ids.max()), int(s.tokens.max())) for s in data + held) + 1
    curve = coverage(data, args.sizes, vocab, held)
    print(json.dumps({"tokens": sum(m["tokens"] for m in manifests), "curve": curve}, indent=1))
    return 0


def add_heads_parser(sub) -> None:
    heads = sub.add_parser("heads", help="train EAGLE-3 draft heads for the pair's target")
    hsub = heads.add_subparsers(dest="heads_command", required=True)
    texts_help = (".txt or .jsonl (a \"text\" field per line) file of training text, gzipped or not, stdlib (the "
                  "Python standard library's modules; stdlib:N its first N characters, stdlib:A-B the modules "
                  "stdlib:B adds to stdlib:A) or pydoc (its reference topics); repeatable")
    ft = hsub.add_parser("features", help="cache the target's features on texts for train --data (reused when it "
                         "matches)")
    ft.add_argument("--texts", action="append", required=True, help=texts_help)
    tr = hsub.add_parser("train", help="train a head on cached features (and cache them first from --texts); "
                         "resumable")
    tr.add_argument("--texts", action="append", help=texts_help + "; their features go to the first --data folder")
    tr.add_argument("--out", required=True, help="folder for the head (config.json, model.safetensors), its card "
                    "and training state; an existing one goes on training")
    tr.add_argument("--draft-vocab", type=int, default=8192, help="draft tokens")
    tr.add_argument("--vocab-data-share", type=float, default=1.0, help="the share of the draft tokens that are the "
                    "data's most frequent; the rest are the lowest token ids (a BPE tokenizer's most frequent)")
    tr.add_argument("--intermediate", type=int, help="the head's MLP width (default: the target's)")
    tr.add_argument("--steps", type=int, default=1000, help="sequences trained on in all")
    tr.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (warm-up, then cosine decay)")
    tr.add_argument("--ttt", type=int, default=3, help="training-time-test levels")
    tr.add_argument("--autocast", choices=["bfloat16", "float16"], help="run the matrix products in this dtype "
                    "(weights and optimizer stay float32)")
    tr.add_argument("--eval-data", action="append", help="held-out cached features: each level's agreement on them "
                    "at every save (repeatable)")
    tr.add_argument("--freeze-lm-head", action="store_true", help="keep the head's LM head the target's output "
                    "rows (fewer parameters to fit on little data)")
    tr.add_argument("--init", help="head folder to start from (fine-tune it on new data: its shape, layers and draft "
                    "vocabulary are kept; a new optimizer and learning-rate schedule)")
    tr.add_argument("--swap-vocab", type=int, default=0, help="with --init: exchange up to this many of the head's "
                    "draft tokens (the data's least used) for the data's most frequent tokens it lacks")
    tr.add_argument("--tie-lm-head", action="store_true", help="the head's output layer is the target's output rows "
                    "at its draft ids: frozen, never stored (config.json: lm_head_from_verifier)")
    tr.add_argument("--grow-vocab", type=int, default=0, help="with --init: grow the draft vocabulary to this many "
                    "tokens (the data's most frequent ones it lacks; see heads vocab)")
    tr.add_argument("--grow-mlp", type=int, default=0, help="with --init: widen the MLP to this many neurons (the new "
                    "ones add nothing until they learn)")
    tr.add_argument("--epochs", type=float, default=0.0, help="passes over the data (replaces --steps), each in a "
                    "new order")
    tr.add_argument("--patience", type=int, default=0, help="with --eval-data: stop after this many saves without a "
                    "better held-out score (the best save is kept in OUT/best either way)")
    tr.add_argument("--loss-on", choices=("all", "answers"), default="all", help="answers: the loss (and the held-out "
                    "agreement) only where the next token is an assistant answer's, found by the chat template")
    tr.add_argument("--save-every", type=int, default=100)
    tr.add_argument("--save-dtype", choices=sorted(DTYPES), help="the saved head's dtype (default: the target's)")
    tr.add_argument("--train-device", help="where to train (default: the pair's device), e.g. cuda")
    tr.add_argument("--seed", type=int, default=0)
    for p in (ft, tr):
        p.add_argument("--data", action="append", required=True,
                       help="folder caching the target's features (reused when it matches)" if p is ft else
                       "folder of cached features (heads features); repeatable: trained on together")
        p.add_argument("--seq-len", type=int, default=512, help="tokens per training sequence")
        p.add_argument("--layers", type=lambda v: tuple(int(x) for x in v.split(",")),
                       help="the three target layers whose inputs the head reads, e.g. 2,14,27 (default: 2, L/2, "
                       "L-3)")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
        add_model_args(p)
    ft.set_defaults(func=cmd_features)
    tr.set_defaults(func=cmd_train)
    rs = hsub.add_parser("respond", help="the target's own responses (greedy unless --temperature) to prompts "
                         "assembled for training (heads/prompts.py; no bench prompt), as JSONL texts for train "
                         "--texts (resumable)")
    rs.add_argument("--out", required=True, help="JSONL file to append to (prompts already in it are skipped)")
    rs.add_argument("--per-kind", type=int, default=40, help="prompts of each of the seven kinds")
    rs.add_argument("--written", action="store_true", help="prompts the target writes itself (self-instruct, "
                    "heads/selfinstruct.py; what it wrote is kept in OUT.writings.jsonl) instead of templates")
    rs.add_argument("--kinds", help="comma-separated kinds to write or assemble prompts of (default: all seven)")
    rs.add_argument("--write-only", action="store_true", help="with --written: write the prompts (JSONL of "
                    "\"kind\", \"prompt\") to OUT and answer none, e.g. for heads online --prompts")
    rs.add_argument("--max-new-tokens", type=int, default=256)
    rs.add_argument("--batch", type=int, default=16, help="prompts decoded together")
    rs.add_argument("--write-temperature", type=float, default=0.0, help="with --written: sample the target's "
                    "writings at this temperature (seeded by --seed) instead of greedy, for prompts a greedy run "
                    "of the same instructions would repeat; the responses follow --temperature")
    rs.add_argument("--prompts", action="append", help="answer the prompts of an earlier responses file (JSONL, "
                    "gzipped or not; repeatable) instead of templates or writings")
    rs.add_argument("--temperature", type=float, default=0.0, help="sample the responses at this temperature "
                    "(top-p 0.95, seeded by --seed) instead of greedy: other paths through the same prompts")
    rs.add_argument("--seed", type=int, default=0)
    rs.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_args(rs)
    rs.set_defaults(func=cmd_respond)
    on = hsub.add_parser("online", help="online distillation (OSD) of the head on a stream of one kind of prompt: "
                         "held-out acceptance of every kind before and after (analysis/online.py)")
    on.add_argument("--kind", required=True, help="the stream's kind: code, math, chat, qa, translation, "
                    "summarisation, reasoning")
    on.add_argument("--requests", type=int, default=32, help="prompts in the stream")
    on.add_argument("--held-out", type=int, default=8, help="held-out prompts of each kind")
    on.add_argument("--lr", type=float, default=1e-4)
    on.add_argument("--every", type=int, default=8, help="requests between two updates")
    on.add_argument("--replay", type=int, default=0, help="earlier requests each update learns from again (default "
                    "0: only those since the last update)")
    on.add_argument("--max-new-tokens", type=int, default=48)
    on.add_argument("--temperature", type=float, default=0.0)
    on.add_argument("--method", default="eagle", help="eagle (the head learns; default), or sd / mcsd (a LoRA "
                    "adapter on the draft learns)")
    on.add_argument("--head", help="the head's folder (default: the one shipped for the target); with sd / mcsd, an "
                    "adapter folder to start from")
    on.add_argument("--seed", type=int, default=77)
    on.add_argument("--prompts", action="append", help="response or prompt files (JSONL with \"kind\" and "
                    "\"prompt\", gzipped or not; repeatable) to draw the stream's kind from, in their order, instead "
                    "of the templates (the other kinds' held-out prompts stay the templates'): e.g. what heads "
                    "respond --written --write-only wrote")
    on.add_argument("--out", help="write the report (JSON) here")
    on.add_argument("--save", help="keep the learned head (or adapter) in this folder")
    add_model_args(on)
    on.set_defaults(func=cmd_online)
    gp = hsub.add_parser("gap", help="the head's teacher-forced level-1 agreement beside its first-position "
                         "acceptance in the engine, on the target's answers to new prompts, by kind")
    gp.add_argument("--prompts", default=str(GAP_PROMPTS),
                    help="JSONL of {\"kind\", \"prompt\"} (default: 56 prompts written for this, 8 of each kind)")
    gp.add_argument("--head", action="append", help="the head's folder (default: the one shipped for the target); "
                    "several with --answers-from")
    gp.add_argument("--answers-from", help="teacher-forced only, no engine run: earlier --answers (JSONL), for "
                    "comparing heads (--head, repeated) on the same texts")
    gp.add_argument("--max-new-tokens", type=int, default=128)
    gp.add_argument("--out", help="write the report (JSON) here")
    gp.add_argument("--answers", help="write the target's answers here (JSONL, as heads respond writes them)")
    gp.add_argument("--quiet", action="store_true")
    add_model_args(gp)
    gp.set_defaults(func=cmd_gap)
    ex = hsub.add_parser("export", help="write a head checkpoint in SpecForge's layout (SGLang, vLLM) or vLLM "
                         "speculators' (Eagle3Speculator)")
    ex.add_argument("--head", required=True, help="the head's folder (the shipped one: assets/heads/<target>)")
    ex.add_argument("--out", required=True, help="the folder to write")
    ex.add_argument("--format", default="specforge", choices=list(LAYOUTS))
    ex.add_argument("--verifier", help="speculators: the target's name or path its config records")
    ex.add_argument("--keep-tied", action="store_true", help="a head whose output layer is the target's: keep it so "
                    "(no lm_head written) instead of writing the rows out")
    add_model_args(ex)
    ex.set_defaults(func=cmd_export)
    vc = hsub.add_parser("vocab", help="the coverage curve of draft vocabulary sizes over cached features: the share "
                         "of the target's favourite tokens the N most frequent tokens hold")
    vc.add_argument("--data", action="append", required=True, help="cached features (heads features)")
    vc.add_argument("--eval-data", action="append", help="held-out cached features whose favourites are counted "
                    "(default: the --data itself)")
    vc.add_argument("--sizes", type=lambda v: [int(x) for x in v.split(",")],
                    default=[8192, 12288, 16384, 24576, 32768, 49152, 65536])
    vc.add_argument("--vocab", type=int, help="the target's vocabulary (default: from the data)")
    vc.set_defaults(func=cmd_vocab)
