"""The command line's shared options and how they become objects: the model pair, the method, the sampling and
the prompts, for every subcommand (``cli/main.py``, ``cli/decision.py``, ``cli/instruments.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..analysis.prompts import Prompt, PromptError, encode_prompt, load_prompt_set
from ..engine.config import DEFAULTS, FREE_ROWS_CPU, METHODS, VERIFIERS, MethodConfig
from ..engine.factory import build_engine
from ..engine.machine import EngineError
from ..engine.policies.cost_ratio import COST_RATIO_MODES
from ..engine.policies.fallback import FALLBACK_MODES
from ..engine.policies.stopping import ADAPT_MODES, DECISION_MODELS, STOP_POLICY_NAMES
from ..engine.stop_models.model import load_decision_model
from ..engine.sampling import SamplingConfig
from ..engine.tree import TreeShapeError, parse_k_config, parse_tree_template
from ..models.loading import load_named_pair
from ..plugins.loading import ENTRY_POINT_GROUP, ENV, NO_PLUGINS_FLAG, PLUGIN_FLAG


def temperature_list(text: str) -> list[float]:
    """``--temperatures`` as floats, e.g. ``"0,0.7"`` -> ``[0.0, 0.7]``. Raises ValueError naming the entry that is
    not a temperature (a number >= 0)."""
    out = []
    for part in str(text).split(","):
        try:
            value = float(part)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ValueError(f"--temperatures: {part.strip()!r} is not a temperature; give numbers >= 0 separated by "
                             "commas, e.g. 0,0.7")
        out.append(value)
    return out


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model pair's options: --models, --draft, --target, --dtype, --device, --draft-quant, --packed-weights,
    --fused-kernels."""
    g = p.add_argument_group("models")
    g.add_argument("--models", default="default", choices=["default", "tiny", "custom"],
                   help="default: embedded Qwen2.5-Coder 0.5B -> 1.5B pair; tiny: random test pair; "
                        "custom: --draft and --target")
    g.add_argument("--draft", help="draft model: local HF folder, hub id or .gguf file (implies --models custom)")
    g.add_argument("--target", help="target model: local HF folder, hub id or .gguf file (implies --models custom; "
                                    "without --draft the target drafts with its own first layers)")
    g.add_argument("--dtype", default=None,
                   help="auto (default: bf16 on CUDA and on CPUs with native bf16, else fp32), bf16, fp16 or fp32")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--draft-device", default=None, help="run the draft model there instead (e.g. cpu while the "
                   "target runs on cuda): PEARL's lanes (--lanes threads) then overlap for real")
    g.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8"],
                   help="int8: the draft's linear layers dynamically quantized (lossless; faster drafting on CPU). "
                        "auto (default): int8 on CPU for real pairs, none on CUDA and for the tiny pair")
    g.add_argument("--packed-weights", default="auto", choices=["auto", "on", "off"],
                   help="float32 linear weights packed once for oneDNN instead of on every call (CPU; faster "
                        "forwards, logits within about 1e-4). auto (default): on for real float32 pairs on a CPU")
    g.add_argument("--fused-kernels", default="off", choices=["on", "off"],
                   help="on: the models' norms, MLPs and rotary embedding compiled into fused kernels "
                        "(torch.compile; a GPU's forwards are mostly such small kernels). Default off")


def add_plugin_args(p: argparse.ArgumentParser) -> None:
    """--plugin (repeatable) and --no-plugins. ``cli/main.py`` loads the plugins before the parser is built
    (``plugins.loading.plugin_args``), so that --method and --verifier take their names; argparse only accepts them
    here."""
    g = p.add_argument_group("plugins (docs/plugins.md)")
    g.add_argument(PLUGIN_FLAG, action="append", metavar="PATH_OR_MODULE",
                   help="load a plugin first: a .py file or a module that registers methods, verifiers or stop "
                        f"policies (repeatable; also {ENV}, paths separated by '{os.pathsep}')")
    g.add_argument(NO_PLUGINS_FLAG, action="store_true",
                   help=f"load neither the installed packages' plugins ({ENTRY_POINT_GROUP} entry points) nor "
                        f"{ENV}'s; --plugin still loads")


