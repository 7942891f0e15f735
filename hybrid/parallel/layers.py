"""Megatron-style tensor-parallel layers: vocab-parallel embedding, column- and row-parallel linear.

Weights are created full-size on the CPU by an `init_method`, then sharded, so the same seed
gives the same full weights at any TP degree (Megatron-LM's `--use-cpu-initialization`).
Sharded parameters carry `tensor_model_parallel=True` (read by DeepSpeed's gradient-norm code),
`partition_dim` and `partition_stride`: the one record of each parameter's TP split, which
hybrid.checkpoint.tp_layout reads for checkpoints, conversion and DeepSpeed's universal patterns.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel import collectives as C
from hybrid.parallel import mappings as M
from hybrid.parallel.fp8 import fp8_linear
from hybrid.parallel.groups import ParallelGroups, as_groups

InitMethod = Callable[[torch.Tensor], None]  # fills a full (unsharded) tensor in place


def default_init(std: float = 0.02, seed: int = 0) -> InitMethod:
    """Normal(0, std) from a private generator seeded by `seed`."""

    def init(tensor: torch.Tensor) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            tensor.normal_(0.0, std, generator=generator)

    return init


def shard(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of `full` along `dim`.

    With `stride` > 1 the dimension holds `stride` stacked blocks (e.g. SwiGLU's [gate; up]) and
    each rank takes its chunk of every block, so every rank holds matching gate/up columns.
    """
    if world == 1:
        return full
    if full.size(dim) % (world * stride) != 0:
        raise ValueError(f"cannot shard dimension {dim} of size {full.size(dim)} into "
                         f"{world} ranks x {stride} blocks")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's shard, in rank order."""
    if len(shards) == 1:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[b] for p in pieces], dim=dim) for b in range(stride)], dim=dim)


def make_parallel_param(full_shape, dim, stride, groups: ParallelGroups, init_method, dtype, device) -> nn.Parameter:
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    local = shard(full, dim, groups.tp_rank, groups.tp_size, stride)
    param = nn.Parameter(local.to(dtype=dtype, device=device))
    mark_tensor_parallel(param, dim, stride)
    return param


def mark_tensor_parallel(param: torch.Tensor, dim: int, stride: int = 1) -> None:
    """Tag a TP-sharded parameter with the attributes DeepSpeed and our conversion read."""
    param.tensor_model_parallel = True
    param.model_parallel = True
    param.partition_dim = dim
    param.partition_stride = stride


def local_rows_lookup(ids: torch.Tensor, table: torch.Tensor, vocab_start: int, whole: bool) -> torch.Tensor:
    """The embeddings of `ids` from the vocabulary rows `table` (the rows from `vocab_start`; `whole`: every row):
    zeros for the ids other ranks or blocks hold (their sum is the whole lookup)."""
    if whole:
        return F.embedding(ids, table)
    local_ids = ids - vocab_start
    outside = (local_ids < 0) | (local_ids >= table.size(0))
    return F.embedding(local_ids.masked_fill(outside, 0), table).masked_fill(outside.unsqueeze(-1), 0.0)


def row_blocks(rows: int, block_rows: int) -> list[tuple[int, int]]:
    """[start, stop) of each block of a table of `rows` rows cut every `block_rows` rows (0: one block)."""
    step = block_rows if 0 < block_rows < rows else rows
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


class TableBlock(nn.Module):
    """Rows of a vocabulary table as a parameter of their own (`blocks.{i}.weight`, hybrid.model.naming.vocab_block),
    so ZeRO-3 gathers, and reduces the gradient of, one block at a time: its own module, whose hooks gather its
    weight when it runs. `local_rows`: [start, stop) of the rows it holds within this TP rank's rows of the table;
    `first_id`: the vocabulary id of its first row. As an embedding (`lookup`) it gives the rows of the ids it
    holds and zeros for the others; as an output head (not `lookup`) its rows' logits."""

    def __init__(self, rows: torch.Tensor, local_rows: tuple[int, int], first_id: int, dtype, device):
        super().__init__()
        self.local_rows, self.first_id = local_rows, first_id
        self.weight = nn.Parameter(rows.to(dtype=dtype, device=device))
        mark_tensor_parallel(self.weight, 0)

    def forward(self, x: torch.Tensor, lookup: bool) -> torch.Tensor:
        if lookup:
            return local_rows_lookup(x, self.weight, self.first_id, whole=False)
        return F.linear(x, self.weight)


