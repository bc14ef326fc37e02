"""Recording the shipped lessons (``python -m explorer lessons record``): each lesson's runs on a real pair, the
notes marked where the run shows what the lesson is about, an ``ar`` run of the same prompt for the race, and where
a lesson is about losslessness the audit's verdict. Writes ``assets/lessons/<id>.json`` (``lessons/lesson.py``).

The notes are found in the recorded traces by rules (the step with the longest accepted chain, the first rejection
with a residual, the first early stop, ...), so a lesson re-recorded on another machine marks what its own run shows.
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

from ..analysis.audit import audit
from ..analysis.bench import run_facts
from ..analysis.online import learn_stream
from ..analysis.prompts import encode_prompt
from ..engine.config import DEFAULTS, MethodConfig
from ..engine.factory import build_engine
from ..engine.sampling import SamplingConfig
from ..trace import lanes
from ..trace.metrics import first_acceptance, prefill_calls
from ..trace.records import REJECTED, RunTrace
from .lesson import LESSONS_DIR, Lesson, LessonRun, MachineTimings, Note, load_lesson
from ..plugins.loading import load_bundled
from .phases import quote_token

load_bundled()  # lessons 08 and 09 run the project's bundled plugins (spectr, rsd-s, pearl), named in LESSON_SPECS
GREEDY = SamplingConfig(temperature=0.0)


@dataclass(frozen=True)
class LessonSpec:
    """How to record one lesson: its runs (label, method, sampling) on one prompt, the notes rule, and the audit's
    sample count (0: none). With ``learn``, the head learns online on a stream of prompts of one kind first
    (``analysis.online``), and a run whose config's head is ``LEARNED_HEAD`` drafts with what it learnt; the notes
    rule then gets the learning's history in place of an audit."""

    id: str
    title: str
    question: str
    prompt: str
    runs: tuple
    notes: Callable[[list[RunTrace], dict | None], list[Note]]
    max_new_tokens: int = 48
    audit_samples: int = 0
    audit_run: int = 0
    learn: tuple | None = None  # (kind, requests, lr, every): a head learnt online first (runs name LEARNED_HEAD)


LEARNING_PROMPT = ("English to Dutch:\n\nCould you tell me where the nearest pharmacy is? The train was late, so we "
                   "missed the beginning of the concert.")
"""Lesson 10's prompt: a held-out translation prompt of the templates (``heads.online.stream_prompts('translation',
32, 1)``; the stream it learns from is the 32 before it, as ``heads online --kind translation --requests 32``'s)."""
LEARNED_HEAD = "@learned"
"""A lesson run's ``head``: the head its ``LessonSpec.learn`` stream taught (``_learned_runs``)."""


def _per_call(trace: RunTrace) -> float:
    calls = sum(s.target_calls for s in trace.steps) + prefill_calls(trace.steps)
    return len(trace.generated_ids) / calls


def _audit_words(audit: dict) -> str:
    first, pairs = audit["first"], audit.get("pairs") or {}
    verdict = "passes" if audit["passed"] else "**fails**"
    return (f"The audit sampled the first two tokens {audit['samples']} times from this prompt and compared them with "
            f"the target's exact law: first token p = {first['p_value']:.3g} (total variation "
            f"{first['tv_distance']:.3f}), first two tokens p = {pairs.get('p_value', float('nan')):.3g}. It "
            f"{verdict} at α = {audit['alpha']}.")


def _code_notes(runs, audit):
    t = runs[0]
    best = max(t.steps, key=lambda s: s.accepted_draft_len)
    return [Note(0, 0, "draft", "The draft model (0.5B) proposes tokens one level at a time, and after each level "
                 "the decision model predicts whether the target (1.5B) will accept them: a chain while it is sure."),
            Note(0, best.index, "commit", f"{best.accepted_draft_len} drafted tokens accepted in one target call "
                 f"({len(best.committed_ids)} committed with the bonus token). Code is predictable: the small model "
                 f"writes what the large one would. Over the run: {_per_call(t):.2f} tokens per target call.")]


