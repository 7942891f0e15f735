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

    --finetune: weights only (from any TP/PP layout), fresh optimizer, schedule and counters.
    --no-load-optim: no optimizer or schedule state. --no-load-rng: keep this run's seeds.
    Checkpoints written by conversion hold weights only and load like --no-load-optim.
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
    meta = read_meta(load_dir, tag)
    if train.finetune or meta.get("weights_only"):
        return _load_weights_only(engine, run, load_dir, tag, meta)
    try:
        path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=not train.no_load_optim,
            load_lr_scheduler_states=not train.no_load_optim, load_module_only=train.no_load_optim)
    except (FileNotFoundError, RuntimeError, KeyError, AssertionError) as e:
        raise ConfigError(f"--load {load_dir}: could not load checkpoint {tag}: {e}. Was it saved with the same "
                          f"--tensor-model-parallel-size/--pipeline-model-parallel-size and ZeRO stage? Reshard "
                          f"it with conversion/checkpoint_util.py, or load its weights with --finetune.") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}.")
    client_state = client_state or {}
    if not train.no_load_rng and "rng_states" in client_state:
        set_rng_states(client_state["rng_states"])
    iteration = int(client_state.get("iteration", 0))
    log(f"loaded checkpoint {load_dir}/{tag} at iteration {iteration}")
    return iteration, int(client_state.get("consumed_samples", 0))


def read_meta(load_dir: str, tag: str) -> dict:
    """Client state and DeepSpeed metadata of a checkpoint (rank 0's model-states file, no weights)."""
    from hybrid.conversion.layout import first_model_file, load_file
    meta = load_file(first_model_file(os.path.join(load_dir, tag)))
    meta.pop("module", None)
    return meta


def load_full_state(model, state: dict, config, topology) -> None:
    """Copy a full canonical state dict into this rank's (TP-sharded, possibly ZeRO-3) parameters."""
    import deepspeed
    import torch
    from hybrid.conversion.layout import shard_for_rank
    from hybrid.model.gpt import canonical_parameters
    params = canonical_parameters(model, config.num_layers)
    missing = sorted(set(params) - set(state))
    if missing:
        raise ConfigError(f"--load: the checkpoint lacks {missing[:5]} (a different model shape?).")
    modifier = topology.grid.get_data_parallel_group_ranks()[0]  # ZeRO-3 re-partitions from here
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=modifier):
        with torch.no_grad():
            for name, param in params.items():
                value = shard_for_rank(name, state[name], config, topology.tp_world_size, topology.tp_rank)
                if tuple(value.shape) != tuple(param.shape):
                    raise ConfigError(f"--load: {name} has shape {tuple(value.shape)} in the checkpoint but "
                                      f"{tuple(param.shape)} in the model; check the model flags.")
                param.copy_(value)


def _load_weights_only(engine, run: RunConfig, load_dir: str, tag: str, meta: dict) -> tuple[int, int]:
    """--finetune, or a converted checkpoint: weights from any layout, fresh optimizer and schedule."""
    from hybrid.conversion.layout import read_hybrid
    state, _ = read_hybrid(load_dir, tag)
    load_full_state(engine.module, state, run.model, engine.hybrid_topology)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO / bf16 masters follow the new weights
    if run.train.finetune:
        log(f"loaded weights from {load_dir}/{tag} for fine-tuning; optimizer, schedule and iteration start fresh")
        return 0, 0
    iteration, consumed = int(meta.get("iteration", 0)), int(meta.get("consumed_samples", 0))
    # a pretraining run resumed from weights only: the LR schedule continues where the run was
    # (Megatron's scheduler position is the consumed samples, or tokens), only Adam starts fresh
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "set_position"):
        scheduler.set_position(consumed * (run.train.seq_length if scheduler.unit == "tokens" else 1))
    log(f"loaded weights of {load_dir}/{tag} (a converted checkpoint: weights only, the optimizer starts "
        f"fresh) at iteration {iteration}; the LR schedule continues from there")
    return iteration, consumed
