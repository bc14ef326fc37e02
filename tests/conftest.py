import inspect
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("SPEC_EXPLORER_PAIR", "tiny")
# The app leaves a core to the browser (ui.common.app_threads); in the test process, where Streamlit's AppTest runs
# the app, that setting would hold for every later test: keep torch's own default here.
os.environ.setdefault("SPEC_EXPLORER_THREADS", str(torch.get_num_threads()))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/browser.py helpers


# The slow kinds (markers in pyproject.toml) that a test's own code tells: whole modules of one kind, and any test
# that drives Streamlit's AppTest or a real browser. ``./scripts/test.sh --fast`` leaves them out.
MODULE_KINDS = {"test_app": "app", "test_browser": "browser"}
CALL_KINDS = {"AppTest": "app", "sync_playwright": "browser"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        if module in MODULE_KINDS:
            item.add_marker(MODULE_KINDS[module])
        try:
            source = inspect.getsource(item.function)
        except (AttributeError, OSError, TypeError):
            continue
        for call, kind in CALL_KINDS.items():
            if call in source:
                item.add_marker(kind)


def pytest_runtest_logreport(report):
    """``SPEC_EXPLORER_TEST_TIMES=FILE``: each test phase's seconds appended as it ends (node id, phase, seconds,
    markers), so a run that is cut off still says where its time went (choosing what the fast tier leaves out)."""
    path = os.environ.get("SPEC_EXPLORER_TEST_TIMES")
    if path:
        kinds = ",".join(sorted(k for k in ("real", "cuda", "browser", "app", "slow") if k in report.keywords))
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{kinds}\n")


@pytest.fixture(scope="session")
def tiny():
    from explorer.models.tiny import tiny_pair

    return tiny_pair(seed=0)


@pytest.fixture(scope="session")
def tiny_cuda():
    """The tiny pair on the GPU, built once (only ``cuda`` tests, which skip without one, ask for it)."""
    from explorer.models.tiny import tiny_pair

    return tiny_pair(seed=0, device="cuda")


@pytest.fixture(scope="session")
def real_pair():
    from explorer.models.loading import load_default_pair

    return load_default_pair()
