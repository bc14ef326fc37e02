"""Per-forward wall time of each model, eager against a replayed CUDA graph, for k new query rows after a context.

    python scripts/forward_times.py --device cuda [--context 300] [--ks 1,16,64] [--repeats 30] [--fused-kernels on]

Eager: a plain forward on a dynamic cache cropped back after each call (what the engine did before issue 13).
Graph: ``graphs.GraphRunner`` on a static cache (captured once per bucket, then replayed). Prints one JSON line per
(model, k) with median ms and the largest |logit difference| between the two. The timings mean something on a GPU
only; on a CPU the runner pads and calls the model eagerly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from explorer.engine.runtime.graphs import BUCKETS, GraphRunner
from explorer.engine.runtime.kv_cache import DynamicKVCache, StaticKVCache
from explorer.models.loading import load_named_pair


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default", choices=["default", "tiny"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--ks", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--fused-kernels", default="off", choices=["on", "off"],
                    help="the models' norms, MLPs and rotary embedding compiled (models/fused_kernels.py)")
    args = ap.parse_args()
    pair = load_named_pair(args.models, device=args.device, draft_quant="none", fused=args.fused_kernels)
    gen = torch.Generator().manual_seed(0)
    top = min(5000, pair.vocab_size)
    ctx = torch.randint(10, top, (args.context,), generator=gen).tolist()
    for role in ("target", "draft"):
        model = getattr(pair, role)
        for k in (int(x) for x in args.ks.split(",")):
            new = torch.randint(10, top, (k,), generator=gen).tolist()
            pos = list(range(args.context, args.context + k))
            with torch.inference_mode():
                dyn = DynamicKVCache()
                model(input_ids=torch.tensor([ctx], device=pair.device), past_key_values=dyn.hf, use_cache=True)
                dyn.length = args.context
                runner = GraphRunner(model, StaticKVCache(model, args.context + k + max(BUCKETS) + 64))
                runner.forward(ctx, list(range(args.context)), None, 1)
                eager_ms, graph_ms = [], []
                for i in range(args.repeats + 3):
                    _sync(pair.device)
                    t0 = time.perf_counter()
                    ref = model(input_ids=torch.tensor([new], device=pair.device),
                                position_ids=torch.tensor([pos], device=pair.device), past_key_values=dyn.hf,
                                use_cache=True).logits[0]
                    _sync(pair.device)
                    t1 = time.perf_counter()
                    dyn.after_forward(k)
                    dyn.rewind(args.context)
                    got, _ = runner.forward(new, pos, None, k)
                    _sync(pair.device)
                    t2 = time.perf_counter()
                    runner.kv.rewind(args.context)
                    if i >= 3:  # the first calls pick kernels and capture the graph
                        eager_ms.append((t1 - t0) * 1e3)
                        graph_ms.append((t2 - t1) * 1e3)
                diff = float((got.float() - ref.float()).abs().max())
            print(json.dumps({"model": role, "k": k, "context": args.context, "device": str(pair.device),
                              "eager_ms": round(statistics.median(eager_ms), 3),
                              "graph_ms": round(statistics.median(graph_ms), 3), "max_abs_logit_diff": diff,
                              "captures": runner.captures, "replays": runner.replays}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
