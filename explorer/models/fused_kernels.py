"""A model's small elementwise pieces compiled into fused kernels (``torch.compile``, Inductor).

Why: on a GPU a small model's forward replayed from a CUDA graph (``engine/runtime/graphs.py``) is still a few
thousand kernels, most of them elementwise: an RMSNorm is about seven (cast, square, mean, add, rsqrt, two
multiplies), rotary position embedding about a dozen, the MLP's SiLU and product two. Each costs a few microseconds
of launch and memory round trip however little it computes, so the draft's forward costs nearly what the target's
does. Compiling these pieces fuses each into one or two kernels; the matrix multiplies and attention stay
as they are. Measured on an H100 (bf16, random weights of the embedded pair's shapes, one forward replayed from a
CUDA graph, timed as ``scripts/forward_times.py`` does): the 0.5B draft's 1-row forward 2.87 -> 1.82 ms and 4 rows
3.25 -> 2.11 ms; the 1.5B target's 1 row 4.20 -> 2.97 ms and 16 rows 4.96 -> 3.40 ms. Compiling a whole forward
instead gave 1.58 / 2.68 ms but cost about 25 s of compiling per query size on the target (nine bucket sizes),
against about 3 s here: the pieces are compiled with dynamic shapes, once for every row count.

What is compiled, per model instance: every module whose class name ends in ``RMSNorm`` and every ``...MLP`` whose
linear layers are plain ``torch.nn.Linear`` (an int8 or oneDNN-packed MLP is left alone); and, once per model family,
the family module's ``apply_rotary_pos_emb`` (a module-level function: every model of that family in the process
uses the compiled one until the last fused model of the family is unfused). Values change only by rounding (fused
kernels sum in another order): greedy texts can differ at near-ties, as between any two kernel choices.
"""

from __future__ import annotations

import functools
import sys

import torch

FUSE_MODES = ("on", "off")

_ROTARY = "apply_rotary_pos_emb"
_families: dict[str, tuple[object, int]] = {}  # family module name -> (its original rotary function, fused models)
_compiled: dict[type, object] = {}  # module class -> its compiled forward


class FusedKernelsError(RuntimeError):
    """Fused kernels cannot be made here (no ``torch.compile``)."""


def _plain_mlp(module: torch.nn.Module) -> bool:
    linears = [m for m in module.children() if hasattr(m, "weight") or "Linear" in type(m).__name__]
    return bool(linears) and all(type(m) is torch.nn.Linear for m in linears)


def _compiled_forward(cls: type):
    """One compiled ``cls.forward`` for every instance of ``cls``: the module comes in as an argument, so its
    parameters are inputs of one graph rather than constants of one graph per instance (with the default limit of
    8 recompilations, most of a 24-layer model's norms would have stayed uncompiled)."""
    if cls not in _compiled:
        _compiled[cls] = torch.compile(cls.forward, dynamic=True)
    return _compiled[cls]


def fusable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fuse_kernels`` compiles: RMSNorms, and MLPs whose linear layers are plain ``nn.Linear``."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")
            or (type(m).__name__.endswith("MLP") and _plain_mlp(m))]


def fuse_kernels(model: torch.nn.Module) -> int:
    """Compile ``model``'s norms, MLPs and its family's rotary embedding (see the module docstring), in place; the
    compilation itself happens on each piece's first call. A model fused already is left as it is.

    Returns:
        The number of pieces compiled (modules, plus 1 for the family's rotary function when this call replaced it).
    Raises:
        FusedKernelsError: this PyTorch has no ``torch.compile``.
    """
    if not hasattr(torch, "compile"):
        raise FusedKernelsError("fused kernels need torch.compile (PyTorch 2)")
    if getattr(model, "fused_kernels", False):
        return 0
    modules = fusable_modules(model)
    for m in modules:
        m.forward = functools.partial(_compiled_forward(type(m)), m)  # an instance attribute: unfuse deletes it
    count = len(modules)
    family = sys.modules.get(type(model).__module__)
    if family is not None and callable(getattr(family, _ROTARY, None)):
        original, users = _families.get(family.__name__, (getattr(family, _ROTARY), 0))
        if users == 0:
            setattr(family, _ROTARY, torch.compile(original, dynamic=True))
            count += 1
        _families[family.__name__] = (original, users + 1)
    model.fused_kernels = True
    return count


def unfuse_kernels(model: torch.nn.Module) -> None:
    """Undo ``fuse_kernels``: the modules' own forwards again, and the family's original rotary function once no
    fused model of the family is left. A model that is not fused is left as it is."""
    if not getattr(model, "fused_kernels", False):
        return
    for m in fusable_modules(model):
        m.__dict__.pop("forward", None)
    name = type(model).__module__
    if name in _families:
        original, users = _families[name]
        if users <= 1:
            setattr(sys.modules[name], _ROTARY, original)
            del _families[name]
        else:
            _families[name] = (original, users - 1)
    model.fused_kernels = False
