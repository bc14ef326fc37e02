"""Train the two decision models on collected data (``collect.py``) and write them with their card.

As in Lu et al. 2024: binary cross-entropy on the soft labels ``min(1, p/q)``; here with Adam, the
validation set split *by prompt* (no prompt contributes tokens to both sides), inputs standardised with the
training mean and std, and early stopping on the validation loss (the best epoch's weights are kept).
The card's threshold is Youden's J on the validation prompts (``scores.choose_threshold``).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

from ..engine.stop_models.features import CONTEXT_FEATURE_NAMES, DIST_FEATURE_NAMES, PATH_FEATURE_NAMES, path_features
from ..engine.stop_models.model import CARD_FORMAT, DEFAULT_LAYERS, KINDS, DecisionMLP, DecisionModel
from ..engine.stop_models.scores import choose_threshold, score_metrics
from .collect import load_data

FEATURE_TEXT = {
    "hidden": "draft model's last hidden state at the drafted token's parent row",
    "dist": "entropy and top-10 probabilities of the draft distribution q (temperature 1) at the parent row",
    "path": "dist plus log q(x), depth and log cumulative path probability of the token",
    "context": "path plus the session features: n-gram matches in the committed context and the target's earlier "
               "top candidates after the parent token and after the two tokens before x (prompt rows included)",
}
FEATURE_NAMES = {"hidden": None, "dist": DIST_FEATURE_NAMES, "path": PATH_FEATURE_NAMES,
                 "context": CONTEXT_FEATURE_NAMES}


def kind_inputs(kind: str, t: dict) -> torch.Tensor:
    """The input matrix of one model kind from a data table (``collect.load_data``)."""
    if kind == "hidden":
        return t["hidden"]
    if kind == "dist":
        return t["dist"]
    path = path_features(t["dist"], t["q"], t["depth"], t["cum_q"])
    if kind == "path":
        return path
    return torch.cat([path, t["session"].float()], dim=-1)


def split_by_prompt(owners: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Shuffle the distinct prompts with ``seed`` and hold out ``ceil(val_fraction * n)`` of them (at least one).

    Raises ValueError when fewer than two prompts are available or the fraction is outside (0, 1).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    prompts = sorted(set(owners))
    if len(prompts) < 2:
        raise ValueError("training needs data from at least two prompts (one is held out for validation)")
    random.Random(seed).shuffle(prompts)
    n_val = min(len(prompts) - 1, max(1, math.ceil(val_fraction * len(prompts))))
    return sorted(prompts[n_val:]), sorted(prompts[:n_val])


def fit(kind: str, x: torch.Tensor, soft: torch.Tensor, train_idx: np.ndarray, val_idx: np.ndarray, *,
        layers=None, epochs: int = 60, patience: int = 5, seed: int = 0, lr: float = 1e-3, batch_size: int = 512,
        progress: bool = False) -> tuple[DecisionModel, dict]:
    """Train one MLP. ``x``: float32 ``(n, features)``; ``soft``: float32 ``(n,)`` labels in [0, 1].

    Returns the model at the epoch with the lowest validation BCE and ``{"epochs", "best_epoch", "val_loss",
    "history"}``.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tr, va = torch.from_numpy(train_idx), torch.from_numpy(val_idx)
    mean = x[tr].mean(0)
    std = x[tr].std(0).clamp_min(1e-6)
    xs = (x - mean) / std
    net = DecisionMLP(x.shape[1], tuple(layers or DEFAULT_LAYERS[kind]))
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    best = (float("inf"), 0, copy.deepcopy(net.state_dict()))
    history = []
    for epoch in range(1, epochs + 1):
        net.train()
        order = tr[torch.randperm(len(tr), generator=gen)]
        total = 0.0
        for start in range(0, len(order), batch_size):
            b = order[start:start + batch_size]
            loss = loss_fn(net(xs[b]), soft[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        net.eval()
        with torch.no_grad():
            val = float(loss_fn(net(xs[va]), soft[va]))
        history.append({"epoch": epoch, "train_loss": total / len(tr), "val_loss": val})
        if progress:
            print(f"[{kind}] epoch {epoch}: train {total / len(tr):.4f} val {val:.4f}", flush=True)
        if val < best[0] - 1e-5:
            best = (val, epoch, copy.deepcopy(net.state_dict()))
        elif epoch - best[1] >= patience:
            break
    net.load_state_dict(best[2])
    model = DecisionModel(kind, net, mean, std)
    return model, {"epochs": len(history), "best_epoch": best[1], "val_loss": best[0], "history": history}


def fit_models(t: dict, owners: list[str], train_prompts: list[str], val_prompts: list[str], *, kinds=KINDS,
               epochs: int = 60, patience: int = 5, seed: int = 0, layers: dict | None = None,
               progress: bool = False) -> dict[str, DecisionModel]:
    """Train each model kind on the rows of ``train_prompts``, early-stopped and thresholded on ``val_prompts``.

    ``t`` / ``owners``: a data table and its rows' prompts (``collect.load_data``). Returns kind -> model whose
    ``info`` holds its card entry (features, layers, epochs, validation loss, Youden threshold, validation metrics).
    """
    train_set, val_set = set(train_prompts), set(val_prompts)
    train_idx = np.flatnonzero([o in train_set for o in owners])
    val_idx = np.flatnonzero([o in val_set for o in owners])
    soft, greedy = t["soft"], t["greedy"].numpy()
    models = {}
    for kind in kinds:
        t0 = time.perf_counter()
        x = kind_inputs(kind, t)
        sizes = (layers or {}).get(kind) or DEFAULT_LAYERS[kind]
        model, fit_info = fit(kind, x, soft, train_idx, val_idx, layers=sizes, epochs=epochs, patience=patience,
                              seed=seed, progress=progress)
        pred = model.predict(**{kind: x[val_idx]}).numpy()
        threshold = choose_threshold(pred, soft[val_idx].numpy())
        metrics = score_metrics(pred, soft[val_idx].numpy(), greedy[val_idx], threshold)
        model.info = {"file": f"{kind}.safetensors", "features": FEATURE_TEXT[kind],
                      "feature_names": FEATURE_NAMES[kind], "in_features": int(x.shape[1]), "layers": list(sizes),
                      "epochs": fit_info["epochs"], "best_epoch": fit_info["best_epoch"],
                      "val_loss": fit_info["val_loss"], "threshold": threshold,
                      "train_seconds": round(time.perf_counter() - t0, 1),
                      **{k: metrics[k] for k in ("roc_auc", "roc_auc_greedy", "precision", "recall", "ece")}}
        models[kind] = model
    return models


def train_models(folders, out, *, val_fraction: float = 0.15, seed: int = 0, epochs: int = 60, patience: int = 5,
                 layers: dict | None = None, exclude_kinds=(), progress: bool = False) -> dict:
    """Train every model kind on ``folders`` and write them plus ``card.json`` into ``out``.

    ``exclude_kinds``: prompt kinds (``prompts.PROMPT_KINDS``) whose prompts are left out entirely, so that the
    models can be tested on a kind they never saw. Returns the card. Raises DataError for unusable data and
    ValueError for bad settings.
    """
    meta, t, owners = load_data(folders)
    kind_of = meta["prompt_kinds"]
    usable = [o for o in owners if kind_of.get(o) not in set(exclude_kinds)]
    train_prompts, val_prompts = split_by_prompt(usable, val_fraction, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = fit_models(t, owners, train_prompts, val_prompts, epochs=epochs, patience=patience, seed=seed,
                        layers=layers, progress=progress)
    for model in models.values():
        model.save(out)
    train_set, val_set = set(train_prompts), set(val_prompts)
    n_train = sum(o in train_set for o in owners)
    n_val = sum(o in val_set for o in owners)
    soft = t["soft"]
    card = {
        "format": CARD_FORMAT,
        "pair": {k: meta["pair"][k] for k in ("name", "draft_id", "target_id")},
        "label": "soft label min(1, p(x)/q(x)), p and q at temperature 1; BCE",
        "threshold_rule": "Youden's J (TPR - FPR) on the validation prompts, soft labels",
        "data": {"folders": [str(f) for f in folders], "records": n_train + n_val,
                 "prompts": len(train_prompts) + len(val_prompts),
                 "train_records": n_train, "val_records": n_val,
                 "collected_with": meta["method"], "max_new_tokens": meta["max_new_tokens"],
                 "mean_soft_label": float(soft.mean()), "train_prompts": train_prompts, "val_prompts": val_prompts,
                 "prompt_kinds": sorted({kind_of.get(o, "other") for o in train_prompts + val_prompts}),
                 "excluded_kinds": sorted(exclude_kinds)},
        "training": {"optimizer": "Adam lr 1e-3, batch 512", "val_fraction": val_fraction, "seed": seed,
                     "max_epochs": epochs, "patience": patience, "torch": torch.__version__},
        "models": {kind: model.info for kind, model in models.items()},
    }
    (out / "card.json").write_text(json.dumps(card, indent=1), encoding="utf-8")
    return card
