"""Model forwards: plain calls (``eager_forward``), and at fixed shapes through CUDA graphs per query-size bucket
(``GraphRunner``).

On a GPU a small model's eager forward is mostly Python and kernel launches (docs/bench.md, "Machines": the 1.5B
target's one-token forward takes 16.6 ms eager on an H200 and 4.55 ms replayed from a graph). A CUDA graph records one
forward's kernels once and replays them with a single launch; it needs every shape and address fixed. So a
``GraphRunner`` serves one model on one ``StaticKVCache`` and keeps, per query size bucket (``BUCKETS``), static input
buffers (token ids, position ids, cache positions, the float mask over all ``key_width`` columns) and the graph's
output buffers:

* a forward of ``q`` rows takes the smallest bucket ``B >= q``; rows ``q .. B-1`` are padding: token 0, each
  attending only to its own cache column, so every value they produce is finite; they write keys and values past
  ``length`` where no real row looks and the next forward overwrites them;
* the static cache's write counter is set to ``length`` before each replay (``StaticKVCache.before_forward``);
* outputs are copied out of the graph's buffers (the next replay overwrites them).

Forwards larger than the last bucket (the prefill) and forwards before the cache is allocated run eagerly. Without
CUDA (``capture=False``) the runner pads to the same buckets and calls the model eagerly, which is what the CPU
tests check: padded buckets give the logits of unpadded forwards.

A *chain replay* (``GraphRunner.chain``) runs several draft levels of ``w`` chains in one graph: each
level's next tokens are chosen on the device (argmax, or an inverse-CDF draw from the processed distribution with
uniforms drawn before the replay) and fed to the next level's forward, as gpt-fast's decode loop does, with the
mask, position ids and cache positions advanced on the device. The host reads the levels' tokens and logits once,
after the replay, instead of once per level.
"""

from __future__ import annotations

import contextlib
import gc
from typing import NamedTuple

import numpy as np
import torch

from ..attention import forward_mask
from ..sampling import SamplingConfig, logits_to_probs
from .kv_cache import KVCache, StaticKVCache

