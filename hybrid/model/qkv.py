"""The fused QKV layout, in one place: the attention module splits its projection's output with it and
every HF adapter fuses and splits weights with it.

Megatron-LM's layout: the fused features are grouped per KV head (query group): for each group its
`heads_per_group` query heads, then its key head, then its value head, `head_dim` features each.
Splitting that dimension contiguously over TP keeps whole groups per rank. GPT-2's per-head
[q_h, k_h, v_h] is the same layout with one query head per group.
"""

from __future__ import annotations

import torch


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v, num_groups: int) -> torch.Tensor:
    """q [G*P*d, ...], k and v [G*d, ...] (dim 0: heads x head_dim, as HF stores them) -> [G*(P+2)*d, ...]; v None
    (keys serve as values: --attention-k-eq-v): [G*(P+1)*d, ...]."""
    tail = q.shape[1:]
    head_dim = k.shape[0] // num_groups
    per_group = q.shape[0] // (num_groups * head_dim)
    parts = [q.reshape(num_groups, per_group, head_dim, *tail), k.reshape(num_groups, 1, head_dim, *tail)]
    if v is not None:
        parts.append(v.reshape(num_groups, 1, head_dim, *tail))
    return torch.cat(parts, dim=1).reshape(-1, *tail)  # [G, P + 2, d, ...] flattened


def split_qkv(fused: torch.Tensor, heads_per_group: int, head_dim: int, dim: int = 0, values: bool = True):
    """The inverse along `dim`: (q, k, v), that dimension split into (heads, head_dim):
    q [..., G*P, d, ...], k and v [..., G, d, ...]; v None where the projection has no values (`values` False)."""
    dim = dim % fused.dim()
    shape = fused.shape
    grouped = fused.view(*shape[:dim], -1, heads_per_group + (2 if values else 1), head_dim, *shape[dim + 1:])
    # one split (its backward is one cat into the fused gradient), not narrow + two selects (whose
    # backwards would each zero-fill a fused-size gradient and add the three)
    if not values:
        q, k = grouped.split([heads_per_group, 1], dim + 1)
        return q.flatten(dim, dim + 1), k.squeeze(dim + 1), None
    q, k, v = grouped.split([heads_per_group, 1, 1], dim + 1)
    return q.flatten(dim, dim + 1), k.squeeze(dim + 1), v.squeeze(dim + 1)


def split_qkv_flat(fused: torch.Tensor, heads_per_group: int, head_dim: int, values: bool = True):
    """split_qkv on dim 0, each part flattened back to HF's [heads * head_dim, ...] (weights and biases)."""
    return tuple(None if t is None else t.flatten(0, 1).contiguous()
                 for t in split_qkv(fused, heads_per_group, head_dim, 0, values))
