"""Collect training data for the decision models: run a pair over prompts, draft wide and deep trees, record
every drafted token's features and labels.

The data set is a folder (format documented in ``docs/decision.md``):

* ``meta.json``: format version, the model pair, the draft quantization, the method settings that drafted the
  trees, hidden size, feature names, and the tensors each shard holds;
* one ``shard-<source>-<id>.safetensors`` per prompt, written atomically when the prompt is done, so an interrupted
  collection resumes where it stopped (prompts with a shard are skipped). Tensors, one row per drafted token:
  ``hidden`` float16 ``(n, H)``, ``dist`` float32 ``(n, 11)``, ``depth`` int32, ``cum_q`` float32 (product of q
  along the path), ``q`` and ``p`` float32 (the token's probability under draft and target at temperature 1),
  ``soft`` float32 ``min(1, p/q)``, ``greedy`` uint8 (token == argmax p), ``step`` int32, ``token`` int64,
  ``session`` float32 ``(n, 10)`` (``features.SESSION_FEATURE_NAMES``: n-gram matches in the context, the target's
  earlier verdicts after the parent token and after the two tokens before x). The
  shard's metadata holds the prompt id, its source and the sampling temperature of its run.

Prompts alternate between greedy decoding (even positions) and temperature 1 (odd), so that both the contexts a
greedy run sees and those a sampled run sees are in the data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..analysis.prompts import Prompt, encode_prompt, prompt_kind
from ..engine.config import MethodConfig
from ..engine.factory import build_engine
from ..engine.machine import EngineError
from ..engine.sampling import SamplingConfig
from ..engine.stop_models.features import DIST_FEATURE_NAMES, SESSION_FEATURE_NAMES, token_labels

DATA_FORMAT = 2  # 2: ten session features (1 had four)
COLLECT_CONFIG = MethodConfig(method="mcsd-improved", k_config=(2, 2, 2), max_depth=6, stop="none")
_HOST = torch.device("cpu")  # shards are host data, whatever device the models run on
SHARD_TENSORS = ("hidden", "dist", "depth", "cum_q", "q", "p", "soft", "greedy", "step", "token", "session")


class DataError(ValueError):
    """A decision data folder that cannot be used (other pair or settings, unreadable shards)."""


def shard_name(prompt: Prompt) -> str:
    return "shard-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{prompt.source}-{prompt.id}") + ".safetensors"


def step_records(engine) -> dict[str, list]:
    """Rows for every drafted token of the engine's latest step (needs ``capture_features=True``)."""
    d, v = engine.last_step
    tree, rows = d.tree, {k: [] for k in SHARD_TENSORS}
    nodes = [i for i in range(len(tree)) if tree.source[i] == "draft" and i in d.features]
    p, soft, greedy = token_labels(tree, nodes, [d.features[i].q for i in nodes], v.p_rows)
    for n, i in enumerate(nodes):
        hidden, dist, q1, cum, session = d.features[i]
        rows["hidden"].append(hidden.to(_HOST, torch.float16))
        rows["dist"].append(dist.cpu())
        rows["depth"].append(tree.depth[i])
        rows["cum_q"].append(cum)
        rows["q"].append(q1)
        rows["p"].append(float(p[n]))
        rows["soft"].append(float(soft[n]))
        rows["greedy"].append(int(greedy[n]))
        rows["step"].append(len(engine.trace.steps) - 1)
        rows["token"].append(tree.token[i])
        rows["session"].append(list(session))
    return rows


def _to_tensors(rows: dict[str, list], hidden_size: int) -> dict[str, torch.Tensor]:
    n = len(rows["depth"])
    return {
        "hidden": torch.stack(rows["hidden"]) if n else torch.zeros(0, hidden_size, dtype=torch.float16, device=_HOST),
        "dist": torch.stack(rows["dist"]).float() if n else torch.zeros(0, len(DIST_FEATURE_NAMES), device=_HOST),
        "depth": torch.tensor(rows["depth"], dtype=torch.int32, device=_HOST),
        "cum_q": torch.tensor(rows["cum_q"], dtype=torch.float32, device=_HOST),
        "q": torch.tensor(rows["q"], dtype=torch.float32, device=_HOST),
        "p": torch.tensor(rows["p"], dtype=torch.float32, device=_HOST),
        "soft": torch.tensor(rows["soft"], dtype=torch.float32, device=_HOST),
        "greedy": torch.tensor(rows["greedy"], dtype=torch.uint8, device=_HOST),
        "step": torch.tensor(rows["step"], dtype=torch.int32, device=_HOST),
        "token": torch.tensor(rows["token"], dtype=torch.int64, device=_HOST),
        "session": torch.tensor(rows["session"], dtype=torch.float32,
                                device=_HOST).reshape(n, len(SESSION_FEATURE_NAMES)),
    }


def _meta(pair, config: MethodConfig, max_new_tokens: int) -> dict:
    return {"format": DATA_FORMAT,
            "pair": {"name": pair.name, "draft_id": pair.draft_id, "target_id": pair.target_id,
                     "dtype": str(pair.dtype).removeprefix("torch.")},
            "draft_quant": pair.draft_quant,  # recorded: the features of an int8 draft differ slightly
            "method": config.to_dict(), "max_new_tokens": max_new_tokens,
            "hidden_size": int(pair.draft.config.hidden_size), "dist_features": DIST_FEATURE_NAMES,
            "tensors": list(SHARD_TENSORS)}


def _full_method(settings):
    try:
        return MethodConfig(**settings).to_dict()
    except (TypeError, ValueError):
        return settings


