"""The step machine: prefill, draft, verify, commit, trim the KV caches; every step emits a StepTrace.

One engine drives all methods (``ar``, ``sd``, ``mcsd``, ``mcsd-improved``); they differ only in the draft tree's
shape, where its roots come from, the stop policy and the verifier (see ``config.MethodConfig``).

Invariants between steps (batch size 1):

* ``committed`` holds prompt + generated token ids. Each model's KV cache covers a prefix of it:
  ``target_len`` and ``draft_len`` tokens. After a lossless step the last committed token (the bonus token, the
  next tree's *anchor*) is not in the target cache yet; after the prefill, and after every step of the lossy
  target-initialized method, the target caches everything and keeps its next-token distribution (``next_dist``)
  for the anchor. The prompt is never recomputed.
* A step feeds each model the committed tokens it lacks (its *chain*) together with tree nodes; tree nodes use
  the topology-aware float mask and position ids ``L - 1 + depth`` (``tree.py``). After verification both caches
  are cut to the committed context plus the accepted path (rows gathered per layer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import drafting, verify
from .config import MethodConfig
from .models import ModelPair
from .sampling import RowDists, SamplingConfig, logits_to_probs
from .stopping import make_stop_policy
from .trace import ACCEPTED, CONTEXT, REJECTED, UNVERIFIED, NodeTrace, RunTrace, StepTrace
from .tree import DraftTree, step_mask, step_position_ids, to_float_mask


class EngineError(ValueError):
    """Bad input to the engine (empty or too long prompt, impossible settings): the message says what is wrong."""


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def trim_cache(cache, keep_prefix: int, keep_rows: list[int]) -> int:
    """Keep cache positions ``[0, keep_prefix)`` plus ``keep_rows`` (ascending, all >= keep_prefix); drop the rest.

    Uses a plain crop when the kept rows are contiguous (the common chain case) and an ``index_select`` on the
    sequence axis of every layer's keys and values otherwise (transformers 5 has no sequence-axis select).
    Returns the new length.
    """
    total = cache_length(cache)
    new_len = keep_prefix + len(keep_rows)
    if keep_rows == list(range(keep_prefix, new_len)):
        if total > new_len:
            cache.crop(new_len - total)  # transformers 5: negative = tokens to remove
        return new_len
    index = torch.tensor(list(range(keep_prefix)) + keep_rows, dtype=torch.long)
    for layer in cache.layers:
        if not hasattr(layer, "keys") or getattr(layer, "sliding_window", None):
            raise EngineError(f"cache layer {type(layer).__name__} cannot be trimmed to a tree path")
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)
    return new_len


@dataclass
class _Forward:
    """Logits of one forward, kept for the rows we need (``(n_rows, vocab)``, model dtype)."""

    logits: torch.Tensor
    first_row: int  # index in the query of logits[0]


class Engine:
    """Step-wise speculative decoding on one ModelPair.

    Args:
        pair: the loaded models (shared, read-only; forwards hold ``pair.lock``).
        config: the method and its shape (``MethodConfig``).
        sampling: temperature / top-k / top-p / seed, applied to draft and target alike.
    Raises:
        EngineError: on ``start`` with an empty prompt or one that leaves no room in the context window.
    """

    def __init__(self, pair: ModelPair, config: MethodConfig, sampling: SamplingConfig):
        self.pair = pair
        self.config = config
        self.sampling = sampling
        self.branching = config.draft_branching()
        self.stop_policy = make_stop_policy(config.stop_policy_name(), config.threshold)
        if config.is_lossy:
            self.verifier_name = "longest-branch"
        elif sampling.greedy:
            self.verifier_name = "greedy"
        else:
            self.verifier_name = "rrs-replacement" if config.replacement else "rrs"
        self.trace: RunTrace | None = None

    # ------------------------------------------------------------------ set-up

    def start(self, prompt_ids: list[int], max_new_tokens: int, prompt_text: str = "") -> RunTrace:
        """Prefill both models on the prompt and open a new RunTrace.

        The target caches the whole prompt and keeps its next-token distribution for the first step; the draft
        caches ``prompt[:-1]`` and feeds the last prompt token (the first anchor) in its first forward.
        """
        if not prompt_ids:
            raise EngineError("the prompt is empty: type a prompt or pick an example")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        budget = self.pair.max_positions
        needed = len(prompt_ids) + max_new_tokens + self.config.max_nodes() + 1
        if needed > budget:
            raise EngineError(
                f"the prompt has {len(prompt_ids)} tokens; with {max_new_tokens} new tokens and a tree of "
                f"{self.config.max_nodes()} nodes it needs {needed} positions, but the models hold {budget}. "
                "Shorten the prompt or lower max new tokens."
            )
        self.generator = torch.Generator(device=self.pair.device)
        self.generator.manual_seed(int(self.sampling.seed))
        self.committed = list(int(t) for t in prompt_ids)
        self.n_prompt = len(self.committed)
        self.max_new_tokens = int(max_new_tokens)
        self.finished = False
        self.target_cache = _new_cache()
        self.draft_cache = _new_cache() if self.branching else None
        self.next_dist = None
        self.next_logits = None
        t0 = _now(self.pair.device)
        # The target prefills the whole prompt exactly as transformers' generate does (same kernels, same cache
        # rounding), and its last row gives p for the first step's anchor.
        fwd = self._forward(self.pair.target, self.target_cache, self.committed, list(range(self.n_prompt)), None,
                            keep=1)
        self.next_logits = fwd.logits[-1].float()
        self.next_dist = logits_to_probs(self.next_logits, self.sampling)
        head = self.committed[:-1]
        if self.draft_cache is not None and head:
            self._forward(self.pair.draft, self.draft_cache, head, list(range(len(head))), None, keep=1)
        prefill_ms = (_now(self.pair.device) - t0) * 1e3
        self.trace = RunTrace(
            settings={"method": self.config.to_dict(), "sampling": self.sampling.to_dict(),
                      "max_new_tokens": self.max_new_tokens, "verifier": self.verifier_name},
            model={"name": self.pair.name, "draft_id": self.pair.draft_id, "target_id": self.pair.target_id,
                   "dtype": str(self.pair.dtype).removeprefix("torch."), "device": str(self.pair.device)},
            prompt=prompt_text, prompt_ids=list(self.committed), prefill_ms=prefill_ms)
        return self.trace

    @property
    def n_generated(self) -> int:
        return len(self.committed) - self.n_prompt

    def _text(self, token_id: int) -> str:
        return self.pair.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ forwards

    def _forward(self, model, cache, input_ids: list[int], position_ids: list[int], mask, keep: int) -> _Forward:
        """One forward of ``model`` appending to ``cache``. ``mask``: bool ``(q, k)`` numpy array or None for the
        ordinary causal mask. Returns the logits of the last ``keep`` rows, cut to the shared vocabulary."""
        device = self.pair.device
        ids = torch.tensor([input_ids], dtype=torch.long, device=device)
        pos = torch.tensor([position_ids], dtype=torch.long, device=device)
        attn = None if mask is None else to_float_mask(mask, self.pair.dtype, device)
        with torch.inference_mode(), self.pair.lock:
            out = model(input_ids=ids, position_ids=pos, attention_mask=attn, past_key_values=cache,
                        use_cache=True, logits_to_keep=keep)
        logits = out.logits[0, :, : self.pair.vocab_size]
        return _Forward(logits=logits, first_row=len(input_ids) - logits.shape[0])

    # ------------------------------------------------------------------ one step

    def step(self) -> StepTrace:
        """Run one speculative round: draft a tree, verify it with one target forward, commit, trim caches.

        Returns the step's StepTrace (also appended to ``self.trace``). Raises EngineError when called before
        ``start`` or after the run finished.
        """
        if self.trace is None:
            raise EngineError("start() the engine with a prompt first")
        if self.finished:
            raise EngineError("this run has finished: reset to start again")
        device = self.pair.device
        t_start = _now(device)
        L = len(self.committed)
        tree = DraftTree()
        q_rows: dict[int, torch.Tensor] = {}  # row (node + 1; 0 = anchor) -> q its children were drafted from
        q_show: dict[int, float] = {}  # node -> q of its own token, as displayed
        stop_signals = []
        draft_calls = 0

        if self.config.is_lossy:
            if self.sampling.greedy:
                roots = drafting.greedy_candidates(self.next_logits, self.config.width)
            else:
                roots = drafting.gumbel_top_k(self.next_dist, self.config.width, self.generator)
            tree.add_level([-1] * len(roots), roots, source="target")

        # Drafting: level by level; the first draft forward also feeds the draft's chain (committed tokens it lacks).
        draft_chain = self.committed[self.draft_len():] if self.draft_cache is not None else []
        draft_past = L - len(draft_chain)
        fed = 0  # tree nodes in the draft cache (a breadth-first prefix)
        first = True
        for k in self.branching:
            level = tree.n_levels
            if level >= 1 and tree.source[tree.level_starts[level - 1]] == "draft":
                sig = self.stop_policy.signal(tree, level, q_show)
                stop_signals.append(sig)
                if not sig.keep_drafting:
                    break
            start, stop = (tree.level_starts[level - 1], tree.level_starts[level]) if level else (0, 0)
            ids = (draft_chain if first else []) + tree.token[start:stop]
            mask = step_mask(draft_past, len(draft_chain), first, tree.anc, start, stop)
            pos = step_position_ids(draft_past, len(draft_chain), first, tree.depth, start, stop)
            fwd = self._forward(self.pair.draft, self.draft_cache, ids, pos,
                                None if (first and level == 0) else mask, keep=max(stop - start, 1))
            draft_calls += 1
            first = False
            fed = stop
            frontier = list(range(start, stop)) if level else [-1]
            qd = RowDists(fwd.logits, self.sampling)
            parents, tokens = [], []
            for r, node in enumerate(frontier):
                if not self.sampling.greedy:
                    q_rows[node + 1] = qd[r]
                kids = drafting.candidates(qd, r, k, greedy=self.sampling.greedy,
                                           replacement=self.config.replacement, generator=self.generator)
                for t in kids:
                    q_show[len(tree) + len(tokens)] = qd.shown(r, t)
                    parents.append(node)
                    tokens.append(t)
            if not tokens:
                break
            tree.add_level(parents, tokens, source="draft")
        t_drafted = _now(device)

        # Verification: one target forward over its chain (the anchor, if not cached) and the whole tree.
        chain = self.committed[self.target_len():]
        past = L - len(chain)
        n = len(tree)
        mask = step_mask(past, len(chain), True, tree.anc, 0, n)
        pos = step_position_ids(past, len(chain), True, tree.depth, 0, n)
        target_calls = 1 if chain or n else 0
        if target_calls:
            logits = self._forward(self.pair.target, self.target_cache, chain + tree.token, pos,
                                   mask if n else None, keep=n + (1 if chain else 0)).logits
        else:  # first `ar` step: the prefill already gave the anchor's distribution
            logits = torch.empty(0, self.pair.vocab_size)
        if chain:  # logits row 0 = anchor (p row 0), row 1 + i = node i
            p_rows = RowDists(logits, self.sampling)
        else:  # the anchor is cached: its distribution was kept from the prefill or the previous (lossy) step
            p_rows = RowDists(logits, self.sampling, offset=1, fixed={0: (self.next_dist, self.next_logits)})
        result = verify.VERIFIERS[self.verifier_name](
            tree, p_rows, q_rows, generator=self.generator, greedy=self.sampling.greedy,
            replacement=self.config.replacement)

        # Commit, then cut both caches to the committed context plus the accepted path.
        new_tokens = [tree.token[i] for i in result.path] + ([result.bonus] if result.bonus is not None else [])
        head = past + len(chain)
        trim_cache(self.target_cache, head, [head + i for i in result.path])
        if draft_calls:
            head = draft_past + len(draft_chain)
            trim_cache(self.draft_cache, head, [head + i for i in result.path if i < fed])
        if self.config.is_lossy:
            self.next_dist = result.next_dist
            self.next_logits = p_rows.row_logits(result.next_row)
        new_tokens = self._truncate(new_tokens)
        self.committed.extend(new_tokens)
        t_end = _now(device)

        step = self._record(tree, L, chain, mask, pos, past, q_show, p_rows, result, new_tokens,
                            stop_signals, draft_calls, target_calls, (t_drafted - t_start) * 1e3, (t_end - t_drafted) * 1e3,
                            (t_end - t_start) * 1e3)
        self.trace.steps.append(step)
        return step

    def _truncate(self, tokens: list[int]) -> list[int]:
        """Cut at the first EOS (kept) and at ``max_new_tokens``; mark the run finished when either is hit."""
        room = self.max_new_tokens - self.n_generated
        out = []
        for t in tokens[:room]:
            out.append(t)
            if t in self.pair.eos_token_ids:
                self.finished = True
                break
        if len(out) >= room:
            self.finished = True
        return out

    def target_len(self) -> int:
        """Committed tokens in the target's KV cache."""
        return cache_length(self.target_cache)

    def draft_len(self) -> int:
        """Committed tokens in the draft's KV cache."""
        return cache_length(self.draft_cache)

    # ------------------------------------------------------------------ trace

    def _record(self, tree, L, chain, mask, pos, past, q_show, p_rows, result, new_tokens, stop_signals,
                draft_calls, target_calls, draft_ms, verify_ms, step_ms) -> StepTrace:
        committed_nodes = set(result.path[: len(new_tokens)])
        branches = tree.children(-1)
        branch_of = tree.branch_ids()
        anchor_token = self.committed[L - 1] if L - 1 < len(self.committed) else self.committed[-1]
        nodes = [NodeTrace(id=0, parent=None, token_id=anchor_token, text=self._text(anchor_token), depth=0,
                           position_id=L - 1, source=CONTEXT, status=CONTEXT, committed=True)]
        for i in range(len(tree)):
            parent_row = tree.parent[i] + 1
            tok = tree.token[i]
            d = result.decisions.get(i)
            if tree.source[i] == "target":
                status = ACCEPTED
            elif d is None:
                status = UNVERIFIED
            else:
                status = ACCEPTED if d.accepted else REJECTED
            nodes.append(NodeTrace(
                id=i + 1, parent=parent_row, token_id=tok, text=self._text(tok), depth=tree.depth[i],
                position_id=L - 1 + tree.depth[i], source=tree.source[i], status=status,
                committed=i in committed_nodes, branch=branch_of[i],
                q=q_show.get(i), p=p_rows.shown(parent_row, tok),
                u=None if d is None else d.u, ratio=None if d is None else _finite(d.ratio),
                residual_top=[] if d is None else [[t, self._text(t), pr] for t, pr in d.residual_top]))
        ids = ([0] if chain else []) + [i + 1 for i in range(len(tree))]
        drafted = sum(1 for s in tree.source if s == "draft")
        accepted_draft = sum(1 for i in result.path[: len(new_tokens)] if tree.source[i] == "draft")
        branch_rows = []
        for b, root in enumerate(branches):
            branch_rows.append({"branch": b, "root_id": root + 1, "root_text": self._text(tree.token[root]),
                                "accepted": int(result.branch_accepted.get(b, 0)),
                                "drafted": sum(1 for j in range(len(tree)) if branch_of[j] == b and tree.source[j] == "draft"),
                                "chosen": b == result.chosen_branch})
        return StepTrace(
            index=len(self.trace.steps), method=self.config.method, lossy=self.config.is_lossy, nodes=nodes,
            mask=mask[:, past:].astype(int).tolist(), mask_node_ids=ids, mask_context_len=past,
            position_ids=[int(p) for p in pos], branches=branch_rows, stop_signals=stop_signals,
            committed_ids=list(new_tokens), committed_text=[self._text(t) for t in new_tokens],
            bonus_token=result.bonus if (result.bonus is not None and len(new_tokens) > len(result.path)) else None,
            accepted_draft_len=accepted_draft, max_draft_len=len(self.branching), drafted=drafted,
            draft_calls=draft_calls, target_calls=target_calls, draft_ms=draft_ms, verify_ms=verify_ms, step_ms=step_ms,
            verifier=self.verifier_name, finished=self.finished)

    # ------------------------------------------------------------------ whole runs

    def run(self, max_steps: int | None = None, on_step=None) -> RunTrace:
        """Step until finished (or ``max_steps``); ``on_step(step_trace)`` is called after each step."""
        count = 0
        while not self.finished and (max_steps is None or count < max_steps):
            s = self.step()
            count += 1
            if on_step:
                on_step(s)
        return self.trace


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
