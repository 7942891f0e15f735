"""LayerNorm and RMSNorm whose replicated weights stay exact under sequence parallelism, and the RMSNorm over every
head of Q or K whose heads are split over TP (HeadsRMSNorm)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import make_parallel_param
from hybrid.parallel.mappings import all_reduce_both_ways, sync_replicated_grad


class _Norm(nn.Module):
    """`sequence_parallel`: each TP rank normalises part of the tensor (a sequence shard under SP, its own
    heads for a Q/K norm), so the weight gradients are partial per rank and are summed over TP.
    `one_plus`: the scale is (1 + weight), the weight starting at 0 (Megatron's --apply-layernorm-1p,
    Gemma's RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, groups, sequence_parallel: bool, bias: bool, dtype,
                 one_plus: bool = False):
        super().__init__()
        self.eps, self.tp_group, self.sequence_parallel = eps, as_groups(groups).tp_group, sequence_parallel
        self.one_plus = one_plus
        self.weight = nn.Parameter((torch.zeros if one_plus else torch.ones)(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if bias else None

    def _params(self):
        """The weights as used in forward, their gradients summed over TP where each rank saw a part."""
        if not self.sequence_parallel:
            return self.weight, self.bias
        bias = None if self.bias is None else sync_replicated_grad(self.bias, self.tp_group)
        return sync_replicated_grad(self.weight, self.tp_group), bias


class LayerNorm(_Norm):
    """LayerNorm over the last (hidden) dimension, with weight and bias (Megatron's LayerNorm1P with one_plus)."""

    def __init__(self, hidden_size, eps=1e-5, groups=None, sequence_parallel=False, dtype=torch.float32,
                 one_plus=False):
        super().__init__(hidden_size, eps, groups, sequence_parallel, True, dtype, one_plus)

    def forward(self, x):
        weight, bias = self._params()
        return F.layer_norm(x, (x.size(-1),), weight + 1 if self.one_plus else weight, bias, self.eps)


class RMSNorm(_Norm):
    """RMSNorm as transformers computes it: normalise in fp32; Llama then scales in the input dtype,
    Gemma (one_plus) scales by (1 + weight) in fp32 and casts after, Gemma 4 (`fp32_scale`) by the weight in fp32."""

    def __init__(self, hidden_size, eps=1e-5, groups=None, sequence_parallel=False, dtype=torch.float32,
                 one_plus=False, fp32_scale=False):
        super().__init__(hidden_size, eps, groups, sequence_parallel, False, dtype, one_plus)
        self.fp32_scale = fp32_scale

    def forward(self, x):
        weight, _ = self._params()
        normalized = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)  # torch's fused kernel on fp32
        if self.one_plus:
            return (normalized * (1.0 + weight.float())).to(x.dtype)
        if self.fp32_scale:
            return (normalized * weight.float()).to(x.dtype)
        return weight * normalized.to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / RMS(x) over the last dimension, in fp32, without a weight (--v-norm, Gemma 4's router; transformers'
    Gemma4RMSNorm with with_scale=False)."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


def build_norm(config, groups, size=None, partial_grads=None, eps=None) -> nn.Module:
    """The norm that `--normalization` names, over `size` features (default: the hidden size).
    `partial_grads`: each TP rank sees part of the input (default: under sequence parallelism); `eps`: another
    epsilon than --norm-epsilon (MLA's latent norms)."""
    partial = config.sequence_parallel if partial_grads is None else partial_grads
    eps = config.norm_epsilon if eps is None else eps
    if config.normalization == "RMSNorm":
        return RMSNorm(size or config.hidden_size, eps, groups, partial, one_plus=config.apply_layernorm_1p,
                       fp32_scale=config.rmsnorm_fp32_scale)
    return LayerNorm(size or config.hidden_size, eps, groups, partial, one_plus=config.apply_layernorm_1p)


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all heads' features of Q or K together (--qk-norm-across-heads: MiniMax-M2's q_norm / k_norm of
    width heads x head_dim, as transformers computes it: the mean square in fp32 over every head, the weight applied
    in the input dtype). Heads are split over TP with their weights; each rank's sum of squares over its heads is
    summed over TP (all_reduce_both_ways: every rank's gradient reaches every rank's heads)."""

    def __init__(self, heads: int, head_dim: int, eps: float, groups):
        super().__init__()
        groups = as_groups(groups)
        self.eps, self.tp_group, self.width = eps, groups.tp_group, heads * head_dim
        self.weight = make_parallel_param((heads * head_dim,), 0, 1, groups, nn.init.ones_, torch.float32, None)

    def forward(self, x):
        """x [s, b, heads/tp, d] -> the same shape."""
        x32 = x.float()
        square_sum = all_reduce_both_ways(x32.pow(2).sum(dim=(-2, -1), keepdim=True), self.tp_group)
        normalized = (x32 * torch.rsqrt(square_sum / self.width + self.eps)).to(x.dtype)
        return self.weight.view(x.shape[-2:]) * normalized
