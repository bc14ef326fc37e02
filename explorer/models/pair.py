"""A loaded draft/target pair: the two models, their shared tokenizer and what the engine needs to know of them.

Loading lives in ``models/loading.py`` (the embedded pair, Hugging Face folders and ids, GGUF files) and
``models/tiny.py`` (the tiny random pair); both wrap what they load with ``make_pair``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass
class ModelPair:
    """A loaded draft/target pair sharing one tokenizer.

    Attributes:
        draft, target: causal LMs in eval mode, on ``device`` in ``dtype`` (an int8 draft computes in float32
            around its int8 matrix multiplies: ``draft_quant``; a draft placed elsewhere is on ``draft_device``).
            Shared and read-only: engines keep their own KV caches, and ``lock`` serialises forwards when several
            sessions share one pair.
        device: the target's device, where the engine's tensors live.
        draft_device: the draft's device where it is not ``device`` (``loading.place_draft``: say the draft on
            the CPU, the target on a GPU, so that PEARL's two lanes run at once for real); None: ``device``.
        tokenizer: the common tokenizer.
        vocab_size: logits columns used by the engine, ``min`` of the two models' output sizes (padding rows of an
            embedding matrix are never real tokens).
        name, draft_id, target_id: labels for traces and reports.
        packed_weights: the float32 models' linear layers hold their weights packed for oneDNN (``pack_weights``).
        fused_kernels: the models' norms, MLPs and rotary embedding run compiled, fused kernels (``fuse_pair``).
        draft_quant: ``none`` or ``int8`` (the draft's linear layers dynamically quantized; see ``quantize_draft``).
        unquantized_draft: the draft before quantization, kept only when asked (``bench`` runs transformers'
            assisted generation with it as the users' baseline); None otherwise.
    """

    draft: torch.nn.Module
    target: torch.nn.Module
    tokenizer: object
    name: str
    draft_id: str
    target_id: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_positions: int
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    draft_quant: str = "none"
    unquantized_draft: torch.nn.Module | None = field(default=None, repr=False)
    graph_runners: dict = field(default_factory=dict, repr=False)  # idle CUDA-graph runners (graphs.acquire_runner)
    measured: dict = field(default_factory=dict, repr=False)  # this machine's costs, once (runtime/forward_costs.py)
    packed_weights: bool = False  # float32 linears packed once for oneDNN (models/packed_weights.py)
    fused_kernels: bool = False  # norms, MLPs and rotary compiled into fused kernels (models/fused_kernels.py)
    heads: dict = field(default_factory=dict, repr=False)  # loaded EAGLE-3 heads by folder (models/head_store.py)
    draft_device: torch.device | None = None

    @property
    def draft_at(self) -> torch.device:
        """The device the draft model runs on."""
        return self.draft_device or self.device

    @property
    def split(self) -> bool:
        """The draft and the target are on different devices (their forwards can overlap for real)."""
        return self.draft_at != self.device


def _eos_ids(lm, tok) -> tuple[int, ...]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(lm, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tok.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def make_pair(draft, target, tokenizer, *, name: str, draft_id: str, target_id: str) -> ModelPair:
    """Wrap two loaded models and a tokenizer into a ModelPair (models must already share the tokenizer)."""
    dv = draft.get_output_embeddings().weight.shape[0]
    tv = target.get_output_embeddings().weight.shape[0]
    param = next(target.parameters())
    max_pos = min(getattr(draft.config, "max_position_embeddings", 1 << 30),
                  getattr(target.config, "max_position_embeddings", 1 << 30))
    return ModelPair(draft=draft, target=target, tokenizer=tokenizer, name=name, draft_id=draft_id,
                     target_id=target_id, device=param.device, dtype=param.dtype, vocab_size=min(dv, tv),
                     eos_token_ids=_eos_ids(target, tokenizer), max_positions=int(max_pos))
