"""Interleaved and zero-bubble pipeline schedules from `torch.distributed.pipelining`, with DeepSpeed
keeping the optimizer (ZeRO-1 partitions its state over DP x CP).

PyTorch runs the schedule (which stage computes which micro-batch when, the activations and
gradients sent between ranks, and for zero-bubble the split of each backward into its input- and
weight-gradient halves); we give it this rank's virtual stages (hybrid.model.virtual_stages) and a
loss; DeepSpeed then reduces the gradients over DP x CP and steps, as its own PipelineEngine does
after its schedule's backward passes (`reduce_gradients(pipeline_parallel=True)` for ZeRO-1, the
bucketed all-reduce without ZeRO). DeepSpeed's own 1F1B engine stays the `1f1b` default.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
from torch.distributed.pipelining import PipelineStage

from hybrid.capabilities import TORCH_SCHEDULES, V_SHAPED
from hybrid.model import preference
from hybrid.model.loss import LMLoss
from hybrid.model.virtual_stages import PipelineRankModel
from hybrid.pipeline_plan import plan_stages
from hybrid.training.reduction import PerPairScale, PerTokenScale


def schedule_class(name: str):
    return getattr(schedules, TORCH_SCHEDULES[name])


class TorchPipelineStep:
    """One training iteration (and evaluation) through a torch.distributed.pipelining schedule; the
    step interface of hybrid.training.steps."""

    def __init__(self, engine, model: PipelineRankModel, groups, schedule: str, micro_batches: int, device,
                 micro_batch: int, seq_length: int, per_token: bool = False, dpo=None):
        self.engine, self.model, self.groups, self.device = engine, model, groups, device
        self.schedule_name = schedule
        self.micro_batches = micro_batches
        self.plans = plan_stages(model.config.num_layers, groups.pp.size, len(model.stages), schedule)
        self.stages = [PipelineStage(stage, stage.plan.index, len(self.plans), device, group=groups.pp.group,
                                     input_args=self._input_meta(stage, micro_batch, seq_length),
                                     output_args=self._output_meta(stage, micro_batch, seq_length))
                       for stage in model.stages]
        self.has_first = any(s.first for s in model.stages)
        self.has_last = any(s.last for s in model.stages)
        lm_loss = LMLoss(groups, model.config.vocab_size)
        self.per_token = PerTokenScale(groups, device) if per_token else None
        self.token_scale = None  # --calculate-per-token-loss: this iteration's factor
        self.dpo = dpo  # --dpo: the targets carry the ids and the reference values (preference_target)
        if dpo is not None:
            self.per_token = PerPairScale(groups, device, dpo.separator)

        def loss_fn(logits, labels):
            # whole-sequence labels (this rank's part taken there); the mean over micro-batches is taken here
            # (scale_grads=False), as DeepSpeed divides each micro-batch's loss by the accumulation steps
            if dpo is not None:
                loss, stats = preference_loss(logits, labels, groups, model.config.vocab_size, dpo, self.token_scale)
                model.preference_stats.add(stats)
                return loss / micro_batches
            return lm_loss.of_whole_sequences(logits, labels, self.token_scale) / micro_batches

        self.loss_fn = loss_fn
        self.schedule = schedule_class(schedule)(self.stages, n_microbatches=micro_batches, loss_fn=loss_fn,
                                                 scale_grads=False)
        self.tie_group = self._tied_embedding_group()
        engine.set_gradient_accumulation_boundary(True)  # every engine.step() below is one optimizer step
        # the rank that computes the loss (last virtual stage), as a global rank in this PP group
        last_pp_rank = next(p.rank for p in self.plans if p.last)
        self.loss_src = dist.get_global_rank(groups.pp.group, last_pp_rank)

    # The shapes each stage receives and sends, given to PipelineStage up front. Without them
    # PyTorch infers them by running every stage's forward and backward once on the first step,
    # which draws from the dropout RNG: a resumed run would then differ from an uninterrupted one.
    def _activation_dtype(self):
        return next(self.model.parameters()).dtype

    def _hidden_meta(self, micro_batch: int, seq_length: int):
        return torch.empty(hidden_shape(self.model.config, self.groups, micro_batch, seq_length),
                           dtype=self._activation_dtype(), device="meta", requires_grad=True)

    def _input_meta(self, stage, micro_batch: int, seq_length: int):
        if stage.first:
            return torch.empty(micro_batch, seq_length, dtype=torch.long, device="meta")
        return self._hidden_meta(micro_batch, seq_length)

    def _output_meta(self, stage, micro_batch: int, seq_length: int):
        if not stage.last:
            return self._hidden_meta(micro_batch, seq_length)
        config, tp = self.model.config, self.groups.tp.size
        vocab = config.vocab_size if tp == 1 else config.padded_vocab_size(tp) // tp  # see parallel_logits
        return torch.empty(seq_length // self.groups.sequence_split, micro_batch, vocab,
                           dtype=self._activation_dtype(), device="meta",
                           requires_grad=True)

    def _tied_embedding_group(self):
        """Loop placement with tied embeddings: the group of the ranks holding the first and last stages
        (hybrid.parallel.groups' embedding axis), whose two table copies' gradients are summed."""
        if not self.model.config.tied_embeddings or self.schedule_name in V_SHAPED:
            return None
        if self.model.tied_weight() is None or self.groups.embedding.size == 1:
            return None
        return self.groups.embedding.group

    def _batch(self, batches):
        parts = [next(batches) for _ in range(self.micro_batches)]
        self.token_scale = self.per_token(parts) if self.per_token else None
        ids = torch.cat([ids for ids, *_ in parts])
        if self.dpo is not None:
            return ids, torch.cat([preference_target(ids, labels, *extra) for ids, labels, *extra in parts])
        return ids, torch.cat([labels for _, labels, *_ in parts])

    def _run(self, method, ids, target, losses):
        args = (ids,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if self.model.config.splits_documents:  # every stage finds the packed documents from the ids
            kwargs["input_ids"] = ids
        return method(*args, **kwargs)

    def train(self, batches) -> torch.Tensor:
        """Forward and backward of every micro-batch, tied-table and DP gradient reduction, one optimizer
        step. Returns this iteration's mean loss on the loss rank (zero elsewhere; see reduce_losses)."""
        ids, target = self._batch(batches)
        losses: list = []
        self._run(self.schedule.step, ids, target, losses)
        if self.tie_group is not None:
            weight = self.model.tied_weight()
            dist.all_reduce(weight.grad, group=self.tie_group)
        engine = self.engine
        if engine.zero_optimization_stage() == 1:
            engine.optimizer.reduce_gradients(pipeline_parallel=True)  # as DeepSpeed's PipelineEngine
        else:
            engine.allreduce_gradients()
        engine.step()
        return self._sum(losses)

    def _sum(self, losses) -> torch.Tensor:
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float().reshape(()) for loss in losses]).sum()

    @torch.no_grad()
    def evaluate(self, batches) -> torch.Tensor:
        """Forward only, every micro-batch through the virtual stages in order (forward_only); returns the mean
        loss on the loss rank."""
        ids, target = self._batch(batches)
        targets = target.chunk(self.micro_batches)
        losses = forward_only(self.model, self.plans, self.groups, self.device, ids.chunk(self.micro_batches),
                              lambda mb, out: self.loss_fn(out, targets[mb]))
        return self._sum(losses)

    def reduce(self, stacked: torch.Tensor) -> torch.Tensor:
        """Per-iteration losses from the loss rank to its whole pipeline, then the DP mean."""
        if self.groups.pp.size > 1:
            dist.broadcast(stacked, src=self.loss_src, group=self.groups.pp.group)
        if self.groups.dp_cp.size > 1:
            dist.all_reduce(stacked, group=self.groups.dp_cp.group)
            stacked = stacked / self.groups.dp_cp.size
        return stacked


