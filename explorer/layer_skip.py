"""A target that drafts for itself: its first layers, an early exit through its final norm and LM head.

Self-speculative decoding (seed 002's family: LayerSkip, Elhoushi et al. 2024; DEL, Zarch et al. 2025; SWIFT,
Xia et al. 2024, arXiv 2410.06916) drafts with the target's own weights, some layers skipped, so a user with only a
target still gets speculative decoding and no second model is held in memory. ``EarlyExitDraft`` is such a draft:
the target's decoder layers ``0 .. exit_layer - 1``, then its final norm and LM head, shared with the target (no
weight is copied). Verification is unchanged: the full target checks every drafted token, so the output is the
target's (lossless, ``tests/test_layer_skip.py``).

What can be shared of the KV cache is shared exactly: an early exit's layers compute what the target's same layers
compute, so the draft's keys and values of the committed tokens *are* the target's for those layers. When the exit
moves deeper, the layers it adds take the target's cached rows (``kv_cache.copy_layers``) instead of a new prefill.

Which exit drafts is chosen as the run goes (``ExitChooser``): each candidate exit's acceptance is measured on the
steps it drafted, and the exit with the best expected speedup ``tokens(alpha, gamma) / (gamma c + 1)`` is taken,
``c`` being the exit's share of the target's layers (Leviathan et al.'s formula, as DEL picks its exit layer from
measured acceptance); an exit not tried for a while is tried again (an exit that did not pay waits twice as long
each time), and where no exit is expected to beat plain decoding the step drafts nothing (a plain decoding step)
until the next exit is due to be tried again.
"""

from __future__ import annotations

import copy
import math

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
    from dataclasses import replace

    if getattr(pair.draft, "shares_target", False):
        return pair
    return replace(pair, draft=EarlyExitDraft(pair.target), draft_quant="none", unquantized_draft=None,
                   draft_id=f"{pair.target_id} (its own first layers)", graph_runners={})


def candidate_exits(n_layers: int) -> list[int]:
    """The exits the chooser weighs: 3/8, 1/2, 5/8 and 3/4 of the layers (distinct, within 1 .. layers - 1)."""
    return sorted({min(n_layers - 1, max(1, round(n_layers * f))) for f in (0.375, 0.5, 0.625, 0.75)})


class ExitChooser:
    """Picks the exit layer of each step from the acceptance each exit measured so far.

    For exit ``e``: ``alpha_e`` = accepted over drafted tokens of the steps it drafted (a prior of 1 accepted in 2
    drafted until it has data), ``c_e = e / layers`` (a draft forward's cost against the target's, by layers run),
    expected speedup ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c_e + 1))``. An exit not drafted in the last
    ``revisit`` steps is tried again (acceptance drifts with the text); one that did not pay waits twice as long
    after each try. Deterministic: the trace can be replayed.
    """

    def __init__(self, n_layers: int, gamma: int, revisit: int = 16):
        self.n_layers, self.gamma, self.revisit = n_layers, gamma, revisit
        self.candidates = candidate_exits(n_layers)
        self.reset()

    def reset(self) -> None:
        self.accepted = {e: 0 for e in self.candidates}
        self.drafted = {e: 0 for e in self.candidates}
        self.last_used = {e: -math.inf for e in self.candidates}
        self.wait = {e: self.revisit for e in self.candidates}  # steps before an unused exit is tried again
        self.steps = 0

    def alpha(self, e: int) -> float:
        return (self.accepted[e] + 1) / (self.drafted[e] + 2)

    def speedup(self, e: int) -> float:
        from .race import chain_speedup  # Leviathan et al.'s formula, as the classroom's curve draws it

        return chain_speedup(self.alpha(e), self.gamma, e / self.n_layers)

    def choose(self) -> int | None:
        """The exit for the next step: an untried or long-unused exit first (deepest first), else the best; None
        (a plain decoding step, no draft) when no exit is expected to beat plain decoding."""
        stale = [e for e in reversed(self.candidates) if self.steps - self.last_used[e] > self.wait[e]]
        if stale:
            return stale[0]
        best = max(self.candidates, key=self.speedup)
        return best if self.speedup(best) > 1.0 else None

    def plain_step(self) -> None:
        """A step that drafted nothing (``choose`` returned None): it counts towards revisiting every exit."""
        self.steps += 1

    def record(self, exit_layer: int, accepted: int, drafted: int) -> None:
        """What a step drafted at ``exit_layer`` measured. An exit that still does not pay waits twice as long
        before its next try (a try costs gamma draft forwards); one that pays is watched at the base interval."""
        self.accepted[exit_layer] += accepted
        self.drafted[exit_layer] += drafted
        self.last_used[exit_layer] = self.steps
        pays = self.speedup(exit_layer) > 1.0
        self.wait[exit_layer] = self.revisit if pays else 2 * self.wait[exit_layer]
        self.steps += 1

    def summary(self) -> dict:
        """Per candidate exit: its measured acceptance and expected speedup, as plain data for the trace."""
        return {str(e): {"alpha": round(self.alpha(e), 4), "drafted": self.drafted[e],
                         "speedup": round(self.speedup(e), 4)} for e in self.candidates}


__all__ = ["EarlyExitDraft", "ExitChooser", "LayerSkipError", "candidate_exits", "self_draft_pair"]
