"""Adapters for drafters people already wrote: a transformers ``CandidateGenerator`` and a class with vLLM's
``custom_class`` proposer signature, each run as a chain drafter. Each adapter returns a factory that
``register_method`` takes.

* transformers (``generation/candidate_generator.py``): ``get_candidates(input_ids (1, L) long) -> (candidate ids
  (1, L + n) long, candidate logits (1, n, vocab) float or None)``, ``update_candidate_strategy(input_ids, scores,
  num_matches)`` after each verification. Logits become the chain's q (processed with the run's sampling settings,
  as p is): the chain's nodes are then drafted nodes that every rule tests against q; the generator must have
  sampled them from that q for the run to stay lossless (the audit says). Without logits the chain is a point mass
  (free nodes, tested with the point-mass stage: lossless whatever it proposes).
* vLLM (``speculative_config={"method": "custom_class", ...}``): ``propose(sampled_token_ids, num_tokens_no_spec,
  token_ids_cpu) -> list[list[int]]`` over a batch; the engine runs a batch of one: the tokens the last step
  committed, the number of tokens so far, and the token ids as a ``(1, L)`` int64 array. Its proposal is a free
  chain.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ..engine.drafters.base import DraftOffer, Drafted, Drafter, FreeNode, empty_draft, merge_free
from ..engine.parts import PluginError
from ..engine.sampling import LazyRows, RowDists
from ..engine.tree import DraftTree


def _fill(cls, kwargs: dict, offer: DraftOffer) -> dict:
    """``kwargs`` plus what the run knows that ``cls.__init__`` asks for and the caller left out: ``eos_token_id``
    (a tensor, as transformers passes it), ``vocab_size``, ``max_length`` (set again each step)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    known = {"eos_token_id": torch.tensor(list(offer.eos_token_ids) or [-1]), "vocab_size": offer.vocab_size,
             "max_length": 1 << 20}
    return {**{k: v for k, v in known.items() if k in params and k not in kwargs}, **kwargs}


class CandidateGeneratorDrafter(Drafter):
    """A transformers ``CandidateGenerator`` as a chain drafter (module docstring). A new generator is built for
    each run and on ``rewind`` (the audit's many samples), so what it learned never leaks between samples."""

    name = "candidate-generator"

    def __init__(self, cls, kwargs: dict, offer: DraftOffer):
        self.cls, self.kwargs, self.offer = cls, _fill(cls, kwargs, offer), offer
        self.generator = cls(**self.kwargs)
        self._chain = 0  # nodes of the last step's chain

    def rewind(self) -> None:
        self.generator = self.cls(**self.kwargs)

    def draft(self, view) -> Drafted:
        committed = list(view.committed)
        if hasattr(self.generator, "max_length"):  # transformers caps candidates at max_length - 1 - len
            self.generator.max_length = len(committed) + view.reach.max_depth + 1
        ids, logits = self.generator.get_candidates(torch.tensor([committed], dtype=torch.long))
        tokens = [int(t) for t in ids[0, len(committed):].tolist()][: max(view.reach.max_depth, 0)]
        info = {"generator": type(self.generator).__name__}
        if logits is None or not tokens:  # a point mass: free nodes
            nodes = [FreeNode(i - 1, t, provenance={"generator": info["generator"]}) for i, t in enumerate(tokens)]
            d = merge_free(empty_draft(len(committed)), nodes, view.free_rows, **view.reach._asdict())
            self._chain = len(d.tree)
            d.info.update(info)
            return d
        vocab = self.offer.vocab_size
        if logits.dim() != 3 or logits.shape[-1] < vocab or logits.shape[1] < len(tokens):
            raise PluginError(f"{self.cls.__name__}.get_candidates returned logits of shape {tuple(logits.shape)}; "
                              f"expected (1, {len(tokens)}, {vocab} or more)")
        dists = RowDists(logits[0, : len(tokens), :vocab].float().to(view.generator.device), view.sampling)
        tree, q_rows, q_show = DraftTree(), LazyRows(), {}
        for i, token in enumerate(tokens):
            tree.add_level([i - 1], [token])
            if not view.sampling.greedy:
                q_rows.add(i, dists, i)  # row i (node i - 1, the anchor for i = 0) drew node i
            q_show[i] = dists.shown(i, token)
        self._chain = len(tokens)
        return Drafted(tree, q_rows=q_rows, q_show=q_show, tree_start=len(committed), info=info)

    def observe(self, step) -> None:
        """``update_candidate_strategy`` with the history, the target's logits at the chain's rows and the number
        of the chain's tokens accepted."""
        update = getattr(self.generator, "update_candidate_strategy", None)
        if update is None or not step.speculated:
            return
        matches = len(step.verified.result.path)
        rows = step.verified.p_rows
        scores = torch.stack([rows.row_logits(r) for r in range(self._chain + 1)])[None] if hasattr(
            rows, "row_logits") else None
        update(torch.tensor([list(step.history)], dtype=torch.long), scores, matches)


