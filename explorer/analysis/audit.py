"""The losslessness audit: does a method + verifier sample exactly from the target?

From one context, the first committed tokens are sampled ``N`` times (the engine rewinds to the prefill between
samples, each with its own seed; an online-adapting stop policy keeps learning across samples, so the law is tested
under a policy that changes from sample to sample). The empirical distribution of the first token, and of the first
two tokens, is
compared with the target's exact distribution, computed from the target's own probabilities (processed by the same
temperature / top-k / top-p):

* first token: ``p(x1)``, the target's distribution at the end of the prompt;
* first two tokens: ``p(x1) p(x2 | x1)`` (one target forward per likely x1; a first token that ends the text is the
  pair ``(x1, end)``).

Categories whose expected count reaches ``MIN_EXPECTED`` are tested one by one, all others pooled into one remainder
bucket; Pearson's chi-square test gives a p-value (scipy) and the total variation distance
``0.5 * sum |empirical - exact|`` over these categories says how far apart the two are. A lossless rule passes (p-value
above ``alpha``) at any N; a lossy one fails once N is large enough.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ..engine.config import MethodConfig
from ..engine.factory import build_engine
from ..engine.machine import Engine, positions_needed
from ..engine.sampling import SamplingConfig, logits_to_probs
from ..models.pair import ModelPair

MIN_EXPECTED = 5.0
ROUNDING_MASS = 1e-5  # probability mass below which the pooled remainder is float rounding, not a category


@dataclass
class Comparison:
    """Empirical against exact probabilities over some categories (token ids or token-id pairs as strings)."""

    n: int
    categories: list[str]
    counts: list[int]
    exact: list[float]
    chi2: float
    dof: int
    p_value: float
    tv_distance: float

    def top(self, k: int = 10) -> list[dict]:
        """The ``k`` likeliest categories under the exact law: ``{"category", "count", "empirical", "exact"}``."""
        return self._rows(sorted(range(len(self.categories)), key=lambda i: -self.exact[i])[:k])

    def most_different(self, k: int = 5) -> list[dict]:
        """The ``k`` categories whose empirical frequency differs most from the exact probability (as ``top``)."""
        return self._rows(sorted(range(len(self.categories)),
                                 key=lambda i: -abs(self.counts[i] / self.n - self.exact[i]))[:k])

    def _rows(self, order: list[int]) -> list[dict]:
        return [{"category": self.categories[i], "count": self.counts[i], "empirical": self.counts[i] / self.n,
                 "exact": self.exact[i]} for i in order]


@dataclass
class AuditResult:
    method: dict
    verifier: str
    sampling: dict
    samples: int
    alpha: float
    first: Comparison
    pairs: Comparison | None = None
    labels: dict = field(default_factory=dict)  # category -> readable text
    adaptation: dict = field(default_factory=dict)  # online adaptation after the last sample (empty when off)

    @property
    def passed(self) -> bool:
        return all(c.p_value > self.alpha for c in (self.first, self.pairs) if c is not None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


def compare(counts: dict, exact: dict, n: int) -> Comparison:
    """Chi-square and TV distance of observed ``counts`` (``n`` samples) against ``exact`` probabilities.

    The categories tested are those in ``exact`` whose expected count reaches ``MIN_EXPECTED``, chosen from the
    exact law and not from the sample (so no selection bias); everything else is pooled into one ``(other)``
    bucket whose expected count is what the tested categories leave. The TV distance is over these categories.
    """
    # here, not at the top: scipy takes about 1 s to import, and the CLI imports this module at start
    from scipy.stats import chi2 as chi2_dist

    kept = sorted((c for c in exact if exact[c] * n >= MIN_EXPECTED), key=lambda c: -exact[c])
    obs = [int(counts.get(c, 0)) for c in kept]
    probs = [float(exact[c]) for c in kept]
    other_p = max(0.0, 1.0 - sum(probs))
    other_obs = n - sum(obs)
    cats = [str(c) for c in kept]
    # A truncated law sums to 1 only up to float32 rounding (a few 1e-7, more or less on another CPU): a remainder
    # that small is no category, else the degrees of freedom would depend on how the sum happened to round.
    if other_obs > 0 or other_p > ROUNDING_MASS:
        cats.append("(other)")
        obs.append(other_obs)
        probs.append(other_p)
    stat = 0.0
    for o, p in zip(obs, probs):
        e = p * n
        if e > 1e-9:
            stat += (o - e) ** 2 / e
        elif o > 0:  # observed what the target gives (almost) no mass: certainly not the target's law
            stat = float("inf")
    dof = max(len(obs) - 1, 1)
    p_value = float(chi2_dist.sf(stat, dof)) if stat != float("inf") else 0.0
    tv = 0.5 * sum(abs(o / n - p) for o, p in zip(obs, probs))
    return Comparison(n=n, categories=cats, counts=obs, exact=probs, chi2=stat, dof=dof, p_value=p_value,
                      tv_distance=tv)


def _second_token_dists(pair: ModelPair, prompt_ids: list[int], firsts: list[int], sampling: SamplingConfig,
                        chunk: int = 1) -> dict[int, torch.Tensor]:
    """``p(. | prompt, x1)`` for each x1, processed like the engine's p: plain forwards (no cache), one sequence
    each. A batch of several x1 rounds differently in bf16 (other matmul kernels): on the embedded pair a batch of
    four moved p("3" | "z = [1, 2, ") from 0.263 (a lone forward, and the engine's tree forward alike) to 0.287,
    one bf16 step of the logit, which 1000 samples detect."""
    out = {}
    for i in range(0, len(firsts), chunk):
        part = firsts[i: i + chunk]
        ids = torch.tensor([prompt_ids + [x] for x in part], device=pair.device)
        with torch.inference_mode(), pair.lock:
            logits = pair.target(input_ids=ids, logits_to_keep=1).logits[:, -1, : pair.vocab_size]
        probs = logits_to_probs(logits, sampling)
        for x, row in zip(part, probs):
            out[x] = row
    return out


def audit(pair: ModelPair, config: MethodConfig, sampling: SamplingConfig, prompt_ids: list[int], samples: int,
          two_tokens: bool = True, alpha: float = 0.001, progress=None) -> AuditResult:
    """Sample the first (two) committed tokens ``samples`` times and compare with the target's exact law.

    Seeds ``sampling.seed + s`` for sample s, so an audit is reproducible. Raises EngineError for bad prompts and
    ValueError at temperature 0 (greedy decoding has nothing to audit).
    """
    return audit_engine(build_engine(pair, config, sampling), prompt_ids, samples, two_tokens, alpha, progress)


def audit_engine(engine: Engine, prompt_ids: list[int], samples: int, two_tokens: bool = True, alpha: float = 0.001,
                 progress=None) -> AuditResult:
    """``audit`` on an engine built by the caller (not started yet), e.g. with a drafter, verifier or stop policy
    swapped into its parts (docs/architecture.md). Same errors as ``audit``."""
    pair, config, sampling = engine.pair, engine.config, engine.sampling
    if sampling.greedy:
        raise ValueError("the audit compares distributions: use a temperature above 0")
    if samples < 1:
        raise ValueError("samples must be >= 1")
    n_tokens = 2 if two_tokens else 1
    # Room for whole trees (the engine drafts no deeper than the tokens left, ``drafters.base.Reach``): the audit must
    # verify the method's full tree, and the first tokens of a longer run follow the same law.
    spare = pair.max_positions - positions_needed(config, len(prompt_ids), n_tokens)
    engine.start(prompt_ids, n_tokens + max(0, min(spare, config.max_nodes())))
    p1 = engine.state.next_dist.detach().clone()
    firsts: dict[int, int] = {}
    pairs: dict[tuple[int, int], int] = {}
    for s in range(samples):
        engine.rewind(seed=sampling.seed + s)
        while engine.n_generated < n_tokens and not engine.finished:
            engine.step()
        gen = engine.state.committed[engine.state.n_prompt:]
        firsts[gen[0]] = firsts.get(gen[0], 0) + 1
        if two_tokens:  # a first token that ends the run (EOS) is its own category (x1, -1)
            key = (gen[0], gen[1] if len(gen) >= 2 else -1)
            pairs[key] = pairs.get(key, 0) + 1
        if progress:
            progress(s + 1, samples)
    exact1 = {t: float(v) for t, v in enumerate(p1.tolist()) if v * samples >= MIN_EXPECTED}
    first = compare(firsts, exact1, samples)
    labels = {str(t): pair.tokenizer.decode([t]) for t in list(firsts)[:200]}
    pair_cmp = None
    if two_tokens:
        # Exact pair probabilities for every first token with enough mass to be tested; the categories come
        # from the exact law, not from the sample.
        heavy = torch.nonzero(p1 * samples >= MIN_EXPECTED).flatten().tolist()
        eos = set(pair.eos_token_ids)
        seconds = _second_token_dists(pair, list(prompt_ids), [t for t in heavy if t not in eos], sampling)
        exact2 = {}
        for a in heavy:
            if a in eos:
                exact2[(a, -1)] = float(p1[a])
                continue
            joint = float(p1[a]) * seconds[a]
            for b in torch.nonzero(joint * samples >= MIN_EXPECTED).flatten().tolist():
                exact2[(a, b)] = float(joint[b])
        pair_cmp = compare(pairs, exact2, samples)
        for a, b in list(pairs)[:200]:
            labels[str((a, b))] = pair.tokenizer.decode([a]) + "|" + (pair.tokenizer.decode([b]) if b >= 0 else "(end)")
    adaptation = {}
    if engine.parts.adapter is not None:  # it learned across all samples (it outlives rewind): show how far it moved
        adaptation = {**engine.parts.adapter.summary(), "start_threshold": engine.parts.adapter.start_threshold}
    return AuditResult(method=config.to_dict(), verifier=engine.verifier_name, sampling=sampling.to_dict(),
                       samples=samples, alpha=alpha, first=first, pairs=pair_cmp, labels=labels,
                       adaptation=adaptation)
