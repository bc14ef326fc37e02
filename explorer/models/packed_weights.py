"""Linear weights packed once for the CPU's matrix multiplies, instead of on every call.

A float32 ``nn.Linear`` on the CPU hands its weight to the BLAS on each call, and for a query of two or more rows the
BLAS copies the whole weight into its blocked layout first (packing), then multiplies. For a 1.5B target that copy is
another pass over 6 GB per forward: measured on a 2-core AVX2 EPYC (docs/bench.md, "Packed float32 weights"), the
target's forward after a 200-token context takes 373 ms for one row and 733 ms for two, so a verified tree cost twice a
plain step before its first extra row. oneDNN (PyTorch's ``mkldnn`` ops, the kernels ``torch.compile``'s CPU freezing
uses) can keep a weight in its blocked layout: ``_reorder_linear_weight`` once at load time, ``_linear_pointwise`` per
call. Same machine and context, packed: 1 / 2 / 16 / 32 rows in 273 / 310 / 569 / 872 ms against 373 / 733 / 1052 / 1363
ms stock.

It changes the order of the float additions, not the model: logits move by about 1e-4 (0.00012 measured, out of
logits of magnitude ~10), the same for every method and baseline on the pair (transformers' ``generate`` runs the
same module objects). ``auto`` packs float32 models on a CPU whose PyTorch has oneDNN; bf16 / fp16 and CUDA keep
their stock kernels (bf16 linears already go through oneDNN there). An int8 draft (``quantize_draft``) has no
``nn.Linear`` left to pack.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

PACK_MODES = ("auto", "on", "off")
BATCH_HINT = 16
"""Rows oneDNN is told to expect when it lays a weight out (a typical verification); any row count works."""


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives in oneDNN's blocked layout (``torch.ops.mkldnn``).

    Input ``(..., in_features)`` float32, output ``(..., out_features)`` float32, as the linear it replaces; the
    packed weight is an opaque oneDNN tensor (not a parameter: not saved, not moved by ``.to``).

    ``keep_weight``: keep the stock ``(out_features, in_features)`` weight readable as ``.weight`` (not a
    parameter, never used by ``forward``). ``pack_linear_weights`` keeps it for the model's output embedding only,
    whose rows other code reads (an EAGLE head's fit check and its ``lm_head`` rows, the pair's vocabulary size):
    tied to the input embedding or file-backed it costs no resident memory; other linears drop it."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        if keep_weight:
            self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed (oneDNN)"


def can_pack(model: torch.nn.Module) -> bool:
    """Whether ``model``'s linears can be packed here: float32 weights on the CPU and a PyTorch with oneDNN."""
    param = next(model.parameters(), None)
    return (param is not None and param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` (in place) by a ``PackedLinear``; returns how many.

    Raises ValueError when ``can_pack(model)`` is false."""
    if not can_pack(model):
        raise ValueError("packed weights need float32 weights on the CPU and a PyTorch built with oneDNN (mkldnn)")
    n = 0
    mapped = file_mappings()
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:  # exactly nn.Linear: not quantized or other subclasses
                setattr(module, name, PackedLinear(child, keep_weight=child is output))
                drop_file_pages(child.weight, mapped)
                n += 1
    return n


# Weights loaded from safetensors are views of the file mapped into memory. Packing reads each weight once, making
# its pages resident, and keeps its own copy; the file's pages stay resident (and counted) while anything views the
# mapping. Dropping a packed weight's pages as it goes keeps the peak near one copy of the model: the embedded fp32
# pair peaked at 15.2 GB resident without it (the target's 6.1 GB of file pages beside its 6.4 GB packed copy).
MADV_DONTNEED = 4


def file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``.safetensors`` files (Linux; [] elsewhere). safetensors maps
    them private and writable (copy-on-write); nothing writes to weights, so every page holds the file's bytes."""
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) >= 6 and parts[5].endswith(".safetensors"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        return []
    return out


def drop_file_pages(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> int:
    """Give back the resident pages wholly inside ``tensor``'s bytes where they lie in one of ``mappings`` (file
    mappings: a page read again comes back from the file, which holds the same bytes). Only for a tensor no longer
    used; pages it shares with a neighbour are kept. Returns the bytes dropped (0 where the tensor is not
    file-backed or the call is unavailable)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(lo <= start and end <= hi for lo, hi in mappings):
        return 0
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return last - first
