"""The only places hybrid touches DeepSpeed internals or replaces a method of a DeepSpeed object, each
with the DeepSpeed version it was written against (0.19.8) and the reason, each covered by
tests/test_deepspeed_fixes.py, which fails loudly if DeepSpeed changes what is relied on.
hybrid.training.deepspeed_internals.RELIED_ON lists those internals; the test checks each still exists.
(torch's process-wide defaults are hybrid.torch_fixes'; the safe torch.load is hybrid.safe_loading's.)"""

from __future__ import annotations

import contextlib
import os

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import PARAM
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.runtime.activation_checkpointing import checkpointing
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils import groups as ds_groups
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

from hybrid.checkpoint.files import load_file
from hybrid.model.moe.moe_layer import MoELayer
from hybrid.model.naming import canonical_parameters, vocab_block
from hybrid.training.async_save import BackgroundWriter
from hybrid.training.muon import FlatPartition, Partitioned

KNOWN_GOOD_DEEPSPEED = ("0.19.8",)  # checked by tests/test_deepspeed_fixes.py; pyproject allows the 0.19 series

GITHUB = "https://github.com/deepspeedai/DeepSpeed"
# each fix below: what kind it is (a workaround of DeepSpeed's behaviour, a speed or memory fix, or an adapter /
# accessor of its internals), the DeepSpeed versions the behaviour was read in (its source history: the first
# release that has it, through the one checked here), and the upstream issue or pull request where one matches
FIXES = {
    "release_engine": ("workaround", "0.16.4-0.19.8", f"{GITHUB}/issues/7204 (memory over re-created engines)"),
    "runs_tensor_backward": ("accessor", "0.18.3-0.19.8", f"{GITHUB}/pull/7665 (the flag)"),
    "prepare_pipeline_engine": ("workaround", "0.16.6-0.19.8", f"{GITHUB}/issues/1839 (TP vs model-parallel rank)"),
    "loss_scale": ("accessor", "0.19.8", None),
    "scaled_for_backward": ("adapter", "0.18.6-0.19.8", f"{GITHUB}/pull/7665 (engine.scale)"),
    "start_backward": ("workaround", "0.3.12-0.19.8", f"{GITHUB}/pull/7780 (the reset in forward)"),
    "begin_accumulation": ("workaround", "0.12.0-0.19.8", None),
    "step_on_gradient_partitions": ("memory", "0.12.0-0.19.8", None),
    "release_input_embedding_after_its_gradient": ("memory", "0.19.3-0.19.8", None),
    "ensure_reduction_buckets": ("workaround", "0.18.3-0.19.8", None),
    "keep_host_activations_when_offloading": ("workaround", "0.12.6-0.19.8", f"{GITHUB}/pull/4836 (the ordering)"),
    "install_fp32_clipping": ("workaround", "0.12.0-0.19.8", f"{GITHUB}/issues/1839"),
    "skip_one_rank_gradient_allreduce": ("speed", "0.14.1-0.19.8", None),
    "skip_non_finite_steps": ("workaround", "0.19.8", None),
    "use_canonical_param_names": ("adapter", "0.18.0-0.19.8", f"{GITHUB}/pull/7585 (ZeRO-3 param_names)"),
    "load_table_blocks_from_universal": ("adapter", "0.18.0-0.19.8", None),
    "repair_zero3_universal_load": ("workaround", "0.18.0-0.19.8", f"{GITHUB}/pull/7585 (introduced both lines)"),
    "keep_run_clipping": ("workaround", "0.19.8", f"{GITHUB}/pull/4516 (the overwrite)"),
    "load_checkpoint": ("workaround", "0.18.5-0.19.8", f"{GITHUB}/pull/7786 (the cause)"),
    "replay_cpu_adam_steps": ("workaround", "0.12.0-0.19.8", f"{GITHUB}/issues/7819 (the same IncrementStep)"),
    "use_async_checkpoint_engine": ("adapter", "0.17.1-0.19.8", f"{GITHUB}/issues/5721 (the request)"),
    "register_moe_layers": ("adapter", "0.12.0-0.19.8", None),
    "zero_partitions": ("accessor", "0.19.8", None),
    "zero3_gathered_while_generating": ("speed", "0.16.4-0.19.8", f"{GITHUB}/issues/5498 (TRL's way, asked upstream)"),
}


# --- an engine's end --------------------------------------------------------------------------------

