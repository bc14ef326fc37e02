"""Training an EAGLE-3 head on cached target features, with training-time test.

The recipe follows EAGLE-3 (Li et al. 2025, arXiv 2503.01840) as SpecForge and vLLM's ``speculators`` run it:

* **Soft labels**: at every level the head's draft-vocabulary distribution is fitted to the target's own next-token
  distribution restricted to the draft vocabulary (soft cross-entropy); positions whose target favourite lies outside
  the draft vocabulary are left out.
* **Training-time test** over ``ttt`` levels: level 1 reads the target's features (causal over the sequence); level
  j reads the head's own output of level j - 1 as its feature and the true token, and attends to the level-1 rows up
  to its chain's start and to its own chain's rows of the levels before, exactly as drafting does
  (``engine/drafters/eagle.py``). Level j's loss weighs ``decay ** (j - 1)``.
* **Started from the target** (``init_from_target``): the head's LM head holds the target's output rows of the
  draft vocabulary and its final norm the target's, ``fc`` passes the last feature layer through and the layer's
  output projections start at zero, so a fresh head already maps its output into the target's token space (the
  target's logit lens of that layer) and has to learn to step one position ahead, not the map to tokens as well.
* AdamW, a short warm-up then a cosine decay of the learning rate, gradient clipping, one sequence a step; the
  target's token embedding is read, never trained. ``autocast="bfloat16"`` runs the matrix products in bfloat16 (the
  weights and the optimizer stay float32): 1.8x faster per step on the AVX-512-BF16 CPU the head was trained on.
* Held-out data (``eval_folders``): the top-1 agreement of each level with the target on sequences never trained on,
  at every save; the gap to the training agreement shows how much of it is memorised.

* **The target's output layer** (``tie_lm_head``): the head's ``lm_head`` is the target's output rows at its draft
  ids, frozen and never stored (vLLM's speculators starts from those rows; EAGLE-1 used the target's LM head). A
  trained head can be grown (``reshape``: a larger draft vocabulary, a wider MLP), its kept tokens' logits unchanged.
* Several passes (``epochs``, each in a new order), the best save by held-out score kept in ``out/best`` and early
  stopping (``patience``), as EAGLE-3's and SpecForge's recipes train for several epochs.

Resumable: ``train_state.safetensors`` (the head and the optimizer's moments, never a pickled file) and
``train_state.json`` beside the saved head; a run started again on the same folder goes on from the last save.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..models.eagle3 import (Eagle3Head, HeadCache, HeadConfig, HeadError, load_head, random_head,
                              rope_theta_of, save_head, verifier_rows)
from .data import (Sequence, answer_masks, draft_vocabulary, generation_prompt, grown_vocabulary, load_all,
                   swapped_vocabulary)

STATE = "train_state"


def head_config(target, layers: tuple[int, ...], draft_vocab: int, intermediate: int | None = None) -> HeadConfig:
    """A head shaped after ``target`` (its hidden size, attention heads, RoPE, vocabulary), reading ``layers``,
    with ``draft_vocab`` draft tokens and an MLP ``intermediate`` wide (default: the target's, else 4 x hidden)."""
    c = target.config
    heads = c.num_attention_heads
    width = intermediate or getattr(c, "intermediate_size", None) or 4 * c.hidden_size  # GPT-2, OPT: no such field
    return HeadConfig(hidden_size=c.hidden_size, intermediate_size=width,
                      num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
                      draft_vocab_size=draft_vocab, rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
                      rope_theta=rope_theta_of(c.to_dict()),
                      max_position_embeddings=int(getattr(c, "max_position_embeddings", 32768)),
                      aux_layer_ids=tuple(layers))


def init_from_target(head: Eagle3Head, target, draft_ids: list[int]) -> None:
    """Start ``head`` from ``target`` (module docstring): ``lm_head`` = the target's output rows ``draft_ids``,
    ``norm`` = the target's final norm, ``fc`` = identity on the last feature layer (zeros elsewhere), the
    attention's and the MLP's output projections zero (the layer starts as the identity on ``g``)."""
    out = target.get_output_embeddings().weight
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    h = head.config.hidden_size
    with torch.no_grad():
        head.lm_head.weight.copy_(out[torch.tensor(draft_ids, device=out.device)].float())
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            head.norm.weight.copy_(final_norm.weight.float())
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * h:].copy_(torch.eye(h))
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()


