"""Online speculative decoding for the EAGLE-3 head (OSD: Liu et al., ICML 2024, arXiv 2310.07177; the reference
code is LiuXiaoxuanPKU/OSD, ``distill/distill_trainer.py``): while it serves, the head learns the target's own
distributions at the positions where its tokens were rejected.

What a request leaves (``HeadDistiller.read``, ``rejected``, fed by ``drafters/eagle.py``):

* the rows the head read, as the engine gave them: at each committed position t the target's hidden states of the
  head's three layers and the token at t + 1 (its level-1 input, ``VerifiedStep.target_states``);
* one **rejection** per step where the verifier rejected the head's tokens: the row t whose chain drafted them, the
  level d that drafted them (d - 1 of the chain's tokens were accepted before), and the target's plain distribution
  at that position (its ``LABEL_K`` best tokens), which verification computed anyway. These are the logits that
  produced the rejected tokens; the bonus token's position, one further, is not trained on (the reference code's
  index is one off there).

Between requests only (``Engine`` calls ``end_request`` when a run finishes, so the head never changes between
drafting and verifying a step, and every step stays lossless), every ``every`` requests the head takes one AdamW
step on the forward KL ``KL(p || q)`` from the target's distribution (restricted to the draft vocabulary) to the
head's, averaged over the rejections buffered since the last update; the buffer then empties, or, with a replay
window of R requests, keeps the last R requests' records for the next updates as well. The chains are
recomputed as drafting computed them (training-time test, ``heads/train.py``): level 1 over every row read, level j
at a rejection's row from level j - 1's output. All the head's weights learn but the target's embedding it reads.
OSD's settings: learning rate 1e-4 every 8 requests, or 1e-5 every request.

The distiller holds the session's own copy of the head (``HeadDistiller.for_head``): a shared pair's head stays as
loaded. ``version`` counts the updates; each step's record says which version drafted it.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models.eagle3 import Eagle3Head, HeadCache, save_head
from .config import MAX_BUFFERED

LABEL_K = 32  # the target's best tokens kept per rejection (as the head's training data keeps them)
DISTILL_FILE = "distill.json"


@dataclass
class Rejection:
    """One step's rejected head tokens: ``row`` the position t whose chain drafted them, ``level`` the chain's level
    d, ``ids`` / ``probs`` the target's ``LABEL_K`` best tokens and plain probabilities at position t + d + 1."""

    row: int
    level: int
    ids: list[int]
    probs: list[float]


@dataclass
class RequestRecord:
    """What one request leaves for the update: ``start`` the first row read, ``tokens`` the token after each row
    (and, once the request ends, the committed tokens after the last), ``states`` their target states (normal
    tensors, float32 on the head's device) and the ``rejections``."""

    start: int = 0
    tokens: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(s.shape[0] for s in self.states)


class OnlineDistiller:
    """What the head's and the draft's online distillation share: the schedule (one AdamW step at ``lr`` every
    ``every`` requests, over the records of the requests since the last step and, with ``replay`` R, of the R
    requests before them too), the finished requests' records waiting for the next update, and the history by
    request.
    A subclass records a request (``begin``, its own ``rejected``), says what of it is kept (``_finish``) and takes
    the step (``update``).

    Args:
        params: the weights that learn. lr: the AdamW learning rate. every: requests between two updates (>= 1).
        replay: requests (with rejections) whose records an update keeps for the next ones (0: none, OSD's; at most
            ``MAX_BUFFERED``).
    Attributes:
        version: updates so far (0: as loaded). requests: requests seen.
        history: one row per request: ``{"request", "version", "first_acceptance", "tokens_per_call",
            "rejections"}`` (the version that drafted it), then ``loss`` / ``updated`` where an update followed.
    Raises ``error`` (ValueError, or the subclass's): ``lr`` not positive, ``every`` below 1 or ``replay`` outside
    [0, ``MAX_BUFFERED``].
    """

    error: type[ValueError] = ValueError

    def __init__(self, params, lr: float, every: int, replay: int = 0):
        if not lr > 0 or int(every) < 1 or not 0 <= int(replay) <= MAX_BUFFERED:
            raise self.error(f"online distillation needs a positive learning rate, every >= 1 and a replay in "
                             f"[0, {MAX_BUFFERED}], got {lr}, {every}, {replay}")
        self.lr, self.every, self.replay = float(lr), int(every), int(replay)
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr, weight_decay=0.0)
        self.version, self.requests = 0, 0
        self.history: list[dict] = []
        self.buffer: list = []

    def describe(self) -> dict:
        """Plain data for a run's trace: the settings, the version and the requests seen."""
        return {"lr": self.lr, "every": self.every, "replay": self.replay, "version": self.version,
                "requests": self.requests}

    def set_schedule(self, lr: float, every: int, replay: int = 0) -> None:
        """Learn at ``lr`` every ``every`` requests, replaying ``replay`` earlier requests, from now on (a session's
        settings changed)."""
        self.lr, self.every, self.replay = float(lr), int(every), int(replay)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def end_request(self, committed: list[int], summary: dict) -> bool:
        """The request finished with ``committed`` (prompt and output ids): its record goes to the buffer (where
        ``_finish`` keeps it and it has a rejection), and every ``every`` requests the weights are updated.
        ``summary``: the run's ``first_acceptance`` and ``tokens_per_call`` for the history. Returns whether they
        were updated."""
        rec, keep = self._finish(committed)
        if keep and rec.rejections:
            self.buffer = (self.buffer + [rec])[-MAX_BUFFERED:]
        self.requests += 1
        row = {"request": self.requests, "version": self.version, "rejections": len(rec.rejections), **summary}
        self.history.append(row)
        if self.requests % self.every:
            return False
        loss = self.update()
        row.update(updated=loss is not None, **({"loss": loss} if loss is not None else {}))
        return loss is not None

    def _finish(self, committed: list[int]):
        """The finished request's record, cut to what the update can use, and whether it may be kept; the next
        request starts a new record."""
        raise NotImplementedError

    def update(self) -> float | None:
        """One step over the buffered records (``_take``); the loss before it, or None."""
        raise NotImplementedError

    def _take(self) -> list:
        """The buffered records for an update; the buffer keeps the last ``replay`` of them for the next ones."""
        records = self.buffer
        self.buffer = records[-self.replay:] if self.replay else []
        return records


