"""Recording: what a run and each of its steps produced, as the plain data of ``trace/records.py``.

``Recorder`` turns a step's ``Drafted`` and ``VerifiedStep`` into its ``StepTrace`` (every node with its token text,
p, q, the uniform draw and the verdict; the mask; the branches) and writes the run's header (``run_header``). Token
texts are decoded once per token id; the text each committed token adds is decoded incrementally, as streaming
detokenisers do (``IncrementalText``), never the whole output again.
"""

from __future__ import annotations

from ..trace.records import (ACCEPTED, CONTEXT, DRAFT_SOURCES, REJECTED, TOP_K_SHOWN, UNVERIFIED, NodeTrace, RunTrace,
                             StepTrace)
from .drafters.base import Drafted
from .policies.stopping import STOP_POLICY_ORIGINS
from .verify.registry import VERIFIER_REGISTRY
from .verification import VerifiedStep


class IncrementalText:
    """The text each new token adds to a decoded output, from a window of the last tokens (the offsets streaming
    detokenisers keep: vLLM's ``detokenize_incrementally``, transformers' ``TextStreamer``). A token that ends
    inside a multi-byte character adds "" and the token completing it carries the whole character, so the pieces
    join to the decoded text. Cost per token: a decode of a few tokens, whatever the output's length."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []
        self._prefix = self._read = 0  # the window: ids[prefix:read] decoded already, ids[read:] pending

    def add(self, token: int) -> str:
        """Append ``token``; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if text.endswith("\ufffd") or len(text) <= len(before) or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]


class Recorder:
    """The trace of one engine's runs: token texts (cached per id) and each step's ``StepTrace``.

    Args:
        tokenizer: the pair's shared tokenizer (``decode``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> decoded text (the trace shows thousands per run)
        self.output = IncrementalText(tokenizer)  # the run's generated text, token by token

    def token_text(self, token_id: int) -> str:
        """The text of one token as the tokenizer decodes it alone (cached): what the trace shows."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def step(self, index: int, context: list[int], d: Drafted, v: VerifiedStep, new_tokens: list[int], *,
             method: str, lossy: bool, max_draft_len: int, verifier: str, finished: bool) -> StepTrace:
        """The trace of step ``index`` (0-based) after ``context`` (the committed tokens before it, the anchor last),
        which committed ``new_tokens``; its times are filled in once its clock stops."""
        tree, result, p_rows = d.tree, v.result, v.p_rows
        L = len(context)
        committed_nodes = set(result.path[: len(new_tokens)])
        branch_of = tree.branch_ids()
        p_top = p_rows.top(v.parent_rows, TOP_K_SHOWN)  # from the batched pass over the parent rows
        p_rows.prefetch_shown([(tree.parent[i] + 1, tree.token[i]) for i in range(len(tree))])
        nodes = [NodeTrace(id=0, parent=None, token_id=context[-1], text=self.token_text(context[-1]), depth=0,
                           position_id=L - 1, source=CONTEXT, status=CONTEXT, committed=True)]
        for i in range(len(tree)):
            parent_row = tree.parent[i] + 1
            tok = tree.token[i]
            dec = result.decisions.get(i)
            odds = v.odds.get(i)
            if tree.source[i] == "target":
                status = ACCEPTED
            elif dec is None:
                status = UNVERIFIED
            else:
                status = ACCEPTED if dec.accepted else REJECTED
            nodes.append(NodeTrace(
                id=i + 1, parent=parent_row, token_id=tok, text=self.token_text(tok), depth=tree.depth[i],
                position_id=L - 1 + tree.depth[i], source=tree.source[i], status=status,
                committed=i in committed_nodes, branch=branch_of[i],
                q=d.q_show.get(i), p=p_rows.shown(parent_row, tok),
                provenance=self._provenance(d.provenance.get(i), context),
                u=None if dec is None else dec.u, ratio=None if dec is None else _finite(dec.ratio),
                residual_top=[] if dec is None else self._top_rows(dec.residual_top),
                p_top=self._top_rows(p_top.get(parent_row, [])), q_top=self._top_rows(d.q_top.get(parent_row, [])),
                accept_prob=None if odds is None else odds.accept_prob,
                slot_prob=None if odds is None else odds.slot_prob, test_order=None if odds is None else odds.order,
                predicted_accept=d.predicted.get(i)))
        ids = ([0] if v.anchor_fed else []) + [i + 1 for i in range(v.fed)]
        drafted = sum(1 for s in tree.source if s in DRAFT_SOURCES)
        accepted_draft = sum(1 for i in result.path[: len(new_tokens)] if tree.source[i] in DRAFT_SOURCES)
        branch_rows = []
        for b, root in enumerate(tree.children(-1)):
            branch_rows.append({"branch": b, "root_id": root + 1, "root_text": self.token_text(tree.token[root]),
                                "accepted": int(result.branch_accepted.get(b, 0)),
                                "drafted": sum(1 for j in range(len(tree))
                                               if branch_of[j] == b and tree.source[j] in DRAFT_SOURCES),
                                "chosen": b == result.chosen_branch})
        return StepTrace(
            index=index, method=method, lossy=lossy, nodes=nodes,
            mask=v.mask.astype(int).tolist(), mask_node_ids=ids, mask_context_len=v.past,
            position_ids=[int(p) for p in v.position_ids], branches=branch_rows, stop_signals=d.signals,
            committed_ids=list(new_tokens), committed_text=[self.output.add(t) for t in new_tokens],
            bonus_token=result.bonus if (result.bonus is not None and len(new_tokens) > len(result.path)) else None,
            accepted_draft_len=accepted_draft, max_draft_len=max_draft_len, drafted=drafted,
            draft_calls=d.calls, target_calls=v.calls, draft_ms=0.0, verify_ms=0.0, step_ms=0.0,
            verifier=verifier, finished=finished, drafter=self._drafter_info(d.info),
            expected_tokens=v.expected_tokens, prefill_rows=v.prefill_rows)

    def _provenance(self, prov: dict | None, context: list[int]) -> dict | None:
        """A free node's provenance with the texts a replay needs (no tokenizer there)."""
        if prov is None:
            return None
        prov = dict(prov)
        if "row_token" in prov:  # recycled: the token whose matrix row proposed it
            prov["row_text"] = self.token_text(prov["row_token"])
        if "match_at" in prov:  # lookup: the earlier occurrence of the n-gram the copy continues
            at = prov["match_at"]
            prov["match_text"] = "".join(self.token_text(t) for t in context[at: at + prov["ngram"]])
        return prov

    def _drafter_info(self, info: dict) -> dict:
        """The drafter's record with token texts added (the matrix row of the anchor)."""
        info = dict(info)
        row = info.get("recycling_row")
        if row is not None:
            info["recycling_row"] = {**row, "token_text": self.token_text(row["token"]),
                                     "candidate_texts": [self.token_text(t) for t in row["candidates"]]}
        return info

    def _top_rows(self, top: list) -> list:
        return [[t, self.token_text(t), float(pr)] for t, pr in top]