def add_method_args(p: argparse.ArgumentParser) -> None:
    """The method's options (``MethodConfig``'s fields): --method, tree shape, stop policy, verifier, free drafters;
    and the plugin options (``add_plugin_args``)."""
    add_plugin_args(p)
    g = p.add_argument_group("method and tree shape")
    g.add_argument("--method", default="mcsd-improved", choices=METHODS,
                   help="the decoding method: " + ", ".join(METHODS) + " (plugins' methods included)")
    g.add_argument("--gamma", type=int, help="sd, pearl: draft chain length (default 4)")
    g.add_argument("--online-distill", action="store_true", default=None,
                   help="eagle, eagle-hybrid: the head learns between prompts from the target's distributions where "
                        "its tokens were rejected (OSD, online speculative decoding); sd, mcsd, mcsd-improved, "
                        "hybrid: a LoRA adapter on the draft does")
    g.add_argument("--draft-adapter", metavar="DIR", help="sd, mcsd, mcsd-improved, hybrid: draft with the LoRA "
                   "adapter in DIR (what --online-distill --save-distilled DIR wrote)")
    g.add_argument("--distill-lr", type=float, help="--online-distill: AdamW learning rate (default 1e-4)")
    g.add_argument("--distill-every", type=int, help="--online-distill: prompts between two updates (default 8)")
    g.add_argument("--distill-replay", type=int, help="--online-distill: earlier prompts each update learns from "
                   "again (default 0: only those since the last update)")
    g.add_argument("--lanes", default="one", choices=["one", "threads"],
                   help="pearl: 'threads' drafts in a thread of its own while the target verifies (one CPU core "
                        "each); 'one' (default) drafts, then verifies, and the trace simulates the two lanes")
    g.add_argument("--k-config", help="children per level, e.g. 4,2,2 (mcsd); first levels for mcsd-improved")
    g.add_argument("--width", type=int, help="mcsd-improved --lossy: target-initialized roots")
    g.add_argument("--max-depth", type=int, help="mcsd-improved: maximum draft levels")
    g.add_argument("--branch-threshold", type=float,
                   help="adaptive width: a node gets its level's k children only where the draft's top "
                        "probability is below this, else one (1 = the fixed k_config)")
    g.add_argument("--tree-choice", choices=["fixed", "online"],
                   help="mcsd-improved: online (default) = each step's root width chosen from the acceptance and "
                        "forward costs the run measures; fixed = the published root width (k_config); --lossy "
                        "takes fixed")
    g.add_argument("--lossy", action="store_true",
                   help="mcsd-improved: the target-initialized roots + longest-branch rule of Lu et al. 2024 (LOSSY)")
    g.add_argument("--stop", choices=STOP_POLICY_NAMES, help="mcsd-improved stop policy (decision, prune and "
                                                            "specdec++ read a learned decision model)")
    g.add_argument("--threshold", type=float,
                   help="stop threshold tau (specdec++: h, goodput: cost ratio r); default per policy")
    g.add_argument("--cost-ratio", choices=COST_RATIO_MODES,
                   help="goodput's r: fixed (--threshold) or measured from the run's own step times, starting there")
    g.add_argument("--decision-model", choices=DECISION_MODELS,
                   help="decision model the learned stop policies read (default context)")
    g.add_argument("--decision-dir", help="folder from `decision train` (default: the one shipped for the pair)")
    g.add_argument("--adapt", choices=ADAPT_MODES, help="online adaptation of the stop policy during the run: "
                                                        "threshold (ROC refit) or last-layer (decision model)")
    g.add_argument("--fallback", choices=FALLBACK_MODES,
                   help="plain decoding steps when speculation measures slower (SmartSpec's goodput rule): auto "
                        "(default: on CUDA, and on CPUs where a verification's extra rows cost several plain steps), "
                        "goodput or off")
    g.add_argument("--verifier", choices=("auto",) + VERIFIERS,
                   help="verification rule (drafting follows it); auto = greedy at temperature 0, else rrs")
    g.add_argument("--lookup-tokens", type=int, help="prompt-lookup / hybrid: longest copy (the adaptive length's cap)")
    g.add_argument("--lookup-branches", type=int, help="prompt-lookup / hybrid: matches proposed as branches")
    g.add_argument("--lookup-ngram", type=int, help="prompt-lookup / hybrid: longest n-gram matched")
    g.add_argument("--lookup-alone", type=int,
                   help="hybrid / eagle-hybrid: shortest n-gram match on which lookup's copies go alone (shorter: "
                        "the model or head drafts)")
    g.add_argument("--recycling-widths", help="token-recycling / hybrid: tree template widths per level, e.g. "
                                               "8,3,2,1,1,1,1,1 (a node of sibling rank r gets floor(w / (r + 1)))")
    g.add_argument("--recycling-k", type=int, help="token-recycling / hybrid: candidates stored per token")
    g.add_argument("--free-rows", type=int, help="prompt-lookup / token-recycling / hybrid: most target rows (the "
                                                 "anchor included) free branches fill a step's tree to; 0 = auto "
                                                 f"({FREE_ROWS_CPU} on the CPU, no limit on CUDA; where a row costs "
                                                 "5 ms or more, token-recycling keeps the template slots whose "
                                                 "measured acceptance pays for their rows)")
    g.add_argument("--head", help="eagle: an EAGLE-3 head's checkpoint folder (config.json + model.safetensors, as "
                                  "SpecForge writes it); default: the head shipped for the target")
    g.add_argument("--head-topk", type=int, help="eagle: children drawn per expanded node, and nodes expanded per "
                                                 "level (default 4)")
    g.add_argument("--head-depth", type=int, help="eagle: levels the head drafts (default 6)")
    g.add_argument("--head-tokens", type=int, help="eagle: most draft tokens verified (default 16)")
    g.add_argument("--beam", type=int, help="rsd-s: nodes kept a level by the stochastic beam search (W; the tree's "
                                            "k_config becomes W,1,...,1)")
    g.add_argument("--depth", type=int, help="rsd-s: levels of its beam tree (L)")
    g.add_argument("--tree", help="mcsd: a tree template instead of the k_config tree: breadth-first parent "
                                  "indices, -1 = the anchor (e.g. the optimal tree `acceptance` prints)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling options (``SamplingConfig``) with --max-new-tokens and --no-chat-template."""
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt text as is")


def add_prompt_source_args(p: argparse.ArgumentParser) -> None:
    """One prompt (--prompt) or a prompt set (--prompt-file, --limit)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="JSONL file ('turns' list or 'prompt' string a line), or mt-bench / "
                                           "humaneval")
    p.add_argument("--limit", type=int, default=0, help="use the first N prompts of the file")


def add_prompt_or_trace_args(p: argparse.ArgumentParser, many: bool,
                             trace_help: str = "a saved trace (download or generate --save-trace)") -> None:
    """A prompt (--prompt), a prompt set (--prompt-file, --limit) or saved runs instead (--trace: one, or with
    ``many`` several)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="JSONL file, or mt-bench / humaneval")
    src.add_argument("--trace", help=trace_help, **({"nargs": "+"} if many else {}))
    p.add_argument("--limit", type=int, default=0, help="use the first N prompts of the file")


