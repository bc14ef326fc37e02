"""Counting a step's reads of tensor values into Python on the CPU: the host synchronisations it would make on a GPU.

On CUDA, torch's sync debug mode counts the real synchronisations (``timeline.StepTimeline(count_syncs=True)``). On
the CPU nothing synchronises, so the host work that should stay in single digits per step cannot be seen there.
Every synchronisation the engine makes on a GPU, though, is a read of a device value into Python: ``.item()``,
``.tolist()``, ``float(t)``, ``int(t)``, ``bool(t)`` (an ``if`` on a tensor), ``.cpu()``, ``.nonzero()``, indexing
by a boolean mask. ``HostReadCounter`` counts those calls through a ``TorchFunctionMode``, so a CPU test can hold a
method's reads per step to a bound (``tests/test_host_reads.py``).

Not an exact count. A read of a tensor that lives on the host on a GPU too (the decision model's output, the
adapter's) counts here and is free there; a copy from pageable host memory to the device (``torch.tensor(list,
device=...)``), which synchronises on CUDA as well, does not count here (on the CPU it cannot be told from host
work). Everything torch runs under the mode passes through Python, model forwards included, so the counting slows a
step several-fold: opt-in (tests, scripts).
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                   "masked_select", "unique", "equal", "allclose", "repeat_interleave"})
"""Tensor functions that hand a value to Python (or size an output by one): each synchronises on a GPU."""


class HostReadCounter(TorchFunctionMode):
    """Context manager: ``reads`` counts the value reads made inside it; with ``sites=True`` also ``sites``, a
    ``Counter`` of ``"file:line function"`` of the innermost ``explorer`` frame that made each read (for finding
    them; it costs a stack walk per read)."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.reads = 0
        self.sites: collections.Counter | None = collections.Counter() if sites else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        hit = name in READS
        if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing sizes its output by a count
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            hit = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if hit:
            self.reads += 1
            if self.sites is not None:
                for frame in reversed(traceback.extract_stack()[:-1]):
                    if "/explorer/" in frame.filename.replace("\\", "/"):
                        where = frame.filename.replace("\\", "/").split("/explorer/")[-1]
                        self.sites[f"{where}:{frame.lineno} {name}"] += 1
                        break
        return func(*args, **(kwargs or {}))