def _unsure_notes(runs, audit):
    t, notes = runs[0], []
    wide = next((s for s in t.steps if sum(1 for n in s.nodes if n.depth == 1 and n.source == "draft") >= 2), None)
    if wide is not None:
        notes.append(Note(0, wide.index, "draft", "The draft's top candidate at the root was below 80 %: unsure, it "
                          "proposed a second candidate there (adaptive width). Each becomes a branch of the tree.",
                          level=1))
    stopped = [s for s in t.steps if s.stop_signals and not s.stop_signals[-1].keep_drafting
               and s.stop_signals[-1].level < s.max_draft_len]
    early = min(stopped, key=lambda s: (s.stop_signals[-1].level, s.index)) if stopped else None  # the earliest stop
    if early is not None:
        sig = early.stop_signals[-1]
        notes.append(Note(0, early.index, "draft", f"The decision model's score fell to {sig.score:.2f}, below τ "
                          f"{sig.threshold:.2f}: drafting stops after {sig.level} level(s) instead of "
                          f"{early.max_draft_len}. Drafting on would cost draft forwards the target would likely "
                          "throw away.", level=sig.level))
    notes.append(Note(0, len(t.steps) - 1, "commit", f"Over the run: {_per_call(t):.2f} tokens per target call, "
                      "fewer than on code: open-ended prose is harder to guess."))
    return notes


def _sampling_notes(runs, audit):
    t, notes = runs[0], []
    for s in t.steps:
        node = next((n for n in s.nodes if n.status == REJECTED and n.residual_top), None)
        if node is not None:
            notes.append(Note(0, s.index, "verify", f"{quote_token(node.text)} is rejected: u ≥ p/q. The next test "
                              "(its sibling, or the token that replaces it) draws from the residual "
                              "norm(max(p − q, 0)): what the target wanted and the draft under-proposed. Accept "
                              "with min(1, p/q), correct with the residual: together they give exactly p.",
                              node=node.id))
            break
    if audit:
        notes.append(Note(0, len(t.steps) - 1, "commit", _audit_words(audit)))
    return notes


def _chain_tree_notes(runs, audit):
    sd, tree = runs
    a, b = _per_call(sd), _per_call(tree)
    verdict = ("The tree wins here: where the draft's first guess was wrong, a sibling was often right." if b > a else
               "The chain wins here: the tree is 3 levels deep against the chain's 4, and where the draft's first "
               "guess is right its siblings add nothing.")
    notes = [Note(0, 0, "draft", "Speculative decoding (SD): the draft proposes one chain of 4 tokens. One wrong "
                  "token and everything after it is lost."),
             Note(1, 0, "draft", "MCSD: two candidates at every node, a tree of 14 tokens, all verified in the same "
                  "single target pass: where the first guess is wrong, its sibling may be right."),
             Note(0, len(sd.steps) - 1, "commit", f"SD over the run: {a:.2f} tokens per target call in "
                  f"{len(sd.steps)} steps."),
             Note(1, len(tree.steps) - 1, "commit", f"MCSD over the run: {b:.2f} tokens per target call in "
                  f"{len(tree.steps)} steps, against SD's {a:.2f}. {verdict}")]
    common = next((i for i, (x, y) in enumerate(zip(sd.generated_ids, tree.generated_ids)) if x != y), None)
    if common is not None:
        step, done = 0, 0
        for s in tree.steps:
            if done + len(s.committed_ids) > common:
                step = s.index
                break
            done += len(s.committed_ids)
        notes.append(Note(1, step, "commit", f"Both runs are greedy and lossless, yet the texts part at token "
                          f"{common + 1} ({quote_token(_piece(sd, common))} in the chain, "
                          f"{quote_token(_piece(tree, common))} here). A forward over many rows rounds bf16 "
                          "differently from one over few; where the target's two best tokens are nearly tied, that can "
                          "pick the other one (docs/numerics.md, \"Numerics\"; `python -m explorer probe` shows it "
                          "node by node)."))
    return notes


def _piece(trace: RunTrace, index: int) -> str:
    """The text the token at ``index`` of the run's output added."""
    pieces = [t for s in trace.steps for t in s.committed_text]
    return pieces[index] if index < len(pieces) else ""


