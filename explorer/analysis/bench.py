"""``python -m explorer bench``: our methods against ``ar`` and Hugging Face assisted generation, same run.

For every temperature and prompt, the methods run back to back (``ar`` first), so machine drift hits them alike.
Per run: generated tokens, wall seconds (prefill included), tokens/s, target calls (ours), both acceptance rates,
and the time split into drafting, verification and everything else (ours: from the step traces; ``hf-assisted``:
wall time only). Aggregates are total tokens over total seconds; ``speedup_vs_ar`` and ``ratio_vs_hf`` divide by the
same run's ``ar`` and ``hf-assisted``.

``hf-assisted`` is ``target.generate(assistant_model=draft)`` with transformers' defaults for the assistant
(recorded in the report: ``num_assistant_tokens``, its schedule, ``assistant_confidence_threshold``), with the same
draft our engine uses (int8 when the pair's draft is quantized). ``hf-assisted-bf16`` is the same call with the
unquantized draft: what a user who loads the two models gets. ``hf-prompt-lookup`` is
``target.generate(prompt_lookup_num_tokens=10)``: transformers' prompt lookup decoding (no draft model).
``hf-generate`` is a plain ``target.generate``: transformers' own plain decoding, beside our ``ar``.

On CUDA each of our methods also gets one untimed run of the first prompt that counts host synchronisations per
step (``build_engine(count_syncs=True)``), and the share of plain decoding steps the goodput fallback took is reported
for every run (``engine/policies/fallback.py``).

A method label may carry settings after ``+``: ``mcsd-improved+adapt=last-layer`` runs the default
``mcsd-improved`` with online adaptation, ``mcsd-improved+decision_model=path+adapt=threshold`` changes two
settings (``VARIANT_KEYS``), so variants of one method run side by side in one bench.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from ..engine.carried import Carried
from ..engine.config import DEFAULTS, MethodConfig
from ..engine.factory import build_engine
from ..engine.tree import parse_k_config
from ..engine.policies.stopping import LEARNED_POLICIES
from ..engine.sampling import SamplingConfig
from ..engine.stop_models.model import load_decision_model
from ..trace.lanes import two_lane_seconds
from ..trace.metrics import run_metrics

HF_ASSISTED = "hf-assisted"
HF_ASSISTED_BF16 = "hf-assisted-bf16"  # the unquantized draft, as users run it (same as hf-assisted without quant)
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
HF_GENERATE = "hf-generate"  # plain decoding as transformers does it: the baseline our `ar` is measured against
HF_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
HF_METHODS = (HF_GENERATE, HF_ASSISTED, HF_ASSISTED_BF16, HF_PROMPT_LOOKUP)
BENCH_METHODS = ("ar", HF_GENERATE, HF_ASSISTED_BF16, HF_ASSISTED, HF_PROMPT_LOOKUP, "sd", "mcsd", "mcsd-improved",
                 "prompt-lookup", "token-recycling", "hybrid", "eagle")


VARIANT_KEYS = ("adapt", "fallback", "stop", "decision_model", "threshold", "branch_threshold", "max_depth",
                "free_rows", "lookup_tokens", "lookup_alone", "cost_ratio", "tree_choice", "head", "head_topk",
                "head_depth", "head_tokens", "verifier", "k_config", "gamma")
INT_KEYS = ("max_depth", "free_rows", "lookup_tokens", "lookup_alone", "head_topk", "head_depth", "head_tokens",
            "gamma")
CARRY_OFF = "+carry=off"  # a bench label's suffix: each run starts afresh (nothing carried)
CHAIN_KEY = "chain="  # a bench label's +chain=N: draft levels of chains per replay (Engine's chain_levels)
PREFILL_APART = "prefill=apart"  # a bench label's +prefill=apart: the target prefills apart from the first step
LANE_THREADS = "lanes=threads"  # a bench label's +lanes=threads: PEARL's draft in a thread of its own, one core each
ENGINE_PARTS = (PREFILL_APART, LANE_THREADS)  # label parts that set the engine, not the method


def carries(label: str) -> bool:
    """Whether a bench label's runs carry what they learned (Token Recycling's matrix, the goodput fallback's
    rates, the stop policy's adaptation: ``engine/carried.py``) to the method's next prompt: all but labels ending in
    ``CARRY_OFF``, e.g. ``hybrid+carry=off``."""
    return not label.endswith(CARRY_OFF)


def chain_of(label: str, default: int = 0) -> int:
    """The chain replay depth of a bench label: its ``+chain=N`` (an engine setting, not the method's), else
    ``default``. Raises ValueError for a value that is not a non-negative integer."""
    for part in label.split("+")[1:]:
        if part.startswith(CHAIN_KEY):
            value = part[len(CHAIN_KEY):]
            if not value.isdigit():
                raise ValueError(f"bench label {label!r}: +chain= takes a number of levels, got {value!r}")
            return int(value)
    return default


def joint_prefill_of(label: str) -> bool:
    """Whether a bench label's runs join the target's prefill to the first verification (``Engine``
    ``joint_prefill``, as transformers' assisted generation and prompt lookup do): all but labels with
    ``+prefill=apart``. The engine itself decides where it can (not ``ar``, ``layer-skip``, target-initialized
    roots or graphs)."""
    return PREFILL_APART not in label.removesuffix(CARRY_OFF).split("+")[1:]


def lanes_of(label: str) -> str:
    """The ``Engine`` ``lanes`` of a bench label: ``threads`` with ``+lanes=threads`` (PEARL's draft drafts in its own
    thread while the target verifies, each on one core), else ``one``."""
    return "threads" if LANE_THREADS in label.removesuffix(CARRY_OFF).split("+")[1:] else "one"


def method_for_label(label: str) -> MethodConfig:
    """The config of a bench label: a method name (``config.DEFAULTS``) optionally followed by ``+key=value``
    settings (``VARIANT_KEYS``; ``k_config`` written with dashes, ``mcsd+k_config=4-1-1-1+verifier=spectr``),
    ``+chain=N``, ``+prefill=apart``, ``+lanes=threads`` and last ``CARRY_OFF`` (bench settings, not the method's).
    Raises ValueError
    for an unknown method, key or value."""
    name, *parts = label.removesuffix(CARRY_OFF).split("+")
    parts = [p for p in parts if not p.startswith(CHAIN_KEY) and p not in ENGINE_PARTS]
    if name not in DEFAULTS:
        raise ValueError(f"unknown bench method {name!r}; use {', '.join(BENCH_METHODS)}")
    changes: dict = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in VARIANT_KEYS:
            raise ValueError(f"bench label {label!r}: write +key=value with key one of {', '.join(VARIANT_KEYS)}")
        changes[key] = (float(value) if key in ("threshold", "branch_threshold")
                        else int(value) if key in INT_KEYS
                        else parse_k_config(value.replace("-", ",")) if key == "k_config" else value)
    return DEFAULTS[name].with_(**changes)


def source_commit() -> str:
    """The short git commit of the code that runs: ``$SPEC_EXPLORER_COMMIT`` where set (a copy of the tree without
    its git folder, as a GPU machine receives it), else git's, else ``unknown``."""
    if os.environ.get("SPEC_EXPLORER_COMMIT"):
        return os.environ["SPEC_EXPLORER_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_label(vector_units: bool = True) -> str:
    """This machine's CPU as a measurement's ``machine`` line names it: its model name and, with ``vector_units``,
    the vector capability torch reads (``"AMD EPYC (AVX512)"``; two CPUs of one model name can differ in their vector
    units, AVX2 against AVX-512 with bf16: docs/bench.md); "" where /proc/cpuinfo cannot be read."""
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        if names:
            return names[0] + (f" ({torch.backends.cpu.get_cpu_capability()})" if vector_units else "")
    return ""


def run_facts(pair) -> dict:
    """What a measurement ran on: the pair, dtype, device, machine (with the CPU's vector capability, as torch reads
    it, on a CPU), library versions, threads, the UTC date and the code's commit."""
    # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports this module at start
    import transformers

    gpu = f", {torch.cuda.get_device_name(pair.device)}" if pair.device.type == "cuda" else ""
    cpu = cpu_label(vector_units=pair.device.type == "cpu")
    cpu = f", {cpu}" if cpu else ""
    return {"pair": pair.name, "draft_id": pair.draft_id, "target_id": pair.target_id,
            "dtype": str(pair.dtype).removeprefix("torch."), "device": str(pair.device),
            **({"draft_device": str(pair.draft_at)} if pair.split else {}),
            "draft_quant": pair.draft_quant, "packed_weights": pair.packed_weights, "fused_kernels": pair.fused_kernels,
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs{cpu}{gpu}", "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(), "commit": source_commit()}


HF_ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def hf_assisted_settings(draft) -> dict:
    """The assistant settings as the draft model's generation config holds them (None: transformers' default), to
    restore after ``generate`` adapted them."""
    g = draft.generation_config
    return {name: getattr(g, name, None) for name in HF_ASSISTANT_FIELDS}


def hf_assisted_effective(draft) -> dict:
    """The assistant settings ``generate`` runs with, for the report: the draft's own where set, else transformers'
    defaults (5.23: 20 tokens, ``constant``, confidence 0.4, from ``GenerationConfig``'s defaults; None where this
    transformers does not say)."""
    # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports this module at start
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    return {k: (v if v is not None else defaults.get(k)) for k, v in hf_assisted_settings(draft).items()}


def run_hf_assisted(pair, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
                    draft=None, helper: str = "assistant") -> dict:
    """One transformers ``generate`` call; ``helper``: ``assistant`` (``generate(assistant_model=draft)``,
    ``draft``: default ``pair.draft``), ``lookup`` (``generate(prompt_lookup_num_tokens=HF_LOOKUP_TOKENS)``) or
    ``plain`` (no helper). Returns the same keys as ``metrics.run_metrics`` where known.

    Raises ValueError for another ``helper``."""
    draft = pair.draft if draft is None else draft
    helpers = {"assistant": {"assistant_model": draft}, "lookup": {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS},
               "plain": {}}
    if helper not in helpers:
        raise ValueError(f"unknown generate helper {helper!r}; use one of {', '.join(helpers)}")
    ids = torch.tensor([prompt_ids], device=pair.device)
    kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if not sampling.greedy:
        kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                  "top_k": sampling.top_k or None}
        torch.manual_seed(int(sampling.seed))
    settings = hf_assisted_settings(draft)  # generate() may adapt these on the shared draft: restore them after
    t0 = time.perf_counter()
    with torch.inference_mode(), pair.lock:
        try:
            out = pair.target.generate(ids, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids),
                                       **helpers[helper], **kwargs)
        finally:
            for name, value in settings.items():
                setattr(draft.generation_config, name, value)
    seconds = time.perf_counter() - t0
    new = out.shape[1] - len(prompt_ids)
    return {"generated_tokens": int(new), "seconds": seconds, "tokens_per_s": new / seconds if seconds else None,
            "target_calls": None, "draft_calls": None, "tokens_per_target_call": None, "acceptance_rate": None,
            "mcsd_acceptance_rate": None, "drafted_tokens": None, "accepted_draft_tokens": None,
            "prefill_ms": None, "draft_ms": None, "verify_ms": None, "forward_ms": None, "step_ms": None,
            "token_ids": out[0, len(prompt_ids):].tolist()}


def warm_graphs(pair, config: MethodConfig, prompt_ids: list[int], max_new_tokens: int, decision_model=None,
                chain_levels: int = 0, sampling: SamplingConfig | None = None) -> int:
    """Capture, before timing, every query-size bucket of the graph runners a run of ``config`` on ``prompt_ids``
    will use (runners are shared through ``pair`` by cache width), and with ``chain_levels`` every chain replay of
    ``sampling``'s settings (default greedy). Without it the timed runs paid the captures: about 0.1-0.2 s each on
    an H100 against 5 ms for a graphed forward. Returns the number of graphs captured (0 off CUDA or where all
    were captured already)."""
    engine = build_engine(pair, config, sampling or SamplingConfig(), decision_model=decision_model,
                          kv_cache="static", graphs=True, chain_levels=chain_levels)
    engine.start(prompt_ids, max_new_tokens)
    try:
        return engine.capture_graphs()
    finally:
        engine.release()


def run_engine(pair, config: MethodConfig, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingConfig,
               decision_model=None, kv_cache: str = "dynamic", graphs: bool = False,
               carried: Carried | None = None, count_syncs: bool = False, chain_levels: int = 0,
               joint_prefill: bool = False, with_trace: bool = False, lanes: str = "one") -> dict:
    """One run of our engine; ``run_metrics`` plus ``token_ids``, ``steps``, ``plain_steps`` (the goodput
    fallback's plain decoding steps), ``cost_ratio`` (the goodput policy's measured r at the end, when measured)
    ``carried``, what the run learned for the next prompt (``engine/carried.py``: Token Recycling's matrix, the
    goodput fallback's rates, the stop policy's online adaptation), and with ``with_trace`` the run's ``RunTrace``
    (``trace``).
    ``count_syncs`` (CUDA): also ``host_syncs_per_step`` (the counting slows the run a little). ``chain_levels``:
    draft levels of chains per replay (``Engine``; needs ``graphs``). ``joint_prefill``: the target's prefill joined
    to the first verification where the method allows (``Engine``). ``lanes``: ``Engine``'s (``threads``: PEARL's
    draft in its own thread, one core a lane).

    ``seconds`` / ``tokens_per_s`` are wall-clock around ``start`` and ``run`` (prefill, steps and building the
    trace), as for ``hf-assisted``, not the sum of the trace's step timers. A PEARL run also gets
    ``two_lane_seconds``: that wall time less the overlap its rounds' two lanes would save on two devices
    (``trace/lanes.py``; nothing saved where the lanes ran concurrently for real).
    """
    engine = build_engine(pair, config, sampling, decision_model=decision_model, kv_cache=kv_cache, graphs=graphs,
                          carried=carried, count_syncs=count_syncs, chain_levels=chain_levels,
                          joint_prefill=joint_prefill, lanes=lanes)
    t0 = time.perf_counter()
    engine.start(prompt_ids, max_new_tokens)
    trace = engine.run()
    seconds = time.perf_counter() - t0
    engine.release()  # graph runners (and their captured graphs) serve the next run
    metrics = run_metrics(trace)
    traced = metrics["seconds"]  # the trace's own clock: the prefill and the steps' timers
    metrics.update(seconds=seconds, tokens_per_s=metrics["generated_tokens"] / seconds if seconds else None,
                   steps=len(trace.steps),
                   plain_steps=sum(1 for s in trace.steps if s.fallback and not s.fallback["speculate"]))
    two_lanes = two_lane_seconds(trace)
    if two_lanes is not None:  # the trace's own clock on two lanes against its clock on one
        metrics["two_lane_seconds"] = seconds - (traced - two_lanes)
    if trace.steps and trace.steps[-1].cost:  # the goodput policy's measured r at the end of the run
        metrics["cost_ratio"] = trace.steps[-1].cost["next"]
    if count_syncs and trace.steps and all(s.host_syncs is not None for s in trace.steps):
        metrics["host_syncs_per_step"] = sum(s.host_syncs for s in trace.steps) / len(trace.steps)
    return {**metrics, "token_ids": trace.generated_ids, "carried": engine.carried(),
            **({"trace": trace} if with_trace else {})}


def aggregate(rows: list[dict]) -> dict:
    """Totals over runs: tokens/s = total tokens / total seconds; time split in seconds and as shares."""

    def total(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return sum(vals) if len(vals) == len(rows) and rows else None

    tokens, seconds = total("generated_tokens"), total("seconds")
    calls, drafted, accepted = total("target_calls"), total("drafted_tokens"), total("accepted_draft_tokens")
    draft_s = total("draft_ms") / 1e3 if total("draft_ms") is not None else None
    verify_s = total("verify_ms") / 1e3 if total("verify_ms") is not None else None
    rates = [r["acceptance_rate"] for r in rows if r.get("acceptance_rate") is not None]
    other_s = seconds - draft_s - verify_s if draft_s is not None and verify_s is not None else None
    # Engine overhead: wall time of the steps (everything but the prefill) spent outside model forwards.
    forward, prefill = total("forward_ms"), total("prefill_ms")
    busy = seconds - prefill / 1e3 if forward is not None and prefill is not None else None
    overhead = (busy - forward / 1e3) / busy if busy else None
    two = total("two_lane_seconds")
    return {"runs": len(rows), "generated_tokens": tokens, "seconds": seconds,
            **({"two_lane_seconds": two, "two_lane_tokens_per_s": tokens / two if two else None} if two else {}),
            "tokens_per_s": tokens / seconds if seconds else None, "target_calls": calls,
            "tokens_per_target_call": tokens / calls if calls else None, "draft_calls": total("draft_calls"),
            "drafted_tokens": drafted, "acceptance_rate": _mean(rates),
            "mcsd_acceptance_rate": accepted / drafted if drafted else None,
            "draft_s": draft_s, "verify_s": verify_s, "other_s": other_s, "overhead_share": overhead,
            "plain_step_share": total("plain_steps") / total("steps") if total("steps") else None,
            "cost_ratio": _mean([r["cost_ratio"] for r in rows if r.get("cost_ratio") is not None])}


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def samples_at(temperature: float, samples: int) -> int:
    """Runs of every prompt at ``temperature``: ``samples`` when sampling, one when greedy (same text each time)."""
    return samples if temperature > 0 else 1


def bench(pair, prompts_ids: list[list[int]], *, methods=BENCH_METHODS, configs: dict | None = None,
          temperatures=(0.0,), max_new_tokens: int = 128, seed: int = 0, warmup: int = 1, top_p: float = 1.0,
          kv_cache: str = "dynamic", graphs: bool = False, decision_dir=None, samples: int = 1,
          chain_levels: int = 0, kinds: list[str] | None = None, progress=lambda msg: None,
          keep_trace=None) -> dict:
    """Run ``methods`` over ``prompts_ids`` at each temperature.

    Args:
        configs: method name -> MethodConfig (default ``config.DEFAULTS``); a name may be any label, e.g.
            ``"mcsd-improved/prune"``, as long as its config says which method it is.
        kv_cache: our engine's KV cache, ``dynamic`` or ``static`` (``engine/runtime/kv_cache.py``); ``graphs``: our
            forwards through CUDA graphs (``engine/runtime/graphs.py``; needs ``static``). A self-drafting method
            (``layer-skip``: its exit layer moves between steps) runs on the dynamic cache without graphs whatever
            these say, and its summary row says ``eager``.
        chain_levels: with ``graphs``, draft levels of chains per replay (``Engine``) for every method; a label's
            ``+chain=N`` (``chain_of``) sets it for that label alone, e.g. ``mcsd-improved+chain=8`` beside
            ``mcsd-improved`` in one run.
        decision_dir: a decision-model folder (``decision train``) the learned stop policies read instead of the
            one shipped for the pair (e.g. a model trained without the prompt kind being benched).
        samples: runs of every prompt at each temperature above 0, each with its own seed (``seed + prompt +
            1000 * sample``); greedy runs once. Two methods sample different texts from one seed (drafting decides
            how the random stream is used, never the law), so one sample per prompt also compares texts of
            different lengths; more samples average that out. Raises ValueError below 1.
        kinds: the kind of each prompt (code, chat, math, ...; ``prompts.prompt_kind``), as long as
            ``prompts_ids``: each run row gets its ``kind`` and ``by_kind`` holds the summary per (temperature, kind,
            method), its ratios against the same kind's baselines (``summarise``).
        keep_trace: called as ``keep_trace(label, sampling, trace)`` with each timed run of our engine (not the
            warm-up's), e.g. to save them for ``forensics --trace``.
    Token Recycling's matrix carries over from prompt to prompt within a temperature, as the method is meant to
    run (a session's matrix keeps learning), and so do the goodput fallback's rates (``engine/policies/fallback.py``)
    and the stop policy's online adaptation (``engine/stop_models/online.py``); each temperature starts afresh. A label
    ending in ``+carry=off`` carries nothing (``carries``).

    Returns:
        ``{"runs": [per run rows], "summary": [per (temperature, method) rows], "by_kind": [per (temperature,
        kind, method) rows] (with ``kinds``), "hf_assisted": settings}``.
    """
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    configs = dict(configs or {})
    unquantized = pair.unquantized_draft if pair.draft_quant != "none" else pair.draft
    if HF_ASSISTED_BF16 in methods and unquantized is None:
        raise ValueError(f"{HF_ASSISTED_BF16} needs the unquantized draft: load the pair with "
                         "keep_unquantized=True (the bench command does)")
    for m in methods:
        if m not in HF_METHODS and m not in configs:
            configs[m] = method_for_label(m)

    carried: dict = {}  # method -> what its last run learned for the next prompt (a Carried)

    def cache_of(method) -> dict:
        """The KV cache and graphs ``method`` runs with: a self-draft's moving exit layer needs the dynamic cache."""
        if configs[method].spec.self_draft:
            return {"kv_cache": "dynamic", "graphs": False, "chain_levels": 0}
        return {"kv_cache": kv_cache, "graphs": graphs, "chain_levels": chain_of(method, chain_levels),
                "joint_prefill": joint_prefill_of(method), "lanes": lanes_of(method)}

    decision_models: dict = {}  # model kind -> the model read from decision_dir

    def decision_model(config):
        if decision_dir is None or config.stop_policy_name() not in LEARNED_POLICIES:
            return None  # the engine loads the shipped one
        if config.decision_model not in decision_models:
            decision_models[config.decision_model] = load_decision_model(decision_dir, config.decision_model)
        return decision_models[config.decision_model]

    def one(method, ids, sampling, n, keep=False):
        if method == HF_ASSISTED:
            return run_hf_assisted(pair, ids, n, sampling)
        if method == HF_ASSISTED_BF16:
            return run_hf_assisted(pair, ids, n, sampling, draft=unquantized)
        if method == HF_PROMPT_LOOKUP:
            return run_hf_assisted(pair, ids, n, sampling, helper="lookup")
        if method == HF_GENERATE:
            return run_hf_assisted(pair, ids, n, sampling, helper="plain")
        earlier = carried.get(method)
        row = run_engine(pair, configs[method], ids, n, sampling, decision_model=decision_model(configs[method]),
                         carried=earlier, with_trace=keep and keep_trace is not None, **cache_of(method))
        learned = row.pop("carried")
        if "trace" in row:
            keep_trace(method, sampling, row.pop("trace"))
        if graphs and not cache_of(method)["graphs"]:
            row["eager"] = True  # asked for graphs, ran without (a self-draft): the report says so
        if carries(method):
            carried[method] = learned
        return row

    for _ in range(warmup if prompts_ids else 0):  # first calls pay for kernel selection and allocations
        for method in methods:
            one(method, prompts_ids[0], SamplingConfig(), 8)
    if graphs and warmup:  # each prompt's runners with every bucket captured: no timed step pays for a capture
        captured = sum(warm_graphs(pair, configs[m], ids, max_new_tokens, decision_model(configs[m]),
                                   chain_of(m, chain_levels), SamplingConfig(temperature=t, top_p=top_p))
                       for ids in prompts_ids for m in methods if m not in HF_METHODS and cache_of(m)["graphs"]
                       for t in temperatures)
        progress(f"warm-up: {captured} CUDA graphs captured")
    runs = []
    for temperature in temperatures:
        carried.clear()
        for n, ids in enumerate(prompts_ids):
            for sample in range(samples_at(temperature, samples)):
                sampling = SamplingConfig(temperature=temperature, top_p=top_p, seed=seed + n + 1000 * sample)
                for method in methods:
                    row = one(method, ids, sampling, max_new_tokens, keep=True)
                    row.update(temperature=temperature, method=method, prompt=n, sample=sample,
                               **({"kind": kinds[n]} if kinds else {}))
                    runs.append(row)
                    progress(f"T={temperature} prompt {n + 1}/{len(prompts_ids)} sample {sample + 1} {method}: "
                             f"{row['tokens_per_s']:.2f} tok/s")
    syncs: dict = {}  # (temperature, method) -> host syncs per step, from an extra untimed run (CUDA)
    if pair.device.type == "cuda" and prompts_ids:
        for temperature in temperatures:
            for method in (m for m in methods if m not in HF_METHODS):
                row = run_engine(pair, configs[method], prompts_ids[0], max_new_tokens,
                                 SamplingConfig(temperature=temperature, top_p=top_p, seed=seed),
                                 decision_model=decision_model(configs[method]), count_syncs=True,
                                 **cache_of(method))
                syncs[temperature, method] = row.get("host_syncs_per_step")
    summary = summarise(runs, methods, temperatures, configs, pair.draft, syncs)
    out = {"runs": runs, "summary": summary, "hf_assisted": hf_assisted_effective(pair.draft)}
    if kinds:
        out["by_kind"] = [dict(row, kind=kind) for kind in dict.fromkeys(kinds)
                          for row in summarise([r for r in runs if r["kind"] == kind], methods, temperatures,
                                               configs, pair.draft, {})]
    return out


def summarise(runs: list[dict], methods, temperatures, configs: dict, draft, syncs: dict) -> list[dict]:
    """Per (temperature, method): ``aggregate`` of its runs, and its tokens/s against the same runs' ``ar``,
    ``hf-assisted``, ``hf-assisted-bf16``, ``hf-prompt-lookup`` and the fastest transformers baseline there
    (``ratio_vs_best_hf``)."""
    summary = []
    for temperature in temperatures:
        base = {m: aggregate([r for r in runs if r["temperature"] == temperature and r["method"] == m])
                for m in methods}
        best_hf = max((base[m]["tokens_per_s"] or 0.0 for m in methods if m in HF_METHODS), default=0.0)
        for method in methods:
            agg = base[method]
            tps = agg["tokens_per_s"]

            def ratio(baseline, base=base, tps=tps):
                b = base.get(baseline, {}).get("tokens_per_s")
                return tps / b if b and tps else None

            cfg = configs.get(method)
            summary.append({"temperature": temperature, "method": method,
                            "config": cfg.to_dict() if cfg else hf_assisted_effective(draft), **agg,
                            "speedup_vs_ar": ratio("ar"), "ratio_vs_hf": ratio(HF_ASSISTED),
                            "ratio_vs_hf_bf16": ratio(HF_ASSISTED_BF16),
                            "ratio_vs_hf_lookup": ratio(HF_PROMPT_LOOKUP),
                            "ratio_vs_best_hf": tps / best_hf if best_hf and tps else None,
                            **_two_lane_ratios(agg, base),
                            "host_syncs_per_step": syncs.get((temperature, method)),
                            **({"eager": True} if any(r.get("eager") for r in runs if r["method"] == method) else {})})
    return summary



def _two_lane_ratios(agg: dict, base: dict) -> dict:
    """A PEARL row's two-lane tokens/s against the same runs' ``ar`` and ``sd`` (their own wall clock, on one
    lane: their drafting and verification cannot overlap); empty for other rows."""
    two = agg.get("two_lane_tokens_per_s")
    if not two:
        return {}
    out = {}
    for key, baseline in (("two_lane_speedup_vs_ar", "ar"), ("two_lane_ratio_vs_sd", "sd")):
        b = base.get(baseline, {}).get("tokens_per_s")
        out[key] = two / b if b else None
    return out
