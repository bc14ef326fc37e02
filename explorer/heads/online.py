"""What online distillation does for a head (``engine/online_distill.py``), or for the draft model's LoRA adapter
(``engine/online_distill_draft.py``, ``--method sd``), on a stream of one kind of prompt (``python -m explorer heads
online``): held-out prompts of every kind drafted as loaded, then a stream of ``requests`` prompts of one kind with
the head or adapter learning between them, then the same held-out prompts drafted by what it learned (saved and
loaded back, as ``--head`` or ``--draft-adapter`` would load it, learning no further).

Prompts come from ``heads/prompts.py``'s templates with a seed of their own (none of the bench's sets; the head's
training used seed 0): the stream and the held-out prompts of its kind are disjoint draws, the other kinds' held-out
prompts a second seed's. The stream's kind can instead come from a file (``--prompts``), such as prompts the target
wrote itself. First-position acceptance is pooled over steps: steps whose first drafted level had a head
token accepted over steps that drafted one (``machine.head_summary`` per request).
"""

from __future__ import annotations

import random
import tempfile
import time

from ..analysis.online import learn_stream
from ..analysis.prompts import encode_prompt
from ..engine.config import DEFAULTS, MethodConfig
from ..engine.factory import build_engine
from ..engine.machine import head_summary
from ..engine.online_distill_draft import DraftDistiller
from ..engine.sampling import SamplingConfig
from ..models.eagle3 import HeadError, load_head
from ..models.head_store import head_for
from ..trace.metrics import first_acceptance
from ..trace.records import RunTrace
from .data import target_features
from .gap import answer_rows, level1_logits
from .prompts import KINDS


