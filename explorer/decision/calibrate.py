"""Calibrating the decision models to a pair that ships none: ``python -m explorer decision calibrate`` and the
app's Calibrate button.

A pair with no model of its own runs the learned stop policies on the embedded pair's model (``model.py``,
``decision_model_for``: ``transferred``). Calibration measures this pair instead: it drafts on a prompt mix with
the collection settings (``collect.py``: every drafted token with its features and the target's soft label
``min(1, p(x)/q(x))``), trains every model kind on those tokens (``train.py``) and saves them in the model cache
under the pair's folder name (``calibration_dir``), where ``decision_model_for`` finds them from then on
(``calibrated``). About two minutes for the embedded pair on a 2-core CPU at the defaults; seconds on the tiny pair.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

from ..analysis.prompts import load_prompt_set
from ..engine.stop_models.model import calibration_dir, find_calibrated
from .collect import collect
from .train import train_models

CALIBRATION_PROMPTS = 24
CALIBRATION_TOKENS = 32
# The prompt mix a calibration drafts on, taken in turn so that a few prompts already cover every kind.
CALIBRATION_SOURCES = ("prompt-mix", "humaneval", "mt-bench")


def calibration_prompts(n: int = CALIBRATION_PROMPTS) -> list:
    """``n`` prompts taken in turn from each category of the prompt mix, HumanEval and MT-bench
    (``analysis/prompts.py``)."""
    groups: dict[str, list] = {}
    for source in CALIBRATION_SOURCES:
        for prompt in load_prompt_set(source):
            groups.setdefault(f"{source}/{prompt.category}", []).append(prompt)
    queues = list(groups.values())
    out, i = [], 0
    while len(out) < n and any(i < len(q) for q in queues):
        out.extend(q[i] for q in queues if i < len(q))
        i += 1
    return out[:n]


def calibrate(pair, *, prompts: int | None = None, max_new_tokens: int | None = None, seed: int = 0,
              on_progress: Callable[[str, float], None] | None = None) -> dict:
    """Collect on ``prompts`` prompts of the calibration mix (``max_new_tokens`` each, greedy and temperature 1 in
    turn; None: ``CALIBRATION_PROMPTS`` and ``CALIBRATION_TOKENS``), train every model kind and save them for
    ``pair`` (``calibration_dir``); a calibration already in the cache is replaced. Returns the models' card
    (``train.train_models``) with ``"folder"`` added.

    ``on_progress(message, fraction)``: called after each prompt and before training (fraction 0..1).
    Raises ValueError for fewer than 4 prompts (a validation split needs some), DataError when no prompt fits the
    models' context window."""
    prompts = CALIBRATION_PROMPTS if prompts is None else prompts
    max_new_tokens = CALIBRATION_TOKENS if max_new_tokens is None else max_new_tokens
    if prompts < 4:
        raise ValueError(f"calibration needs at least 4 prompts, got {prompts}")
    report = on_progress or (lambda message, fraction: None)
    root = calibration_dir(pair.draft_id, pair.target_id)
    data, model = root / "data", root / "model"
    shutil.rmtree(root, ignore_errors=True)  # a fresh measurement: no shards of an earlier one mix in
    chosen = calibration_prompts(prompts)
    report(f"drafting on {len(chosen)} prompts", 0.0)

    def after_prompt(done: int, total: int) -> None:
        report(f"drafted on {done}/{total} prompts", 0.85 * done / total)

    collect(pair, chosen, data, max_new_tokens=max_new_tokens, seed=seed, progress=False, on_prompt=after_prompt)
    report("training the decision models", 0.85)
    card = train_models([data], model, seed=seed, epochs=40)
    report("calibrated", 1.0)
    return {**card, "folder": str(model)}


__all__ = ["CALIBRATION_PROMPTS", "CALIBRATION_TOKENS", "calibrate", "calibration_dir", "calibration_prompts",
           "find_calibrated"]  # the last two live in model.py (the lookup needs them without collect's imports)
