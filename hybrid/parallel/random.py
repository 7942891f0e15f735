"""TP-aware random number generation.

Two streams, as in Megatron-LM: the default generator is seeded identically on every rank of a
TP group (dropout on replicated activations matches across TP ranks), and a tracked
"model-parallel" stream is seeded per TP rank (dropout on TP-sharded activations differs). Both are
offset per sequence-split rank (CP or Ulysses): those ranks hold different tokens (CP) or different
heads of the same tokens (Ulysses' attention), so equal streams would repeat one dropout pattern on
them. Checkpoints keep every sequence rank's states (get_rng_states gathers them).

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
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

# our name for the per-TP-rank stream in the tracker (DeepSpeed's own choice of name, so checkpoints'
# rng_states keep their key; every fork names it, nothing relies on DeepSpeed's default)
MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron-LM's offset between the data-parallel and TP seeds
_SEQUENCE_SEED_OFFSET = 1009  # between the streams of sequence-split (CP / Ulysses) ranks


def get_rng_tracker():
    """The RNG tracker shared with `deepspeed.checkpointing`."""
    return ds_checkpointing.get_cuda_rng_tracker()


def model_parallel_seed(seed: int, tp_rank: int, sequence_rank: int = 0) -> None:
    """Seed python and numpy with `seed`, torch with `seed + 1009 x sequence_rank` (the CP / Ulysses rank),
    and the TP stream with that plus `2718 + tp_rank`."""
    random.seed(seed)
    np.random.seed(seed)
    base = seed + _SEQUENCE_SEED_OFFSET * sequence_rank
    torch.manual_seed(base)
    get_accelerator().manual_seed_all(base)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, base + _TP_SEED_OFFSET + tp_rank)


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


def get_rng_states(sequence=None) -> dict:
    """Every RNG state a resumed run needs to continue bit-identically. `sequence`: the CP / Ulysses Axis;
    when it spans several ranks their states are gathered (a collective over it: every rank calls this),
    {"sequence_ranks": [states of rank 0, 1, ...]}, since one of them writes the checkpoint."""
    own = _own_rng_states()
    if sequence is None or sequence.size == 1:
        return own
    every = [None] * sequence.size
    dist.all_gather_object(every, own, group=sequence.group)
    return {"sequence_ranks": every}


def _own_rng_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": _numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_rng_tracker().get_states().items()},
    }


def set_rng_states(states: dict, sequence=None) -> bool:
    """Restore states saved by `get_rng_states` (this sequence rank's, when they are per sequence rank).
    False, restoring nothing, when they were saved for another number of sequence ranks."""
    if "sequence_ranks" in states:
        every = states["sequence_ranks"]
        size, rank = (sequence.size, sequence.rank) if sequence is not None else (1, 0)
        if len(every) != size:
            return False
        states = every[rank]
    elif sequence is not None and sequence.size > 1:
        return False  # one rank's states (saved without a sequence split): not this split's streams
    random.setstate(states["python"])
    np.random.set_state(_numpy_state_from_tensors(states["numpy"]))
    torch.set_rng_state(states["torch"])
    get_accelerator().set_rng_state(states["accelerator"])
    get_rng_tracker().set_states({k: v.clone() for k, v in states["tracker"].items()})
    return True