def stream_prompts(kind: str, requests: int, held_out: int, seed: int = 77) -> dict:
    """``{"stream": [...], "held_out": {kind: [...]}}``: ``requests`` prompts of ``kind`` to learn from and
    ``held_out`` more of every kind (``heads.prompts.KINDS``) never learnt from. Raises ValueError for an unknown
    kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    own = KINDS[kind](random.Random(seed), requests + held_out)
    others = {k: make(random.Random(seed + 1), held_out) for k, make in KINDS.items() if k != kind}
    return {"stream": own[:requests], "held_out": {kind: own[requests:], **others}}


def stream_prompts_from(prompts: list[tuple[str, str]], kind: str, requests: int, held_out: int,
                        seed: int = 77) -> dict:
    """``stream_prompts``'s split with the prompts of ``kind`` taken from given ``(kind, prompt)`` pairs (for
    instance those the target wrote itself, ``heads respond --written --write-only``), in their order: the first
    ``requests`` to learn from, the next ``held_out`` never learnt from; the other kinds' held-out prompts are the
    templates' (``stream_prompts``), so they match a template stream's. Raises ValueError for an unknown kind or
    when the pairs hold fewer than ``requests + held_out`` prompts of ``kind``."""
    own = [text for k, text in prompts if k == kind]
    if len(own) < requests + held_out:
        raise ValueError(f"the prompts hold {len(own)} of kind {kind!r}: {requests} requests and {held_out} held "
                         "out need more")
    drawn = stream_prompts(kind, 0, held_out, seed)
    return {"stream": own[:requests], "held_out": {**drawn["held_out"], kind: own[requests:requests + held_out]}}


def online_stream(pair, kind: str, requests: int = 32, held_out: int = 8, lr: float = 1e-4, every: int = 8,
                  max_new_tokens: int = 48, temperature: float = 0.0, head: str = "", seed: int = 77,
                  before: dict | None = None, progress=print, method: str = "eagle",
                  prompts: list[tuple[str, str]] | None = None, replay: int = 0, save: str = "") -> dict:
    """The experiment of the module docstring on ``pair`` with ``method``'s drafter: ``eagle``'s head (``head``: a
    folder, empty for the shipped one), or the draft model of ``sd`` / ``mcsd`` with a LoRA adapter
    (``engine/online_distill_draft.py``; ``head`` is then an adapter folder to start from, empty for a new one); its
    tree fixed (a tree sized online from wall times would make acceptance depend on the machine's load).
    ``before``: an earlier report's ``before`` for the same prompts and drafter, reused. Returns ``{"settings",
    "history" (per stream request), "before", "after" (per held-out kind: ``first_acceptance`` pooled, and
    ``tokens_per_call``), "seconds"}``. Raises ValueError for an unknown kind, a method that cannot learn online,
    or bad settings. ``replay``: earlier requests each update learns from again (``MethodConfig.distill_replay``).
    ``save``: a folder to keep what was learned in (``--head`` or ``--draft-adapter`` loads it). With a head, the
    report's ``paired_top1`` compares the two heads teacher-forced on the held-out answers (``paired_top1``).
    ``prompts``: ``(kind, prompt)`` pairs to draw the stream and the held-out prompts from
    (``stream_prompts_from``) instead of the templates."""
    source = "templates" if prompts is None else "given"
    prompts = (stream_prompts(kind, requests, held_out, seed) if prompts is None
               else stream_prompts_from(prompts, kind, requests, held_out, seed))
    if method not in DEFAULTS or not (DEFAULTS[method].spec.uses_head or DEFAULTS[method].distils_draft):
        raise ValueError(f"{method!r} cannot learn online: use eagle, or sd / mcsd for the draft's LoRA adapter")
    weights = "head" if DEFAULTS[method].spec.uses_head else "draft_adapter"
    base = DEFAULTS[method].with_(fallback="off", tree_choice="fixed", **{weights: head})
    sampling = SamplingConfig(temperature=temperature, seed=seed)
    t0 = time.perf_counter()

    def run(config: MethodConfig, text: str) -> RunTrace:
        engine = build_engine(pair, config, sampling)
        engine.start(encode_prompt(pair.tokenizer, text, chat_template=True), max_new_tokens, prompt_text=text)
        return engine.run()

    def held(config: MethodConfig, label: str, texts_of: list | None = None) -> dict:
        out = {}
        for k, texts in prompts["held_out"].items():
            traces = [run(config, text) for text in texts]
            if texts_of is not None:  # the held-out answers, for the paired teacher-forced measure
                texts_of += [{"kind": k, "ids": list(t.prompt_ids) + list(t.generated_ids),
                              "prompt_tokens": len(t.prompt_ids)} for t in traces]
            calls = sum(s.target_calls for t in traces for s in t.steps) + len(traces)  # each run's prefill
            out[k] = {"first_acceptance": first_acceptance([s for t in traces for s in t.steps]),
                      "tokens_per_call": sum(len(t.generated_ids) for t in traces) / calls}
            progress(f"[{label}] {k}: first-position acceptance {out[k]['first_acceptance']['rate']:.3f}, "
                     f"{out[k]['tokens_per_call']:.2f} tokens/call")
        return out

    clock = [time.perf_counter()]

    def told(n, engine, trace):
        row = engine.parts.distiller.history[-1]
        row["seconds"] = time.perf_counter() - clock[0]  # the run and the update that followed it
        clock[0] = time.perf_counter()
        first = head_summary(trace)["first_acceptance"]
        progress(f"[stream] {n}/{requests}: version {row['version']}, first-position acceptance "
                 f"{'n/a' if first is None else f'{first:.3f}'}"
                 + (f", update loss {row['loss']:.3f}" if row.get("updated") else ""))

    with tempfile.TemporaryDirectory() as fresh:
        if weights == "draft_adapter" and not head:  # before: a new adapter (B = 0), on the layers the learning uses
            DraftDistiller.for_draft(pair.draft, pair.vocab_size).save(fresh)
            base = base.with_(draft_adapter=fresh)
        before = before or held(base, "before")
        clock[0] = time.perf_counter()
        learning = base.with_(online_distill=True, distill_lr=lr, distill_every=every, distill_replay=replay)
        distiller = learn_stream(pair, prompts["stream"], learning, sampling, max_new_tokens, progress=told)
    answers: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        distiller.save(save or folder)
        after = held(base.with_(**{weights: save or folder}), "after", answers)
        paired = None
        if weights == "head":
            progress("[paired] both heads teacher-forced on the held-out answers")
            paired = paired_top1(pair, head_for(pair, head)[0], load_head(save or folder, target=pair.target),
                                 answers)
    return {"settings": {"method": method, "kind": kind, "prompts": source, "requests": requests,
                         "held_out": held_out, "lr": lr, "every": every, "replay": replay,
                         "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
                         weights: head or ("shipped" if weights == "head" else "new"), "version": distiller.version,
                         "draft_quant": pair.draft_quant},
            "history": distiller.history, "before": before, "after": after, "paired_top1": paired,
            "seconds": time.perf_counter() - t0}


def paired_top1(pair, before, after, answers: list[dict]) -> dict:
    """Two heads' teacher-forced level-1 top-1 (``heads.gap``'s measure) at the same answer positions, paired:
    ``answers`` ``{"kind", "ids", "prompt_tokens"}`` (the target runs once over each). Returns ``{kind: {"positions",
    "before", "after", "gained", "lost"}}``: positions each head gets right, and those only ``after`` (gained) or
    only ``before`` (lost) gets right. The change (after - before) / positions has the standard error sqrt(gained +
    lost) / positions (McNemar's pairs): at the same positions it resolves far smaller changes than the engine's
    first-position acceptance over a few prompts' steps. Raises HeadError for heads reading different layers."""
    n_layers = pair.target.config.num_hidden_layers
    layers = tuple(before.config.aux_layers(n_layers))
    if tuple(after.config.aux_layers(n_layers)) != layers:
        raise HeadError("the two heads read different target layers")
    out: dict[str, dict] = {}
    for a in answers:
        seq = target_features(pair, [int(i) for i in a["ids"]], layers)
        before_top, after_top = (h.target_ids().cpu()[level1_logits(h, seq.states, seq.tokens).argmax(-1)]
                                 for h in (before, after))
        rows, want = answer_rows(seq.tokens, int(a["prompt_tokens"]))
        b, f = before_top[rows] == want, after_top[rows] == want
        c = out.setdefault(a["kind"], {"positions": 0, "before": 0, "after": 0, "gained": 0, "lost": 0})
        for key, value in (("positions", rows.shape[0]), ("before", b.sum()), ("after", f.sum()),
                           ("gained", (f & ~b).sum()), ("lost", (b & ~f).sum())):
            c[key] += int(value)
    return out
