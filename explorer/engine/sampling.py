"""Turning logits into the distributions p (target) and q (draft), identically for both models.

Speculative sampling is lossless with respect to the *processed* target distribution: temperature, top-k and
top-p must be applied the same way to p and q (Leviathan et al. 2023, section 2.3).

The draws from the engine's generator (``uniforms``, ``inverse_cdf``, ``sample_one``) are here too, below both the
drafting and the verifiers' node rules, which draw with them (``drafting.py`` re-exports them).
"""

from __future__ import annotations

from collections.abc import Mapping
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


def plain_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best tokens of each row of ``logits`` ``(..., vocab)`` (any float dtype) and their plain-softmax
    (temperature 1) probabilities: ids int64 and probabilities float32, ``(..., min(k, vocab))`` each."""
    lf = logits.float()
    vals, ids = lf.topk(min(k, lf.shape[-1]), dim=-1)
    return ids, torch.exp(vals - torch.logsumexp(lf, dim=-1, keepdim=True))


class RowDists:
    """Processed distributions of the rows of a logits matrix, computed on demand and cached.

    Verification walks a handful of rows of a tree with hundreds of nodes, and each processed row costs a pass over
    the vocabulary (a sort for top-p), so rows are computed only when asked for. The rows whose best tokens and
    normalisers are needed (those that have children in the tree) are handled in batched passes: one top-k, and
    one ``logsumexp`` of the raw logits or of ``logits / T``, each only when something asks for it.

    Args:
        logits: ``(rows, vocab)`` any float dtype (model output rows).
        cfg: the sampling settings.
        offset: index of ``logits[0]`` (rows before it must be given in ``fixed``).
        fixed: ``{row: (probs, logits)}`` for rows not in ``logits`` (float32 ``(vocab,)`` each).
        stat_rows: the stored rows the batched passes cover (default: all); other rows are computed one by one.
    """

    def __init__(self, logits: torch.Tensor, cfg: SamplingConfig, offset: int = 0, fixed: dict | None = None,
                 stat_rows=None):
        self.logits = logits
        self.cfg = cfg
        self.offset = offset
        self._probs: dict[int, torch.Tensor] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._lse: dict[int, float] = {}
        n = logits.shape[0]
        rows = range(offset, offset + n) if stat_rows is None else sorted({r for r in stat_rows
                                                                           if offset <= r < offset + n})
        self._pos = {r: i for i, r in enumerate(rows)}  # row -> index in the batched block
        self._all_rows = len(self._pos) == n
        self._float: torch.Tensor | None = None  # float32 logits of every stored row
        self._block: torch.Tensor | None = None  # float32 logits of the batched rows
        self._top: tuple | None = None  # (ids (S, TOP_CACHED), raw logit values (S, TOP_CACHED)) of the block
        self._block_lse: torch.Tensor | None = None  # logsumexp(logits) of the block (S,)
        self._block_lse_t: torch.Tensor | None = None  # logsumexp(logits / T) of the block (S,)
        self._host: dict[int, tuple] | None = None  # row -> the block's best tokens on the host (_host_top)
        self._top_proc: dict[tuple[int, int], tuple] = {}  # (row, k) -> processed top (ids, probs), prefetched
        self._shown: dict[tuple[int, int], float] = {}  # (row, token) -> processed probability, prefetched
        self._attach: dict[str, torch.Tensor] = {}  # name -> (rows, k) values for the best tokens' transfer
        self._attached: dict[str, list] = {}  # name -> those values on the host, per row
        for r, (p, lg) in (fixed or {}).items():
            self._probs[r], self._logits[r] = p, lg

    @property
    def float_logits(self) -> torch.Tensor:
        """float32 ``(rows, vocab)``: every stored row, converted once."""
        if self._float is None:
            self._float = self.logits.float()
        return self._float

    def _rows_block(self) -> torch.Tensor:
        if self._block is None:
            if self._all_rows:
                self._block = self.float_logits
            else:
                idx = torch.tensor([r - self.offset for r in self._pos], dtype=torch.long, device=self.logits.device)
                self._block = self.logits.index_select(0, idx).float()
        return self._block

    def _top_block(self) -> tuple:
        if self._top is None:
            block = self._rows_block()
            vals, ids = torch.topk(block, min(TOP_CACHED, block.shape[-1]), dim=-1)
            self._top = (ids, vals)
        return self._top

    def _lse_block(self) -> torch.Tensor:
        if self._block_lse is None:
            self._block_lse = torch.logsumexp(self._rows_block(), -1)
        return self._block_lse

    def _lse_t_block(self) -> torch.Tensor:
        if self._block_lse_t is None:
            self._block_lse_t = torch.logsumexp(self._rows_block() / self.cfg.temperature, -1)
        return self._block_lse_t

    def _host_top(self, r: int) -> tuple | None:
        """Row ``r``'s ``TOP_CACHED`` best token ids, their plain-softmax probabilities and, when sampling, their
        probabilities under ``softmax(logits / T)``, as host lists; plus the row's ``logsumexp``. All batched rows
        come to the host in one transfer the first time any is asked for: on a GPU each read of a device value
        is a host synchronisation, and the trace reads these for every node. None for rows outside the block.
        The probabilities are computed on the device exactly as the per-row reads computed them before."""
        if r not in self._pos:
            return None
        if self._host is None:
            ids, vals = self._top_block()
            lse = self._lse_block()
            parts = [ids.double(), torch.exp(vals - lse[:, None]).double(), lse[:, None].double()]
            t = ids.shape[1]
            width = 2 * t + 1
            if not self.cfg.greedy:
                parts.append(torch.exp(vals / self.cfg.temperature - self._lse_t_block()[:, None]).double())
                width += t
            parts += [v.double() for v in self._attach.values()]
            packed = torch.cat(parts, 1).tolist()  # float64 holds every token id exactly
            self._host = {}
            for row, i in self._pos.items():
                line = packed[i]
                self._host[row] = ([int(x) for x in line[:t]], line[t:2 * t], line[2 * t],
                                   line[2 * t + 1:width] if not self.cfg.greedy else None)
            for name, v in self._attach.items():
                self._attached[name] = [line[width: width + v.shape[1]] for line in packed]
                width += v.shape[1]
        return self._host[r]

    def attach(self, name: str, values: torch.Tensor) -> None:
        """Per-row values ``(rows, k)`` that come to the host in the same transfer as the rows' best tokens (on a GPU
        each transfer is a synchronisation): a draft level's decision features and uniform draws ride with its best
        tokens. ``attached(name)`` returns them. Only for a block of every stored row, before that transfer.

        Raises:
            RuntimeError: the transfer was made already, or the block leaves rows out.
            ValueError: ``values`` is not ``(rows, k)``.
        """
        if self._host is not None or not self._all_rows:
            raise RuntimeError("attach values before the first read of the rows' best tokens, to a block of all rows")
        if values.dim() != 2 or values.shape[0] != len(self._pos):
            raise ValueError(f"attached values must be (rows, k) with {len(self._pos)} rows, got {tuple(values.shape)}")
        self._attach[name] = values.to(self.logits.device)

    def attached(self, name: str) -> list[list[float]]:
        """The values ``attach(name, ...)`` gave, on the host: one list of floats (float64) per row of the block, in
        order (row ``r`` at index ``r - offset``)."""
        if self._host is None:
            self._host_top(next(iter(self._pos)))
        return self._attached[name]

    def stats(self) -> tuple:
        """Plain-softmax statistics of the batched rows (all stored rows by default): log-normaliser ``(S,)``, the
        ``TOP_CACHED`` best token ids ``(S, t)`` and their probabilities ``(S, t)``. The decision features use
        them. Indexed by position among ``stat_rows`` (sorted), which is ``r - offset`` only when ``stat_rows``
        covers every stored row."""
        ids, vals = self._top_block()
        lse = self._lse_block()
        return lse, ids, torch.exp(vals - lse[:, None])

    def row_logits(self, r: int) -> torch.Tensor:
        """float32 ``(vocab,)`` logits of row ``r``."""
        if r not in self._logits:
            if r in self._pos and self._block is not None:
                self._logits[r] = self._block[self._pos[r]]
            elif self._float is not None:
                self._logits[r] = self._float[r - self.offset]
            else:
                self._logits[r] = self.logits[r - self.offset].float()
        return self._logits[r]

    def argmax(self, r: int) -> int:
        """The greedy token of row ``r``: the largest logit, the lowest id among exact ties (``argmax``'s rule, as
        plain decoding and transformers pick; ``topk`` may order ties otherwise). From the host copy of the row's
        best tokens unless its top two tie, when the row is read."""
        host = self._host_top(r)
        if host is not None and (len(host[1]) < 2 or host[1][0] > host[1][1]):
            return host[0][0]
        return int(self.row_logits(r).argmax())

    def top_ids(self, r: int, k: int) -> list[int]:
        """The ``k`` largest logits of row ``r``, best first (the greedy children)."""
        if r in self._pos and k <= TOP_CACHED:  # raw logits either way: the block's pass, already on the host
            return self._host_top(r)[0][:k]
        return torch.topk(self.row_logits(r), k).indices.tolist()

    def __getitem__(self, r: int) -> torch.Tensor:
        """Processed float32 ``(vocab,)`` distribution of row ``r`` (one-hot when greedy)."""
        if r not in self._probs:
            self._probs[r] = logits_to_probs(self.row_logits(r), self.cfg)
        return self._probs[r]

    def _temperature_only(self, r: int) -> bool:
        """Sampling with temperature alone, on a batched row: the processed distribution is softmax(logits / T),
        whose best tokens are the raw logits' and whose normaliser one batched pass gives for all rows."""
        return (not self.cfg.greedy and not self.cfg.top_k and self.cfg.top_p >= 1.0 and r in self._pos
                and r not in self._probs)

    def top_processed(self, r: int, k: int = TOP_CACHED) -> tuple[list[int], list[float]]:
        """The (up to) ``k`` most likely tokens of row ``r``'s processed distribution and their probabilities,
        best first, zero-probability tokens left out. Sampling only."""
        if self._temperature_only(r) and k <= TOP_CACHED:
            ids, _, _, probs_t = self._host_top(r)
            pairs = zip(ids[:k], probs_t[:k])
        elif (r, k) in self._top_proc:
            pairs = zip(*self._top_proc[r, k])
        else:
            probs, ids = torch.topk(self[r], min(k, self[r].shape[-1]))
            pairs = zip(ids.tolist(), probs.tolist())
        kept = [(t, p) for t, p in pairs if p > 0]
        return [t for t, _ in kept], [p for _, p in kept]

    def top(self, rows: list[int], k: int) -> dict[int, list[tuple[int, float]]]:
        """The ``k`` most likely tokens of each row as ``(token_id, probability)``, with the probabilities of
        ``shown``: processed when sampling, plain softmax when greedy."""
        out: dict[int, list[tuple[int, float]]] = {}
        if not self.cfg.greedy:  # rows processed one by one: their top-k in one batched pass and one transfer
            slow = [r for r in sorted(set(rows)) if not (self._temperature_only(r) and k <= TOP_CACHED)
                    and (r, k) not in self._top_proc]
            if slow:
                stacked = torch.stack([self[r] for r in slow])
                probs, ids = torch.topk(stacked, min(k, stacked.shape[-1]), dim=-1)
                packed = torch.cat([ids.double(), probs.double()], 1).tolist()
                width = ids.shape[1]
                for r, line in zip(slow, packed):
                    self._top_proc[r, k] = ([int(t) for t in line[:width]], line[width:])
        for r in sorted(set(rows)):
            if self.cfg.greedy and r in self._pos and k <= TOP_CACHED:
                ids, probs, _, _ = self._host_top(r)
                out[r] = list(zip(ids[:k], probs[:k]))
            elif self.cfg.greedy:
                lg = self.row_logits(r)
                vals, ids = torch.topk(lg, min(k, lg.shape[-1]))
                out[r] = list(zip(ids.tolist(), torch.exp(vals - self.log_normalizer(r)).tolist()))
            else:
                out[r] = list(zip(*self.top_processed(r, k)))
        return out

    def plain(self, r: int, token: int) -> float:
        """Plain-softmax (temperature 1) probability of ``token`` at row ``r``: from the host copy of the row's best
        tokens when it is among them (no read of the device), else read from the row."""
        value = self._on_host(r, token, 1)
        return value if value is not None else float(self._plain_on_device(r, token))

    def plain_top(self, rows: list[int], k: int) -> dict[int, list[tuple[int, float]]]:
        """The ``k`` best tokens of each row with their plain-softmax (temperature 1) probabilities, whatever the
        sampling settings: from the host copy of the batched rows' best tokens (no read of its own) for ``k <=
        TOP_CACHED``, else read row by row."""
        out: dict[int, list[tuple[int, float]]] = {}
        for r in rows:
            host = self._host_top(r) if k <= TOP_CACHED else None
            if host is not None:
                out[r] = list(zip(host[0][:k], host[1][:k]))
            else:
                ids, probs = plain_topk(self.row_logits(r), k)
                out[r] = list(zip(ids.tolist(), probs.tolist()))
        return out

    def _on_host(self, r: int, token: int, column: int) -> float | None:
        """Column ``column`` of the host copy of row ``r``'s best tokens (1: plain softmax, 3: at the temperature)
        for ``token``, or None when the token is not among them."""
        host = self._host_top(r)
        if host is not None and token in host[0]:
            return host[column][host[0].index(token)]
        return None

    def _plain_on_device(self, r: int, token: int) -> torch.Tensor:
        """Plain-softmax probability of ``token`` at row ``r`` as a 0-d device tensor (no read)."""
        lse = self._lse_block()[self._pos[r]] if r in self._pos else torch.logsumexp(self.row_logits(r), -1)
        return torch.exp(self.row_logits(r)[token] - lse)

    def log_normalizer(self, r: int) -> float:
        """``logsumexp`` of row ``r``'s raw logits (so its plain-softmax probability of t is exp(logit - it))."""
        if r not in self._lse:
            if r in self._pos:
                self._lse[r] = self._host_top(r)[2]
            else:
                self._lse[r] = float(torch.logsumexp(self.row_logits(r), -1))
        return self._lse[r]

    def prefetch_shown(self, pairs) -> None:
        """Read ``shown(r, token)`` of many ``(r, token)`` pairs in one transfer: those the host copy of the rows'
        best tokens does not hold already (``shown`` then answers all of them from the host)."""
        need = sorted({(r, t) for r, t in pairs if (r, t) not in self._shown and self._from_host(r, t) is None})
        if need:
            values = torch.stack([self._shown_on_device(r, t) for r, t in need]).tolist()
            self._shown.update(zip(need, values))

    def _from_host(self, r: int, token: int) -> float | None:
        """``shown(r, token)`` when the token is among the row's best tokens already on the host, else None."""
        if not (self.cfg.greedy or self._temperature_only(r)):
            return None
        return self._on_host(r, token, 1 if self.cfg.greedy else 3)

    def _shown_on_device(self, r: int, token: int) -> torch.Tensor:
        """``shown(r, token)`` as a 0-d device tensor (no read)."""
        if self._temperature_only(r):  # no need to process the whole row for one probability
            return torch.exp(self.row_logits(r)[token] / self.cfg.temperature - self._lse_t_block()[self._pos[r]])
        return self[r][token] if not self.cfg.greedy else self._plain_on_device(r, token)

    def shown(self, r: int, token: int) -> float:
        """The probability shown for ``token`` at row ``r``: processed when sampling, plain softmax when greedy."""
        if (r, token) in self._shown:
            return self._shown[r, token]
        host = self._from_host(r, token)
        return host if host is not None else float(self._shown_on_device(r, token))


