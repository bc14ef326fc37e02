"""The attention mask a forward hands a model: the engine's allowed pattern (a tree mask, or any rows-by-columns
pattern), made exact for models whose layers attend through a sliding window.

The engine's masks say which cache columns a query row may see (``engine/tree.py``: the prefix and the row's ancestors).
A sliding-window layer (Mistral, Gemma 2 and 3, Qwen with ``use_sliding_window``) must also drop every key more
than ``window - 1`` positions behind the query, as transformers' ``sliding_window_overlay`` does
(``kv_idx > q_idx - window``). transformers takes a prepared 4D mask as it is, for every layer, so the window is
ours to apply, by position: a cached column ``c`` holds position ``c`` (the cache layout after every step is that
of a fresh prefill, ``engine/runtime/kv_cache.py``), and a new row holds its position id. Models with a ``layer_types``
list in their config (Qwen 2 and 3, Gemma 2 and 3) read a mapping ``{"full_attention": mask, "sliding_attention":
mask}``; the others (Mistral, Phi-3) one mask, windowed when their config has ``sliding_window``.

Attention logit soft-capping (Gemma 2) needs no mask change: the eager attention caps the scores before it adds
the mask (``models._load_lm`` picks eager attention where SDPA is not supported).
"""

from __future__ import annotations

import numpy as np

from .tree import to_float_mask


def sliding_window(model) -> int | None:
    """The model's attention window in positions when some layer slides, else None."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None  # a window in the config that no layer uses (Qwen 2 without use_sliding_window)
    return int(window)


def reads_layer_masks(model) -> bool:
    """Whether the model takes a mask per layer type (a config with ``layer_types``, transformers 5)."""
    return getattr(model.config, "layer_types", None) is not None


def windowed(allowed: np.ndarray, length: int, position_ids: list[int], window: int) -> np.ndarray:
    """``allowed`` bool ``(q, k)`` with every key ``window`` or more positions behind its query blocked. Query row
    ``r`` is at ``position_ids[r]``; key column ``c`` at ``c`` below ``length`` and at ``position_ids[c - length]``
    from there (columns past the new rows are left as they are: blocked already)."""
    q, k = allowed.shape
    rows = np.asarray(position_ids, dtype=np.int64)
    keys = np.arange(k, dtype=np.int64)
    new = slice(length, min(k, length + q))
    keys[new] = rows[: new.stop - new.start]
    return allowed & (keys[None, :] > rows[:, None] - window)


def forward_mask(model, allowed: np.ndarray, length: int, position_ids: list[int], device):
    """The ``attention_mask`` argument for a forward of ``model`` whose query rows may see the cache columns
    ``allowed`` (bool ``(q, k)``; ``length`` cached columns before the ``q`` new rows at ``position_ids``):
    an additive float ``(1, 1, q, k)`` in the model's dtype (``tree.to_float_mask``), windowed where the model's
    layers all slide, or ``{"full_attention": ..., "sliding_attention": ...}`` where its layers mix both."""
    window = sliding_window(model)
    if window is None:
        return to_float_mask(allowed, model.dtype, device)
    slid = to_float_mask(windowed(allowed, length, position_ids, window), model.dtype, device)
    if not reads_layer_masks(model):
        return slid
    return {"full_attention": to_float_mask(allowed, model.dtype, device), "sliding_attention": slid}


__all__ = ["forward_mask", "reads_layer_masks", "sliding_window", "windowed"]
