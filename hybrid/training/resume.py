"""Where a run starts: a checkpoint in --load (DeepSpeed's own load at the same layout, a universal
checkpoint at any layout, or weights only from any layout), --load-hf's weights, or from scratch. Each load path
says what it found (a `Start`), and one epilogue (`begin`) ends them all."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from hybrid.capabilities import stage_placement
from hybrid.checkpoint.client_state import ClientState, SavedLayout, read_client_state
from hybrid.checkpoint.files import (LATEST, LATEST_UNIVERSAL, first_model_file, iteration_of, load_file, read_tag,
                                     write_atomic)
from hybrid.checkpoint.manifest import tag_to_resume, verify_manifest
from hybrid.config import RunConfig, checkpoint_summary
from hybrid.conversion.hf import hf_parts
from hybrid.conversion.layout import hybrid_parts, load_parts, table_block_rows
from hybrid.conversion.source import MEGATRON_DEEPSPEED, MEGATRON_KINDS, checkpoint_kind, open_source
from hybrid.conversion.megatron.universal import write_universal
from hybrid.conversion.universal import convert
from hybrid.data.plan import plan_changes
from hybrid.errors import ConfigError
from hybrid.model.naming import canonical_name, names_to_load
from hybrid.parallel.random import set_rng_states
from hybrid.safe_loading import UnsafeCheckpointError
from hybrid.training import deepspeed_fixes
from hybrid.training.logging import log

MEGATRON_UNIVERSAL = ".megatron-universal"  # under --save: a Megatron checkpoint's Adam state while it loads
PIPELINE_ENGINE_UNIVERSAL = ".pipeline-engine-universal"  # under --save: the same for a pipeline-engine checkpoint


def latest_tag(load_dir: str) -> Optional[str]:
    return read_tag(load_dir, LATEST)


def already_finished(run: RunConfig) -> bool:
    """A restart (--load = --save) whose newest complete checkpoint is the run's last iteration has
    nothing to do: it says so, and the caller exits before building anything (no process group, no save)."""
    c = run.checkpoint
    if not c.load or c.finetune or c.universal_checkpoint or not os.path.isdir(c.load):
        return False
    tag = read_tag(c.load)
    iteration = iteration_of(tag)
    if iteration is None or iteration < run.training.train_iters or verify_manifest(os.path.join(c.load, tag)):
        return False
    log(f"nothing to train: the newest checkpoint in {c.load} ({tag}) is at iteration {iteration}, the end of "
        f"the run (--train-iters {run.training.train_iters}); exiting")
    return True


@dataclass
class Start:
    """Where a run starts, as one load path found it; `begin` ends every path the same way."""

    said: str  # the log line
    iteration: int = 0
    consumed: int = 0
    state: Optional[ClientState] = None  # hybrid's record of the checkpoint: its data plan (and RNG streams)
    restore_rng: bool = False  # the checkpoint's RNG streams continue (DeepSpeed loaded its engine state)
    copied_weights: bool = False  # weights copied into the module: ZeRO's / bf16's fp32 masters must follow
    schedule_at_consumed: bool = False  # the LR schedule moves to the consumed samples (DeepSpeed did not load it)


def begin(engine, run: RunConfig, groups, start: Start) -> tuple[int, int]:
    """The one epilogue of every load path: the fp32 masters follow copied weights, the checkpoint's RNG streams
    and data plan, the LR schedule's position, one log line. Returns (iteration, consumed samples)."""
    if start.copied_weights and hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()  # ZeRO / bf16 masters follow the new weights
    state = start.state
    if state is not None:
        if (start.restore_rng and not run.checkpoint.no_load_rng and state.rng_states is not None
                and not set_rng_states(state.rng_states, groups.sequence)):
            log("the checkpoint's RNG states are for another number of context-parallel / Ulysses ranks: the dropout "
                "streams continue from this run's seed")
        report_data_plan(state, run)
    if start.schedule_at_consumed:
        # Megatron's scheduler position is the consumed samples (or tokens); only Adam starts fresh
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and hasattr(scheduler, "set_position"):
            scheduler.set_position(start.consumed * (run.training.seq_length if scheduler.unit == "tokens" else 1))
    log(start.said)
    return start.iteration, start.consumed


def start(engine, run: RunConfig, groups) -> tuple[int, int]:
    """Where the run starts: the checkpoint in --load when there is one (a restart), else --load-hf's
    weights, else --load's messages, else from scratch. Returns (iteration, consumed samples)."""
    if starts_from_hf(run):
        return load_hf(engine, run, groups)
    return load(engine, run, groups) if run.checkpoint.load else (0, 0)


