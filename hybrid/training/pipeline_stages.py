"""PP > 1 in the runtime (hybrid.training.runtime): this rank's virtual stages as torch.distributed.pipelining
stages, each one's forward through the DeepSpeed engine, the run's schedule over them, and a tied embedding's one
gradient across the first and last stage (`TiedTable`)."""

from __future__ import annotations

import weakref

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from hybrid.capabilities import SPLIT_BACKWARD, TORCH_SCHEDULES
from hybrid.model import lora
from hybrid.model.forward_only import hidden_shape
from hybrid.model.naming import EMBEDDING_WEIGHT
from hybrid.model.virtual_stages import RankModel
from hybrid.training import deepspeed_fixes


def schedule_class(name: str):
    return getattr(schedules, TORCH_SCHEDULES[name])


class PipelineSchedules:
    """PP > 1: this rank's stages as torch.distributed.pipelining stages and the run's schedule over them."""

    def __init__(self, runtime, pipeline, micro_batch: int, seq_length: int, full_backward: bool):
        self.runtime = runtime
        model, groups, engine = runtime.model, runtime.groups, runtime.engine
        self.plans = model.all_plans
        # a tied table's copy is no parameter of the stage: torch's weight step would not reach it
        self.split = pipeline.schedule in SPLIT_BACKWARD and not full_backward and not model.holds_tied_copy
        call = engine if deepspeed_fixes.runs_tensor_backward(engine) else model
        no_weight_step = None if self.split else (lambda: _nothing)
        self.stages = [DeepSpeedStage(StageEntry(call, index, stage), stage.plan.index, len(self.plans),
                                      runtime.device, group=groups.pp.group,
                                      input_args=self._input_meta(stage, micro_batch, seq_length),
                                      output_args=self._output_meta(stage, micro_batch, seq_length),
                                      dw_builder=no_weight_step, engine=engine)
                       for index, stage in enumerate(model.stages)]
        self.has_first = any(s.first for s in model.stages)
        self.has_last = any(s.last for s in model.stages)
        self.scale = None  # this iteration's per-item factor, read by the loss function
        self.count = runtime.micro_batches
        objective = runtime.objective

        def loss_fn(logits, target):
            # the mean over micro-batches is taken here (scale_grads=False); fp16: DeepSpeed's loss scale
            return deepspeed_fixes.scaled_for_backward(engine, objective.loss(logits, target, self.scale) / self.count)

        cls = schedule_class(pipeline.schedule)
        if pipeline.schedule == "1f1b" and self.count < groups.pp.size:
            cls = schedules.ScheduleGPipe  # what 1F1B is with fewer micro-batches than stages (torch's refuses)
        stages = self.stages[0] if issubclass(cls, schedules.PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=self.count, loss_fn=loss_fn, scale_grads=False)
        last_pp_rank = next(p.rank for p in self.plans if p.last)  # the rank computing the loss
        self.loss_src = dist.get_global_rank(groups.pp.group, last_pp_rank)

    # The shapes each stage receives and sends, given to PipelineStage up front. Without them PyTorch infers
    # them by running every stage's forward and backward once on the first step, which draws from the dropout
    # RNG: a resumed run would then differ from an uninterrupted one.
    def _dtype(self):
        return next(self.runtime.model.parameters()).dtype

    def _hidden_meta(self, micro_batch: int, seq_length: int):
        return torch.empty(hidden_shape(self.runtime.model.config, self.runtime.groups, micro_batch, seq_length),
                           dtype=self._dtype(), device="meta", requires_grad=True)

    def _input_meta(self, stage, micro_batch: int, seq_length: int):
        if stage.first:
            return torch.empty(micro_batch, seq_length, dtype=torch.long, device="meta")
        return self._hidden_meta(micro_batch, seq_length)

    def _output_meta(self, stage, micro_batch: int, seq_length: int):
        if not stage.last:
            return self._hidden_meta(micro_batch, seq_length)
        config, groups = self.runtime.model.config, self.runtime.groups
        tp = groups.tp.size
        vocab = config.vocab_size if tp == 1 else config.padded_vocab_size(tp) // tp  # see parallel_logits
        depths = 1 + (config.mtp_num_layers or 0)  # (training: multi-token prediction's logits follow)
        return torch.empty(depths * seq_length // groups.sequence_split, micro_batch, vocab, dtype=self._dtype(),
                           device="meta", requires_grad=True)

    def train(self, micro: list, scale) -> torch.Tensor:
        """Forward and backward of every micro-batch, one optimizer step. Returns this iteration's mean loss
        on the loss rank (zero elsewhere; see Runtime.reduce)."""
        runtime, engine = self.runtime, self.runtime.engine
        self.scale = scale
        runtime.tied.sync_once()
        objective = runtime.objective
        ids = torch.cat([ids for ids, *_ in micro])
        target = torch.cat([objective.target(i, labels, extra) for i, labels, *extra in micro])
        deepspeed_fixes.begin_accumulation(engine)
        runtime.tied.begin(len(micro))
        unscale = 1.0 / deepspeed_fixes.loss_scale(engine)  # the loss the schedule saw, as logged (fp16: scaled)
        losses: list = []
        args = (ids,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if runtime.model.config.stages_take_ids:  # packed documents, multi-token prediction's tokens ahead
            kwargs["batch_ids"] = ids
        inputs = [objective.model_inputs(extra) for _, _, *extra in micro]
        if inputs[0]:  # --grpo's recorded routing: every stage reads its own MoE layers' part
            kwargs.update({name: torch.cat([i[name] for i in inputs]) for name in inputs[0]})
        # the last stage's logits are not kept for the caller (the loss consumed them in place; keeping each
        # micro-batch's until the next iteration would hold micro-batches x sequence x vocabulary)
        self.schedule.step(*args, return_outputs=False, **kwargs)
        runtime.tied.end()
        deepspeed_fixes.ensure_reduction_buckets(engine)
        engine.step()
        runtime.tied.sync()
        if not losses:
            return torch.zeros((), device=runtime.device)
        return torch.stack([loss.detach().float().reshape(()) for loss in losses]).sum() * unscale


def _nothing():
    """The weight-gradient step of a backward that the input step ran whole."""


class StageEntry(nn.Module):
    """What a PipelineStage runs: virtual stage `index` of the rank's model, through the DeepSpeed engine
    (`call`; the model itself where DeepSpeed's ZeRO hooks need no forward of their own). Its child is the
    virtual stage, so `parameters()` are that stage's (torch's weight-gradient step differentiates them)."""

    def __init__(self, call, index: int, stage: nn.Module):
        super().__init__()
        object.__setattr__(self, "call", call)
        self.index = index
        self.stage = stage

    def forward(self, hidden, batch_ids=None, routes=None):
        return self.call(hidden, stage=self.index, batch_ids=batch_ids, routes=routes)


class DeepSpeedStage(PipelineStage):
    """torch's PipelineStage, telling the DeepSpeed engine before each backward the schedule runs that a new
    backward pass begins (hybrid.training.deepspeed_fixes.start_backward): torch's documented place for a
    data-parallel wrapper's per-backward work, as it does for DDP and FSDP."""

    def __init__(self, *args, engine=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        deepspeed_fixes.start_backward(self.engine)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class TiedTable:
    """A tied embedding with the loop placement: one parameter (the first stage's) and one gradient.

    The last stage reads `model.tied_table`, a copy refreshed from the parameter after every optimizer step (a
    broadcast over the embedding group; under ZeRO-3 the parameter is gathered over its stage's DP ranks first).
    The copy's gradient accumulates over the iteration's micro-batches; after its last one the last stage sends
    it to the first, which adds it to the parameter's gradient in the first stage's last backward of the
    iteration (a tensor hook, before DeepSpeed's own hooks reduce it), so DeepSpeed reduces and steps the
    table's whole gradient once, at every ZeRO stage. In the loop placement the first stage's last backward
    comes after the last stage's (the gradient flows through every stage), so the receive waits on a send
    that was already made. A frozen table (LoRA's base) is copied once and exchanges no gradient."""

    def __init__(self, model: RankModel, groups, device):
        self.model, self.axis, self.device = model, groups.embedding, device
        self.first, self.last = model.holds_tied_parameter, model.holds_tied_copy
        self.trains = lora.trains(EMBEDDING_WEIGHT, model.config) if model.config.lora_rank else True
        self.expected = self.seen = 0
        self.synced = False
        self.transfer = None
        if self.first and self.trains:
            model.embedding.word_embeddings.weight.register_hook(_weak(self._with_copy_gradient))
        if self.last:
            dtype = next(p.dtype for p in model.parameters())
            model.tied_table = model.tied_table.to(device, dtype).requires_grad_(self.trains)
            if self.trains:
                model.tied_table.register_post_accumulate_grad_hook(_weak(self._send_copy_gradient))

    @property
    def active(self) -> bool:
        """This rank holds the table or its copy, and the table trains (a gradient crosses each iteration)."""
        return (self.first or self.last) and self.trains

    def begin(self, micro_batches: int) -> None:
        """Before an iteration's schedule: its micro-batch count; the first stage posts its receive."""
        if not self.active:
            return
        self.expected, self.seen = micro_batches, 0
        if self.first:
            weight = self.model.embedding.word_embeddings.weight
            self.buffer = torch.empty(_full_shape(weight), dtype=weight.dtype, device=self.device)
            self.transfer = dist.irecv(self.buffer, group=self.axis.group, group_src=1)

    def _with_copy_gradient(self, grad):
        self.seen += 1
        if self.seen != self.expected or self.transfer is None:
            return grad
        self.transfer.wait()
        self.transfer = None
        return grad + self.buffer

    def _send_copy_gradient(self, table) -> None:
        self.seen += 1
        if self.seen == self.expected:
            self.transfer = dist.isend(table.grad, group=self.axis.group, group_dst=0)

    def end(self) -> None:
        """After the schedule: the send is done, the copy's gradient dropped."""
        if self.last and self.trains:
            if self.transfer is not None:
                self.transfer.wait()
                self.transfer = None
            self.model.tied_table.grad = None
        self.expected = 0

    def sync_once(self) -> None:
        """The copy equal to the parameter before the first forward (after the weights were loaded)."""
        if not self.synced:
            self.sync()

    def sync(self) -> None:
        """The copy := the parameter (after each optimizer step; a frozen table's once)."""
        if self.synced and not self.trains:
            return
        self.synced = True
        if self.first:
            weight = self.model.embedding.word_embeddings.weight
            with deepspeed.zero.GatheredParameters([weight], enabled=hasattr(weight, "ds_id")):
                dist.broadcast(weight.data, group=self.axis.group, group_src=0)
        elif self.last:
            with torch.no_grad():
                dist.broadcast(self.model.tied_table.data, group=self.axis.group, group_src=0)


def _weak(method):
    """A tensor hook calling `method` while its object lives, nothing after: a tensor's hooks are held in C++,
    where Python's collector cannot see a cycle back through the object to the model (and the engine holding
    it), so a strong reference would keep them all once the run is over."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return hook


def _full_shape(param) -> tuple:
    """A parameter's shape, also while ZeRO-3 holds only its partition."""
    return tuple(getattr(param, "ds_shape", param.shape))