def release_engine(engine) -> None:
    """After a run, what keeps DeepSpeed 0.19.8's engine alive once the run drops it, removed, so a process that
    trains again (an RL loop building engines, a pool of test ranks) does not keep every earlier engine, its
    buffers and its process groups (gloo's threads end only with their group's last reference):
    1. `engine.destroy()`, DeepSpeed's own release: the gradient hooks on the parameters hold the optimizer and
       engine through C++ autograd nodes, which Python's collector cannot follow;
    2. ZeRO-3 pushes the top module on its module-level `FWD_MODULE_STACK` when it sets its hooks up and never
       pops it (the module's forward hooks hold the engine);
    3. ZeRO-3's parameter coordinator caches `__params_to_release` with `functools.lru_cache` on the class, which
       keeps every coordinator and module it was called with (emptied: another live engine recomputes its
       entries on their next use);
    4. ZeRO-3 numbers modules and parameters (`ds_id`) from counters kept in a mutable default argument of
       `_register_deepspeed_module` and in `Init.param_id`, so the next engine's numbers depend on every engine the
       process built: two pipeline ranks, whose stages differ, then number the same later model differently, and
       ZeRO-3's trace check fails ("Detected a disagreement on list contents"; a kept 4-rank pool). Reset to 0."""
    engine.destroy()
    # (imported here: only ZeRO-3 engines put anything in these)
    from deepspeed.runtime.zero import parameter_offload, partition_parameters, partitioned_param_coordinator
    mine = {id(m) for m in engine.module.modules()}
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in mine]
    cached = vars(partitioned_param_coordinator.PartitionedParameterCoordinator)[
        "_PartitionedParameterCoordinator__params_to_release"]
    while not hasattr(cached, "cache_clear"):  # under DeepSpeed's nvtx wrapper: the function it closes over
        cached = next(cell.cell_contents for cell in cached.__closure__ if callable(cell.cell_contents))
    cached.cache_clear()
    parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
    partition_parameters.Init.param_id = 0


# --- pipeline schedules on the plain engine (hybrid.training.runtime) ------------------------------

def runs_tensor_backward(engine) -> bool:
    """Whether the engine follows backward passes that torch runs itself (`tensor.backward()` on outputs of
    `engine(...)`): DeepSpeed 0.19.8 does so for its ZeRO optimizers (ZeRO-1/2/3 and its bf16 optimizer), whose
    gradient hooks end each such pass with its epilogue; without them (fp32 / fp16 without ZeRO) gradients
    accumulate in `.grad` and the step reduces them."""
    return bool(engine._support_torch_style_backward)


def prepare_pipeline_engine(engine, mpu) -> None:
    """PP > 1 on the plain engine, two things of DeepSpeed 0.19.8's ZeRO-3:
    1. its coordinator resets its trace of fetched modules at every forward of the top module
       (`DeepSpeedZeRoOffload.fwd_pre_hook`) and, when a recorded trace completes, checks it equal on every rank
       of the world (`assert_ints_same_as_other_ranks`, default group): a pipeline's stages run different
       modules, and each stage forward is a forward of the top module. Without the reset the trace stays
       invalid: parameters are gathered when a module runs (no trace-driven prefetch) and released after,
       forward and backward, as ZeRO-3 does without a trace;
    2. its gradient norm counts a parameter that is not split over TP only where `model_parallel_rank == 0`,
       the rank in the whole TP x PP group (`mpu.get_model_parallel_rank()`), so every later stage's norms and
       biases were left out of the norm that clipping uses; ZeRO-1/2 take the TP rank
       (`bwc_tensor_model_parallel_rank`), as this sets it here."""
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None and getattr(offload, "fwd_pre_hook", None) is not None:
        offload.fwd_pre_hook.remove()  # the handle stays: engine.destroy() removes it again (a no-op)
    if engine.zero_optimization_stage() == 3:
        optimizer.model_parallel_rank = bwc_tensor_model_parallel_rank(mpu)


def loss_scale(engine) -> float:
    """fp16: DeepSpeed 0.19.8's current loss scale (`loss_scale` of its ZeRO optimizers and FP16_Optimizer); else 1."""
    if not engine.fp16_enabled():
        return 1.0
    return float(engine.optimizer.loss_scale)


def scaled_for_backward(engine, loss):
    """A pipeline's loss as DeepSpeed 0.19.8's fp16 loss scaling wants it for a backward that torch's schedule
    runs: `engine.scale(loss)` with a ZeRO optimizer (DeepSpeed's API for backward passes it does not run itself),
    the fp32 loss times FP16_Optimizer's loss scale without ZeRO (what its own `backward` multiplies by);
    unchanged in bf16 and fp32. The step unscales the gradients and skips it on overflow, as after engine.backward."""
    if not engine.fp16_enabled():
        return loss
    if isinstance(engine.optimizer, ZeROOptimizer):
        return engine.scale(loss)
    return loss.float() * engine.optimizer.loss_scale


