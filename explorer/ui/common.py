"""What every page shares: the cached model pair, example prompts, error reporting, settings -> MethodConfig."""

from __future__ import annotations

import os

import streamlit as st
import torch

from ..analysis.prompts import PromptError, encode_prompt, humaneval, mt_bench
from ..engine.carried import Carried
from ..engine.config import DEFAULTS
from ..engine.factory import build_engine, times_verification
from ..engine.machine import EngineError
from ..engine.runtime.forward_costs import DEAR_ROWS, verification_cost
from ..engine.sampling import SamplingConfig
from ..engine.tree import TreeShapeError, parse_k_config, parse_tree_template
from ..models import loading as models
from ..models.loading import ModelPairError, load_named_pair
from ..trace.records import TraceError
from .state import Key, Shared

PAIRS = {"default": "Embedded: Qwen2.5-Coder 0.5B → 1.5B", "tiny": "Tiny random pair (no download, for trying)",
         "custom": "Custom pair (folders, hub ids or .gguf)"}


@st.cache_resource(show_spinner=False, max_entries=1)
def get_pair(spec: str, draft: str, target: str, dtype: str):
    """Models are shared by every browser session: read-only, forwards serialised by ``pair.lock``; each session
    keeps its own engine and KV caches. One pair at a time: loading another lets the last one go (two fp32 pairs
    would not fit a 16 GB machine). No Streamlit calls in here: a cached function may not touch page elements
    created outside it."""
    torch.set_num_threads(app_threads())
    return load_named_pair(spec, dtype=dtype, draft=draft or None, target=target or None,
                           draft_quant=os.environ.get("SPEC_EXPLORER_DRAFT_QUANT") or None,
                           packed=os.environ.get("SPEC_EXPLORER_PACKED_WEIGHTS") or None)