class HeadDistiller(OnlineDistiller):
    """A session's online distillation of an EAGLE-3 head (module docstring; the schedule and history:
    ``OnlineDistiller``).

    Args:
        head: the session's own head (``for_head`` copies a loaded one); updated in place.
        lr, every: as ``OnlineDistiller``'s.
    Raises ValueError: ``lr`` not positive or ``every`` below 1.
    """

    def __init__(self, head: Eagle3Head, lr: float = 1e-4, every: int = 8):
        for p in head.parameters():  # the session's own copy: every weight learns but a tied output layer
            p.requires_grad_(p.dtype.is_floating_point)
        if head.config.lm_head_from_verifier:  # the target's rows: frozen
            head.lm_head.weight.requires_grad_(False)
        super().__init__([p for p in head.parameters() if p.dtype.is_floating_point and p.requires_grad], lr, every)
        self.head = head
        self._current = RequestRecord()

    @classmethod
    def for_head(cls, head: Eagle3Head, lr: float = 1e-4, every: int = 8) -> HeadDistiller:
        """A distiller of a copy of ``head`` (float32; the target's embedding it reads stays shared, not copied)."""
        shared = {id(m): m for m in head._target_embed}
        own = copy.deepcopy(head, memo=shared).float()
        own._target_embed = head._target_embed
        return cls(own, lr, every)

    # ------------------------------------------------------------------ a request's record

    def begin(self) -> None:
        """A new request (or a rewound one): nothing read yet."""
        self._current = RequestRecord()

    def read(self, start: int, tokens: list[int], states: torch.Tensor) -> None:
        """The head read rows ``start`` .. ``start + n - 1``: ``tokens`` the token after each, ``states`` ``(n, 3,
        H)`` (inference tensors are copied). Rows that do not follow the last ones start the record afresh."""
        rec = self._current
        if rec.states and rec.start + rec.rows != start:
            rec = self._current = RequestRecord()
        if not rec.states:
            rec.start = start
        with torch.inference_mode(False):
            rec.states.append(states.detach().float().clone())
        rec.tokens.extend(int(t) for t in tokens)

    def rejected(self, row: int, level: int, ids: list[int], probs: list[float]) -> None:
        """A step's head tokens at chain level ``level`` from row ``row`` were rejected; the target's best tokens
        ``ids`` with plain probabilities ``probs`` at that position."""
        self._current.rejections.append(Rejection(int(row), int(level), list(ids), list(probs)))

    def _finish(self, committed: list[int]) -> tuple[RequestRecord, bool]:
        """Every token after each row read (and beyond), and the rejections within the rows read and the text; a
        request whose rows were never read is not kept."""
        rec, self._current = self._current, RequestRecord()
        if rec.states:
            rec.tokens = [int(t) for t in committed[rec.start + 1:]]  # every token after each row, and beyond
            rec.rejections = [r for r in rec.rejections if rec.start <= r.row < rec.start + rec.rows
                              and r.row + r.level <= len(committed) - 1]
        return rec, bool(rec.states)

    # ------------------------------------------------------------------ the update

    def update(self) -> float | None:
        """One AdamW step on the mean forward KL over the buffered rejections (``_take``). Returns the loss before
        the step, or None where nothing was buffered (or no rejection's target token is in the draft vocabulary)."""
        records = self._take()
        if not records:
            return None
        head = self.head
        to_draft = _to_draft(head)
        self.optimizer.zero_grad(set_to_none=True)
        total, count = None, 0
        with torch.enable_grad():
            for rec in records:
                terms = _record_kl(head, rec, to_draft)
                if terms is None:
                    continue
                kl, n = terms
                total = kl if total is None else total + kl
                count += n
            if total is None:
                return None
            loss = total / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.version += 1
        return float(loss.detach())

    # ------------------------------------------------------------------ saving

    def save(self, folder: str | Path) -> Path:
        """Write the learned head (``save_head``: it loads with ``--head`` like any) and ``distill.json`` (settings,
        version, history) into ``folder``. Returns the folder."""
        folder = Path(folder)
        save_head(self.head, folder)
        (folder / DISTILL_FILE).write_text(json.dumps({**self.describe(), "history": self.history}, indent=1),
                                           encoding="utf-8")
        return folder