def method_config_from_args(args) -> MethodConfig:
    """The ``MethodConfig`` the parsed options name: the method's defaults with the options given. Raises
    TreeShapeError / ValueError for a malformed shape or setting."""
    base = DEFAULTS[args.method]
    changes = {}
    for name in ("gamma", "width", "max_depth", "stop", "threshold", "decision_model", "branch_threshold",
                 "lookup_tokens", "lookup_branches", "lookup_ngram", "lookup_alone", "recycling_k", "adapt",
                 "fallback", "free_rows", "cost_ratio", "tree_choice", "head", "head_topk", "head_depth",
                 "head_tokens", "online_distill", "distill_lr", "distill_every", "distill_replay", "draft_adapter"):
        value = getattr(args, name, None)
        if value is not None:
            changes[name] = value
    if getattr(args, "k_config", None) is not None:
        changes["k_config"] = parse_k_config(args.k_config)
    if getattr(args, "tree", None):
        changes["tree"] = parse_tree_template(args.tree)
    if getattr(args, "recycling_widths", None) is not None:
        changes["recycling_widths"] = parse_k_config(args.recycling_widths)
    beam, depth = getattr(args, "beam", None), getattr(args, "depth", None)
    if beam is not None or depth is not None:  # a beam tree: W nodes a level, L levels (rsd-s)
        shape = changes.get("k_config", base.k_config)
        beam, depth = beam or shape[0], depth or len(shape)
        if not (isinstance(beam, int) and isinstance(depth, int) and beam >= 1 and depth >= 1):
            raise TreeShapeError(f"--beam and --depth must be integers >= 1, got {beam!r}, {depth!r}")
        changes["k_config"] = (beam,) + (1,) * (depth - 1)
    if getattr(args, "lossy", False):
        changes["lossy"] = True
        if "k_config" not in changes:
            changes["k_config"] = (1,)  # the fork of Lu et al. 2024: one draft chain under each root
    if getattr(args, "verifier", None):
        changes["verifier"] = args.verifier
    return base.with_(**changes)


