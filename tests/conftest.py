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
    """The 8-rank pool, and any rank grown large, are stopped after each module; the 1-, 2- and 4-rank pools serve
    the next module (checks/rank_pool.py close_large_pools)."""
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
def deepspeed_on_a_free_port(tmp_path):
    """A directory to put first on PATH for a command run as the docs write it (`deepspeed --num_gpus 2
    launch/train.py ...`): its `deepspeed` is the environment's own launcher given a free --master_port (else every
    such run listens on the launcher's default, 29500, and two pytest-xdist workers' runs would meet there)."""
    import shlex
    import shutil
    import stat
    real = shutil.which("deepspeed", path=os.path.dirname(sys.executable)) or shutil.which("deepspeed")
    assert real, "no deepspeed launcher beside the interpreter or on PATH"
    shim = tmp_path / "deepspeed-on-a-free-port"
    shim.mkdir()
    script = shim / "deepspeed"
    free = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
    script.write_text(f"#!/bin/bash\nport=$({shlex.quote(sys.executable)} -c {shlex.quote(free)})\n"
                      f"exec {shlex.quote(real)} --master_port \"$port\" \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(shim)


# the modules a two-worker run measured longest (seconds of test time), started first: pytest-xdist hands out whole
# files as workers free up, so the longest ones go early and the short ones even out the end (its default order, by
# number of tests, left the one-test tutorial of 2.5 minutes to the end while the other worker stood idle)
LONGEST_FIRST = {"test_combinations": 665, "test_megatron_checkpoints": 665, "test_sft": 443, "test_training": 344,
                 "test_restarts": 208, "test_grpo": 198, "test_tutorial": 154, "test_universal_checkpoint": 149,
                 "test_moe": 130, "test_families": 113, "test_generation": 100, "test_pipeline_schedules": 96,
                 "test_memory": 93, "test_context_parallel": 91, "test_gradients": 75, "test_deepspeed_fixes": 68}


def pytest_collection_modifyitems(session, config, items):
    """Modules in LONGEST_FIRST's order, then the rest as collected; the tests of a module keep their order (with
    --no-loadscope-reorder in pyproject.toml's addopts, pytest-xdist schedules the files in this order)."""
    def weight(item):
        return -LONGEST_FIRST.get(item.path.stem, 0)
    items[:] = sorted(items, key=weight)  # (a stable sort)


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
