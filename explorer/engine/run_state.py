"""One run's state in one place: what ``Engine.start`` creates, every step advances and ``Engine.rewind`` restores.

Invariants between steps (batch size 1):

* ``committed`` holds prompt + generated token ids. Each model's KV cache covers a prefix of it. After a lossless
  step the last committed token (the bonus token, the next tree's *anchor*) is not in the target cache yet; after
  the prefill, and after every step of the lossy target-initialized method, the target caches everything and keeps
  its next-token distribution (``next_logits``, ``next_dist``) for the anchor.
* With a joint prefill (``prefill_pending``) the target caches nothing yet: the next verification reads the whole
  prompt with the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .runtime.kv_cache import KVCache


@dataclass
class RunState:
    """The mutable state of one run.

    Attributes:
        committed: prompt and committed token ids (the drafters read a copy, never this list).
        n_prompt: prompt tokens at the start of ``committed``.
        max_new_tokens: the run's budget of new tokens.
        target_kv, draft_kv: the models' KV caches (``draft_kv`` None where no draft model runs).
        generator: the run's random stream (``torch.Generator`` on the pair's device), seeded with the sampling's
            ``seed``: drafting and verification draw from it in order, so a run is reproducible.
        next_logits, next_dist: float32 ``(vocab,)``: the target's logits and processed distribution after the last
            committed token, where the target has read it (after the prefill, after a lossy step), else None.
        prefill_pending: the target has not read the prompt yet: the next verification reads it (joint prefill).
        prompt_rows: prompt rows whose target candidates the joint prefill's verification returns (the decision
            features' memory of the prompt), 0 where none.
        finished: EOS committed or the budget spent.
    """

    committed: list[int]
    n_prompt: int
    max_new_tokens: int
    target_kv: KVCache
    draft_kv: KVCache | None
    generator: torch.Generator
    next_logits: torch.Tensor | None = None
    next_dist: torch.Tensor | None = None
    prefill_pending: bool = False
    prompt_rows: int = 0
    finished: bool = False
    _after_prefill: dict = field(default_factory=dict, repr=False)  # field -> its value after the prefill

    @property
    def n_generated(self) -> int:
        """New tokens committed so far."""
        return len(self.committed) - self.n_prompt

    @property
    def tokens_left(self) -> int:
        """New tokens the run may still commit before ``max_new_tokens``."""
        return self.max_new_tokens - self.n_generated

    def commit(self, tokens: list[int], eos_ids) -> list[int]:
        """Append ``tokens`` cut at the first EOS (kept) and at the budget; the run is finished when either is hit.
        Returns what was appended."""
        room = self.tokens_left
        out = []
        for t in tokens[:room]:
            out.append(t)
            if t in eos_ids:
                self.finished = True
                break
        if len(out) >= room:
            self.finished = True
        self.committed.extend(out)
        return out

    def mark_prefilled(self) -> None:
        """Remember the state right after the prefill, where ``rewind`` returns."""
        self._after_prefill = {"target_len": self.target_kv.length,
                               "draft_len": self.draft_kv.length if self.draft_kv is not None else 0,
                               "next_logits": self.next_logits, "next_dist": self.next_dist,
                               "prefill_pending": self.prefill_pending, "prompt_rows": self.prompt_rows}

    def prompt_read(self) -> None:
        """The target has read the prompt (a joint prefill's first verification): no verification reads it again
        but after a rewind, and none returns its rows again (the drafter keeps what it read of them)."""
        self.prefill_pending, self.prompt_rows = False, 0
        self._after_prefill["prompt_rows"] = 0

    def rewind(self, seed: int) -> None:
        """Back to the state right after the prefill: caches cut back, no token generated, the generator reseeded
        with ``seed``; a joint prefill's target reads the prompt again in the next verification."""
        saved = self._after_prefill
        self.next_logits, self.next_dist = saved["next_logits"], saved["next_dist"]
        self.prefill_pending, self.prompt_rows = saved["prefill_pending"], saved["prompt_rows"]
        self.target_kv.rewind(saved["target_len"])
        if self.draft_kv is not None:
            self.draft_kv.rewind(saved["draft_len"])
        del self.committed[self.n_prompt:]
        self.finished = False
        self.generator.manual_seed(int(seed))
