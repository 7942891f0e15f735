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
