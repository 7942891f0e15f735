"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybrid.model.attention import SelfAttention
from hybrid.model.mlp import build_mlp
from hybrid.model.norms import build_norm
from hybrid.model.recompute import checkpoint
from hybrid.model.sequence import sequence_layout, stage_layout
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
    `recompute_whole`: the layer recomputes itself in backward (full recompute, block method, where
    the caller cannot wrap it: DeepSpeed's pipeline engine calls each layer itself).
    """

    def __init__(self, config, groups, layer_number: int):
        super().__init__()
        name = f"layers.{layer_number}"
        self.layer_number = layer_number
        self.config = config
        self.groups = as_groups(groups)
        self.recompute_whole = False
        self.input_norm = build_norm(config, groups)
        self.attention = SelfAttention(config, groups, layer_number, f"{name}.attention")
        self.post_attention_norm = build_norm(config, groups)
        self.mlp = build_mlp(config, groups, layer_number)

    def forward(self, hidden, layout=None):
        """`layout`: the micro-batch's documents and positions (hybrid.model.sequence), or None (a pipeline
        stage, which derives this rank's part of the sequence from the hidden states' length)."""
        if isinstance(hidden, tuple):  # a pipeline stage with packed documents: (hidden, whole-sequence ids)
            hidden, ids = hidden
            return self.forward(hidden, sequence_layout(ids, self.config, self.groups)), ids
        if layout is None and self.groups.sequence_split > 1:
            sp = self.config.sequence_parallel
            layout = stage_layout(hidden.size(0) * (self.groups.tp_size if sp else 1), self.groups, hidden.device)
        if self.recompute_whole and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden, layout)
        return self._forward(hidden, layout)

    def _forward(self, hidden, layout=None):
        c = self.config
        hidden = dropout_add(self.attention(self.input_norm(hidden), layout), hidden, c.hidden_dropout,
                             self.training, c.sequence_parallel)
        return dropout_add(self.mlp(self.post_attention_norm(hidden)), hidden, c.hidden_dropout,
                           self.training, c.sequence_parallel)
