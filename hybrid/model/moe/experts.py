"""The experts an MoE layer holds on this rank (its EP rank's share, whole on every TP rank) and their
GEMMs: one grouped GEMM per projection (`torch._grouped_mm`, forward and both backward products) where
the kernel runs, else a per-expert loop (Megatron's SequentialMLP)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init, output_layer_std
from hybrid.parallel.fp8 import fp8_linear, gemm_for
from hybrid.parallel.groups import ParallelGroups
from hybrid.parallel.mappings import sync_replicated_grad


class _Weight(nn.Module):
    """A projection's weight, [out, in], drawn by its canonical name, and with `bias` its bias (zeros)."""

    def __init__(self, out_features: int, in_features: int, init, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        init(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None


class ExpertMLP(nn.Module):
    """One expert: fc1 [up, h] (up = 2 f for SwiGLU/GeGLU, [gate; up]), fc2 [h, f]; biases with
    --add-bias-linear (GPT-OSS's experts; megatron-core's grouped experts take them the same way)."""

    def __init__(self, config, name: str):
        super().__init__()
        f, h = config.moe_ffn_hidden_size, config.hidden_size
        up = 2 * f if config.gated_linear_unit else f
        bias = config.add_bias_linear
        self.fc1 = _Weight(up, h, normal_init(config.seed, f"{name}.fc1.weight", config.init_method_std), bias)
        self.fc2 = _Weight(h, f, normal_init(config.seed, f"{name}.fc2.weight",
                                             output_layer_std(config.init_method_std, config.num_layers)), bias)


class Experts(nn.Module):
    """DeepSpeed's `Experts` layout (`experts.deepspeed_experts.{local}`), its parameters marked as
    DeepSpeed marks expert parameters."""

    def __init__(self, config, name: str, first: int, count: int, ep_size: int):
        super().__init__()
        self.grouped = config.moe_grouped_gemm  # --moe-grouped-gemm; False once a device lacked the kernel
        # FP8 (--fp8-format): per-token (rowwise) scales whatever the recipe, so an expert's GEMMs do not
        # depend on which ranks' tokens it gets (EP-invariant); run per expert
        self.fp8 = gemm_for(config, ParallelGroups.single(), name, "expert")
        self.deepspeed_experts = nn.ModuleList(ExpertMLP(config, f"{name}.experts.{first + j}") for j in range(count))
        for param in self.deepspeed_experts.parameters():
            param.allreduce = False  # reduced over the expert-data-parallel group, not DP
            param.group_name = f"ep_size_{ep_size}"

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, activation, tp_group, sizes=None) -> torch.Tensor:
        """rows [N, h] grouped by local expert (counts [local]) -> their experts' outputs [N, h]. Called as a
        method, not a module: under ZeRO-3 the MoE layer gathers these weights (external parameters).
        `activation`: on fc1's output; `tp_group`: the TP group under SP (experts are replicated over TP,
        their gradients summed over it), else SINGLE_RANK; `sizes`: the counts as a host list where the
        caller knows them without reading the device (padded to capacity), else None."""
        fc1 = [sync_replicated_grad(e.fc1.weight, tp_group) for e in self.deepspeed_experts]
        fc2 = [sync_replicated_grad(e.fc2.weight, tp_group) for e in self.deepspeed_experts]
        b1, b2 = ([sync_replicated_grad(getattr(e, fc).bias, tp_group) for e in self.deepspeed_experts]
                  if self.deepspeed_experts[0].fc1.bias is not None else [None] * len(fc1) for fc in ("fc1", "fc2"))
        up, f = fc1[0].size(0), fc2[0].size(1)
        if self.fp8 is not None:
            outputs = [fp8_linear(activation(fp8_linear(part, w1, c1, self.fp8), None), w2, c2, self.fp8)
                       for part, w1, w2, c1, c2 in zip(rows.split(sizes or counts.tolist()), fc1, fc2, b1, b2)]
            return torch.cat(outputs) if outputs else rows
        if self.grouped and rows.size(0) and grouped_gemm_fits(rows, rows.size(1), up, f):
            offsets = counts.cumsum(0).to(torch.int32)
            try:  # one grouped GEMM per projection, no host sync (torchtitan's and DeepSpeed AutoEP's path)
                hidden = _with_biases(GroupedLinear.apply(rows, offsets, *fc1), b1, counts)
                return _with_biases(GroupedLinear.apply(activation(hidden, None), offsets, *fc2), b2, counts)
            except RuntimeError:  # a device without the kernel: the loop below from now on
                self.grouped = False
        outputs = []
        for part, w1, w2, c1, c2 in zip(rows.split(sizes or counts.tolist()), fc1, fc2, b1, b2):  # SequentialMLP
            outputs.append(F.linear(activation(F.linear(part, w1, c1), None), w2, c2))
        return torch.cat(outputs) if outputs else rows


def _with_biases(out: torch.Tensor, biases: list, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's bias added to its rows of a grouped GEMM's output (the rows' experts repeated on the device,
    their total given: no host sync)."""
    if biases[0] is None:
        return out
    return out + torch.repeat_interleave(torch.stack(biases), counts, dim=0, output_size=out.size(0))


class ExpertsHolder(nn.Module):
    """`deepspeed_moe`: holds the local experts under DeepSpeed's names."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


def grouped_gemm_fits(x: torch.Tensor, *sizes: int) -> bool:
    """torch._grouped_mm runs here: rows of 16-byte multiples, a float dtype its kernels take."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all(s * x.element_size() % 16 == 0 for s in sizes)


class GroupedLinear(torch.autograd.Function):
    """rows [N, in] grouped by expert (`offsets`: cumulative rows per expert) times each expert's weight
    [out, in] -> [N, out], one torch._grouped_mm; backward: the input gradient and every expert's weight
    gradient as two more grouped GEMMs. The experts' weights are stacked only while a GEMM runs: autograd
    keeps the parameters themselves, not a stacked copy of every expert per micro-batch."""

    @staticmethod
    def forward(ctx, rows, offsets, *weights):
        ctx.save_for_backward(rows, offsets, *weights)
        return torch._grouped_mm(rows, torch.stack(weights).transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        rows, offsets, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        try:
            grad_rows = torch._grouped_mm(grad, torch.stack(weights), offs=offsets) if ctx.needs_input_grad[0] \
                else None
            grad_weights = torch._grouped_mm(grad.t(), rows, offs=offsets).unbind(0)  # grad_e^T rows_e
        except RuntimeError:  # a kernel without this layout: per expert (the offsets read on the host)
            ends = offsets.tolist()
            starts = [0] + ends[:-1]
            grad_rows = torch.cat([grad[a:b] @ w for a, b, w in zip(starts, ends, weights)]) \
                if ctx.needs_input_grad[0] else None
            grad_weights = [grad[a:b].t() @ rows[a:b] for a, b in zip(starts, ends)]
        return (grad_rows, None, *grad_weights)