def open_data_dir(out: Path, meta: dict) -> None:
    """Create ``out`` with ``meta.json``, or check that an existing one was collected with the same settings."""
    path = out / "meta.json"
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"cannot read {path}: {exc}") from None
        for key in ("format", "pair", "method", "max_new_tokens", "hidden_size", "draft_quant"):
            was, now = old.get(key), meta.get(key)
            if key == "method":  # settings added since the folder was made take their defaults
                was, now = _full_method(was), _full_method(now)
            if key == "draft_quant" and was is None:  # folders from before it was recorded: unknown
                continue
            if was != now:
                raise DataError(f"{out} holds data collected with another {key} ({old.get(key)!r}); "
                                "use a new --out folder")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=1), encoding="utf-8")


def collect(pair, prompts: list[Prompt], out: str | Path, *, max_new_tokens: int = 40,
            config: MethodConfig = COLLECT_CONFIG, temperatures=(0.0, 1.0), seed: int = 0, chat_template=True,
            progress: bool = True, on_prompt=None) -> dict:
    """Run ``pair`` over ``prompts`` and write one shard per prompt into ``out`` (skipping prompts already done).

    Returns ``{"prompts_done", "prompts_skipped", "records", "too_long"}``: prompts written, prompts already done,
    records written by this call, and prompts skipped because they do not fit the models' context window.
    ``on_prompt(done, total)``, when given, is called after each prompt (done, skipped or too long).
    Raises DataError when ``out`` holds data of another pair or other settings.
    """
    out = Path(out)
    open_data_dir(out, _meta(pair, config, max_new_tokens))
    hidden_size = int(pair.draft.config.hidden_size)
    done = skipped = records = 0
    too_long: list[str] = []
    bar = tqdm(prompts, desc="decision collect", unit="prompt", disable=not progress)
    for n, prompt in enumerate(bar):
        if on_prompt is not None and n:
            on_prompt(n, len(prompts))
        path = out / shard_name(prompt)
        if path.exists():
            skipped += 1
            continue
        temperature = float(temperatures[n % len(temperatures)])
        engine = build_engine(pair, config, SamplingConfig(temperature=temperature, seed=seed + n),
                              capture_features=True)
        try:
            engine.start(encode_prompt(pair.tokenizer, prompt.text, chat_template=chat_template), max_new_tokens)
        except EngineError as exc:  # a prompt too long for these models: skip it, keep the others
            too_long.append(f"{prompt.source}:{prompt.id}")
            bar.write(f"skipping prompt {prompt.id}: {exc}")
            continue
        rows = {k: [] for k in SHARD_TENSORS}
        while not engine.finished:
            engine.step()
            for k, v in step_records(engine).items():
                rows[k].extend(v)
        tensors = _to_tensors(rows, hidden_size)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"prompt_id": str(prompt.id), "source": prompt.source,
                                               "category": prompt.category, "kind": prompt_kind(prompt),
                                               "temperature": str(temperature)})
        os.replace(tmp, path)
        done += 1
        records += int(tensors["depth"].shape[0])
        bar.set_postfix(records=records)
    if on_prompt is not None:
        on_prompt(len(prompts), len(prompts))
    return {"prompts_done": done, "prompts_skipped": skipped, "records": records, "too_long": too_long}


def load_data(folders: list[str | Path]) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """Read data folders into one table.

    Returns ``(meta, tensors, prompt_of_row)``: the first folder's meta plus ``"prompt_kinds"`` (``"source:id"`` ->
    the prompt's kind, ``prompts.PROMPT_KINDS``; ``"other"`` for shards from before kinds were recorded) and
    ``"folder_rows"`` (each folder as given -> its rows' ``[start, stop)`` in the table: folders are read in turn), the
    shards' tensors concatenated (``hidden`` as float32), and for each row its prompt as ``"source:id"``, for
    splitting by prompt or by kind.
    Raises DataError for missing folders, folders of different pairs, or unreadable shards.
    """
    meta = None
    parts: dict[str, list] = {k: [] for k in SHARD_TENSORS}
    owners: list[str] = []
    kinds: dict[str, str] = {}
    folder_rows: dict[str, list[int]] = {}
    for folder in folders:
        start = len(owners)
        folder = Path(folder)
        try:
            m = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{folder} is not a decision data folder (meta.json: {exc})") from None
        if meta is None:
            meta = m
        elif (m.get("pair", {}).get("draft_id"), m.get("hidden_size")) != (meta["pair"]["draft_id"],
                                                                            meta["hidden_size"]):
            raise DataError(f"{folder} was collected with another draft model than {folders[0]}")
        for shard in sorted(folder.glob("shard-*.safetensors")):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    got = {k: f.get_tensor(k) for k in SHARD_TENSORS}
                    info = f.metadata() or {}
            except (OSError, SafetensorError) as exc:
                raise DataError(f"cannot read {shard}: {exc}") from None
            except KeyError as exc:
                raise DataError(f"{shard} has no tensor {exc}: collected by an older version, collect again") from None
            n = int(got["depth"].shape[0])
            if got["session"].shape[-1] != len(SESSION_FEATURE_NAMES):
                raise DataError(f"{shard} has {got['session'].shape[-1]} session features, this version reads "
                                f"{len(SESSION_FEATURE_NAMES)}: collected by an older version, collect again")
            for k in SHARD_TENSORS:
                parts[k].append(got[k])
            owner = f"{info.get('source', folder.name)}:{info.get('prompt_id', shard.stem)}"
            kinds[owner] = info.get("kind", "other")
            owners.extend([owner] * n)
        folder_rows[str(folder)] = [start, len(owners)]
    if meta is None or not owners:
        raise DataError(f"no records in {', '.join(map(str, folders))}: run `decision collect` first")
    tensors = {k: torch.cat(v) for k, v in parts.items()}
    tensors["hidden"] = tensors["hidden"].float()
    return {**meta, "prompt_kinds": kinds, "folder_rows": folder_rows}, tensors, owners
