"""Cross-entropy over logits whose vocabulary dimension is split across TP ranks.

The full-vocabulary logits are never gathered: each rank works on its `[..., V/tp]` slice and
only per-token scalars cross ranks (one MAX all-reduce, one SUM all-reduce of the target logit
and the softmax denominator together), as in Megatron-LM.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from hybrid.parallel import collectives as C

IGNORE_INDEX = -100  # a label that takes no loss (masked positions), as torch's and transformers' losses


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over TP-split logits [..., V/tp] (Megatron-LM's vocab-parallel cross-entropy): the
    max and then (target logit, sum of exp) are all-reduced over the TP group. Like _CrossEntropy it
    works in the logits' own memory: shifted logits, their exp, the probabilities kept for backward and
    the gradient are all the same [tokens, V/tp] tensor (fp32 logits are consumed; bf16/fp16 ones are
    read once into fp32), so no [tokens, V/tp] temporary is allocated beyond it."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, vocab_size):
        rank = C.group_rank(group)
        part = logits.size(-1)
        vocab_start = rank * part
        ctx.logits_dtype = logits.dtype
        work = logits.float()
        if work is logits and logits.is_leaf:  # a caller's own tensor: never overwrite it
            work = logits.clone()
        if vocab_size is not None and vocab_start + part > vocab_size:
            # Padded vocabulary rows (Megatron's --make-vocab-size-divisible-by) take no part.
            padded = torch.arange(vocab_start, vocab_start + part, device=logits.device) >= vocab_size
            work.masked_fill_(padded, float("-inf"))
        logits_max = work.max(dim=-1).values
        C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = work.sub_(logits_max.unsqueeze(-1))

        ignored = target == ignore_index
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= part) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])  # one all-reduce for both
        C.all_reduce(sums, group)
        target_logit, sum_exp = sums[0], sums[1]

        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax  # used once: reused in place (as Megatron-LM's cross-entropy does)
        flat = grad.view(-1, grad.size(-1))
        rows = torch.arange(flat.size(0), device=grad.device)
        flat[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(grad.dtype)
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """Cross-entropy over whole-vocabulary logits (TP = 1) from two fused kernels.

    Forward: log_softmax gives the loss, softmax the probabilities kept for backward, both in the
    logits' own memory; backward turns those probabilities into the gradient in place,
    (p - onehot(target)) x grad. Neither pass runs an elementwise exp over the [tokens, vocab]
    logits, which `F.cross_entropy`'s backward does (on CPU that exp alone costs as much as both
    fused kernels together). The logits are consumed: callers must not read them afterwards
    (a leaf tensor passed in directly is copied first).
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        ctx.logits_dtype = logits.dtype
        work = logits.float()
        if work is logits and logits.is_leaf:  # a caller's own tensor: never overwrite it
            work = logits.clone()
        # The logits feed nothing else (the output projection's backward keeps its input and
        # weight, not its output), so they are overwritten in place: log-probabilities, then
        # probabilities (softmax of log-probabilities equals softmax of logits). No new
        # [tokens, vocab] tensor is allocated, which on CPU also saves its page faults.
        ignored = target == ignore_index
        safe_target = target.masked_fill(ignored, 0).unsqueeze(-1)
        log_probs = torch.ops.aten._log_softmax.out(work, -1, False, out=work)
        loss = -log_probs.gather(-1, safe_target).squeeze(-1)
        loss = loss.masked_fill(ignored, 0.0)
        probs = torch.ops.aten._softmax.out(log_probs, -1, False, out=log_probs)
        ctx.save_for_backward(probs, safe_target, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, safe_target, ignored = ctx.saved_tensors
        grad = probs  # used once: reused in place (as Megatron-LM's cross-entropy does)
        grad.scatter_add_(-1, safe_target, torch.full_like(safe_target, -1.0, dtype=grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 ignore_index: int = IGNORE_INDEX, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token loss (fp32, shape of `target`) from TP-split logits `[..., V/tp]`.

    Tokens whose label is `ignore_index` get loss 0 and gradient 0; vocabulary entries at or
    beyond `vocab_size` (padding) are excluded from the softmax. With the whole vocabulary on
    this rank and no padding columns, the fused single-rank kernel is used.
    """
    if C.group_size(group) == 1 and (vocab_size is None or logits.size(-1) == vocab_size):
        return _CrossEntropy.apply(logits, target, ignore_index)
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, vocab_size)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, group, vocab_size: Optional[int] = None, temperature: float = 1.0,
                           chunk: int = 1024) -> torch.Tensor:
    """Each position's entropy of softmax(logits / temperature) (fp32, logits' shape without the vocabulary) from
    TP-split logits `[..., V/tp]`, the padding columns at or beyond `vocab_size` left out (TRL's entropy_from_logits
    on the whole vocabulary). Positions go `chunk` at a time (a few fp32 copies of a chunk, never of the whole
    logits); the ranks exchange one MAX all-reduce of the positions' maxima and one SUM all-reduce of two sums each.
    `logits` is only read."""
    shape, part = logits.shape[:-1], logits.size(-1)
    rows = logits.reshape(-1, part)
    start = C.group_rank(group) * part
    padded = None
    if vocab_size is not None and start + part > vocab_size:
        padded = torch.arange(start, start + part, device=logits.device) >= vocab_size

    def scaled(k):  # a chunk of rows in fp32, divided by the temperature, padding at -inf
        work = rows[k:k + chunk].float()
        work = work / temperature if temperature != 1.0 else work.clone()
        return work.masked_fill_(padded, float("-inf")) if padded is not None else work

    top = torch.cat([scaled(k).amax(-1) for k in range(0, rows.size(0), chunk)])
    if C.group_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.empty(2, rows.size(0), dtype=torch.float32, device=logits.device)
    for k in range(0, rows.size(0), chunk):
        shifted = scaled(k).sub_(top[k:k + chunk, None])
        weights = shifted.exp()
        sums[0, k:k + chunk] = weights.sum(-1)
        sums[1, k:k + chunk] = (weights * shifted.masked_fill_(weights == 0, 0.0)).sum(-1)
    if C.group_size(group) > 1:
        dist.all_reduce(sums, group=group)
    return (sums[0].log() - sums[1] / sums[0]).reshape(shape)