def start_backward(engine) -> None:
    """Before each backward a pipeline schedule runs: DeepSpeed 0.19.8 resets its per-backward hook state
    (`BackwardHookStateManager.reset_for_new_step`, from `ZeROOptimizer.clear_backward_seen_flag`) only in
    `engine.forward`, so the second of two backwards without a forward between them (a pipeline's cooldown)
    queues no epilogue: its gradients would never be reduced. This runs that reset (the base class's part
    only: ZeRO-1/2's override also drops the fp32 `grad_accum` of the iteration, which the step still needs).
    ZeRO-3 releases a module's gathered parameters when its count of pending input gradients
    (`ds_grads_remaining`) reaches 0 in backward, and sets the count anew at each forward: after a schedule's
    forwards of several micro-batches, only the first backward released, and a cooldown's later backwards held
    every module of the stage gathered through the gradients' reduction (a layer-heavy stage 0: 0.14 GiB more).
    The count of each module's last forward is kept here and restored where a backward finds it spent."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        for module in engine.module.modules():
            remaining = getattr(module, "ds_grads_remaining", 0)
            if remaining > 0:  # a forward since the last backward set it
                module.hybrid_grads_per_forward = remaining
            else:
                module.ds_grads_remaining = getattr(module, "hybrid_grads_per_forward", 0)
    if isinstance(optimizer, ZeROOptimizer):
        ZeROOptimizer.clear_backward_seen_flag(optimizer)
        if engine.fp16_enabled():
            # fp16: each of the schedule's backward passes carries the scaled loss's gradient (the last stage's
            # from `scaled_for_backward`, the others' received from it); DeepSpeed checks that engine.scale ran
            # for the backward (`_manual_backward_expected`), which it did only on the last stage
            engine._manual_backward_expected = True


def begin_accumulation(engine) -> None:
    """Before an iteration's schedule (PP > 1, caller-owned accumulation). DeepSpeed 0.19.8's ZeRO-3 copies a
    parameter's gradient partition on the iteration's first backward (`micro_step_id == 0`) and adds it on the
    later ones, and ZeRO-1/2 with optimizer offload do the same with their host accumulators; in a pipeline a
    rank's first backward does not reach every parameter (interleaved stages, a stage's weight step), so a
    parameter first reached later would add to the last iteration's values. Here the accumulators start at
    zero and every backward adds (0 + g is g: the values are those of DeepSpeed's own accumulation). The full
    `clear_backward_seen_flag` runs as a forward would run it first."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, ZeROOptimizer):
        return
    optimizer.clear_backward_seen_flag()
    if engine.zero_optimization_stage() == 3:
        optimizer.grad_partitions_flat_buffer.zero_()
        optimizer.micro_step_id = 1
    elif getattr(optimizer, "cpu_offload", False):
        for buffer in getattr(optimizer, "accumulated_grads_in_cpu", {}).values():
            buffer.zero_()
        optimizer.micro_step_id = max(optimizer.micro_step_id, 1)


def step_on_gradient_partitions(engine) -> None:
    """ZeRO-3 without optimizer offload: each sub-group's optimizer step reads its gradient partitions where
    they already lie. DeepSpeed 0.19.8's `_prepare_fp32_grad_for_sub_group` hands the fp32 master
    `flatten(partitions).to(fp32)`: a copy of the sub-group's gradient partitions in their own dtype and then,
    with bf16/fp16 accumulation, a second one in fp32, both alive at once (with the default `sub_group_size`, a
    whole stage's partition: the largest transient of a ZeRO-3 step). The partitions are adjacent slices of
    one flat buffer (`grad_partitions_flat_buffer`, filled in the order of the sub-groups), so where that holds
    the master's gradient is that slice itself (fp32 accumulation) or its one fp32 conversion: the same values,
    so the step is bitwise DeepSpeed's. Otherwise (a parameter without gradients, an offloaded optimizer)
    DeepSpeed's own copy runs. With fp32 accumulation the step's in-place unscale/clip scales the buffer
    itself, which the next iteration's first backward overwrites (`micro_step_id == 0`) or `begin_accumulation`
    zeroes. (A parameter that gets no gradient in an iteration at PP = 1 keeps its last partition in the buffer,
    as in DeepSpeed, but clipped here: no parameter of hybrid's models does; an MoE expert no token reached gets a
    zero gradient.) The method is replaced on this optimizer object only."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() != 3 or not hasattr(optimizer, "_prepare_fp32_grad_for_sub_group"):
        return
    copy_for_sub_group = optimizer._prepare_fp32_grad_for_sub_group

    def in_place(sub_group_id):
        master = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        grads = optimizer.averaged_gradients[sub_group_id]
        flat = optimizer.grad_partitions_flat_buffer
        size, base = flat.element_size(), flat.data_ptr()
        start = (grads[0].data_ptr() - base) // size if grads else -1
        at = start
        for grad in grads or ():
            if grad.dtype != flat.dtype or not grad.is_contiguous() or grad.data_ptr() != base + at * size:
                break
            at += grad.numel()
        else:
            if grads and flat.is_contiguous() and 0 <= start and at - start == master.numel() <= flat.numel() - start:
                master.grad = flat.narrow(0, start, master.numel()).to(device=master.device, dtype=master.dtype)
                optimizer.averaged_gradients[sub_group_id] = None
                return
        copy_for_sub_group(sub_group_id)

    optimizer._prepare_fp32_grad_for_sub_group = in_place


def release_input_embedding_after_its_gradient(engine, embedding) -> None:
    """ZeRO-3: the input embedding's gathered table is released once its gradient exists, before that gradient is
    reduce-scattered. DeepSpeed 0.19.8 releases a module after backward reaches its input; the embedding's input
    is token ids, which take no gradient, so its table stays gathered until the backward's end
    (`release_backward_leftovers`), through the reduction of its whole gradient: on the first pipeline stage (and
    at PP = 1) the table, its gradient and the reduction's buffers at once, the stage's peak where the vocabulary
    is large (bench_memory: 0.07 GiB in bf16 at PP 2 x DP 2 for GPT-2's vocabulary). Here, when the table's
    gradient arrives at ZeRO's reduction, the module is released as DeepSpeed's own post-backward hook releases
    a module (`release_sub_module`, backward); its backward has run, and the weights are gathered again by the
    next forward. A table another module still holds stays gathered (DeepSpeed's release skips a parameter with
    active modules: the tied head at PP = 1 reads it through the top module, so nothing is saved there). A table
    in blocks (hybrid.parallel.layers.TableBlock, ZeRO-3's vocab_block_rows): each block's module when its own
    gradient arrives. The method is replaced on this optimizer object only."""
    optimizer = engine.optimizer
    if (engine.zero_optimization_stage() != 3 or embedding is None
            or getattr(optimizer, "parameter_offload", None) is None):
        return
    coordinator = optimizer.parameter_offload.get_param_coordinator()
    reduce = optimizer.reduce_ready_partitions_and_remove_grads
    blocks = getattr(embedding, "blocks", None)
    owner = {id(module.weight): module for module in ([embedding] if blocks is None else blocks)}
    active = coordinator._PartitionedParameterCoordinator__active_backward_submodules  # one dict, kept by DeepSpeed

    def release_then_reduce(param, *args, **kwargs):
        module = owner.get(id(param))
        if module is not None and getattr(module, "ds_id", None) in active:
            coordinator.release_sub_module(module, forward=False)
        return reduce(param, *args, **kwargs)

    optimizer.reduce_ready_partitions_and_remove_grads = release_then_reduce


def ensure_reduction_buckets(engine) -> None:
    """Before a pipeline's `engine.step()` with ZeRO-1/2: the reduction buckets exist. DeepSpeed 0.19.8 allocates
    them in the gradient hooks of a backward (`setup_buckets`, from `process_gradients`) and frees them at each
    backward's epilogue; a zero-bubble weight step hands its gradients over without hooks, so the step's
    reduction (ZeRO-1, caller-owned accumulation) could find none (`IndexError` in
    `reduce_independent_p_g_buckets_and_remove_grads`). DeepSpeed's own coalesced flush calls it the same way."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() in (1, 2) and hasattr(optimizer, "setup_buckets"):
        optimizer.setup_buckets()


# --- activation offloading on a host accelerator -----------------------------------------------------

def keep_host_activations_when_offloading() -> None:
    """DeepSpeed 0.19.8's blocking cpu_checkpointing path (the one synchronized accelerators take; CUDA takes
    the async offload engine) copies each checkpointed input to the CPU with `.to("cpu")`, empties the
    input, then keeps the copy. An input already in host memory (the CPU accelerator) *is* its copy:
    `.to` returns the same tensor, and emptying it loses the activation (the backward then fails). This
    keeps the copy's storage before the input is emptied; a real device-to-host copy is unaffected."""

    def get_cpu_activations_for_backward(args, inputs):
        new_args = []
        for arg, inp in zip(args, inputs):
            if not checkpointing.is_activation_to_checkpoint(arg):
                new_args.append(arg)
                continue
            saved = inp.data  # read before `arg` is emptied: it may be the same tensor
            arg.data = torch.empty([], device=arg.device).data
            arg.saved_data = saved
            new_args.append(arg)
        return new_args

    checkpointing.get_cpu_activations_for_backward = get_cpu_activations_for_backward


# --- exact fp32 gradient clipping for TP x PP (ZeRO-0) ------------------------------------------

def install_fp32_clipping(engine, groups) -> None:
    """Replace DeepSpeed's fp32/ZeRO-0 gradient clipping with one that is exact for TP x PP x EP.

    DeepSpeed 0.19's `DeepSpeedEngine.clip_fp32_gradients` (called from `_take_model_step` when
    neither ZeRO nor bf16/fp16 wraps the optimizer) counts replicated parameters only on
    model-parallel rank 0 of the whole TP x PP group, so on pipeline stages after the first their norms
    are left out, and it discards the norm it computed. Here every TP-sharded gradient counts on its
    rank, each replicated one once per stage (TP rank 0), the tied embedding once (first stage), summed
    over the TP x PP group; expert parameters (DeepSpeed's `allreduce = False`), different on each EP
    rank, are summed over the EP group as well, so every rank clips (and judges finiteness) with the one
    global norm. The norm is stored where `get_global_grad_norm()` reads it (the private
    `_global_grad_norm`) for logging. The engine method is replaced on this engine object only.
    """
    # a tied embedding's copies on later pipeline stages, which DeepSpeed marks ds_pipe_replicated
    # (TiedLayerSpec; our virtual stages mark theirs the same way)
    tied_copies = {id(p) for p in engine.module.parameters() if getattr(p, "ds_pipe_replicated", False)}
    model_group = groups.mpu.get_model_parallel_group()

    def squared_norm(grads):
        # torch's public clipping pieces (foreach kernels: one pass per dtype group, not per parameter)
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=engine.device)
        return norm.double().square()

    split_experts = groups.ep.size > 1  # each EP rank holds other experts: their squares add up over EP

    def clip_fp32_gradients():
        params, dense, experts = [], [], []
        for param in engine.module.parameters():
            if param.grad is None:
                continue
            params.append(param)
            if (is_model_parallel_parameter(param) or groups.tp.rank == 0) and id(param) not in tied_copies:
                expert = split_experts and getattr(param, "allreduce", True) is False
                (experts if expert else dense).append(param.grad)
        total = squared_norm(dense)
        if split_experts:
            expert_total = squared_norm(experts)
            dist.all_reduce(expert_total, group=groups.ep.group)
            total = total + expert_total
        if dist.get_world_size(group=model_group) > 1:
            dist.all_reduce(total, group=model_group)
        # On the device, with no host sync: the factor is 1 when the norm is below the threshold
        # (multiplying by exactly 1.0 leaves the gradients bitwise unchanged).
        norm = total.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, engine.gradient_clipping(), norm)
        engine._global_grad_norm = norm
        engine.hybrid_step_grad_norm = norm  # skip_non_finite_steps' check reads it (same on every rank)

    engine.clip_fp32_gradients = clip_fp32_gradients


def skip_one_rank_gradient_allreduce(engine) -> None:
    """No gradient "all-reduce" over a group of one rank. Without ZeRO, DeepSpeed 0.19's
    `buffered_allreduce_fallback` flattens every gradient into one buffer, all-reduces it over the
    (sequence-)data-parallel group and copies each gradient back (`allreduce_and_copy`), even when that
    group is one rank: two full passes over the gradients per step for nothing (about 4% of a one-rank
    CPU step, measured by benchmarks/bench_vs_transformers.py). Where the group has one rank and the
    averaging divides by one (no pre/post-divide factor), the values would come back unchanged, so the
    bucket is left as it is; any other group or factor goes to DeepSpeed's own method. The method is
    replaced on this engine object only."""
    reduce_and_copy = engine.allreduce_and_copy

    def allreduce_and_copy(small_bucket, dp_group, dp_world_size=None):
        ranks = dist.get_world_size(group=dp_group)
        divisor = ranks if dp_world_size is None else dp_world_size
        unscaled = not engine.gradient_average or (divisor == 1 and engine.gradient_predivide_factor() == 1.0)
        if ranks == 1 and unscaled:
            return
        reduce_and_copy(small_bucket, dp_group, dp_world_size)

    engine.allreduce_and_copy = allreduce_and_copy


def skip_non_finite_steps(engine) -> None:
    """No update from a non-finite gradient, without a host sync, where DeepSpeed 0.19 does not skip it
    itself: its ZeRO optimizers and fp16/bf16 wrappers check for overflow and skip the step, but without
    ZeRO in fp32 `_take_model_step` steps the torch optimizer whatever the gradients hold. A step pre-hook
    (torch's public API) on that optimizer computes the gradients' total norm on the device and, for
    torch's fused Adam(W), sets `found_inf` (the attribute torch's GradScaler uses), so the fused kernel
    leaves parameters and moments untouched; other optimizers get the gradients zeroed instead."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RuntimeError(f"DeepSpeed wrapped the fp32 optimizer in {type(optimizer).__name__} (DeepSpeed changed?)")
    fused = bool(optimizer.defaults.get("fused"))

    def before_step(opt, args, kwargs):
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # the norm clipping took this step (summed over TP x PP: every rank decides alike), else this
        # rank's own
        norm = engine.__dict__.pop("hybrid_step_grad_norm", None)
        finite = torch.isfinite(torch.nn.utils.get_total_norm(grads) if norm is None else norm)
        if fused:
            opt.found_inf = (~finite).to(torch.float32)
        else:
            for grad in grads:
                grad.nan_to_num_(0.0, 0.0, 0.0).mul_(finite)

    optimizer.register_step_pre_hook(before_step)


# --- universal checkpoints ----------------------------------------------------------------------

def use_canonical_param_names(engine, num_layers: int) -> None:
    """Universal checkpoints made here keep each parameter under its canonical name; DeepSpeed 0.19's
    ZeRO optimizers look a parameter's directory up as `optimizer.param_names[param]`, which the
    engine fills from `module.named_parameters()` (pipeline stages: `3.attention...`,
    `tied_modules.embed...`). Point those at the canonical names so any PP loads any PP."""
    optimizer = engine.optimizer
    names = getattr(optimizer, "param_names", None)
    if not isinstance(names, dict):
        raise RuntimeError(f"DeepSpeed's {type(optimizer).__name__} has no param_names dict (DeepSpeed "
                           f"changed?); universal checkpoint loading cannot find its parameters.")
    canonical = {id(p): name for name, p in canonical_parameters(engine.module, num_layers).items()}
    optimizer.param_names = {param: canonical.get(id(param), name) for param, name in names.items()}


def load_table_blocks_from_universal(engine, rows: dict) -> None:
    """A ZeRO-3 universal load into a vocabulary table held in row blocks (hybrid.parallel.layers.TableBlock;
    `rows`: {id of a block's parameter: its rows [start, stop) of the table}). A universal checkpoint holds the
    table whole, one directory (hybrid.conversion.ds_universal.join_block_folders); DeepSpeed 0.19.8's ZeRO-3 load
    reads each parameter's `zero/<name>/<key>.pt` (`load_hp_checkpoint_state`). A block's read takes its rows of
    the table's file and this rank's partition of them as DeepSpeed's partitions any parameter (flat, padded to a
    multiple of the partition group, this rank's slice). Replaced on this optimizer object only."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() != 3 or not rows:
        return
    load = optimizer.load_hp_checkpoint_state

    def load_block(folder, key, param=None):
        block = vocab_block(os.path.basename(folder))
        if block is None or param is None or id(param) not in rows:
            return load(folder, key, param=param)
        # memory-mapped: each block reads its rows of the table, not the table (DeepSpeed asks once per block)
        value = load_file(os.path.join(os.path.dirname(folder), block[0], f"{key}.pt"), mmap=True)
        start, stop = rows[id(param)]
        flat = (value[PARAM] if isinstance(value, dict) else value)[start:stop].reshape(-1)
        group = optimizer._get_param_partition_group(param)
        world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
        per = -(-flat.numel() // world)
        flat = torch.cat([flat, flat.new_zeros(per * world - flat.numel())])
        return flat.narrow(0, rank * per, per)

    optimizer.load_hp_checkpoint_state = load_block


def repair_zero3_universal_load(engine, universal_dir: str) -> None:
    """Undo two bugs of DeepSpeed 0.19.8's ZeRO-3 universal load
    (`DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`):
    1. one `step` tensor object is stored for every sub-group, so torch's Adam, which increments each
       group's step in place, advances it once per sub-group per iteration (wrong bias correction);
    2. the first parameter group's hyperparameters are copied into every group, so the no-decay
       group (biases, norms) gets the first group's weight decay.
    Each group gets its own step tensor and its own saved hyperparameters back."""
    inner = engine.optimizer.optimizer
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = load_file(os.path.join(universal_dir, "zero", "optimizer_state.pt"))["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(inner.param_groups):
        raise RuntimeError(f"universal checkpoint {universal_dir} has {len(saved)} optimizer parameter groups, "
                           f"this run {len(inner.param_groups)}")
    for group, saved_group in zip(inner.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})


def keep_run_clipping(engine, clip_grad: float) -> None:
    """DeepSpeed 0.19.8's universal load (ZeRO-1/2's `_load_global_state`, which the universal path calls)
    sets the optimizer's gradient clipping to the checkpoint's `clip_grad`; this run's --clip-grad is put
    back, as every other setting of a resumed run comes from its flags."""
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = clip_grad


# --- loading DeepSpeed checkpoints -----------------------------------------------------------------

def load_checkpoint(engine, load_dir: str, tag: str, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """`engine.load_checkpoint`, with two DeepSpeed 0.19.8 bugs undone so a resume is bitwise:
    1. bf16 without ZeRO on the pipeline engine wraps the optimizer in BF16_Optimizer, which saves its
       state per DP rank in `bf16_zero_pp_rank_*` files, but the engine (since DeepSpeed PR 7786) hands
       its load_state_dict the rank-0 dict of `mp_rank_*_model_states.pt` (`KeyError: 0`) and never
       reads those files: the model and schedule load here without the optimizer, then the engine's
       own ZeRO-file loader reads them (fp32 masters and moments of this rank's partition).
    2. DeepSpeedCPUAdam (ZeRO offload) is resumed with its running beta products replayed
       (`replay_cpu_adam_steps`)."""
    bf16_wrapped = type(engine.optimizer).__name__ == "BF16_Optimizer" and not engine.zero_optimization()
    fix_bf16 = bf16_wrapped and load_optimizer_states and not load_module_only
    path, client_state = engine.load_checkpoint(
        load_dir, tag=tag, load_optimizer_states=load_optimizer_states and not fix_bf16,
        load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)
    if path is not None and fix_bf16 and not engine._load_zero_checkpoint(load_dir, tag, load_optimizer_states=True):
        raise FileNotFoundError(f"{load_dir}/{tag}: no bf16_zero_pp_rank_* optimizer files for this rank")
    if path is not None and load_optimizer_states and not load_module_only:
        replay_cpu_adam_steps(engine)
    return path, client_state


def replay_cpu_adam_steps(engine) -> None:
    """DeepSpeed 0.19's DeepSpeedCPUAdam (ZeRO offload) keeps beta1^t and beta2^t in C++ as running products
    (`beta_t *= beta` each step, cpu_adam.h IncrementStep), but a fresh optimizer resuming at step t
    computes pow(beta, t): one float ulp apart (0.999^3: 0.9970031 against 0.997003), so the resumed run
    leaves the uninterrupted one at its first step. Replaying one empty update per past step builds the
    same products; the parameters and moments are untouched (zero-size tensors)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if type(inner).__name__ != "DeepSpeedCPUAdam":
        return
    steps = {int(state["step"]) for state in inner.state.values() if "step" in state}
    if not steps:
        return
    if len(steps) != 1:
        raise RuntimeError(f"DeepSpeedCPUAdam parameters resumed at different steps {sorted(steps)}")
    empty = torch.empty(0, dtype=torch.float32)
    group = inner.param_groups[0]
    beta1, beta2 = group["betas"]
    for step in range(1, steps.pop() + 1):
        inner.ds_opt_adam.adam_update(inner.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                      group["weight_decay"], group["bias_correction"], empty, empty, empty, empty)


# --- --async-save: DeepSpeed's checkpoint engine writes in the background ------------------------

def use_async_checkpoint_engine(engine):
    """Replace the engine's checkpoint engine by one that copies each state dict to host memory and
    returns; a background thread writes the files (hybrid.training.async_save). DeepSpeed 0.19's engine
    (and its pipeline engine, for the layer files) hands every file to `self.checkpoint_engine.save`
    and calls `commit` right after the last one; commit must not wait, so completion is
    `engine.checkpoint_engine.wait()`, called by hybrid.training.saving before the manifest and
    `latest` move. DeepSpeed's own DecoupledCheckpointEngine shares CUDA tensors with a writer
    process instead (its files are torn unless training waits at the next step) and needs the
    FastCheckpointEngine writer; this keeps torch.save's files, readable by every DeepSpeed tool."""
    class AsyncCheckpointEngine(TorchCheckpointEngine):
        def __init__(self, config_params):
            super().__init__(config_params)
            self.name = "HybridAsyncCheckpointEngine"
            self.writer = BackgroundWriter(super().save)

        def save(self, state_dict, path: str):
            self.writer.submit(state_dict, path)

        def wait(self):
            self.writer.wait()

        def done(self):
            return self.writer.done()

    engine.checkpoint_engine = AsyncCheckpointEngine(getattr(engine, "_config", None))
    return engine.checkpoint_engine


# --- mixture of experts: DeepSpeed's MoE machinery for hybrid's MoE layers ------------------------

def register_moe_layers(model, layout, zero_stage: int = 0) -> int:
    """Let DeepSpeed 0.19's engine treat hybrid's MoE layers (hybrid.model.moe.moe_layer.MoELayer) as its own:
    the engine turns on its MoE handling (expert parameters reduced over the expert-data-parallel group
    and averaged over DP, their own optimizer groups through `split_params_into_different_moe_groups_
    for_optimizer`, each expert written to its own `layer_{i}_expert_{e}_mp_rank_XX_model_states.pt`
    file and read back by global expert index) only for modules that are instances of
    `deepspeed.moe.layer.MoE`, and it finds the expert groups by name (`ep_size_{EP}`) in
    `deepspeed.utils.groups`. So: the layout's EP and EDP groups (`layout`: hybrid.parallel.groups.
    ParallelGroups; our rank order, EP inside DP x CP) go into
    those dictionaries, and each MoE layer becomes an instance of a subclass of both classes
    (`MoE.__init__`, which builds DeepSpeed's own gate and experts, never runs; the layer carries the
    attributes the engine reads: num_experts, ep_size, expert_group_name, num_local_experts). Returns
    the number of MoE layers. Call before deepspeed.initialize. With ZeRO-3 (DeepSpeed 0.19 refuses its
    MoE layers there; EP 1 only) the experts stay ordinary parameters, partitioned over DP, each registered
    as an external parameter of its layer (`deepspeed.zero.register_external_parameter`) since the layer
    reads their weights in its own forward.

    Every model's call (a dense one's too) first empties DeepSpeed's expert registries: they are module-level and
    outlive the run that filled them, and DeepSpeed 0.19.8's universal-checkpoint load asks the largest registered
    expert group for its rank (`base_optimizer._get_universal_checkpoint_ep_info`, which catches RuntimeError but
    not the ValueError of a destroyed group): a dense model resumed from a universal checkpoint in a process that
    had trained an MoE model ended "Group ... is not registered"."""
    # this model's groups only: DeepSpeed saves by the largest EP size registered, so the groups of an earlier
    # model in this process (destroyed since) must not stay behind
    for registry in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS,
                     ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
        registry.clear()
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        return 0
    if zero_stage == 3:  # EP 1 only (capabilities): experts are ordinary parameters ZeRO-3 partitions over DP
        for layer in layers:
            for param in layer.deepspeed_moe.parameters():
                del param.allreduce, param.group_name  # not DeepSpeed MoE parameters here
                # used in the layer's own forward (no expert module is called): gathered with it
                deepspeed.zero.register_external_parameter(layer, param)
        return len(layers)
    if not layout.edp.ranks:
        raise RuntimeError("the model has MoE layers but its groups were built without expert groups "
                           "(hybrid.parallel.groups.build_groups(..., experts=True))")
    name = layers[0].expert_group_name
    ds_groups._EXPERT_PARALLEL_GROUP[name] = layout.ep.group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(layout.ep.ranks)
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = layout.edp.group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(layout.edp.ranks)
    for layer in layers:
        layer.__class__ = _deepspeed_moe_class(type(layer), MoE)
    return len(layers)


_MOE_CLASSES: dict = {}


def _deepspeed_moe_class(cls, moe_base):
    if cls not in _MOE_CLASSES:
        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            if self.expert_group_name not in ds_groups._get_expert_parallel_group_dict():
                raise RuntimeError(f"expert groups {self.expert_group_name} were not registered "
                                   f"(hybrid.training.deepspeed_fixes.register_moe_layers)")
        _MOE_CLASSES[cls] = type(cls.__name__, (cls, moe_base), {
            "set_deepspeed_parallelism": set_deepspeed_parallelism, "forward": cls.forward,
            "__module__": cls.__module__, "__doc__": cls.__doc__})
    return _MOE_CLASSES[cls]


# --- --optimizer muon under ZeRO ----------------------------------------------------------------------

def zero_partitions(zero_optimizer) -> list:
    """Where each parameter lies in the flat fp32 partitions DeepSpeed 0.19.8's ZeRO optimizers hand their client
    optimizer (hybrid.training.muon.ShardedMuonWithAdamW, which needs each matrix whole), as
    hybrid.training.muon.FlatPartition's:
    - ZeRO-1/2 (`DeepSpeedZeroOptimizer`): group i's parameters (`round_robin_bit16_groups[i]`, at
      `round_robin_bit16_offsets[i]`, alignment padding included) form one flat buffer cut into equal partitions
      over `real_dp_process_group[i]`; `single_partition_of_fp32_groups[i]` is this rank's, the tensor put in
      the client's group i;
    - ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`): sub-group s (`fp16_groups[s]`) is partitioned per parameter
      over `sub_group_process_groups[s]`, each rank holding `partition_numel()` elements of each (rank r the
      elements from r times that), one after another in `fp32_partitioned_groups_flat[s]` (the order
      `_partitioned_params_swap_out` reads them in), the tensor put in its group for that sub-group's step."""
    partitions, device = [], torch.device(get_accelerator().current_device_name())
    if hasattr(zero_optimizer, "single_partition_of_fp32_groups"):
        for i, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
            group = zero_optimizer.real_dp_process_group[i]
            params = [Partitioned(p, tuple(p.shape), offset) for p, offset in
                      zip(zero_optimizer.round_robin_bit16_groups[i], zero_optimizer.round_robin_bit16_offsets[i])]
            partitions.append(FlatPartition(flat, group, dist.get_world_size(group), dist.get_rank(group), params,
                                            device))
        return partitions
    for s, flat in enumerate(zero_optimizer.fp32_partitioned_groups_flat):
        group, params, offset = zero_optimizer.sub_group_process_groups[s], [], 0
        for p in zero_optimizer.fp16_groups[s]:
            params.append(Partitioned(p, tuple(p.ds_shape), offset, p.partition_numel(), contiguous=False))
            offset += p.partition_numel()
        partitions.append(FlatPartition(flat, group, dist.get_world_size(group), dist.get_rank(group), params, device))
    return partitions


@contextlib.contextmanager
def zero3_gathered_while_generating(engine, log=None):
    """A generation (hybrid.model.generate, --grpo's rollouts) with this rank's ZeRO-3 parameters gathered once, not
    by ZeRO-3's hooks layer by layer at every step (DeepSpeed 0.19.8: 0.26x ZeRO-1's decode speed). No API does it
    (TRL's ds3_gather_for_generation does as here; DeepSpeed issue 5498): for the block the module hooks are removed
    and the parameters gathered (partitioned on exit), then the hooks set up again with the same module numbers and
    the top module on `FWD_MODULE_STACK` once (see release_engine). Where CUDA's free memory cannot hold the stage
    with a quarter to spare (one decision for all ranks) the hooks stay, said through `log`. Yields whether gathered."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    if offload is None or not params:
        yield False
        return
    need = sum(p.ds_numel * p.element_size() for p in params)
    device = torch.device(get_accelerator().current_device_name())
    fits = device.type != "cuda" or torch.cuda.mem_get_info(device)[0] >= 1.25 * need
    if dist.is_initialized() and dist.get_world_size() > 1:  # one decision for every rank (their collectives meet)
        agreed = torch.tensor([1 if fits else 0], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        fits = bool(agreed.item())
    if not fits:
        if log is not None:
            log(f"ZeRO-3: the stage's {need / 2 ** 30:.1f} GiB of parameters do not fit beside what is allocated: "
                f"generation fetches them layer by layer at every step (slower)")
        yield False
        return
    from deepspeed.runtime.zero import parameter_offload, partition_parameters  # (only ZeRO-3 reaches here)
    first = engine.module.ds_id
    resets = offload.fwd_pre_hook.id in engine.module._forward_pre_hooks  # (not at PP > 1: prepare_pipeline_engine)
    offload.get_param_coordinator().release_and_reset_all(engine.module)  # nothing held or in flight (TRL's too)
    offload._remove_module_hooks()
    # torch's F.linear for the block, not ZeRO-3's zero3_linear_wrap (set for good; for backward; a third of decoding)
    linear = getattr(partition_parameters.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    patched, torch.nn.functional.linear = torch.nn.functional.linear, linear or torch.nn.functional.linear
    try:  # flat all-gathers (ZeRO-3's prefetch path), split as its coordinator splits them (hpZ's secondary
        chunks, sizes = {}, {}  # partitions, quantized ones), an eighth of the stage at most (within the spare)
        for p in (p for p in params if p.ds_status.name == "NOT_AVAILABLE"):
            kind = (getattr(p, "ds_secondary_tensor", None) is not None, hasattr(p.ds_tensor, "ds_quant_scale"))
            if sizes.get(kind, need) + p.ds_numel * p.element_size() > need / 8:
                chunks.setdefault(kind, []).append([])
                sizes[kind] = 0
            chunks[kind][-1].append(p)
            sizes[kind] += p.ds_numel * p.element_size()
        for chunk in (chunk for kind in chunks.values() for chunk in kind):
            chunk[0].all_gather_coalesced(chunk).wait()
        with deepspeed.zero.GatheredParameters(params):
            yield True
    finally:
        torch.nn.functional.linear = patched
        offload.forward_hooks.clear()
        offload.backward_hooks.clear()
        counter = parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]
        kept, counter[0] = counter[0], first
        offload.setup_zero_stage3_hooks()
        counter[0] = kept
        if not resets:
            offload.fwd_pre_hook.remove()
        stack = parameter_offload.FWD_MODULE_STACK
        if stack and stack[-1] is engine.module and sum(m is engine.module for m in stack) > 1:
            stack.pop()
