"""Where a run starts, executed: the start plan (hybrid.training.start, decided once before the config) names one of
four loaders: DeepSpeed's own load at the same layout, a universal load at any layout (a Megatron-LM checkpoint's
Adam state and DeepSpeed pipeline-engine layer files crossing through a universal checkpoint written beside
--save), weights only from any source, or fresh. Each loader says what it found (a `Start`), and one epilogue
(`begin`) ends them all."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException

from hybrid.capabilities import stage_placement
from hybrid.checkpoint.client_state import ClientState, SavedLayout
from hybrid.checkpoint.files import LATEST_UNIVERSAL, first_model_file, iteration_of, load_file, read_tag, write_atomic
from hybrid.checkpoint.manifest import verify_manifest
from hybrid.config import RunConfig, checkpoint_summary
from hybrid.conversion.layout import hybrid_parts, load_parts, table_block_rows
from hybrid.conversion import peft
from hybrid.conversion.megatron.universal import write_universal
from hybrid.conversion.source import HF, HYBRID
from hybrid.conversion.universal import convert
from hybrid.data.plan import plan_changes
from hybrid.errors import ConfigError
from hybrid.model import lora
from hybrid.model.naming import canonical_name, names_to_load
from hybrid.parallel.random import set_rng_states
from hybrid.safe_loading import UnsafeCheckpointError
from hybrid.training import deepspeed_fixes
from hybrid.training.logging import log
from hybrid.training.start import (FRESH, LAYER_FILES, MEGATRON_ADAM, SAME_LAYOUT, UNIVERSAL, WEIGHTS, StartPlan,
                                   describe)

MEGATRON_UNIVERSAL = ".megatron-universal"  # under --save: a Megatron checkpoint's Adam state while it loads
PIPELINE_ENGINE_UNIVERSAL = ".pipeline-engine-universal"  # under --save: the same for a pipeline-engine checkpoint
BRIDGES = {MEGATRON_ADAM: MEGATRON_UNIVERSAL, LAYER_FILES: PIPELINE_ENGINE_UNIVERSAL}  # a bridge's directory


def already_finished(run: RunConfig) -> bool:
    """A restart (--load = --save) whose newest complete checkpoint is the run's last iteration has
    nothing to do: it says so, and the caller exits before building anything (no process group, no save)."""
    plan, c = run.start, run.checkpoint
    if plan.kind != HYBRID or plan.tag is None or c.finetune or c.universal_checkpoint:
        return False
    iteration = iteration_of(plan.tag)
    if iteration is None or iteration < run.training.train_iters or verify_manifest(os.path.join(c.load, plan.tag)):
        return False
    log(f"nothing to train: the newest checkpoint in {c.load} ({plan.tag}) is at iteration {iteration}, the end of "
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


def start(engine, run: RunConfig, groups, plan: Optional[StartPlan] = None) -> tuple[int, int]:
    """Where the run starts, as its plan (run.start, or `plan`) says: the plan's loader runs, then the one
    epilogue. Returns (iteration, consumed samples)."""
    plan = plan or run.start
    if plan.refusal is not None:
        raise ConfigError(plan.refusal)
    if plan.loader == FRESH and plan.warning is None:
        return 0, 0
    return begin(engine, run, groups, LOADERS[plan.loader](engine, run, groups, plan))


def _fresh(engine, run: RunConfig, groups, plan: StartPlan) -> Start:
    return Start(plan.warning)


def _same_layout(engine, run: RunConfig, groups, plan: StartPlan) -> Start:
    """DeepSpeed's own load of a hybrid checkpoint at this run's layout: engine, optimizer, schedule and RNG.
    --no-load-optim: no optimizer or schedule state; --no-load-rng: keep this run's seeds."""
    c, load_dir, tag = run.checkpoint, plan.directory, plan.tag
    check_same_layout(plan.saved, run, load_dir, tag)
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