def _to_draft(head: Eagle3Head) -> torch.Tensor:
    """int64 ``(vocab,)``: the draft id of each target id, -1 outside the draft vocabulary."""
    ids = head.target_ids()
    out = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
    out[ids] = torch.arange(ids.numel(), device=ids.device)
    return out


def chain_logits(head: Eagle3Head, rec: RequestRecord) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """The head's draft-vocabulary logits along the committed chains of one request, as drafting computed them
    (with gradients where enabled): level 1 over every row read (each row sees the rows before it), level j > 1 at
    the rows of the rejections at level j or deeper, from level j - 1's output, each chain seeing the level-1 rows up
    to its own and its own earlier levels (``heads.train.ttt_levels``). Returns level -> (logits ``(rows,
    draft_vocab)`` float32, the rows' positions)."""
    device = head.fc.weight.device
    states = torch.cat(rec.states).to(device)
    n, start = states.shape[0], rec.start
    tokens = torch.tensor(rec.tokens, dtype=torch.long, device=device)  # tokens[i]: the token after row start + i
    cache = HeadCache()
    logits, g = head(tokens[:n], head.features(states), torch.arange(start, start + n, device=device), cache)
    levels = {1: (logits, g, list(range(n)))}  # level -> (logits, g, the rows' record indices)
    depth = max((r.level for r in rec.rejections), default=1)
    for j in range(2, depth + 1):
        rows = sorted({r.row - start for r in rec.rejections if r.level >= j})
        prev_logits, prev_g, prev_rows = levels[j - 1]
        at = {i: k for k, i in enumerate(prev_rows)}
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        cols = [torch.arange(n, device=device)[None, :] <= idx[:, None]]  # level-1 rows up to the chain's own
        for i in range(2, j):  # the chain's rows of the levels between, then itself
            cols.append(torch.tensor([[r == c for c in levels[i][2]] for r in rows], device=device))
        cols.append(torch.eye(len(rows), dtype=torch.bool, device=device))
        mask = torch.cat(cols, dim=1)
        out_logits, out_g = head(tokens[idx + j - 1], prev_g[[at[r] for r in rows]], idx + start + j - 1, cache,
                                 mask)
        levels[j] = (out_logits, out_g, rows)
    return {j: (lg, [start + i for i in rows]) for j, (lg, _, rows) in levels.items()}


def _record_kl(head: Eagle3Head, rec: RequestRecord, to_draft: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The summed KL(p || q) of one request's rejections (``chain_logits`` at the level and row that drafted each)
    and their count; None where none counts."""
    device = head.fc.weight.device
    levels = chain_logits(head, rec)
    total, count = None, 0
    for r in rec.rejections:
        logits_j, rows = levels[r.level]
        k = rows.index(r.row)
        draft = to_draft[torch.tensor(r.ids, dtype=torch.long, device=device)]
        if int(draft[0]) < 0:  # the target's favourite is outside the draft vocabulary: nothing to fit
            continue
        probs = torch.tensor(r.probs, dtype=torch.float32, device=device) * (draft >= 0)
        p = torch.zeros(logits_j.shape[1], device=device).scatter_add_(0, draft.clamp(min=0), probs)
        p = p / p.sum()
        logq = logits_j[k].log_softmax(-1)
        kl = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum()
        total = kl if total is None else total + kl
        count += 1
    return None if total is None else (total, count)