def starts_from_hf(run: RunConfig) -> bool:
    """The run begins at --load-hf's weights: given, and no checkpoint in --load to restart from."""
    c = run.checkpoint
    return bool(c.load_hf) and not (c.load and os.path.isdir(c.load) and latest_tag(c.load))


def load_hf(engine, run: RunConfig, groups) -> tuple[int, int]:
    """--load-hf: the HF model's weights, converted to canonical names and sharded for this rank (every
    layout, every ZeRO stage), read a layer at a time and only for this rank's stage and experts; the
    optimizer and LR schedule start fresh at iteration 0."""
    wanted = names_to_load(engine.module, run.model.num_layers, buffers=False)  # this rank's (stage, experts)
    # multi-token prediction layers the HF model does not store (--mtp-num-layers) start from their initialisation
    fresh = load_parts(engine.module, hf_parts(run.checkpoint.load_hf, run.model, wanted), run.model, groups,
                       may_start_fresh=("mtp.",))
    return begin(engine, run, groups, Start(
        f"loaded the {run.model.family} weights of {run.checkpoint.load_hf} (--load-hf); optimizer, schedule and "
        f"iteration start fresh" + ("; the multi-token prediction layers (not in it) from their initialisation"
                                    if fresh else ""), copied_weights=True))


def load(engine, run: RunConfig, groups) -> tuple[int, int]:
    """Load --load into the engine; returns (iteration, consumed samples) to continue from.

    --finetune: weights only (from any TP/PP layout), fresh optimizer, schedule and counters.
    --no-load-optim: no optimizer or schedule state. --no-load-rng: keep this run's seeds.
    Checkpoints written by conversion hold weights only and load like --no-load-optim.
    """
    return begin(engine, run, groups, _load(engine, run, groups))


def _load(engine, run: RunConfig, groups) -> Start:
    """The load path --load takes, and what it found."""
    c = run.checkpoint
    load_dir = c.load
    if not os.path.isdir(load_dir) and os.path.abspath(load_dir) != os.path.abspath(c.save or ""):
        raise ConfigError(f"--load {load_dir}: no such directory.")
    tag = latest_tag(load_dir) if os.path.isdir(load_dir) else None
    kind = checkpoint_kind(load_dir)
    if kind in MEGATRON_KINDS:  # Megatron-LM's (no hybrid `latest`) or Megatron-DeepSpeed's
        return _load_megatron(engine, run, groups, load_dir, kind)
    if c.universal_checkpoint and os.path.isdir(load_dir) and read_tag(load_dir, LATEST_UNIVERSAL) and tag is None:
        return _load_universal(engine, run, load_dir, groups)  # one made from a Megatron-LM checkpoint
    if tag is None:
        if c.finetune:
            raise ConfigError(f"--load {load_dir} --finetune: no checkpoint there (no '{LATEST}' file).")
        return Start(f"WARNING: no checkpoint found in {load_dir} (no '{LATEST}' file); training from scratch.")
    if c.universal_checkpoint:
        return _load_universal(engine, run, load_dir, groups)
    tag = complete_tag(load_dir, tag)
    saved = read_client_state(load_dir, tag)
    if c.finetune or saved.weights_only:
        return _load_weights_only(engine, run, groups, load_dir, tag, saved)
    if saved.layout.storage == "layer_files":  # DeepSpeed's pipeline engine wrote it
        return _load_pipeline_engine(engine, run, groups, load_dir, tag, saved)
    check_same_layout(saved, run, load_dir, tag)
    try:
        path, client_state = deepspeed_fixes.load_checkpoint(
            engine, load_dir, tag, load_optimizer_states=not c.no_load_optim,
            load_lr_scheduler_states=not c.no_load_optim, load_module_only=c.no_load_optim)
    except UnsafeCheckpointError:
        raise
    except (FileNotFoundError, RuntimeError, KeyError, AssertionError, ValueError, ZeRORuntimeException) as e:
        raise ConfigError(f"--load {load_dir}: could not load checkpoint {tag}: {e}. To load it anyway, "
                          f"{_fix_command(load_dir)}.") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load checkpoint {tag}.")
    return _resumed(client_state, lambda iteration: f"loaded checkpoint {load_dir}/{tag} at iteration {iteration}")


def complete_tag(load_dir: str, tag: str) -> str:
    """`tag` if its files are as its manifest lists them; else the newest older complete checkpoint (said
    in the log), or an error naming the file when there is none."""
    chosen, problem = tag_to_resume(load_dir, tag)
    if problem is None:
        return tag
    if not chosen:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} is incomplete: {problem}; no complete older "
                          f"checkpoint is there to resume from.")
    log(f"WARNING: checkpoint {tag} in {load_dir} is incomplete ({problem}); resuming from {chosen}, the newest "
        f"complete checkpoint")
    return chosen


