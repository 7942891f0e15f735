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
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from hybrid.checkpoint_format import (LATEST, LATEST_UNIVERSAL, MEGATRON_LATEST, ClientState, UnsafeCheckpointError,
                                      complete_tags, iteration_of, read_client_state, read_tag, tag_for,
                                      universal_checkpoint_info,
                                      verify_manifest, write_atomic, write_manifest)
from hybrid.config import RunConfig, config_summary
from hybrid.errors import ConfigError
from hybrid.parallel.random import get_rng_states, set_rng_states
from hybrid.training.logging import log

def optimizer_param_names(engine, run: RunConfig) -> Optional[list]:
    """Without ZeRO, the optimizer's state is indexed by parameter position; record each position's
    canonical name so the checkpoint can be made universal (hybrid.conversion.universal)."""
    if run.zero_stage != 0 or run.train.precision != "fp32":
        return None
    from hybrid.model.naming import canonical_parameters
    names = {id(p): name for name, p in canonical_parameters(engine.module, run.model.num_layers).items()}
    return [[names[id(p)] for p in group["params"]] for group in engine.optimizer.param_groups]


def _universal_info(run: RunConfig) -> dict:
    """DeepSpeed's pipeline engine names parameters by layer index; the virtual stages (and PP = 1)
    by canonical name, plus the last stage's copy of a tied table."""
    from hybrid.model.naming import TIED_COPY_WEIGHT
    tied_copy = TIED_COPY_WEIGHT if run.virtual_pipeline and run.model.tied_embeddings else None
    return universal_checkpoint_info(run.model, run.tensor_parallel, run.deepspeed_pipeline, tied_copy)


def save(engine, run: RunConfig, save_dir: str, iteration: int, consumed_samples: int, sequence=None) -> str:
    """Save through DeepSpeed, then point `latest` at it."""
    tag = write_files(engine, run, save_dir, iteration, consumed_samples, sequence)
    finalize(engine, save_dir, tag)
    return tag


def write_files(engine, run: RunConfig, save_dir: str, iteration: int, consumed_samples: int, sequence=None) -> str:
    """DeepSpeed's files of this checkpoint (with --async-save: their host copies, handed to the background
    writer); no manifest, no pointer yet. Returns the tag. `sequence`: the CP / Ulysses Axis, whose ranks'
    RNG states are all kept (one of them writes the client state)."""
    tag = tag_for(iteration)
    universal = _universal_info(run)
    if run.model.num_experts:  # DeepSpeed's MoE save takes these from the module and refuses them as client state
        engine.module.universal_checkpoint_info, universal = universal, None
    client_state = ClientState(iteration=iteration, consumed_samples=consumed_samples, args=run.args,
                               hybrid_config=config_summary(run), rng_states=get_rng_states(sequence),
                               universal_checkpoint_info=universal,
                               optimizer_param_names=optimizer_param_names(engine, run))
    os.makedirs(save_dir, exist_ok=True)
    state = client_state.to_dict()
    if universal is None:
        del state["universal_checkpoint_info"]  # a key DeepSpeed's MoE save reserves (it writes the module's)
    engine.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False)
    return tag


def finalize(engine, save_dir: str, tag: str) -> None:
    """Once every rank's files of `tag` are on disk (--async-save: its background writes done), record
    them in the manifest and move `latest` and Megatron's pointer to it."""
    writer = getattr(engine, "checkpoint_engine", None)
    if hasattr(writer, "wait"):
        writer.wait()  # this rank's background writes
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written before the manifest and the pointer
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_manifest(os.path.join(save_dir, tag))  # what complete means for this checkpoint
        write_atomic(os.path.join(save_dir, LATEST), tag)
        write_atomic(os.path.join(save_dir, MEGATRON_LATEST), str(iteration_of(tag)))
    if dist.is_initialized():
        dist.barrier()
    log(f"saved checkpoint {tag} to {save_dir}")


def latest_tag(load_dir: str) -> Optional[str]:
    return read_tag(load_dir, LATEST)


def start(engine, run: RunConfig, topology) -> tuple[int, int]:
    """Where the run starts: the checkpoint in --load when there is one (a restart), else --load-hf's
    weights, else --load's messages, else from scratch. Returns (iteration, consumed samples)."""
    train = run.train
    if train.load_hf and not (train.load and os.path.isdir(train.load) and latest_tag(train.load)):
        return load_hf(engine, run, topology)
    return load(engine, run, topology) if train.load else (0, 0)


