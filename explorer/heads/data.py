"""A head's training data: token sequences with the target's features and next-token distributions, computed once.

For each sequence of ``n`` tokens the target runs one forward (no cache) and the shard keeps, per position t: the
hidden states entering the head's three feature layers (``HeadConfig.aux_layers``; ``(n, 3, H)`` in the target's
dtype) and the target's ``LABEL_K`` most likely next tokens with their probabilities (a sparse soft label: the full
distribution over a 152k vocabulary would not fit on disk). Shards are safetensors files with a ``manifest.json``
beside them (the target, the layers, the sequences, the tokens); a folder whose manifest matches is reused.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

LABEL_K = 32
MANIFEST = "manifest.json"


class HeadDataError(ValueError):
    """Training data that cannot be built or read: the message says why."""


def read_text(path: Path) -> str:
    """The UTF-8 text of the file ``path``, gunzipped when its name ends in ``.gz`` (the response files shipped beside
    a head's card). Raises OSError (missing, or not gzip), EOFError (a cut gzip) or UnicodeDecodeError."""
    raw = path.read_bytes()
    return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")


@dataclass
class Sequence:
    """One cached sequence: ``tokens`` int64 ``(n,)``, ``states`` ``(n, 3, H)``, and at each position the target's
    next-token candidates ``label_ids`` int64 ``(n, LABEL_K)`` with probabilities ``label_probs`` float32."""

    tokens: torch.Tensor
    states: torch.Tensor
    label_ids: torch.Tensor
    label_probs: torch.Tensor


def chunk(token_lists: list[list[int]], seq_len: int) -> list[list[int]]:
    """Token lists cut into sequences of at most ``seq_len`` (shorter than 4 dropped: too short to train on)."""
    out = []
    for ids in token_lists:
        for start in range(0, len(ids), seq_len):
            piece = ids[start:start + seq_len]
            if len(piece) >= 4:
                out.append(piece)
    return out


def target_features(pair, ids: list[int], layers: tuple[int, ...]) -> Sequence:
    """One forward of ``pair``'s target over ``ids`` (no cache): the ``Sequence`` a head trains on, on the CPU, states
    in the target's dtype (the inputs of ``layers``, transformers' ``hidden_states[id]``)."""
    with torch.inference_mode(), pair.lock:
        out = pair.target(input_ids=torch.tensor([ids], device=pair.device), output_hidden_states=True)
    states = torch.stack([out.hidden_states[j][0] for j in layers], dim=1)
    top = out.logits[0, :, : pair.vocab_size].float().softmax(-1).topk(LABEL_K, dim=-1)
    return Sequence(torch.tensor(ids, dtype=torch.long), states.contiguous().cpu(), top.indices.cpu(),
                    top.values.cpu())


def build(pair, sequences: list[list[int]], layers: tuple[int, ...], folder: str | Path,
          progress: bool = True) -> Path:
    """Run the target over ``sequences`` and cache what a head trains on in ``folder`` (one shard per sequence).
    Reuses a folder whose manifest names the same target, layers and sequences. Returns the folder.

    Raises:
        HeadDataError: no sequence to cache.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    if not sequences:
        raise HeadDataError("no training sequence: give texts of at least 4 tokens")
    folder = Path(folder)
    manifest = {"target": pair.target_id, "layers": list(layers), "label_k": LABEL_K,
                "sequences": len(sequences), "tokens": sum(len(s) for s in sequences),
                "sha256": hashlib.sha256(json.dumps(sequences).encode()).hexdigest()}
    if (folder / MANIFEST).is_file():
        try:
            if json.loads((folder / MANIFEST).read_text()) == manifest:
                return folder
        except json.JSONDecodeError:
            pass
    folder.mkdir(parents=True, exist_ok=True)
    for i, ids in enumerate(tqdm(sequences, desc="target features", unit="seq", disable=not progress)):
        seq = target_features(pair, ids, layers)
        save_file({"tokens": seq.tokens, "states": seq.states, "label_ids": seq.label_ids,
                   "label_probs": seq.label_probs}, str(folder / f"{i:06d}.safetensors"))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return folder


def load(folder: str | Path, device=None) -> list[Sequence]:
    """The cached sequences of ``folder``. Raises HeadDataError without a manifest or with a shard that does not
    read."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise HeadDataError(f"{folder} holds no head training data ({MANIFEST} missing)")
    out = []
    for path in sorted(folder.glob("*.safetensors")):
        try:
            t = load_file(str(path), device=str(device or "cpu"))
            out.append(Sequence(t["tokens"], t["states"], t["label_ids"], t["label_probs"].float()))
        except (OSError, KeyError, ValueError) as exc:
            raise HeadDataError(f"cannot read {path}: {exc}") from None
    return out


def load_all(folders: list[str | Path], device=None) -> tuple[list[Sequence], list[dict]]:
    """The cached sequences of every folder in ``folders`` (in that order) and their manifests. Raises
    HeadDataError as ``load`` does, or when the folders' manifests name different targets or layers."""
    data, manifests = [], []
    for folder in folders:
        data.extend(load(folder, device))
        manifests.append(json.loads((Path(folder) / MANIFEST).read_text()))
    if len({(m["target"], tuple(m["layers"])) for m in manifests}) > 1:
        raise HeadDataError("the data folders hold features of different targets or layers: "
                            + ", ".join(f"{f}: {m['target']} {m['layers']}" for f, m in zip(folders, manifests)))
    return data, manifests


def draft_vocabulary(data: list[Sequence], size: int, vocab: int, data_share: float = 1.0) -> list[int]:
    """The ``size`` target ids a head drafts among, ascending: first the ``data_share`` of them that are the data's
    most frequent next tokens (the target's best candidate at every position, then the tokens themselves), then the
    lowest ids not yet chosen. A byte-pair tokenizer numbers its tokens in merge order, which follows their frequency
    in the text it was built on, so the low ids stand for text the data lacks (on the kinds set 8,192 tokens from
    135k tokens of data left 23 % of the target's greedy tokens outside; the second shipped head's 12,288, a
    quarter by id, 17.7 %). With ``data_share`` 1, fewer than ``size`` when the data has fewer distinct tokens."""
    if not 0.0 <= data_share <= 1.0:
        raise ValueError(f"data_share {data_share} is not between 0 and 1")
    counts = token_counts(data, vocab)
    seen = int((counts > 0).sum())
    chosen = {int(t) for t in counts.topk(min(round(size * data_share), max(seen, 1), size)).indices}
    if data_share < 1.0:
        rest = (i for i in range(vocab) if i not in chosen)
        chosen.update(next(rest) for _ in range(min(size, vocab) - len(chosen)))
    return sorted(chosen)


def token_counts(data: list[Sequence], vocab: int) -> torch.Tensor:
    """int64 ``(vocab,)``: how often each target id is the target's best next token or a token of ``data``."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in data:
        counts += torch.bincount(s.label_ids[:, 0].clamp(max=vocab - 1), minlength=vocab)
        counts += torch.bincount(s.tokens.clamp(max=vocab - 1), minlength=vocab)
    return counts


def swapped_vocabulary(data: list[Sequence], draft_ids: list[int], vocab: int, swaps: int,
                       min_count: int = 2) -> list[int]:
    """``draft_ids`` (a trained head's draft vocabulary) with up to ``swaps`` of its tokens exchanged for tokens of
    ``data`` it lacks, ascending, the same size. In: the data's most frequent missing tokens seen at least
    ``min_count`` times; out: the draft tokens the data uses least (ties: the highest ids, a byte-pair tokenizer's
    rarest merges); a pair is swapped only when the incoming token is the more frequent. Fine-tuning on text of
    other kinds than the head first learned (languages, prose) otherwise keeps its tokens undraftable: on the
    fourth shipped head's self-instruct responses 14 % of the target's tokens were outside its 12,288.

    Raises:
        ValueError: ``swaps`` negative."""
    if swaps < 0:
        raise ValueError(f"swaps {swaps} is negative")
    counts = token_counts(data, vocab)
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[torch.tensor(draft_ids, dtype=torch.long)] = True
    missing = torch.where(~inside & (counts >= min_count))[0]
    incoming = missing[counts[missing].argsort(descending=True, stable=True)][:swaps].tolist()
    # least used first; among equals the highest id first (flip, then a stable ascending sort by count)
    present = torch.tensor(sorted(draft_ids, reverse=True), dtype=torch.long)
    outgoing = present[counts[present].argsort(stable=True)][:len(incoming)].tolist()
    pairs = [(i, o) for i, o in zip(incoming, outgoing) if counts[i] > counts[o]]
    chosen = set(draft_ids) - {o for _, o in pairs} | {i for i, _ in pairs}
    return sorted(chosen)


def grown_vocabulary(data: list[Sequence], draft_ids: list[int], size: int, vocab: int) -> list[int]:
    """``draft_ids`` (a trained head's draft vocabulary) grown to ``size`` target ids, ascending: every one of them
    kept, then the data's most frequent tokens they lack (``token_counts``), then the lowest ids. Raises ValueError
    for a ``size`` below ``len(draft_ids)`` or above ``vocab``."""
    if not len(draft_ids) <= size <= vocab:
        raise ValueError(f"a draft vocabulary of {len(draft_ids)} cannot grow to {size} (the target has {vocab})")
    counts = token_counts(data, vocab)
    counts[torch.tensor(draft_ids, dtype=torch.long)] = -1
    chosen = set(draft_ids)
    for t in counts.argsort(descending=True, stable=True).tolist():
        if len(chosen) >= size or counts[t] <= 0:
            break
        chosen.add(t)
    rest = (i for i in range(vocab) if i not in chosen)
    chosen.update(next(rest) for _ in range(size - len(chosen)))
    return sorted(chosen)


def coverage(data: list[Sequence], sizes: list[int], vocab: int, held_out: list[Sequence] = ()) -> list[dict]:
    """The coverage curve a draft vocabulary's size is chosen from: for each size N, the share of the target's
    favourite tokens (``label_ids[:, 0]``, what a greedy target commits) in ``held_out`` (default: ``data`` itself)
    among ``data``'s N most frequent tokens (``token_counts``: favourites and text; the rest by lowest id, as
    ``grown_vocabulary`` fills). On its own data the curve reaches 1 at the data's distinct tokens; on held-out text it
    shows what a larger vocabulary buys. Returns ``[{"size", "covered"}]``."""
    counts = token_counts(data, vocab)
    counts = counts * (vocab + 1) + torch.arange(vocab, 0, -1)  # ties and unseen tokens: the lowest ids first
    favourites = torch.zeros(vocab, dtype=torch.long)
    for s in held_out or data:
        favourites += torch.bincount(s.label_ids[:, 0].clamp(max=vocab - 1), minlength=vocab)
    total = max(int(favourites.sum()), 1)
    order = counts.argsort(descending=True)
    return [{"size": n, "covered": round(int(favourites[order[:n]].sum()) / total, 4)} for n in sizes]


def generation_prompt(tokenizer) -> list[int]:
    """The token ids a chat template writes before an answer (Qwen's ``<|im_start|>assistant\\n``): the template of
    one user message with the generation prompt, less the same without it, encoded as the training texts are.

    Raises:
        HeadDataError: the tokenizer has no chat template, or its generation prompt is empty or not a suffix."""
    messages = [{"role": "user", "content": "x"}]
    try:
        with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except (ValueError, AttributeError) as exc:
        raise HeadDataError(f"the tokenizer has no chat template to find answers by: {exc}") from None
    if not with_prompt.startswith(without) or not with_prompt[len(without):]:
        raise HeadDataError("the chat template's generation prompt is empty or not a suffix: answers cannot be found")
    return tokenizer.encode(with_prompt[len(without):], add_special_tokens=False)


def answer_masks(data: list[Sequence], marker: list[int]) -> list[torch.Tensor]:
    """Which tokens of ``data`` belong to an answer: for each sequence a bool ``(n,)``. ``marker`` is the chat
    template's generation prompt (``generation_prompt``) and its first id opens every turn. The sequences are read
    as one stream in order (a text's chunks are consecutive, ``chunk``), so a chunk cut inside an answer or a marker
    continues it: a token is an answer's after a marker, up to and including its end-of-turn token, until the next
    turn opens; text before any turn (no chat template) counts as an answer. SpecForge and speculators take the loss
    on the assistant's tokens alone: a head drafts answers, never the user's prompt."""
    if not marker:
        raise HeadDataError("an empty generation prompt marks no answer")
    stream = torch.cat([s.tokens for s in data]).tolist() if data else []
    inside, m, answer = True, len(marker), [False] * len(stream)
    i = 0
    while i < len(stream):
        if stream[i:i + m] == marker:
            inside, i = True, i + m  # the marker itself is the template's, not the answer's
            continue
        if stream[i] == marker[0]:
            inside = False
        answer[i] = inside
        i += 1
    out, start = [], 0
    for s in data:
        n = s.tokens.shape[0]
        out.append(torch.tensor(answer[start:start + n], dtype=torch.bool))
        start += n
    return out
