"""How good a decision model is on collected data: every model of a folder scored on prompts it never saw, overall
and per prompt kind (``decision eval``); the scores themselves are ``scores.py``'s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from ..analysis.prompts import range_spec, select_prompts
from ..engine.stop_models.model import (TRANSFERABLE_KINDS, DecisionModelError, find_calibrated, find_shipped,
                                        load_decision_model, read_card)
from ..engine.stop_models.scores import score_metrics
from .collect import DataError, collect, load_data
from .train import kind_inputs


def evaluate_on(model_dir: str | Path, folders: list[str | Path]) -> dict:
    """Every model of ``model_dir`` on the data in ``folders``, leaving out prompts the models were trained or
    validated on (listed in their card): ``{"models": {kind: score_metrics}, "by_kind": {prompt kind: {"records",
    model kind: roc_auc}}, ...}``. Data of another pair than the models' measures how they transfer: only the
    kinds that can (``model.TRANSFERABLE_KINDS``) are scored, and ``"transferred_from"`` names the models' pair.
    Raises DataError / DecisionModelError for unusable inputs."""
    card = read_card(model_dir)
    meta, t, owners = load_data(folders)
    transferred = meta["pair"].get("draft_id") != card.get("pair", {}).get("draft_id")
    seen = set(card.get("data", {}).get("train_prompts", [])) | set(card.get("data", {}).get("val_prompts", []))
    rows = np.array([o not in seen for o in owners])
    if not rows.any():
        raise DataError("every prompt of this data was used to train the model: evaluate on other prompts")
    prompts = sorted({o for o, r in zip(owners, rows) if r})
    report = {"model": str(model_dir), "data": [str(f) for f in folders], "prompts": len(prompts),
              "excluded_prompts": len({o for o in owners if o in seen}), "models": {},
              **({"transferred_from": card.get("pair", {}).get("name")} if transferred else {})}
    idx = np.flatnonzero(rows)
    kind_of = meta["prompt_kinds"]
    prompt_kinds = np.array([kind_of.get(owners[i], "other") for i in idx])
    report["by_kind"] = {}
    for kind in card["models"]:
        if transferred and kind not in TRANSFERABLE_KINDS:
            continue
        model = load_decision_model(model_dir, kind)
        pred = model.predict(**{kind: kind_inputs(kind, t)[idx]}).numpy()
        soft, greedy = t["soft"][idx].numpy(), t["greedy"][idx].numpy()
        threshold = model.threshold if model.threshold is not None else 0.5
        report["models"][kind] = score_metrics(pred, soft, greedy, threshold)
        for pk in sorted(set(prompt_kinds)):  # per prompt kind, where both outcomes occur
            sel = prompt_kinds == pk
            if 0 < soft[sel].sum() < sel.sum():
                m = score_metrics(pred[sel], soft[sel], greedy[sel], threshold)
                report["by_kind"].setdefault(pk, {"records": int(sel.sum())})[kind] = m["roc_auc"]
    return report


def evaluate(args, load_pair) -> dict:
    """``decision eval``: collect features on ``args.prompt_file`` (or read ``args.data``) and score the models."""
    if args.data:
        folders = args.data
        model_dir = args.model
        if model_dir is None:
            raise DecisionModelError("with --data, name the decision-model folder with --model")
        return evaluate_on(model_dir, folders)
    pair = load_pair()
    model_dir = (args.model or find_shipped(pair.draft_id, pair.target_id)
                 or find_calibrated(pair.draft_id, pair.target_id))
    if model_dir is None:
        raise DecisionModelError(f"no decision model ships or is calibrated for {pair.name}: run decision calibrate "
                                 "or pass --model (e.g. assets/decision/qwen2.5-coder-0.5b-1.5b, the embedded "
                                 "pair's, to measure how it transfers)")
    prompts = select_prompts([range_spec(args.prompt_file, args.range)])
    temps = tuple(float(x) for x in args.temperatures.split(","))
    with tempfile.TemporaryDirectory(prefix="decision-eval-") as tmp:
        out = Path(args.keep_data) if args.keep_data else Path(tmp)
        collect(pair, prompts, out, max_new_tokens=args.max_new_tokens, temperatures=temps,
                chat_template=not args.no_chat_template, progress=not args.quiet)
        return evaluate_on(model_dir, [out])
