"""Where a step's host time goes on a GPU: implicit host synchronisations per step (``torch.cuda.set_sync_debug_mode``
turns each one into a warning; we count them by the Python line that caused it), the step timeline's phases, and
the most expensive functions of one run (cProfile).

    python scripts/gpu_syncs.py [--methods ar,sd,...] [--max-new-tokens 96] [--graphs]

Prints one JSON line per (method, temperature) and, for each method, the lines with the most syncs. On a CPU, where
nothing synchronises, it counts the reads of tensor values into Python instead, each of which is a synchronisation
on a GPU (``explorer/engine/runtime/host_reads.py``; an upper bound, and the counting slows the run several-fold, so
its tokens/s and phases mean nothing there): the same per-line list, for finding reads without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import time
import warnings

import torch

from explorer.analysis.prompts import encode_prompt, humaneval
from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.runtime.host_reads import HostReadCounter
from explorer.engine.runtime.timeline import phase_totals
from explorer.engine.sampling import SamplingConfig
from explorer.models.loading import load_named_pair


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default", choices=["default", "tiny"])
    ap.add_argument("--methods", default="ar,sd,mcsd-improved,prompt-lookup,token-recycling,hybrid")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile each run; print the top functions")
    args = ap.parse_args()
    pair = load_named_pair(args.models, device=None)
    ids = encode_prompt(pair.tokenizer, humaneval()[0].text)
    cuda = pair.device.type == "cuda"
    for method in args.methods.split(","):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            def run():
                eng = build_engine(pair, DEFAULTS[method], SamplingConfig(temperature=temperature, seed=0),
                             kv_cache="static" if args.graphs else "dynamic", graphs=args.graphs)
                eng.start(ids, args.max_new_tokens)
                eng.run()
                eng.release()
                return eng
            run()  # warm-up: graph capture, caches
            sites = collections.Counter()
            reads = None if cuda else HostReadCounter(sites=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                else:
                    reads.__enter__()
                prof = cProfile.Profile() if args.profile else None
                t0 = time.perf_counter()
                if prof:
                    prof.enable()
                eng = run()
                if prof:
                    prof.disable()
                seconds = time.perf_counter() - t0
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                else:
                    reads.__exit__(None, None, None)
                    sites.update(reads.sites)
            for w in caught:
                if "synchroniz" in str(w.message).lower():
                    sites[f"{w.filename.split('explorer/')[-1]}:{w.lineno}"] += 1
            steps = eng.trace.steps
            tokens = sum(len(s.committed_ids) for s in steps)
            totals = phase_totals(steps)
            fwd = sum(v for k, v in totals.items() if k.endswith("forward"))
            step_ms = sum(totals.values())
            print(json.dumps({
                "method": method, "T": temperature, "tokens": tokens, "steps": len(steps),
                "tok_s": round(tokens / seconds, 1), "implicit_syncs_per_step": round(sum(sites.values()) / len(steps), 1),
                "outside_forwards": round(1 - fwd / step_ms, 3) if step_ms else None,
                "phases_ms_per_step": {k: round(v / len(steps), 2) for k, v in totals.items()}}), flush=True)
            for site, n in sites.most_common(8):
                print(f"    {n / len(steps):6.1f}/step  {site}")
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                print("\n".join(s.getvalue().splitlines()[6:24]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
