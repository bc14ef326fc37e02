"""Online speculative decoding for a draft model (OSD: Liu et al., ICML 2024, arXiv 2310.07177; the reference code is
LiuXiaoxuanPKU/OSD, ``distill/distill_trainer.py``): while it serves, a LoRA adapter (peft) on the draft learns the
target's own distributions at the positions where the draft's tokens were rejected. The base weights stay the pair's,
shared by every session; the adapter is the session's.

What a request leaves (``DraftDistiller.rejected``, fed by ``drafters/model.py``): one **rejection** per step where the
verifier rejected the draft's children of the last accepted node: the position of the token they were drafted for
(the draft's logits there are the ones that produced them) and the target's plain distribution at that position (its
``LABEL_K`` best tokens), which verification computed anyway. The bonus token's position, where nothing was rejected,
is not trained on (the reference code's index is one off there).

Between requests only (``Engine`` calls ``end_request`` when a run finishes), every ``every`` requests the adapter
takes one AdamW step on the forward KL ``KL(p || q)`` from the target's distribution to the draft's, averaged over
the rejections buffered since the last update. The draft's logits are recomputed in one forward over each request's
committed tokens: a drafted node's context is the committed text up to it (the accepted path is committed), so the
row before a rejection's position holds the logits that drafted the rejected tokens. LoRA's B starts at zero, so
version 0 drafts exactly as the base draft.

The adapter needs gradients through the draft's linear layers. An int8 draft (the CPU default, ``--draft-quant``) has
none, so its session copy drafts and learns on float32 linears dequantized from the int8 weights, made once per
loaded draft and shared by every session (``float_linears``; the draft only proposes, so the rounding changes no
output, and that copy drafts about as fast as an unquantized draft). oneDNN-packed weights (``--packed-weights``)
keep no plain weight and are refused with a message.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .online_distill import OnlineDistiller

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # a PeftModel's weights sit under its base model
ADAPTER_CONFIG, ADAPTER_WEIGHTS, DISTILL_FILE = "adapter_config.json", "adapter_model.safetensors", "distill.json"


class AdapterError(ValueError):
    """A draft that cannot take a LoRA adapter, or an adapter folder that cannot be read or does not fit."""


@dataclass
class DraftRejection:
    """One step's rejected draft tokens: ``position`` the index in the committed ids of the token they were drafted
    for, ``ids`` / ``probs`` the target's ``LABEL_K`` best tokens and plain probabilities there."""

    position: int
    ids: list[int]
    probs: list[float]


@dataclass
class DraftRecord:
    """One finished request: its committed ids (prompt and output) and its rejections."""

    committed: list[int] = field(default_factory=list)
    rejections: list[DraftRejection] = field(default_factory=list)


_FLOAT_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FLOAT_LOCK = threading.Lock()


def float_linears(draft: torch.nn.Module) -> dict[int, torch.nn.Linear]:
    """id of each int8 dynamic linear layer of ``draft`` -> a float32 ``torch.nn.Linear`` with its dequantized
    weight and bias, made once per draft and shared (empty for a draft with no int8 layers)."""
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    with _FLOAT_LOCK:
        if draft not in _FLOAT_LINEARS:
            out = {}
            for m in draft.modules():
                if isinstance(m, Int8Linear):
                    bias = m.bias()
                    linear = torch.nn.Linear(m.in_features, m.out_features, bias=bias is not None)
                    with torch.no_grad():
                        linear.weight.copy_(m.weight().dequantize())
                        if bias is not None:
                            linear.bias.copy_(bias)
                    linear.requires_grad_(False)
                    out[id(m)] = linear
            _FLOAT_LINEARS[draft] = out
        return _FLOAT_LINEARS[draft]


def trainable(draft: torch.nn.Module) -> str | None:
    """Why ``draft`` cannot take a LoRA adapter (oneDNN-packed linear layers), or None where it can."""
    if any(type(m).__name__ == "PackedLinear" for m in draft.modules()):
        return ("the draft's weights are packed for oneDNN (no plain weights for an adapter); load the pair with "
                "--packed-weights off to distil the draft online")
    return None