def _resumed(client_state: Optional[dict], said) -> Start:
    """A checkpoint DeepSpeed loaded with its engine state: its counters, RNG streams and data plan continue;
    `said(iteration)`: the log line."""
    state = ClientState.from_meta(client_state)
    iteration = int(state.iteration)
    return Start(said(iteration), iteration, int(state.consumed_samples), state, restore_rng=True)


def report_data_plan(state: ClientState, run: RunConfig) -> None:
    """A resumed run continues at the checkpoint's consumed samples of its own data plan, as Megatron-LM does;
    where that plan is not the checkpoint's (hybrid.data.plan), one log line names each difference and the fix."""
    changes, batch = plan_changes(state.run, checkpoint_summary(run))
    where = f"consumed sample {state.consumed_samples} (iteration {state.iteration})"
    if batch:
        log(f"the checkpoint was trained with {batch}: continuing at {where}, the same order of samples taken "
            f"{run.training.global_batch_size} per iteration, as Megatron-LM does")
    if changes:
        log(f"WARNING: the checkpoint was trained on another data plan: {'; '.join(changes)}. This run continues "
            f"at {where} of its own plan, as Megatron-LM does, so the samples from there are not the ones the "
            f"saved run would have served next. To continue those exactly, give the checkpoint's values; to start "
            f"the new data from its first sample with these weights, add --finetune.")


def _fix_command(load_dir: str) -> str:
    return (f"make a universal checkpoint of it (python conversion/checkpoint_util.py --saver universal "
            f"--load-dir {load_dir}) and add --universal-checkpoint, which keeps the optimizer state; or load "
            f"its weights only with --finetune")


def _layout_differences(saved: SavedLayout, now: SavedLayout, with_optimizer: bool) -> list[str]:
    """What a plain load cannot bridge, field by field: TP, PP and the stage placement always; with the
    optimizer state also the ZeRO stage and, when ZeRO partitions it, DP and the sequence split."""
    differences = [f"{flag} {getattr(saved, field)} (this run: {getattr(now, field)})" for flag, field in (
        ("--tensor-model-parallel-size", "tensor_parallel"), ("--pipeline-model-parallel-size", "pipeline_parallel"))
        if getattr(saved, field) != getattr(now, field)]
    if now.pipeline_parallel > 1 and saved.pipeline_parallel == now.pipeline_parallel:
        before = stage_placement(saved.pipeline_schedule, saved.virtual_stages)
        after = stage_placement(now.pipeline_schedule, now.virtual_stages)
        if before != after:
            differences.append(f"pipeline stages: {before} (this run: {after})")
        elif saved.stage_layers and now.stage_layers and saved.stage_layers != now.stage_layers:
            differences.append(f"--pipeline-partition: stages of {list(saved.stage_layers)} transformer layers (this "
                               f"run: {list(now.stage_layers)})")
    if not with_optimizer:
        return differences
    if saved.zero_stage != now.zero_stage:
        differences.append(f"ZeRO stage {saved.zero_stage} (this run: {now.zero_stage})")
    elif saved.zero_stage > 0 and saved.data_parallel != now.data_parallel:
        differences.append(f"data-parallel size {saved.data_parallel} (this run: {now.data_parallel}; ZeRO "
                           f"partitions the optimizer state over it)")
    elif saved.zero_stage > 0 and (saved.context_parallel, saved.ulysses) != (now.context_parallel, now.ulysses):
        differences.append(f"--context-parallel-size {saved.context_parallel} and --ds-sequence-parallel-size "
                           f"{saved.ulysses} (this run: {now.context_parallel} and {now.ulysses}; ZeRO partitions "
                           f"the optimizer state over DP x CP)")
    return differences


def check_same_layout(state: ClientState, run: RunConfig, load_dir: str, tag: str) -> None:
    """A plain (non-universal) load needs the saved TP, PP, and, with ZeRO optimizer state, DP and
    ZeRO stage: one message names what differs and the command that fixes it."""
    saved, now = state.layout, run.saved_layout()
    with_optimizer = not run.checkpoint.no_load_optim
    if run.model.num_experts and saved.expert_parallel != now.expert_parallel and with_optimizer:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} was saved with --expert-model-parallel-size "
                          f"{saved.expert_parallel} (this run: {now.expert_parallel}; the experts' optimizer state is "
                          f"partitioned over DP / EP). To resume at this layout with the optimizer, "
                          f"{_fix_command(load_dir)}; or add --no-load-optim (the weights at this layout, a fresh "
                          f"optimizer).")
    differences = _layout_differences(saved, now, with_optimizer)
    if differences:
        raise ConfigError(f"--load {load_dir}: checkpoint {tag} was saved with {'; '.join(differences)}. To resume "
                          f"at this layout, {_fix_command(load_dir)}.")


