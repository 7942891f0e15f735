"""MLA's rope rows in DeepSeek's interleaved order (HF's DeepSeek-V3 checkpoints and megatron-core's MLA) and in
the halves hybrid rotates: the one permutation the HF and Megatron readers and writers share."""

from __future__ import annotations

import torch

from hybrid.model.config import ModelConfig


def rope_order(pos: int, interleaved_to_halves: bool) -> torch.Tensor:
    """The rope features' order: DeepSeek's checkpoints hold each rotated pair side by side (x0, x1), (x2, x3),
    ... and rotate them de-interleaved, [x0, x2, ... | x1, x3, ...] (transformers' apply_rotary_pos_emb_interleave,
    megatron-core's MLA); the model here rotates halves, so the rows making those features are permuted."""
    halves = torch.cat([torch.arange(0, pos, 2), torch.arange(1, pos, 2)])
    return halves if interleaved_to_halves else torch.argsort(halves)


def permute_rope_rows(t: torch.Tensor, block: int, pos: int, to_halves: bool) -> torch.Tensor:
    """`t` [blocks x block, ...] with the rope features last in each block: those rows reordered (rope_order)."""
    blocks = t.reshape(-1, block, *t.shape[1:])
    order = torch.cat([torch.arange(block - pos), block - pos + rope_order(pos, to_halves)])
    return blocks[:, order].reshape(t.shape).contiguous()


def mla_rope_blocks(config: ModelConfig) -> dict:
    """MLA's projections whose rows make rope features (canonical names inside a layer) -> the size of their row
    blocks, the rope features last in each: a head of the query, the whole kv down projection (latent, then the
    shared rope key)."""
    head = config.qk_head_dim + config.qk_pos_emb_head_dim
    return {"attention.q.weight": head, "attention.q_up.weight": head,
            "attention.kv_down.weight": config.kv_lora_rank + config.qk_pos_emb_head_dim}


def deepseek_rope_rows(state: dict, config: ModelConfig, to_halves: bool) -> dict:
    """`state` (canonical names) with MLA's rope rows permuted from DeepSeek's interleaved order, which HF's
    DeepSeek-V3 checkpoints and megatron-core's MLA keep, to the halves hybrid rotates (`to_halves`), or back;
    unchanged without MLA. Optimizer moments are permuted as their parameters."""
    if not config.multi_latent_attention:
        return state
    blocks = mla_rope_blocks(config)
    out = {}
    for name, t in state.items():
        block = next((size for rest, size in blocks.items() if name.endswith("." + rest)), None)
        out[name] = t if block is None else permute_rope_rows(t, block, config.qk_pos_emb_head_dim, to_halves)
    return out
