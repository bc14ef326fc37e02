"""Every page's session state, declared in one place: each key once, with its type, default and meaning.

Why: Streamlit's ``st.session_state`` is one flat dict per browser session that every page and panel shares. With
bare string keys nothing said which page a key belongs to, what it holds or where else it is written, and the
Classroom handed a lesson to the Explorer by writing the Explorer's keys itself. Here each page has a group (a
class of ``Key`` constants); the pages and panels read and write their state only through these keys, write only
their own group's, and the few places where one part gives another its state are functions of this module, each
saying what it writes (``hand_off_to_explorer``, ``hand_lesson_to_classroom``, ``replay_in_explorer``,
``open_in_explorer``, ``ask_for_tree_run``, ``keep_learned``). This module is the only
one in ``explorer/ui`` and ``app.py`` that touches ``st.session_state`` (``tests/test_ui_state.py`` checks it).

What is declared: every key that code reads or writes through the session state, every widget key bound to such a
key (the widget uses the constant's ``name``), and every widget key of the sidebar and of the pages' prompt boxes,
whose values ``keep_widget_values`` keeps across pages (``kept``). Not declared: keys that only name an element
(buttons, charts, containers, and inputs whose value is read from the widget's return in the same run): Streamlit
keeps those where they are drawn, and no other code reads them.

Groups and who writes them: ``App`` (app.py), ``Sidebar`` (sidebar.py), ``Explorer`` (explorer_page.py and its
panels: panels.py, instruments_panel.py, counterfactual_panel.py, lesson_panel.py), ``Classroom``
(classroom_page.py), ``Compare`` (compare_page.py), ``Forensics`` (forensics_page.py), ``Shared`` (common.py
and this module: the session's engine lock and what its runs learned). The Benchmarks page, the lesson player's
component (lesson_player.py, mounted under ``Classroom.PLAYER``), the page layout (layout.py: CSS, wrapping rows) and
the plugin list (plugin_list.py: the server's plugins, loaded once for every session) keep no session state of their
own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar

import streamlit as st

from ..engine.carried import Carried

if TYPE_CHECKING:
    from ..engine.machine import Engine
    from ..lessons.lesson import Lesson
    from ..trace.records import RunTrace

T = TypeVar("T")

# What the prompt boxes hold on a fresh start, so that the first press of Step drafts a tree.
STARTING_PROMPT = "Write a Python function that checks whether a number is prime."


@dataclass(frozen=True)
class Key(Generic[T]):
    """One session-state key: ``name`` (the string in ``st.session_state``, and the widget's ``key=`` where a widget
    is bound to it), what it holds (``doc``), the value read while it is absent (``default``), whether a widget
    owns it (``widget``: Streamlit writes it while the widget is drawn; code may write it only before the widget is
    drawn, or in a callback), and whether ``keep_widget_values`` keeps it across pages (``kept``)."""

    name: str
    doc: str
    default: T | None = None
    widget: bool = False
    kept: bool = False

    def widget_key(self, within: str = "") -> str:
        """The ``key=`` of the widget bound to this key; ``within``: the caller's prefix, which keeps two sets of the
        same widgets on one page apart (``sidebar.method_widgets(prefix=...)``)."""
        return within + self.name

    def get(self) -> T:
        """The value, or ``default`` while the key is absent."""
        return st.session_state.get(self.name, self.default)

    def set(self, value: T) -> None:
        """Store ``value`` (for a widget's key: before the widget is drawn in this run, or in a callback)."""
        st.session_state[self.name] = value

    def setdefault(self, value: T) -> T:
        """The value; ``value`` is stored first where the key is absent."""
        return st.session_state.setdefault(self.name, value)

    def ensure(self) -> T:
        """The value; ``default`` is stored first where the key is absent (a widget bound to the key starts there)."""
        return st.session_state.setdefault(self.name, self.default)

    def pop(self) -> T:
        """Remove the key and return its value (``default`` where it was absent): a one-shot request or flag."""
        return st.session_state.pop(self.name, self.default)

    def clear(self) -> None:
        """Remove the key (absent again: ``get`` gives ``default``)."""
        st.session_state.pop(self.name, None)

    def present(self) -> bool:
        """Whether the key holds a value (``get`` gives ``default`` otherwise)."""
        return self.name in st.session_state


@dataclass(frozen=True)
class KeyFamily(Generic[T]):
    """Keys made of a ``prefix`` and a suffix (a step index, a method name, ...), one per thing they describe;
    ``kept``: ``keep_widget_values`` keeps every key with this prefix. ``within`` is a caller's own prefix, which
    keeps two sets of the same widgets on one page apart (``sidebar.method_widgets(prefix=...)``)."""

    prefix: str
    doc: str
    widget: bool = False
    kept: bool = False

    def name(self, suffix: Any, within: str = "") -> str:
        """The key of ``suffix`` (also the ``key=`` of its widget)."""
        return f"{within}{self.prefix}{suffix}"

    def get(self, suffix: Any, within: str = "") -> T | None:
        """The value of ``suffix``'s key, None while absent."""
        return st.session_state.get(self.name(suffix, within))

    def set(self, suffix: Any, value: T, within: str = "") -> None:
        """Store ``value`` under ``suffix``'s key."""
        st.session_state[self.name(suffix, within)] = value

    def forget(self) -> None:
        """Remove every key of the family (those with no ``within`` prefix)."""
        for key in [k for k in st.session_state if str(k).startswith(self.prefix)]:
            del st.session_state[key]


class LessonHandOff(TypedDict):
    """What the Classroom's Continue live hands the Explorer (``Explorer.CONTINUE_LESSON``)."""

    trace: RunTrace  # the lesson's run, as recorded
    step: int  # index of the step on screen: the Explorer replays the run through it
    title: str  # the lesson's title, for the Explorer's messages


class App:
    """app.py: the page router (``st.navigation``)."""

    PAGE: Key[str] = Key("page", "the title of the page on screen (Explorer, Classroom, Compare, Forensics, "
                         "Benchmarks), written by app.py on each run")
    GO_TO: Key[str | None] = Key("go_to", "a page another part asks for (its title): app.py switches to it on the "
                                 "next run (written only by the hand-offs below)")


class Sidebar:
    """sidebar.py: the model pair, the method and its shape, sampling, teach mode (one run's settings; the Explorer
    and Compare pages read them). ``kept`` as app.py always kept them; the others come back to their defaults after
    a page without the sidebar (Classroom, Benchmarks)."""

    PAIR_SPEC: Key[str] = Key("pair_spec", "which pair: default (embedded), tiny or custom", widget=True, kept=True)
    DRAFT_PATH: Key[str] = Key("draft_path", "the custom pair's draft (folder, hub id or .gguf)", widget=True,
                               kept=True)
    TARGET_PATH: Key[str] = Key("target_path", "the custom pair's target", widget=True, kept=True)
    DTYPE: Key[str] = Key("dtype", "auto, bf16 or fp32", widget=True, kept=True)
    METHOD: Key[str] = Key("method", "the decoding method (engine.config.METHODS)", widget=True, kept=True)
    GAMMA: Key[int] = Key("gamma", "sd's draft length", widget=True, kept=True)
    LOSSY: Key[bool] = Key("lossy", "mcsd-improved's lossy mode (Lu et al.'s target-initialized roots)", widget=True,
                           kept=True)
    K_CONFIG: KeyFamily[str] = KeyFamily("k_config_", "the tree shape as typed, per method and lossy mode",
                                         widget=True, kept=True)
    TREE_TEMPLATE: Key[str] = Key("tree_template", "mcsd's explicit tree (parent indices), empty for k_config",
                                  widget=True, kept=True)
    BRANCH_THRESHOLD: KeyFamily[float] = KeyFamily("branch_threshold_", "adaptive width, per method", widget=True)
    WIDTH: Key[int] = Key("width", "target roots in lossy mode", widget=True, kept=True)
    MAX_DEPTH: Key[int] = Key("max_depth", "the deepest draft level", widget=True, kept=True)
    STOP: Key[str] = Key("stop", "the stop policy", widget=True, kept=True)
    THRESHOLD: KeyFamily[float] = KeyFamily("threshold_", "the stop policy's threshold, per policy", widget=True,
                                            kept=True)
    COST_RATIO: Key[bool] = Key("cost_ratio", "goodput: measure r on this machine", widget=True)
    TREE_CHOICE: Key[bool] = Key("tree_choice", "mcsd-improved: the root width chosen online", widget=True)
    DECISION_MODEL: Key[str] = Key("decision_model", "what the learned stop model reads", widget=True, kept=True)
    ADAPT: KeyFamily[str] = KeyFamily("adapt_", "online adaptation, per stop policy", widget=True)
    LOOKUP_TOKENS: Key[int] = Key("lk_tokens", "prompt lookup's longest copy", widget=True)
    LOOKUP_BRANCHES: Key[int] = Key("lk_branches", "prompt lookup's matches as branches", widget=True)
    LOOKUP_NGRAM: Key[int] = Key("lk_ngram", "prompt lookup's longest n-gram", widget=True)
    LOOKUP_ALONE: Key[int] = Key("lk_alone", "a hybrid's shortest match copied alone", widget=True)
    RECYCLING_WIDTHS: Key[str] = Key("rc_widths", "Token Recycling's template as typed", widget=True)
    RECYCLING_K: Key[int] = Key("rc_k", "Token Recycling's candidates per token", widget=True)
    RECYCLING_CARRY: Key[bool] = Key("rc_carry", "carry the recycling matrix to the next run", widget=True)
    HEAD_PATH: Key[str] = Key("head_path", "eagle: the head's folder, empty for the shipped one", widget=True,
                              kept=True)
    HEAD_TOPK: Key[int] = Key("head_topk", "eagle: children per expanded node", widget=True)
    HEAD_DEPTH: Key[int] = Key("head_depth", "eagle: most levels drafted", widget=True)
    HEAD_TOKENS: Key[int] = Key("head_tokens", "eagle: most draft tokens verified", widget=True)
    HEAD_ONLINE: Key[bool] = Key("head_online", "eagle: levels drafted and nodes verified, chosen online",
                                 widget=True)
    HEAD_DISTILL: Key[bool] = Key("head_distill", "eagle, or a draft model's LoRA adapter: learns online between "
                                  "prompts (OSD)",
                                  widget=True)
    DISTILL_EVERY: Key[int] = Key("distill_every", "eagle, online distillation: prompts between updates",
                                  widget=True)
    DISTILL_LR: Key[float] = Key("distill_lr", "eagle, online distillation: learning rate", widget=True)
    DISTILL_REPLAY: Key[int] = Key("distill_replay", "eagle, online distillation: earlier prompts each update "
                                   "learns from again", widget=True)
    FREE_ROWS: Key[int] = Key("free_rows", "free branches' most target rows (0 = auto)", widget=True)
    FALLBACK: Key[str] = Key("fallback", "the goodput fallback to plain decoding", widget=True)
    VERIFIER: Key[str] = Key("verifier", "the verification rule", widget=True, kept=True)
    TEMPERATURE: Key[float] = Key("temperature", "sampling temperature (0 = greedy)", widget=True, kept=True)
    TOP_K: Key[int] = Key("top_k", "top-k (0 = off)", widget=True, kept=True)
    TOP_P: Key[float] = Key("top_p", "top-p", widget=True, kept=True)
    SEED: Key[int] = Key("seed", "the sampling seed", widget=True, kept=True)
    MAX_NEW: Key[int] = Key("max_new", "max new tokens", widget=True, kept=True)
    TEACH: Key[bool] = Key("teach", "teach mode: large type and a plain account of each step", widget=True,
                           kept=True)


class Explorer:
    """explorer_page.py and its panels: one live or replayed run, its steps, its instruments' requests and results
    (a panel's button only sets a request; the page does the work with the models on the next run)."""

    EXAMPLE: Key[str] = Key("example", "the example prompt picked (fills the prompt box)", widget=True, kept=True)
    PROMPT_TEXT: Key[str] = Key("prompt_text", "the prompt box", STARTING_PROMPT, widget=True, kept=True)
    CHAT: Key[bool] = Key("chat", "apply the chat template", True, widget=True, kept=True)
    ENGINE: Key[Engine | None] = Key("engine", "the live Engine; None or absent: no run yet, or replaying a file")
    TRACE: Key[RunTrace | None] = Key("trace", "the RunTrace on screen: engine.trace while live, the loaded file "
                                      "while replaying")
    CURSOR: Key[int | None] = Key("cursor", "index of the step on screen; None follows the latest step")
    STEP_SLIDER: Key[int] = Key("step_slider", "the Go to step slider (1-based), kept in line with cursor",
                                widget=True)
    REPLAY: Key[str | None] = Key("replay", "name of the replayed trace file; None: live")
    LOADED_FILE: Key[str | None] = Key("loaded_file", "file id of the last trace uploaded (each file loads once)")
    PENDING: Key[str | None] = Key("pending", "\"step\" or \"run\": asked by a button's callback, done in the "
                                   "script body (which can show progress and a Stop button)")
    RUNNING: Key[bool] = Key("running", "Run to end is stepping; still set on the next run = it was interrupted",
                             False)
    STOPPED: Key[bool] = Key("stopped", "the last Run to end was interrupted by a click", False)
    RUN_SETTINGS: Key[dict | None] = Key("run_settings", "the settings and prompt the live run started with (a "
                                         "change is pointed out)")
    RUNS: Key[list | None] = Key("runs", "the session's runs once a what-if edit went on as a new run: [{\"name\", "
                                 "\"engine\", \"trace\"}]; the one on screen is also in engine / trace")
    RUN_INDEX: Key[int | None] = Key("run_index", "index into runs of the run on screen")
    RUN_CHOICE: Key[int] = Key("run_choice", "the run selector (an index into runs)", widget=True)
    ERROR: Key[str | None] = Key("error", "the message of the last failed action, shown on the page")
    CONTINUED: Key[str | None] = Key("continued", "what Continue live did with the Classroom's lesson (shown while "
                                     "its run is live)")
    CONTINUE_LESSON: Key[LessonHandOff | None] = Key("continue_lesson", "a lesson handed over by the Classroom, "
                                                     "taken on the next run (written only by hand_off_to_explorer)")
    INSTRUMENT_RESET: Key[str | None] = Key("instrument_reset", "\"run\": start a new run at once (written only by "
                                            "ask_for_tree_run)")
    PROBE_REQUEST: Key[int | None] = Key("probe_request", "index of the step the tree-attention probe should probe")
    PROBES: Key[dict | None] = Key("probes", "probe results: {\"trace\": the run they belong to, step index: plain "
                                   "data}")
    COSTS_REQUEST: Key[bool] = Key("costs_request", "measure forward costs on the next run", False)
    FORWARD_COSTS: Key[dict | None] = Key("forward_costs", "the measured forward costs: {\"pair\": its name, "
                                          "\"costs\"}")
    PROBE_ERROR: Key[str | None] = Key("probe_error", "the message of a failed instrument request")
    CF_REQUEST: Key[dict | None] = Key("cf_request", "a what-if re-verification: {\"step\", \"edits\", "
                                       "\"continue\"}")
    CF_BRANCH: Key[int | None] = Key("cf_branch", "index of the step whose what-if edit goes on as a new run")
    COUNTERFACTUALS: Key[dict | None] = Key("counterfactuals", "what-if results: {\"trace\", step index: plain data "
                                            "and its \"engine\"}")
    RUN_FIGURES: Key[dict | None] = Key("run_figures", "figures of the whole run on screen, which do not change with "
                                        "the step shown, built once per length of the run: {\"trace\", \"steps\", "
                                        "name: figure} (instruments_panel.of_the_run)")
    STEP_FIGURES: Key[dict | None] = Key("step_figures", "figures of single steps of the run on screen (a recorded "
                                         "step does not change), for the steps drawn last: {\"trace\", \"steps\": "
                                         "{step index: {name: figure}}} (instruments_panel.of_the_step)")
    AUDIT: Key[dict | None] = Key("audit", "the last losslessness audit's result (plain data)")
    RULES: Key[dict | None] = Key("rules", "the last rule comparison: {\"rows\": analysis.rules.compare_rules rows, "
                                           "\"tokens\", \"temperature\"}")
    INSPECT: KeyFamily[int] = KeyFamily("inspect_", "per step index: the node inspected (the tree's last click)")
    TREE_CHART: KeyFamily[Any] = KeyFamily("tree_chart_", "per step index: the tree chart's selection event",
                                           widget=True)


class Classroom:
    """classroom_page.py: the lesson on screen (where in it the class is lives in the browser: the player)."""

    LESSON: Key[str | None] = Key("cls_lesson", "the lesson's key (a shipped lesson's id, or file:<id>)",
                                  widget=True)
    PLAYER: Key[Any] = Key("cls_player", "the embedded lesson player's component value (ui/lesson_player.py); in its "
                           "Continue live callback, the run and step the player showed", widget=True)
    UPLOADED: Key[Lesson | None] = Key("cls_uploaded", "a lesson opened from a file")
    FILE: Key[str | None] = Key("cls_file", "file id of the last lesson uploaded (each file loads once)")
    ERROR: Key[str | None] = Key("cls_error", "why the last lesson file could not be opened")


class Compare:
    """compare_page.py: two runs side by side, A on the sidebar's settings, B on its own widgets."""

    PROMPT: Key[str] = Key("cmp_prompt", "the prompt box", STARTING_PROMPT, widget=True, kept=True)
    CHAT: Key[bool] = Key("cmp_chat", "apply the chat template", True, widget=True, kept=True)
    B_METHOD: Key[str] = Key("b_method", "run B's method", widget=True, kept=True)
    B_WIDGETS: KeyFamily[Any] = KeyFamily("b_", "run B's method widgets: the sidebar's keys behind this prefix "
                                          "(sidebar.method_widgets(prefix=\"b_\"))", widget=True, kept=True)
    ENGINES: Key[list | None] = Key("cmp_engines", "the two live engines [A, B]; None: no run yet")
    ERROR: Key[str | None] = Key("cmp_error", "the message of the last failed action")


class Forensics:
    """forensics_page.py: the last report over a prompt set or uploaded traces."""

    TRACES: Key[dict] = Key("fo_traces_kept", "the runs the report's costliest rejections come from, by name (to "
                                              "open one in the Explorer)", {})
    RESULT: Key[dict | None] = Key("fo_result", "the report (analysis.forensics.Forensics.to_dict) of the last batch "
                                                "or traces read; a stopped batch's holds the prompts done")
    SKIPPED: Key[list] = Key("fo_skipped", "the uploaded trace files that could not be read and the prompts the "
                                          "engine refused, with the reason", [])
    BASELINE: Key[dict | None] = Key("fo_baseline", "report A of the comparison ('Keep as A', or an uploaded "
                                                    "forensics.json): the page diffs the current report against it")
    ERROR: Key[str | None] = Key("fo_error", "the message of the last failed action")


class Shared:
    """common.py and this module: what the session's pages share."""

    ENGINE_LOCK: Key[threading.Lock | None] = Key("engine_lock", "one lock per browser session around engine steps "
                                                  "(engine_lock())")
    CARRIED: Key[Carried | None] = Key("carried", "what the session's runs learned for the next one (the recycling "
                                       "matrix, the fallback's rates, the online adaptation: engine/carried.py)")
    DISTILLER: Key[tuple | None] = Key("distiller", "the session's head or draft adapter learning online (OSD): "
                                       "(pair name, online_distill.HeadDistiller or online_distill_draft."
                                       "DraftDistiller); reset drops it")


GROUPS: tuple[type, ...] = (App, Sidebar, Explorer, Classroom, Compare, Forensics, Shared)


def declared(group: type) -> dict[str, Key | KeyFamily]:
    """A group's keys and key families by attribute name."""
    return {k: v for k, v in vars(group).items() if isinstance(v, (Key, KeyFamily))}


def engine_lock() -> threading.Lock:
    """One lock per browser session around engine steps. Streamlit's fast reruns start the next script run while an
    interrupted one may still be inside ``engine.step()``; the lock keeps two steps apart, whichever page (Explorer,
    Compare) started them."""
    return Shared.ENGINE_LOCK.setdefault(threading.Lock())


def keep_learned(engine: Engine) -> None:
    """Keep what ``engine``'s run learned (the recycling matrix, the fallback's rates, the online adaptation) for
    the session's next run: ``common.make_engine`` starts from it where the method and pair match."""
    Shared.CARRIED.set((Shared.CARRIED.get() or Carried()).updated(engine.carried()))


def learned_head_history() -> list[dict] | None:
    """The session's head (or draft adapter) learning online: its history by request (``history``), or None."""
    held = Shared.DISTILLER.get()
    return held[1].history if held else None


def forget_learned_head() -> None:
    """Drop the session's learning head or adapter: the next run starts from the head or draft as loaded."""
    Shared.DISTILLER.set(None)


def hand_off_to_explorer(trace: RunTrace, step: int, title: str) -> None:
    """The Classroom's Continue live: the only place where one page writes another's state. Call it from a widget
    callback (it sets widget keys). Hands over exactly:

    * ``Explorer.CONTINUE_LESSON`` = ``{"trace", "step", "title"}``: the Explorer loads the pair, replays ``trace``
      through ``step`` and goes on live from there;
    * ``Explorer.PROMPT_TEXT`` = ``trace.prompt`` and ``Explorer.CHAT`` = True: the prompt box shows the lesson's
      prompt (a lesson's runs apply the chat template), so the run's settings match what is on screen;
    * ``Sidebar.PAIR_SPEC`` = ``"default"`` and ``Sidebar.DTYPE`` = the recorded dtype as the sidebar names it
      (``bfloat16`` -> bf16, ``float32`` -> fp32, else auto): the embedded pair the lessons were recorded on;
    * ``App.GO_TO`` = ``"Explorer"``: app.py opens the Explorer page.
    """
    dtype = str(trace.model.get("dtype", "auto"))
    Explorer.CONTINUE_LESSON.set(LessonHandOff(trace=trace, step=step, title=title))
    Explorer.PROMPT_TEXT.set(trace.prompt)
    Explorer.CHAT.set(True)
    Sidebar.PAIR_SPEC.set("default")
    Sidebar.DTYPE.set({"bfloat16": "bf16", "float32": "fp32"}.get(dtype, "auto"))
    App.GO_TO.set("Explorer")


def replay_in_explorer(trace: RunTrace, name: str, step: int = 0) -> None:
    """The Explorer replays ``trace`` with no model, from ``step`` (its Load trace, and the other pages' "open in
    the Explorer"); the live session's runs end with it. Writes ``Explorer.ENGINE`` = None, ``Explorer.TRACE`` =
    ``trace``, ``Explorer.CURSOR`` = ``step`` (None for a trace with no step), ``Explorer.REPLAY`` = ``name``,
    ``Explorer.STEP_SLIDER`` = ``step + 1``, and clears ``Explorer.RUNS``, ``Explorer.RUN_INDEX``,
    ``Explorer.COUNTERFACTUALS``, ``Explorer.PROBES`` and the node selections (``Explorer.INSPECT``,
    ``Explorer.TREE_CHART``)."""
    Explorer.INSPECT.forget()
    Explorer.TREE_CHART.forget()
    for key in (Explorer.RUNS, Explorer.RUN_INDEX, Explorer.COUNTERFACTUALS, Explorer.PROBES):
        key.clear()
    step = max(0, min(step, len(trace.steps) - 1))
    Explorer.ENGINE.set(None)
    Explorer.TRACE.set(trace)
    Explorer.CURSOR.set(step if trace.steps else None)
    Explorer.REPLAY.set(name)
    Explorer.STEP_SLIDER.set(step + 1)


def open_in_explorer(trace: RunTrace, name: str, step: int) -> None:
    """Another page's "open in the Explorer" (a button callback): ``replay_in_explorer`` at ``step``, then writes
    ``App.GO_TO`` = ``"Explorer"`` (app.py opens the Explorer page)."""
    replay_in_explorer(trace, name, step)
    App.GO_TO.set("Explorer")


def hand_lesson_to_classroom(lesson: Lesson) -> None:
    """The Explorer's Save as lesson, "Open in the Classroom" (a button callback): the Classroom opens ``lesson`` as
    a lesson opened from a file. Writes ``Classroom.UPLOADED`` = ``lesson``, ``Classroom.LESSON`` = ``"file:" +
    lesson.id``, ``Classroom.ERROR`` = None and ``App.GO_TO`` = ``"Classroom"`` (app.py opens the Classroom
    page)."""
    Classroom.UPLOADED.set(lesson)
    Classroom.LESSON.set("file:" + lesson.id)
    Classroom.ERROR.set(None)
    App.GO_TO.set("Classroom")


def ask_for_tree_run(parents: list[int]) -> None:
    """The optimal-tree panel's "Run mcsd with this tree" (a button callback): sets the sidebar's ``Sidebar.METHOD``
    to mcsd and its ``Sidebar.TREE_TEMPLATE`` to ``parents``, and asks the Explorer for a new run at once
    (``Explorer.INSTRUMENT_RESET``)."""
    Sidebar.METHOD.set("mcsd")
    Sidebar.TREE_TEMPLATE.set(",".join(map(str, parents)))
    Explorer.INSTRUMENT_RESET.set("run")


def kept_names() -> tuple[frozenset[str], tuple[str, ...]]:
    """The keys and key prefixes ``keep_widget_values`` keeps."""
    keys = [k for g in GROUPS for k in declared(g).values() if k.kept]
    return (frozenset(k.name for k in keys if isinstance(k, Key)),
            tuple(k.prefix for k in keys if isinstance(k, KeyFamily)))


def keep_widget_values() -> None:
    """Streamlit forgets the value of a widget that a run does not draw (another page): writing each kept value back
    at the top of the run keeps prompts and settings across page changes."""
    names, prefixes = kept_names()
    for key in list(st.session_state):
        if key in names or str(key).startswith(prefixes):
            st.session_state[key] = st.session_state[key]