# Query sizes forwards are padded to. Up to 256: prompt lookup's default tree is 64 nodes plus the anchor, and the
# hybrid's reaches about 130; a forward past the largest bucket ran eagerly (3x a replay on the H100).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ForwardOutput(NamedTuple):
    """What one forward returns (fresh tensors on the model's device).

    Attributes:
        logits: ``(keep, vocab)`` model dtype, the last ``keep`` rows.
        hidden: float32 ``(rows, hidden_size)``, the last hidden state (after the final norm) of the last
            ``hidden_rows`` rows, or None where not asked for.
        states: model dtype ``(q, len(layers), hidden_size)``, the hidden states entering the decoder layers named
            in ``layers`` (index ``i < L`` is the input of layer ``i``, 0 the token embeddings; ``L`` the final
            norm's output) at every query row, or None where no layer was named.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    states: torch.Tensor | None = None


def eager_forward(model, kv: KVCache, input_ids: list[int], position_ids: list[int], mask: np.ndarray | None,
                  keep: int, hidden: bool = False, hidden_rows: int | None = None, layers: tuple[int, ...] = ()
                  ) -> ForwardOutput:
    """One plain forward of ``model`` appending ``q = len(input_ids)`` rows to ``kv``. ``mask``: bool
    ``(q, kv.length + q)`` or None (causal). Returns the logits of the last ``keep`` rows in the model dtype and,
    with ``hidden``, the last hidden state of the last ``hidden_rows`` rows (default ``keep``; more rows than
    ``keep`` leave the logits' kernels as they are), and with ``layers`` those layers' hidden states at every row
    (``ForwardOutput``)."""
    device = next(model.parameters()).device
    attn = None if mask is None else forward_mask(model, kv.pad_mask(mask), kv.length, position_ids, device)
    cache_position = kv.before_forward(len(input_ids))
    out = model(input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
                position_ids=torch.tensor([position_ids], dtype=torch.long, device=device), attention_mask=attn,
                past_key_values=kv.hf, cache_position=cache_position, use_cache=True, logits_to_keep=keep,
                output_hidden_states=hidden or bool(layers))
    kv.after_forward(len(input_ids))
    logits = out.logits[0]
    last = out.hidden_states[-1][0, -(hidden_rows or logits.shape[0]):].float() if hidden else None
    return ForwardOutput(logits, last, _layer_states([out.hidden_states[i] for i in layers], len(input_ids)))


def _layer_states(states, rows: int) -> torch.Tensor | None:
    """The first ``rows`` rows of the named layers' hidden states (``(1, q, hidden_size)`` each, in the layers'
    order) as one fresh tensor ``(rows, layers, hidden_size)`` (a graph's output buffers are overwritten by its next
    replay); None without layers."""
    if not states:
        return None
    return torch.stack([s[0, :rows] for s in states], dim=1)


def bucket_for(n: int, buckets=BUCKETS) -> int | None:
    """The smallest bucket holding ``n`` query rows, or None when ``n`` is larger than all."""
    return next((b for b in buckets if b >= n), None)


def padded_mask(mask: np.ndarray | None, length: int, n: int, bucket: int, width: int) -> np.ndarray:
    """Bool ``(bucket, width)``: the forward's ``(n, length + n)`` mask (None = causal) padded with blocked
    columns, then ``bucket - n`` padding rows that each see only their own column ``length + n + j``."""
    out = np.zeros((bucket, width), dtype=bool)
    if mask is None:
        out[:n, :length] = True
        out[:n, length: length + n] = np.tril(np.ones((n, n), dtype=bool))
    else:
        out[:n, : mask.shape[1]] = mask
    pad = np.arange(n, bucket)
    out[pad, length + pad] = True
    return out


class _Bucket:
    """Static buffers (and on a GPU the captured graph) of one query size."""

    def __init__(self, size: int, width: int, device, dtype):
        self.size = size
        self.ints = torch.zeros((3, size), dtype=torch.long, device=device)
        self.ids, self.pos, self.cache_position = self.ints[0:1], self.ints[1:2], self.ints[2]
        self.allowed = torch.zeros((size, width), dtype=torch.bool, device=device)
        self.mask = torch.zeros((1, 1, size, width), dtype=dtype, device=device)
        self.graph = None
        self.logits = None  # output buffers: (1, size, vocab) and (1, size, hidden) or None
        self.hidden = None
        self.states: tuple = ()  # (1, size, hidden) per named layer
        # On CUDA the inputs go through pinned host buffers, copied asynchronously: a copy from pageable memory
        # makes the host wait for the device (two such waits per forward were counted).
        cuda = torch.device(device).type == "cuda"
        self._staged = (torch.zeros((3, size), dtype=torch.long, device="cpu", pin_memory=True),
                        torch.zeros((size, width), dtype=torch.bool, device="cpu", pin_memory=True)) if cuda else None
        self._copied = None  # CUDA event: the last copy out of the pinned buffers is done

    def host_to_device(self, ints: np.ndarray, allowed: np.ndarray) -> None:
        """Fill the input buffers from host arrays: ids, position ids and cache positions ``(3, size)`` int64,
        and the allowed-attention pattern ``(size, width)`` bool."""
        if self._staged is None:
            self.ints.copy_(torch.from_numpy(ints))
            self.allowed.copy_(torch.from_numpy(allowed))
            return
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the pinned buffers (nearly always already)
        staged_ints, staged_allowed = self._staged
        np.copyto(staged_ints.numpy(), ints)
        np.copyto(staged_allowed.numpy(), allowed)
        self.ints.copy_(staged_ints, non_blocking=True)
        self.allowed.copy_(staged_allowed, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()


class _Chain:
    """Static buffers (and on a GPU the captured graph) of one chain replay: ``levels`` forwards of ``w`` rows."""

    def __init__(self, w: int, levels: int, vocab: int, width: int, device, dtype):
        self.w, self.levels, self.vocab = w, levels, vocab
        self.ints = torch.zeros((3, w), dtype=torch.long, device=device)
        self.ids, self.pos, self.cache_position = self.ints[0:1], self.ints[1:2], self.ints[2]
        self.allowed = torch.zeros((w, width), dtype=torch.bool, device=device)
        self.uniforms = torch.zeros((levels, w), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((levels, w), dtype=torch.long, device=device)
        self.logits = torch.zeros((levels, w, vocab), dtype=dtype, device=device)
        self.graph = None


class GraphRunner:
    """Forwards of ``model`` appending to ``kv`` at fixed shapes; CUDA graphs when ``capture``.

    Args:
        model: a transformers causal LM (read-only; its forwards must hold the pair's lock, as the engine's do).
        kv: the static cache every forward of this runner appends to (its tensors are captured by address).
        capture: record CUDA graphs (default: when ``kv`` lives on a CUDA device); False = padded eager calls.
        buckets: the query sizes forwards are padded to, ascending.
    Raises:
        ValueError: ``kv`` is not a ``StaticKVCache`` (graphs need fixed key widths). A forward whose padding rows
            would not fit in ``kv`` runs eagerly instead.
    """

    def __init__(self, model, kv, capture: bool | None = None, buckets=BUCKETS):
        if not isinstance(kv, StaticKVCache):
            raise ValueError("a graph runner needs a static KV cache (fixed key width)")
        self.model, self.kv, self.buckets = model, kv, tuple(buckets)
        self.capture = kv.device.type == "cuda" if capture is None else bool(capture)
        self.dtype = next(model.parameters()).dtype
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        self._chains: dict[tuple, _Chain] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = self.captures = self.eager_calls = 0

    def forward(self, input_ids: list[int], position_ids: list[int], mask: np.ndarray | None, keep: int,
                hidden: bool = False, hidden_rows: int | None = None, layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One forward of ``q = len(input_ids)`` rows at ``kv.length``. ``mask``: bool ``(q, kv.length + q)`` or
        None (causal). Returns the logits of the last ``keep`` rows ``(keep, vocab)`` in the model dtype, with
        ``hidden`` the last hidden state (float32) of the last ``hidden_rows`` rows (default ``keep``; more than
        ``keep``: an eager forward, as a prefill is), and with ``layers`` the named layers' hidden states at every
        row (``ForwardOutput``), all fresh tensors. A bucket's graph is captured per ``(hidden, layers)``."""
        n, length = len(input_ids), self.kv.length
        size = bucket_for(n, self.buckets)
        layers = tuple(layers)
        if (size is None or not self._cache_ready() or length + size > self.kv.key_width
                or (hidden and (hidden_rows or keep) > keep)):
            self.eager_calls += 1
            return eager_forward(self.model, self.kv, input_ids, position_ids, mask, keep, hidden, hidden_rows,
                                 layers)
        b = self._bucket(size, hidden, layers)
        self._stage(b, input_ids, position_ids, mask)
        if self.capture and b.graph is None:
            self._capture(b, hidden, layers)
            self.kv.seek(size)  # warm-up and capture advanced the cache's counter
        if b.graph is not None:
            b.graph.replay()
            self.replays += 1
            logits, hid, states = b.logits, b.hidden, b.states
        else:
            out = self._call(b, hidden or bool(layers))
            self.eager_calls += 1
            logits, hid = out.logits, (out.hidden_states[-1] if hidden else None)
            states = tuple(out.hidden_states[i] for i in layers)
        self.kv.after_forward(n)  # the padding rows are past `length`: stale, blocked, overwritten next time
        rows = slice(n - keep, n)
        # copies: the next replay overwrites the graph's output buffers (``.float()`` of a float32 buffer is the buffer)
        return ForwardOutput(logits[0, rows].clone(), hid[0, rows].to(torch.float32, copy=True) if hid is not None
                             else None, _layer_states(states, n))

    def chain(self, input_ids: list[int], position_ids: list[int], mask: np.ndarray, levels: int, vocab: int,
              sampling: SamplingConfig, uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``levels`` forwards of ``w = len(input_ids)`` chains in one replay: the first feeds
        ``input_ids``; each next one feeds the tokens chosen from the previous one's logits on the device, one
        position further, each row attending to what its row attended to plus its own new column.

        Args:
            input_ids, position_ids: the first level's rows, ``w`` each.
            mask: bool ``(w, kv.length + w)``: what the first level's rows attend to.
            levels: forwards in the replay (>= 1).
            vocab: the shared vocabulary; tokens are chosen among ids below it.
            sampling: greedy chooses the largest logit (lowest id among ties, as ``argmax``); otherwise one draw
                from ``logits_to_probs`` of the row (the draft's q), by inverse CDF on ``uniforms``.
            uniforms: float64 ``(levels, w)`` U[0, 1) draws when sampling, on any device.
        Returns:
            ``(tokens, logits)``: int64 ``(levels, w)`` (row ``c`` of level ``j`` is the token chosen after level
            ``j``'s row ``c``) and ``(levels * w, vocab)`` logits in the model dtype, level-major, fresh tensors.
            The cache holds all ``levels * w`` rows, level-major, from ``kv.length`` on.
        Raises:
            ValueError: ``levels < 1``, sampling without ``uniforms``, or the rows do not fit in the cache.
        """
        w, length = len(input_ids), self.kv.length
        if levels < 1:
            raise ValueError(f"a chain replay needs at least one level, got {levels}")
        if not sampling.greedy and uniforms is None:
            raise ValueError("a sampled chain replay needs its uniform draws")
        if length + levels * w > self.kv.key_width or not self._cache_ready():
            raise ValueError(f"{levels} levels of {w} rows do not fit in the static cache after {length} positions")
        c = self._stage_chain(input_ids, position_ids, mask, levels, vocab, sampling)
        if uniforms is not None:
            c.uniforms.copy_(uniforms.reshape(levels, w))
        if self.capture and c.graph is None:
            c.graph, _ = self._record(levels * w, lambda: self._chain_body(c, sampling))
        self.kv.seek(levels * w)
        if c.graph is not None:
            c.graph.replay()
            self.replays += 1
        else:
            self._chain_body(c, sampling)
            self.eager_calls += levels
        self.kv.after_forward(levels * w)
        return c.tokens.clone(), c.logits.reshape(levels * w, vocab).clone()

    def capture_chains(self, widths, depths, vocab: int, sampling: SamplingConfig) -> int:
        """Capture the chain replays of ``w`` chains and ``levels`` levels for every ``w`` in ``widths`` and
        ``levels`` in ``depths`` not captured yet, at the cache's current length, without changing the cache's
        content up to it (as ``capture_all``). Returns how many graphs were captured (0 off CUDA)."""
        length = self.kv.length
        if not self.capture or not self._cache_ready():
            return 0
        done = self.captures
        for w in widths:
            for levels in depths:
                if length + levels * w > self.kv.key_width:
                    continue
                mask = np.zeros((w, length + w), dtype=bool)
                mask[:, :length] = True
                mask[np.arange(w), length + np.arange(w)] = True
                c = self._stage_chain([0] * w, [length] * w, mask, levels, vocab, sampling)
                if c.graph is None:
                    c.graph, _ = self._record(levels * w, lambda c=c: self._chain_body(c, sampling))
        return self.captures - done

    def _stage_chain(self, input_ids: list[int], position_ids: list[int], mask: np.ndarray, levels: int, vocab: int,
                     sampling: SamplingConfig) -> _Chain:
        """The chain replay's buffers for this shape and sampling (made on first use), filled with the inputs."""
        w, length = len(input_ids), self.kv.length
        key = (w, levels, vocab, sampling.temperature, sampling.top_k, sampling.top_p)
        c = self._chains.get(key)
        if c is None:
            c = self._chains[key] = _Chain(w, levels, vocab, self.kv.key_width, self.kv.device, self.dtype)
        host = np.stack([np.asarray(input_ids, dtype=np.int64), np.asarray(position_ids, dtype=np.int64),
                         np.arange(length, length + w, dtype=np.int64)])
        c.ints.copy_(torch.from_numpy(host))
        c.allowed.copy_(torch.from_numpy(self.kv.pad_mask(mask)))
        return c

    def _chain_body(self, c: _Chain, sampling: SamplingConfig) -> None:
        """The chain replay's work (captured on a GPU): forwards, next-token choices and the advance of the
        mask and positions, all on the device; writes ``c.tokens`` and ``c.logits``. Reads the inputs without
        changing them, so a replay starts from what the host staged."""
        ids, pos, cache_position, allowed = c.ids, c.pos, c.cache_position, c.allowed
        blocked = torch.finfo(self.dtype).min
        for j in range(c.levels):
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device).masked_fill_(~allowed, blocked)
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask[None, None],
                             past_key_values=self.kv.hf, cache_position=cache_position, use_cache=True)
            logits = out.logits[0, :, : c.vocab]
            if sampling.greedy:
                tokens = logits.argmax(-1)
            else:
                probs = logits_to_probs(logits, sampling)
                cdf = probs.double().cumsum(-1)
                u = (c.uniforms[j] * cdf[:, -1]).unsqueeze(1)
                tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=c.vocab - 1)
                # u rounded up to the total (chance ~2^-53) lands on a token of no mass: take the row's mode
                tokens = torch.where(probs.gather(1, tokens) > 0, tokens, probs.argmax(-1, keepdim=True)).squeeze(1)
            c.tokens[j].copy_(tokens)
            c.logits[j].copy_(logits)
            if j + 1 < c.levels:
                ids, pos, cache_position = tokens[None], pos + 1, cache_position + c.w
                allowed = allowed.scatter(1, cache_position[:, None], True)

    def capture_all(self, hidden: bool = False, layers: tuple[int, ...] = ()) -> int:
        """Capture every bucket not captured yet (with ``hidden`` and ``layers`` as ``forward`` takes them), at the
        cache's current length, without
        changing the cache's content up to that length: the capture's forwards write only past it, where padding
        rows go too. Returns how many graphs were captured (0 off CUDA, or before the cache's first forward)."""
        length = self.kv.length
        if not self.capture or not self._cache_ready():
            return 0
        done = self.captures
        for size in self.buckets:
            b = self._bucket(size, hidden, tuple(layers))
            if b.graph is not None or length + size > self.kv.key_width:
                continue
            self._stage(b, [0] * size, list(range(length, length + size)), None)  # causal rows of token 0
            self._capture(b, hidden, tuple(layers))
        return self.captures - done

    def _cache_ready(self) -> bool:
        """Whether the static cache's layers hold their tensors (after its first, eager, forward)."""
        return all(getattr(layer, "is_initialized", False) for layer in self.kv.hf.layers)

    def _stage(self, b: _Bucket, input_ids: list[int], position_ids: list[int], mask: np.ndarray | None) -> None:
        """Fill bucket ``b``'s input buffers for ``len(input_ids)`` rows at ``kv.length`` (padded to ``b.size``;
        ``mask`` as ``forward`` takes it) and point the cache's write position there."""
        n, length, size = len(input_ids), self.kv.length, b.size
        host = np.zeros((3, size), dtype=np.int64)  # ids, position ids, cache positions: one copy to the device
        host[0, :n] = input_ids
        host[1, :n], host[1, n:] = position_ids, position_ids[-1]
        host[2] = np.arange(length, length + size)
        b.host_to_device(host, padded_mask(mask, length, n, size, self.kv.key_width))
        b.mask.fill_(0.0).masked_fill_(~b.allowed[None, None], torch.finfo(self.dtype).min)
        self.kv.seek(size)  # the cache's write position: `length`

    def _call(self, b: _Bucket, hidden: bool):
        return self.model(input_ids=b.ids, position_ids=b.pos, attention_mask=b.mask, past_key_values=self.kv.hf,
                          cache_position=b.cache_position, use_cache=True, output_hidden_states=hidden)

    def _bucket(self, size: int, hidden: bool, layers: tuple[int, ...]) -> _Bucket:
        key = (size, hidden, layers)
        if key not in self._buckets:
            self._buckets[key] = _Bucket(size, self.kv.key_width, self.kv.device, self.dtype)
        return self._buckets[key]

    def _capture(self, b: _Bucket, hidden: bool, layers: tuple[int, ...]) -> None:
        """Record bucket ``b``'s forward (``_record``); its outputs become the bucket's output buffers."""
        b.graph, out = self._record(b.size, lambda: self._call(b, hidden or bool(layers)))
        b.logits = out.logits
        b.hidden = out.hidden_states[-1] if hidden else None
        b.states = tuple(out.hidden_states[i] for i in layers)

    def _record(self, rows: int, work):
        """Warm ``work`` (the forwards of ``rows`` cache rows from ``kv.length``) up twice on a side stream, as
        PyTorch's CUDA graph notes ask, then record it in one graph of this runner's memory pool. Returns the graph
        and what the recorded call returned (its tensors are the graph's output buffers)."""
        device = self.kv.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.kv.seek(rows)
                work()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.kv.seek(rows)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph, pool=self._pool):
            out = work()
        self.captures += 1
        return graph, out


