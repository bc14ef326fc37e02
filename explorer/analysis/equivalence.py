"""Greedy equivalence check: every lossless method must reproduce ``ar``, and ``ar`` must reproduce transformers'
own greedy ``generate``, token for token.

In bf16 a batched (tree) verification can round differently from one-token decoding, so two correct decoders may
part where the target's two best logits are (nearly) tied. Where outputs diverge, ``divergence`` recomputes the
target's logits at that position with one plain forward and reports the gap between the two tokens; a gap within
``NEAR_TIE_ULPS`` bf16 units in the last place at that magnitude counts as a near-tie, anything larger is a bug.
"""

from __future__ import annotations

import math
import time

import torch

from ..engine.config import DEFAULTS, MethodConfig
from ..engine.factory import build_engine
from ..engine.sampling import SamplingConfig
from ..models.head_store import has_head
from ..models.pair import ModelPair

NEAR_TIE_ULPS = 4


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers (8 significant bits) around ``x``."""
    if x == 0:
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def hf_greedy(pair: ModelPair, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of the target (the reference for ``ar``)."""
    with torch.inference_mode(), pair.lock:
        out = pair.target.generate(torch.tensor([prompt_ids], device=pair.device), max_new_tokens=max_new_tokens,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long,
                                                             device=pair.device))
    return out[0, len(prompt_ids):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(pair: ModelPair, prompt_ids: list[int], reference: list[int], other: list[int]) -> dict | None:
    """Where ``other`` leaves ``reference``: position, both tokens, their target logits and whether it is a near-tie.

    Returns None when the two agree. Logits come from a plain forward over prompt + reference[:pos].
    """
    pos = first_difference(reference, other)
    if pos is None:
        return None
    if pos >= min(len(reference), len(other)):  # one stopped early (EOS): not a token disagreement
        return {"position": pos, "near_tie": False, "reason": "different lengths"}
    ctx = torch.tensor([prompt_ids + reference[:pos]], device=pair.device)
    with torch.inference_mode(), pair.lock:
        logits = pair.target(input_ids=ctx, logits_to_keep=1).logits[0, -1].float()
    a, b = reference[pos], other[pos]
    la, lb = float(logits[a]), float(logits[b])
    top2 = torch.topk(logits, 2).values.tolist()
    tol = NEAR_TIE_ULPS * bf16_ulp(max(abs(la), abs(lb)))
    return {"position": pos, "reference_token": a, "other_token": b, "reference_logit": la, "other_logit": lb,
            "gap": abs(la - lb), "top2_gap": top2[0] - top2[1], "tolerance": tol, "near_tie": abs(la - lb) <= tol,
            "reference_text": pair.tokenizer.decode([a]), "other_text": pair.tokenizer.decode([b])}


def check_prompt(pair: ModelPair, prompt_ids: list[int], max_new_tokens: int,
                 methods: dict[str, MethodConfig] | None = None) -> dict:
    """Run HF greedy generate, ``ar`` and every lossless method on one prompt (``eagle`` where a head is shipped
    for the target); compare as described above."""
    methods = methods or {m: c for m, c in DEFAULTS.items()
                          if m != "ar" and (not c.spec.uses_head or has_head(pair, c.head))}
    ref = hf_greedy(pair, prompt_ids, max_new_tokens)
    report = {"hf_generate": ref, "methods": {}}

    def run(cfg):
        eng = build_engine(pair, cfg, SamplingConfig(temperature=0.0))
        t0 = time.perf_counter()
        eng.start(prompt_ids, max_new_tokens)
        trace = eng.run()
        return trace.generated_ids, len(trace.steps), time.perf_counter() - t0

    ar_ids, ar_steps, ar_s = run(DEFAULTS["ar"])
    report["methods"]["ar"] = {"ids": ar_ids, "steps": ar_steps, "seconds": ar_s,
                               "matches": ar_ids == ref, "divergence": divergence(pair, prompt_ids, ref, ar_ids)}
    for name, cfg in methods.items():
        ids, steps, secs = run(cfg)
        report["methods"][name] = {"ids": ids, "steps": steps, "seconds": secs, "matches": ids == ar_ids,
                                   "divergence": divergence(pair, prompt_ids, ar_ids, ids)}
    return report