def load_hf(engine, run: RunConfig, topology) -> tuple[int, int]:
    """--load-hf: the HF model's weights, converted to canonical names and sharded for this rank (every
    layout, every ZeRO stage); the optimizer and LR schedule start fresh at iteration 0."""
    from hybrid.conversion.hf import read_hf_dir
    state, _, _ = read_hf_dir(run.train.load_hf, flag="--load-hf")
    load_full_state(engine.module, state, run.model, topology)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO / bf16 masters follow the new weights
    log(f"loaded the {run.model.family} weights of {run.train.load_hf} (--load-hf); optimizer, schedule and "
        f"iteration start fresh")
    return 0, 0


def load(engine, run: RunConfig, topology) -> tuple[int, int]:
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
    if train.universal_checkpoint:
        return _load_universal(engine, run, load_dir, topology)
    tag = complete_tag(load_dir, tag)
    saved = read_client_state(load_dir, tag)
    if train.finetune or saved.weights_only:
        return _load_weights_only(engine, run, topology, load_dir, tag, saved)
    check_same_layout(saved, run, load_dir, tag)
    try:
        path, client_state = engine.load_checkpoint(
            load_dir, tag=tag, load_optimizer_states=not train.no_load_optim,
            load_lr_scheduler_states=not train.no_load_optim, load_module_only=train.no_load_optim)
    except UnsafeCheckpointError:
        raise
    except (FileNotFoundError, RuntimeError, KeyError, AssertionError, ValueError, ZeRORuntimeException) as e:
        raise ConfigError(f"--load {load_dir}: could not load checkpoint {tag}: {e}. To load it anyway, "
                          f"{_fix_command(load_dir)}.") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}.")
    iteration, consumed = _restore_client_state(client_state, train, topology.groups.sequence)
    log(f"loaded checkpoint {load_dir}/{tag} at iteration {iteration}")
    return iteration, consumed


def complete_tag(load_dir: str, tag: str) -> str:
    """`tag` if its files are as its manifest lists them; else the newest older complete checkpoint (said
    in the log), or an error naming the file when there is none."""
    problem = verify_manifest(os.path.join(load_dir, tag))
    if problem is None:
        return tag
    older = [t for t in complete_tags(load_dir) if t < tag]
    if not older:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} is incomplete: {problem}; no complete older "
                          f"checkpoint is there to resume from.")
    log(f"WARNING: checkpoint {tag} in {load_dir} is incomplete ({problem}); resuming from {older[0]}, the newest "
        f"complete checkpoint")
    return older[0]


def _restore_client_state(client_state: Optional[dict], train, sequence=None) -> tuple[int, int]:
    state = ClientState.from_meta(client_state)
    if not train.no_load_rng and state.rng_states is not None and not set_rng_states(state.rng_states, sequence):
        log("the checkpoint's RNG states are for another number of context-parallel / Ulysses ranks: the dropout "
            "streams continue from this run's seed")
    return int(state.iteration), int(state.consumed_samples)


def _fix_command(load_dir: str) -> str:
    return (f"make a universal checkpoint of it (python conversion/checkpoint_util.py --saver universal "
            f"--load-dir {load_dir}) and add --universal-checkpoint, which keeps the optimizer state; or load "
            f"its weights only with --finetune")


def check_same_layout(state: ClientState, run: RunConfig, load_dir: str, tag: str) -> None:
    """A plain (non-universal) load needs the saved TP, PP, and, with ZeRO optimizer state, DP and
    ZeRO stage: one message names what differs and the command that fixes it."""
    saved = state.hybrid_config
    saved_stage = state.zero_stage
    differences = [f"{what} {saved[key]} (this run: {now})" for what, key, now in (
        ("--tensor-model-parallel-size", "tensor_parallel", run.tensor_parallel),
        ("--pipeline-model-parallel-size", "pipeline_parallel", run.pipeline_parallel)) if saved.get(key, now) != now]
    if run.pipeline_parallel > 1 and saved.get("pipeline_parallel") == run.pipeline_parallel:
        from hybrid.capabilities import stage_placement
        before = stage_placement(saved.get("pipeline_schedule", "1f1b"), saved.get("virtual_stages", 1))
        now = stage_placement(run.pipeline_schedule, run.virtual_stages)
        if before != now:
            differences.append(f"pipeline stages: {before} (this run: {now})")
    if not run.train.no_load_optim:
        if saved_stage != run.zero_stage:
            differences.append(f"ZeRO stage {saved_stage} (this run: {run.zero_stage})")
        elif saved_stage > 0 and saved.get("data_parallel", run.data_parallel) != run.data_parallel:
            differences.append(f"data-parallel size {saved['data_parallel']} (this run: {run.data_parallel}; ZeRO "
                               f"partitions the optimizer state over it)")
        elif saved_stage > 0 and (saved.get("context_parallel", 1), saved.get("ulysses", 1)) != (
                run.context_parallel, run.ulysses):
            differences.append(f"--context-parallel-size {saved.get('context_parallel', 1)} and "
                               f"--ds-sequence-parallel-size {saved.get('ulysses', 1)} (this run: "
                               f"{run.context_parallel} and {run.ulysses}; ZeRO partitions the optimizer state over "
                               f"DP x CP)")
    saved_ep = saved.get("expert_parallel", 1)
    if run.model.num_experts and saved_ep != run.expert_parallel and not run.train.no_load_optim:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} was saved with --expert-model-parallel-size {saved_ep} "
                          f"(this run: {run.expert_parallel}; the experts' optimizer state is partitioned over "
                          f"DP / EP). To resume at this layout with the optimizer, {_fix_command(load_dir)}; or add "
                          f"--no-load-optim (the weights at this layout, a fresh optimizer).")
    if differences:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} was saved with {'; '.join(differences)}. To resume "
                          f"at this layout, {_fix_command(load_dir)}.")