def decision_model_from_args(args, config: MethodConfig):
    """The decision model named by ``--decision-dir``, or None (the engine then loads the shipped one)."""
    if not getattr(args, "decision_dir", None):
        return None

    return load_decision_model(args.decision_dir, config.decision_model)


def prompts_from_args(args) -> list[Prompt]:
    """The prompts of --prompt or --prompt-file (its first --limit). Raises PromptError for an unreadable file."""
    if args.prompt is not None:
        return [Prompt("cli", args.prompt, "user")]
    prompts = load_prompt_set(args.prompt_file)
    return prompts[: args.limit] if args.limit else prompts


def runs_from_args(args, pair, prompts: list[Prompt], config: MethodConfig, on_error=None,
                   session: dict | None = None):
    """Each of ``prompts`` run to its end on ``pair`` with ``config`` and the options' sampling and decision model:
    yields ``(n, prompt, trace)``. Raises what the decision model's loading and the engine raise; with
    ``on_error(prompt, exc)`` a prompt the engine refuses (EngineError, PromptError: too long for the models, empty)
    is handed to it instead and the next prompt runs. With ``--online-distill`` the head learns from prompt to
    prompt; ``session["distiller"]`` holds its ``HeadDistiller`` after each run."""
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    decision = decision_model_from_args(args, config)
    session = {} if session is None else session
    for n, prompt in enumerate(prompts):
        engine = build_engine(pair, config, sampling, decision_model=decision, lanes=getattr(args, "lanes", "one"),
                              distiller=session.get("distiller"))
        session["distiller"] = engine.parts.distiller
        try:
            engine.start(encode_prompt(pair.tokenizer, prompt.text, chat_template=not args.no_chat_template),
                         args.max_new_tokens, prompt_text=prompt.text)
        except (EngineError, PromptError) as exc:
            if on_error is None:
                raise
            on_error(prompt, exc)
            continue
        trace = engine.run()
        trace.prompt_info = prompt.info()
        yield n, prompt, trace


def load_pair_from_args(args, keep_unquantized: bool = False):
    """The model pair the options name (``models.load_named_pair``), loading progress on stderr. Raises
    ModelPairError."""
    spec = "custom" if (args.draft or args.target) else args.models
    return load_named_pair(spec, dtype=args.dtype, device=args.device, draft=args.draft, target=args.target,
                           draft_quant=args.draft_quant, keep_unquantized=keep_unquantized,
                           packed=args.packed_weights, fused=getattr(args, "fused_kernels", "off"),
                           draft_device=getattr(args, "draft_device", None),
                           progress=lambda msg, frac: print(f"[models] {msg}", file=sys.stderr) if frac == 0 else None)
