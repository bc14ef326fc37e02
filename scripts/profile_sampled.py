"""Profile the sampled path (temperature 0.7) of one method on one HumanEval prompt: tokens, wall time, time in
model forwards and the engine overhead for two seeds, then the costliest calls and the engine's own functions
(cProfile around ``Engine.run`` of the second seed). The "sampled path" figures of docs/bench.md.

    PYTHONPATH=. .venv/bin/python scripts/profile_sampled.py [METHOD] [HUMANEVAL_INDEX]
"""

import cProfile
import io
import pstats
import sys
import time
import warnings

from explorer.analysis.bench import run_engine
from explorer.analysis.prompts import encode_prompt, humaneval
from explorer.engine.config import DEFAULTS
from explorer.engine.factory import build_engine
from explorer.engine.sampling import SamplingConfig
from explorer.models.loading import load_named_pair

warnings.filterwarnings("ignore")
method = sys.argv[1] if len(sys.argv) > 1 else "mcsd"
pair = load_named_pair("default", draft_quant="int8")
ids = encode_prompt(pair.tokenizer, humaneval()[int(sys.argv[2]) if len(sys.argv) > 2 else 0].text)
run_engine(pair, DEFAULTS["sd"], ids, 8, SamplingConfig())  # warm-up
prof = cProfile.Profile()
for seed in range(2):
    engine = build_engine(pair, DEFAULTS[method], SamplingConfig(temperature=0.7, seed=seed))
    engine.start(ids, 128)
    t0 = time.perf_counter()
    if seed == 1:
        prof.enable()
    engine.run()
    prof.disable()
    wall = time.perf_counter() - t0
    forward = sum(s.forward_ms for s in engine.trace.steps) / 1e3
    print(f"{method} seed {seed}: {len(engine.trace.steps)} steps, {len(engine.trace.generated_ids)} tokens, "
          f"run {wall:.2f} s, forwards {forward:.2f} s, engine overhead {100 * (wall - forward) / wall:.1f} %")
stats = pstats.Stats(prof, stream=io.StringIO()).stats
print("costliest calls (own time s, cumulative s, calls):")
for own, cum, n, name in sorted(((v[2], v[3], v[0], f"{k[0].split('/')[-1]}:{k[2]}") for k, v in stats.items()),
                                reverse=True)[:15]:
    print(f"  {own:7.3f} {cum:7.3f} {n:6d} {name}")
print("the engine's functions (cumulative s, calls):")
for cum, n, name in sorted(((v[3], v[0], f"{k[0].split('/')[-1]}:{k[2]}") for k, v in stats.items()
                            if "/explorer/" in k[0]), reverse=True)[:20]:
    print(f"  {cum:7.3f} {n:6d} {name}")
