"""Online adaptation of a stop policy: every verified step labels its drafted tokens for free.

After verification the target's logits at every drafted token's parent row are known, so each drafted token x gets
a label whether or not the verifier reached it: its acceptance probability under the run's own verification rule
(``expectation.NodeOdds.accept_prob``: 0 or 1 for greedy decoding, ``min(1, p'(x)/q'(x))`` with the run's
temperature and the residuals of earlier-tested siblings when sampling). The models were trained on the
temperature-1 soft label; adapting to the run's own acceptance events is the point. An adapter keeps a window of
the latest labelled tokens and moves the stop policy towards this session's behaviour:

* ``threshold``: refit the policy's threshold from the window's ROC curve (Hugging Face assisted generation does
  this for its confidence threshold, ``AssistedCandidateGenerator.update_candidate_strategy``: the threshold that
  minimises ``fpr + c * fnr``; transformers uses c = 3 with hard labels, here labels in [0, 1] are weighted as
  soft labels are in ``evaluate.py`` and c defaults to 1, Youden's J, the rule the shipped card's threshold comes
  from). Works for the ``confidence``, ``decision`` and ``prune`` policies, whose scores are per-token acceptance
  estimates.
* ``last-layer``: refit the decision model's last linear layer on the window (the earlier layers stay frozen, so a
  token's penultimate activations are computed once), in the spirit of online speculative decoding (Liu et al.
  2023, OSD, arXiv 2310.07177), which keeps adapting the draft side to the queries it serves. The fit is a MAP
  logistic regression: binary cross-entropy on the labels plus a Gaussian prior centred on the shipped layer
  (``prior`` records' worth), solved by a few Newton steps, deterministic and cheap (65 parameters for the
  default ``context`` model: 64 weights and a bias). The threshold stays tau; what moves is the predicted
  acceptance it is compared with. Works for every learned policy (``decision``, ``prune``, ``specdec++``,
  ``goodput``).

Either way only *how much* is drafted changes: verification never reads the policy, so the output law is the
target's (the audit checks it with adaptation on). The adapter outlives ``Engine.rewind`` like a session would, and
what it learned carries to the session's next run of the same method, sampling and decision model (``state`` and
``carried``; the bench carries it from prompt to prompt, the app from run to run), as Token Recycling's matrix and
the goodput fallback's rates do: a run starts where the last one left off instead of at the shipped model.
Each step's ``update`` returns plain data for the trace (``StepTrace.adaptation``). Measured (docs/decision.md):
``last-layer``, carried and weighted, under ``goodput`` with a measured r, 1.00-1.10x the frozen model's tokens/s on
the CPU (HumanEval level within noise, MT-bench 1.03-1.05x, a held-out kind 1.08-1.10x; "Online adaptation against
the frozen model"); ``threshold`` 0.79-1.01x ("Tried and not kept"); both off by default.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections import deque

import numpy as np
import torch

from ..policies.stopping import ADAPT_MODES, adapt_problem
from .scores import choose_threshold

WINDOW = 512  # labelled tokens kept (the latest)
MIN_RECORDS = 16  # no refit before this many labels (and, for the threshold, both outcomes seen)


class AdaptError(ValueError):
    """An adaptation mode that cannot work with the chosen stop policy."""


class OnlineAdapter:
    """Moves a stop policy with labels from verified steps.

    Args:
        mode: ``"threshold"`` or ``"last-layer"`` (``ADAPT_MODES`` minus ``off``).
        policy: the engine's ``stopping.StopPolicy``; a ``last-layer`` adapter gives it its own copy of the
            decision model (the shipped one stays untouched).
        window: labelled tokens kept; fnr_cost: c in ``fpr + c * fnr`` (threshold mode);
        prior: weight of the shipped layer in records (last-layer mode); newton_steps: per refit.
        carried: ``state()`` of an earlier run's adapter of the same mode, policy and decision model: its window,
            threshold and (last-layer) layer are where this one starts. The prior stays centred on the shipped
            layer.
    Raises:
        AdaptError: ``threshold`` with ``specdec++`` (its score is a path product, not a token's acceptance),
            ``last-layer`` with a policy that reads no decision model, or a ``carried`` state of another mode,
            policy or decision model, or malformed (say, from an edited trace file).
    """

    def __init__(self, mode: str, policy, *, window: int = WINDOW, fnr_cost: float = 1.0, prior: float = 32.0,
                 newton_steps: int = 3, carried: dict | None = None):
        if mode == "off":
            raise AdaptError("adaptation off needs no adapter (make_adapter returns None)")
        problem = adapt_problem(mode, policy.name)
        if problem:
            raise AdaptError(problem)
        self.mode, self.policy = mode, policy
        self.fnr_cost, self.prior, self.newton_steps = float(fnr_cost), float(prior), int(newton_steps)
        self.scores: deque = deque(maxlen=window)  # threshold mode: the policy's score of each labelled token
        self.acts: deque = deque(maxlen=window)  # last-layer mode: penultimate activations (float64 rows)
        self.labels: deque = deque(maxlen=window)
        self.weights: deque = deque(maxlen=window)  # P(the walk tested the token): what a refit weighs it by
        self.start_threshold = float(policy.threshold)
        if mode == "last-layer":
            self.frozen = policy.model
            policy.model = copy.deepcopy(policy.model)
            last = policy.model.net.layers[-1]
            self.theta0 = _theta(last)  # the shipped layer: the prior's centre
        # the decision model this adapter learns with (None for the confidence policy): what a carried state must match
        self.model_id = model_fingerprint(getattr(policy, "model", None) if mode == "threshold" else self.frozen)
        self.carried = 0  # labelled tokens carried over from an earlier run
        if carried is not None:
            self.restore(carried)

    @property
    def needs(self) -> str:
        """What ``update`` needs per token besides its label: ``"score"`` or ``"inputs"`` (model inputs)."""
        return "score" if self.mode == "threshold" else "inputs"

    def update(self, labels: torch.Tensor, scores: torch.Tensor | None = None,
               inputs: dict | None = None, weights: torch.Tensor | None = None) -> dict:
        """Learn from one verified step.

        Args:
            labels: float32 ``(n,)`` in [0, 1], the step's drafted tokens' acceptance probabilities.
            scores: float32 ``(n,)`` the policy's score of each (threshold mode).
            inputs: the decision model's inputs (last-layer mode; ``features.model_inputs``: ``{"dist", "path",
                "context"[, "hidden"]: (n, F)}``).
            weights: float32 ``(n,)`` in [0, 1], each token's weight in the last layer's refit: the probability
                that the verifier's walk tested it (``expectation.tested_probs``), since the stop rule needs a
                token's acceptance given that its path so far was accepted; a token below a rejection says little
                about that. None = 1 each.
        Returns:
            plain data for the trace: ``mode``, ``records`` (window size), ``threshold`` (the policy's setting
            now), ``label_mean`` (mean label of this step's tokens), in threshold mode ``score_mean``, in
            last-layer mode ``pred_frozen`` / ``pred_before`` / ``pred_after`` (mean predicted acceptance of this
            step's tokens by the shipped model, by the adapted one that drafted them, and after this refit) plus
            ``bias`` and ``weight_shift`` (L2 distance of the layer from the shipped one).
        """
        labels = labels.detach().float().cpu()
        out = {"mode": self.mode, "tokens": int(labels.numel()),
               "label_mean": float(labels.mean()) if labels.numel() else None}
        self.labels.extend(labels.tolist())
        self.weights.extend(weights.detach().float().cpu().tolist() if weights is not None else [1.0] * len(labels))
        if self.mode == "threshold":
            scores = scores.detach().float().cpu()
            out["score_mean"] = _mean(scores)
            self.scores.extend(scores.tolist())
            if len(self.labels) >= MIN_RECORDS:
                t = roc_threshold(np.array(self.scores), np.array(self.labels), self.fnr_cost)
                if t is not None:
                    self.policy.set_threshold(t)
        else:
            model = self.policy.model
            with torch.inference_mode():
                acts = _penultimate(model, inputs)
                out["pred_frozen"] = _mean(self.frozen.predict(**inputs))
                out["pred_before"] = _mean(model.predict(**inputs))
            self.acts.extend(acts.double().numpy())
            if len(self.labels) >= MIN_RECORDS:
                self._refit(model)
            with torch.inference_mode():
                out["pred_after"] = _mean(model.predict(**inputs))
            out["bias"] = float(model.net.layers[-1].bias.detach()[0])
            out["weight_shift"] = self._weight_shift()
        out["records"] = len(self.labels)
        out["threshold"] = float(self.policy.threshold)
        return out

    def summary(self) -> dict:
        """Where the adapter stands: ``mode``, ``records``, ``threshold``, ``label_mean`` over the window, and for
        ``last-layer`` the layer's ``weight_shift`` from the shipped one."""
        out = {"mode": self.mode, "records": len(self.labels), "threshold": float(self.policy.threshold),
               "label_mean": float(np.mean(self.labels)) if self.labels else None}
        if self.mode == "last-layer":
            out["weight_shift"] = self._weight_shift()
        return out

    def state(self) -> dict:
        """What this adapter has learned, as plain data (JSON-safe, exact): ``mode``, ``policy``, ``model`` (the
        decision model's fingerprint, or None), ``labels``, ``weights``, ``threshold``, and ``scores`` (threshold
        mode) or ``acts`` (penultimate activations, one list per label) and ``theta`` (the adapted last layer,
        weights then bias). Pass it as ``carried`` to the next run's adapter."""
        out = {"mode": self.mode, "policy": self.policy.name, "model": self.model_id,
               "labels": [float(x) for x in self.labels], "weights": [float(x) for x in self.weights],
               "threshold": float(self.policy.threshold)}
        if self.mode == "threshold":
            out["scores"] = [float(x) for x in self.scores]
        else:
            out["acts"] = [[float(x) for x in row] for row in self.acts]
            out["theta"] = [float(x) for x in _theta(self.policy.model.net.layers[-1])]
        return out

    def restore(self, state: dict) -> None:
        """Start from ``state`` (``state()`` of an earlier adapter), before any ``update``. Raises AdaptError when
        it does not fit (another mode, policy or decision model: ``model_id``; or malformed), restoring nothing."""
        try:
            if (state["mode"], state["policy"], state["model"]) != (self.mode, self.policy.name, self.model_id):
                raise AdaptError(f"the carried adaptation was learned for {state['mode']} / {state['policy']} "
                                 f"(decision model {state['model']}), this run adapts {self.mode} / "
                                 f"{self.policy.name} ({self.model_id}): it cannot start this run's")
            labels = [_unit(x) for x in state["labels"]]
            weights = [_unit(x) for x in state["weights"]]
            if len(weights) != len(labels):
                raise ValueError("one weight per label")
            if self.mode == "threshold":
                scores = [float(x) for x in state["scores"]]
                threshold = _unit(state["threshold"])
                if len(scores) != len(labels) or not all(math.isfinite(x) for x in scores):
                    raise ValueError("one finite score per label")
            else:
                width = len(self.theta0) - 1
                acts = [np.asarray(row, dtype=np.float64) for row in state["acts"]]
                theta = np.asarray(state["theta"], dtype=np.float64)
                if len(acts) != len(labels) or any(a.shape != (width,) for a in acts) or theta.shape != (width + 1,):
                    raise ValueError(f"one row of {width} activations per label and {width + 1} layer values")
                if not (all(np.isfinite(a).all() for a in acts) and np.isfinite(theta).all()):
                    raise ValueError("non-finite activations or layer values")
        except AdaptError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise AdaptError(f"the carried adaptation state is malformed: {exc!r}") from None
        self.labels.extend(labels)
        self.weights.extend(weights)
        if self.mode == "threshold":
            self.scores.extend(scores)
            self.policy.set_threshold(threshold)
        else:
            self.acts.extend(acts)
            _set_theta(self.policy.model.net.layers[-1], theta)
        self.carried = len(self.labels)

    def _weight_shift(self) -> float:
        """L2 distance of the adapting last layer (weights and bias) from the shipped one."""
        return float(np.linalg.norm(_theta(self.policy.model.net.layers[-1]) - self.theta0))

    def _refit(self, model) -> None:
        """MAP logistic regression of the last layer on the window (each token's BCE times its weight), prior
        N(theta0, (1 / prior) * diag(scale)).

        In torch, float64 on the host, not numpy: numpy's OpenBLAS keeps a thread pool of its own that spins after
        each call once the window is a few hundred rows, and on a 2-core CPU those threads took the cores from the
        next forwards (with a full window the refit took 15-20 ms a step and the forwards after it
        slowed; a run making the frozen model's very calls took 1.2x its time). torch's ops run on the models'
        threads."""
        cpu = torch.device("cpu")
        a = torch.from_numpy(np.asarray(self.acts))
        x = torch.cat([a, torch.ones((len(a), 1), dtype=torch.float64, device=cpu)], 1)
        y = torch.tensor(list(self.labels), dtype=torch.float64, device=cpu)
        w = torch.tensor(list(self.weights), dtype=torch.float64, device=cpu)
        rms = (w[:, None] * a * a).sum(0) / w.sum().clamp_min(1e-9)  # each input's own units, over what counts
        scale = torch.cat([rms + 1e-3, torch.ones(1, dtype=torch.float64, device=cpu)])
        lam = self.prior * scale
        theta0 = torch.from_numpy(self.theta0)
        theta = torch.from_numpy(_theta(model.net.layers[-1]))
        for _ in range(self.newton_steps):
            p = torch.sigmoid((x @ theta).clamp(-30, 30))
            grad = x.T @ (w * (p - y)) + lam * (theta - theta0)
            hess = (x * (w * p * (1 - p))[:, None]).T @ x + torch.diag(lam)
            theta = theta - torch.linalg.solve(hess, grad)
        _set_theta(model.net.layers[-1], theta.numpy())


def roc_threshold(scores: np.ndarray, soft: np.ndarray, fnr_cost: float = 1.0) -> float | None:
    """The score threshold minimising ``fpr + fnr_cost * fnr`` on soft labels (``scores.choose_threshold``: each
    token counts as accepted with weight ``soft``, rejected with ``1 - soft``); None while the window holds no
    evidence of both outcomes. Returned in [0, 1]."""
    if float(soft.sum()) < 1e-6 or float((1 - soft).sum()) < 1e-6:
        return None
    return choose_threshold(scores, soft, fnr_cost)


def _theta(layer) -> np.ndarray:
    return np.concatenate([layer.weight.detach().double().numpy().ravel(), layer.bias.detach().double().numpy()])


def _set_theta(layer, theta: np.ndarray) -> None:
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(theta[:-1]).reshape_as(layer.weight))
        layer.bias.copy_(torch.from_numpy(theta[-1:]).reshape_as(layer.bias))


def _unit(x) -> float:
    """``x`` as a float in [0, 1]; ValueError otherwise."""
    x = float(x)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{x} is not in [0, 1]")
    return x


def model_fingerprint(model) -> str | None:
    """A short hash of a decision model's kind, input standardisation and weights (None without a model): what
    a carried adaptation state must have been learned with."""
    if model is None:
        return None
    h = hashlib.sha1(model.kind.encode())
    for t in (model.mean, model.std, *model.net.parameters()):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _penultimate(model, inputs: dict) -> torch.Tensor:
    """The decision MLP's activations before its last linear layer, float32 ``(n, width)``."""
    x = model.inputs(**inputs)
    return model.net.layers[:-1](x)


def _mean(t: torch.Tensor) -> float | None:
    return float(t.float().mean()) if t.numel() else None


def make_adapter(mode: str, policy) -> OnlineAdapter | None:
    """None for ``off``, else an OnlineAdapter for ``policy``. Raises AdaptError as OnlineAdapter does."""
    if mode == "off":
        return None
    return OnlineAdapter(mode, policy)


__all__ = ["ADAPT_MODES", "AdaptError", "OnlineAdapter", "make_adapter", "model_fingerprint", "roc_threshold"]
