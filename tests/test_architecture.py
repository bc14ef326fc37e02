"""The architecture as docs/architecture.md states it: the modules in wings that import only downward, no import
circles, and each worked example (a drafter, a verifier, a stop policy) runs as written there, with its losslessness
checks."""

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
EXAMPLES = {"drafter": "Adding a drafter", "verifier": "Adding a verifier", "stop policy": "Adding a stop policy"}
EXAMPLE_SAMPLES = 400


def _import_graph() -> nx.DiGraph:
    """Module -> module it imports, for every import in explorer/ (module level and inside functions)."""
    modules = {}
    for path in (ROOT / "explorer").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_no_import_circles():
    graph = _import_graph()
    assert graph.number_of_edges() > 100  # the graph really holds the project's imports
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not circles, f"import circles: {circles}"


# The wings, floor by floor (docs/architecture.md, "Module map"): a wing imports only wings on lower floors.
FLOORS = {"models": 1, "trace": 1, "engine": 2, "analysis": 3, "plugins": 3, "lessons": 4, "decision": 4,
          "instruments": 4, "heads": 4, "cli": 5, "ui": 5}


def test_each_wing_imports_only_the_wings_below_it():
    graph = _import_graph()
    wing = {name: name.split(".")[1] for name in graph if name.count(".") >= 1}
    top = sorted(n for n in graph if n.count(".") == 1 and n not in ("explorer.__main__",)
                 and not (ROOT / "explorer" / n.split(".")[1] / "__init__.py").exists())
    assert not top, f"modules outside a wing: {top}"  # explorer/ holds the package glue only
    assert set(wing.values()) - {"__main__"} == set(FLOORS)
    upward = [(a, b) for a, b in graph.edges if wing.get(a) in FLOORS and wing.get(b) in FLOORS
              and wing[a] != wing[b] and FLOORS[wing[b]] >= FLOORS[wing[a]]]
    assert not upward, f"imports that do not run down: {upward}"


def _example_code(heading: str) -> str:
    """The python blocks of one "## heading" section of docs/architecture.md, joined in order."""
    text = DOC.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, f"no code in the section {heading!r}"
    return "\n".join(blocks)


@pytest.fixture
def restore_verifier_tables():
    """Registering a verifier adds it to the registry; remove what the test added, for the other tests."""
    from explorer.engine.verify.registry import VERIFIER_REGISTRY, unregister_verifier

    before = set(VERIFIER_REGISTRY)
    yield
    for name in set(VERIFIER_REGISTRY) - before:
        unregister_verifier(name)


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_worked_example_runs_as_written(example, restore_verifier_tables):
    """Each section's code runs as a reader would paste it, but for the audit's sample count: the examples ask for
    1,200 samples, which cost about 30 s each here; ``EXAMPLE_SAMPLES`` still gives their audits several categories
    to test (tests/test_audit.py measures the audit's power)."""
    code = _example_code(EXAMPLES[example])
    assert "samples=1200" in code  # what the reader runs
    code = code.replace("samples=1200", f"samples={EXAMPLE_SAMPLES}")
    exec(compile(code, f"docs/architecture.md ({EXAMPLES[example]})", "exec"), {"__name__": "example"})


def test_a_verifier_name_is_taken_once(restore_verifier_tables):
    from explorer.engine.verify.node_rules import mcns_node, mcns_odds
    from explorer.engine.verify.registry import VERIFIER_REGISTRY, unregister_verifier
    from explorer.engine.verify.rules import VerifierError, register_verifier

    before = dict(VERIFIER_REGISTRY)
    for taken in ("rrs", "greedy", "longest-branch", "auto"):
        with pytest.raises(VerifierError, match="exists already"):
            register_verifier(taken, mcns_node, mcns_odds)
    for law in ("sideways", "greedy"):  # greedy drafting (the top-k) belongs to the greedy rule alone
        with pytest.raises(VerifierError, match="drafting law"):
            register_verifier("new-rule", mcns_node, mcns_odds, draws=law)
    with pytest.raises(TypeError):
        register_verifier("new-rule", None, mcns_odds)
    register_verifier("new-rule", mcns_node, mcns_odds)
    with pytest.raises(VerifierError, match="exists already"):
        register_verifier("new-rule", mcns_node, mcns_odds, draws="with")
    unregister_verifier("new-rule")
    with pytest.raises(VerifierError, match="built-in"):
        unregister_verifier("rrs")
    with pytest.raises(VerifierError, match="no verifier"):
        unregister_verifier("new-rule")
    assert dict(VERIFIER_REGISTRY) == before


