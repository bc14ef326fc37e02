"""Rejection forensics over a prompt set: which drafted tokens the target rejects, where, and why, from
recorded traces only (no model, no torch).

Every drafted node the verifier tested (accepted or rejected: nodes below a rejection were never tested, and the
lossy rule's target-sampled roots are not tests) is one observation with:

* its **token class** (``token_class``): one classifier for any tokenizer, on the token's decoded text and the text
  before it (its parent's): ``special`` (``<|...|>``, ``<s>``-like), ``newline``, ``whitespace`` (indentation),
  ``digits``, ``punctuation`` (also a token that starts with punctuation, as ``.append``), ``word start`` (after a
  space, punctuation or a newline) and ``word continuation`` (glued to a letter or digit);
* its **depth**, the prompt's **category**, its **draft source** (draft model, lookup, recycled), the draft's
  confidence ``q`` in it (deciles), the **target's entropy** at its parent (from the trace's top-8 of p, the rest of
  the mass spread as one lump: a lower bound, in nats);
* realised (accepted or not) and **expected** acceptance: the verification rule's probability that the node passes
  once its parent is reached (``NodeTrace.accept_prob``, ``engine/verify/expectation.py``). At T > 0 a rejection is
  a draw; a class whose expected rate is high and realised rate low was unlucky, a class whose expected rate is low
  is one the draft gets wrong.

Besides the tables by class, depth, category, confidence, entropy and source, it keeps **the confusion table**
(drafted token -> the token the target committed in its place, with counts, mean p and q of the drafted token and the
share of near ties: the target's best two within one rounding step of bf16, 2^-8 relative), **the costliest
rejections** (the expected tokens the rejected subtree would have added had the node passed: 1 + the expected
accepted length below it under its descendants' ``accept_prob``), and **per prompt** tokens per target call,
acceptance length and vLLM's per-position acceptance (accepted drafted tokens at depth d over steps that drafted
depth d).

``Forensics.add`` takes one run at a time, so memory grows with the confusion pairs and the kept top rejections, not
with the nodes; ``to_dict`` is the ``forensics.json`` schema (docs/forensics.md).
"""

from __future__ import annotations

import heapq
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from ..trace.records import ACCEPTED, REJECTED, RunTrace

FORENSICS_SCHEMA = 1
TOKEN_CLASSES = ("special", "newline", "whitespace", "digits", "punctuation", "word start", "word continuation")
# the draft sources a test can come from (target roots are not tested)
SOURCES = ("draft", "lookup", "recycled", "plugin")
NEAR_TIE = 2.0 ** -8  # bf16's relative rounding step: the target's best two closer than this are a near tie
TOP_REJECTIONS = 20  # the costliest rejections kept

_SPECIAL = re.compile(r"^(<\|[^|]*\|>|</?s>|<[a-z_]+>|\[[A-Z_]+\])$")


def token_class(text: str, before: str = "") -> str:
    """The class of a token of decoded ``text`` after the text ``before`` it (``TOKEN_CLASSES``)."""
    if _SPECIAL.match(text.strip()):
        return "special"
    if text.strip() == "":
        return "newline" if "\n" in text else "whitespace"
    core = text.strip()
    if core.isdigit():
        return "digits"
    if not (core[0].isalnum() or core[0] == "_"):
        return "punctuation"
    glued = text[0] not in " \t\n" and before and (before[-1].isalnum() or before[-1] == "_")
    return "word continuation" if glued else "word start"


def target_entropy(p_top: list) -> float | None:
    """Entropy (nats) of the target's distribution at a node's parent from its top tokens (``[id, text, prob]``),
    the mass outside them counted as one outcome: a lower bound of the true entropy. None without a top list."""
    probs = [float(t[2]) for t in p_top if t[2] and t[2] > 0]
    if not probs:
        return None
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in probs + ([rest] if rest > 1e-12 else []))


@dataclass
class Tally:
    """Tested nodes of one group: ``tested``, ``accepted`` and the sum of their ``accept_prob`` (``expected``
    over ``with_odds`` nodes that have one)."""

    tested: int = 0
    accepted: int = 0
    expected: float = 0.0
    with_odds: int = 0

    def add(self, accepted: bool, odds: float | None) -> None:
        self.tested += 1
        self.accepted += accepted
        if odds is not None:
            self.expected += odds
            self.with_odds += 1

    def to_dict(self) -> dict:
        return {"tested": self.tested, "accepted": self.accepted,
                "rate": self.accepted / self.tested if self.tested else None,
                "expected_rate": self.expected / self.with_odds if self.with_odds else None}


@dataclass
class Forensics:
    """The aggregate over every run added (module docstring). Tables map a group's name to its ``Tally``."""

    by_class: dict = field(default_factory=lambda: defaultdict(Tally))
    by_depth: dict = field(default_factory=lambda: defaultdict(Tally))
    by_category: dict = field(default_factory=lambda: defaultdict(Tally))
    by_confidence: dict = field(default_factory=lambda: defaultdict(Tally))
    by_entropy: dict = field(default_factory=lambda: defaultdict(Tally))
    by_source: dict = field(default_factory=lambda: defaultdict(Tally))
    # (drafted id, committed id) -> [count, sum p, sum q, near ties, drafted text, committed text]
    confusions: dict = field(default_factory=dict)
    costliest: list = field(default_factory=list)  # heap of (expected tokens cut, seq, row)
    prompts: list = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # a run's settings line -> runs with it
    nodes: int = 0
    _seq: int = 0

    def add(self, trace: RunTrace, prompt: str = "", category: str = "-", source: str = "") -> None:
        """Every tested node of ``trace`` (one run), under ``prompt`` (a name) and ``category``; ``source``: where
        the trace came from (a file path), for the costliest rejections' rows."""
        depth_tested: dict[int, int] = defaultdict(int)
        depth_accepted: dict[int, int] = defaultdict(int)
        target_calls = sum(s.target_calls for s in trace.steps)
        for step in trace.steps:
            by_id = {n.id: n for n in step.nodes}
            kids: dict[int, list] = defaultdict(list)
            for n in step.nodes:
                if n.parent is not None:
                    kids[n.parent].append(n)
            drafted_depths = {n.depth for n in step.nodes if n.source in SOURCES}
            for d in drafted_depths:
                depth_tested[d] += 1
            for n in step.nodes:
                if n.source not in SOURCES or n.status not in (ACCEPTED, REJECTED):
                    continue
                ok = n.status == ACCEPTED
                parent = by_id.get(n.parent)
                before = parent.text if parent is not None else ""
                cls = token_class(n.text, before)
                self.nodes += 1
                for table, key in ((self.by_class, cls), (self.by_depth, n.depth), (self.by_category, category),
                                   (self.by_source, n.source), (self.by_confidence, _decile(n.q)),
                                   (self.by_entropy, _entropy_bin(target_entropy(n.p_top)))):
                    table[key].add(ok, n.accept_prob)
                if ok:
                    depth_accepted[n.depth] += 1
                    continue
                self._confusion(n, parent, kids, step)
                cut = 1.0 + _expected_below(n.id, kids)
                row = {"prompt": prompt, "category": category, "step": step.index, "node": n.id,
                       "token": n.text, "class": cls, "depth": n.depth, "source": n.source,
                       "expected_tokens_cut": cut, "p": n.p, "q": n.q, "trace": source}
                self._seq += 1
                item = (cut, self._seq, row)
                if len(self.costliest) < TOP_REJECTIONS:
                    heapq.heappush(self.costliest, item)
                elif cut > self.costliest[0][0]:
                    heapq.heapreplace(self.costliest, item)
        line = settings_line(trace)
        self.settings[line] = self.settings.get(line, 0) + 1
        steps = len(trace.steps)
        accepted = sum(s.accepted_draft_len for s in trace.steps)
        tokens = sum(len(s.committed_ids) for s in trace.steps)
        self.prompts.append({
            "prompt": prompt, "category": category, "steps": steps, "target_calls": target_calls, "tokens": tokens,
            "tokens_per_target_call": tokens / target_calls if target_calls else None,
            "acceptance_length": accepted / steps if steps else None,
            "per_position": {str(d): depth_accepted[d] / depth_tested[d] for d in sorted(depth_tested)}})

    def _confusion(self, n, parent, kids, step) -> None:
        """Drafted ``n`` rejected: what the target committed in its place, the parent's committed child or the
        bonus token. Keyed by token ids: byte-level tokenizers decode many partial-character tokens to the same
        text."""
        instead = next(((k.token_id, k.text) for k in kids.get(n.parent, []) if k.committed and k.id != n.id), None)
        if instead is None and parent is not None and parent.committed and step.bonus_token is not None:
            instead = (step.bonus_token, step.committed_text[-1])
        if instead is None:
            return
        tops = [float(t[2]) for t in n.p_top[:2]]
        tie = len(tops) == 2 and tops[0] > 0 and (tops[0] - tops[1]) <= NEAR_TIE * tops[0]
        entry = self.confusions.setdefault((n.token_id, instead[0]), [0, 0.0, 0.0, 0, n.text, instead[1]])
        entry[0] += 1
        entry[1] += n.p or 0.0
        entry[2] += n.q or 0.0
        entry[3] += tie

    def to_dict(self) -> dict:
        """The ``forensics.json`` content (docs/forensics.md)."""
        def table(t: dict) -> dict:
            return {str(k): v.to_dict() for k, v in sorted(t.items(), key=lambda kv: str(kv[0]))}

        confusions = sorted(self.confusions.items(), key=lambda kv: -kv[1][0])
        return {"forensics_schema": FORENSICS_SCHEMA, "nodes": self.nodes, "settings": dict(self.settings),
                "by_class": {c: self.by_class[c].to_dict() for c in TOKEN_CLASSES if c in self.by_class},
                "by_depth": {str(d): self.by_depth[d].to_dict() for d in sorted(self.by_depth)},
                "by_category": table(self.by_category), "by_confidence": table(self.by_confidence),
                "by_entropy": table(self.by_entropy), "by_source": table(self.by_source),
                "confusions": [{"drafted": a, "committed": b, "drafted_id": i, "committed_id": j, "count": c,
                                "mean_p": p / c, "mean_q": q / c, "near_tie_share": t / c}
                               for (i, j), (c, p, q, t, a, b) in confusions],
                "costliest": [row for _, _, row in sorted(self.costliest, key=lambda x: (-x[0], x[1]))],
                "prompts": self.prompts}


def settings_line(trace: RunTrace) -> str:
    """What a run was: pair, method and temperature, in one line (``mcsd-improved, T 0.7, <pair name>``)."""
    method = trace.settings.get("method", {}).get("method", "?")
    return f"{method}, T {trace.temperature:g}, {trace.model.get('name', '?')}"


def run_category(trace: RunTrace) -> str:
    """A saved run's prompt category: its prompt set's category, else the set's name, else ``-``."""
    info = trace.prompt_info
    return info.get("category") or info.get("source") or "-"


def _decile(q: float | None) -> str:
    if q is None:
        return "-"
    k = min(9, max(0, int(q * 10)))
    return f"{k / 10:.1f}-{(k + 1) / 10:.1f}"


def _entropy_bin(h: float | None) -> str:
    if h is None:
        return "-"
    for edge in (0.1, 0.5, 1.0, 2.0):
        if h < edge:
            return f"<{edge}"
    return ">=2.0"


def _expected_below(node: int, kids: dict) -> float:
    """The expected number of nodes accepted below ``node`` had it passed: children tried in test order, each
    passing with its ``accept_prob`` (0 where none) and the walk going down the first that passes."""
    total, reach = 0.0, 1.0
    for k in sorted(kids.get(node, []), key=lambda k: (k.test_order is None, k.test_order or 0)):
        odds = k.accept_prob or 0.0
        total += reach * odds * (1.0 + _expected_below(k.id, kids))
        reach *= 1.0 - odds
    return total


__all__ = ["FORENSICS_SCHEMA", "Forensics", "TOKEN_CLASSES", "Tally", "run_category", "settings_line",
           "target_entropy", "token_class"]
