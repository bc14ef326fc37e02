"""Do the decision models generalise to kinds of prompt they never saw? Leave one kind out, train, test on it.

For each prompt kind K in the data (``prompts.PROMPT_KINDS``: code, chat, math, translation, summarisation,
extraction, reasoning), every model kind is trained on the prompts of all *other* kinds (validation split by prompt
among them, as ``decision train`` does) and scored on every token of K's prompts: ROC-AUC on soft labels (the
goal: >= 0.75 for the default model on every held-out kind), on greedy labels, calibration error and the mean
prediction against the mean soft label (a model that never saw K may rank well but sit too high or too low;
online adaptation, ``online.py``, corrects the latter during a session).

Given several data folders (e.g. one collected with the int8 draft the CPU runs and one with the bf16 draft a GPU
runs), the models train on all of them, as the shipped ones do, and each held-out kind is also scored on each
folder's tokens alone: how the one shipped model ranks the drafts of each deployment.
"""

from __future__ import annotations

import numpy as np

from ..engine.stop_models.model import KINDS
from ..engine.stop_models.scores import score_metrics
from .collect import load_data
from .train import fit_models, kind_inputs, split_by_prompt

GOAL_AUC = 0.75


def leave_one_kind_out(folders, *, held_out=None, models=KINDS, val_fraction: float = 0.15, seed: int = 0,
                       epochs: int = 60, patience: int = 5, progress=lambda msg: None) -> dict:
    """Train without each prompt kind in turn and score the models on it.

    Args:
        folders: decision data folders (``decision collect``; shards must record their prompt kind).
        held_out: kinds to hold out (default: every kind in the data).
        models: model kinds to train (``model.KINDS``).
    Returns:
        ``{"kinds": {kind: prompts}, "rows": [{"held_out", "model", "prompts", "records", "roc_auc",
        "roc_auc_greedy", "ece", "mean_pred", "mean_soft", "threshold", "train_prompts", "by_data"}], "worst":
        {model: lowest roc_auc}, "worst_by_data": {folder: {model: lowest roc_auc}}}``; ``by_data`` (folder ->
        ``{"records", "roc_auc"}``, the held-out kind's tokens of that folder alone) and ``worst_by_data`` are empty
        for a single folder.
    Raises:
        DataError: unreadable folders; ValueError: fewer than two kinds, or a held-out kind not in the data.
    """
    meta, t, owners = load_data(folders)
    kind_of = meta["prompt_kinds"]  # every prompt has one ("other" when its shard recorded none)
    prompts_of: dict[str, set] = {}
    for o in owners:
        prompts_of.setdefault(kind_of[o], set()).add(o)
    if len(prompts_of) < 2:
        raise ValueError("leaving a kind out needs data of at least two prompt kinds (collect with kinds recorded)")
    held_out = list(held_out or sorted(prompts_of))
    for k in held_out:
        if k not in prompts_of:
            raise ValueError(f"no prompts of kind {k!r} in the data (has: {', '.join(sorted(prompts_of))})")
    soft, greedy = t["soft"].numpy(), t["greedy"].numpy()
    # each folder's rows [start, stop), when there are several to tell apart
    folder_rows = meta["folder_rows"] if len(meta["folder_rows"]) > 1 else {}
    rows = []
    for k in held_out:
        progress(f"holding out {k} ({len(prompts_of[k])} prompts)")
        rest = [o for o in owners if kind_of[o] != k]
        train_prompts, val_prompts = split_by_prompt(rest, val_fraction, seed)
        fitted = fit_models(t, owners, train_prompts, val_prompts, kinds=models, epochs=epochs, patience=patience,
                            seed=seed)
        idx = np.flatnonzero([kind_of[o] == k for o in owners])
        for name, model in fitted.items():
            pred = model.predict(**{name: kind_inputs(name, t)[idx]}).numpy()
            m = score_metrics(pred, soft[idx], greedy[idx], model.threshold)
            by_data = {}
            for folder, (start, stop) in folder_rows.items():
                sel = (idx >= start) & (idx < stop)
                if sel.any():
                    by_data[folder] = {"records": int(sel.sum()), "roc_auc": score_metrics(
                        pred[sel], soft[idx][sel], greedy[idx][sel], model.threshold)["roc_auc"]}
            rows.append({"held_out": k, "model": name, "prompts": len(prompts_of[k]), "records": int(len(idx)),
                         "train_prompts": len(train_prompts) + len(val_prompts), "by_data": by_data,
                         **{key: m[key] for key in ("roc_auc", "roc_auc_greedy", "ece", "mean_pred", "mean_soft",
                                                    "threshold")}})
    worst = {name: min(r["roc_auc"] for r in rows if r["model"] == name) for name in models}
    worst_by_data = {folder: {name: min(r["by_data"][folder]["roc_auc"] for r in rows
                                        if r["model"] == name and folder in r["by_data"]) for name in models}
                     for folder in folder_rows}
    return {"kinds": {k: len(v) for k, v in sorted(prompts_of.items())}, "rows": rows, "worst": worst,
            "worst_by_data": worst_by_data, "goal_auc": GOAL_AUC}


def markdown_table(report: dict) -> str:
    """The study as a Markdown table: one line per held-out kind, ROC-AUC (soft / greedy) per model."""
    models = list(report["worst"])
    header = "| held-out kind | prompts | tokens | " + " | ".join(f"{m} AUC soft / greedy" for m in models) + " |"
    lines = [header, "|" + "---|" * (3 + len(models))]
    for k in dict.fromkeys(r["held_out"] for r in report["rows"]):
        cells = {r["model"]: r for r in report["rows"] if r["held_out"] == k}
        any_row = next(iter(cells.values()))
        vals = []
        for m in models:
            r = cells[m]
            g = "-" if r["roc_auc_greedy"] is None else f"{r['roc_auc_greedy']:.3f}"
            vals.append(f"{r['roc_auc']:.3f} / {g}")
        lines.append(f"| {k} | {any_row['prompts']} | {any_row['records']} | " + " | ".join(vals) + " |")
    lines.append("| **worst** | | | " + " | ".join(f"**{report['worst'][m]:.3f}**" for m in models) + " |")
    for folder, worst in report.get("worst_by_data", {}).items():
        lines.append(f"| worst on {folder} alone | | | " + " | ".join(f"{worst[m]:.3f}" for m in models) + " |")
    return "\n".join(lines)
