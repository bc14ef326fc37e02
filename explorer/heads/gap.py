"""The gap between a head's teacher-forced agreement and its first-position acceptance in the engine, on the same
texts (``python -m explorer heads gap``).

For each prompt the engine runs ``eagle`` greedy (lossless: its output is the target's own answer), then the target
runs once over prompt and answer (``data.target_features``, as training data is built) and the head's level 1 reads
those features teacher-forced (``train.ttt_levels``' level 1). Both then face the same tokens:

* **teacher-forced**, at every answer position: the head's top-1 against the token the target committed, a miss split
  into *out of vocabulary* (the token is not among the head's draft tokens: no training can fix it) and *in
  vocabulary* (EAGLE-3 and SpecForge report agreement on in-vocabulary positions only, ``train.held_out_agreement``);
* **at the engine's steps** only (the positions where a step drafted its first level): the engine's first-position
  acceptance (any depth-1 head node committed; ``trace.metrics.first_acceptance``), teacher-forced top-1 and top-k
  (k = the depth-1 nodes the engine drafted), and how often the engine's most likely depth-1 token is the
  teacher-forced top-1: below 1 means the engine's features or cache differ from training's (vLLM PR 11672 found a
  norm mismatch that halved acceptance).

Row t of level 1 reads the target's features at position t and the token at t + 1, and drafts position t + 2; a step
whose anchor sits at L - 1 drafts position L from row L - 2.
"""

from __future__ import annotations

import torch

from ..analysis.prompts import encode_prompt
from ..engine.config import DEFAULTS
from ..engine.factory import build_engine
from ..engine.sampling import SamplingConfig
from ..models.eagle3 import HeadCache, HeadError
from ..models.head_store import head_for
from .data import target_features


