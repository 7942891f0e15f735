"""One step interface for every way an iteration runs, chosen once per run (`build_step`).

Every step takes the same micro-batches, `(ids [b, s], labels [b, s])` with IGNORE_INDEX where no
loss is taken, and offers:
- `train(batches)`: one iteration (forward, backward, optimizer step); its loss on the device;
- `evaluate(batches)`: one evaluation iteration's loss on the device, no gradients;
- `reduce(stacked)`: per-iteration losses stacked on the device -> their means over the data-parallel
  ranks (and from the loss rank of a pipeline), with one collective; the caller syncs once.

Loss reduction (the rule for combining micro-batches and DP ranks):
- default (Megatron-LM's): each micro-batch's loss is the mean over its valid tokens, the iteration's
  loss the mean over micro-batches and DP ranks;
- `--calculate-per-token-loss`: the iteration's loss is the sum over every valid token of the global
  batch / their number. Each micro-batch's loss is its token sum times GAS x DP / N, N counted over the
  iteration's micro-batches on every DP rank before the first forward (one small all-reduce on the
  device, no host sync), so DeepSpeed's division by GAS and its DP average give exactly that.

Implementations: `EngineStep` (PP = 1, micro-steps on the plain engine), `DeepSpeedPipelineStep`
(DeepSpeed's 1F1B PipelineEngine), and hybrid.training.pipelining.TorchPipelineStep (the
torch.distributed.pipelining schedules).
"""

from __future__ import annotations

import torch

from hybrid.training.reduction import PerTokenScale, dp_mean, take


class EngineStep:
    """PP = 1: gradient-accumulation micro-steps on the plain DeepSpeed engine (it steps the optimizer
    on the last); losses are this rank's, reduced over DP by `reduce`."""

    def __init__(self, engine, topology, eval_micro_batches: int, per_token: bool = False):
        self.engine, self.topology, self.eval_micro_batches = engine, topology, eval_micro_batches
        self.loss_fn = engine.module.loss_fn
        self.per_token = PerTokenScale(topology, torch.device(engine.device)) if per_token else None

    def train(self, batches) -> torch.Tensor:
        steps = self.engine.gradient_accumulation_steps()  # changes under --rampup-batch-size
        micro = take(batches, steps)
        self.loss_fn.token_scale = self.per_token(micro) if self.per_token else None
        total = None
        for ids, labels in micro:
            loss = self.engine(ids, labels)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        return total / steps

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        micro = take(batches, self.eval_micro_batches)
        self.loss_fn.token_scale = self.per_token(micro) if self.per_token else None
        return torch.stack([self.engine(ids, labels).detach().float() for ids, labels in micro]).mean()

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        return dp_mean(stacked, self.topology)


class DeepSpeedPipelineStep:
    """PP > 1 with DeepSpeed's PipelineEngine (its 1F1B TrainSchedule); DeepSpeed's returned loss is
    already the DP mean, on every stage."""

    def __init__(self, engine, topology, per_token: bool = False):
        self.engine, self.topology = engine, topology
        self.loss_fn = engine.module.loss_fn
        self.per_token = PerTokenScale(topology, torch.device(engine.device)) if per_token else None

    def _micro_batches(self, batches):
        micro = take(batches, self.engine.gradient_accumulation_steps())
        self.loss_fn.token_scale = self.per_token(micro) if self.per_token else None
        return iter(micro)

    def train(self, batches) -> torch.Tensor:
        return self.engine.train_batch(data_iter=self._micro_batches(batches)).detach().float().reshape(())

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        return self.engine.eval_batch(data_iter=self._micro_batches(batches)).detach().float().reshape(())

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked


def build_step(run, topology, engine):
    """The step of this run: DeepSpeed's pipeline, a torch.distributed.pipelining schedule, or the
    plain engine."""
    per_token = run.train.per_token_loss
    if run.virtual_pipeline:
        from hybrid.training.pipelining import TorchPipelineStep
        return TorchPipelineStep(engine, engine.module, topology, run.pipeline_schedule, run.train.grad_acc_steps,
                                 torch.device(engine.device), run.train.micro_batch_size, run.train.seq_length,
                                 per_token)
    if run.deepspeed_pipeline:
        return DeepSpeedPipelineStep(engine, topology, per_token)
    return EngineStep(engine, topology, run.train.grad_acc_steps, per_token)
