"""Writing checkpoints during a run: DeepSpeed's files plus hybrid's client state, then the manifest and
the pointers once every rank's files are complete.

DeepSpeed writes the files (model states per TP/PP rank, ZeRO optimizer partitions per DP rank). We
add (hybrid.checkpoint.client_state): iteration, consumed samples, the model and the layout, the flags,
every RNG state, and DeepSpeed's `universal_checkpoint_info` patterns so its universal-checkpoint tools
can reshape the files. DeepSpeed's own `latest` write can precede other ranks' files reaching disk, so we
save with save_latest=False, wait for every rank, then rename a complete `latest` into place.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import deepspeed
import torch
import torch.distributed as dist

from hybrid.checkpoint.client_state import ClientState
from hybrid.checkpoint.files import tag_for, write_latest
from hybrid.checkpoint.manifest import write_manifest
from hybrid.checkpoint.tp_layout import join_vocab_blocks, tp_layout, universal_checkpoint_info
from hybrid.config import RunConfig, checkpoint_summary
from hybrid.conversion import peft
from hybrid.model import lora
from hybrid.model.naming import canonical_parameters, vocab_block
from hybrid.parallel.layers import unshard
from hybrid.parallel.random import get_rng_states
from hybrid.training.logging import log

ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint: its adapters as a PEFT adapter directory


def optimizer_param_names(engine, run: RunConfig) -> Optional[list]:
    """Without ZeRO, the optimizer's state is indexed by parameter position; record each position's
    canonical name so the checkpoint can be made universal (hybrid.conversion.universal)."""
    if run.zero_stage != 0 or run.training.precision != "fp32":
        return None
    names = {id(p): name for name, p in canonical_parameters(engine.module, run.model.num_layers).items()}
    return [[names[id(p)] for p in group["params"]] for group in engine.optimizer.param_groups]


def _universal_info(run: RunConfig) -> dict:
    """Every layout names parameters by their canonical names (a tied table's copy is not a parameter); ZeRO-3's
    row blocks of a vocabulary table by theirs (RunConfig.model_form)."""
    return universal_checkpoint_info(run.model_form, run.parallel.tensor_parallel)


def write_files(engine, run: RunConfig, save_dir: str, iteration: int, consumed_samples: int, sequence=None) -> str:
    """DeepSpeed's files of this checkpoint (with --async-save: their host copies, handed to the background
    writer); no manifest, no pointer yet. Returns the tag. `sequence`: the CP / Ulysses Axis, whose ranks'
    RNG states are all kept (one of them writes the client state)."""
    tag = tag_for(iteration)
    universal = _universal_info(run)
    if run.model.num_experts:  # DeepSpeed's MoE save takes these from the module and refuses them as client state
        engine.module.universal_checkpoint_info, universal = universal, None
    summary = checkpoint_summary(run)
    client_state = ClientState(iteration=iteration, consumed_samples=consumed_samples, model=summary.pop("model"),
                               layout=run.saved_layout(), run=summary, args=run.args,
                               rng_states=None if run.checkpoint.no_save_rng else get_rng_states(sequence),
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
        write_latest(save_dir, tag)
    if dist.is_initialized():
        dist.barrier()
    log(f"saved checkpoint {tag} to {save_dir}")


def gather_adapters(model, config, groups) -> Optional[dict]:
    """With LoRA: every adapter matrix, and the weights of --lora-modules-to-save, whole (canonical names) on rank 0,
    None on the others; from each rank's shards (under ZeRO-3 its partitions gathered first), joined over TP (a
    table's row blocks into the table), from every pipeline stage. Collective: every rank calls it. The adapters are
    small (rank x width per projection), so they travel as objects."""
    params = {n: p for n, p in canonical_parameters(model, config.num_layers).items() if lora.trains(n, config)}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        local = {n: p.detach().float().cpu().clone() for n, p in params.items()}
    sender = groups.dp_cp.rank == 0 and groups.ulysses.rank == 0  # one copy of each TP rank's shards per stage
    mine = (groups.tp.rank, local if sender else {})
    if not dist.is_initialized():
        shards = [mine]
    else:  # to rank 0 only (all_gather_object would give every rank every payload, on the device under NCCL)
        shards = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, shards, dst=0)
        if dist.get_rank() != 0:
            return None
    by_name: dict = {}
    for tp_rank, tensors in shards:
        for name, tensor in tensors.items():
            by_name.setdefault(name, {})[tp_rank] = tensor
    rules = tp_layout(config)
    whole = {name: torch.cat([parts[r] for r in sorted(parts)]) for name, parts in by_name.items() if vocab_block(name)}
    join_vocab_blocks(whole, groups.tp.size)  # (each block: that block of every TP rank, in rank order)
    for name, parts in by_name.items():
        if not vocab_block(name):
            rule = rules[name]
            whole[name] = parts[0] if rule.dim is None else unshard([parts[r] for r in sorted(parts)], rule.dim)
    return whole


def write_adapter(engine, run: RunConfig, groups, save_dir: str, tag: str) -> None:
    """A LoRA run's adapters as a PEFT adapter directory in the checkpoint (`<tag>/adapter`), from every rank; none
    for a family whose HF modules PEFT's keys here cannot name (the checkpoint merges with --saver hf)."""
    if not peft.peft_named(run.model):
        return
    state = gather_adapters(engine.module, run.model, groups)
    if state is not None:
        base = run.checkpoint.load_hf or "(the base model)"
        peft.write_adapter(state, run.model, os.path.join(save_dir, tag, ADAPTER_DIR), base, replace=True)


class CheckpointSaver:
    """The run's saves into --save: each written through DeepSpeed and completed (manifest, `latest`) at
    once, or with --async-save in the background, completed at the next log line, the next save or the
    end of the run, whichever comes first. Keeps the training thread's time spent saving for the log."""

    def __init__(self, engine, run: RunConfig, groups, device):
        self.engine, self.run, self.groups, self.device = engine, run, groups, device
        self.last_saved_tag: Optional[str] = None  # the newest checkpoint this run completed
        self.unfinished: Optional[str] = None  # --async-save: the tag whose files are being written
        self.stall_seconds = 0.0  # training-thread time spent saving since the last take_stall()

    def save(self, iteration: int, consumed: int) -> None:
        self.finish()
        start = time.perf_counter()
        self.unfinished = write_files(self.engine, self.run, self.run.checkpoint.save, iteration, consumed,
                                      self.groups.sequence)
        if self.run.model.lora_rank:  # (PEFT's format beside DeepSpeed's files: adapters that peft loads as they are)
            write_adapter(self.engine, self.run, self.groups, self.run.checkpoint.save, self.unfinished)
        self.stall_seconds += time.perf_counter() - start
        if not self.run.checkpoint.async_save:
            self.finish()

    def finish(self, blocking: bool = True) -> None:
        """Complete the checkpoint being written, if one is. Not `blocking` (at log lines): only once
        every rank's background writes are done (one all-reduce of a flag)."""
        if self.unfinished is None or (not blocking and not self._writes_done_everywhere()):
            return
        start = time.perf_counter()
        finalize(self.engine, self.run.checkpoint.save, self.unfinished)
        self.stall_seconds += time.perf_counter() - start
        self.last_saved_tag, self.unfinished = self.unfinished, None

    def take_stall(self) -> float:
        stall, self.stall_seconds = self.stall_seconds, 0.0
        return stall

    def _writes_done_everywhere(self) -> bool:
        writer = getattr(self.engine, "checkpoint_engine", None)
        pending = torch.tensor([0.0 if not hasattr(writer, "done") or writer.done() else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        return pending.item() == 0.0
