import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _close_rank_pools_after_each_module():
    yield
    from tests.rank_pool import close_pools
    close_pools()


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The embedded corpus's token files, copied once per test run (every module trains on them)."""
    from tests.launch_helpers import copy_default_corpus
    return copy_default_corpus(str(tmp_path_factory.mktemp("data")))


SLOW_TEST_SECONDS = 90  # a test over this (setup + call + teardown) is named at the end of the run: a report, not a failure
_SECONDS: dict = {}


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(((s, n) for n, s in _SECONDS.items() if s > SLOW_TEST_SECONDS), reverse=True)
    if slow:
        terminalreporter.write_sep("=", f"warning: {len(slow)} test(s) over {SLOW_TEST_SECONDS} s", yellow=True)
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}")
