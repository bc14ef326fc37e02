"""One model's KV cache during a run (batch size 1): what a forward appends to, and how a step keeps its path.

Two backends behind one small interface:

* ``DynamicKVCache`` (transformers' ``DynamicCache``): keys and values grow with every forward. The default: on a
  CPU a forward attends over exactly the cached columns.
* ``StaticKVCache`` (transformers' ``StaticCache``, preallocated for the run's maximum context): every forward has
  the same key width, so its attention mask spans all ``max_len`` columns (unwritten ones blocked). Static shapes
  are what CUDA graphs need.

Either way a step's forwards append rows at ``length``; ``keep`` then moves the accepted path's rows to sit right
after the kept prefix and cuts the rest (only the kept rows move; nothing is re-gathered across the whole cache),
and ``rewind`` goes back to an earlier length (time travel, the audit). The layout after ``keep`` is the one a fresh
prefill of the committed tokens would give (``tests/test_engine.py`` checks it).
"""

from __future__ import annotations

import numpy as np
import torch

KV_CACHES = ("dynamic", "static")


class KVCacheError(ValueError):
    """A cache that cannot hold what a step asks for: the message says what is wrong."""


class KVCache:
    """Interface. ``hf`` is the transformers cache object a forward gets as ``past_key_values``; ``length`` the
    positions filled so far (tokens, from position 0)."""

    kind = ""
    hf = None
    length = 0
    key_width: int | None = None  # fixed key columns of every forward's mask (static), None = length + query

    def before_forward(self, n_new: int) -> torch.Tensor | None:
        """Called right before a forward that appends ``n_new`` rows; returns its ``cache_position`` (or None
        where transformers derives it). Raises KVCacheError when they do not fit."""
        raise NotImplementedError

    def after_forward(self, n_new: int) -> None:
        self.length += n_new

    def keep(self, keep_prefix: int, keep_rows: list[int]) -> int:
        """Keep positions ``[0, keep_prefix)`` and then ``keep_rows`` (ascending, all >= ``keep_prefix``), in that
        order, as positions ``0 .. keep_prefix + len(keep_rows) - 1``; drop the rest. Returns the new length."""
        raise NotImplementedError

    def rewind(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.keep(length, [])

    def pad_mask(self, mask: np.ndarray) -> np.ndarray:
        """A step's bool mask ``(q, length + q)`` widened to this cache's key width (new columns blocked)."""
        if self.key_width is None or mask.shape[1] == self.key_width:
            return mask
        out = np.zeros((mask.shape[0], self.key_width), dtype=bool)
        out[:, : mask.shape[1]] = mask
        return out

    def layer_tensors(self):
        """``(keys, values)`` of every layer, each ``(1, kv_heads, positions, head_dim)``, cut to ``length``."""
        for layer in self.hf.layers:
            yield layer.keys[:, :, : self.length], layer.values[:, :, : self.length]


def _move_rows(layers, keep_prefix: int, keep_rows: list[int]) -> None:
    """In every layer, copy the rows ``keep_rows`` to ``keep_prefix, keep_prefix + 1, ...`` (in place)."""
    moved = [(dst, src) for dst, src in enumerate(keep_rows, start=keep_prefix) if dst != src]
    if not moved:
        return
    index: dict = {}  # device -> (dst, src) index tensors; layers may sit on several devices
    for layer in layers:
        if not hasattr(layer, "keys") or getattr(layer, "sliding_window", None):
            raise KVCacheError(f"cache layer {type(layer).__name__} cannot keep a tree path")
        dev = layer.keys.device
        if dev not in index:
            index[dev] = tuple(torch.tensor(col, dtype=torch.long, device=dev) for col in zip(*moved))
        dst, src = index[dev]
        with torch.inference_mode():  # the cache tensors were made by forwards in inference mode
            # the gather on the right reads every source row before the scatter writes any destination
            layer.keys[:, :, dst] = layer.keys[:, :, src]
            layer.values[:, :, dst] = layer.values[:, :, src]


class DynamicKVCache(KVCache):
    """transformers' ``DynamicCache``: grows with each forward, cropped after each step."""

    kind = "dynamic"

    def __init__(self):
        # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports the engine at start
        from transformers import DynamicCache

        self.hf = DynamicCache()
        self.length = 0

    def before_forward(self, n_new: int) -> None:
        return None

    def keep(self, keep_prefix: int, keep_rows: list[int]) -> int:
        new_len = keep_prefix + len(keep_rows)
        if self.length:
            _move_rows(self.hf.layers, keep_prefix, keep_rows)
            if self.length > new_len:
                self.hf.crop(new_len - self.length)  # transformers 5: negative = tokens to remove
        self.length = new_len
        return new_len


class StaticKVCache(KVCache):
    """transformers' ``StaticCache`` with ``max_len`` positions, written where we say.

    transformers 5.23's static layers append at their own ``cumulative_length`` counter (a device tensor that
    every update advances, also inside a replayed CUDA graph); we own the position instead and set the counter to
    ``length`` before each forward, so a step's rows land right after the kept prefix and a rejected tree costs
    no copy at all.
    """

    kind = "static"

    def __init__(self, model, max_len: int):
        # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports the engine at start
        from transformers import StaticCache

        self.device = next(model.parameters()).device
        with torch.device(self.device):  # its position counters are made without a device: make them here
            self.hf = StaticCache(config=model.config, max_cache_len=int(max_len))
        self.key_width = int(max_len)
        self.length = 0

    def before_forward(self, n_new: int) -> torch.Tensor:
        self.seek(n_new)
        return torch.arange(self.length, self.length + n_new, device=self.device)

    def seek(self, n_new: int) -> None:
        """Make the next forward write its ``n_new`` rows at ``length``. Raises KVCacheError when they do not
        fit."""
        if self.length + n_new > self.key_width:
            raise KVCacheError(f"the static KV cache holds {self.key_width} positions; this forward needs "
                               f"{self.length + n_new}")
        for layer in self.hf.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(self.length)

    def keep(self, keep_prefix: int, keep_rows: list[int]) -> int:
        if self.length and any(getattr(layer, "is_initialized", False) for layer in self.hf.layers):
            _move_rows(self.hf.layers, keep_prefix, keep_rows)
        self.length = keep_prefix + len(keep_rows)  # rows past it are stale and masked until overwritten
        return self.length


def copy_layers(src: KVCache, dst: DynamicKVCache, layers: range) -> None:
    """Layers ``layers`` of ``dst`` become copies of ``src``'s first ``dst.length`` positions in those layers.

    For a draft that computes what the target computes in those layers (``layer_skip.EarlyExitDraft``): its keys
    and values of the committed tokens are the target's, so a layer it starts running needs no prefill. Raises
    KVCacheError where ``src`` holds fewer positions or layers."""
    if src.length < dst.length or len(src.hf.layers) < layers.stop:
        raise KVCacheError(f"the source cache holds {src.length} positions in {len(src.hf.layers)} layers; "
                           f"{dst.length} positions of layers {layers.start}-{layers.stop - 1} were asked for")
    cache = dst.hf
    while len(cache.layers) < layers.stop:
        cache.layers.append(cache.layer_class_to_replicate())
    with torch.inference_mode():
        for i in layers:
            keys = src.hf.layers[i].keys[:, :, : dst.length].clone()
            values = src.hf.layers[i].values[:, :, : dst.length].clone()
            layer = cache.layers[i]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values


def new_kv_cache(kind: str, model, max_len: int) -> KVCache:
    """A cache of ``kind`` (``KV_CACHES``) for ``model``; ``max_len`` positions for a static one.
    Raises KVCacheError for an unknown kind."""
    if kind == "dynamic":
        return DynamicKVCache()
    if kind == "static":
        return StaticKVCache(model, max_len)
    raise KVCacheError(f"unknown KV cache {kind!r}; use one of {', '.join(KV_CACHES)}")