def app_threads() -> int:
    """The intra-op threads the app's forwards use: ``$SPEC_EXPLORER_THREADS``, else one fewer than PyTorch's
    default (its physical cores), at least 1.

    Why: the browser showing the app re-renders the page while the script runs a Step (headless chromium took
    100-160 % of a core during the Step's first half second, 14 charts on the page). With every core in torch's
    thread team, each parallel region then waits for the thread whose core the browser holds: on the 2-core
    AVX-512-BF16 CPU the app's draft took 255-480 ms against the CLI's 35-39 ms. With one thread the app's steps
    took draft 47-64 / verify 317-405 ms, the CLI's at one thread 48-54 / 359-379 ms (``scripts/app_step_bench.py``,
    docs/bench.md "The app's steps against the CLI's")."""
    value = os.environ.get("SPEC_EXPLORER_THREADS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            pass  # a malformed setting is ignored: the default below
    return max(1, torch.get_num_threads() - 1)


@st.cache_data(show_spinner=False)
def example_prompts() -> dict[str, str]:
    out = {}
    try:
        for p in mt_bench():
            out[f"MT-bench {p.id} ({p.category}): {p.text[:60]}"] = p.text
        for p in humaneval():
            out[f"HumanEval {p.id}: {p.text.split('def ', 1)[-1][:50]}"] = p.text
    except PromptError as exc:  # examples are a convenience: the app works without them
        out[f"(examples unavailable: {exc})"] = ""
    return out


def load_pair_with_progress(spec: str, draft: str, target: str, dtype: str):
    """First start of the embedded pair: assemble, verify and convert it (on disk, once) with a progress bar;
    then load the cached pair (seconds)."""
    torch_dtype = models.parse_dtype(dtype)
    if spec == "default":
        missing = [m for m in (models.DEFAULT_DRAFT, models.DEFAULT_TARGET) if not models.is_prepared(m, torch_dtype)]
        if missing:
            bar = st.progress(0.0, text="Preparing the embedded models (first start only)…")
            try:
                for m in missing:
                    models.prepare_embedded(m, torch_dtype, progress=lambda msg, f: bar.progress(
                        min(max(f, 0.0), 1.0), text=msg))
            finally:
                bar.empty()
    # "auto" and the dtype it resolves to are one pair: another key loads it again, and the cache lets the old one go
    # only once the new one is in (the Classroom's Continue live names the lesson's dtype: on an H200 the app's peak,
    # 9.2 GB allocated against the CLI's 4.7 GB, had room for two pairs)
    with st.spinner("Loading models…"):
        return get_pair(spec, draft, target, str(torch_dtype).removeprefix("torch."))


def pair_or_message(settings):
    """The sidebar's pair, loaded; None (with a message on the page) when it cannot be."""
    if settings["spec"] == "custom" and not settings["target"]:
        st.info("Enter a target model in the sidebar (a local folder, hub id or .gguf file), and a draft model "
                "that shares its tokenizer; with the draft left empty the target drafts with its own first layers.")
        return None
    try:
        return load_pair_with_progress(settings["spec"], settings["draft"], settings["target"], settings["dtype"])
    except Exception as exc:  # noqa: BLE001 - shown, not raised: the user can pick another pair
        st.error(f"Cannot load this model pair: {exc}")
        return None


def parse_upload(upload, seen: Key[str | None], max_bytes: int, parse, error: type[Exception], what: str):
    """A newly uploaded file, parsed once: ``(parse(bytes), None)``; ``(None, message)`` for a file that is too
    large or does not parse, whatever it raises (the page goes on); ``(None, None)`` when there is no new file
    (``seen``, the calling page's key, holds the last file's id)."""
    if upload is None or seen.get() == upload.file_id:
        return None, None
    seen.set(upload.file_id)
    try:
        if upload.size > max_bytes:
            raise error(f"the file is {upload.size / 1e6:.1f} MB; {what}s are limited to {max_bytes / 1e6:.0f} MB")
        return parse(upload.getvalue()), None
    except error as exc:
        return None, f"Cannot load {upload.name}: {exc}"
    except Exception as exc:  # noqa: BLE001 - whatever a hostile file does, the session stays
        return None, f"Cannot load {upload.name}: malformed {what} ({type(exc).__name__}: {exc})"


def set_error(message: str | None, key: Key[str | None]) -> None:
    """Show ``message`` (None: no message) through the calling page's error key."""
    key.set(message)


def guarded(action, *args, error_key: Key[str | None], **kwargs):
    """Run an action; any failure becomes a message in the calling page's ``error_key`` (never a traceback) and the
    app keeps going."""
    try:
        set_error(None, error_key)
        return action(*args, **kwargs)
    except (PromptError, TreeShapeError, ModelPairError, EngineError, TraceError, ValueError) as exc:
        set_error(str(exc), error_key)
    except Exception as exc:  # noqa: BLE001 - the page must stay up whatever a model does
        set_error(f"unexpected error ({type(exc).__name__}): {exc}", error_key)
    return None


def build_config(method: str, changes: dict):
    """MethodConfig from the method's defaults and the widgets' values (``k_config`` as typed). Raises
    TreeShapeError / ValueError with a message naming the field."""
    changes = {k: v for k, v in changes.items() if k != "carry_matrix"}
    for name in ("k_config", "recycling_widths"):
        if name in changes:
            changes[name] = parse_k_config(changes[name])
    if "tree" in changes:
        changes["tree"] = parse_tree_template(changes["tree"]) if str(changes["tree"] or "").strip() else None
    return DEFAULTS[method].with_(**changes)


def make_engine(pair, settings, prompt_text: str, chat: bool, method: str | None = None,
                changes: dict | None = None):
    """A started engine for the prompt (the prefill runs here). With Token Recycling and ``carry_matrix`` on, it
    starts from what the session's runs learned (``Shared.CARRIED``, which ``state.keep_learned`` updates): the
    matrix the last recycling run left, the goodput fallback's rates its last run measured and the stop policy's
    online adaptation where its last run left it.
    Raises PromptError / EngineError / ValueError."""
    changes = settings["changes"] if changes is None else changes
    config = build_config(method or settings["method"], changes)
    sampling = SamplingConfig(**settings["sampling"])
    ids = encode_prompt(pair.tokenizer, prompt_text, chat_template=chat)
    carried = Shared.CARRIED.get() or Carried()
    if not changes.get("carry_matrix"):
        carried = carried.without_recycling()
    if times_verification(config, pair.device.type) and "verification_cost" not in pair.measured:
        # the engine would time it, silently
        with st.spinner(f"Timing a {DEAR_ROWS}-row verification on this machine (once per model pair)…"):
            verification_cost(pair)
    # the goodput fallback's rates and the adaptation from the session's last run: the engine uses them only for
    # the same method, sampling, pair and device (and decision model)
    held = Shared.DISTILLER.get()  # the session's learning head, if it learns on this pair
    distiller = held[1] if config.online_distill and held and held[0] == pair.name else None
    engine = build_engine(pair, config, sampling, carried=carried, distiller=distiller)
    if engine.parts.distiller is not None:
        Shared.DISTILLER.set((pair.name, engine.parts.distiller))
    engine.start(ids, settings["max_new"], prompt_text=prompt_text)
    return engine
