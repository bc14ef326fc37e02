"""Profile one prompt with the bf16 and the int8 draft: tokens/s, draft / verify seconds and calls, the share of
step time outside model forwards, and the four most expensive functions (cProfile around ``Engine.run``); then
``hf-assisted`` with the same draft. The "before / after" table of docs/bench.md.

    PYTHONPATH=. .venv/bin/python scripts/profile_methods.py [HUMANEVAL_INDEX]
"""

import cProfile
import io
import pstats
import sys
import time
import warnings

from explorer.analysis.bench import run_engine, run_hf_assisted
from explorer.analysis.prompts import encode_prompt, humaneval
from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.models.loading import load_default_pair, quantize_draft

warnings.filterwarnings("ignore")
base = load_default_pair()
ids = encode_prompt(base.tokenizer, humaneval()[int(sys.argv[1]) if len(sys.argv) > 1 else 0].text)
configs = [("ar", DEFAULTS["ar"]), ("sd", DEFAULTS["sd"]),
           ("mcsd-improved (2,2) d6", MethodConfig(method="mcsd-improved", k_config=(2, 2), max_depth=6,
                                                   stop="decision")),
           ("mcsd-improved default", DEFAULTS["mcsd-improved"])]
for quant in ("none", "int8"):
    pair = quantize_draft(base, quant)
    run_engine(pair, DEFAULTS["sd"], ids, 8, SamplingConfig())  # warm-up
    for name, cfg in configs:
        e = build_engine(pair, cfg, SamplingConfig())
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        e.start(ids, 128)
        prof.enable()
        e.run()
        prof.disable()
        wall = time.perf_counter() - t0
        st = e.trace.steps
        step_ms, fwd = sum(s.step_ms for s in st), sum(s.forward_ms for s in st)
        ps = pstats.Stats(prof, stream=io.StringIO())
        top = sorted(((v[2], f"{k[0].split('/')[-1]}:{k[2]}") for k, v in ps.stats.items()), reverse=True)[:4]
        print(f"{quant:5s} {name:24s} {len(e.trace.generated_ids) / wall:6.2f} tok/s  steps {len(st):3d}  "
              f"draft {sum(x.draft_ms for x in st) / 1e3:5.1f}s ({sum(x.draft_calls for x in st)} calls)  "
              f"verify {sum(x.verify_ms for x in st) / 1e3:5.1f}s ({sum(x.target_calls for x in st)} calls)  "
              f"outside forwards {100 * (step_ms - fwd) / step_ms:4.1f}%  top: "
              + ", ".join(f"{k} {v:.2f}s" for v, k in top), flush=True)
    hf = run_hf_assisted(pair, ids, 128, SamplingConfig())
    print(f"{quant:5s} hf-assisted              {hf['tokens_per_s']:6.2f} tok/s", flush=True)
