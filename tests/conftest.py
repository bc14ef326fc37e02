import os

import pytest

os.environ.setdefault("SPEC_EXPLORER_PAIR", "tiny")


def pytest_configure(config):
    config.addinivalue_line("markers", "real: uses the embedded real model pair (1.6 GB download on first use)")


@pytest.fixture(scope="session")
def tiny():
    from explorer.tiny import tiny_pair

    return tiny_pair(seed=0)


@pytest.fixture(scope="session")
def real_pair():
    from explorer.models import load_default_pair

    return load_default_pair()