def hidden_shape(config, groups, micro_batch: int, seq_length: int) -> tuple:
    """The hidden states one stage sends the next: [s, b, h], s this rank's part under CP / Ulysses and SP."""
    seq = seq_length // groups.sequence_split
    seq = seq // groups.tp.size if config.sequence_parallel else seq
    return seq, micro_batch, config.hidden_size


@torch.no_grad()
def forward_only(model: PipelineRankModel, plans, groups, device, ids: tuple, on_output) -> list:
    """Every micro-batch of `ids` (a tuple of [b, s] chunks) through this rank's virtual stages in stage order;
    `on_output(mb, logits)` on the last stage's outputs, their values returned in order (empty on the other
    ranks). Written here because torch 2.13's `schedule.eval()` runs the backward actions of its V-shaped
    schedules ("can't steal_bwd_input if this stage doesn't have backward"); each rank runs its stages in
    stage order and sends asynchronously, so no rank waits on a later one."""
    group, sends, local, outputs = groups.pp.group, [], {}, []
    rank_of = {p.index: p.rank for p in plans}
    config = model.config
    for stage in sorted(model.stages, key=lambda st: st.plan.index):
        index = stage.plan.index
        for mb in range(len(ids)):
            if stage.first:
                hidden = ids[mb]
            elif rank_of[index - 1] == groups.pp.rank:
                hidden = local.pop((index, mb))
            else:
                hidden = torch.empty(hidden_shape(config, groups, ids[mb].size(0), ids[mb].size(1)),
                                     dtype=next(model.parameters()).dtype, device=device)
                dist.irecv(hidden, group=group, group_src=rank_of[index - 1]).wait()
            out = stage(hidden, input_ids=ids[mb] if config.splits_documents else None)
            if stage.last:
                outputs.append(on_output(mb, out))
            elif rank_of[index + 1] == groups.pp.rank:
                local[(index + 1, mb)] = out
            else:
                sends.append(dist.isend(out.contiguous(), group=group, group_dst=rank_of[index + 1]))
    for work in sends:
        work.wait()
    return outputs