def test_the_derived_verifier_tables_are_read_only_views():
    from explorer.engine import config, drafting
    from explorer.engine.verify import expectation
    from explorer.engine.verify import rules as verify
    from explorer.engine.verify.registry import VERIFIER_REGISTRY

    for table in (config.VERIFIER_LABELS, drafting.DRAFT_RULES, expectation.ODDS_RULES, verify.NODE_RULES,
                  VERIFIER_REGISTRY):
        with pytest.raises(TypeError):
            table["x"] = None
    assert config.VERIFIERS == ("rrs", "rrs-replacement", "mcns", "spechub", "spectr")  # spectr: a bundled plugin
    assert verify.ODDS_RULES == ("greedy", "rrs", "rrs-replacement")
    assert {name: drafting.DRAFT_RULES[name] for name in VERIFIER_REGISTRY} == {
        "greedy": "greedy", "rrs": "without", "rrs-replacement": "with", "mcns": "without", "spechub": "hub",
        "longest-branch": "without", "spectr": "with"}


@pytest.mark.parametrize("original", ["mcns", "spechub"])
def test_a_registered_verifier_is_seen_everywhere(tiny, original, restore_verifier_tables):
    """A copy of a rule under a new name: MethodConfig and the CLI take it, the menus label it, the draft model
    draws its children its way, expectation gives its odds, and an engine run with it commits exactly what the
    original commits from the same seed, with the same odds. Once removed, MethodConfig refuses it again."""
    import argparse

    from explorer.cli.args import add_method_args, method_config_from_args
    from explorer.engine import drafting
    from explorer.engine.config import VERIFIER_LABELS, VERIFIERS, MethodConfig
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig
    from explorer.engine.verify import expectation
    from explorer.engine.verify import rules as verify
    from explorer.engine.verify.registry import VERIFIER_REGISTRY, register_verifier, unregister_verifier

    rule, name = VERIFIER_REGISTRY[original], f"{original}-copy"
    entry = register_verifier(name, rule.node_rule, rule.odds_rule, draws=rule.draws, label="A copy")
    assert VERIFIER_REGISTRY[name] is entry and entry.selectable
    assert ("auto",) + VERIFIERS == ("auto", "rrs", "rrs-replacement", "mcns", "spechub", "spectr", name)
    assert VERIFIER_LABELS[name] == "A copy" and drafting.DRAFT_RULES[name] == rule.draws
    assert expectation.ODDS_RULES[name] is rule.odds_rule and verify.NODE_RULES[name].__wrapped__ is rule.node_rule
    parser = argparse.ArgumentParser()
    add_method_args(parser)
    args = parser.parse_args(["--method", "mcsd", "--k-config", "2,2", "--verifier", name])
    assert method_config_from_args(args).verifier == name

    prompt = tiny.tokenizer.encode("def f(x):\n    return")
    runs = {}
    for verifier in (original, name):
        # fallback off: timing-driven plain steps would make the two runs differ
        config = MethodConfig(method="mcsd", k_config=(2, 2), verifier=verifier, fallback="off")
        engine = build_engine(tiny, config, SamplingConfig(temperature=0.6, seed=5))
        engine.start(prompt, max_new_tokens=24)
        engine.run()
        runs[verifier] = engine
    ours, theirs = runs[name], runs[original]
    assert ours.state.committed == theirs.state.committed
    assert {s.verifier for s in ours.trace.steps} == {name}
    assert [s.expected_tokens for s in ours.trace.steps] == [s.expected_tokens for s in theirs.trace.steps]
    assert [[n.accept_prob for n in s.nodes] for s in ours.trace.steps] == \
        [[n.accept_prob for n in s.nodes] for s in theirs.trace.steps]
    assert sum(s.accepted_draft_len for s in ours.trace.steps) > 0  # the copy tested, and accepted, drafts

    if original == "spechub":  # hub drafting draws pairs: MethodConfig refuses wider trees for the copy too
        with pytest.raises(ValueError, match="at most two drafts"):
            MethodConfig(method="mcsd", k_config=(3, 2), verifier=name)
    unregister_verifier(name)
    assert name not in VERIFIERS and name not in drafting.DRAFT_RULES
    with pytest.raises(ValueError, match="unknown verifier"):
        MethodConfig(method="mcsd", verifier=name)


def _pins(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith(("#", "-r"))]


def test_pyproject_pins_what_the_requirements_files_pin():
    """The package's dependencies are requirements.txt's pins and its dev extra requirements-dev.txt's, in order:
    the README's commands install the files, ``pip install .`` the package, and both get the same versions."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == _pins(ROOT / "requirements.txt")
    assert project["optional-dependencies"]["dev"] == _pins(ROOT / "requirements-dev.txt")
    assert project["scripts"]["spec-explorer"] == "explorer.cli.main:main"


def test_the_console_script_is_the_module_command():
    """``spec-explorer`` (the console script) and ``python -m explorer`` are one program; usage names the one typed."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "spec-explorer"
    if not script.exists():
        pytest.fail(f"{script} is missing: scripts/setup.sh installs the package in editable mode")
    out = subprocess.run([str(script), "verifiers", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: spec-explorer verifiers")
    module = subprocess.run([sys.executable, "-m", "explorer", "verifiers", "--help"], capture_output=True, text=True,
                            timeout=120)
    words = lambda text: text.replace("python -m explorer", "spec-explorer").split()  # noqa: E731 (usage wraps by name)
    assert words(module.stdout) == words(out.stdout)
