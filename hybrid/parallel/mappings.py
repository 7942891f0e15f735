"""Autograd functions that move activations into and out of tensor/sequence-parallel regions.

Each forward collective is paired with its adjoint in backward (Megatron-LM's mappings).
Tensors inside the transformer are `[sequence, batch, hidden]`, so the sequence dimension is 0
and the hidden (TP-split) dimension is the last.
"""

from __future__ import annotations

import torch

from hybrid.parallel import collectives as C


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBothWays(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous().clone(), ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return C.split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, 0, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return C.all_gather_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return C.reduce_scatter_along_dim(grad, 0, ctx.group), None, None
        return C.split_along_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather_along_dim(grad, 0, ctx.group), None


class _AllToAllVariable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return C.all_to_all_variable(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return C.all_to_all_variable(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    """forward: all-to-all of rows, `send_splits[r]` rows to rank r; backward: the reverse all-to-all
    (each gradient row goes back to the rank its row came from). The expert-parallel dispatch and combine."""
    if C.group_size(group) == 1:
        return x
    return _AllToAllVariable.apply(x, list(send_splits), list(recv_splits), group)


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: identity; backward: all-reduce (the input of a column-parallel layer)."""
    if C.group_size(group) == 1:  # no autograd node and no gradient copy at TP = 1
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-reduce; backward: identity (the output of a row-parallel layer)."""
    if C.group_size(group) == 1:  # no copy of the activation at TP = 1
        return x
    return _ReduceFromRegion.apply(x, group)


def all_reduce_both_ways(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-reduce; backward: all-reduce. A sum of every rank's part that each rank then uses in its own
    way (the Q/K norms across heads: each rank's statistic over its heads, the norm over all)."""
    if C.group_size(group) == 1:
        return x
    return _AllReduceBothWays.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: keep this rank's chunk of the last dim; backward: all-gather along it."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: all-gather along the last dim; backward: keep this rank's chunk."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: keep this rank's chunk of the sequence (dim 0); backward: all-gather along it."""
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, grad_is_partial: bool = True) -> torch.Tensor:
    """forward: all-gather along the sequence; backward: reduce-scatter along it.

    `grad_is_partial=False` is for outputs whose gradient is already complete on every rank
    (e.g. before a replicated op): backward then only keeps this rank's chunk.
    """
    return _GatherFromSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """forward: reduce-scatter along the sequence; backward: all-gather along it."""
    return _ReduceScatterToSequence.apply(x, group)


def sync_replicated_grad(param: torch.Tensor, group) -> torch.Tensor:
    """Use a replicated parameter whose gradient is partial on each TP rank.

    forward: identity; backward: all-reduce of the parameter's gradient. With sequence
    parallelism, norm weights and row-parallel biases see only a sequence shard; summing their
    gradient inside autograd keeps it exact under every DeepSpeed engine (ZeRO-2/3 take the
    gradient from hooks during backward, so a post-backward pass would come too late).
    """
    if C.group_size(group) == 1:
        return param
    return _CopyToRegion.apply(param, group)
