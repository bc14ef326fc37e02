"""Plugins (explorer.plugins, docs/plugins.md): the stable API, loading from files, modules, the environment and entry
points, the adapters against transformers' own candidate generator, every tool taking a plugin's method, traces that
replay without it, and bad plugins reported by name."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from explorer.engine.config import DEFAULTS, MethodConfig
from explorer.engine.factory import build_engine
from explorer.engine.methods import METHOD_SPECS
from explorer.engine.parts import PluginError
from explorer.engine.policies.stopping import STOP_POLICY_NAMES
from explorer.engine.sampling import SamplingConfig
from explorer.engine.verify.node_rules import VerifierError
from explorer.engine.verify.registry import VERIFIER_REGISTRY
from explorer.plugins import loading, unregister

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
STABLE_API = {"DraftOffer", "DraftView", "Drafted", "Drafter", "FreeNode", "LevelView", "ModelDrafter", "NodeDecision",
              "PluginError", "StopPolicy", "from_candidate_generator", "from_vllm_proposer", "normalize_or", "ratio",
              "register_method", "register_stop_policy", "register_verifier", "rrs_rejected", "unregister", "without"}

BIGRAM = '''
"""A bigram drafter."""
from explorer.plugins import Drafter, FreeNode, register_method


class BigramDrafter(Drafter):
    """After each token, the token that followed it the last time."""

    def free_nodes(self, view):
        follows = dict(zip(view.committed, view.committed[1:]))
        nodes, token = [], view.committed[-1]
        while len(nodes) < 4 and token in follows:
            token = follows[token]
            nodes.append(FreeNode(len(nodes) - 1, token))
        return nodes


register_method("bigram-t", BigramDrafter, defaults={"fallback": "off"})
'''


@pytest.fixture(autouse=True)
def restore_registries():
    """Every test leaves the registries, the loaded plugins and sys.modules as it found them."""
    before = (set(METHOD_SPECS), set(VERIFIER_REGISTRY), set(STOP_POLICY_NAMES))
    modules = set(sys.modules)
    loaded = dict(loading._LOADED)
    yield
    unregister(*(set(METHOD_SPECS) - before[0]), *(set(VERIFIER_REGISTRY) - before[1]),
               *(set(STOP_POLICY_NAMES) - before[2]))
    loading._LOADED.clear()
    loading._LOADED.update(loaded)
    for name in set(sys.modules) - modules:
        if name.startswith("spec_explorer_plugin_") or name.startswith("my_drafters"):
            del sys.modules[name]


def _plugin(tmp_path: Path, source: str, name: str = "bigram_t.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def _greedy(pair, method: str, prompt: list[int], n: int = 24, config: MethodConfig | None = None):
    engine = build_engine(pair, config or DEFAULTS[method], SamplingConfig(temperature=0.0))
    engine.start(prompt, max_new_tokens=n)
    return engine.run()


# ------------------------------------------------------------------------------------------------ the API


def test_the_stable_api_keeps_its_names_and_documents_them():
    import explorer.plugins as api

    assert set(api.__all__) == STABLE_API  # a name leaving (or joining) the stable API is a decision, not a slip
    for name in api.__all__:
        obj = getattr(api, name)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"


# ------------------------------------------------------------------------------------------------ docs/plugins.md


def _doc_blocks() -> list[tuple[str, str, str]]:
    """(marker kind, marker argument, code) of each marked block of docs/plugins.md, in order."""
    text = DOCS.read_text(encoding="utf-8")
    found = re.findall(r"<!-- (plugin|check|package):? ?(\S*) -->\n```(?:python|toml)\n(.*?)```", text, re.S)
    return [(kind, arg, code) for kind, arg, code in found]


def test_the_tutorial_examples_run_as_written(tmp_path, monkeypatch):
    """Every plugin block of docs/plugins.md loads as a plugin file, and every check block after it passes: the
    free drafter and the model drafter give ar's greedy tokens, the audit passes the first-child rule and catches
    typical acceptance, the stop policy stops drafting; the package block's entry point loads."""
    blocks = _doc_blocks()
    kinds = [k for k, _, _ in blocks]
    assert kinds.count("plugin") == 6 and kinds.count("check") == 5 and kinds.count("package") == 1
    for kind, arg, code in blocks:
        if kind == "plugin":
            plugin = loading.load_plugin(str(_plugin(tmp_path, code, arg)))
            assert plugin.registered and plugin.sha256
        elif kind == "check":
            exec(compile(code, f"{DOCS.name} check", "exec"), {"__name__": "docs_check"})
    # the package: the entry point from the page's pyproject, the module from the first example's drafter
    toml = next(code for kind, _, code in blocks if kind == "package")
    bigram = next(code for kind, arg, code in blocks if arg == "bigram.py")
    unregister("bigram")
    entry_points = toml.split('[project.entry-points."spec_explorer.plugins"]')[1]
    name, value = re.search(r'^(\w+) = "([\w.:]+)"', entry_points, re.M).groups()
    source = bigram.replace('\nregister_method("bigram"', '\n\ndef register():\n    register_method("bigram"')
    assert "def register():" in source
    _install(tmp_path, "my_drafters", "0.1.0", {"bigram.py": source, "__init__.py": ""}, {name: value})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    found = loading.load_entry_points()
    assert [p.version for p in found if p.name == "bigram"] == ["0.1.0"]
    assert METHOD_SPECS["bigram"].origin["loaded_from"].startswith("entry point spec_explorer.plugins:bigram")