def run_plugins(config, verifier: str) -> list[dict]:
    """The plugins a run of ``config`` verified by ``verifier`` depends on (``explorer.plugins``), one entry per part
    it registered: ``name``, ``loaded_from``, ``version``, ``sha256``, ``bundled`` (the project's own), the first
    paragraph of its docstring (``doc``), and the part: ``method`` (with its ``label`` and ``summary``), ``verifier``
    or ``stop``; as the trace's
    ``settings["plugins"]`` records them; empty for the project's own methods."""
    found: list[dict] = []
    parts = (("method", config.spec.origin),
             ("verifier", VERIFIER_REGISTRY[verifier].origin if verifier in VERIFIER_REGISTRY else None),
             ("stop", STOP_POLICY_ORIGINS.get(config.stop_policy_name())))
    for role, origin in parts:
        if origin:
            found.append({**origin, role: {"method": config.method, "verifier": verifier,
                                           "stop": config.stop_policy_name()}[role]})
            if role == "method":  # what teach mode says of it, also where the plugin is not loaded
                found[-1].update(label=config.spec.label, summary=config.spec.summary)
    return found


def run_header(engine, prompt_text: str, prefill_ms: float, joint_prefill: bool) -> RunTrace:
    """A new run's ``RunTrace`` (no steps yet): its settings (method, sampling, budget, verifier, what the drafter
    and the learners started from), the models and how they ran, the prompt and the prefill's time (ms)."""
    parts, pair, opts = engine.parts, engine.pair, engine.options
    fallback, decision_model = parts.fallback, parts.decision_model
    settings = {"method": engine.config.to_dict(), "sampling": engine.sampling.to_dict(),
                "max_new_tokens": engine.state.max_new_tokens, "verifier": engine.verifier_name,
                **parts.drafter.state_for_trace(),
                **({"fallback_carried": fallback.carried} if fallback and fallback.carried else {}),
                **({"adaptation_carried": parts.adapter_carried} if parts.adapter_carried else {}),
                **({"joint_prefill": True} if joint_prefill else {}),
                **({"decision_model": {"kind": decision_model.kind, **decision_model.source}}
                   if getattr(decision_model, "source", None) else {}),
                **({"plugins": plugins} if (plugins := run_plugins(engine.config, engine.verifier_name)) else {})}
    model = {"name": pair.name, "draft_id": pair.draft_id, "target_id": pair.target_id,
             "dtype": str(pair.dtype).removeprefix("torch."), "device": str(pair.device),
             **({"draft_device": str(pair.draft_at)} if pair.split else {}),
             "draft_quant": pair.draft_quant, "packed_weights": pair.packed_weights,
             "kv_cache": opts.kv_cache, "graphs": opts.graphs,
             **({"chain_levels": opts.chain_levels} if opts.chain_levels else {}),
             **({"fused_kernels": True} if pair.fused_kernels else {}),
             **({"verification_cost": pair.measured["verification_cost"]}
                if "verification_cost" in pair.measured else {}),
             **({"row_pricing": parts.row_pricing.prices} if parts.row_pricing is not None else {}),
             **({"tree_costs": parts.tree_costs} if parts.tree_costs is not None else {})}
    state = engine.state
    return RunTrace(settings=settings, model=model, prompt=prompt_text, prompt_ids=list(state.committed),
                    prefill_ms=prefill_ms)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
