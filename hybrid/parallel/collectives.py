"""Small device-agnostic collectives over an explicit process group.

Each one is a no-op (or a plain view) when the group has one rank, so TP = 1 costs nothing.
The device is whatever the tensor lives on: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SingleRank:
    """A group of this rank alone that needs no torch.distributed call: a model built with it is the
    one-rank (TP = 1) model even inside a distributed job (None would mean the whole world)."""

    def __repr__(self) -> str:
        return "SINGLE_RANK"


SINGLE_RANK = _SingleRank()


class _ShapesOnly:
    """A group stand-in for models built only to read shapes and names (ParallelGroups.shapes_only):
    any collective over it raises."""

    def __repr__(self) -> str:
        return "SHAPES_ONLY"


SHAPES_ONLY = _ShapesOnly()


def _refuse_shapes_only(group) -> None:
    if group is SHAPES_ONLY:
        raise RuntimeError("this model was built with ParallelGroups.shapes_only() (for shapes and names): it "
                           "cannot communicate; build it with a topology's groups to run it")


def group_size(group) -> int:
    """Number of ranks in `group` (1 for SINGLE_RANK or when distributed is not initialised)."""
    _refuse_shapes_only(group)
    if group is SINGLE_RANK or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group) -> int:
    """This rank's index inside `group` (0 for SINGLE_RANK or when distributed is not initialised)."""
    _refuse_shapes_only(group)
    if group is SINGLE_RANK or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # torch >= 2.10 renamed all_gather_into_tensor; look it up at call time so tests can count it.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, tensor, group=group)


def _reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, tensor, group=group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce (sum by default) `tensor` over `group`, in place; returns it."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_async(tensor: torch.Tensor, group):
    """Start summing `tensor` over `group` in place; returns a wait function (no-op at size 1)."""
    if group_size(group) == 1:
        return lambda: tensor
    work = dist.all_reduce(tensor, group=group, async_op=True)

    def wait():
        work.wait()
        return tensor
    return wait


def reduce_scatter_dim0_async(tensor: torch.Tensor, group):
    """Start summing a contiguous `tensor` over `group`, keeping this rank's chunk of dim 0; returns a
    wait function that gives the chunk."""
    world = group_size(group)
    if world == 1:
        return lambda: tensor
    if tensor.size(0) % world != 0:
        raise ValueError(f"dimension 0 of size {tensor.size(0)} does not divide over {world} ranks")
    output = torch.empty((tensor.size(0) // world,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                         device=tensor.device)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = fn(output, tensor, group=group, async_op=True)

    def wait():
        work.wait()
        return output
    return wait


def split_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of `tensor` along `dim` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    if tensor.size(dim) % world != 0:
        raise ValueError(f"dimension {dim} of size {tensor.size(dim)} does not divide over {world} ranks")
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


def all_gather_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in rank order."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    output = torch.empty((world * tensor.size(0),) + tuple(tensor.shape[1:]),
                         dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(output, tensor, group)
    return output.movedim(0, dim).contiguous()


def reduce_scatter_along_dim(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `tensor` over `group` and keep this rank's chunk along `dim`."""
    world = group_size(group)
    if world == 1:
        return tensor
    tensor = tensor.movedim(dim, 0).contiguous()
    if tensor.size(0) % world != 0:
        raise ValueError(f"dimension {dim} of size {tensor.size(0)} does not divide over {world} ranks")
    output = torch.empty((tensor.size(0) // world,) + tuple(tensor.shape[1:]),
                         dtype=tensor.dtype, device=tensor.device)
    _reduce_scatter_single(output, tensor, group)
    return output.movedim(0, dim).contiguous()


def all_to_all_variable(tensor: torch.Tensor, send_splits: list, recv_splits: list, group) -> torch.Tensor:
    """Rows of `tensor` (dim 0) sent to each rank of `group` in rank order, `send_splits[r]` rows to rank r;
    returns the rows received, `recv_splits[r]` from rank r, in rank order (the expert dispatch)."""
    if group_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    output = tensor.new_empty((sum(recv_splits),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(output, tensor, output_split_sizes=list(recv_splits),
                           input_split_sizes=list(send_splits), group=group)
    return output