def _lookup_notes(runs, audit):
    t, notes = runs[0], []
    copied = [s for s in t.steps if any(n.source == "lookup" and n.committed and n.provenance for n in s.nodes)]
    if copied:
        s = max(copied, key=lambda s: (s.accepted_draft_len, -s.index))  # the longest copy taken
        node = next(n for n in s.nodes if n.source == "lookup" and n.committed and n.provenance)
        prov = node.provenance
        where = "the prompt" if prov.get("in_prompt") else "the text so far"
        notes.append(Note(0, s.index, "draft", f"No draft model: the last {prov.get('ngram', '?')} token(s) "
                          f"{quote_token(str(prov.get('match_text', '')))} occurred earlier in {where}, so the "
                          "tokens that followed there are proposed, for free (copied from position "
                          f"{prov.get('copied_from')})."))
        notes.append(Note(0, s.index, "commit", f"{s.accepted_draft_len} copied tokens accepted in one target "
                          "call: the answer repeats the prompt's code."))
    notes.append(Note(0, len(t.steps) - 1, "commit", f"Over the run: {_per_call(t):.2f} tokens per target call, "
                      "with no draft model at all."))
    return notes


def _lossy_notes(runs, audit):
    t = runs[0]
    notes = [Note(0, 0, "draft", "The mode of Lu et al. 2024: the roots (diamonds) are not drafted but sampled from "
                  "the target's own next-token distribution, three of them, and each gets a draft chain.", level=1),
             Note(0, 0, "commit", "Each branch is verified on its own and the one with the most accepted tokens is "
                  "committed. Choosing a root by how well its continuation went favours roots with easy "
                  "continuations: the output is no longer distributed as the target's. LOSSY.")]
    if audit:
        notes.append(Note(0, len(t.steps) - 1, "commit", _audit_words(audit)))
    return notes


def _head_notes(runs, audit):
    head, model, notes = runs[0], runs[1], []
    first = next((s for s in head.steps if s.drafted), None)
    if first is not None:
        layers = ", ".join(str(i) for i in first.drafter["head"]["target_layers"])
        notes.append(Note(0, first.index, "draft", "No draft model: a head of one decoder layer reads what the "
                          "target computed inside itself for the text so far (the hidden states entering its layers "
                          f"{layers}) with the last token, and guesses the next token; its own output is fed back to "
                          f"guess further. {first.draft_calls} head calls drafted this tree; each costs a few "
                          "milliseconds, a small part of a draft model's forward.", level=1))
    best = max(head.steps, key=lambda s: (s.accepted_draft_len, -s.index))
    notes.append(Note(0, best.index, "commit", f"{best.accepted_draft_len} of the head's tokens accepted in one "
                      "target call: the target's features already say much about the tokens that follow."))
    vocab = set(head.settings.get("head", {}).get("draft_ids", ()))
    outside = next((s for s in head.steps if vocab and s.bonus_token is not None and s.bonus_token not in vocab), None)
    if outside is not None:
        notes.append(Note(0, outside.index, "commit", f"The bonus token {quote_token(outside.committed_text[-1])} is "
                          f"outside the head's draft vocabulary ({len(vocab)} of the target's most frequent tokens): "
                          "the head could never propose it, and the target supplies it as always."))
    notes.append(Note(1, len(model.steps) - 1, "commit", f"The same prompt drafted by the 0.5B draft model: "
                      f"{_per_call(model):.2f} tokens per target call, against {_per_call(head):.2f} for the head. "
                      "A draft model of the target's own family guesses far better than this head, trained on a CPU "
                      "on little data; the head's drafting costs far less per step (the race shows both)."))
    return notes


def _rules_notes(runs, audit):
    """Lesson 08: one context, four verification rules (RSD-C, SpecInfer's, SpecTr's, RSD-S), each run's tokens per
    target call and why."""
    rrs, iid, spectr, beam = runs
    rates = {name: _per_call(t) for name, t in (("RRS without replacement (RSD-C)", rrs),
                                                 ("RRS with replacement", iid), ("SpecTr K-SEQ", spectr),
                                                 ("RSD-S", beam))}
    notes = [Note(0, 0, "draft", "Four candidates at the root, drawn without replacement (four different tokens), "
                  "each continued by a chain: the constant-branching tree RSD-C of Jeon et al. 2024. The verifier "
                  "tests them in draw order, and each rejected one is taken out of q before the next test."),
             Note(1, 0, "draft", "The same tree shape, but the four root candidates are drawn independently (with "
                  "replacement, as SpecInfer draws them): the draft's favourite can come twice, and a repeat of a "
                  "rejected token is rejected again.")]
    dup = next((s for s in iid.steps if len({n.token_id for n in s.nodes if n.depth == 1}) <
                sum(1 for n in s.nodes if n.depth == 1)), None)
    if dup is not None:
        notes.append(Note(1, dup.index, "draft", "Here two of the independent draws are the same token: a slot of "
                          "the tree spent on a candidate already there."))
    tested = next(((s, n) for s in spectr.steps for n in s.nodes if n.parent == 0 and n.u is not None and n.ratio
                   and n.p and n.q), None)
    if tested is not None:
        s, n = tested
        rho = n.p / (n.q * n.ratio)
        notes.append(Note(2, s.index, "verify", f"SpecTr's K-SEQ on the same independent drafts: each is accepted "
                          f"with min(1, p/(ρ q)) where ρ = {rho:.2f} here is the smallest that keeps the output exact "
                          "for four drafts: each test is stricter than speculative decoding's p/q, but four chances "
                          "add up (Sun et al. 2023).", node=n.id))
    notes.append(Note(3, 0, "draft", "RSD-S: a stochastic beam search keeps the 4 likeliest paths at every level "
                      "(by Gumbel keys), so a node can have several children and another none; siblings are verified "
                      "in the order they were drawn, as RSD-C's (Jeon et al. 2024)."))
    ranked = sorted(rates.items(), key=lambda kv: -kv[1])
    notes.append(Note(3, len(beam.steps) - 1, "commit", "Tokens per target call on this prompt, 12 draft nodes each: "
                      + ", ".join(f"{name} {rate:.2f}" for name, rate in ranked) + ". Every rule here is exact "
                      "(the audit checks each); they differ only in how many drafted tokens survive. One prompt at "
                      "temperature 1 is noisy: `spec-explorer verifiers` measures the rules over many."))
    return notes


def _pearl_notes(runs, audit):
    """Lesson 09: PEARL against speculative decoding on one prompt: the modes, a carried block, a discarded one, and
    the time on two lanes against sd's."""
    pearl, sd = runs
    notes = [Note(0, 0, "draft", "PEARL runs the two models side by side. In this first round nothing waits to be "
                  "checked (pre-verify): the target checks only the first new token while the draft drafts the "
                  "whole block.")]
    post = next((s for s in pearl.steps if s.drafter["pearl"]["mode"] == "post"), None)
    if post is not None:
        notes.append(Note(0, post.index, "draft", "Post-verify: the tokens the draft wrote during the last round are "
                          "read by the target now, while the draft already writes the next block. Neither model "
                          "waits for the other.", level=1))
    whole = next((s for s in pearl.steps if s.bonus_token is None and s.drafter["pearl"]["mode"] == "post"), None)
    if whole is not None:
        notes.append(Note(0, whole.index, "commit", "The whole block passed: it is committed without a bonus token "
                          "(the target never read the new token's position), and the next block is already "
                          "drafted: the draft length grows by itself while blocks pass."))
    lost = next((s for s in pearl.steps if len(lanes.discarded(s)) > 1), None)
    if lost is not None:
        notes.append(Note(0, lost.index, "commit", f"A rejection: {len(lanes.discarded(lost))} tokens drafted in "
                          "parallel are thrown away, and the next round starts afresh. That is PEARL's price: work "
                          "done at the same time can be wasted, where speculative decoding's draft waits instead."))
    two, one = lanes.two_lane_seconds(pearl), (sd.prefill_ms + sum(s.step_ms for s in sd.steps)) / 1e3
    why = ("fewer: PEARL has no bonus token on a passed block, and a pre-verify round commits one token"
           if _per_call(pearl) < _per_call(sd) else
           "more: its blocks are longer, though a passed block has no bonus token and a pre-verify round commits one")
    notes.append(Note(1, len(sd.steps) - 1, "commit", f"Tokens per target call: PEARL {_per_call(pearl):.2f}, "
                      f"speculative decoding {_per_call(sd):.2f} ({why}). And a PEARL round lasts as long as the "
                      f"slower lane, not both: on two devices this prompt would take {two:.2f} s against sd's "
                      f"{one:.2f} s here ({one / two:.2f}x), simulated from the forward times this machine "
                      "measured. On a 2-core CPU, two threads of one core each are slower than either on both cores "
                      "(docs/bench.md)."))
    return notes