def _weights(engine, run: RunConfig, groups, plan: StartPlan) -> Start:
    """Weights only, from any source and layout (--load-hf, --finetune, a converted checkpoint, a Megatron one
    whose optimizer is not loaded), resharded for this rank as they are read (a layer at a time, this rank's
    stage and experts only); a fresh optimizer. The counters and the LR schedule continue where the plan says."""
    model = run.model
    wanted = names_to_load(engine.module, model.num_layers, buffers=plan.kind not in (HF, HYBRID))
    base = dataclasses.replace(model, **lora.NO_LORA) if model.lora_rank and plan.kind == HF else model
    # multi-token prediction layers an HF model does not store (--mtp-num-layers) start from their initialisation
    parts = plan.source.parts(base, {n for n in wanted if not lora.is_adapter(n)}) if plan.source is not None \
        else hybrid_parts(plan.directory, plan.tag, model, wanted)  # (the newest complete checkpoint's)
    if plan.adapter:  # --load-lora: the adapters, after the base weights
        parts = itertools.chain(parts, [peft.read_adapter(plan.adapter, model)])
    fresh = load_parts(engine.module, parts, model, groups,
                       may_start_fresh=("mtp.",) if plan.kind == HF else (), adapters_may_start_fresh=True)
    if model.lora_rank:
        targets = " ".join(lora.resolve_targets(model.lora_target_modules))
        log(f"LoRA: {'the adapters of ' + plan.adapter if plan.adapter else 'adapters as PEFT initialises them'} "
            f"(rank {model.lora_rank}, alpha {model.lora_alpha:g}, on {targets}); the base frozen")
    if plan.kind == HF:
        return Start(f"loaded the {model.family} weights of {plan.directory} (--load-hf); optimizer, schedule and "
                     f"iteration start fresh" + ("; the multi-token prediction layers (not in it) from their "
                                                 "initialisation" if fresh else ""), copied_weights=True)
    where = f"{plan.directory}/{plan.tag}" if plan.kind == HYBRID else describe(plan)
    if not plan.counters:
        return Start(f"loaded {'weights from' if plan.kind == HYBRID else 'the weights of the'} {where} for "
                     f"fine-tuning; optimizer, schedule and iteration start fresh", copied_weights=True)
    if plan.kind == HYBRID:
        saved = plan.saved
        why = ("a converted checkpoint: weights only" if plan.bridge is None and saved.weights_only else
               f"written by DeepSpeed's pipeline engine; its optimizer state is not loaded: {plan.optimizer_problem}")
        iteration, consumed = int(saved.iteration), int(saved.consumed_samples)
        return Start(f"loaded weights of {where} ({why}; the optimizer starts fresh) at iteration {iteration}; the "
                     f"LR schedule continues from there", iteration, consumed, saved, copied_weights=True,
                     schedule_at_consumed=True)
    iteration, consumed = plan.source.iteration, plan.source.consumed_samples
    return Start(f"loaded the weights of the {where} at iteration {iteration} ({consumed} consumed samples); the LR "
                 f"schedule continues from there; Adam starts fresh: {plan.optimizer_problem or 'not loaded'}",
                 iteration, consumed, copied_weights=True, schedule_at_consumed=True)


def _universal(engine, run: RunConfig, groups, plan: StartPlan) -> Start:
    """DeepSpeed's universal load at any layout, with the optimizer; a Megatron-LM checkpoint with Adam state or
    pipeline-engine layer files first cross the bridge: a universal checkpoint rank 0 writes under --save, every
    rank loads, and rank 0 removes."""
    if plan.bridge is None:
        return _load_universal(engine, run, plan.directory, plan.tag)
    directory = os.path.join(run.checkpoint.save, BRIDGES[plan.bridge])
    if dist.get_rank() == 0:
        _write_bridge(plan, run, directory)
    dist.barrier()
    try:
        found = _load_universal(engine, run, directory, plan.tag)  # (a Megatron bridge: latest_universal's)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    log(found.said)  # the universal load's own line (the weight decay of each parameter group)
    if plan.bridge == MEGATRON_ADAM:
        found.said = (f"loaded the {describe(plan)} at iteration {found.iteration} ({found.consumed} consumed "
                      f"samples) with its Adam state (step {plan.source.optimizer().step}); the LR schedule continues "
                      f"from there")
        found.schedule_at_consumed = True
    else:
        found.said = (f"loaded {plan.directory}/{plan.tag}, written by DeepSpeed's pipeline engine, with its "
                      f"optimizer state (through a universal checkpoint) at iteration {found.iteration}")
    return found


def _write_bridge(plan: StartPlan, run: RunConfig, directory: str) -> None:
    """The universal checkpoint the bridge crosses through, written whole under `directory`."""
    if plan.bridge == MEGATRON_ADAM:
        write_universal(plan.source, run.model, directory, log=log, replace=True, clip_grad=run.optimizer.clip_grad)
        return
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    convert(os.path.join(plan.directory, plan.tag), os.path.join(directory, plan.tag), plan.saved.model_config(),
            log=log)
    write_atomic(os.path.join(directory, LATEST_UNIVERSAL), plan.tag)


LOADERS = {FRESH: _fresh, SAME_LAYOUT: _same_layout, WEIGHTS: _weights, UNIVERSAL: _universal}


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


def _load_universal(engine, run: RunConfig, load_dir: str, tag: Optional[str]) -> Start:
    """DeepSpeed loads the per-parameter fp32 weights and Adam moments of universal checkpoint `tag` (None: the
    one latest_universal names) and slices them for this rank's TP/PP/DP position (its `load_universal` mode)."""
    tag = tag or read_tag(load_dir, LATEST_UNIVERSAL)
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
