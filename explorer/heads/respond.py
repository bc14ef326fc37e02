"""The target's own responses to prompts: the text a head trains on (the head then learns what the target says, in
the chat format it is run with). Batched greedy decoding with transformers' ``generate``; resumable (a prompt
already answered in the output file is skipped)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .data import HeadDataError, read_text


def records(path: Path) -> list[dict]:
    """The response records of the JSONL file ``path`` (gzipped when its name ends in ``.gz``; none when it does not
    exist). Raises HeadDataError for a line that is not one, or a file that is not text."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        text = read_text(path)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise HeadDataError(f"{path} is not a readable JSONL file ({exc})") from None
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
            if not isinstance(record["prompt"], str) or not isinstance(record["kind"], str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HeadDataError(f"{path} holds a line that is not a response record") from None
        out.append(record)
    return out


def answered(path: Path) -> set[str]:
    """The prompts already answered in the JSONL file ``path`` (none when it does not exist)."""
    return {r["prompt"] for r in records(path)}


def prompts_of(paths: list[str | Path]) -> list[tuple[str, str]]:
    """The ``(kind, prompt)`` pairs of earlier response files (``records``), in their order, each prompt once: for
    answering the same prompts again (sampled, ``heads respond --prompts --temperature``). Raises HeadDataError for
    a file that is missing, unreadable or holds no record."""
    seen, out = set(), []
    for path in paths:
        if not Path(path).is_file():
            raise HeadDataError(f"{path}: no such file")
        found = records(Path(path))
        if not found:
            raise HeadDataError(f"{path} holds no response record")
        for r in found:
            if r["prompt"] not in seen:
                seen.add(r["prompt"])
                out.append((r["kind"], r["prompt"]))
    return out


def respond(pair, prompts: list[tuple[str, str]], out: str | Path, *, max_new_tokens: int = 256, batch: int = 16,
            progress: bool = True, temperature: float = 0.0, seed: int = 0) -> Path:
    """Append to ``out`` (JSONL) one record per ``(kind, prompt)``: ``{"kind", "prompt", "text", "response",
    "complete"}``, where ``text`` is the chat-formatted prompt (the prompt itself for a tokenizer without a chat
    template) followed by the target's greedy response (at most ``max_new_tokens`` tokens, cut after the pair's
    first end-of-sequence token), as the target reads it when decoding, ``response`` the response alone as text (no
    special tokens) and ``complete`` whether it ended (an end-of-sequence token before the limit). Prompts of
    similar length are batched (left padding). With ``temperature`` above 0 the responses are sampled instead (top-p
    0.95; torch's global seed set from ``seed`` and the batch's place in the run, so one run is repeatable): for
    writing prompts (``heads respond --written --write-temperature``), where greedy writing of the same instruction
    writes the same text, or other paths through prompts answered before (``--prompts --temperature``). Returns
    ``out``.

    Raises:
        HeadDataError: ``out`` holds something else than response records.
    """
    from tqdm import tqdm

    out = Path(out)
    done = answered(out)
    todo = [(k, p) for k, p in prompts if p not in done]
    tok = pair.tokenizer
    formatted = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 if getattr(tok, "chat_template", None) else p for _, p in todo]  # a base model reads the prompt
    encoded = [tok.encode(f, add_special_tokens=False) for f in formatted]
    order = sorted(range(len(todo)), key=lambda i: len(encoded[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stops = set(pair.eos_token_ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="target responses", unit="prompt", disable=not progress)
    for start in range(0, len(order), batch):
        picks = order[start:start + batch]
        width = max(len(encoded[i]) for i in picks)
        ids = torch.tensor([[pad] * (width - len(encoded[i])) + encoded[i] for i in picks], device=pair.device)
        mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in picks],
                            device=pair.device)
        sampling = {"do_sample": False}
        if temperature > 0:
            torch.manual_seed(seed * 1_000_003 + start)
            sampling = {"do_sample": True, "temperature": temperature, "top_p": 0.95, "top_k": 0}
        with torch.inference_mode(), pair.lock:
            gen = pair.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       pad_token_id=pad, **sampling)
        with out.open("a", encoding="utf-8") as f:
            for row, i in enumerate(picks):
                reply = gen[row, width:].tolist()
                ends = [j for j, t in enumerate(reply) if t in stops]
                reply = reply[:ends[0] + 1] if ends else reply
                kind, prompt = todo[i]
                f.write(json.dumps({"kind": kind, "prompt": prompt,
                                    "text": formatted[i] + tok.decode(reply, skip_special_tokens=False),
                                    "response": tok.decode(reply, skip_special_tokens=True),
                                    "complete": bool(ends)}) + "\n")
        bar.update(len(picks))
    bar.close()
    return out
