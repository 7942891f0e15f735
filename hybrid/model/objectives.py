"""What a run trains for, as one object each (megatron-core's contract: the forward step gives the output, the
loss function comes with the objective): language modelling (pretraining and --sft) and --dpo's preference
pairs, plus the forward-only scoring of those pairs' log-probabilities (--dpo-reference-logps).

An `Objective` says what it needs from a micro-batch (`target`: one tensor [b, ...] that rides with the
micro-batch to the last pipeline stage; a torch schedule splits it along dim 0 like the ids), how the last
stage turns the logits and that target into the micro-batch's loss (`loss`), what the iteration's loss is a
mean over when it is taken per token or per pair (`count`), and what it logs (`metrics`). The runtime
(hybrid.training.runtime) runs every schedule, PP = 1 included, without knowing which objective it runs;
evaluation and the reference scorer take the same objects.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.model import grpo, preference
from hybrid.model.loss import LMLoss, token_logps, whole_sequence
from hybrid.model.mtp import shifted
from hybrid.model.preference import DPOOptions, PreferenceStats
from hybrid.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_entropy
from hybrid.parallel.groups import as_groups


@torch.no_grad()
def reference_logps(reference, ids: torch.Tensor, labels: torch.Tensor, groups, vocab_size: int,
                    temperature: float = 1.0, separator: Optional[int] = None) -> torch.Tensor:
    """The frozen reference model's log-probabilities of `labels`, one forward without gradients (`reference`: the
    model beside the engine, or the engine's own with its adapters off under LoRA; called as `reference(ids,
    stage=0)`): per token [b, s_local] under softmax(logits / temperature) (GRPO's KL), or with `separator` summed
    per packed document [b, s] (DPO's pairs), for the objectives that score it as they train (DPO's and GRPO's);
    the --dpo-reference-logps table holds the same document sums, scored once before the first iteration by the
    pipeline's forward-only schedule (hybrid.training.reference_logps, through DocumentScores)."""
    logits = reference(ids, stage=0)
    if separator is None:
        return token_logps(logits, labels, groups, vocab_size, temperature)
    return preference.document_logps(logits, labels, ids, groups, vocab_size, separator)[0]


class Objective:
    """The interface (see the module docstring). `per_item`: the iteration's loss is a mean over the items
    `count` counts (tokens, pairs) of the whole global batch, not over micro-batches."""

    name = "objective"
    per_item = False

    def target(self, ids: torch.Tensor, labels: torch.Tensor, extra: tuple = ()) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, target: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def model_inputs(self, extra: tuple = ()) -> dict:
        """What the micro-batch gives the model's forward beside its ids (keyword arguments of RankModel.forward)."""
        return {}

    def count(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The items of one micro-batch the iteration's loss is a mean over (on its device)."""
        return (labels != IGNORE_INDEX).sum()

    def sequence_factor(self, sequence_split: int) -> int:
        """By how much each sequence rank's count is divided (the ranks holding parts of one sequence)."""
        return sequence_split

    def metrics(self, groups=None, device=None) -> dict:
        """What the log line adds for the micro-batches since the last call (every rank calls it)."""
        return {}

    def discard_pending(self) -> list:
        """The statistics gathered since the last log line, taken out (evaluation keeps them apart)."""
        return []

    def restore_pending(self, pending: list) -> None:
        pass


class LanguageModeling(Objective):
    """Next-token loss over the labels that are not IGNORE_INDEX: each micro-batch's mean over its valid
    tokens (Megatron-LM's default), or with `per_token` (--calculate-per-token-loss, and every --sft run)
    the token sum times the iteration's factor, so the iteration's loss is the mean over all its tokens."""

    name = "lm"

    def __init__(self, groups, vocab_size: int, per_token: bool = False, mtp_loss_scale: float = 0.0):
        self.lm_loss = LMLoss(groups, vocab_size)
        self.per_item = per_token
        self.mtp_loss_scale = mtp_loss_scale  # --mtp-loss-scaling-factor / --mtp-num-layers (hybrid.model.mtp)

    def target(self, ids, labels, extra=()):
        return labels

    def loss(self, logits, target, scale):
        local = logits.size(0) // self._local_length(target)
        if local == 1:
            return self.lm_loss.of_whole_sequences(logits, target, scale)
        # multi-token prediction (training): the decoder's logits, then depth k's against the labels k ahead
        # (the depths' copies first: the cross-entropy works in its logits' memory, the decoder's in the tensor's own)
        rows = logits.size(0) // local
        depths = [logits.narrow(0, 0, rows)] + [logits.narrow(0, k * rows, rows).clone() for k in range(1, local)]
        loss = self.lm_loss.of_whole_sequences(depths[0], target, scale)
        valid = (target != IGNORE_INDEX).sum()
        extra = 0.0
        for k, depth in enumerate(depths[1:], start=1):
            ahead = shifted(target, k, IGNORE_INDEX)
            if scale is None:  # the mean over depth k's tokens
                extra = extra + self.lm_loss.of_whole_sequences(depth, ahead)
            else:  # per token: its sum, weighted as megatron-core does (x the decoder's tokens / depth k's)
                count = (ahead != IGNORE_INDEX).sum().clamp(min=1)
                extra = extra + self.lm_loss.of_whole_sequences(depth, ahead, scale * valid / count)
        return WithExtraGradient.apply(loss, extra * self.mtp_loss_scale)

    def _local_length(self, target) -> int:
        return target.size(1) // self.lm_loss.groups.sequence_split


class WithExtraGradient(torch.autograd.Function):
    """forward: `loss` (what is logged); backward: the gradient of loss + extra (megatron-core's
    MTPLossAutoScaler: the multi-token prediction losses train the model without entering the logged LM loss)."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class WithStatistics(Objective):
    """An objective whose loss gathers statistics in `self.stats` (a PreferenceStats or grpo.PolicyStats: its
    `pending` list and `metrics(dp, pp, device)`), logged over every DP rank, kept apart during evaluation; its
    loss is taken over whole documents or rows, summed over the ranks holding parts of one (factor 1)."""

    stats = None

    def sequence_factor(self, sequence_split: int) -> int:
        # a token's loss is on one sequence rank, a pair's or a row's on all of them (their parts are summed first)
        return 1

    def metrics(self, groups=None, device=None) -> dict:
        dp = groups.dp if groups is not None else None
        pp = groups.pp if groups is not None else None
        return self.stats.metrics(dp, pp, device)

    def discard_pending(self) -> list:
        pending, self.stats.pending = self.stats.pending, []
        return pending

    def restore_pending(self, pending: list) -> None:
        self.stats.pending = pending


class PreferencePairs(WithStatistics):
    """--dpo: TRL's DPO loss on packed pairs (hybrid.model.preference). The target stacks, per row, the labels,
    the ids (the packed documents) and the reference model's per-document log-probability sums as fp32 bits
    ([b, 3, s] int64): they come with the batch (--dpo-reference-logps) or from `reference`, the frozen model
    beside the engine (PP = 1), scored here when the target is made. The rewards are logged."""

    name = "dpo"
    per_item = True

    def __init__(self, groups, vocab_size: int, options: DPOOptions, reference=None):
        self.groups, self.vocab_size, self.options = groups, vocab_size, options
        self.reference = reference  # the frozen starting model (a one-stage RankModel), or None
        self.stats = PreferenceStats()

    def target(self, ids, labels, extra=()):
        reference = extra[0] if extra else reference_logps(self.reference, ids, labels, self.groups, self.vocab_size,
                                                           separator=self.options.separator)
        return pair_target(ids, labels, reference)

    def loss(self, logits, target, scale):
        labels, ids, reference = target[:, 0], target[:, 1], float_planes(target, 2)[:, 0]
        sums = preference.document_logps(logits, labels, ids, self.groups, self.vocab_size, self.options.separator)
        loss, stats = preference.dpo_loss(sums, (reference, None), self.options, scale)
        self.stats.add(stats)
        return loss

    def count(self, ids, labels):
        return preference.pairs_in(ids, labels, self.options.separator)


class DocumentScores(Objective):
    """Forward only: each micro-batch's per-document (log-probability sums, token counts) over its loss tokens,
    stacked [2, b, s] fp32 (what --dpo-reference-logps stores for the reference model)."""

    name = "document-logps"

    def __init__(self, groups, vocab_size: int, separator: int):
        self.groups, self.vocab_size, self.separator = groups, vocab_size, separator

    def target(self, ids, labels, extra=()):
        return pack_target([labels, ids])

    def loss(self, logits, target, scale):
        sums = preference.document_logps(logits, target[:, 0], target[:, 1], self.groups, self.vocab_size,
                                         self.separator)
        return torch.stack(sums)


class GroupPolicy(WithStatistics):
    """--grpo: TRL's GRPO loss (hybrid.model.grpo) on rows of one completion each. `extra[0]` [b, 5, s] fp32 rides
    with the row, its planes named by hybrid.model.grpo.Value: its advantage, the sampler's log-probability of each
    label, the reference model's (or, at beta 0, zeros), and 1 where the row's values are fresh from the sampler (the
    mismatch is measured there). The iteration's loss is a mean over the global batch's rows (grpo), tokens (dapo) or
    rows x the completion limit (dr_grpo); bnpo's is each micro-batch's token mean, averaged (TRL's). The ratio's
    old log-probabilities are the trainer's when the batch was generated: on its first pass its own, detached (TRL's
    when steps align), on later passes (--grpo-iterations) those the rollout computed then."""

    name = "grpo"
    per_item = True

    def __init__(self, groups, vocab_size: int, options: grpo.GRPOOptions):
        self.groups, self.vocab_size, self.options = groups, vocab_size, options
        self.stats = grpo.PolicyStats()
        # bnpo: TRL's token mean per micro-batch, averaged over micro-batches and ranks (not over the global batch)
        self.per_item = options.loss_type != "bnpo"

    def target(self, ids, labels, extra=()):
        return pack_target([labels], extra[0])  # the row's values [b, 5, s] (grpo.Value) ride as fp32 bits

    def model_inputs(self, extra=()) -> dict:
        """`extra[1]`, where the rollout recorded the MoE layers' routing: [b, s, layers, k] for the model's
        forward (hybrid.model.sequence.SequenceLayout.routes)."""
        return {"routes": extra[1]} if len(extra) > 1 else {}

    def loss(self, logits, target, scale):
        labels, values = target[:, 0], float_planes(target, 1)
        advantage, old = values[:, grpo.Value.ADVANTAGE, 0], values[:, grpo.Value.OLD]
        reference, fresh = values[:, grpo.Value.REFERENCE], values[:, grpo.Value.FRESH, 0] > 0
        o = self.options
        mask = labels != IGNORE_INDEX
        groups = as_groups(self.groups)
        keep = None
        if o.top_entropy_quantile < 1.0:  # before token_logps: its cross-entropy overwrites fp32 logits in place
            # TRL's entropies of softmax(logits / temperature) over the whole vocabulary, of the whole rows; the
            # quantile over the data-parallel ranks
            entropies = vocab_parallel_entropy(logits, groups.tp_group, self.vocab_size, o.temperature).t()
            keep = grpo.high_entropy_mask(whole_sequence(entropies.detach(), groups), mask,
                                          1.0 - o.top_entropy_quantile, groups.dp)
        logps = token_logps(logits, labels, self.groups, self.vocab_size, o.temperature)
        # under a sequence split (CP, Ulysses) the rows' loss needs all their tokens (per-row sums, GSPO's sequence
        # ratio): every sequence rank computes the whole rows' loss (its items counted by each: the sequence factor
        # 1), its gradient through its own tokens x the split (DeepSpeed's mean over DP x CP); else unchanged
        logps = whole_sequence(logps, groups, grad_scale=groups.sequence_split)
        # the trainer's log-probabilities when the batch was generated: on its first pass its own (detached, ratio 1,
        # as TRL takes them), on later passes the rollout's (--grpo-iterations); `old` is the sampler's
        trainer = values[:, grpo.Value.TRAINER] if o.iterations > 1 else old
        trainer = torch.where(fresh[:, None], logps.detach(), trainer)
        loss, stats = grpo.policy_loss(logps, trainer, reference if o.beta else None, advantage, mask, o,
                                       scale if self.per_item else None, fresh, sampled=old, entropy_mask=keep)
        self.stats.add(stats)
        return loss

    def count(self, ids, labels):
        mask = labels != IGNORE_INDEX
        if self.options.loss_type in grpo.TOKEN_MEAN_LOSSES:
            return mask.sum()
        return torch.full((), labels.size(0), device=labels.device, dtype=torch.long)


def pack_target(planes: list, floats: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A micro-batch's fields as the one int64 tensor [b, k + f, s] torch's pipeline schedules split along dim 0 (their
    target is a single tensor): the integer planes [b, s] as they are, then the fp32 planes `floats` [b, f, s] as
    their bits (float_planes reads them back)."""
    ints = torch.stack(planes, 1)
    if floats is None:
        return ints
    return torch.cat([ints, floats.float().contiguous().view(torch.int32).long()], 1)


def float_planes(target: torch.Tensor, first: int) -> torch.Tensor:
    """The fp32 planes pack_target stored from plane `first` on, [b, f, s]."""
    return target[:, first:].int().view(torch.float32)


def pair_target(ids: torch.Tensor, labels: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """DPO's micro-batch: labels, ids and the reference's per-document sums [b, s] (fp32), packed."""
    return pack_target([labels, ids], reference[:, None])


def objective_for(run_training, model_config, groups, reference=None) -> Objective:
    """The run's objective from its training settings (hybrid.config.TrainingConfig)."""
    if getattr(run_training, "grpo", None) is not None:
        return GroupPolicy(groups, model_config.vocab_size, run_training.grpo)
    if run_training.dpo is not None:
        return PreferencePairs(groups, model_config.vocab_size, run_training.dpo, reference)
    return LanguageModeling(groups, model_config.vocab_size, run_training.per_token_loss,
                            mtp_loss_scale(model_config))


def mtp_loss_scale(config) -> float:
    """Each multi-token prediction depth's loss weight: --mtp-loss-scaling-factor / --mtp-num-layers."""
    return config.mtp_loss_scaling_factor / config.mtp_num_layers if config.mtp_num_layers else 0.0