# --dpo through the torch schedules: the schedule splits one target tensor into micro-batches, so the labels,
# the ids (the packed documents) and the reference sums (fp32, their bits) travel as its rows.

def preference_target(ids, labels, reference=None) -> torch.Tensor:
    """[b, 2 or 3, s] int64: labels, ids and (when given) the reference sums' fp32 bits."""
    rows = [labels, ids] + ([reference.float().contiguous().view(torch.int32).long()] if reference is not None else [])
    return torch.stack(rows, 1)


def preference_loss(logits, target, groups, vocab_size: int, options, scale):
    """The pair loss and its rewards statistics from a preference_target with reference sums; without them
    (2 rows) the policy's per-document (sums, counts) stacked [2, b, s], the values the reference scores."""
    labels, ids = target[:, 0], target[:, 1]
    sums = preference.document_logps(logits, labels, ids, groups, vocab_size, options.separator)
    if target.size(1) == 2:
        return torch.stack(sums), None
    reference = target[:, 2].int().view(torch.float32)
    return preference.dpo_loss(sums, (reference, None), options, scale)


def torch_pipeline_scorer(model: PipelineRankModel, groups, schedule: str, device, options):
    """Scores micro-batches with the virtual stages (forward only): each one's (sums, counts) [b, s] on the
    rank holding the last stage, None on the others (hybrid.training.reference_logps)."""
    plans = plan_stages(model.config.num_layers, groups.pp.size, len(model.stages), schedule)
    has_last = any(s.last for s in model.stages)

    def score(batches):
        was_training = model.training
        model.eval()
        ids = tuple(i for i, _ in batches)
        targets = [preference_target(i, labels) for i, labels in batches]
        outputs = forward_only(model, plans, groups, device, ids,
                               lambda mb, out: preference_loss(out, targets[mb], groups, model.config.vocab_size,
                                                               options, None)[0])
        model.train(was_training)
        return [tuple(values) for values in outputs] if has_last else None
    return score
