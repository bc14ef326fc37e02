"""The UI's session state has a schema (explorer/ui/state.py): every key declared once with its default and meaning,
only state.py touches ``st.session_state``, no page writes another page's keys, and the Classroom hands a lesson to
the Explorer through one function that says what it hands over. The checks read the source (AST), so a page that
goes back to bare string keys, or writes a key of another page, fails here before it misbehaves in a browser."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from explorer.ui import state
from explorer.ui.state import GROUPS, Key, KeyFamily, declared

ROOT = Path(__file__).resolve().parent.parent
UI = ROOT / "explorer" / "ui"
GROUP_NAMES = {g.__name__ for g in GROUPS}
# Which groups each module may write (state.py's docstring); a new module under explorer/ui must be placed here.
OWNERS = {"app.py": {"App"}, "sidebar.py": {"Sidebar"}, "explorer_page.py": {"Explorer"}, "panels.py": {"Explorer"},
          "instruments_panel.py": {"Explorer"}, "counterfactual_panel.py": {"Explorer"},
          "lesson_panel.py": {"Explorer"},
          "classroom_page.py": {"Classroom"}, "compare_page.py": {"Compare"}, "forensics_page.py": {"Forensics"},
          "bench_page.py": set(),
          "common.py": {"Shared"}, "lesson_player.py": set(), "layout.py": set(), "plugin_list.py": set(),
          "__init__.py": set()}
# The functions of state.py that write another part's keys, each on its docstring's word; the rest write Shared only.
CROSSINGS = {"hand_off_to_explorer": {"Explorer", "Sidebar", "App"}, "ask_for_tree_run": {"Sidebar", "Explorer"},
             "hand_lesson_to_classroom": {"Classroom", "App"}, "replay_in_explorer": {"Explorer"},
             "open_in_explorer": {"App"}}
READS = {"get", "present", "default", "doc"}  # what a module may do with another group's key
STATE_CALLS = {"get", "pop", "setdefault"}


def _modules() -> dict[str, Path]:
    """app.py and every module of explorer/ui except state.py."""
    paths = [ROOT / "app.py"] + sorted(p for p in UI.glob("*.py") if p.name != "state.py")
    return {p.name: p for p in paths}


def _names() -> tuple[set[str], tuple[str, ...]]:
    keys = [k for g in GROUPS for k in declared(g).values()]
    return {k.name for k in keys if isinstance(k, Key)}, tuple(k.prefix for k in keys if isinstance(k, KeyFamily))


def session_state_uses(source: str) -> list[int]:
    """Lines that touch ``session_state`` at all."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if (isinstance(n, ast.Attribute) and n.attr == "session_state")
            or (isinstance(n, ast.Name) and n.id == "session_state")]


def literal_state_keys(source: str) -> list[str]:
    """String keys used on ``session_state`` directly: ``[...]``, ``.get/.pop/.setdefault(...)``, ``.update(k=)``."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute) and n.value.attr == "session_state":
            if isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
                out.append(n.slice.value)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "session_state"):
            if n.func.attr in STATE_CALLS and n.args and isinstance(n.args[0], ast.Constant):
                out.append(n.args[0].value)
            if n.func.attr == "update":
                out += [k.arg for k in n.keywords if k.arg]
    return out


def literal_widget_keys(source: str) -> list[str]:
    """``key=`` literals (or f-strings) that spell a declared key or a declared family's prefix: they must use the
    schema's constant instead."""
    names, prefixes = _names()
    out = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.keyword) or n.arg != "key":
            continue
        v = n.value
        if isinstance(v, ast.JoinedStr) and v.values and isinstance(v.values[0], ast.Constant):
            v = v.values[0]
            if str(v.value).startswith(prefixes):
                out.append(v.value)
        elif isinstance(v, ast.Constant) and isinstance(v.value, str) and (
                v.value in names or v.value.startswith(prefixes)):
            out.append(v.value)
    return out


