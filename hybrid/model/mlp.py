"""Feed-forward block: column-parallel up-projection, GeLU or SwiGLU, row-parallel down-projection."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.config import MLP_TYPES
from hybrid.model.init import normal_init, output_layer_std
from hybrid.model.moe.moe_layer import MoELayer
from hybrid.parallel.fp8 import gemm_for
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear, RowParallelLinear


def bias_gelu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """GeLU (tanh approximation, as Megatron's fused bias_gelu and GPT-2's gelu_new) of y + bias.

    Written as one elementwise expression so torch.compile / TorchInductor fuses it into a
    single kernel; without a compiler it is two elementwise ops.
    """
    x = y if bias is None else y + bias
    return F.gelu(x, approximate="tanh")


class _GatedUnit(torch.autograd.Function):
    """act(gate) * up on y = [gate | up] (last dimension), keeping only y for backward, as Megatron's
    fused SwiGLU does: act(gate) is recomputed in backward, and both halves of the gradient are written
    into one tensor. Autograd on the plain expression would also keep act(gate) (a third of the block's
    activations) and concatenate the two halves' gradients. The same aten ops as autograd's, so the
    values are bitwise those of the plain expression."""

    @staticmethod
    def forward(ctx, y, kind: str):
        ctx.save_for_backward(y)
        ctx.kind = kind
        gate, up = y.chunk(2, dim=-1)
        return _GATE_ACTIVATIONS[kind](gate) * up

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        grad_y = torch.empty_like(y)
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)
        torch.mul(grad, _GATE_ACTIVATIONS[ctx.kind](gate), out=grad_up)
        if ctx.kind == "silu":
            torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        else:
            torch.ops.aten.gelu_backward.grad_input(grad * up, gate, approximate="tanh", grad_input=grad_gate)
        return grad_y, None


_GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _gated(y: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    if torch.compiler.is_compiling():  # TorchInductor fuses the plain expression itself
        gate, up = y.chunk(2, dim=-1)
        return _GATE_ACTIVATIONS[kind](gate) * up
    return _GatedUnit.apply(y, kind)


def swiglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """silu(gate) * up, with y = [gate | up] on the last dimension (this rank's halves)."""
    return _gated(y, bias, "silu")


def geglu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh), with y = [gate | up] as for SwiGLU."""
    return _gated(y, bias, "gelu_tanh")


QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu, GPT-OSS's swiglu alpha


def quick_geglu(y: torch.Tensor, bias: Optional[torch.Tensor], offset: float = 0.0, clamp=None) -> torch.Tensor:
    """gate x sigmoid(1.702 gate) x (up + offset) on y = [gate | up], with `clamp` gate <= c and |up| <= c first
    (megatron-core's quick_geglu with --glu-linear-offset and --activation-func-clamp-value; GPT-OSS's experts)."""
    if bias is not None:
        y = y + bias
    gate, up = y.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    return gate * torch.sigmoid(gate * QUICK_GELU_ALPHA) * (up + offset)


def activation_of(config):
    """The MLP's activation on fc1's output (and bias): SwiGLU, GeGLU, quick-GeGLU or tanh-GeLU."""
    if config.quick_geglu:
        offset, clamp = config.glu_linear_offset, config.activation_func_clamp_value
        return lambda y, bias: quick_geglu(y, bias, offset, clamp)
    return swiglu if config.swiglu else geglu if config.geglu else bias_gelu


class MLP(nn.Module):
    """h -> ffn (or 2 x ffn for SwiGLU/GeGLU, sharded with stride 2 so gate/up columns match) -> h.
    `ffn_hidden_size`: another width than the config's (an MoE layer's shared experts)."""

    def __init__(self, config, groups, name: str, ffn_hidden_size: Optional[int] = None):
        super().__init__()
        self.activation = activation_of(config)
        gated = config.gated_linear_unit
        ffn = ffn_hidden_size or config.ffn_hidden_size
        up_size = ffn * (2 if gated else 1)
        local = ffn // as_groups(groups).tp_size  # a rank's fc1 rows: [gate; up] halves when gated
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, up_size, groups,
            normal_init(config.seed, f"{name}.fc1.weight", config.init_method_std),
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
            stride=2 if gated else 1, overlap=config.async_tensor_model_parallel_allreduce,
            fp8=gemm_for(config, groups, name, "column", [(0, local), (1, local)] if gated else None))
        self.fc2 = RowParallelLinear(
            ffn, config.hidden_size, groups,
            normal_init(config.seed, f"{name}.fc2.weight", output_layer_std(config.init_method_std, config.num_layers)),
            bias=config.add_bias_linear, input_is_parallel=True, sequence_parallel=config.sequence_parallel,
            fp8=gemm_for(config, groups, name, "row"))

    def forward(self, x):
        # fc1's bias is added inside its GEMM (addmm: the bias as the GEMM's starting value), not by the
        # activation: one pass over [s, b, up/tp] fewer than Megatron's skip-bias-add without its fused kernel
        y = self.fc1(x)  # [s(/tp), b, h] -> [s, b, up/tp]
        return self.fc2(self.activation(y, None))  # -> [s(/tp), b, h]


# --- the layer's feed-forward block, chosen by the config -----------------------------------------

def build_moe(config, groups, name: str) -> nn.Module:
    """An MoE layer's feed-forward block (hybrid.model.moe.moe_layer), its shared experts a dense MLP."""
    return MoELayer(config, groups, name, MLP, activation_of(config))


MLP_BUILDERS = {"dense": MLP, "moe": build_moe}  # ModelConfig.mlp_type_of(layer) -> the block's builder
assert set(MLP_BUILDERS) == set(MLP_TYPES), "hybrid.model.config.MLP_TYPES names the builders here"


def build_mlp(config, groups, layer_number: int) -> nn.Module:
    """The feed-forward block of layer `layer_number` (named `layers.{i}.mlp`), as the config chooses."""
    return MLP_BUILDERS[config.mlp_type_of(layer_number)](config, groups, f"layers.{layer_number}.mlp")
