"""Start torch.distributed (and DeepSpeed's comm layer over it) from the launcher's environment.

Works under `deepspeed`, `torchrun`, `accelerate launch` (RANK/WORLD_SIZE/MASTER_ADDR set) and
plain `python` (one rank: a local rendezvous is made up). NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from hybrid.torch_fixes import groups_time_out_after


def is_rank_zero() -> bool:
    """Rank 0 of the job (before torch.distributed starts: the launcher's RANK)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def log(message: str, all_ranks: bool = False) -> None:
    """Print on rank 0 (or every rank, prefixed with its number): the one log of every floor (the training
    loop's metrics go through hybrid.training.logging)."""
    if all_ranks and dist.is_initialized():
        print(f"[rank {dist.get_rank()}] {message}", flush=True)
    elif is_rank_zero():
        print(message, flush=True)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def resolve_backend(requested: Optional[str]) -> str:
    """--distributed-backend: gloo is honoured everywhere; nccl needs CUDA, so on a machine without
    a GPU (a Megatron script's `--distributed-backend nccl` run on CPU ranks) gloo is used and
    said, as DeepSpeed's CPU accelerator does."""
    if requested == "nccl" and not torch.cuda.is_available():
        if os.environ.get("RANK", "0") == "0":
            print("--distributed-backend nccl: no CUDA device here, using gloo", flush=True)
        return "gloo"
    return requested or default_backend()


def _restart_safe_store(timeout) -> dict:
    """Under torchrun (its agent hosts the TCP store) a store whose keys are this restart attempt's own.
    torchrun keeps one store across `--max-restarts` attempts, so with the plain env:// rendezvous a
    restarted rank can read the previous attempt's gloo/NCCL addresses and wait on a peer that no
    longer exists (seen: restarted jobs hanging in init_process_group). Elsewhere: env:// as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"/hybrid/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def share_cpu_cores() -> Optional[int]:
    """CPU ranks without OMP_NUM_THREADS: each takes its share of this machine's cores (as torchrun's
    OMP_NUM_THREADS=1 does with one core per rank), not all of them. DeepSpeed's launcher sets no
    thread count, so its ranks would each run every core's worth of threads on the same cores (measured:
    TP 2 at 0.95x DeepSpeed's AutoTP that way, 1.22x with one thread per rank). Returns the threads set
    (None: a GPU machine, or OMP_NUM_THREADS given)."""
    if torch.cuda.is_available() or os.environ.get("OMP_NUM_THREADS"):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, local))
    torch.set_num_threads(threads)
    return threads


def init_distributed(timeout_minutes: float = 10.0, backend: Optional[str] = None) -> None:
    """Initialise torch.distributed from the environment if needed (`backend`: --distributed-backend,
    default nccl on CUDA, gloo on CPU), then DeepSpeed's comm. `timeout_minutes`
    (--distributed-timeout-minutes) bounds every collective of every group made afterwards; a call
    when torch.distributed is already initialised changes neither."""
    import deepspeed  # not at the top: data tools import this module and never need DeepSpeed (seconds to load)

    timeout = datetime.timedelta(minutes=timeout_minutes)
    share_cpu_cores()
    if not dist.is_initialized():
        groups_time_out_after(timeout)  # DeepSpeed's groups too, not only the world group
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"] if os.environ["WORLD_SIZE"] == "1" else "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(resolve_backend(backend), timeout=timeout, **_restart_safe_store(timeout))
    # Wraps the existing process group; DeepSpeed's grid and engine call deepspeed.comm.
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, timeout=timeout)


def end_distributed(owned: bool, clean: bool) -> None:
    """An entry point's last step. `owned`: torch.distributed was not initialised when the entry started (it
    made the groups, so it tears them down; a caller that made them, such as a pool of ranks running entries
    in turn, keeps them). `clean`: every rank reached this point (no error on some ranks only), so a barrier
    first lets every rank finish its last collective and send before any rank destroys its groups (a rank
    destroying its gloo groups while a peer still talks to it aborts the peer)."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    if owned:
        dist.destroy_process_group()