@contextlib.contextmanager
def no_collection():
    """No cyclic garbage collection inside the block (the collector's state is restored after it).

    Why around a graph's capture: a collection there frees the CUDA tensors of dead reference cycles (engines of
    earlier runs), and the allocator's bookkeeping for them is an operation a capture forbids. On an H100 the CUDA
    suite failed that way in one test out of 169 ("operation failed due to a previous error during capture"), in
    some orders of the test files and not in others, as the collector's timing moved. PyTorch collected before every
    capture until it made that optional (``torch.compiler.config.force_cudagraph_gc``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def acquire_runner(pair, role: str, min_width: int) -> GraphRunner:
    """A runner (with its own static cache, rewound to 0) for ``pair``'s ``role`` model (``draft``/``target``),
    holding at least ``min_width`` positions: an idle one of the pair if any (its graphs already captured), else a
    new one. Widths are rounded up to 256 so that runs of similar lengths share runners."""
    width = -(-int(min_width) // 256) * 256
    idle = pair.graph_runners.get((role, width))
    if idle:
        runner = idle.pop()
        runner.kv.rewind(0)
        return runner
    model = getattr(pair, role)
    return GraphRunner(model, StaticKVCache(model, width))


def release_runner(pair, role: str, runner: GraphRunner) -> None:
    """Give ``runner`` back to ``pair`` for the next run (``acquire_runner``)."""
    pair.graph_runners.setdefault((role, runner.kv.key_width), []).append(runner)
