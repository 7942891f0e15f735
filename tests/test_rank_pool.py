"""The warm rank pool (checks/rank_pool.py) starts even when its port is taken before rank 0 listens on it (the
other xdist worker's runs pick free ports too: one CI run hung 600 s on EADDRINUSE), and a rank that dies is
seen at once, not at the task's deadline."""

from __future__ import annotations

import socket
import time

import torch.distributed as dist


def _world_size() -> int:
    return dist.get_world_size()


def _die_on_rank_1() -> int:
    import os
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    return 0


def test_a_pool_whose_port_was_taken_starts_on_another_and_a_dead_rank_fails_fast(monkeypatch):
    import checks.rank_pool as rank_pool
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free = rank_pool.free_port
    monkeypatch.setattr(rank_pool, "free_port", lambda: next(ports, None) or free())
    pool = rank_pool.RankPool(2, start_timeout=120)
    try:
        assert pool.run(_world_size, (), {}, timeout=60) == [2, 2]
        start = time.monotonic()
        try:
            pool.run(_die_on_rank_1, (), {}, timeout=120)
            raise RuntimeError("a dead rank went unnoticed")
        except AssertionError as e:
            assert "gave no result" in str(e) or "failed" in str(e), e
        assert time.monotonic() - start < 30  # seen within a few polls, not at the 120 s deadline
    finally:
        pool.close(force=True)
        taken.close()
