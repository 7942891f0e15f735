import glob
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed's JIT-built CPU ops (checks/rank_pool.py builds them), per interpreter: two environments building into one
# directory (a CI venv beside a developer's) rebuilt each other's ops and waited on each other's build locks
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _close_large_rank_pools_after_each_module():
    """The pools of more than 2 ranks, and any rank grown large, are stopped after each module; the 1- and 2-rank
    pools serve the next module (checks/rank_pool.py close_large_pools)."""
    yield
    from checks.rank_pool import close_large_pools
    close_large_pools()


@pytest.fixture(autouse=True)
def _loading_rules_restored_after_each_test():
    """An entry run in this process (checkpoint_util's main, a reader) installs the safe torch.load for the
    process and sets TORCH_FORCE_WEIGHTS_ONLY_LOAD for its children: undone after each test, so no later test
    depends on which ran before it."""
    import torch

    from hybrid import safe_loading
    load, forced, unsafe = torch.load, os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD"), dict(safe_loading._LOADS)
    yield
    torch.load = load
    safe_loading._LOADS.update(unsafe)
    if forced is None:
        os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
    else:
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = forced


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The embedded corpus's token files, copied once per test run (every module trains on them)."""
    from checks.launch_helpers import copy_default_corpus
    return copy_default_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture
def launcher_default_port():
    """A command run as the docs write it (`deepspeed --num_gpus 2 launch/train.py ...`) listens on the launcher's
    default port, 29500: such tests take this lock, so two pytest-xdist workers never run two of them at once
    (every other launch in the suite asks the OS for a free port)."""
    import fcntl
    import tempfile
    with open(os.path.join(tempfile.gettempdir(), "hybrid-tests-port-29500.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


# a test over this (setup + call + teardown) is named at the end of the run: a report, not a failure
SLOW_TEST_SECONDS = 90
_SECONDS: dict = {}


@pytest.fixture
def safe_torch_load():
    """`install_safe_torch_load()` for one test (undone after it, as every test's loading rules are)."""
    from hybrid.safe_loading import install_safe_torch_load
    install_safe_torch_load()


def pytest_runtest_logreport(report):
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(((s, n) for n, s in _SECONDS.items() if s > SLOW_TEST_SECONDS), reverse=True)
    if slow:
        terminalreporter.write_sep("=", f"warning: {len(slow)} test(s) over {SLOW_TEST_SECONDS} s", yellow=True)
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:7.1f}s {nodeid}")


_SESSION_START = time.time()
SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU all-reduce (its shm_comm op) leaves two /dev/shm buffers of about 69 MB behind every
    multi-rank run, never unlinked; those this session made are removed (a day of runs filled a 24 GB machine's
    memory with them, and a run was killed for memory). Under pytest-xdist only the controller removes them, after
    every worker has ended: a worker ending first would unlink the buffers of a run another worker is still in."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker
        return
    for path in glob.glob(SHM_BUFFERS):
        try:
            if os.path.getmtime(path) >= _SESSION_START:
                os.remove(path)
        except OSError:
            pass
