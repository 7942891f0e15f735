"""Direct preference optimisation (--dpo): the loss of TRL's DPOTrainer on packed preference pairs.

A window holds pairs side by side, `[prompt + chosen] SEP [prompt + rejected] SEP ...` (hybrid.data.chat),
so with the packed-document split at SEP the chosen answer of pair k is document 2k of its row and the
rejected one document 2k + 1. Each document's log-probability is the sum of log p over its answer tokens
(the labels that are not ignored); with the sequence split over CP / Ulysses ranks each rank sums its part
and the parts are added up. With the frozen reference model's sums (its own forward of the same batch):

    h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))
    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps: --dpo-label-smoothing)
    ipo:     (h - 1 / (2 beta))^2, the log-probabilities averaged over each answer's tokens (as TRL)

The iteration's loss is the mean over its pairs (every DP rank's): each micro-batch's sum times
GAS x DP / pairs, as --calculate-per-token-loss does with tokens (hybrid.training.reduction.PerPairScale).
Logged: rewards beta (log pi - log ref) of the chosen and rejected answers, their margin and the accuracy
(chosen reward above the rejected one), means over the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid.model.sequence import documents_of, local_index
from hybrid.model.loss import token_logps
from hybrid.parallel.cross_entropy import IGNORE_INDEX

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DPOOptions:
    """The --dpo flags and the token pairs are split at."""

    beta: float = 0.1  # --dpo-beta
    label_smoothing: float = 0.0  # --dpo-label-smoothing (conservative DPO)
    loss_type: str = "sigmoid"  # --dpo-loss-type
    separator: int = 0  # the token after every sequence of a packed window
    reference_logps: Optional[str] = None  # --dpo-reference-logps: the reference's values computed once, in a file


class _SumOverSequenceRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) of per-document partial sums over the ranks holding parts of the sequences.
    Backward: the incoming gradient (the same on every such rank, as the loss is computed from the summed
    values on each) times their number, so that DeepSpeed's average of gradients over those ranks leaves
    each parameter the full gradient of its own tokens' contribution."""

    @staticmethod
    def forward(ctx, partial, group, size):
        ctx.size = size
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None, None


def document_logps(logits, labels, ids, groups, vocab_size: int, separator: int):
    """logits [s_local, b, V/tp] of this rank's part, whole labels and ids [b, s] -> (sums, counts), both
    [b, s] fp32: per row and document (by index), the summed log-probability of its tokens that take loss
    and their number; summed over the sequence's ranks."""
    documents = documents_of(ids, separator).long()
    if groups.sequence_split > 1:
        index = local_index(labels.size(1), groups, labels.device)
        labels, documents = labels.index_select(1, index), documents.index_select(1, index)
    logp = token_logps(logits, labels, groups, vocab_size)  # [b, s_l]
    valid = labels != IGNORE_INDEX
    shape = (ids.size(0), ids.size(1))
    sums = torch.zeros(shape, device=logits.device, dtype=torch.float32).scatter_add(1, documents, logp)
    counts = torch.zeros(shape, device=logits.device, dtype=torch.float32).scatter_add(1, documents, valid.float())
    if groups.sequence_split > 1:
        axis = groups.sequence
        sums = _SumOverSequenceRanks.apply(sums, axis.group, axis.size)
        dist.all_reduce(counts, group=axis.group)
    return sums, counts


def _pairs(values: torch.Tensor):
    """[b, s] per document -> (chosen, rejected) [b, ceil(s/2)]: documents 2k and 2k + 1."""
    if values.size(1) % 2:
        values = F.pad(values, (0, 1))
    return values[:, 0::2], values[:, 1::2]


def dpo_loss(policy, reference, options: DPOOptions, scale: Optional[torch.Tensor]):
    """(policy sums, counts), (reference sums, counts) -> (the micro-batch's loss: the sum over its pairs times
    `scale`, or their mean without it; statistics [4]: sums of chosen and rejected rewards, of correct
    orderings, and the number of pairs, detached)."""
    (sums, counts), (ref_sums, _) = policy, reference
    chosen_counts, rejected_counts = _pairs(counts)
    valid = (chosen_counts > 0) & (rejected_counts > 0)
    if options.loss_type == "ipo":  # TRL's IPO: log-probabilities averaged over each answer's tokens
        sums, ref_sums = sums / counts.clamp(min=1), ref_sums / counts.clamp(min=1)
    chosen, rejected = _pairs(sums)
    ref_chosen, ref_rejected = _pairs(ref_sums)
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    if options.loss_type == "ipo":
        losses = (h - 1 / (2 * options.beta)) ** 2
    else:
        eps = options.label_smoothing
        losses = -F.logsigmoid(options.beta * h) * (1 - eps) - F.logsigmoid(-options.beta * h) * eps
    losses = torch.where(valid, losses, torch.zeros((), device=losses.device))
    pairs = valid.sum()
    loss = losses.sum() * scale if scale is not None else losses.sum() / pairs.clamp(min=1)
    with torch.no_grad():
        chosen_rewards = options.beta * (chosen - ref_chosen).detach()
        rejected_rewards = options.beta * (rejected - ref_rejected).detach()
        stats = torch.stack([(chosen_rewards * valid).sum(), (rejected_rewards * valid).sum(),
                             ((chosen_rewards > rejected_rewards) & valid).sum().float(), pairs.float()])
    return loss, stats


def pairs_in(ids: torch.Tensor, labels: torch.Tensor, separator: int) -> torch.Tensor:
    """The number of preference pairs of a micro-batch (on its device): chosen documents with loss tokens."""
    documents = documents_of(ids, separator).long()
    counts = torch.zeros(ids.shape, device=ids.device).scatter_add(1, documents, (labels != IGNORE_INDEX).float())
    chosen, rejected = _pairs(counts)
    return ((chosen > 0) & (rejected > 0)).sum()


class PreferenceStats:
    """The rewards statistics of the micro-batches since the last log line (device tensors, no host sync
    until `metrics`, which the log interval calls)."""

    def __init__(self):
        self.pending = []

    def add(self, stats: torch.Tensor) -> None:
        self.pending.append(stats)

    def metrics(self, dp=None, pp=None, device=None) -> dict:
        """Means over the pairs of every DP rank (`dp`: the data-parallel Axis): rewards of the chosen and rejected
        answers, margin, accuracy. With a pipeline (`pp`, its Axis; `device`: where the sums are), the last
        stage's, given to every stage; every rank calls this at the same iteration."""
        staged = pp is not None and pp.size > 1
        if not self.pending and not staged:
            return {}
        total = torch.stack(self.pending).sum(0) if self.pending else torch.zeros(4, device=device)
        self.pending = []
        if staged:  # only the last stage computed the loss: a sum over the stages is its values
            dist.all_reduce(total, group=pp.group)
        if dp is not None and dp.size > 1:
            dist.all_reduce(total, group=dp.group)
        chosen, rejected, correct, pairs = total.tolist()
        pairs = max(pairs, 1.0)
        return {"rewards_chosen": chosen / pairs, "rewards_rejected": rejected / pairs,
                "rewards_margin": (chosen - rejected) / pairs, "rewards_accuracy": correct / pairs}