class LazyRows(Mapping):
    """``{row: processed distribution}`` whose rows are computed when first read: the q rows a verifier may need
    (it reads only the rows on the paths it walks). Built from ``(RowDists, row)`` references."""

    def __init__(self):
        self._refs: dict[int, tuple[RowDists, int]] = {}

    def add(self, key: int, dists: RowDists, row: int) -> None:
        self._refs[key] = (dists, row)

    def remapped(self, key_map) -> LazyRows:
        """The same rows under new keys ``key_map(old_key)`` (a tree re-indexed after free branches joined)."""
        out = LazyRows()
        out._refs = {key_map(k): v for k, v in self._refs.items()}
        return out

    def __getitem__(self, key: int) -> torch.Tensor:
        dists, row = self._refs[key]
        return dists[row]

    def __iter__(self):
        return iter(self._refs)

    def __len__(self) -> int:
        return len(self._refs)


# ------------------------------------------------------------------------------------------------ draws


def uniforms(generator: torch.Generator, n: int) -> torch.Tensor:
    """``n`` U[0, 1) draws (float64) from the engine's generator, on the generator's device, in one call."""
    return torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)


def inverse_cdf(probs: torch.Tensor, n: int, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """``n`` i.i.d. draws from the non-negative weights ``probs`` (``(vocab,)``) by inverse CDF on a float64
    running sum: a tenth of ``torch.multinomial``'s time over a 150,000-token row. The draws are made on the
    device and reach the host in one transfer with the total and their weights (a GPU synchronises once).
    Returns (token ids, their weights in ``probs``).

    Raises:
        ValueError: ``probs`` has no positive weight.
    """
    cdf = probs.double().cumsum(0)
    total = cdf[-1]
    u = uniforms(generator, n).to(probs.device) * total
    # the first index whose running sum exceeds u has weight > 0, and u < total keeps it inside the row
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    host = torch.cat([total.reshape(1), idx.double(), probs[idx].double()]).tolist()
    if not host[0] > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    ids, weights = [int(i) for i in host[1:1 + n]], host[1 + n:]
    if any(w <= 0 for w in weights):  # u rounded up to total (chance ~2^-53): the last token with weight
        last = int(torch.nonzero(probs > 0).max())
        ids = [i if w > 0 else last for i, w in zip(ids, weights)]
        weights = [w if w > 0 else float(probs[last]) for w in weights]
    return ids, weights


def sample_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from ``probs`` (``(vocab,)``, non-negative weights); the argmax when ``probs`` is one-hot."""
    return inverse_cdf(probs, 1, generator)[0][0]
