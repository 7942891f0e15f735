"""Gemma 4's per-layer inputs (--per-layer-input-size P; its E2B and E4B), as transformers' Gemma4TextModel computes
them (get_per_layer_inputs, project_per_layer_inputs) and its decoder layer uses them:

- the first stage looks the tokens up in a second vocabulary table of num_layers x P features (x sqrt(P), in the
  table's dtype), projects the scaled word embeddings to the same size (x 1/sqrt(h)), RMS-norms each layer's P
  features of that projection, and adds the two, x 1/sqrt(2): [s, b, layers, P];
- layer i, after its MLP's residual, adds norm(W_up (gelu_tanh(W_gate x) * its P features)).

The table is split over TP by vocabulary rows as the word embeddings are (its lookup summed over TP); the projection,
the norm and each layer's gate and up projection are small and replicated, computed on the whole sequence before
SP's scatter (the embedding side) or on this rank's tokens (the layer side, their gradients then summed over TP).
The per-layer inputs go to every layer beside the hidden states; a pipeline would send them between stages, which is
not built (capability rule `per-layer-inputs-pipeline`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.init import normal_init, vocab_rows_init
from hybrid.model.norms import RMSNorm, build_norm
from hybrid.parallel import mappings as M
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import VocabParallelEmbedding

# canonical names (Embedding holds PerLayerInputs as `per_layer`, each TransformerLayer its PerLayerGate as `per_layer`)
TABLE = "embedding.per_layer.table.weight"  # [vocab, layers x P], split over TP by rows
PROJECTION = "embedding.per_layer.projection"  # [layers x P, h], replicated (its norm: embedding.per_layer.norm.weight)


def _replicated(config, name: str, shape: tuple) -> nn.Parameter:
    full = torch.empty(shape, dtype=torch.float32)
    normal_init(config.seed, name, config.init_method_std)(full)
    return nn.Parameter(full)


class PerLayerInputs(nn.Module):
    """The embedding side: (ids [s, b], the scaled word embeddings [s, b, h] of the whole sequence) -> per-layer
    inputs [s, b, layers, P] (the caller scatters them with the hidden states under SP)."""

    def __init__(self, config, groups):
        super().__init__()
        groups = as_groups(groups)
        self.layers, self.size, self.hidden = config.num_layers, config.per_layer_input_size, config.hidden_size
        width = self.layers * self.size
        self.table = VocabParallelEmbedding(
            config.padded_vocab_size(groups.tp_size), width, groups,
            vocab_rows_init(normal_init(config.seed, TABLE, config.init_method_std), config.vocab_size))
        self.projection = _replicated(config, PROJECTION, (width, self.hidden))
        self.norm = RMSNorm(self.size, config.norm_epsilon, groups, fp32_scale=config.rmsnorm_fp32_scale)

    def forward(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        tokens = self.table(ids)  # [s, b, layers x P], summed over TP
        tokens = tokens * torch.tensor(self.size ** 0.5, dtype=tokens.dtype, device=tokens.device)
        projected = F.linear(embedded, self.projection) * self.hidden ** -0.5
        projected = self.norm(projected.view(*projected.shape[:-1], self.layers, self.size))
        return (projected + tokens.view_as(projected)) * 2.0 ** -0.5


class PerLayerGate(nn.Module):
    """The layer side: hidden [s(/tp), b, h] + norm(W_up (gelu_tanh(W_gate hidden) * this layer's inputs))."""

    def __init__(self, config, groups, layer_number: int):
        super().__init__()
        self.tp_group, self.sequence_parallel = as_groups(groups).tp_group, config.sequence_parallel
        name, size = f"layers.{layer_number}", config.per_layer_input_size
        self.gate = _replicated(config, f"{name}.per_layer.gate", (size, config.hidden_size))
        self.up = _replicated(config, f"{name}.per_layer.up", (config.hidden_size, size))
        self.norm = build_norm(config, groups)
        self.layer_number = layer_number

    def forward(self, hidden: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate, self.up
        if self.sequence_parallel:  # this rank's tokens only: the gradients are partial, summed over TP
            gate, up = M.sync_replicated_grad(gate, self.tp_group), M.sync_replicated_grad(up, self.tp_group)
        out = F.gelu(F.linear(hidden, gate), approximate="tanh") * per_layer[..., self.layer_number, :]
        return hidden + self.norm(F.linear(out, up))