def _load_universal(engine, run: RunConfig, load_dir: str, topology) -> tuple[int, int]:
    """--universal-checkpoint: DeepSpeed loads the per-parameter fp32 weights and Adam moments and
    slices them for this rank's TP/PP/DP position (its `load_universal` mode)."""
    tag = read_tag(load_dir, LATEST_UNIVERSAL)
    if tag is None:
        raise ConfigError(f"--load {load_dir} --universal-checkpoint: no universal checkpoint there (no "
                          f"'{LATEST_UNIVERSAL}' file). Make one from its last checkpoint with: python "
                          f"conversion/checkpoint_util.py --saver universal --load-dir {load_dir}")
    from hybrid.training import deepspeed_fixes
    deepspeed_fixes.use_canonical_param_names(engine, run.model.num_layers)
    try:
        path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    except UnsafeCheckpointError:
        raise
    except (FileNotFoundError, RuntimeError, KeyError, AssertionError, ValueError) as e:
        raise ConfigError(f"--load {load_dir} --universal-checkpoint: could not load {tag}: {type(e).__name__}: {e}") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load universal checkpoint {tag}.")
    if run.zero_stage == 3:
        deepspeed_fixes.repair_zero3_universal_load(engine, os.path.join(load_dir, tag))
    if run.model.num_experts:
        _restore_score_biases(engine, os.path.join(load_dir, tag), run.model.num_layers)
    iteration, consumed = _restore_client_state(client_state, run.train, topology.groups.sequence)
    decays = ", ".join(f"{group['weight_decay']:g}" for group in engine.optimizer.param_groups)
    log(f"loaded universal checkpoint {load_dir}/{tag} at iteration {iteration} (weight decay per parameter "
        f"group: {decays})")
    return iteration, consumed


def _restore_score_biases(engine, universal_dir: str, num_layers: int) -> None:
    """A universal load restores parameters only (DeepSpeed 0.19 skips the module state there); the
    routers' score biases are buffers, trained by their updates: copied from the source's model file."""
    from hybrid.checkpoint_format import first_model_file, load_file
    from hybrid.model.naming import canonical_name
    saved = {canonical_name(name, num_layers): value for name, value in
             load_file(first_model_file(universal_dir))["module"].items() if name.endswith("router.score_bias")}
    import torch
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name.endswith("router.score_bias"):
                buffer.copy_(saved[canonical_name(name, num_layers)])


def load_full_state(model, state: dict, config, topology) -> None:
    """Copy a full canonical state dict into this rank's (TP-sharded, possibly ZeRO-3) parameters."""
    import deepspeed
    import torch
    from hybrid.conversion.layout import shard_for_rank
    from hybrid.model.naming import canonical_parameters
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


def _load_weights_only(engine, run: RunConfig, topology, load_dir: str, tag: str,
                       saved: ClientState) -> tuple[int, int]:
    """--finetune, or a converted checkpoint: weights from any layout, fresh optimizer and schedule."""
    from hybrid.conversion.layout import read_hybrid
    state, _ = read_hybrid(load_dir, tag)
    load_full_state(engine.module, state, run.model, topology)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO / bf16 masters follow the new weights
    if run.train.finetune:
        log(f"loaded weights from {load_dir}/{tag} for fine-tuning; optimizer, schedule and iteration start fresh")
        return 0, 0
    iteration, consumed = int(saved.iteration), int(saved.consumed_samples)
    # a pretraining run resumed from weights only: the LR schedule continues where the run was
    # (Megatron's scheduler position is the consumed samples, or tokens), only Adam starts fresh
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "set_position"):
        scheduler.set_position(consumed * (run.train.seq_length if scheduler.unit == "tokens" else 1))
    log(f"loaded weights of {load_dir}/{tag} (a converted checkpoint: weights only, the optimizer starts "
        f"fresh) at iteration {iteration}; the LR schedule continues from there")
    return iteration, consumed