def set_draft_vocabulary(head: Eagle3Head, target, draft_ids: list[int]) -> None:
    """Give ``head`` the draft vocabulary ``draft_ids`` (ascending target ids, as many as it has): a token it keeps
    keeps its ``lm_head`` row, a new one gets the target's output row (as ``init_from_target`` starts a head);
    ``d2t`` and ``t2d`` follow (``Eagle3Head.set_target_ids``). Raises HeadError (a ValueError) for another number
    of ids."""
    weight = output_rows(head, target, draft_ids)
    head.set_target_ids(torch.tensor(draft_ids, dtype=torch.long))
    with torch.no_grad():
        head.lm_head.weight.copy_(weight)


def output_rows(head: Eagle3Head, target, draft_ids: list[int]) -> torch.Tensor:
    """``lm_head`` rows for the draft vocabulary ``draft_ids`` (target ids): ``head``'s own row for a token it has,
    the target's output row for a new one. Returns ``(len(draft_ids), H)`` in ``head``'s dtype and device."""
    row = {t: i for i, t in enumerate(head.target_ids().tolist())}
    out = target.get_output_embeddings().weight
    with torch.no_grad():
        weight = out[torch.tensor(draft_ids, device=out.device)].to(head.lm_head.weight)
        kept = [i for i, t in enumerate(draft_ids) if t in row]
        weight[kept] = head.lm_head.weight[[row[draft_ids[i]] for i in kept]]
    return weight


def reshape(head: Eagle3Head, target, draft_ids: list[int] | None = None, intermediate: int | None = None,
            tie_lm_head: bool = False, seed: int = 0) -> Eagle3Head:
    """A trained ``head`` made larger: an MLP ``intermediate`` wide (the new neurons' input rows random and small,
    their output columns zero, so the kept tokens' logits are unchanged until they learn), the draft vocabulary
    ``draft_ids`` (ascending target ids; a kept token keeps its ``lm_head`` row, a new one gets the target's output
    row, as ``set_draft_vocabulary``, and may outrank kept ones), and with ``tie_lm_head`` its output layer the
    target's rows at the draft ids, frozen and not stored (``HeadConfig.lm_head_from_verifier``). Returns a new
    float32 head on ``head``'s device, its embedding the target's. Raises HeadError for a narrower MLP or a head
    with its own embedding."""
    if head.embed_tokens is not None:
        raise HeadError("a head with its own token embedding cannot be reshaped (its embedding would be lost)")
    c = head.config
    width = intermediate or c.intermediate_size
    if width < c.intermediate_size:
        raise HeadError(f"the MLP can only grow: {c.intermediate_size} -> {width}")
    ids = list(draft_ids) if draft_ids is not None else head.target_ids().tolist()
    config = replace(c, intermediate_size=width, draft_vocab_size=len(ids),
                     lm_head_from_verifier=c.lm_head_from_verifier or tie_lm_head)
    grown = random_head(config, seed=seed, draft_ids=ids).to(device=head.fc.weight.device, dtype=torch.float32)
    own, state = head.state_dict(), grown.state_dict()
    gate, up, down = (f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
    n = c.intermediate_size
    with torch.no_grad():
        for name, value in own.items():
            if name not in (gate, up, down, "lm_head.weight", "d2t", "t2d"):
                state[name].copy_(value)
        for name in (gate, up):
            state[name][n:].mul_(0.1)  # new neurons start small ...
            state[name][:n].copy_(own[name])
        state[down].zero_()  # ... and add nothing until they learn
        state[down][:, :n].copy_(own[down])
        state["lm_head.weight"].copy_(output_rows(head, target, ids))
    grown.set_embeddings(target.get_input_embeddings())
    if config.lm_head_from_verifier:
        tie_to_target(grown, target)
    return grown


def tie_to_target(head: Eagle3Head, target) -> None:
    """Set ``head``'s output layer to the target's rows at its draft ids and freeze it (``reshape``)."""
    rows = verifier_rows(target, head.d2t, head.config.draft_vocab_size)
    with torch.no_grad():
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight))
    head.lm_head.weight.requires_grad_(False)


