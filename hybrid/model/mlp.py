"""Feed-forward block: column-parallel up-projection, GeLU or SwiGLU, row-parallel down-projection."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.config import MLP_TYPES
from hybrid.model.init import normal_init, output_layer_std
from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear


def bias_gelu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """GeLU (tanh approximation, as Megatron's fused bias_gelu and GPT-2's gelu_new) of y + bias.

    Written as one elementwise expression so torch.compile / TorchInductor fuses it into a
    single kernel; without a compiler it is two elementwise ops.
    """
    x = y if bias is None else y + bias
    return F.gelu(x, approximate="tanh")


def swiglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up, with y = [gate | up] on the last dimension (this rank's halves)."""
    if bias is not None:
        y = y + bias
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh), with y = [gate | up] as for SwiGLU."""
    if bias is not None:
        y = y + bias
    gate, up = y.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    """h -> ffn (or 2 x ffn for SwiGLU/GeGLU, sharded with stride 2 so gate/up columns match) -> h."""

    def __init__(self, config, groups, name: str):
        super().__init__()
        self.activation = swiglu if config.swiglu else geglu if config.geglu else bias_gelu
        gated = config.gated_linear_unit
        up_size = config.ffn_hidden_size * (2 if gated else 1)
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, up_size, groups,
            normal_init(config.seed, f"{name}.fc1.weight", config.init_method_std),
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel, skip_bias_add=True,
            stride=2 if gated else 1, overlap=config.async_tensor_model_parallel_allreduce)
        self.fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, groups,
            normal_init(config.seed, f"{name}.fc2.weight", output_layer_std(config.init_method_std, config.num_layers)),
            bias=config.add_bias_linear, input_is_parallel=True, sequence_parallel=config.sequence_parallel)

    def forward(self, x):
        y, bias = self.fc1(x)  # [s(/tp), b, h] -> [s, b, up/tp]
        return self.fc2(self.activation(y, bias))  # -> [s(/tp), b, h]


# --- the layer's feed-forward block, chosen by the config -----------------------------------------

MLP_BUILDERS = {"dense": MLP}  # ModelConfig.mlp_type -> the block's class (a mixture of experts plugs in here)
assert set(MLP_BUILDERS) == set(MLP_TYPES), "hybrid.model.config.MLP_TYPES names the builders here"


def build_mlp(config, groups, name: str) -> nn.Module:
    """The feed-forward block of the layer named `name` (`layers.{i}.mlp`), as the config chooses."""
    return MLP_BUILDERS[config.mlp_type](config, groups, name)