def _load_universal(engine, run: RunConfig, load_dir: str, groups) -> Start:
    """--universal-checkpoint: DeepSpeed loads the per-parameter fp32 weights and Adam moments and
    slices them for this rank's TP/PP/DP position (its `load_universal` mode)."""
    tag = read_tag(load_dir, LATEST_UNIVERSAL)
    if tag is None:
        raise ConfigError(f"--load {load_dir} --universal-checkpoint: no universal checkpoint there (no "
                          f"'{LATEST_UNIVERSAL}' file). Make one from its last checkpoint with: python "
                          f"conversion/checkpoint_util.py --saver universal --load-dir {load_dir}")
    deepspeed_fixes.use_canonical_param_names(engine, run.model.num_layers)
    deepspeed_fixes.load_table_blocks_from_universal(engine, table_block_rows(engine.module))
    try:
        path, client_state = deepspeed_fixes.load_checkpoint(engine, load_dir, tag)
    except UnsafeCheckpointError:
        raise
    except (FileNotFoundError, RuntimeError, KeyError, AssertionError, ValueError) as e:
        raise ConfigError(f"--load {load_dir} --universal-checkpoint: could not load {tag}: {type(e).__name__}: "
                          f"{e}") from None
    if path is None:
        raise ConfigError(f"--load {load_dir}: DeepSpeed could not load universal checkpoint {tag}.")
    # the client state DeepSpeed read with the weights (not a second read of the model file on every rank)
    _same_optimizer(ClientState.from_meta(client_state), run, f"--load {load_dir} --universal-checkpoint")
    deepspeed_fixes.keep_run_clipping(engine, run.optimizer.clip_grad)
    if run.zero_stage == 3:
        deepspeed_fixes.repair_zero3_universal_load(engine, os.path.join(load_dir, tag))
    if run.model.num_experts:
        _restore_score_biases(engine, os.path.join(load_dir, tag), run.model.num_layers)
    decays = ", ".join(f"{group['weight_decay']:g}" for group in engine.optimizer.param_groups)
    return _resumed(client_state, lambda iteration: f"loaded universal checkpoint {load_dir}/{tag} at iteration "
                                                    f"{iteration} (weight decay per parameter group: {decays})")


def _same_optimizer(saved: ClientState, run: RunConfig, what: str) -> None:
    """A universal checkpoint's moments are Adam's, or Muon's momentum (its exp_avg, with zero second moments:
    hybrid.training.muon): loading one into the other optimizer would not continue either."""
    saved_muon = (saved.args or {}).get("optimizer") == "muon"
    if saved_muon != (run.optimizer.muon is not None):
        have, want = ("Muon's momentum", "Adam") if saved_muon else ("Adam's moments", "Muon")
        raise ConfigError(f"{what}: its optimizer state is {have}, and this run trains with {want}; "
                          f"{'add' if saved_muon else 'drop'} --optimizer muon to continue it, or start from its "
                          f"weights with --finetune.")


def _restore_score_biases(engine, universal_dir: str, num_layers: int) -> None:
    """A universal load restores parameters only (DeepSpeed 0.19 skips the module state there); the
    routers' score biases are buffers, trained by their updates: copied from the source's model file."""
    saved = {canonical_name(name, num_layers): value for name, value in
             load_file(first_model_file(universal_dir))["module"].items() if name.endswith("router.score_bias")}
    with torch.no_grad():
        for name, buffer in engine.module.named_buffers():
            if name.endswith("router.score_bias"):
                buffer.copy_(saved[canonical_name(name, num_layers)])