def learning_rate(step: int, steps: int, peak: float, warmup: int = 20) -> float:
    """The learning rate at ``step`` of ``steps``: linear warm-up over ``warmup`` steps to ``peak``, then a cosine
    decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def ttt_levels(head: Eagle3Head, seq: Sequence, ttt: int,
               keep: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The head's draft-vocabulary logits at every training-time-test level of one sequence (module docstring):
    level j's row t (t < n - ttt) reads the token at t + j and, as its feature, level j - 1's output at row t (the
    target's features at level 1); it sits at position t + j - 1 and sees the level-1 rows 0 .. t and its own
    chain's rows of the earlier levels, as the drafter's tree rows do. ``keep``: per level a bool ``(n - ttt,)``,
    the rows whose logits are wanted (the output layer, up to half a tied head's step, runs on those alone; every
    row still feeds the next level). Returns ``ttt`` tensors ``(n - ttt, draft_vocab)`` float32, or ``(kept rows,
    draft_vocab)`` with ``keep``."""
    n = seq.tokens.shape[0]
    rows = n - ttt  # every level reads rows 0 .. rows - 1 (their tokens and labels exist at every level)
    if rows < 1:
        raise ValueError(f"a sequence of {n} tokens is too short for {ttt} levels")
    device = head.fc.weight.device
    cache, t = HeadCache(), torch.arange(rows, device=device)
    g = head.features(seq.states[:rows].to(device))
    tril = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    eye = torch.eye(rows, dtype=torch.bool, device=device)
    out = []
    for j in range(1, ttt + 1):
        mask = torch.cat([tril] + [eye] * (j - 1), dim=1)
        g = head.step(seq.tokens[j:j + rows].to(device), g, t + (j - 1), cache, mask)
        out.append(head.logits(g if keep is None else g[keep[j - 1]]))
    return out


