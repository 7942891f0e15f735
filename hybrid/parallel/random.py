"""TP-aware random number generation.

Two streams, as in Megatron-LM: the default generator is seeded identically on every rank of a
TP group (dropout on replicated activations matches across TP ranks), and a tracked
"model-parallel" stream is seeded per TP rank (dropout on TP-sharded activations differs).

The tracker is DeepSpeed's own (`deepspeed.checkpointing.get_cuda_rng_tracker()`, which works
on any accelerator despite the name) because `deepspeed.checkpointing.checkpoint` saves and
restores exactly that tracker's states when it recomputes a layer; using another would make
recomputed dropout masks differ from the original ones.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

# our name for the per-TP-rank stream in the tracker (DeepSpeed's own choice of name, so checkpoints'
# rng_states keep their key; every fork names it, nothing relies on DeepSpeed's default)
MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron-LM's offset between the data-parallel and TP seeds


def get_rng_tracker():
    """The RNG tracker shared with `deepspeed.checkpointing`."""
    return ds_checkpointing.get_cuda_rng_tracker()


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed python, numpy and torch with `seed`, and the TP stream with `seed + 2718 + tp_rank`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


@contextlib.contextmanager
def fork_tp_rng():
    """Run the enclosed ops (dropout on TP-sharded activations) on the per-TP-rank stream.

    Outside a configured tracker (no `model_parallel_seed` call yet) it is a no-op, so modules
    can be used standalone.
    """
    tracker = get_rng_tracker()
    if MODEL_PARALLEL_RNG not in tracker.get_states():
        yield
        return
    with tracker.fork(MODEL_PARALLEL_RNG):
        yield


def _numpy_state_to_tensors(state) -> tuple:
    """numpy's RNG state with its key array as a tensor, so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, cached = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


def _numpy_state_from_tensors(state) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)


def get_rng_states() -> dict:
    """Every RNG state a resumed run needs to continue bit-identically."""
    return {
        "python": random.getstate(),
        "numpy": _numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_rng_tracker().get_states().items()},
    }


def set_rng_states(states: dict) -> None:
    """Restore states saved by `get_rng_states`."""
    random.setstate(states["python"])
    np.random.set_state(_numpy_state_from_tensors(states["numpy"]))
    torch.set_rng_state(states["torch"])
    get_accelerator().set_rng_state(states["accelerator"])
    get_rng_tracker().set_states({k: v.clone() for k, v in states["tracker"].items()})
