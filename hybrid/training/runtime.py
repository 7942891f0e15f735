"""The one runtime: every training and evaluation iteration, at every pipeline schedule, PP = 1 included, over
the one model form (hybrid.model.virtual_stages.RankModel) registered with DeepSpeed, for any objective
(hybrid.model.objectives).

- PP = 1: DeepSpeed's own gradient accumulation (micro-batches through `engine(...)`, `engine.backward`,
  `engine.step` on each; the optimizer steps on the last), so every ZeRO stage, offload and fp16 loss scaling
  run as DeepSpeed runs them.
- PP > 1: a `torch.distributed.pipelining` schedule (1F1B, interleaved 1F1B, zero-bubble, ZB-V, DualPipeV) runs
  the stages; each stage's forward goes through `engine(...)` (the engine wraps this rank's RankModel), so
  DeepSpeed's ZeRO-1/2/3 hooks see every backward the schedule runs, and one `engine.step()` ends the
  iteration. DeepSpeed's caller-owned accumulation (`"managed_gradient_accumulation": false`, set by
  hybrid.ds_config for PP > 1) makes every backward a non-boundary one: ZeRO-2/3 reduce-scatter each
  micro-batch's gradients into their partitions, ZeRO-0/1 reduce at the step (hybrid.training.deepspeed_fixes
  keeps DeepSpeed's per-backward bookkeeping right when one rank runs several backwards between forwards).
- The zero-bubble schedules split each backward into an input- and a weight-gradient step (torch's own
  split) where DeepSpeed keeps the gradients until the step (ZeRO-0/1) and nothing recomputes or is compiled;
  otherwise (ZeRO-2/3, whose hooks reduce what the backward accumulates; activation recompute; compiled
  layers; a tied table's copy) the input step runs the whole backward and the weight step is empty: the same
  gradients, the schedule's order kept, its weight-gradient overlap given up.
- A tied embedding with the loop placement is one parameter on the first stage; the last stage's copy gets the
  parameter after every step, and the copy's gradient joins the parameter's before DeepSpeed reduces it
  (`TiedTable`).

The loss: each micro-batch's objective loss, the iteration's the mean over micro-batches (or, per token or per
pair, over the whole global batch: `ItemScale`), averaged over DP x CP by DeepSpeed.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from hybrid.model.forward_only import forward_only
from hybrid.model.objectives import Objective
from hybrid.model.virtual_stages import RankModel
from hybrid.training.reduction import ItemScale, dp_mean, take


class Runtime:
    """Training and evaluation iterations of one run (see the module docstring). Every step takes the same
    micro-batches, `(ids [b, s], labels [b, s], *extra)`, and offers:
    - `train(batches)`: one iteration; its mean loss on the device (on the loss rank of a pipeline);
    - `evaluate(batches)`: one evaluation iteration's loss, no gradients;
    - `score(batches, objective)`: forward only, each micro-batch's `objective.loss` output on the last stage;
    - `reduce(stacked)`: per-iteration losses -> their means over DP (and from a pipeline's loss rank), one
      collective; the caller syncs once."""

    def __init__(self, engine, groups, objective: Objective, micro_batches: int, eval_micro_batches: int,
                 pipeline=None, micro_batch: int = 1, seq_length: int = 0, full_backward: bool = False):
        self.engine, self.groups, self.objective = engine, groups, objective
        self.model: RankModel = engine.module
        self.device = torch.device(engine.device)
        self.micro_batches, self.eval_micro_batches = micro_batches, eval_micro_batches
        self.scale = ItemScale(objective, groups, self.device) if objective.per_item else None
        self.pipelined = groups.pp.size > 1
        self.tied = self.pipeline = None
        if self.pipelined:
            # not at the top: torch.distributed.pipelining takes 1.3 s to import, and only pipelines use it
            from hybrid.training.pipeline_stages import PipelineSchedules, TiedTable
            self.tied = TiedTable(self.model, groups, self.device)
            self.pipeline = PipelineSchedules(self, pipeline, micro_batch, seq_length, full_backward)

    # --- training ---------------------------------------------------------------------------------

    def train(self, batches) -> torch.Tensor:
        micro = take(batches, self.micro_batches)
        scale = self.scale(micro) if self.scale else None
        if self.pipelined:
            return self.pipeline.train(micro, scale)
        total = None
        for ids, labels, *extra in micro:  # DeepSpeed's gradient accumulation: it steps on the last
            logits = self.engine(ids, stage=0, **self.objective.model_inputs(extra))
            loss = self.objective.loss(logits, self.objective.target(ids, labels, extra), scale)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        return total / len(micro)

    # --- forward only -----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        micro = take(batches, self.eval_micro_batches)
        scale = self.scale(micro) if self.scale else None
        losses = self.score(micro, self.objective, scale)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float().reshape(()) for loss in losses]).mean()

    @torch.no_grad()
    def score(self, micro: list, objective: Objective, scale=None) -> list:
        """`objective.loss` of every micro-batch of `micro`, forward only through this rank's stages in order;
        empty on the pipeline ranks without the last stage."""
        if self.tied is not None:
            self.tied.sync_once()
        targets = [objective.target(ids, labels, extra) for ids, labels, *extra in micro]
        ids = [ids for ids, *_ in micro]
        inputs = [objective.model_inputs(extra) for _, _, *extra in micro]
        return forward_only(self.model, self.groups, self.device, ids,
                            lambda mb, out: objective.loss(out, targets[mb], scale), call=self.engine, inputs=inputs)

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        """Per-iteration losses from the loss rank to its whole pipeline, then the DP mean."""
        if self.pipelined and self.groups.pp.size > 1:
            dist.broadcast(stacked, src=self.pipeline.loss_src, group=self.groups.pp.group)
        return dp_mean(stacked, self.groups)


def full_backward_needed(run) -> bool:
    """Whether a zero-bubble schedule's input step runs the whole backward (see the module docstring; the
    stage reading a tied table's copy decides that for itself)."""
    return run.zero_stage >= 2 or bool(run.model.recompute_granularity) or run.training.torch_compile


def build_runtime(run, groups, engine, objective: Objective) -> Runtime:
    """The runtime of this run's layout and schedule."""
    training = run.training
    return Runtime(engine, groups, objective, training.grad_acc_steps, training.grad_acc_steps, run.pipeline,
                   training.micro_batch_size, training.seq_length, full_backward_needed(run))