def _install(tmp_path: Path, package: str, version: str, files: dict, entry_points: dict) -> None:
    """A package 'installed' in tmp_path/site: its modules and a dist-info with its entry points."""
    site = tmp_path / "site"
    (site / package).mkdir(parents=True)
    for name, text in files.items():
        (site / package / name).write_text(text, encoding="utf-8")
    info = site / f"{package.replace('_', '-')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{loading.ENTRY_POINT_GROUP}]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    (info / "top_level.txt").write_text(package + "\n")


# ------------------------------------------------------------------------------------------------ adapters


def _hf_candidates(context: list[int], room: int) -> list[int]:
    """What transformers' own PromptLookupCandidateGenerator proposes after ``context`` (generate's max_length:
    the context plus the room left)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    gen = PromptLookupCandidateGenerator(eos_token_id=None, num_output_tokens=10, max_matching_ngram_size=2,
                                         max_length=len(context) + room)
    ids, _ = gen.get_candidates(torch.tensor([context]))
    return ids[0, len(context):].tolist()


def _check_prompt_lookup(pair, prompt: list[int], n: int, plain: list[int]) -> None:
    """The adapter's greedy run gives ``plain`` (ar's tokens), and each step drafted exactly what transformers'
    generator proposes for the same committed text (cut where the run's room or an EOS ends the chain)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from explorer.plugins import from_candidate_generator, register_method

    register_method("hf-lookup-t", from_candidate_generator(PromptLookupCandidateGenerator, num_output_tokens=10,
                                                            max_matching_ngram_size=2), defaults={"fallback": "off"})
    trace = _greedy(pair, "hf-lookup-t", prompt, n)
    assert trace.generated_ids == plain
    context, proposed = list(prompt), 0
    for step in trace.steps:
        room = n - (len(context) - len(prompt))
        drafted = [nd.token_id for nd in sorted(step.nodes, key=lambda nd: nd.depth) if nd.parent is not None]
        expected = _hf_candidates(context, room)[: room - 1]
        cut = next((i + 1 for i, t in enumerate(expected) if t in pair.eos_token_ids), len(expected))
        assert drafted == expected[:cut], f"step {step.index}"
        assert all(nd.source == "plugin" for nd in step.nodes if nd.parent is not None)
        proposed += len(drafted)
        context += step.committed_ids
    assert proposed > 0  # the comparison compared something


def test_transformers_prompt_lookup_through_the_adapter_on_the_tiny_pair(tiny):
    prompt = tiny.tokenizer.encode("def f(x):\n    return x + 1\n\ndef f(x):\n    return")
    plain = _greedy(tiny, "ar", prompt, 32).generated_ids
    _check_prompt_lookup(tiny, prompt, 32, plain)


@pytest.mark.real
def test_transformers_prompt_lookup_through_the_adapter_on_the_embedded_pair(real_pair, real_prompt, real_greedy):
    _check_prompt_lookup(real_pair, real_prompt, 12, real_greedy(real_prompt, 12))


class _Proposer:
    """vLLM's custom_class signature: what followed the last earlier occurrence of the last token (k tokens)."""

    calls: list = []

    def __init__(self, k: int = 3):
        self.k = k

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        _Proposer.calls.append((list(sampled_token_ids[0]), int(num_tokens_no_spec[0]), token_ids_cpu.shape))
        ids = list(token_ids_cpu[0, : num_tokens_no_spec[0]])
        last = max((i for i in range(len(ids) - 1) if ids[i] == ids[-1]), default=None)
        return [[] if last is None else [int(t) for t in ids[last + 1: last + 1 + self.k]]]


def test_a_vllm_style_proposer_runs_greedy_as_ar_and_passes_the_audit(tiny):
    from explorer.analysis.audit import audit_engine
    from explorer.plugins import from_vllm_proposer, register_method

    register_method("proposer-t", from_vllm_proposer(_Proposer, k=3), defaults={"fallback": "off"})
    prompt = tiny.tokenizer.encode("a b c a b c a b")
    _Proposer.calls.clear()
    trace = _greedy(tiny, "proposer-t", prompt)
    assert trace.generated_ids == _greedy(tiny, "ar", prompt).generated_ids
    assert sum(s.drafted for s in trace.steps) > 0  # it proposed, and greedy kept exactly ar's tokens
    (first, n, shape), (second, n2, _) = _Proposer.calls[:2]
    assert first == [prompt[-1]] and n == len(prompt) and shape == (1, len(prompt))
    assert second == trace.steps[0].committed_ids and n2 == len(prompt) + len(second)  # the last step's tokens
    engine = build_engine(tiny, DEFAULTS["proposer-t"], SamplingConfig(temperature=1.0, seed=3))
    assert audit_engine(engine, prompt, samples=400).passed


def test_a_candidate_generator_with_logits_drafts_model_nodes_with_q(tiny):
    """A generator that returns logits: its chain's nodes are drafted nodes with q, tested by rrs; sampled from
    those logits it passes the audit, and update_candidate_strategy hears each step's matches."""
    from explorer.analysis.audit import audit_engine
    from explorer.plugins import from_candidate_generator, register_method

    heard, rng = [], torch.Generator().manual_seed(0)

    class DraftModelGenerator:
        """Samples 3 tokens from the tiny draft model at temperature 1, returning its logits. Its random stream
        lives outside the instance: the adapter builds a new generator for each audit sample (``rewind``), and a
        stream restarted with it would propose the same tokens every sample, which the audit rightly fails."""

        def __init__(self):
            self.rng = rng

        def get_candidates(self, input_ids):
            ids, logits = input_ids, []
            for _ in range(3):
                row = tiny.draft(ids).logits[:, -1].float()
                token = torch.multinomial(torch.softmax(row, -1), 1, generator=self.rng)
                ids, logits = torch.cat([ids, token], 1), logits + [row]
            return ids, torch.stack(logits, 1)

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            heard.append((input_ids.shape[1], None if scores is None else tuple(scores.shape), num_matches))

    register_method("gen-t", from_candidate_generator(DraftModelGenerator), defaults={"fallback": "off"})
    prompt = tiny.tokenizer.encode("def f(x):\n    return")
    engine = build_engine(tiny, DEFAULTS["gen-t"], SamplingConfig(temperature=1.0, seed=1))
    engine.start(prompt, max_new_tokens=12)
    trace = engine.run()
    drafted = [n for s in trace.steps for n in s.nodes if n.parent is not None]
    assert drafted and all(n.source == "draft" and n.q is not None for n in drafted)
    assert [h[2] for h in heard] == [s.accepted_draft_len for s in trace.steps]
    assert heard[0][1] == (1, 4, tiny.vocab_size)
    assert audit_engine(build_engine(tiny, DEFAULTS["gen-t"], SamplingConfig(temperature=1.0, seed=2)), prompt,
                        samples=400).passed


# ------------------------------------------------------------------------------------------------ every tool


def test_the_cli_takes_a_plugin_method_and_the_trace_records_it(tmp_path, capsys):
    from explorer.cli.main import main

    path = _plugin(tmp_path, BIGRAM)
    with pytest.raises(SystemExit):
        main(["generate", "--plugin", str(path), "--help"])
    assert "bigram-t" in capsys.readouterr().out
    out = tmp_path / "traces"
    assert main(["generate", "--plugin", str(path), "--method", "bigram-t", "--models", "tiny", "--prompt",
                 "a b c a b c a b", "--max-new-tokens", "16", "--json", "--save-trace", str(out), "--html",
                 str(out)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["method"] == "bigram-t" and len(line["token_ids"]) == 16
    saved = json.loads((out / "trace_000.json").read_text())
    recorded = saved["settings"]["plugins"][0]
    assert recorded["method"] == "bigram-t" and recorded["loaded_from"] == str(path.resolve())
    assert recorded["sha256"] == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    assert (out / "trace_000.html").stat().st_size > 0
    nodes = [n for s in saved["steps"] for n in s["nodes"] if n["source"] == "plugin"]
    assert nodes and all(n["provenance"]["plugin"] == "bigram-t" for n in nodes)


def test_the_audit_cli_judges_a_plugin_rule(tmp_path, capsys):
    from explorer.cli.main import main

    typical = next(code for kind, arg, code in _doc_blocks() if arg == "typical.py")
    path = _plugin(tmp_path, typical, "typical.py")
    status = main(["audit", "--plugin", str(path), "--method", "mcsd", "--k-config", "3,2", "--verifier", "typical",
                   "--fallback", "off", "--samples", "400", "--no-chat-template", "--prompt", "def f(x):\n    return"])
    out = capsys.readouterr().out
    assert status == 1 and "FAIL" in out and "differ most" in out and "TV distance" in out


def test_bench_and_forensics_take_a_plugin_method(tiny, tmp_path):
    from explorer.analysis.bench import bench
    from explorer.analysis.forensics import Forensics
    from explorer.plugins import loading as load

    load.load_plugin(str(_plugin(tmp_path, BIGRAM)))
    prompt = tiny.tokenizer.encode("a b c a b c a b")
    report = bench(tiny, [prompt], methods=("ar", "bigram-t"), max_new_tokens=12, warmup=0)
    assert {r["method"] for r in report["summary"]} >= {"ar", "bigram-t"}
    trace = _greedy(tiny, "bigram-t", prompt, 16)
    found = Forensics()
    found.add(trace, "bigram prompt")
    assert found.to_dict()["by_source"]["plugin"]["tested"] > 0


def test_a_trace_replays_without_its_plugin_and_a_live_run_names_it(tiny, tmp_path):
    from explorer.instruments.replay import ReplayError, engine_for_trace
    from explorer.lessons.player import trace_html
    from explorer.lessons.teach import explain_step
    from explorer.trace import figures
    from explorer.trace.records import RunTrace

    path = _plugin(tmp_path, BIGRAM)
    loading.load_plugin(str(path))
    trace = _greedy(tiny, "bigram-t", tiny.tokenizer.encode("a b c a b c a b"), 12)
    data = trace.to_json()
    unregister("bigram-t")
    loaded = RunTrace.from_dict(json.loads(data))
    step = next(s for s in loaded.steps if any(n.source == "plugin" for n in s.nodes))
    assert figures.tree_figure(step) is not None and trace_html(loaded)
    words = " ".join(explain_step(step, loaded.settings["method"], None, loaded.settings["plugins"]))
    assert "bigram-t" in words and "After each token" in words
    with pytest.raises(ReplayError, match=r"plugin bigram_t .*method 'bigram-t'.*SPEC_EXPLORER_PLUGINS="):
        engine_for_trace(tiny, loaded)
    from explorer.lessons.authoring import lesson_from_run
    from explorer.lessons.lesson import loads_lesson

    lesson = loads_lesson(lesson_from_run(loaded, "A bigram plugin").to_json())  # Save as lesson, without the plugin
    assert lesson.runs[0].trace.settings["plugins"][0]["method"] == "bigram-t"


# ------------------------------------------------------------------------------------------------ loading


def test_the_environment_and_entry_points_load_and_off_turns_them_off(tmp_path, monkeypatch):
    one = _plugin(tmp_path, BIGRAM)
    two = _plugin(tmp_path, BIGRAM.replace("bigram-t", "bigram-two"), "two.py")
    _install(tmp_path, "my_drafters", "2.0", {"__init__.py": BIGRAM.replace("bigram-t", "bigram-ep")},
             {"ep": "my_drafters"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv(loading.ENV, "off")
    bundled = loading.load_bundled()
    assert {p.how for p in bundled} == {"bundled"} and {"spectr", "rsd-s"} <= {n for p in bundled for n in p.registered}
    assert loading.load_plugins() == bundled and "bigram-ep" not in METHOD_SPECS  # the project's own only
    monkeypatch.setenv(loading.ENV, f"{one}{__import__('os').pathsep}{two}")
    loaded = loading.load_plugins(entry_points=False)[len(bundled):]
    assert [p.registered for p in loaded] == [["bigram-t"], ["bigram-two"]]
    assert loading.load_plugins(entry_points=False)[len(bundled):] == loaded  # each loads once
    loaded = loading.load_plugins(use_env=False)[len(bundled):]
    assert [(p.name, p.how, p.version, p.registered) for p in loaded] == [("ep", "entry point", "2.0", ["bigram-ep"])]
    assert loading.plugin_args(["generate", "--plugin", "a.py", "--plugin=b", "--no-plugins"]) == (["a.py", "b"], True)


def test_a_module_plugin_loads_by_name(tmp_path, monkeypatch):
    (tmp_path / "mod_plugin_t.py").write_text(BIGRAM.replace("bigram-t", "bigram-mod"), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = loading.load_plugin("mod_plugin_t")
    assert plugin.how == "module" and plugin.registered == ["bigram-mod"] and plugin.sha256
    del sys.modules["mod_plugin_t"]


# ------------------------------------------------------------------------------------------------ bad plugins


def test_bad_plugins_are_named_and_leave_nothing_behind(tmp_path, capsys):
    from explorer.cli.main import main

    broken = _plugin(tmp_path, "import explorer.plugins\ndef broken(:\n", "broken.py")
    with pytest.raises(PluginError, match=r"plugin broken .*SyntaxError \(line 2\)"):
        loading.load_plugin(str(broken))
    taken = _plugin(tmp_path, BIGRAM + '\nregister_method("sd", BigramDrafter)\n', "taken.py")
    with pytest.raises(PluginError, match="plugin taken: a method named 'sd' exists already"):
        loading.load_plugin(str(taken))
    assert "bigram-t" not in METHOD_SPECS  # what it registered before failing was taken back
    with pytest.raises(PluginError, match="no such module"):
        loading.load_plugin("no_such_plugin_module_here")
    with pytest.raises(PluginError, match="defaults are not valid settings: gamma"):
        from explorer.plugins import Drafter, register_method
        register_method("bad-defaults", Drafter, defaults={"gamma": 0})
    assert main(["generate", "--plugin", str(broken), "--method", "ar", "--models", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: plugin: plugin broken") and "Traceback" not in err


def _failing_drafter(tmp_path, body: str) -> Path:
    return _plugin(tmp_path, f'''
from explorer.plugins import Drafter, FreeNode, register_method


class Failing(Drafter):
    """Fails at its third step."""

    def free_nodes(self, view):
        if view.steps_done == 2:
            {body}
        return []


register_method("failing", Failing, defaults={{"fallback": "off"}})
''', "failing.py")


@pytest.mark.parametrize("body, message", [
    ("raise RuntimeError('boom')", r"plugin failing \(.*failing.py\): method failing: its drafter raised "
                                   r"RuntimeError: boom"),
    ("return [FreeNode(-1, 10**6)]", r"plugin failing .*method failing: proposed token 1000000, outside the "
                                     r"vocabulary \(ids 0 to 258\)"),
])
def test_a_failing_drafter_stops_the_step_by_name_and_keeps_the_run(tiny, tmp_path, capsys, body, message):
    from explorer.cli.main import main

    path = _failing_drafter(tmp_path, body)
    loading.load_plugin(str(path))
    engine = build_engine(tiny, DEFAULTS["failing"], SamplingConfig(temperature=0.0))
    engine.start(tiny.tokenizer.encode("hello"), max_new_tokens=8)
    engine.step(), engine.step()
    with pytest.raises(PluginError, match=message):
        engine.step()
    assert len(engine.trace.steps) == 2 and len(engine.state.committed) == len(engine.trace.prompt_ids) + 2
    assert main(["generate", "--plugin", str(path), "--method", "failing", "--models", "tiny", "--prompt", "hi"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_rule_that_returns_nothing_usable_is_named(tiny, tmp_path):
    path = _plugin(tmp_path, '''
from explorer.plugins import register_verifier


def nothing(tokens, p, q, generator):
    """Returns neither a child nor a distribution."""
    return None, None, {}


register_verifier("nothing", nothing)
''', "nothing.py")
    loading.load_plugin(str(path))
    config = MethodConfig(method="mcsd", k_config=(2,), verifier="nothing", fallback="off")
    engine = build_engine(tiny, config, SamplingConfig(temperature=1.0, seed=0))
    engine.start(tiny.tokenizer.encode("hello"), max_new_tokens=4)
    with pytest.raises(VerifierError, match=r"verifier 'nothing' \(plugin nothing\): its node rule returned "
                                            "neither an accepted child nor a distribution"):
        engine.step()


def test_a_rule_without_odds_shows_its_decisions_only(tiny, tmp_path):
    typical = next(code for kind, arg, code in _doc_blocks() if arg == "typical.py")
    loading.load_plugin(str(_plugin(tmp_path, typical, "typical.py")))
    config = MethodConfig(method="mcsd", k_config=(3, 2), verifier="typical", fallback="off")
    engine = build_engine(tiny, config, SamplingConfig(temperature=1.0, seed=0))
    engine.start(tiny.tokenizer.encode("def f(x):\n    return"), max_new_tokens=12)
    trace = engine.run()
    tested = [n for s in trace.steps for n in s.nodes if n.status in ("accepted", "rejected")]
    assert tested and all(n.accept_prob is None for n in tested) and all(n.u == 0.1 for n in tested)