def make_table_blocks(full_shape, block_rows: int, groups: ParallelGroups, init_method, dtype, device):
    """This TP rank's rows of a vocabulary table (initialised whole, as make_parallel_param does) as TableBlocks of
    `block_rows` rows."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_method(full)
    local = shard(full, 0, groups.tp_rank, groups.tp_size)
    vocab_start = groups.tp_rank * local.size(0)
    return nn.ModuleList(TableBlock(local[a:b].clone(), (a, b), vocab_start + a, dtype, device)
                         for a, b in row_blocks(local.size(0), block_rows))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over TP ranks.

    Each rank looks up the ids in its range (others give zeros) and the partial results are
    summed: all-reduce, or with `reduce_scatter_embeddings` a reduce-scatter along dim 0 (the
    sequence, for sequence parallelism; ids must then be `[s, b]`). With `block_rows` (ZeRO-3) this
    rank's rows are TableBlocks, each looked up on its own and summed: the same values, as each id is in
    one block and the others add exact zeros.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, groups: ParallelGroups, init_method: InitMethod,
                 reduce_scatter_embeddings: bool = False, params_dtype=torch.float32, device=None,
                 block_rows: int = 0):
        super().__init__()
        self.groups = groups = as_groups(groups)
        self.tp_group = groups.tp_group
        world = groups.tp_size
        if num_embeddings % world != 0:
            raise ValueError(f"vocabulary size {num_embeddings} does not divide over {world} TP ranks")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = num_embeddings // world
        self.vocab_start = groups.tp_rank * self.rows_per_rank
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        if len(row_blocks(self.rows_per_rank, block_rows)) > 1:
            self.blocks = make_table_blocks((num_embeddings, embedding_dim), block_rows, groups, init_method,
                                            params_dtype, device)
            self.register_parameter("weight", None)
            return
        self.blocks = None
        self.weight = make_parallel_param((num_embeddings, embedding_dim), 0, 1, groups,
                                           init_method, params_dtype, device)
        self.weight.vocab_padded = True  # rows are the vocabulary (padded per TP degree by the model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            out = self.blocks[0](ids, lookup=True)
            for block in self.blocks[1:]:
                out = out + block(ids, lookup=True)
        else:
            out = local_rows_lookup(ids, self.weight, self.vocab_start, self.groups.tp_size == 1)
        if self.reduce_scatter_embeddings:
            return M.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return M.reduce_from_tp_region(out, self.tp_group)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) over TP: each rank computes Y_i.

    Input: full activations (`[s, b, h]`), or with `sequence_parallel` a sequence shard that is
    all-gathered first (reduce-scattered back in backward). Output: this rank's slice of the
    features, or the full output with `gather_output`.
    """

    def __init__(self, input_size: int, output_size: int, groups: ParallelGroups, init_method: InitMethod,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, stride: int = 1, params_dtype=torch.float32, device=None,
                 overlap: bool = True, fp8: Optional[nn.Module] = None):
        super().__init__()
        self.overlap = overlap  # the backward's input-gradient collective beside the weight-gradient matmul
        self.fp8 = fp8  # an Fp8Gemm (hybrid.parallel.fp8): the GEMMs in FP8; None: in the weights' dtype
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output is incompatible with sequence_parallel")
        self.groups = groups = as_groups(groups)
        self.tp_group, self.gather_output = groups.tp_group, gather_output
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.input_size, self.output_size = input_size, output_size
        # [out, in] -> [out/tp, in]
        self.weight = make_parallel_param((output_size, input_size), 0, stride, groups,
                                           init_method, params_dtype, device)
        if bias:
            self.bias = make_parallel_param((output_size,), 0, stride, groups,
                                             nn.init.zeros_, params_dtype, device)
        else:
            self.register_parameter("bias", None)
        self.lora = None  # low-rank adapters beside the weight (hybrid.parallel.lora), attached by hybrid.model.lora

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        # [s(/tp), b, h] -> [s, b, out/tp]
        if self.lora is not None and self.lora.enabled():  # the adapters read the same gathered input
            x = (M.gather_from_sequence_parallel_region(x, self.tp_group) if self.sequence_parallel
                 else M.copy_to_tp_region(x, self.tp_group))
            y = F.linear(x, self.weight, bias) + self.lora(x)
        elif self.fp8 is not None:  # the input gathered (SP) or entered into the TP region, then FP8 GEMMs
            x = (M.gather_from_sequence_parallel_region(x, self.tp_group) if self.sequence_parallel
                 else M.copy_to_tp_region(x, self.tp_group))
            y = fp8_linear(x, self.weight, bias, self.fp8)
        else:
            y = column_parallel_matmul(x, self.weight, bias, self.groups, self.sequence_parallel, self.overlap)
        if self.gather_output:
            y = M.gather_from_tp_region(y, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y


class _ColumnParallelMatmul(torch.autograd.Function):
    """y = x W^T (+ b) with x replicated over TP (under SP: this rank's sequence shard, all-gathered
    here). Backward starts the input gradient's all-reduce (SP: reduce-scatter) and computes the weight
    and bias gradients while it runs (Megatron's async TP all-reduce; DeepSpeed's AutoTP does the
    same), then waits: the same values as the synchronous mappings, one collective's time hidden."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel: bool):
        full = C.all_gather_along_dim(x, 0, group) if sequence_parallel else x  # [s, b, in]
        # a frozen weight (LoRA's base) takes no gradient: its input is not kept, its GEMM not run
        ctx.save_for_backward(full if weight.requires_grad else None, weight)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        full, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_input = grad.matmul(weight)  # [s, b, out/tp] x [out/tp, in] -> [s, b, in], a partial sum
        wait = (C.reduce_scatter_dim0_async(grad_input, ctx.group) if ctx.sequence_parallel
                else C.all_reduce_async(grad_input, ctx.group))
        grad_2d = grad.reshape(-1, grad.size(-1))
        grad_weight = None if full is None else grad_2d.t().matmul(full.reshape(-1, full.size(-1)))  # while the
        # collective runs
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return wait(), grad_weight, grad_bias, None, None


def column_parallel_matmul(x, weight, bias, groups, sequence_parallel: bool, overlap: bool = True):
    """x [s(/tp), b, in] -> [s, b, out/tp] through a column-parallel weight: the input all-gathered
    (SP) or copied into the TP region; with `overlap` (Megatron's async TP all-reduce, the default)
    the backward collective runs beside the weight-gradient matmul."""
    if overlap and groups.tp_size > 1:
        return _ColumnParallelMatmul.apply(x, weight, bias, groups.tp_group, sequence_parallel)
    if sequence_parallel:
        x = M.gather_from_sequence_parallel_region(x, groups.tp_group)  # [s/tp, b, h] -> [s, b, h]
    else:
        x = M.copy_to_tp_region(x, groups.tp_group)
    return F.linear(x, weight, bias)


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features) over TP: partial products are summed.

    Input: this rank's slice of the features (`input_is_parallel`) or the full input, which is
    then split. Output: all-reduced, or with `sequence_parallel` reduce-scattered along the
    sequence. The bias is replicated and added after the reduction; under sequence parallelism
    its gradient is summed over TP.
    """

    def __init__(self, input_size: int, output_size: int, groups: ParallelGroups, init_method: InitMethod,
                 bias: bool = True, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 skip_bias_add: bool = False, params_dtype=torch.float32, device=None, fp8: Optional[nn.Module] = None):
        super().__init__()
        self.fp8 = fp8  # an Fp8Gemm (hybrid.parallel.fp8): the GEMM in FP8; None: in the weights' dtype
        self.groups = groups = as_groups(groups)
        self.tp_group, self.input_is_parallel = groups.tp_group, input_is_parallel
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.input_size, self.output_size = input_size, output_size
        # [out, in] -> [out, in/tp]
        self.weight = make_parallel_param((output_size, input_size), 1, 1, groups,
                                           init_method, params_dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.lora = None  # low-rank adapters beside the weight (hybrid.parallel.lora), attached by hybrid.model.lora

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = M.scatter_to_tp_region(x, self.tp_group)
        # [s, b, in/tp] -> [s, b, out] (partial sum)
        partial = F.linear(x, self.weight) if self.fp8 is None else fp8_linear(x, self.weight, None, self.fp8)
        if self.lora is not None and self.lora.enabled():  # this rank's partial sum of the adapters' output
            partial = partial + self.lora(x)
        if self.sequence_parallel:
            y = M.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # -> [s/tp, b, out]
        else:
            y = M.reduce_from_tp_region(partial, self.tp_group)
        bias = self.bias
        if bias is not None and self.sequence_parallel:
            bias = M.sync_replicated_grad(bias, self.tp_group)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias
