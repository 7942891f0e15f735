"""LayerNorm and RMSNorm whose replicated weights stay exact under sequence parallelism."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.parallel.groups import as_groups
from hybrid.parallel.mappings import sync_replicated_grad


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, groups, sequence_parallel: bool, bias: bool, dtype):
        super().__init__()
        self.eps, self.tp_group, self.sequence_parallel = eps, as_groups(groups).tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if bias else None

    def _params(self):
        """The weights as used in forward: with SP each rank sees a sequence shard, so the
        weight gradients are summed over TP inside autograd."""
        if not self.sequence_parallel:
            return self.weight, self.bias
        bias = None if self.bias is None else sync_replicated_grad(self.bias, self.tp_group)
        return sync_replicated_grad(self.weight, self.tp_group), bias


class LayerNorm(_Norm):
    """LayerNorm over the last (hidden) dimension, with weight and bias."""

    def __init__(self, hidden_size, eps=1e-5, groups=None, sequence_parallel=False, dtype=torch.float32):
        super().__init__(hidden_size, eps, groups, sequence_parallel, True, dtype)

    def forward(self, x):
        weight, bias = self._params()
        return F.layer_norm(x, (x.size(-1),), weight, bias, self.eps)


class RMSNorm(_Norm):
    """RMSNorm as transformers' Llama computes it: normalise in fp32, scale in the input dtype."""

    def __init__(self, hidden_size, eps=1e-5, groups=None, sequence_parallel=False, dtype=torch.float32):
        super().__init__(hidden_size, eps, groups, sequence_parallel, False, dtype)

    def forward(self, x):
        weight, _ = self._params()
        # torch's fused kernel on fp32, then the scale in the input dtype (transformers' numerics)
        normalized = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        return weight * normalized.to(x.dtype)


def build_norm(config, groups) -> nn.Module:
    """The norm that `--normalization` names."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config.hidden_size, config.norm_epsilon, groups, config.sequence_parallel)