def group_refs(source: str) -> list[tuple[str, str, str | None, int]]:
    """Every ``Group.KEY`` reference (module-level aliases ``X = Group.KEY`` followed): ``(group, key, what is done
    with it: the attribute taken from it, or None, line)``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    aliases, alias_values = {}, set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                and node.value.value.id in GROUP_NAMES):
            aliases[node.targets[0].id] = (node.value.value.id, node.value.attr)
            alias_values.add(node.value)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in GROUP_NAMES:
            if n in alias_values:
                continue
            group, key = n.value.id, n.attr
        elif isinstance(n, ast.Name) and n.id in aliases and isinstance(n.ctx, ast.Load):
            group, key = aliases[n.id]
        else:
            continue
        parent = parents.get(n)
        use = parent.attr if isinstance(parent, ast.Attribute) and parent.value is n else None
        out.append((group, key, use, n.lineno))
    return out


def foreign_writes(source: str, owners: set[str]) -> list[tuple[str, str, str | None, int]]:
    """References to another group's key that are not reads (a write, a ``key=`` of a widget, a key handed to a
    function that writes it)."""
    return sorted((r for r in group_refs(source) if r[0] not in owners and r[2] not in READS), key=lambda r: r[3])


def test_the_checks_catch_what_they_are_for():
    bad = ('import streamlit as st\n'
           'from explorer.ui.state import App, Explorer\n'
           'st.session_state["nope"] = 1\n'
           'st.session_state.update(cursor=None)\n'
           'Explorer.CURSOR.set(0)\n'
           'ERR = Explorer.ERROR\n'
           'set_error("x", ERR)\n'
           'st.slider("s", key=Explorer.STEP_SLIDER.name)\n'
           'st.text_area("p", key="prompt_text")\n'
           'st.plotly_chart(f, key=f"tree_chart_{i}")\n'
           'if App.PAGE.get() == "Classroom": pass\n')
    assert session_state_uses(bad) == [3, 4]
    assert literal_state_keys(bad) == ["nope", "cursor"]
    assert literal_widget_keys(bad) == ["prompt_text", "tree_chart_"]
    assert [(g, k, line) for g, k, _, line in foreign_writes(bad, {"Classroom"})] == [
        ("Explorer", "CURSOR", 5), ("Explorer", "ERROR", 7), ("Explorer", "STEP_SLIDER", 8)]
    assert foreign_writes(bad, {"Explorer"}) == []


def test_every_module_is_placed_and_touches_the_session_only_through_state():
    assert set(_modules()) <= set(OWNERS), "place the new module in OWNERS (and in state.py's docstring)"
    for name, path in _modules().items():
        source = path.read_text()
        assert not session_state_uses(source), f"{name} touches st.session_state at lines " \
                                               f"{session_state_uses(source)}: go through explorer/ui/state.py"
        assert not literal_widget_keys(source), f"{name} spells declared keys: {literal_widget_keys(source)}"


def test_state_itself_uses_only_declared_keys():
    names, _ = _names()
    used = literal_state_keys((UI / "state.py").read_text())
    assert set(used) <= names, f"undeclared session-state keys in state.py: {set(used) - names}"


def test_every_key_is_declared_once_with_its_meaning():
    seen: dict[str, str] = {}
    for group in GROUPS:
        assert group.__doc__, group.__name__
        for attr, key in declared(group).items():
            label = f"{group.__name__}.{attr}"
            assert key.doc.strip(), f"{label} says nothing about what it holds"
            name = key.name if isinstance(key, Key) else key.prefix
            assert name not in seen, f"{label} and {seen.get(name)} are both {name!r}"
            seen[name] = label
    _, prefixes = _names()
    for group in GROUPS:  # a key inside a family's prefix belongs to the family's group (b_method in b_)
        families = {k.prefix for k in declared(group).values() if isinstance(k, KeyFamily)}
        for key in declared(group).values():
            if isinstance(key, Key) and key.name.startswith(prefixes):
                assert key.name.startswith(tuple(families)), f"{key.name} lies in another group's family"


def test_every_reference_names_a_declared_key():
    for name, path in [*_modules().items(), ("state.py", UI / "state.py")]:
        for group, key, _, line in group_refs(path.read_text()):
            if key in ("__name__", "__doc__"):
                continue
            assert key in declared(getattr(state, group)), f"{name}:{line}: {group}.{key} is not declared"


def test_no_page_writes_another_pages_keys():
    for name, path in _modules().items():
        found = foreign_writes(path.read_text(), OWNERS[name])
        assert not found, f"{name} writes keys it does not own: {found}"


def test_only_the_named_crossings_of_state_write_another_parts_keys():
    tree = ast.parse((UI / "state.py").read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for fname in CROSSINGS:
        assert fname in functions, fname
    for fname, fn in functions.items():
        written = [(g, k) for g, k, use, _ in group_refs(ast.unparse(fn)) if use not in READS]
        allowed = CROSSINGS.get(fname, {"Shared"})
        assert {g for g, _ in written} <= allowed, f"{fname} writes {written}"
        if fname in CROSSINGS:  # and its docstring says exactly what it writes
            doc = ast.get_docstring(fn)
            assert written and all(f"{g}.{k}" in doc for g, k in written), f"{fname}'s docstring misses a key"


def test_the_kept_widget_values_are_the_ones_the_app_always_kept():
    """``keep_widget_values`` keeps what app.py's KEPT / KEPT_PREFIXES kept before the schema: not one more."""
    names, prefixes = state.kept_names()
    assert names == {"prompt_text", "chat", "example", "cmp_prompt", "cmp_chat", "pair_spec", "draft_path",
                     "target_path", "dtype", "method", "gamma", "lossy", "width", "max_depth", "stop", "decision_model",
                     "verifier", "temperature", "top_k", "top_p", "seed", "max_new", "teach", "tree_template",
                     "b_method", "head_path"}  # b_method: in the b_ family, which was kept; head_path: eagle's
    assert sorted(prefixes) == ["b_", "k_config_", "threshold_"]