class DraftDistiller(OnlineDistiller):
    """A session's online distillation of a draft model through a LoRA adapter (module docstring; the schedule and
    history: ``online_distill.OnlineDistiller``).

    Args:
        model: the session's draft (``for_draft``: the pair's base weights shared, the adapter its own).
        lr, every: as ``OnlineDistiller``'s. vocab_size: the pair's shared vocabulary (the draft's logits are cut to
            it, as its forwards are).
        lora: the adapter's settings (``peft.LoraConfig.to_dict()``), for saving.
    Raises AdapterError: ``lr`` not positive or ``every`` below 1.
    """

    error = AdapterError

    def __init__(self, model: torch.nn.Module, lr: float, every: int, vocab_size: int, lora: dict):
        params = [p for n, p in model.named_parameters() if "lora_" in n]
        for p in params:
            p.requires_grad_(True)
        super().__init__(params, lr, every)
        self.model, self.vocab_size, self.lora = model, vocab_size, lora
        self._current = DraftRecord()
        self.base: torch.nn.Module | None = None  # the pair's draft it adapts (``for_draft``)
        self.source = ""  # the adapter folder it started from, empty for a new adapter

    @classmethod
    def for_draft(cls, draft: torch.nn.Module, vocab_size: int, lr: float = 1e-4, every: int = 8, rank: int = 8,
                  adapter: str | Path | None = None) -> DraftDistiller:
        """A distiller of a session copy of ``draft`` (modules copied, weights shared) with a new LoRA adapter of
        rank ``rank`` on its attention and MLP projections, or the adapter saved in folder ``adapter``
        (``save``). Raises AdapterError where the draft cannot take one or the folder does not fit."""
        from peft import LoraConfig, inject_adapter_in_model

        why = trainable(draft)
        if why:
            raise AdapterError(why)
        saved = _read_adapter(adapter) if adapter else None
        config = LoraConfig(**saved[0]) if saved else LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGET_MODULES), bias="none")
        tensors = list(draft.parameters()) + list(draft.buffers())
        memo = {id(t): t for t in tensors} | float_linears(draft)  # an int8 layer's place: its shared float copy
        own = copy.deepcopy(draft, memo=memo)  # the pair's weights, this session's modules
        try:
            inject_adapter_in_model(config, own)
        except ValueError as exc:
            raise AdapterError(f"the draft cannot take a LoRA adapter: {exc}") from None
        dtype = next(own.parameters()).dtype
        for name, p in own.named_parameters():
            if "lora_" in name:
                p.data = p.data.to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
            elif p.requires_grad:
                p.requires_grad_(False)  # the shared base never learns
        out = cls(own, lr, every, vocab_size, _plain(config.to_dict()))
        out.base, out.source = draft, str(adapter or "")
        if saved:
            out._load(saved[1])
        return out

    def describe(self) -> dict:
        """Plain data for a run's trace: the adapter's folder (empty: a new one), rank, settings, version and
        requests seen."""
        return {"path": self.source, "rank": self.lora.get("r"), **super().describe()}

    # ------------------------------------------------------------------ a request's record

    def begin(self) -> None:
        """A new request (or a rewound one): nothing rejected yet."""
        self._current = DraftRecord()

    def rejected(self, position: int, ids: list[int], probs: list[float]) -> None:
        """A step's draft tokens for committed position ``position`` were rejected; the target's best tokens ``ids``
        with plain probabilities ``probs`` there."""
        self._current.rejections.append(DraftRejection(int(position), list(ids), list(probs)))

    def _finish(self, committed: list[int]) -> tuple[DraftRecord, bool]:
        """The committed ids, and the rejections at positions within them."""
        rec, self._current = self._current, DraftRecord()
        rec.committed = [int(t) for t in committed]
        rec.rejections = [r for r in rec.rejections if 0 < r.position < len(rec.committed)]
        return rec, True

    # ------------------------------------------------------------------ the update

    def update(self) -> float | None:
        """One AdamW step on the mean forward KL over the buffered rejections (``_take``). Returns the loss before
        the step, or None where nothing was buffered."""
        records = self._take()
        if not records:
            return None
        self.optimizer.zero_grad(set_to_none=True)
        count = sum(len(r.rejections) for r in records)
        total = 0.0
        self.model.train(False)
        with torch.enable_grad():
            for rec in records:  # one backward per request: its graph is freed before the next
                kl = self.request_kl(rec) / count
                kl.backward()
                total += float(kl.detach())
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.version += 1
        return total

    def rejection_logq(self, rec: DraftRecord) -> torch.Tensor:
        """float32 ``(len(rec.rejections), vocab_size)``: the draft's log-probabilities at each rejection's position
        (its logits at the row before), from one forward over the committed ids up to the last of them (with
        gradients where enabled)."""
        device = self.params[0].device
        end = max(r.position for r in rec.rejections)
        ids = torch.tensor([rec.committed[:end]], dtype=torch.long, device=device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :, : self.vocab_size].float()
        rows = torch.tensor([r.position - 1 for r in rec.rejections], dtype=torch.long, device=device)
        return logits[rows].log_softmax(-1)

    def request_kl(self, rec: DraftRecord) -> torch.Tensor:
        """The summed KL(p || q) of one request's rejections (``rejection_logq``), p the target's best tokens
        renormalised."""
        logq = self.rejection_logq(rec)
        p = torch.zeros_like(logq)
        for i, r in enumerate(rec.rejections):
            keep = [(t, q) for t, q in zip(r.ids, r.probs) if t < self.vocab_size]
            p[i, [t for t, _ in keep]] = torch.tensor([q for _, q in keep], device=logq.device)
        p = p / p.sum(-1, keepdim=True)
        return (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum()

    # ------------------------------------------------------------------ saving

    def save(self, folder: str | Path) -> Path:
        """Write the adapter as peft writes one (``adapter_config.json``, ``adapter_model.safetensors``: it loads
        with ``--draft-adapter`` and with ``peft.PeftModel.from_pretrained``) and ``distill.json`` (settings,
        version, history) into ``folder``. Returns the folder."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {PEFT_PREFIX + k: v.detach().contiguous().cpu()  # the key names a PeftModel saves and loads
                 for k, v in get_peft_model_state_dict(self.model).items()}
        save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(self.lora, indent=1), encoding="utf-8")
        (folder / DISTILL_FILE).write_text(json.dumps({**self.describe(), "history": self.history}, indent=1),
                                           encoding="utf-8")
        return folder

    def _load(self, state: dict) -> None:
        from peft import set_peft_model_state_dict

        state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
        result = set_peft_model_state_dict(self.model, state)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if missing or getattr(result, "unexpected_keys", []):
            raise AdapterError(f"the adapter does not fit this draft: {len(missing)} missing and "
                               f"{len(result.unexpected_keys)} unexpected weights")


def _plain(config: dict) -> dict:
    """peft's config as JSON-able data (sets become sorted lists, enums their values)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, set):
            v = sorted(v)
        elif hasattr(v, "value"):
            v = v.value
        try:
            json.dumps(v)
        except TypeError:
            continue
        out[k] = v
    return out


def _read_adapter(folder: str | Path) -> tuple[dict, dict]:
    """(LoraConfig keyword arguments, the adapter's tensors) of a folder ``save`` wrote. Raises AdapterError where
    it is missing, unreadable or not a LoRA adapter."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        state = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read a draft adapter from {folder}: {exc}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{folder / ADAPTER_CONFIG} is not a LoRA adapter's config")
    known = set(LoraConfig.__dataclass_fields__)
    return {k: v for k, v in config.items() if k in known and k not in ("peft_type", "task_type")}, state