def from_candidate_generator(cls, **kwargs):
    """A factory for ``register_method`` that runs the transformers ``CandidateGenerator`` subclass ``cls`` as a
    chain drafter, built as ``cls(**kwargs)`` for each run (``eos_token_id``, ``vocab_size`` and ``max_length``
    filled from the run where its ``__init__`` takes them and ``kwargs`` does not say).

    Example: ``register_method("hf-lookup", from_candidate_generator(PromptLookupCandidateGenerator,
    num_output_tokens=10, max_matching_ngram_size=2))``. Raises TypeError when ``cls`` has no ``get_candidates``."""
    if not callable(getattr(cls, "get_candidates", None)):
        raise TypeError(f"{cls!r} has no get_candidates(input_ids): not a transformers CandidateGenerator")

    def factory(offer: DraftOffer) -> Drafter:
        return CandidateGeneratorDrafter(cls, kwargs, offer)

    factory.__doc__ = f"{cls.__name__} (a transformers candidate generator) as a chain drafter."
    return factory


class ProposerDrafter(Drafter):
    """A class with vLLM's ``custom_class`` proposer signature as a free chain drafter (module docstring)."""

    name = "proposer"

    def __init__(self, cls, kwargs: dict):
        self.cls, self.kwargs = cls, kwargs
        self.proposer = cls(**kwargs)
        self._sampled: list[int] = []  # the tokens the last step committed

    def rewind(self) -> None:
        self.proposer, self._sampled = self.cls(**self.kwargs), []

    def free_nodes(self, view) -> list[FreeNode]:
        committed = np.asarray([view.committed], dtype=np.int64)
        sampled = self._sampled or [int(view.committed[-1])]
        out = self.proposer.propose([sampled], np.asarray([committed.shape[1]], dtype=np.int64), committed)
        if not isinstance(out, (list, tuple)) or len(out) != 1 or not isinstance(out[0], (list, tuple, np.ndarray)):
            raise PluginError(f"{self.cls.__name__}.propose must return one list of token ids per request (a batch "
                              f"of one here), got {out!r:.80}")
        kind = type(self.proposer).__name__
        return [FreeNode(i - 1, int(t) if isinstance(t, (int, np.integer)) else t, provenance={"proposer": kind})
                for i, t in enumerate(out[0])]

    def observe(self, step) -> None:
        self._sampled = list(step.committed)


def from_vllm_proposer(cls, **kwargs):
    """A factory for ``register_method`` that runs ``cls`` (built as ``cls(**kwargs)`` for each run), a class with
    vLLM's ``custom_class`` proposer method ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) ->
    list[list[int]]``, as a free chain drafter. Raises TypeError when ``cls`` has no ``propose``."""
    if not callable(getattr(cls, "propose", None)):
        raise TypeError(f"{cls!r} has no propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)")

    def factory(offer: DraftOffer) -> Drafter:
        return ProposerDrafter(cls, kwargs)

    factory.__doc__ = f"{cls.__name__} (a vLLM-style proposer) as a free chain drafter."
    return factory
