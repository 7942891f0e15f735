"""Model FLOPs per iteration by Megatron-LM's formula (num_floating_point_operations)."""

from __future__ import annotations

from hybrid.model.config import ModelConfig


def flops_per_iteration(config: ModelConfig, batch_size: int, seq_length: int, padded_vocab_size: int) -> float:
    """Forward + backward FLOPs (3 x 2 per multiply-add) for `batch_size` sequences, recompute excluded."""
    h, layers = config.hidden_size, config.num_layers
    query_ratio = (config.head_dim * config.num_attention_heads) / h
    gated = 1.5 if config.gated_linear_unit else 1.0
    return 12.0 * batch_size * seq_length * layers * h * h * (
        (1 + config.num_query_groups / config.num_attention_heads + seq_length / h) * query_ratio
        + (config.ffn_hidden_size / h) * gated
        + padded_vocab_size / (2 * layers * h))
