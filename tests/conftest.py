import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests import shared helpers from tiny.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (long multi-process runs; off in the default run)")


def pytest_collection_modifyitems(config, items):
    """`slow` tests run with --runslow or HF_MEGATRON_SLOW=1; the default run (CI) stays lean.
    They are reported as skipped with that reason, never as passed."""
    if config.getoption("--runslow") or os.environ.get("HF_MEGATRON_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (or HF_MEGATRON_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
