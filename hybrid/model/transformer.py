"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.attention import SelfAttention
from hybrid.model.gated_delta_net import GatedDeltaNet
from hybrid.model.mla import MultiLatentAttention
from hybrid.model.mlp import build_mlp
from hybrid.model.moe.moe_layer import MoELayer
from hybrid.model.norms import build_norm
from hybrid.model.per_layer import PerLayerGate
from hybrid.parallel.groups import as_groups
from hybrid.parallel.random import fork_tp_rng


def dropout_add(x, residual, p: float, training: bool, sequence_parallel: bool):
    """residual + dropout(x). Under SP the activations are sequence shards, so the mask must
    come from the per-TP-rank stream; otherwise it is the same on every TP rank."""
    if not training or p == 0.0:  # no dropout, hence no RNG fork
        return residual + x
    if sequence_parallel:
        with fork_tp_rng():
            return residual + F.dropout(x, p, True)
    return residual + F.dropout(x, p, True)


class TransformerLayer(nn.Module):
    """A decoder layer on `[s, b, h]` (`[s/tp, b, h]` with sequence parallelism).

    `layer_number` is global (0-based) so weights and names do not depend on the pipeline split.
    """

    def __init__(self, config, groups, layer_number: int):
        super().__init__()
        name = f"layers.{layer_number}"
        self.layer_number = layer_number
        self.config = config
        self.groups = as_groups(groups)
        self.input_norm = build_norm(config, groups)
        attention = GatedDeltaNet if config.linear_attention(layer_number) else \
            MultiLatentAttention if config.multi_latent_attention else SelfAttention
        self.attention = attention(config, groups, layer_number, f"{name}.attention")
        self.post_attention_norm = build_norm(config, groups)
        self.mlp = build_mlp(config.layer_config(layer_number), groups, layer_number)
        # --sandwich-norms (Gemma 2/3): the attention's and the MLP's outputs normed before their residuals
        self.attention_output_norm = build_norm(config, groups) if config.sandwich_norms else None
        self.mlp_output_norm = build_norm(config, groups) if config.sandwich_norms else None
        # --layer-scalars (Gemma 4's layer_scalar): the layer's output times a constant
        scalars = config.layer_scalars
        self.output_scale = scalars[layer_number] if scalars and layer_number < len(scalars) else None
        # --per-layer-input-size (Gemma 4): this layer's gate on its per-layer inputs (hybrid.model.per_layer)
        self.per_layer = PerLayerGate(config, groups, layer_number) \
            if config.per_layer_input_size and layer_number < config.num_layers else None

    def forward(self, hidden, layout=None, per_layer=None):
        """`layout`: the micro-batch's documents and positions, and this rank's part of the sequence
        (hybrid.model.sequence), or None for whole sequences of one document each; `per_layer`: the per-layer
        inputs [s(/tp), b, layers, P] (--per-layer-input-size)."""
        c = self.config
        out = self.attention(self.input_norm(hidden), layout)
        if self.attention_output_norm is not None:
            out = self.attention_output_norm(out)
        hidden = dropout_add(out, hidden, c.hidden_dropout, self.training, c.sequence_parallel)
        normed = self.post_attention_norm(hidden)
        # (Gemma 4's MoE block reads the residual too: hybrid.model.moe.moe_layer)
        if isinstance(self.mlp, MoELayer):  # (the layout: --grpo's recorded routing, hybrid.model.sequence)
            out = self.mlp(normed, hidden if self.mlp.takes_residual else None, layout)
        else:
            out = self.mlp(normed)
        if self.mlp_output_norm is not None:
            out = self.mlp_output_norm(out)
        hidden = dropout_add(out, hidden, c.hidden_dropout, self.training, c.sequence_parallel)
        if self.per_layer is not None:
            hidden = self.per_layer(hidden, per_layer)
        return hidden if self.output_scale is None else hidden * self.output_scale