def _load_megatron(engine, run: RunConfig, groups, load_dir: str, kind: str) -> Start:
    """A Megatron-LM checkpoint (either format, any TP x PP x EP): unless --finetune, its iteration, consumed
    samples and the LR schedule's position (Megatron's scheduler counts samples). Its Adam state, where it
    maps (hybrid.conversion.megatron.optimizer.MegatronOptimizer), is loaded with the weights by DeepSpeed's universal
    loader from a universal checkpoint made beside --save (hybrid.conversion.megatron.universal), then
    removed; otherwise the weights are resharded for this rank as they are read (a layer at a time) and
    Adam starts fresh, the log says why."""
    source = open_source(load_dir, kind=kind)
    what = (f"Megatron-DeepSpeed checkpoint {source.directory}" if source.kind == MEGATRON_DEEPSPEED else
            f"Megatron-LM checkpoint {source.directory} (--ckpt-format {source.format})")
    c = run.checkpoint
    if c.load_megatron_optimizer:
        return _load_megatron_with_optimizer(engine, run, groups, source, what)
    wanted = names_to_load(engine.module, run.model.num_layers)  # with the routers' score biases
    load_parts(engine.module, source.parts(run.model, wanted), run.model, groups)
    if c.finetune:
        return Start(f"loaded the weights of the {what} for fine-tuning; optimizer, schedule and iteration start "
                     f"fresh", copied_weights=True)
    iteration, consumed = source.iteration, source.consumed_samples
    return Start(f"loaded the weights of the {what} at iteration {iteration} ({consumed} consumed samples); the LR "
                 f"schedule continues from there; Adam starts fresh: {c.megatron_optimizer_problem or 'not loaded'}",
                 iteration, consumed, copied_weights=True, schedule_at_consumed=True)


def _load_megatron_with_optimizer(engine, run: RunConfig, groups, source, what: str) -> Start:
    """The universal checkpoint of `source` is written by rank 0 under --save (every rank reads it there),
    loaded, and removed."""
    directory = os.path.join(run.checkpoint.save, MEGATRON_UNIVERSAL)
    if dist.get_rank() == 0:
        write_universal(source, run.model, directory, log=log, replace=True, clip_grad=run.optimizer.clip_grad)
    dist.barrier()
    try:
        found = _load_universal(engine, run, directory, groups)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    log(found.said)  # the universal load's own line (the weight decay of each parameter group)
    found.said = (f"loaded the {what} at iteration {found.iteration} ({found.consumed} consumed samples) with its "
                  f"Adam state (step {source.optimizer().step}); the LR schedule continues from there")
    found.schedule_at_consumed = True
    return found


def _load_pipeline_engine(engine, run: RunConfig, groups, load_dir: str, tag: str, saved: ClientState) -> Start:
    """A checkpoint of DeepSpeed's pipeline engine (layer files; every 1f1b checkpoint before the one runtime),
    at any layout: with its optimizer state through a universal checkpoint (hybrid.conversion.universal, DeepSpeed's
    ds_to_universal) written under --save, loaded and removed; else (the config says why) its weights, the LR
    schedule continuing from its position."""
    c = run.checkpoint
    if not c.load_pipeline_engine:
        return _load_weights_only(engine, run, groups, load_dir, tag, saved,
                                  f"written by DeepSpeed's pipeline engine; its optimizer state is not loaded: "
                                  f"{c.pipeline_engine_problem}")
    directory = os.path.join(run.checkpoint.save, PIPELINE_ENGINE_UNIVERSAL)
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        convert(os.path.join(load_dir, tag), os.path.join(directory, tag), saved.model_config(), log=log)
        write_atomic(os.path.join(directory, LATEST_UNIVERSAL), tag)
    dist.barrier()
    try:
        found = _load_universal(engine, run, directory, groups)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    log(found.said)  # the universal load's own line (the weight decay of each parameter group)
    found.said = (f"loaded {load_dir}/{tag}, written by DeepSpeed's pipeline engine, with its optimizer state "
                  f"(through a universal checkpoint) at iteration {found.iteration}")
    return found


def _load_weights_only(engine, run: RunConfig, groups, load_dir: str, tag: str,
                       saved: ClientState, why: str = "a converted checkpoint: weights only") -> Start:
    """--finetune, or a converted checkpoint: weights from any layout, a fresh optimizer; without --finetune the
    LR schedule continues where the run was (its data plan reported; its RNG streams are this run's)."""
    wanted = names_to_load(engine.module, run.model.num_layers, buffers=False)
    load_parts(engine.module, hybrid_parts(load_dir, tag, run.model, wanted), run.model, groups)
    if run.checkpoint.finetune:
        return Start(f"loaded weights from {load_dir}/{tag} for fine-tuning; optimizer, schedule and iteration start "
                     f"fresh", copied_weights=True)
    iteration, consumed = int(saved.iteration), int(saved.consumed_samples)
    return Start(f"loaded weights of {load_dir}/{tag} ({why}; the optimizer starts fresh) at iteration {iteration}; "
                 f"the LR schedule continues from there", iteration, consumed, saved, copied_weights=True,
                 schedule_at_consumed=True)