def test_defaults_match_the_widgets():
    assert state.Explorer.PROMPT_TEXT.default == state.Compare.PROMPT.default == state.STARTING_PROMPT


@pytest.fixture()
def session(monkeypatch):
    """A plain dict as the session state: the schema's accessors need nothing else."""
    held: dict = {}
    monkeypatch.setattr(state, "st", SimpleNamespace(session_state=held))
    return held


def test_keys_read_their_default_while_absent(session):
    assert state.Classroom.FILE.get() is None and state.Explorer.ENGINE.get() is None
    state.Classroom.FILE.set("f3")
    assert session == {"cls_file": "f3"} and state.Classroom.FILE.pop() == "f3" and state.Classroom.FILE.pop() is None
    state.Explorer.INSPECT.set(2, 5)
    state.Explorer.TREE_CHART.set(2, "event")
    session["inspector_2_5"] = "a chart's id, not a selection"
    state.Explorer.INSPECT.forget()
    assert session == {"tree_chart_2": "event", "inspector_2_5": "a chart's id, not a selection"}


@pytest.mark.parametrize("dtype, named", [("bfloat16", "bf16"), ("float32", "fp32"), ("float16", "auto")])
def test_the_hand_off_gives_the_explorer_what_its_docstring_says(session, dtype, named):
    trace = SimpleNamespace(prompt="def f(x):", model={"dtype": dtype})
    session["cls_lesson"] = "01-code-chains"  # the Classroom's own keys are its business
    state.hand_off_to_explorer(trace, 2, "Chains")
    assert session == {"continue_lesson": {"trace": trace, "step": 2, "title": "Chains"}, "prompt_text": "def f(x):",
                       "chat": True, "pair_spec": "default", "dtype": named, "go_to": "Explorer",
                       "cls_lesson": "01-code-chains"}


def test_continue_live_hands_the_lesson_to_the_explorer_page(monkeypatch):
    """The Classroom's Continue live, clicked: the Explorer takes the lesson on the same run, with the lesson's prompt
    in its box and the embedded pair in the sidebar. No model is loaded: the pair's loading is faked and refused."""
    from streamlit.testing.v1 import AppTest
    from test_classroom import press_continue_live

    from explorer.lessons.lesson import load_lesson, shipped_lessons
    from explorer.models import loading
    from explorer.ui import common

    asked = []

    def no_model(*key):
        asked.append(key)
        raise RuntimeError("no model in this test")

    monkeypatch.setattr(common, "get_pair", no_model)
    monkeypatch.setattr(loading, "is_prepared", lambda *args: True)
    lesson = load_lesson(shipped_lessons()[0])
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60)
    at.query_params["page"] = "classroom"
    at.run()
    press_continue_live(at, 0, 1)
    assert not at.exception, [e.value for e in at.exception]
    ss = at.session_state
    assert ss["page"] == "Explorer" and "continue_lesson" not in ss  # taken by the Explorer on this run
    assert ss["prompt_text"] == lesson.runs[0].trace.prompt and ss["chat"] is True and ss["pair_spec"] == "default"
    recorded = str(lesson.runs[0].trace.model.get("dtype"))
    assert ss["dtype"] == {"bfloat16": "bf16", "float32": "fp32"}.get(recorded, "auto")
    assert asked and asked[-1][0] == "default"  # it asked for the embedded pair...
    assert any("no model pair is loaded" in e.value for e in at.error)  # ...and says why it cannot go on


def test_the_per_source_counts_add_up_to_the_run_metrics(tiny):
    """Compare's committed/proposed tokens per draft source (now ``trace.metrics.draft_source_counts``) sum to
    ``run_metrics``' accepted and drafted tokens, for every kind of drafter."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.trace.metrics import draft_source_counts, run_metrics

    for method, changes, temperature in [("hybrid", {}, 0.0), ("mcsd", {"k_config": (2, 2)}, 1.0),
                                         ("token-recycling", {}, 0.0), ("prompt-lookup", {}, 0.0),
                                         ("mcsd-improved", {"lossy": True, "k_config": (1,)}, 0.0)]:
        engine = build_engine(tiny, DEFAULTS[method].with_(**changes), SamplingConfig(temperature=temperature, seed=1))
        engine.start(tiny.tokenizer.encode("def f(x):\n    return f(x) + f(x)"), 16)
        trace = engine.run()
        counts = draft_source_counts(trace.steps)
        m = run_metrics(trace)
        assert sum(c for c, _ in counts.values()) == m["accepted_draft_tokens"], method
        assert sum(p for _, p in counts.values()) == m["drafted_tokens"] > 0, method
        assert set(counts) <= {"draft", "lookup", "recycled"}
