"""A target that drafts for itself: its first layers, an early exit through its final norm and LM head.

Self-speculative decoding (LayerSkip, Elhoushi et al. 2024, arXiv 2404.16710; DEL, Zarch et al. 2025; SWIFT,
Xia et al. 2024, arXiv 2410.06916) drafts with the target's own weights, some layers skipped, so a user with only a
target still gets speculative decoding and no second model is held in memory. ``EarlyExitDraft`` is such a draft:
the target's decoder layers ``0 .. exit_layer - 1``, then its final norm and LM head, shared with the target (no
weight is copied). Verification is unchanged: the full target checks every drafted token, so the output is the
target's (lossless, ``tests/test_layer_skip.py``).

What can be shared of the KV cache is shared exactly: an early exit's layers compute what the target's same layers
compute, so the draft's keys and values of the committed tokens *are* the target's for those layers. When the exit
moves deeper, the layers it adds take the target's cached rows (``kv_cache.copy_layers``) instead of a new prefill.

Which exit drafts is the ``layer-skip`` drafter's choice, step by step (``engine/drafters/layer_skip.py``,
``ExitChooser``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch


class LayerSkipError(ValueError):
    """A model the early-exit draft cannot be built from: the message says why."""


def _layer_stack(model) -> tuple[list[str], torch.nn.ModuleList]:
    """The attribute path to the model's decoder layers (``model.layers``, ``transformer.h``, ``gpt_neox.layers``,
    ``model.decoder.layers``) and the list itself: the ModuleList as long as the config's layer count."""
    n = int(model.config.num_hidden_layers)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and n > 1:
            return name.split("."), module
    raise LayerSkipError(f"{type(model).__name__} has no list of its {n} decoder layers to exit from")


def _view(model, exit_layer: int):
    """A shallow copy of ``model`` that runs only its first ``exit_layer`` decoder layers: every module on the
    path to the layer list is copied (their other children, and all weights, stay shared), the config too."""
    path, layers = _layer_stack(model)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:exit_layer]
    root = _shallow(model, config)
    parent = root
    for name in path[:-1]:
        child = _shallow(getattr(parent, name), config)
        setattr(parent, name, child)
        parent = child
    setattr(parent, path[-1], torch.nn.ModuleList(list(layers)[:exit_layer]))
    return root


def _shallow(module: torch.nn.Module, config) -> torch.nn.Module:
    out = copy.copy(module)
    out._modules = dict(module._modules)  # its own child table: replacing a child must not touch the original
    if hasattr(out, "config"):
        out.config = config
    return out


class EarlyExitDraft(torch.nn.Module):
    """The target's first ``exit_layer`` decoder layers, its final norm and LM head, as a draft model.

    Called like a transformers causal LM (``input_ids``, ``position_ids``, ``attention_mask``, ``past_key_values``,
    ...), it returns the output of the current exit's view. ``parameters()`` are the target's (shared, not copied).
    ``exit_layer`` (1 .. layers - 1) can move between steps (``set_exit``).

    Raises:
        LayerSkipError: a model without a decoder layer list, or an exit outside ``1 .. layers - 1``.
    """

    shares_target = True  # loaders neither quantize nor pack it: its weights are the target's

    def __init__(self, target: torch.nn.Module, exit_layer: int | None = None):
        super().__init__()
        self.target = target
        self.n_layers = int(target.config.num_hidden_layers)
        _layer_stack(target)
        self._views: dict[int, torch.nn.Module] = {}
        self.exit_layer = 0
        self.set_exit(exit_layer or max(1, self.n_layers // 2))

    def set_exit(self, exit_layer: int) -> None:
        if not 1 <= exit_layer < self.n_layers:
            raise LayerSkipError(f"the exit layer must be in [1, {self.n_layers - 1}], got {exit_layer}")
        self.exit_layer = int(exit_layer)

    @property
    def view(self) -> torch.nn.Module:
        # built on first use, after any packing of the target's linears has replaced them (the view copies the
        # module tables on its path, so it would keep a replaced module alive)
        if self.exit_layer not in self._views:
            self._views[self.exit_layer] = _view(self.target, self.exit_layer)
        return self._views[self.exit_layer]

    @property
    def config(self):
        return self.view.config

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    @property
    def generation_config(self):
        return self.target.generation_config

    def get_output_embeddings(self):
        return self.target.get_output_embeddings()

    def forward(self, **kwargs):
        return self.view(**kwargs)


def self_draft_pair(pair):
    """``pair`` with an ``EarlyExitDraft`` of its target as the draft (the same lock, tokenizer and measured costs;
    ``draft_id`` says so); a pair whose draft already is one comes back as it is. Raises LayerSkipError for a target
    without a decoder layer list."""
    if getattr(pair.draft, "shares_target", False):
        return pair
    return replace(pair, draft=EarlyExitDraft(pair.target), draft_quant="none", unquantized_draft=None,
                   draft_device=None, draft_id=f"{pair.target_id} (its own first layers)", graph_runners={})


__all__ = ["EarlyExitDraft", "LayerSkipError", "self_draft_pair"]
