import copy
import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("SPEC_EXPLORER_PAIR", "tiny")
# One thread for the tiny models (hidden size 64): a forward is Python overhead, and with two threads every one of
# the many small matmuls waits at an OpenMP barrier for the other core, which the app server and chromium of the
# browser tests (or any other process) also want. Measured on the 2-core EPYC: an audit of 300 samples took 49 s
# with two threads and 13 s with one beside a second busy process (8.3 and 7.9 s idle). The tests on the embedded
# pair get torch's default back (``real_pair_threads``). SPEC_EXPLORER_THREADS: the app in AppTest and the app
# servers the browser tests start (the app leaves a core to the browser: ui.common.app_threads) take one too.
DEFAULT_THREADS = torch.get_num_threads()
TEST_THREADS = 1
# pytest-xdist's workers (``scripts/test.sh`` starts one a core, at most four) share the cores: a test on the embedded
# pair takes its share of them, not all (two threads beside a busy worker ran a 1.5B forward no faster than one).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
REAL_THREADS = max(1, DEFAULT_THREADS // WORKERS)
torch.set_num_threads(TEST_THREADS)
os.environ.setdefault("SPEC_EXPLORER_THREADS", str(TEST_THREADS))
# The tiny pair's forward costs as measured on an idle 2-core EPYC with one thread (``forward_costs``; ms): the
# session's tiny pair starts with them, so that what reads them (the goodput fallback's ``auto``, the online root
# width, row pricing) decides the same on a busy machine as on an idle one. Tests about measuring empty
# ``pair.measured`` themselves.
IDLE_TINY_COSTS = {
    "verification_cost": {"rows": 16, "one_row_ms": 3.146, "two_rows_ms": 3.565, "rows_ms": 3.806, "ratio": 1.21,
                          "dear": False},
    "tree_costs": {"draft": {1: 2.213, 2: 1.962, 4: 2.275}, "target": {1: 3.146, 2: 3.565, 16: 3.806}},
}
REAL_GREEDY_TOKENS = 24  # what ``real_greedy`` decodes a prompt for at least
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/browser.py helpers

# The project's own plugins (SpecTr's verifier, ...) are registered in every tool; the tests see them too, from the
# start, so that no test's clean-up of the registries takes them away.
from explorer.plugins.loading import load_bundled  # noqa: E402

load_bundled()


# The slow kinds (markers in pyproject.toml) that a test's own code tells: whole modules of one kind, and any test
# that drives Streamlit's AppTest or a real browser. ``./scripts/test.sh --fast`` leaves them out.
MODULE_KINDS = {"test_app": "app", "test_browser": "browser"}
CALL_KINDS = {"AppTest": "app", "sync_playwright": "browser"}
# Unit tests that took 4 s or more (all their cases together) in the full suite of 2026-11-28 on a 2-core EPYC
# (SPEC_EXPLORER_TEST_TIMES), and those that export every shipped lesson: the fast tier leaves them to the full run.
SLOW_TESTS = {
    "tests/test_architecture.py::test_the_console_script_is_the_module_command",
    "tests/test_audit.py::test_the_lossy_longest_branch_rule_is_detected",
    "tests/test_classroom.py::test_shipped_lessons_cover_the_topics_and_draw_every_phase",
    "tests/test_classroom.py::test_the_players_data_holds_every_phase_of_the_lesson",
    "tests/test_cli_and_prompts.py::test_generate_greedy_methods_agree_through_the_cli",
    "tests/test_cli_and_prompts.py::test_module_entry_point_runs",
    "tests/test_cost_ratio.py::test_a_measured_run_moves_r_and_keeps_the_greedy_tokens",
    "tests/test_cost_ratio.py::test_an_r_that_moves_between_samples_keeps_the_output_law",
    "tests/test_cost_ratio.py::test_measured_ratios_survive_a_saved_trace_and_steer_its_replay",
    "tests/test_eagle3.py::test_head_drafting_samples_the_targets_law",
    "tests/test_expectation.py::test_expected_tokens_match_reverifying_the_drafted_tree",
    "tests/test_expectation.py::test_slot_probability_is_the_acceptance_rate_over_redrafts",
    "tests/test_fallback.py::test_fallback_steps_keep_the_output_law",
    "tests/test_families.py::test_the_default_tree_method_passes_the_audit_on_a_windowed_family",
    "tests/test_forensics.py::test_the_command_reads_a_folder_and_names_what_it_skipped",
    "tests/test_fused_kernels.py::test_a_fused_pair_keeps_its_logits_and_greedy_tokens",
    "tests/test_graphs.py::test_chain_replays_sample_from_the_target",
    "tests/test_layer_skip.py::test_layer_skip_passes_the_audit",
    "tests/test_player.py::test_a_built_page_is_kept_and_a_changed_lesson_is_built_again",
    "tests/test_player.py::test_every_phase_of_the_page_draws_what_figures_py_draws",
    "tests/test_row_pricing.py::test_priced_trees_keep_the_output_law",
    "tests/test_row_pricing.py::test_the_priced_hybrid_keeps_the_output_law",
}
SLOW_FIXTURES = {"exported"}


# Tests that share something costly run on one xdist worker (``--dist loadgroup``), each group once: the embedded
# pair (a test that asks for it: about a minute to load, 9 GB), a browser module's app server, the exported lessons.
# The rest go one test at a time to whichever worker is free. xdist sends the largest groups out first.
MODULE_GROUPS = {"test_browser": "app-server", "test_player": "exported-lessons"}


def _group(item, module: str) -> str | None:
    if module in MODULE_GROUPS:  # test_browser's test on the embedded pair starts a server of its own
        return MODULE_GROUPS[module]
    if item.get_closest_marker("real") is not None or "real_pair" in getattr(item, "fixturenames", ()):
        return "real-pair"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        group = _group(item, module)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        if module in MODULE_KINDS:
            item.add_marker(MODULE_KINDS[module])
        if item.nodeid.partition("[")[0] in SLOW_TESTS or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("slow")
        try:
            source = inspect.getsource(item.function)
        except (AttributeError, OSError, TypeError):
            continue
        for call, kind in CALL_KINDS.items():
            if call in source:
                item.add_marker(kind)


def pytest_runtest_logreport(report):
    """``SPEC_EXPLORER_TEST_TIMES=FILE``: each test phase's seconds appended as it ends (node id, phase, seconds,
    markers, xdist worker), so a run that is cut off still says where its time went (choosing what the fast tier
    leaves out)."""
    path = os.environ.get("SPEC_EXPLORER_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller writes each report once
        kinds = ",".join(sorted(k for k in ("real", "cuda", "browser", "app", "slow") if k in report.keywords))
        worker = getattr(getattr(report, "node", None), "gateway", None)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{kinds}\t{getattr(worker, 'id', '')}\n")


def idle_costs(pair):
    """``pair`` with the tiny pair's idle forward costs (``IDLE_TINY_COSTS``) in ``pair.measured``."""
    pair.measured.update(copy.deepcopy(IDLE_TINY_COSTS))
    return pair


@pytest.fixture(scope="session")
def tiny():
    from explorer.models.tiny import tiny_pair

    return idle_costs(tiny_pair(seed=0))


@pytest.fixture(autouse=True)
def real_pair_threads(request):
    """Torch's default threads (``REAL_THREADS``: its share of them under xdist) for a test on the embedded pair (a
    1.5B forward uses every core it is given), one otherwise."""
    real = request.node.get_closest_marker("real") is not None or "real_pair" in request.fixturenames
    torch.set_num_threads(REAL_THREADS if real else TEST_THREADS)
    yield
    torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def tiny_cuda():
    """The tiny pair on the GPU, built once (only ``cuda`` tests, which skip without one, ask for it)."""
    from explorer.models.tiny import tiny_pair

    return tiny_pair(seed=0, device="cuda")


@pytest.fixture(scope="session")
def real_prompt(real_pair):
    """A HumanEval prompt (number 2) in the embedded pair's chat template: ``list[int]``, the prompt most tests on the
    real pair share, so that ``real_greedy`` decodes it once."""
    from explorer.analysis.prompts import encode_prompt, humaneval

    return encode_prompt(real_pair.tokenizer, humaneval()[2].text)


@pytest.fixture(scope="session")
def real_greedy(real_pair):
    """``tokens(ids, n)``: the first ``n`` tokens ``ar`` decodes greedily from ``ids`` on the embedded pair
    (``list[int]``), decoded once per prompt for ``REAL_GREEDY_TOKENS`` (or ``n`` where more) and sliced: greedy
    decoding's first n tokens are a prefix of a longer run's. A target forward costs about 0.75 s on 2 cores here."""
    from explorer.engine.config import DEFAULTS
    from explorer.engine.factory import build_engine
    from explorer.engine.sampling import SamplingConfig

    runs: dict[tuple, tuple[int, list[int]]] = {}

    def tokens(ids, n: int) -> list[int]:
        asked, have = runs.get(tuple(ids), (0, []))
        if n > asked:
            engine = build_engine(real_pair, DEFAULTS["ar"], SamplingConfig(temperature=0.0))
            asked = max(n, REAL_GREEDY_TOKENS)
            engine.start(list(ids), asked)
            have = engine.run().generated_ids
            runs[tuple(ids)] = (asked, have)
        return have[:n]

    return tokens


@pytest.fixture(scope="session")
def real_pair():
    """The embedded pair as the app and the command line load it (``load_named_pair("default")``, every setting
    ``auto``): on a CPU the draft in int8, and float32 weights packed where the CPU has no native bf16, the paths
    users run (and the one an EAGLE head once crashed on). Loaded once: the tests on the real pair share it (the
    stock float32 pair took 425 s for one greedy test on a 2-core AVX2 EPYC)."""
    from explorer.models.loading import load_named_pair

    return load_named_pair("default")