def level1_logits(head, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The head's level-1 draft-vocabulary logits, teacher-forced over a whole sequence: ``states`` ``(n, 3, H)``,
    ``tokens`` int64 ``(n,)``. Row t reads the features at t and the token at t + 1 (it drafts position t + 2).
    Returns float32 ``(n - 1, draft_vocab)``."""
    device = head.fc.weight.device
    n = tokens.shape[0]
    with torch.inference_mode():
        logits, _ = head(tokens[1:].to(device), head.features(states[: n - 1].to(device)),
                         torch.arange(n - 1, device=device), HeadCache())
    return logits.float().cpu()


def answer_rows(tokens: torch.Tensor, n_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher-forced rows that draft an answer's tokens (``tokens[n_prompt:]``, int64 ``(n,)``): row t's level
    1 drafts position t + 2. Returns the rows and the tokens they should draft, int64 ``(answer positions,)`` each."""
    rows = torch.arange(max(n_prompt - 2, 0), max(tokens.shape[0] - 2, 0))
    return rows, tokens[rows + 2]


def _count_answer(c: dict, top: torch.Tensor, tokens: torch.Tensor, n_prompt: int, in_vocab: torch.Tensor) -> None:
    """Add to ``c`` the teacher-forced counts of every answer position (``answer_rows``): ``top`` the head's best
    target ids by row (``(n - 1, k)``), ``in_vocab`` bool ``(vocab,)`` (``t2d``)."""
    rows, want = answer_rows(tokens, n_prompt)
    c["positions"] += int(rows.shape[0])
    c["top1"] += int((top[rows, 0] == want).sum())
    c["oov"] += int((~in_vocab[want].bool()).sum())


def teacher_forced(pair, heads: dict, answers: list[dict]) -> dict:
    """Teacher-forced counts alone (no engine run) for several heads on the same earlier answers (``measure``'s
    ``answers``: ``{"kind", "ids", "prompt_tokens"}``; the target runs once per answer): ``{name: {"by_kind": {kind:
    summarise(...)}, "all": ...}}``, the engine's fields None. Raises HeadError for heads reading different target
    layers."""
    n_layers = pair.target.config.num_hidden_layers
    layers = {tuple(h.config.aux_layers(n_layers)) for h in heads.values()}
    if len(layers) != 1:
        raise HeadError(f"the heads read different target layers: {sorted(layers)}")
    pooled: dict[str, dict[str, dict]] = {name: {} for name in heads}
    for a in answers:
        ids, n_prompt = [int(i) for i in a["ids"]], int(a["prompt_tokens"])
        seq = target_features(pair, ids, next(iter(layers)))
        for name, head in heads.items():
            top = head.target_ids().cpu()[level1_logits(head, seq.states, seq.tokens).argmax(-1, keepdim=True)]
            _count_answer(pooled[name].setdefault(a["kind"], _empty()), top, seq.tokens, n_prompt, head.t2d.cpu())
    return {name: _report(kinds) for name, kinds in pooled.items()}


def _empty() -> dict:
    return {"positions": 0, "top1": 0, "oov": 0, "steps": 0, "engine_first": 0, "step_top1": 0, "step_topk": 0,
            "same_top1": 0, "tokens": 0, "calls": 0}


def _add(into: dict, counts: dict) -> dict:
    """``into`` with ``counts`` (``_empty``'s fields) added to it."""
    for key, value in counts.items():
        into[key] += value
    return into


def _report(kinds: dict[str, dict]) -> dict:
    """Pooled counts by kind -> ``{"by_kind": {kind: summarise(...)}, "all": summarise(every kind's)}``."""
    total = _empty()
    for acc in kinds.values():
        _add(total, acc)
    return {"by_kind": {k: summarise(v) for k, v in kinds.items()}, "all": summarise(total)}


def compare(pair, head, prompt: str, max_new_tokens: int = 128, head_path: str = "") -> dict:
    """One prompt's counts (``measure``'s fields, unpooled) and the answer's text. Raises EngineError where the
    engine cannot run the head."""
    config = DEFAULTS["eagle"].with_(fallback="off", tree_choice="fixed", head=head_path)
    engine = build_engine(pair, config, SamplingConfig(temperature=0.0))
    prompt_ids = encode_prompt(pair.tokenizer, prompt, chat_template=True)
    engine.start(prompt_ids, max_new_tokens, prompt_text=prompt)
    trace = engine.run()
    ids = list(prompt_ids) + list(trace.generated_ids)
    layers = head.config.aux_layers(pair.target.config.num_hidden_layers)
    seq = target_features(pair, ids, tuple(layers))
    logits = level1_logits(head, seq.states, seq.tokens)  # row t drafts position t + 2
    widest = max([sum(1 for n in s.nodes if n.depth == 1) for s in trace.steps] + [1])
    top = head.target_ids().cpu()[logits.topk(min(widest, logits.shape[1]), dim=-1).indices]  # best first
    tokens = seq.tokens
    c = _empty()
    _count_answer(c, top, tokens, len(prompt_ids), head.t2d.cpu())
    for step in trace.steps:
        anchor = step.nodes[0]
        first = [n for n in step.nodes[1:] if n.depth == 1 and n.source == "draft"]
        t = anchor.position_id - 1  # the anchor sits at L - 1; row L - 2 drafts position L
        if not first or t < 0 or t + 2 >= len(ids):
            continue
        want = int(tokens[t + 2])
        k = len(first)
        best = max(first, key=lambda n: n.q or 0.0)
        c["steps"] += 1
        c["engine_first"] += any(n.committed for n in first)
        c["step_top1"] += int(top[t, 0]) == want
        c["step_topk"] += want in top[t, :k].tolist()
        c["same_top1"] += best.token_id == int(top[t, 0])
    c["tokens"] = len(trace.generated_ids)
    c["calls"] = sum(s.target_calls for s in trace.steps) + 1  # the prefill
    return {"counts": c, "text": pair.tokenizer.decode(ids, skip_special_tokens=False), "ids": ids,
            "prompt_tokens": len(prompt_ids),
            "response": pair.tokenizer.decode(trace.generated_ids, skip_special_tokens=True)}


def summarise(c: dict) -> dict:
    """Rates from pooled counts (``compare``): ``teacher_forced_top1`` over answer positions, ``oov_miss`` and
    ``in_vocab_miss`` (shares of those positions), ``in_vocab_top1`` (top-1 over in-vocabulary positions, the
    recipes' figure); at the engine's steps ``engine_first`` (first-position acceptance), ``step_top1``,
    ``step_topk``, ``same_top1``; ``tokens_per_call``. None where nothing was counted."""
    def rate(a, b):
        return round(a / b, 4) if b else None
    p, s = c["positions"], c["steps"]
    return {"positions": p, "steps": s, "teacher_forced_top1": rate(c["top1"], p), "oov_miss": rate(c["oov"], p),
            "in_vocab_miss": rate(p - c["top1"] - c["oov"], p), "in_vocab_top1": rate(c["top1"], p - c["oov"]),
            "engine_first": rate(c["engine_first"], s), "step_top1": rate(c["step_top1"], s),
            "step_topk": rate(c["step_topk"], s), "same_top1": rate(c["same_top1"], s),
            "tokens_per_call": rate(c["tokens"], c["calls"])}


def measure(pair, records: list[dict], head_path: str = "", max_new_tokens: int = 128, progress=None) -> dict:
    """The gap by kind over ``records`` (``{"kind", "prompt"}``): ``{"by_kind": {kind: summarise(...)}, "all":
    ..., "answers": [{"kind", "prompt", "text", "response", "ids", "prompt_tokens"}]}`` (the target's answers,
    ``text`` chat-formatted with the prompt as ``heads respond`` writes it: held-out data for ``heads features``;
    ``ids`` the token ids of prompt and answer, the first ``prompt_tokens`` the prompt's). Raises HeadError (the
    head) or EngineError (a run)."""
    head, _ = head_for(pair, head_path)
    pooled: dict[str, dict] = {}
    answers = []
    for i, r in enumerate(records):
        got = compare(pair, head, r["prompt"], max_new_tokens, head_path)
        _add(pooled.setdefault(r["kind"], _empty()), got["counts"])
        answers.append({"kind": r["kind"], "prompt": r["prompt"], "text": got["text"], "response": got["response"],
                        "ids": got["ids"], "prompt_tokens": got["prompt_tokens"]})
        if progress:
            progress(f"{i + 1}/{len(records)} {r['kind']}: {summarise(got['counts'])}")
    return {**_report(pooled), "answers": answers}
