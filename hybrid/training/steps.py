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

from hybrid.training.reduction import PerPairScale, PerTokenScale, dp_mean, take


class EngineStep:
    """PP = 1: gradient-accumulation micro-steps on the plain DeepSpeed engine (it steps the optimizer
    on the last); losses are this rank's, reduced over DP x CP by `reduce`."""

    def __init__(self, engine, groups, eval_micro_batches: int, per_token: bool = False, dpo=None, reference=None):
        self.engine, self.groups, self.eval_micro_batches = engine, groups, eval_micro_batches
        self.per_token = PerTokenScale(groups, torch.device(engine.device)) if per_token else None
        self.dpo = dpo  # --dpo's options; the frozen starting model, or None when the batches carry its values
        self.reference = reference
        if dpo is not None:
            self.per_token = PerPairScale(groups, torch.device(engine.device), dpo.separator)

    def _forward(self, ids, labels, scale, extra=()):
        if self.dpo is None:
            return self.engine(ids, labels, token_scale=scale)
        if self.reference is not None:
            with torch.no_grad():
                reference = self.reference(ids, labels, document_logps=True)
        else:  # --dpo-reference-logps: the window's values (hybrid.training.reference_logps)
            reference = (extra[0], None)
        return self.engine(ids, labels, token_scale=scale, reference=reference)

    def train(self, batches) -> torch.Tensor:
        steps = self.engine.gradient_accumulation_steps()  # changes under --rampup-batch-size
        micro = take(batches, steps)
        scale = self.per_token(micro) if self.per_token else None
        total = None
        for ids, labels, *extra in micro:
            loss = self._forward(ids, labels, scale, extra)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach() if total is None else total + loss.detach()
        return total / steps

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        micro = take(batches, self.eval_micro_batches)
        scale = self.per_token(micro) if self.per_token else None
        return torch.stack([self._forward(ids, labels, scale, extra).detach().float()
                            for ids, labels, *extra in micro]).mean()

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        return dp_mean(stacked, self.groups)


class DeepSpeedPipelineStep:
    """PP > 1 with DeepSpeed's PipelineEngine (its 1F1B TrainSchedule); DeepSpeed's returned loss is
    already the DP mean, on every stage. The per-token scale goes to the pipeline's loss
    (hybrid.model.deepspeed_pipeline.PipelineLoss), which the engine calls itself. With --dpo the labels
    travel to the last stage as `(labels, ids, reference sums)` (the values ride in the batches:
    --dpo-reference-logps), the scale is per pair."""

    def __init__(self, engine, groups, per_token: bool = False, dpo=None):
        self.engine, self.groups, self.dpo = engine, groups, dpo
        self.loss_fn = engine.module.loss_fn
        self.per_token = PerTokenScale(groups, torch.device(engine.device)) if per_token else None
        if dpo is not None:
            self.per_token = PerPairScale(groups, torch.device(engine.device), dpo.separator)

    def _micro_batches(self, batches):
        micro = take(batches, self.engine.gradient_accumulation_steps())
        self.loss_fn.token_scale = self.per_token(micro) if self.per_token else None
        if self.dpo is not None:
            return iter([(ids, (labels, ids, *extra)) for ids, labels, *extra in micro])
        return iter(micro)

    def train(self, batches) -> torch.Tensor:
        return self.engine.train_batch(data_iter=self._micro_batches(batches)).detach().float().reshape(())

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        return self.engine.eval_batch(data_iter=self._micro_batches(batches)).detach().float().reshape(())

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        return stacked


def build_step(run, groups, engine, reference=None):
    """The step of this run: DeepSpeed's pipeline, a torch.distributed.pipelining schedule, or the
    plain engine (`reference`: --dpo's frozen model at PP = 1, None where --dpo-reference-logps puts its values in
    the batches, as a pipeline needs; the capability table says)."""
    training = run.training
    if run.virtual_pipeline:
        # not at the top: torch.distributed.pipelining takes 1.3 s to import, and only these schedules use it
        from hybrid.training.pipelining import TorchPipelineStep
        return TorchPipelineStep(engine, engine.module, groups, run.pipeline.schedule, training.grad_acc_steps,
                                 torch.device(engine.device), training.micro_batch_size, training.seq_length,
                                 training.per_token_loss, training.dpo)
    if run.deepspeed_pipeline:
        return DeepSpeedPipelineStep(engine, groups, training.per_token_loss, training.dpo)
    return EngineStep(engine, groups, training.grad_acc_steps, training.per_token_loss, training.dpo, reference)
