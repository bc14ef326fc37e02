"""Turning logits into the distributions p (target) and q (draft), identically for both models.

Speculative sampling is lossless with respect to the *processed* target distribution: temperature, top-k and
top-p must be applied the same way to p and q (Leviathan et al. 2023, section 2.3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings shared by draft and target.

    Attributes:
        temperature: 0 means greedy (p and q become one-hot at their argmax); > 0 divides the logits.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of tokens whose mass reaches top_p (1.0 = off).
        seed: seeds the engine's own torch.Generator, so the same seed gives the same trace.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Processed next-token distributions.

    Args:
        logits: ``(..., vocab)`` any float dtype.
    Returns:
        ``(..., vocab)`` float32 probabilities summing to 1 on the last axis. Greedy: one-hot at the argmax.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= cfg.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


TOP_CACHED = 16  # best tokens kept per row by RowDists' batched pass


class RowDists:
    """Processed distributions of the rows of a logits matrix, computed on demand and cached.

    Verification walks a handful of rows of a tree with hundreds of nodes, and each processed row costs a pass over
    the vocabulary (a sort for top-p), so rows are computed only when asked for.

    Args:
        logits: ``(rows, vocab)`` any float dtype (model output rows).
        cfg: the sampling settings.
        offset: index of ``logits[0]`` (rows before it must be given in ``fixed``).
        fixed: ``{row: (probs, logits)}`` for rows not in ``logits`` (float32 ``(vocab,)`` each).
    """

    def __init__(self, logits: torch.Tensor, cfg: SamplingConfig, offset: int = 0, fixed: dict | None = None):
        self.logits = logits
        self.cfg = cfg
        self.offset = offset
        self._probs: dict[int, torch.Tensor] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._lse: dict[int, float] = {}
        self._float: torch.Tensor | None = None  # logits as float32, converted once
        self._batch: tuple | None = None  # (lse (rows,), top ids (rows, TOP_CACHED), top probs) of stored rows
        self._lse_t: torch.Tensor | None = None  # logsumexp(logits / T) of stored rows (temperature-only sampling)
        for r, (p, lg) in (fixed or {}).items():
            self._probs[r], self._logits[r] = p, lg

    @property
    def float_logits(self) -> torch.Tensor:
        """float32 ``(rows, vocab)``: the stored rows, converted once for every use."""
        if self._float is None:
            self._float = self.logits.float()
        return self._float

    def stats(self) -> tuple:
        """Plain-softmax statistics of all stored rows in one batched pass: log-normaliser ``(rows,)``, the
        ``TOP_CACHED`` best token ids ``(rows, t)`` and their probabilities ``(rows, t)``. One pass serves the
        greedy children, the displayed q and p, the trace's top-k lists and the decision features."""
        if self._batch is None:
            lf = self.float_logits
            lse = torch.logsumexp(lf, -1)
            vals, ids = torch.topk(lf, min(TOP_CACHED, lf.shape[-1]), dim=-1)
            self._batch = (lse, ids, torch.exp(vals - lse[:, None]))
        return self._batch

    def row_logits(self, r: int) -> torch.Tensor:
        """float32 ``(vocab,)`` logits of row ``r``."""
        if r not in self._logits:
            self._logits[r] = self.float_logits[r - self.offset]
        return self._logits[r]

    def top_ids(self, r: int, k: int) -> list[int]:
        """The ``k`` largest logits of row ``r``, best first (the greedy children)."""
        if r >= self.offset and k <= TOP_CACHED and r not in self._probs:
            return self.stats()[1][r - self.offset, :k].tolist()
        return torch.topk(self.row_logits(r), k).indices.tolist()

    def __getitem__(self, r: int) -> torch.Tensor:
        """Processed float32 ``(vocab,)`` distribution of row ``r`` (one-hot when greedy)."""
        if r not in self._probs:
            self._probs[r] = logits_to_probs(self.row_logits(r), self.cfg)
        return self._probs[r]

    def _temperature_only(self, r: int) -> bool:
        """Sampling with temperature alone, on a stored row: the processed distribution is softmax(logits / T),
        whose best tokens are the raw logits' and whose normaliser one batched pass gives for all rows."""
        return (not self.cfg.greedy and not self.cfg.top_k and self.cfg.top_p >= 1.0 and r >= self.offset
                and r not in self._probs)

    def _lse_temperature(self) -> torch.Tensor:
        """``logsumexp(logits / T)`` of every stored row ``(rows,)``, computed once."""
        if self._lse_t is None:
            self._lse_t = torch.logsumexp(self.float_logits / self.cfg.temperature, -1)
        return self._lse_t

    def top(self, rows: list[int], k: int) -> dict[int, list[tuple[int, float]]]:
        """The ``k`` most likely tokens of each row as ``(token_id, probability)``, with the probabilities of
        ``shown``: processed when sampling, plain softmax when greedy."""
        out: dict[int, list[tuple[int, float]]] = {}
        for r in sorted(set(rows)):
            if self.cfg.greedy and r >= self.offset and k <= TOP_CACHED:
                _, ids, probs = self.stats()
                out[r] = list(zip(ids[r - self.offset, :k].tolist(), probs[r - self.offset, :k].tolist()))
                continue
            if self._temperature_only(r) and k <= TOP_CACHED:
                ids = self.stats()[1][r - self.offset, :k]
                vals = self.float_logits[r - self.offset, ids] / self.cfg.temperature
                probs = torch.exp(vals - self._lse_temperature()[r - self.offset])
                out[r] = list(zip(ids.tolist(), probs.tolist()))
                continue
            if self.cfg.greedy:
                lg = self.row_logits(r)
                vals, ids = torch.topk(lg, min(k, lg.shape[-1]))
                probs = torch.exp(vals - self.log_normalizer(r))
            else:
                probs, ids = torch.topk(self[r], min(k, self[r].shape[-1]))
            out[r] = list(zip(ids.tolist(), probs.tolist()))
        return out

    def log_normalizer(self, r: int) -> float:
        """``logsumexp`` of row ``r``'s raw logits (so its plain-softmax probability of t is exp(logit - it))."""
        if r not in self._lse:
            if r >= self.offset:
                self._lse[r] = float(self.stats()[0][r - self.offset])
            else:
                self._lse[r] = float(torch.logsumexp(self.row_logits(r), -1))
        return self._lse[r]

    def shown(self, r: int, token: int) -> float:
        """The probability shown for ``token`` at row ``r``: processed when sampling, plain softmax when greedy."""
        if self._temperature_only(r):  # no need to process the whole row for one probability
            lse = self._lse_temperature()[r - self.offset]
            return float(torch.exp(self.float_logits[r - self.offset, token] / self.cfg.temperature - lse))
        if not self.cfg.greedy:
            return float(self[r][token])
        return float(torch.exp(self.row_logits(r)[token] - self.log_normalizer(r)))
