"""The language-model loss of one micro-batch, from TP-split logits, as every step takes it (every schedule of the
one runtime), and the one per-token log-probability the other objectives read (DPO's document sums, GRPO's
ratios), vocabulary-parallel and aware of the sequence split."""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.model.sequence import local_index, sequence_order
from hybrid.parallel import collectives as C
from hybrid.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from hybrid.parallel.groups import as_groups


class LMLoss:
    """Next-token loss of one micro-batch from TP-split logits [s, b, V/tp] and labels [b, s], in which
    positions that take no loss hold IGNORE_INDEX: the sum over valid tokens / their count (the mean
    over the micro-batch's valid tokens), or with `token_scale` (--calculate-per-token-loss) the sum
    times that factor (the training step computes it from the iteration's token count)."""

    def __init__(self, groups, vocab_size: int):
        self.groups, self.vocab_size = as_groups(groups), vocab_size
        self.__name__ = "LMLoss"

    def __call__(self, logits, labels, valid: Optional[torch.Tensor] = None,
                 token_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`labels`: this rank's tokens'. `valid`: with context parallelism (or Ulysses) the valid tokens of
        the whole sequences (this rank holds 1/CP of them, and DeepSpeed averages gradients over DP x CP,
        hence the factor CP)."""
        labels = labels.t()  # [b, s] -> [s, b], as the logits
        per_token = vocab_parallel_cross_entropy(logits, labels, self.groups.tp_group, vocab_size=self.vocab_size)
        if token_scale is not None:  # the token sum, scaled to the iteration's token count
            return per_token.sum() * token_scale
        if valid is None:
            valid = (labels != IGNORE_INDEX).sum()  # on the device: no host sync
        return per_token.sum() * self.groups.sequence_split / valid.clamp(min=1)

    def of_whole_sequences(self, logits, labels, token_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss from whole-sequence labels [b, s] (a pipeline's last stage gets them whole): with a
        sequence split this rank's part is taken, the valid tokens counted over the whole sequences."""
        if self.groups.sequence_split == 1:
            return self(logits, labels, token_scale=token_scale)
        valid = (labels != IGNORE_INDEX).sum()
        mine = labels.index_select(1, local_index(labels.size(1), self.groups, labels.device))
        return self(logits, mine, valid, token_scale)


def token_logps(logits: torch.Tensor, labels: torch.Tensor, groups, vocab_size: int,
                temperature: float = 1.0) -> torch.Tensor:
    """TP-split logits [s_local, b, V/tp] and labels [b, s] -> each label's log-probability under softmax(logits /
    temperature), [b, s_local] fp32, 0 where the label is IGNORE_INDEX. Labels of the whole sequences are cut to
    this rank's part under a sequence split (context parallelism, Ulysses); this rank's own labels are taken as
    they are."""
    groups = as_groups(groups)
    if groups.sequence_split > 1 and labels.size(1) != logits.size(0):
        labels = labels.index_select(1, local_index(labels.size(1), groups, labels.device))
    if temperature != 1.0:  # in fp32, as the sampler divides (a bf16 division would round once more)
        logits = logits.float() / temperature
    per_token = vocab_parallel_cross_entropy(logits, labels.t(), groups.tp_group, vocab_size=vocab_size)
    return torch.where(labels != IGNORE_INDEX, -per_token.t().float(), torch.zeros((), device=logits.device))


class _WholeSequence(torch.autograd.Function):
    """Every sequence rank's part [b, s_local] -> the whole rows [b, s]; backward: this rank's part of the gradient
    times `grad_scale`."""

    @staticmethod
    def forward(ctx, part, group, order, mine, grad_scale):
        ctx.mine, ctx.grad_scale = mine, grad_scale
        gathered = C.all_gather_along_dim(part.contiguous(), 1, group)  # [b, s] in the ranks' order
        return torch.empty_like(gathered).index_copy_(1, order, gathered)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(1, ctx.mine) * ctx.grad_scale, None, None, None, None


def whole_sequence(part: torch.Tensor, groups, grad_scale: float = 1.0) -> torch.Tensor:
    """Per-token values of this rank's part of the sequences [b, s_local] (token_logps' under a sequence split) ->
    the whole sequences' [b, s] on every rank of the sequence axis (CP's or Ulysses'); unchanged without a split.
    For losses whose rows need every token at once (GRPO's per-row sums, sequence ratios and group statistics):
    every sequence rank then computes the whole rows' loss, and the gradient flows back through its own tokens only,
    times `grad_scale` (the sequence split, so that DeepSpeed's mean over DP x CP gives the unsplit gradient)."""
    groups = as_groups(groups)
    if groups.sequence_split == 1:
        return part
    length = part.size(1) * groups.sequence_split
    order = sequence_order(length, groups, part.device)
    return _WholeSequence.apply(part, groups.sequence.group, order, local_index(length, groups, part.device),
                                float(grad_scale))
