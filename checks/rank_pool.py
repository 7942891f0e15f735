"""Run a function on N CPU ranks (gloo) from pytest, and compare sharded results to references.

Starting a process that imports torch and DeepSpeed takes seconds on a 2-core machine, so ranks
are kept in a small pool per world size and reused across tests; every task runs on every rank
of the pool. A task that fails on one rank while the others wait in a collective would hang, so
a timeout kills the pool (it is rebuilt on the next call) and the failing rank's traceback is
reported.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional

import torch

from hybrid.distributed import free_port


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException:  # e.g. the port taken between its choice and rank 0's listen (EADDRINUSE): RankPool retries
        results.put((READY, rank, False, traceback.format_exc()))
        return
    results.put((READY, rank, True, None))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone (the ranks are not daemons: see RankPool)
                break
            continue
        if task is None:
            break
        number, fn, args, kwargs = task
        groups_before = set(_process_groups())
        try:
            results.put((number, rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion failures
            results.put((number, rank, False, traceback.format_exc()))
        # Each task's topology/engine creates process groups whose gloo threads keep polling;
        # destroy them so idle pool ranks do not slow down everything that runs later (and collect the
        # task's objects first: a group's threads end only when its last reference goes).
        gc.collect()
        for group in set(_process_groups()) - groups_before:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass
    dist.destroy_process_group()


READY = -1  # the task number of a rank's start-up report


def _process_groups():
    import torch.distributed.distributed_c10d as c10d
    return [g for g in c10d._world.pg_map if g is not c10d.GroupMember.WORLD]


class RankPool:
    """`world_size` worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, attempts: int = 3, start_timeout: float = 300.0):
        self.world_size = world_size
        self.tasks_sent = 0  # each result names its task: one left by a task its test gave up on is dropped
        for attempt in range(attempts):  # a free port can be taken by another process (the other xdist worker's
            error = self._start(start_timeout)  # runs) before rank 0 listens on it: start again on another
            if error is None:
                return
            self.close(force=True)
        raise AssertionError(f"a pool of {world_size} ranks did not start in {attempts} attempts:\n{error}")

    def _start(self, timeout: float) -> Optional[str]:
        """The ranks started and joined in one process group (None), or why not (they are then left to close)."""
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        # not daemons: a run on a rank starts processes of its own (data-loader workers, the chat stream), which
        # multiprocessing forbids a daemon; a rank ends when the test process does (_worker watches its parent)
        self.procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self.tasks[r], self.results),
                                  daemon=False) for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        ready, deadline = set(), time.monotonic() + timeout
        while len(ready) < self.world_size:
            try:  # (short waits: a rank that died is seen within a second)
                number, rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return f"ranks {sorted(set(range(self.world_size)) - ready)} did not join within {timeout:.0f}s"
                if not all(p.is_alive() for p in self.procs):
                    return "a rank died while starting"
                continue
            if number == READY and not ok:
                return f"rank {rank} could not join (port {port}):\n{value}"
            if number == READY:
                ready.add(rank)
        return None

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float,
            failed: Optional[Callable[[Any], bool]] = None, partial: bool = False) -> list[Any]:
        """`fn` on every rank. Once a rank raised (or returned a value `failed` calls a failure), the others get
        15 s more: a rank that failed alone leaves its peers waiting in a collective. `partial`: ranks that gave
        no result then are None in the list (the pool is killed), instead of an AssertionError."""
        self.tasks_sent += 1
        for q in self.tasks:
            q.put((self.tasks_sent, fn, args, kwargs))
        outputs: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outputs) < self.world_size:
            if any(not ok or (failed is not None and failed(value)) for ok, value in outputs.values()):
                deadline = min(deadline, time.monotonic() + 15)  # the others are likely stuck
            try:  # (at most 2 s at a time: a rank that died is seen then, not at the deadline)
                number, rank, ok, value = self.results.get(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                if number == self.tasks_sent:
                    outputs[rank] = (ok, value)
            except queue.Empty:
                if time.monotonic() >= deadline or not all(p.is_alive() for p in self.procs):
                    break
        failures = {r: v for r, (ok, v) in outputs.items() if not ok}
        missing = sorted(set(range(self.world_size)) - set(outputs))
        if partial and not failures:
            if missing:
                self.close(force=True)
            return [outputs[r][1] if r in outputs else None for r in range(self.world_size)]
        if failures or missing:
            self.close(force=True)
            message = [f"{getattr(fn, '__name__', fn)} failed on {self.world_size} ranks"]
            for rank, tb in sorted(failures.items()):
                message.append(f"--- rank {rank} ---\n{tb}")
            if missing:
                message.append(f"ranks {missing} gave no result within {timeout:.0f}s "
                               f"(hung in a collective or died)")
            raise AssertionError("\n".join(message))
        return [outputs[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


_POOLS: dict[int, RankPool] = {}

# DeepSpeed's CPU ops, JIT-built (torch.utils.cpp_extension) the first time a run needs them: about 95 s on 2 cores
# from nothing, and again whenever the interpreter's headers move (each fresh CI venv). Built here, once per
# session, in the test process and with no deadline, before any pool rank or launched run could: a rank killed
# by its test's timeout while it held cpp_extension's build lock left the lock behind, and every later run that
# needed the op then waited on it until its own timeout (one CI run spent its 90 minutes that way). DeepSpeed's
# FusedAdam is not among them: no run here uses it (hybrid gives DeepSpeed torch's fused AdamW, ds_config.py), and
# its build was 47 s of every fresh session.
DEEPSPEED_CPU_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")
STALE_LOCK_SECONDS = 600  # a build takes under 2 minutes: a lock this old was left by a killed process
_OPS_BUILT = False


def build_deepspeed_cpu_ops() -> None:
    global _OPS_BUILT
    if _OPS_BUILT:
        return
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory
    if get_accelerator().device_name() != "cpu":  # (on a GPU machine DeepSpeed's own ops are other builders)
        _OPS_BUILT = True
        return
    for name in DEEPSPEED_CPU_OPS:
        builder = get_accelerator().create_op_builder(name)
        lock = os.path.join(_get_build_directory(builder.name, verbose=False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_SECONDS:
            print(f"removing {lock}, left by a process killed while it built {builder.name} (cpp_extension would wait "
                  f"on it forever)")
            os.remove(lock)
        builder.load(verbose=False)
    _OPS_BUILT = True


def run_on_ranks(fn: Callable, world_size: int, *args, timeout: float = 300,
                 failed: Optional[Callable[[Any], bool]] = None, partial: bool = False, **kwargs) -> list[Any]:
    """Call `fn(*args, **kwargs)` on each of `world_size` gloo ranks; return the results by rank.

    `fn` must be importable (a module-level function). Raises AssertionError carrying every
    failing rank's traceback (`failed` and `partial`: see RankPool.run).
    """
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        build_deepspeed_cpu_ops()
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool.run(fn, args, kwargs, timeout, failed=failed, partial=partial)


@atexit.register
def close_pools() -> None:
    """Stop every pool."""
    for pool in list(_POOLS.values()):
        pool.close()


KEPT_WORLD_SIZES = (1, 2, 4)  # the pools most modules use: kept warm for the next module (4: 15 modules use it)
KEPT_RANK_BYTES = 3 << 30  # a rank grown past this (imports, allocator arenas) is started afresh instead
KEPT_POOL_BYTES = 5 << 30  # and a pool whose ranks hold more than this together (unique pages: psutil's uss)


def close_large_pools() -> None:
    """A test module's teardown: stop the pools of other sizes than KEPT_WORLD_SIZES (the 8-rank one: idle, it holds
    memory later tests need), any whose rank has grown past KEPT_RANK_BYTES and any past KEPT_POOL_BYTES in all; the
    1-, 2- and 4-rank pools stay for the next module. Starting a pool and importing the entry points on it took about
    6 s on 2 cores, once per module and world size: 3-4 minutes of a full suite. Each task's process groups are
    destroyed after it and each engine released (hybrid.training.deepspeed_fixes.release_engine), so an idle pool
    holds only its world group."""
    import psutil
    for world_size, pool in list(_POOLS.items()):
        try:
            sizes = [psutil.Process(p.pid).memory_full_info().uss for p in pool.procs]
        except psutil.Error:  # a rank gone: the next call starts the pool again
            sizes = [KEPT_RANK_BYTES]
        if world_size not in KEPT_WORLD_SIZES or max(sizes) >= KEPT_RANK_BYTES or sum(sizes) >= KEPT_POOL_BYTES:
            pool.close()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-5, what: str = "") -> None:
    """Max-abs-difference check that names the tensor and the difference."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    diff = (actual.detach().double() - expected.detach().double()).abs().max().item() if actual.numel() else 0.0
    if not diff <= atol:
        raise AssertionError(f"{what}: max abs diff {diff:.3e} > {atol:.1e}")
