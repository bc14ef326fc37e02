"""The two decision models of Lu et al. 2024 and their files.

Lu et al. 2024 (arXiv 2409.10644, code JackZeng0208/DynaSD) train small MLPs that predict, from what the draft
model knows when it drafts a token, how likely the target is to accept it:

* ``hidden``: input the draft's last hidden state at the token's parent row (``hidden_size``, 896 for the
  0.5B draft), layers ``hidden_size -> 512 -> 256 -> 1`` by default;
* ``dist``: input the 11 distribution features (entropy and top-10 probabilities of q), ``11 -> 64 -> 32 -> 1``;
* ``path`` (beyond the paper): ``dist`` plus the token's own ``log q(x)``, its depth and ``log`` of the cumulative
  path probability, ``14 -> 64 -> 32 -> 1``; unlike the other two it scores a node's children differently;
* ``context`` (beyond the paper): ``path`` plus ten session features (``features.py``: does x continue an earlier
  occurrence of what precedes it in the context; did the target rank x after the same parent token, and after the
  same two tokens, before, in the prompt or the run, and with what probability), ``24 -> 128 -> 64 -> 1``.

Inputs are standardised with the training set's mean and std (stored with the weights); the output is a
probability (sigmoid). Files: ``<dir>/<kind>.safetensors`` (weights ``layers.<i>.weight|bias``, ``mean``, ``std``)
and ``<dir>/card.json`` (model pair, features, data size, validation loss, ROC-AUC, chosen threshold; see
``docs/decision.md``). Loading reads safetensors only: no pickled code is ever executed.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ...models.loading import cache_dir
from ...trace.jsonfile import parse_json, read_file
from .features import N_DIST_FEATURES

KINDS = ("hidden", "dist", "path", "context")  # training order; stopping.DECISION_MODELS lists them default first
# Kinds whose inputs do not depend on the pair (probabilities, entropies, depth, path and run features): a model of
# these trained on one pair can serve another. ``hidden`` reads the draft's hidden state: its own pair only.
TRANSFERABLE_KINDS = ("dist", "path", "context")
EMBEDDED_MODELS = "qwen2.5-coder-0.5b-1.5b"  # the folder under assets/decision a pair without its own borrows
DEFAULT_LAYERS = {"hidden": (512, 256), "dist": (64, 32), "path": (64, 32), "context": (128, 64)}
CARD_FORMAT = 1
ASSETS_DIR = Path(__file__).resolve().parents[3] / "assets" / "decision"


class DecisionModelError(ValueError):
    """A decision model that cannot be found, read or used with this pair: the message says what is wrong."""


class DecisionMLP(nn.Module):
    """``in_features -> layers... -> 1`` with ReLU between, returning logits ``(n,)``."""

    def __init__(self, in_features: int, layers=(512, 256), device=None):
        super().__init__()
        sizes = [in_features, *layers]
        mods: list[nn.Module] = []
        for a, b in zip(sizes[:-1], sizes[1:]):
            mods += [nn.Linear(a, b, device=device), nn.ReLU()]
        mods.append(nn.Linear(sizes[-1], 1, device=device))
        self.layers = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).squeeze(-1)


class DecisionModel:
    """A trained decision model: the MLP plus its input standardisation and card entry.

    Args:
        kind: ``"hidden"``, ``"dist"`` or ``"path"``.
        net: the MLP (float32, CPU).
        mean, std: float32 ``(in_features,)`` standardisation of the inputs.
        info: this model's card entry (threshold, metrics, ...).
        pair: ``{"name", "draft_id", "target_id"}`` the model was trained for.
    """

    def __init__(self, kind: str, net: DecisionMLP, mean: torch.Tensor, std: torch.Tensor, info: dict | None = None,
                 pair: dict | None = None):
        if kind not in KINDS:
            raise DecisionModelError(f"unknown decision model kind {kind!r}; use one of {', '.join(KINDS)}")
        self.kind, self.net, self.mean, self.std = kind, net.eval(), mean.float(), std.float()
        self.info = dict(info or {})
        self.pair = dict(pair or {})
        # how it came to serve the pair it runs on (``decision_model_for``): plain data for traces and the UI
        self.source = {"how": "given", "trained_on": self.pair.get("name", "?")}

    @property
    def in_features(self) -> int:
        return int(self.mean.shape[0])

    @property
    def threshold(self) -> float | None:
        t = self.info.get("threshold")
        return None if t is None else float(t)

    def inputs(self, hidden: torch.Tensor | None = None, dist: torch.Tensor | None = None,
               path: torch.Tensor | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
        x = {"hidden": hidden, "dist": dist, "path": path, "context": context}[self.kind]
        if x is None:
            raise DecisionModelError(f"the {self.kind} decision model needs {self.kind} features")
        x = x.float().cpu()
        if x.shape[-1] != self.in_features:
            raise DecisionModelError(f"the {self.kind} decision model takes {self.in_features} features per token, "
                                     f"got {x.shape[-1]} (trained for another draft model?)")
        return (x - self.mean) / self.std

    def predict(self, hidden: torch.Tensor | None = None, dist: torch.Tensor | None = None,
                path: torch.Tensor | None = None, context: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted acceptance in [0, 1], float32 ``(n,)``, from the features of this model's kind:
        ``hidden`` ``(n, H)``, ``dist`` ``(n, 11)``, ``path`` ``(n, 14)`` or ``context`` ``(n, 24)``
        (``features.py``; other kinds' features may be passed and are ignored).
        Raises DecisionModelError when they are missing or have the wrong width."""
        with torch.inference_mode():
            return torch.sigmoid(self.net(self.inputs(hidden, dist, path, context)))

    def save(self, directory: str | Path) -> Path:
        """Write ``<directory>/<kind>.safetensors`` (weights + standardisation); the card is written separately."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.net.state_dict().items()}
        tensors["mean"], tensors["std"] = self.mean.contiguous(), self.std.contiguous()
        path = directory / f"{self.kind}.safetensors"
        save_file(tensors, str(path), metadata={"kind": self.kind, "format": str(CARD_FORMAT)})
        return path


def read_card(directory: str | Path) -> dict:
    """The JSON card of a decision-model folder. Raises DecisionModelError when missing or malformed."""
    path = Path(directory) / "card.json"
    card = parse_json(read_file(path, DecisionModelError), DecisionModelError, str(path))
    if not isinstance(card, dict) or card.get("format") != CARD_FORMAT or not isinstance(card.get("models"), dict):
        raise DecisionModelError(f"{path} is not a decision-model card (format {CARD_FORMAT})")
    return card


def load_decision_model(directory: str | Path, kind: str = "hidden") -> DecisionModel:
    """Load one model of a decision-model folder (``card.json`` + ``<kind>.safetensors``).

    Raises:
        DecisionModelError: missing or malformed files, or tensors that do not fit the card's layer sizes.
    """
    card = read_card(directory)
    info = card["models"].get(kind)
    if info is None:
        raise DecisionModelError(f"{directory} has no {kind!r} decision model (has: {', '.join(card['models'])})")
    path = Path(directory) / f"{kind}.safetensors"
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise DecisionModelError(f"cannot read {path}: {exc}") from None
    try:
        mean, std = tensors.pop("mean"), tensors.pop("std")
        net = DecisionMLP(int(info["in_features"]), tuple(int(x) for x in info["layers"]), device="cpu")
        net.load_state_dict(tensors)
    except (KeyError, RuntimeError, TypeError, ValueError) as exc:
        raise DecisionModelError(f"{path} does not match its card: {exc}") from None
    return DecisionModel(kind, net, mean, std, info=info, pair=card.get("pair"))


def find_shipped(draft_id: str, target_id: str, root: Path = ASSETS_DIR) -> Path | None:
    """The folder under ``assets/decision`` whose card was trained for this draft/target pair, or None."""
    if not root.is_dir():
        return None
    for card_path in sorted(root.glob("*/card.json")):
        try:
            pair = read_card(card_path.parent).get("pair", {})
        except DecisionModelError:
            continue
        if pair.get("draft_id") == draft_id and pair.get("target_id") == target_id:
            return card_path.parent
    return None


def shipped_decision_model(draft_id: str, target_id: str, kind: str = "hidden") -> DecisionModel:
    """The shipped model for a pair. Raises DecisionModelError (saying how to train one) when there is none."""
    folder = find_shipped(draft_id, target_id)
    if folder is None:
        raise DecisionModelError(
            f"no decision model ships for the pair {draft_id} -> {target_id}; train one with "
            "`python -m explorer decision calibrate`, or pick the stop policy none or confidence")
    return load_decision_model(folder, kind)


def calibration_dir(draft_id: str, target_id: str) -> Path:
    """The cache folder of a pair's calibrated models: ``<cache>/decision/<draft>--<target>-<hash>`` (the hash
    of both ids, which may be long paths)."""
    digest = hashlib.sha256(f"{draft_id}\0{target_id}".encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{Path(draft_id).name}--{Path(target_id).name}")[:80]
    return cache_dir() / "decision" / f"{name}-{digest}"


def find_calibrated(draft_id: str, target_id: str) -> Path | None:
    """The pair's calibrated models' folder when a calibration finished (its ``card.json`` names this pair)."""
    folder = calibration_dir(draft_id, target_id) / "model"
    try:
        pair = read_card(folder).get("pair", {}) if (folder / "card.json").is_file() else {}
    except DecisionModelError:
        return None
    return folder if pair.get("draft_id") == draft_id and pair.get("target_id") == target_id else None


def decision_model_for(draft_id: str, target_id: str, kind: str = "context") -> DecisionModel:
    """The decision model of ``kind`` that serves a draft/target pair, first found of:

    1. ``shipped``: trained for this pair, in ``assets/decision``;
    2. ``calibrated``: trained on this machine for this pair by ``decision calibrate`` (``calibrate.py``: the
       cache's ``decision/<pair>`` folder);
    3. ``transferred``: the embedded pair's model, for the kinds whose inputs do not depend on the pair
       (``TRANSFERABLE_KINDS``). Its predictions are a prior, not a measurement of this pair: callers switch on
       online adaptation for it (``factory.resolve_decision``).

    The model's ``source`` says which (``{"how", "trained_on"}``). Raises DecisionModelError for ``hidden`` on a
    pair with neither its own nor a calibrated model, or unreadable files."""
    for how, folder in (("shipped", find_shipped(draft_id, target_id)),
                        ("calibrated", find_calibrated(draft_id, target_id))):
        if folder is not None:
            model = load_decision_model(folder, kind)
            model.source = {"how": how, "trained_on": model.pair.get("name", "?")}
            return model
    if kind not in TRANSFERABLE_KINDS:
        raise DecisionModelError(
            f"the {kind} decision model reads the draft's hidden states, so it serves only the pair it was trained "
            f"on, and none is trained for {draft_id} -> {target_id}: run `python -m explorer decision calibrate` "
            f"(or the app's Calibrate button), or pick {', '.join(TRANSFERABLE_KINDS)}")
    model = load_decision_model(ASSETS_DIR / EMBEDDED_MODELS, kind)
    model.source = {"how": "transferred", "trained_on": model.pair.get("name", "?")}
    return model


__all__ = ["KINDS", "DEFAULT_LAYERS", "N_DIST_FEATURES", "TRANSFERABLE_KINDS", "DecisionMLP", "DecisionModel",
           "DecisionModelError", "calibration_dir", "decision_model_for", "find_calibrated", "find_shipped",
           "load_decision_model", "read_card", "shipped_decision_model"]