def _learning_notes(runs, info):
    """Lesson 10: one held-out prompt drafted by the head as shipped, then by the head after it learnt online from a
    stream of prompts of the same kind; the learning's history in numbers."""
    before, after = runs
    history = (info or {}).get("learning") or []
    first = [row["first_acceptance"] for row in history if row.get("first_acceptance") is not None]
    rate = {name: first_acceptance(t.steps)["rate"] for name, t in (("before", before), ("after", after))}
    miss = next((s for s in before.steps if any(n.depth == 1 and n.source == "draft" for n in s.nodes)
                 and not any(n.depth == 1 and n.committed for n in s.nodes if n.source == "draft")), None)
    notes = []
    if miss is not None:
        wanted = "".join(miss.committed_text[:1])
        notes.append(Note(0, miss.index, "commit", f"The head's first guesses here were all rejected; the target "
                          f"wrote {quote_token(wanted)}. Online distillation keeps this position: the target's whole "
                          "distribution there, which verification computed anyway, and the head's own logits that "
                          "made the rejected guesses."))
    updates = sum(1 for row in history if row.get("updated"))
    half = max(1, len(first) // 2)
    curve = (f" Over the stream, first-position acceptance went from {sum(first[:half]) / half:.2f} in its first "
             f"half to {sum(first[half:]) / max(1, len(first) - half):.2f} in its second." if len(first) > 1 else "")
    notes.append(Note(1, len(after.steps) - 1, "commit", f"The same prompt, which the head never learnt from, after "
                      f"it learnt from {len(history)} other prompts of this kind ({updates} updates, one after each "
                      f"prompt, never inside one: every step stays exact). First-position acceptance on this prompt: "
                      f"{rate['before']:.2f} before, {rate['after']:.2f} after; tokens per target call "
                      f"{_per_call(before):.2f} and {_per_call(after):.2f}.{curve} One prompt is noisy: "
                      "`python -m explorer heads online` measures held-out prompts of every kind."))
    return notes


LEARNING_LESSON = LessonSpec(
               "10-head-learns", "A draft that learns from its rejections",
               "Can the head get better at a kind of prompt while it serves, without ever changing the output?",
               LEARNING_PROMPT,
               (("head as shipped", DEFAULTS["eagle"].with_(fallback="off", tree_choice="fixed"), GREEDY),
                ("head after 32 prompts", DEFAULTS["eagle"].with_(head=LEARNED_HEAD, fallback="off",
                                                                   tree_choice="fixed"), GREEDY)),
               _learning_notes, max_new_tokens=48, learn=("translation", 32, 1e-4, 1))
"""Lesson 10: its learned head is not kept (``_mark_learned``), so its second run plays from the file, and the
Classroom's Continue live goes on from its text with the shipped head."""


LESSON_SPECS = (
    LessonSpec("01-code-chains", "Code: long chains accepted",
               "Why does a small draft model save the large one so much work on code?",
               "Write a Python function that checks whether a number is prime.",
               (("mcsd-improved", DEFAULTS["mcsd-improved"], GREEDY),), _code_notes),
    LessonSpec("02-unsure-draft", "An unsure draft: a second candidate, and an early stop",
               "What does the tree do where the draft does not know what comes next?",
               "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
               "experiences and must-see attractions.",
               (("mcsd-improved", DEFAULTS["mcsd-improved"], GREEDY),), _unsure_notes),
    LessonSpec("03-temperature-one", "Sampling at temperature 1: rejection and the residual",
               "How can the output be exactly the target's when the draft proposes the tokens?",
               "Tell me a short story about a robot who learns to paint.",
               (("mcsd 2,2 (RRS)", MethodConfig(method="mcsd", k_config=(2, 2), verifier="rrs"),
                 SamplingConfig(temperature=1.0, seed=1)),), _sampling_notes, max_new_tokens=32, audit_samples=300),
    LessonSpec("04-chain-vs-tree", "A chain against a tree",
               "Does verifying a tree of candidates in one pass beat verifying one chain?",
               "Explain what a hash table is in two sentences.",
               (("sd (chain of 4)", MethodConfig(method="sd", gamma=4), GREEDY),
                ("mcsd 2,2,2 (tree of 14)", MethodConfig(method="mcsd", k_config=(2, 2, 2)), GREEDY)),
               _chain_tree_notes, max_new_tokens=40),
    LessonSpec("05-prompt-lookup", "Prompt lookup: drafting by copying",
               "Can we draft without any draft model?",
               "Rename the variable `out` to `result` in this function and return the whole function:\n\n```python\n"
               "def moving_average(values, window):\n    out = []\n    for i in range(len(values) - window + 1):\n"
               "        out.append(sum(values[i:i + window]) / window)\n    return out\n```",
               (("prompt-lookup", DEFAULTS["prompt-lookup"], GREEDY),), _lookup_notes, max_new_tokens=80),
    LessonSpec("06-lossy-roots", "The target-initialised roots of Lu et al. 2024, and what the audit says",
               "Is the longest-branch rule of Lu et al. 2024 still exact?",
               "Tell me a short story about a robot who learns to paint.",
               (("mcsd-improved --lossy", MethodConfig(method="mcsd-improved", lossy=True, width=3, k_config=(1,),
                                                       max_depth=4, stop="none"),
                 SamplingConfig(temperature=1.0, seed=1)),), _lossy_notes, max_new_tokens=32, audit_samples=600),
    LessonSpec("07-head-features", "Drafting from the target's own features",
               "Can the target draft for itself, with one extra layer reading its hidden states?",
               "Write a Python function that returns the n-th Fibonacci number, with a short docstring.",
               (("eagle (EAGLE-3 head)", DEFAULTS["eagle"], GREEDY),
                ("mcsd-improved (0.5B draft)", DEFAULTS["mcsd-improved"], GREEDY)), _head_notes, max_new_tokens=64),
    LessonSpec("08-which-rule", "Which rule accepts more?",
               "Four ways to decide which drafted tokens survive: which one keeps the most?",
               "Tell me a short story about a robot who learns to paint.",
               tuple((label, MethodConfig(method=method, k_config=(4, 1, 1), verifier=verifier, fallback="off"),
                      SamplingConfig(temperature=1.0, seed=1))
                     for label, method, verifier in (("RRS without replacement (RSD-C)", "mcsd", "rrs"),
                                                     ("RRS with replacement (SpecInfer)", "mcsd", "rrs-replacement"),
                                                     ("SpecTr K-SEQ", "mcsd", "spectr"),
                                                     ("RSD-S (beam 4, depth 3)", "rsd-s", "auto"))),
               _rules_notes, max_new_tokens=24),
    LessonSpec("09-parallel-lanes", "Drafting while the target verifies",
               "What if the draft model never waited for the target, and the target never waited for the draft?",
               "Write a Python function that reverses the order of the words in a sentence.",
               (("PEARL γ 8", DEFAULTS["pearl"].with_(gamma=8), GREEDY),
                ("sd (chain of 4)", MethodConfig(method="sd", gamma=4, fallback="off"), GREEDY)),
               _pearl_notes, max_new_tokens=48),
    LEARNING_LESSON,
)


def _prompt_ids(pair, spec: LessonSpec) -> list[int]:
    """The lesson's prompt as the recorder and the timer feed it: the chat template applied."""
    return encode_prompt(pair.tokenizer, spec.prompt, chat_template=True)


def _recorded(pair, command: str) -> dict:
    """What a lesson file says of the machine a recording or a timing ran on: ``command`` and ``bench.run_facts``."""
    facts = run_facts(pair)
    return {"command": command, **{k: facts[k] for k in ("machine", "date", "commit", "dtype", "device",
                                                          "draft_quant", "torch", "transformers", "threads")}}


def _selected(only: list[str] | None) -> list[LessonSpec]:
    """The specs named in ``only`` (all for None). Raises ValueError for an unknown lesson id."""
    unknown = set(only or ()) - {s.id for s in LESSON_SPECS}
    if unknown:
        raise ValueError(f"unknown lesson(s) {', '.join(sorted(unknown))}; the lessons are "
                         f"{', '.join(s.id for s in LESSON_SPECS)}")
    return [s for s in LESSON_SPECS if not only or s.id in only]


def _runner(pair, spec: LessonSpec, ids: list[int], graphs: bool = False):
    """A function running one of ``spec``'s settings on ``pair`` from the prompt ``ids`` to the end:
    ``run(config, sampling) -> RunTrace``
    (with ``graphs``: a static KV cache and CUDA graphs, as ``bench --graphs`` runs: every graph captured before the
    first step and the runners given back to the pair after the run, so a later run of the same size captures
    nothing; a GPU run that skipped both paid 50-60 ms captures inside its steps)."""
    def run(config, sampling):
        engine = build_engine(pair, config, sampling, kv_cache="static" if graphs else "dynamic", graphs=graphs)
        engine.start(ids, spec.max_new_tokens, prompt_text=spec.prompt)
        try:
            engine.capture_graphs()  # every bucket before the first step: no step pays a capture (CPU: nothing)
            return engine.run()
        finally:
            engine.release()  # the graph runners, captured, serve the next run of the pair

    return run


def _learned_runs(pair, spec: LessonSpec, folder: str, progress=print, stream=None) -> tuple[tuple, list[dict]]:
    """``spec.runs`` with ``LEARNED_HEAD`` replaced by a head learnt online on ``spec.learn``'s stream (saved in
    ``folder``), starting from the head of the runs' other head run (the shipped one by default), and that
    learning's history; the runs unchanged and no history without ``learn``. ``stream(kind,
    n)``: n prompts of a kind to learn from (the command line's, ``heads.online.stream_prompts``). Raises ValueError
    for a lesson that learns without one."""
    if spec.learn is None:
        return spec.runs, []
    if stream is None:
        raise ValueError(f"lesson {spec.id} learns on a stream of prompts: give record/time a stream")
    kind, requests, lr, every = spec.learn
    start = next((c.head for _, c, _ in spec.runs if c.spec.uses_head and c.head != LEARNED_HEAD), "")
    config = DEFAULTS["eagle"].with_(head=start, fallback="off", tree_choice="fixed", online_distill=True,
                                     distill_lr=lr, distill_every=every)
    told = lambda n, engine, trace: progress(  # noqa: E731 - one line
        f"[{spec.id}] learning on {kind} prompt {n}/{requests}: head version {engine.parts.distiller.version}")
    distiller = learn_stream(pair, stream(kind, requests), config, GREEDY, spec.max_new_tokens, progress=told)
    distiller.save(folder)
    runs = tuple((label, c.with_(head=folder) if c.head == LEARNED_HEAD else c, sampling)
                 for label, c, sampling in spec.runs)
    return runs, distiller.history


def _mark_learned(spec: LessonSpec, traces: list, learning: list[dict]) -> None:
    """Say in each trace of ``spec``'s runs drafted by the head it learnt (``LEARNED_HEAD``) what taught it, in place
    of the temporary folder it was read from: ``settings["head"]["learned"]`` = the stream (kind, requests, lr,
    every) and the head's version, and the method's head the one the stream started from, which a replay refuses
    and a live continuation drafts with (``instruments/replay.py``)."""
    if spec.learn is None:
        return
    kind, requests, lr, every = spec.learn
    start = next((c.head for _, c, _ in spec.runs if c.spec.uses_head and c.head != LEARNED_HEAD), "")
    version = sum(1 for row in learning if row.get("updated"))
    for (_, config, _), trace in zip(spec.runs, traces):
        if config.head == LEARNED_HEAD:
            trace.settings["method"]["head"] = start
            head = {k: v for k, v in (trace.settings.get("head") or {}).items() if k != "path"}
            trace.settings["head"] = head | {"learned": {"kind": kind, "requests": requests, "lr": lr,
                                                         "every": every, "version": version}}


def record_lesson(pair, spec: LessonSpec, progress=print, stream=None) -> Lesson:
    """Run ``spec`` on ``pair`` and return the lesson (its runs, the ``ar`` baseline of the race, notes, audit);
    ``stream``: as ``_learned_runs``'s."""
    ids = _prompt_ids(pair, spec)
    run = _runner(pair, spec, ids)
    with tempfile.TemporaryDirectory() as folder:
        runs, learning = _learned_runs(pair, spec, folder, progress, stream)
        traces = []
        for label, config, sampling in runs:
            progress(f"[{spec.id}] {label}")
            traces.append(run(config, sampling))
    _mark_learned(spec, traces, learning)
    progress(f"[{spec.id}] ar (the race's baseline)")
    baseline = run(DEFAULTS["ar"], spec.runs[0][2])
    result = None
    if spec.audit_samples:
        label, config, sampling = spec.runs[spec.audit_run]
        progress(f"[{spec.id}] audit of {label}, {spec.audit_samples} samples")
        result = audit(pair, config, sampling, ids, spec.audit_samples).to_dict()
        result = {k: result[k] for k in ("samples", "alpha", "passed", "verifier")} | {
            "first": {k: result["first"][k] for k in ("p_value", "tv_distance", "dof")},
            "pairs": {k: result["pairs"][k] for k in ("p_value", "tv_distance", "dof")} if result["pairs"] else None}
    recorded = _recorded(pair, f"python -m explorer lessons record --only {spec.id}")
    lesson = Lesson(spec.id, spec.title, spec.question, [LessonRun(label, t) for (label, _, _), t in
                                                         zip(spec.runs, traces)],
                    spec.notes(traces, {"learning": learning} if spec.learn else result), recorded, result, baseline)
    return Lesson.from_dict(lesson.to_dict())  # the file's own checks, before it is written


def record_lessons(pair, out: Path = LESSONS_DIR, only: list[str] | None = None, progress=print,
                   stream=None) -> list[Path]:
    """Record every lesson of ``LESSON_SPECS`` (or those named in ``only``) into ``out``; returns the files.
    ``stream``: as ``_learned_runs``'s."""
    specs = _selected(only)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        lesson = record_lesson(pair, spec, progress, stream)
        path = out / f"{spec.id}.json"
        path.write_text(lesson.to_json(), encoding="utf-8")
        progress(f"[{spec.id}] wrote {path} ({path.stat().st_size / 1e3:.0f} kB), "
                 f"{datetime.datetime.now(datetime.UTC):%H:%M:%S} UTC")
        paths.append(path)
    return paths


def time_lesson(pair, spec: LessonSpec, graphs: bool = False, progress=print, stream=None) -> MachineTimings:
    """``spec``'s runs and its ``ar`` baseline timed on ``pair``'s machine, for the race on that machine. Each
    setting runs once untimed first (on a GPU that captures its CUDA graphs, which a timed run must not count)."""
    run = _runner(pair, spec, _prompt_ids(pair, spec), graphs)
    traces = []
    with tempfile.TemporaryDirectory() as folder:
        runs, learning = _learned_runs(pair, spec, folder, progress, stream)
        for label, config, sampling in [*runs, ("ar (the race's baseline)", DEFAULTS["ar"], spec.runs[0][2])]:
            progress(f"[{spec.id}] {label}: warm-up, then timed")
            run(config, sampling)
            traces.append(run(config, sampling))
    _mark_learned(spec, traces, learning)
    command = f"python -m explorer lessons time --only {spec.id}" + (" --graphs" if graphs else "")
    return MachineTimings(_recorded(pair, command) | {"graphs": graphs}, traces[:-1], traces[-1])


def time_lessons(pair, folder: Path = LESSONS_DIR, only: list[str] | None = None, graphs: bool = False,
                 progress=print, stream=None) -> list[Path]:
    """Time every lesson of ``LESSON_SPECS`` (or those in ``only``) on ``pair``'s machine and write the timings
    into the lesson files in ``folder`` (replacing an earlier timing of the same machine); returns the files.
    ``stream``: as ``_learned_runs``'s.

    Raises:
        ValueError: an unknown lesson id.
        LessonError: a lesson file is missing or unreadable (record it first: ``lessons record``).
    """
    paths = []
    for spec in _selected(only):
        path = Path(folder) / f"{spec.id}.json"
        lesson = load_lesson(path).with_timings(time_lesson(pair, spec, graphs, progress, stream))
        path.write_text(Lesson.from_dict(lesson.to_dict()).to_json(), encoding="utf-8")
        progress(f"[{spec.id}] timings for {lesson.timings[-1].machine} written to {path}")
        paths.append(path)
    return paths


__all__ = ["LESSON_SPECS", "LessonSpec", "record_lesson", "record_lessons", "time_lesson", "time_lessons"]
