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
FLOORS = {"models": 1, "trace": 1, "engine": 2, "analysis": 3, "lessons": 4, "decision": 4, "instruments": 4,
          "cli": 5, "ui": 5}


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
    """Registering the example verifier changes module tables; put them back for the other tests."""
    from explorer.engine import drafting
    from explorer.engine.verify import expectation
    from explorer.engine.verify import rules as verify

    saved = [(table, dict(table)) for table in (verify.NODE_RULES, expectation.ODDS_RULES, drafting.DRAFT_RULES)]
    yield
    for table, content in saved:
        table.clear()
        table.update(content)


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_worked_example_runs_as_written(example, restore_verifier_tables):
    code = _example_code(EXAMPLES[example])
    exec(compile(code, f"docs/architecture.md ({EXAMPLES[example]})", "exec"), {"__name__": "example"})


def test_a_verifier_name_is_taken_once(restore_verifier_tables):
    from explorer.engine.verify.rules import VerifierError, register_verifier

    with pytest.raises(VerifierError, match="exists already"):
        register_verifier("rrs", None, None)
    with pytest.raises(VerifierError, match="drafting law"):
        register_verifier("new-rule", None, None, draws="sideways")