def ttt_loss(head: Eagle3Head, seq: Sequence, ttt: int, decay: float, to_draft: torch.Tensor,
             counted: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """The training-time-test loss of one sequence (``ttt_levels``; soft cross-entropy against the target's
    distribution restricted to the draft vocabulary, level j weighed ``decay ** (j - 1)``) and each level's top-1
    agreement with the target (on positions that count). ``to_draft``: int64 ``(vocab,)``, the draft id of each
    target id, -1 outside the draft vocabulary; ``counted``: bool ``(n,)``, the positions whose next token the loss
    takes (``next_in_answer``; default all). Returns the loss (a scalar with gradients) and the agreements."""
    device = head.fc.weight.device
    rows = seq.tokens.shape[0] - ttt
    drafts, valids = [], []  # per level: the labels' draft ids and the rows the loss takes, known before the head runs
    for j in range(1, ttt + 1):
        ids, probs = seq.label_ids[j:j + rows].to(device), seq.label_probs[j:j + rows].to(device)
        draft = to_draft[ids]  # (rows, K) draft ids, -1 outside
        valid = (draft[:, 0] >= 0) & ((probs * (draft >= 0)).sum(-1) > 0)
        if counted is not None:
            valid &= counted[j:j + rows].to(device)
        drafts.append((draft[valid], probs[valid]))
        valids.append(valid)
    total, agree = torch.zeros((), device=device), []
    for j, logits in enumerate(ttt_levels(head, seq, ttt, keep=valids), start=1):
        draft, probs = drafts[j - 1]
        if not draft.shape[0]:
            agree.append(0.0)
            continue
        label = torch.zeros_like(logits).scatter_add_(1, draft.clamp(min=0), probs * (draft >= 0))
        label = label / label.sum(-1, keepdim=True)
        total = total + decay ** (j - 1) * -(label * logits.log_softmax(-1)).sum(-1).mean()
        agree.append(float((logits.argmax(-1) == draft[:, 0]).float().mean()))
    return total, agree


def held_out_agreement(head: Eagle3Head, data: list[Sequence], ttt: int, to_draft: torch.Tensor,
                       autocast: str | None = None, counted: list[torch.Tensor] | None = None) -> list[float]:
    """Each level's top-1 agreement with the target over all positions of ``data`` that count (as ``ttt_loss``:
    the target's favourite in the draft vocabulary; with ``counted``, one bool ``(n,)`` per sequence, only where
    it is set), without training. Returns ``ttt`` fractions."""
    device = head.fc.weight.device
    hits, counts = [0] * ttt, [0] * ttt
    with torch.no_grad(), _autocast(device, autocast):
        for i, seq in enumerate(data):
            if seq.tokens.shape[0] <= ttt:
                continue
            rows = seq.tokens.shape[0] - ttt
            drafts = [to_draft[seq.label_ids[j:j + rows, 0].to(device)] for j in range(1, ttt + 1)]
            valids = [d >= 0 for d in drafts]
            if counted is not None:
                valids = [v & counted[i][j:j + rows].to(device) for j, v in enumerate(valids, start=1)]
            for j, logits in enumerate(ttt_levels(head, seq, ttt, keep=valids), start=1):
                hits[j - 1] += int((logits.argmax(-1) == drafts[j - 1][valids[j - 1]]).sum())
                counts[j - 1] += int(valids[j - 1].sum())
    return [round(h / max(c, 1), 4) for h, c in zip(hits, counts)]


def next_in_answer(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The positions whose next token is an answer's (``data.answer_masks``), the ``counted`` of ``ttt_loss``: a
    position's label is the target's distribution for the token after it. A chunk's last position takes its own
    token's answer flag (its next token opens the following chunk)."""
    return [torch.cat([m[1:], m[-1:]]) for m in masks]


def _autocast(device: torch.device, dtype: str | None):
    """``torch.autocast`` to ``dtype`` (a torch dtype's name) on ``device``'s type, or a no-op for None."""
    if not dtype:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def train_head(pair, data_folder: str | Path | list[str | Path], out: str | Path, *, draft_vocab: int = 8192,
               intermediate: int | None = None, steps: int = 1000, lr: float = 1e-4, ttt: int = 3,
               decay: float = 0.8, clip: float = 0.5, seed: int = 0, device: str | None = None,
               save_every: int = 100, save_dtype: torch.dtype | None = None, progress: bool = True,
               command: str = "", vocab_data_share: float = 1.0, autocast: str | None = None,
               eval_folders: list[str | Path] = (), freeze_lm_head: bool = False,
               init: str | Path | None = None, swap_vocab: int = 0, tie_lm_head: bool = False,
               grow_vocab: int = 0, grow_mlp: int = 0, epochs: float = 0.0, patience: int = 0,
               loss_on: str = "all") -> dict:
    """Train (or go on training) a head for ``pair``'s target on the cached data of ``data_folder``, saving it in
    ``out`` in the checkpoint format (``models/eagle3.save_head``) with its facts (``card.json``: data, command,
    steps, time, loss and agreement by level) and the training state (float32 weights and the optimizer's moments,
    so a resumed run loses nothing to the saved head's dtype). Returns the card's facts.

    Args:
        data_folder: one folder of cached features (``data.build``) or several, trained on together.
        draft_vocab, vocab_data_share: draft tokens, that share of them the data's most frequent and the rest the
            lowest ids (``data.draft_vocabulary``); intermediate: the MLP's
            width (default the target's); steps: sequences trained on in all (resumed runs count what was done);
            lr, clip: AdamW's peak learning rate (``learning_rate``) and the gradient norm clip; ttt, decay:
            training-time-test levels and their loss weights; device: where to train (default the pair's);
            save_every: steps between saves; save_dtype: the saved head's dtype (default the target's);
            autocast: a dtype name (``"bfloat16"``) for the matrix products, or None for float32 throughout;
            eval_folders: held-out cached features (``held_out_agreement`` at each save); freeze_lm_head: keep
            ``lm_head`` the target's output rows (as EAGLE-1 kept the target's LM head), half the parameters fewer
            to fit on little data.
        init: a head checkpoint folder to start from instead of the target's rows (fine-tuning a trained head on new
            data: its shape, layers and draft vocabulary are kept, the optimizer and learning-rate schedule are
            new; ``draft_vocab``, ``vocab_data_share`` and ``intermediate`` are then not used). Ignored when ``out``
            holds a state to go on from.
        swap_vocab: with ``init``, exchange up to this many of its draft tokens for the data's frequent tokens it
            lacks (``data.swapped_vocabulary``; an incoming token's ``lm_head`` row starts as the target's).
        tie_lm_head: the head's output layer is the target's output rows at its draft ids, frozen and not stored
            (``HeadConfig.lm_head_from_verifier``; the bytes it frees can go to the MLP).
        grow_vocab, grow_mlp: with ``init``, a draft vocabulary of this many tokens (``data.grown_vocabulary``) and
            an MLP this wide (``reshape``); 0 keeps the head's.
        epochs: passes over the data (``steps`` = epochs x the sequences; each pass in a new order); 0 uses
            ``steps``.
        patience: with ``eval_folders``, stop when the held-out score (the levels' agreements weighed as the loss
            weighs them) has not risen for this many saves; 0 trains every step. The best save is kept in
            ``out/best`` either way.
        loss_on: ``"all"`` positions, or ``"answers"``: only those whose next token is an assistant answer's
            (``data.answer_masks`` by the tokenizer's chat template; SpecForge's and speculators' loss mask), in
            training and in the held-out agreement; sequences with no such position are skipped. A resumed run
            must name the setting it started with.
    Raises:
        HeadDataError: no data in a folder, or folders of different targets or layers; HeadError: a saved state that
        does not fit this run, or an ``init`` head that does not load, fit the target or read the data's layers;
        ValueError: ``swap_vocab``, ``grow_vocab`` or ``grow_mlp`` without ``init`` for a new run, a
            vocabulary that cannot grow to ``grow_vocab``, ``patience`` without ``eval_folders``, an unknown
            ``loss_on`` or one that differs from the resumed run's.
        HeadDataError (also): ``loss_on="answers"`` with a tokenizer that has no chat template.
    """
    if patience and not eval_folders:
        raise ValueError("early stopping (patience, --patience) needs held-out data (eval_folders, --eval-data)")
    if loss_on not in ("all", "answers"):
        raise ValueError(f"loss_on {loss_on!r}: choose 'all' or 'answers'")
    started = time.perf_counter()
    folders = [data_folder] if isinstance(data_folder, (str, Path)) else list(data_folder)
    data, manifests = load_all(folders)
    held_out = load_all(eval_folders)[0] if eval_folders else []
    manifest = manifests[0] if len(manifests) == 1 else {
        "target": manifests[0]["target"], "layers": manifests[0]["layers"],
        "sequences": sum(m["sequences"] for m in manifests), "tokens": sum(m["tokens"] for m in manifests),
        "folders": manifests}
    device = torch.device(device) if device else pair.device
    out = Path(out)
    state_file, info_file = out / f"{STATE}.safetensors", out / f"{STATE}.json"
    if info_file.is_file() and state_file.is_file():  # go on from the last save
        info = json.loads(info_file.read_text())
        head = load_head(out, target=pair.target, device=device, dtype=torch.float32)
        done, draft_ids = int(info["step"]), head.target_ids().tolist()
    elif init is not None:
        head = load_head(init, target=pair.target, device=device, dtype=torch.float32)
        layers = head.config.aux_layers(pair.target.config.num_hidden_layers)
        if tuple(layers) != tuple(manifest["layers"]):
            raise HeadError(f"the head in {init} reads target layers {tuple(layers)}, the data's features are of "
                            f"layers {tuple(manifest['layers'])}")
        draft_ids = head.target_ids().tolist()
        info, done = {"step": 0, "seconds": 0.0, "history": [], "init": str(init)}, 0
        if swap_vocab:
            new_ids = swapped_vocabulary(data, draft_ids, pair.target.config.vocab_size, swap_vocab)
            info["vocab_swapped"] = len(set(new_ids) - set(draft_ids))
            set_draft_vocabulary(head, pair.target, new_ids)
            draft_ids = new_ids
        if grow_vocab or grow_mlp or tie_lm_head:
            if grow_vocab:
                draft_ids = grown_vocabulary(data, draft_ids, grow_vocab, pair.target.config.vocab_size)
            head = reshape(head, pair.target, draft_ids, grow_mlp or None, tie_lm_head, seed)
            info["reshaped"] = {"draft_vocab": len(draft_ids), "intermediate": head.config.intermediate_size,
                                "tie_lm_head": head.config.lm_head_from_verifier}
    else:
        if swap_vocab or grow_vocab or grow_mlp:
            raise ValueError("a vocabulary swap or growth, or a wider MLP (--swap-vocab, --grow-vocab, --grow-mlp) "
                             "needs a trained head to start from (init, --init): a new head is shaped by "
                             "--draft-vocab and --intermediate")
        draft_ids = draft_vocabulary(data, draft_vocab, pair.target.config.vocab_size, vocab_data_share)
        config = head_config(pair.target, tuple(manifest["layers"]), len(draft_ids), intermediate)
        if tie_lm_head:
            config = replace(config, lm_head_from_verifier=True)
        head = random_head(config, seed=seed, draft_ids=draft_ids)
        init_from_target(head, pair.target, draft_ids)
        head = head.to(device=device, dtype=torch.float32)
        head.set_embeddings(pair.target.get_input_embeddings())
        info, done = {"step": 0, "seconds": 0.0, "history": []}, 0
    head.train()
    head.lm_head.weight.requires_grad_(not (freeze_lm_head or head.config.lm_head_from_verifier))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if done and state_file.is_file():
        moments = load_file(str(state_file), device=str(device))
        with torch.no_grad():
            for name, p in head.named_parameters():
                if f"param.{name}" in moments:  # a tied lm_head is not saved: the target's rows, read at load
                    p.copy_(moments[f"param.{name}"])
        for name, p in head.named_parameters():
            if not p.requires_grad:
                continue
            opt.state[p] = {"step": torch.tensor(float(done)), "exp_avg": moments[f"exp_avg.{name}"],
                            "exp_avg_sq": moments[f"exp_avg_sq.{name}"]}
    to_draft = torch.full((pair.target.config.vocab_size,), -1, dtype=torch.long, device=device)
    to_draft[torch.tensor(draft_ids, device=device)] = torch.arange(len(draft_ids), device=device)
    if info.setdefault("loss_on", loss_on) != loss_on:
        raise ValueError(f"{out} was trained with the loss on {info['loss_on']}, not {loss_on}: go on as it started "
                         "or train into a new folder")
    counted, held_counted = [None] * len(data), None  # per sequence: the positions the loss takes (None: all)
    if loss_on == "answers":
        marker = generation_prompt(pair.tokenizer)
        counted = next_in_answer(answer_masks(data, marker))
        held_counted = next_in_answer(answer_masks(held_out, marker)) if held_out else None
    usable = [(s, c) for s, c in zip(data, counted) if s.tokens.shape[0] > ttt and (c is None or bool(c[1:].any()))]
    if epochs:
        steps = math.ceil(epochs * len(usable))
    info.pop("stopped_early", None)  # a resumed run decides again, with this run's patience
    orders: dict[int, list[int]] = {}  # a new order each pass, the same for a resumed run
    recent: list[tuple[float, list[float]]] = []
    bar = tqdm(total=steps, initial=done, desc="head training", unit="seq", disable=not progress)
    for step in range(done, steps):
        if patience and _stale(info, patience):  # checked before a step: a resumed stale run trains no further
            info["stopped_early"] = step
            (out / f"{STATE}.json").write_text(json.dumps(info, indent=1) + "\n")
            break
        epoch = step // len(usable)
        if epoch not in orders:
            gen = torch.Generator().manual_seed(seed + 1000 * epoch)
            orders[epoch] = torch.randperm(len(usable), generator=gen).tolist()
        seq, seq_counted = usable[orders[epoch][step % len(usable)]]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        with _autocast(device, autocast):
            loss, agree = ttt_loss(head, seq, ttt, decay, to_draft, seq_counted)
        if loss.requires_grad:  # else no position the loss takes has its label in the draft vocabulary: no update,
            opt.zero_grad(set_to_none=True)  # and nothing recorded (its 0 loss and agreement would skew the card's)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            recent = (recent + [(float(loss.detach()), agree)])[-50:]
        bar.update(1)
        if recent:
            bar.set_postfix(loss=f"{sum(r[0] for r in recent) / len(recent):.3f}")
        if (step + 1) % save_every == 0 or step + 1 == steps:
            held = held_out_agreement(head, held_out, ttt, to_draft, autocast, held_counted) if held_out else None
            dtype = save_dtype or next(pair.target.parameters()).dtype
            info = _save(head, opt, out, step + 1, info, recent, time.perf_counter() - started, dtype, held)
            started = time.perf_counter()
            if held is not None:
                score = held_out_score(held, decay)
                if score > (info.get("best") or {}).get("score", -1.0):
                    info["best"] = {"step": step + 1, "score": score, "held_out": held}
                    _write_head(head, out / "best", dtype)
                    (out / f"{STATE}.json").write_text(json.dumps(info, indent=1) + "\n")
    bar.close()
    card = {"steps": info["step"], "seconds": round(info["seconds"], 1), "sequences": len(usable),
            "tokens": manifest["tokens"], "draft_vocab": len(draft_ids), "ttt": ttt, "lr": lr,
            "loss": info["history"][-1]["loss"] if info["history"] else None,
            "agreement_by_level": info["history"][-1]["agreement"] if info["history"] else [],
            "held_out_agreement_by_level": (info["history"][-1].get("held_out") or []) if info["history"] else [],
            "autocast": autocast, "vocab_data_share": vocab_data_share, "freeze_lm_head": freeze_lm_head,
            "data": manifest, "command": command, "parameters": sum(p.numel() for p in params),
            "init": info.get("init"), "vocab_swapped": info.get("vocab_swapped", 0),
            "tie_lm_head": head.config.lm_head_from_verifier, "intermediate": head.config.intermediate_size,
            "reshaped": info.get("reshaped"), "epochs": round(info["step"] / max(len(usable), 1), 2),
            "best": info.get("best"), "stopped_early": info.get("stopped_early"), "decay": decay,
            "loss_on": info["loss_on"]}
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return card


def held_out_score(agreement: list[float], decay: float) -> float:
    """One number for early stopping and the best save: the levels' held-out agreements weighed as ``ttt_loss``
    weighs the levels (``decay ** (j - 1)``), normalised."""
    weights = [decay ** j for j in range(len(agreement))]
    return sum(w * a for w, a in zip(weights, agreement)) / max(sum(weights), 1e-9)


def _stale(info: dict, patience: int) -> bool:
    """Whether ``patience`` saves with a held-out measure have passed since the best one."""
    best = (info.get("best") or {}).get("step")
    if best is None:
        return False
    return sum(1 for h in info.get("history", []) if h.get("held_out") is not None and h["step"] > best) >= patience


def _write_head(head: Eagle3Head, folder: Path, dtype) -> None:
    """Save a copy of ``head`` on the CPU in ``dtype`` (the training head stays float32 where it is)."""
    saved = Eagle3Head(head.config)
    saved.load_state_dict({k: v.detach().cpu() for k, v in head.state_dict().items()})
    save_head(saved.to(dtype), folder)


def _save(head: Eagle3Head, opt, out: Path, step: int, info: dict, recent, seconds: float, dtype,
          held: list[float] | None = None) -> dict:
    """Write the head (in ``dtype``), the optimizer's moments and the progress; returns the progress record."""
    _write_head(head, out, dtype)
    moments = {}
    for name, p in head.named_parameters():
        if name == "lm_head.weight" and head.config.lm_head_from_verifier:
            continue  # the target's rows: never stored
        st = opt.state.get(p, {})
        moments[f"param.{name}"] = p.detach().float().cpu().contiguous()
        if "exp_avg" in st:
            moments[f"exp_avg.{name}"] = st["exp_avg"].detach().cpu().contiguous()
            moments[f"exp_avg_sq.{name}"] = st["exp_avg_sq"].detach().cpu().contiguous()
    save_file(moments, str(out / f"{STATE}.safetensors"))
    levels = len(recent[0][1]) if recent else 0
    entry = {"step": step, "loss": round(sum(r[0] for r in recent) / max(len(recent), 1), 4),
             "agreement": [round(sum(r[1][j] for r in recent) / len(recent), 4) for j in range(levels)]}
    if held is not None:
        entry["held_out"] = held
    info = {**info, "step": step, "seconds": info.get("seconds", 0.0) + seconds,
            "history": info.get("history", []) + [entry]}
    (out / f"{STATE}.json").write_text(json.dumps(info, indent=1) + "\n")
    return info
