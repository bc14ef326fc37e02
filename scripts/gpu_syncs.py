"""Where a step's host time goes on a GPU: implicit host synchronisations per step (``torch.cuda.set_sync_debug_mode``
turns each one into a warning; we count them by the Python line that caused it), the step timeline's phases, and
the most expensive functions of one run (cProfile).

    python scripts/gpu_syncs.py [--methods ar,sd,mcsd-improved+chain=16,...] [--max-new-tokens 96] [--graphs]
        [--fused-kernels off,on] [--dump DIR]

``--methods`` takes bench labels (``+chain=N`` for chain replays, ``+key=value`` settings). ``--fused-kernels off,on``
runs every method stock, then fuses the pair's kernels in place and runs them again (A/B in one process).
``--dump DIR`` writes each run's cProfile statistics (``.pstats``) and its steps' timelines (``.json``) there.
Each JSON line also gives the garbage collector's milliseconds in the timed run by generation (``--freeze``:
``gc.freeze()`` after the warm-up, which compiles and captures), and ``wall_ms_per_step``, the whole run's wall
clock (building the engine, prefill, steps, trace) per step, beside ``timed_ms_per_step``, the steps' timelines.

Prints one JSON line per (method, temperature) and, for each method, the lines with the most syncs. On a CPU, where
nothing synchronises, it counts the reads of tensor values into Python instead, each of which is a synchronisation
on a GPU (``explorer/engine/runtime/host_reads.py``; an upper bound, and the counting slows the run several-fold, so
its tokens/s and phases mean nothing there): the same per-line list, for finding reads without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import json
import os
import pstats
import time
import warnings

import torch

from explorer.analysis.bench import chain_of, method_for_label
from explorer.analysis.prompts import encode_prompt, humaneval
from explorer.engine.factory import build_engine
from explorer.engine.runtime.host_reads import HostReadCounter
from explorer.engine.runtime.timeline import phase_totals
from explorer.engine.sampling import SamplingConfig
from explorer.models.loading import fuse_pair, load_named_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default", choices=["default", "tiny"])
    ap.add_argument("--methods", default="ar,sd,mcsd-improved,prompt-lookup,token-recycling,hybrid")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile each run; print the top functions")
    ap.add_argument("--prompt", type=int, default=0, help="HumanEval prompt index")
    ap.add_argument("--fused-kernels", default="off", help="off, on, or off,on (both, in this order)")
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after each warm-up (compiled code, graphs)")
    ap.add_argument("--dump", default=None, help="folder for each run's .pstats and timelines .json")
    args = ap.parse_args()
    pair = load_named_pair(args.models, device=None)
    ids = encode_prompt(pair.tokenizer, humaneval()[args.prompt].text)
    cuda = pair.device.type == "cuda"
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for fused in args.fused_kernels.split(","):
        fuse_pair(pair, fused)
        for method in args.methods.split(","):
            for temperature in (float(t) for t in args.temperatures.split(",")):
                profile_run(args, pair, ids, cuda, fused, method, temperature)
    return 0


def profile_run(args, pair, ids, cuda: bool, fused: str, method: str, temperature: float) -> None:
    """A warm-up, a timed run (cProfile'd with ``--profile``) and a run counting host synchronisations of
    ``method`` (a bench label); prints the timed run's JSON line (phases per step, speculative and plain steps apart)
    and the lines that synchronise most."""
    def run():
        eng = build_engine(pair, method_for_label(method), SamplingConfig(temperature=temperature, seed=0),
                           kv_cache="static" if args.graphs else "dynamic", graphs=args.graphs,
                           chain_levels=chain_of(method) if args.graphs else 0)
        eng.start(ids, args.max_new_tokens)
        eng.run()
        eng.release()
        return eng

    run()  # warm-up: graph capture, caches, compiling
    if args.freeze:
        gc.collect()
        gc.freeze()
    gc_ms = collections.Counter()  # garbage collections during the timed run: ms by generation
    gc_t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_ms[info["generation"]] += (time.perf_counter() - gc_t0[0]) * 1e3

    prof = cProfile.Profile() if args.profile else None
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    eng = run()
    if prof:
        prof.disable()
    seconds = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    steps = eng.trace.steps
    tokens = sum(len(s.committed_ids) for s in steps)
    spec = [s for s in steps if (s.fallback or {}).get("speculate", True)]

    def per_step(group):
        totals = phase_totals(group)
        return {k: round(v / len(group), 3) for k, v in totals.items()} if group else {}

    totals = phase_totals(steps)
    fwd = sum(v for k, v in totals.items() if k.endswith("forward"))
    step_ms = sum(totals.values())
    sites = collections.Counter()
    reads = None if cuda else HostReadCounter(sites=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        else:
            reads.__enter__()
        counted = run()
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        else:
            reads.__exit__(None, None, None)
            sites.update(reads.sites)
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            sites[f"{w.filename.split('explorer/')[-1]}:{w.lineno}"] += 1
    n_counted = len(counted.trace.steps)
    draft_rows = sum(seg.get("rows", 0) for s in spec for seg in s.timeline if seg["phase"] == "draft forward")
    draft_fwds = sum(1 for s in spec for seg in s.timeline if seg["phase"] == "draft forward")
    print(json.dumps({
        "fused": fused, "method": method, "T": temperature, "tokens": tokens, "steps": len(steps),
        "speculative_steps": len(spec), "tok_s": round(tokens / seconds, 1),
        "wall_ms_per_step": round(seconds * 1e3 / len(steps), 3),
        "timed_ms_per_step": round(step_ms / len(steps), 3),
        "tokens_per_spec_step": round(sum(len(s.committed_ids) for s in spec) / len(spec), 2) if spec else None,
        "draft_forward_segments_per_spec_step": round(draft_fwds / len(spec), 2) if spec else None,
        "draft_rows_per_spec_step": round(draft_rows / len(spec), 2) if spec else None,
        "implicit_syncs_per_step": round(sum(sites.values()) / n_counted, 1),
        "outside_forwards": round(1 - fwd / step_ms, 3) if step_ms else None,
        "gc_ms_by_generation": {g: round(v, 1) for g, v in sorted(gc_ms.items())},
        "gc_tracked_objects": len(gc.get_objects()),
        "phases_ms_per_spec_step": per_step(spec),
        "phases_ms_per_plain_step": per_step([s for s in steps if s not in spec])}), flush=True)
    for site, n in sites.most_common(8):
        print(f"    {n / n_counted:6.1f}/step  {site}")
    name = f"{fused}-{method}-T{temperature}".replace("+", "_").replace("=", "")
    if args.dump:
        with open(os.path.join(args.dump, name + ".json"), "w") as f:
            json.dump([{"committed": len(s.committed_ids), "timeline": s.timeline,
                        "fallback": s.fallback, "drafter": {k: v for k, v in (s.drafter or {}).items()
                                                            if k in ("chain_replays", "plain")}}
                       for s in steps], f, default=str)
    if prof:
        if args.dump:
            prof.dump_stats(os.path.join(args.dump, name + ".pstats"))
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(20)
        print("\n".join(s.getvalue().splitlines()[6:30]))


if __name__ == "__main__":
    raise SystemExit(main())
