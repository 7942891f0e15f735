"""DeepSpeed checkpoints plus our client state; the `latest` pointer moves only after a full save.

DeepSpeed writes the files (model states per TP/PP rank, ZeRO optimizer partitions per DP rank).
We add: iteration, consumed samples, the flags and configs, every RNG state, and DeepSpeed's
`universal_checkpoint_info` patterns so its universal-checkpoint tools can reshape the files.
DeepSpeed's own `latest` write can precede other ranks' files reaching disk, so we save with
save_latest=False, wait for every rank, then rename a complete `latest` into place.
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist
from deepspeed.checkpoint import constants as ds_constants

from hybrid.config import RunConfig, config_summary
from hybrid.errors import ConfigError
from hybrid.parallel.random import get_rng_states, set_rng_states
from hybrid.training.logging import log

LATEST = "latest"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def universal_checkpoint_info(run: RunConfig) -> dict:
    """How each parameter is laid out over TP, in DeepSpeed's universal-checkpoint vocabulary."""
    c = ds_constants
    info = {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.VOCABULARY_PARAMETER_PATTERNS: [r".*word_embeddings\.weight$", r".*output_layer\.weight$"],
        c.TP_REPLICATED_PARAMETER_PATTERNS: [r".*norm\.weight$", r".*norm\.bias$", r".*position_embeddings\.weight$",
                                             r".*attention\.dense\.bias$", r".*mlp\.fc2\.bias$"],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r".*attention\.dense\.weight$", r".*mlp\.fc2\.weight$"],
        c.PARAMETER_TO_AVERAGE_PATTERNS: [],
    }
    if run.model.swiglu:  # fc1 holds [gate; up], each split over TP
        info[c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [r".*mlp\.fc1\.weight$", r".*mlp\.fc1\.bias$"]
    return info


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(engine, run: RunConfig, save_dir: str, iteration: int, consumed_samples: int) -> str:
    """Save through DeepSpeed, then point `latest` at it."""
    tag = tag_for(iteration)
    client_state = {
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "args": run.args,
        "hybrid_config": config_summary(run),
        "rng_states": get_rng_states(),
        ds_constants.UNIVERSAL_CHECKPOINT_INFO: universal_checkpoint_info(run),
    }
    os.makedirs(save_dir, exist_ok=True)
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written before the pointer moves
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_atomic(os.path.join(save_dir, LATEST), tag)
        _write_atomic(os.path.join(save_dir, MEGATRON_LATEST), str(iteration))
    if dist.is_initialized():
        dist.barrier()
    log(f"saved checkpoint {tag} to {save_dir}")
    return tag


def latest_tag(load_dir: str) -> Optional[str]:
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    if not os.path.isdir(os.path.join(load_dir, tag)):
        raise ConfigError(f"--load {load_dir}: 'latest' names {tag!r}, which does not exist; the checkpoint "
                          f"directory is incomplete.")
    return tag


def load(engine, run: RunConfig) -> tuple[int, int]:
    """Load --load into the engine; returns (iteration, consumed samples) to continue from.

    --finetune: weights only, fresh optimizer, schedule and counters. --no-load-optim: no
    optimizer or schedule state. --no-load-rng: keep this run's seeds.
    """
    train = run.train
    load_dir = train.load
    if not os.path.isdir(load_dir) and os.path.abspath(load_dir) != os.path.abspath(train.save or ""):
        raise ConfigError(f"--load {load_dir}: no such directory.")
    tag = latest_tag(load_dir) if os.path.isdir(load_dir) else None
    if tag is None:
        if train.finetune:
            raise ConfigError(f"--load {load_dir} --finetune: no checkpoint there (no '{LATEST}' file).")
        log(f"WARNING: no checkpoint found in {load_dir} (no '{LATEST}' file); training from scratch.")
        return 0, 0
    weights_only = train.finetune or train.no_load_optim
    try:
        path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=not weights_only, load_lr_scheduler_states=not weights_only,
            load_module_only=weights_only)
    except (FileNotFoundError, RuntimeError, KeyError) as e:
        raise ConfigError(f"--load {load_dir}: could not load checkpoint {tag}: {e}. Was it saved with the same "
                          f"--tensor-model-parallel-size/--pipeline-model-parallel-size? Reshard it with "
                          f"conversion/checkpoint_util.py.") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}.")
    client_state = client_state or {}
    if train.finetune:
        log(f"loaded weights from {load_dir}/{tag} for fine-tuning; optimizer, schedule and iteration start fresh")
        return 0, 0
    if not train.no_load_rng and "rng_states" in client_state:
        set_rng_states(client_state["rng_states"])
    iteration = int(client_state.get("iteration", 0))
    log(f"loaded checkpoint {load_dir}/{tag} at iteration {iteration}")
    return iteration, int(client_state.get("consumed_samples", 0))
