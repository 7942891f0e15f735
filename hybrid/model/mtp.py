"""Multi-token prediction (DeepSeek-V3; megatron-core's MultiTokenPredictionLayer, Megatron-LM's --mtp-num-layers):
after the decoder, depth k = 1..D predicts the token k + 1 places ahead. Its layer combines each position's
previous representation h (the decoder's final-normed output for k = 1, else depth k - 1's output) with the
embedding of the token k places ahead:

    h_k = final_norm_k(layer_k(eh_proj_k([enorm_k(embed(ids shifted by k)) | hnorm_k(h_{k-1})])))

and the shared output head gives its logits. The loss of depth k is the mean cross-entropy against the labels
shifted by k (the last k positions have no target), the D depths weighted by --mtp-loss-scaling-factor / D
(hybrid.model.objectives.LanguageModeling). The layers sit on the last pipeline stage; there the word embeddings
are the first stage's table or, when another rank holds it, the copy the runtime keeps equal to it
(hybrid.model.virtual_stages). They run in training only: evaluation and decoding take the decoder's logits.

Positions stay those of the tokens h belongs to (megatron-core rolls them with the ids, which shifts every rope
angle by the same amount and leaves attention unchanged for every position that takes a loss).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybrid.model.init import normal_init
from hybrid.model.norms import build_norm
from hybrid.model.transformer import TransformerLayer
from hybrid.parallel.groups import as_groups
from hybrid.parallel.layers import ColumnParallelLinear
from hybrid.parallel.mappings import gather_from_tp_region, scatter_to_sequence_parallel_region


class MTPLayer(nn.Module):
    """One prediction depth (see the module docstring); `layer_number`: its number after the decoder's."""

    def __init__(self, config, groups, layer_number: int, prefix: str):
        super().__init__()
        self.config, self.groups = config, as_groups(groups)
        h = config.hidden_size
        self.enorm = build_norm(config, groups)
        self.hnorm = build_norm(config, groups)
        self.eh_proj = ColumnParallelLinear(2 * h, h, groups, normal_init(config.seed, f"{prefix}eh_proj.weight",
                                                                          config.init_method_std),
                                            bias=False, sequence_parallel=config.sequence_parallel,
                                            overlap=config.async_tensor_model_parallel_allreduce)
        self.layer = TransformerLayer(config, groups, layer_number)
        self.final_norm = build_norm(config, groups)

    def forward(self, hidden, embedded, layout=None):
        """hidden, embedded [s(/tp), b, h] -> this depth's final-normed hidden [s(/tp), b, h]."""
        tp_group = self.groups.tp_group
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))  # [s, b, h/tp]
        x = gather_from_tp_region(x, tp_group)  # [s, b, h], as megatron-core's eh_proj
        if self.config.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, tp_group)
        return self.final_norm(self.layer(x, layout))


def shifted(tensor: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """[b, s] -> the same with every row moved k places left, the last k places `fill` (megatron-core's
    roll_tensor, which zeroes them)."""
    if k == 0:
        return tensor
    return torch.cat((tensor[:, k:], tensor.new_full((tensor.size(0), k), fill)), dim=1)
