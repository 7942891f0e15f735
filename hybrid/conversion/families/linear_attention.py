"""Gated DeltaNet layers and the gated full attention beside them (Qwen3-Next, Qwen3.5): config fields and tensors
both ways. Two HF layouts of the input projection: Qwen3-Next's grouped per key head (`in_proj_qkvz` rows
[q | k | v | z] per key head, `in_proj_ba` [b | a] per key head) and Qwen3.5's flat one (`in_proj_qkv` = all
queries, all keys, all values; `in_proj_z`, `in_proj_b`, `in_proj_a`). Ours is grouped per key head, [q | k | v | z |
b | a], so TP splits it contiguously (hybrid.model.gated_delta_net). transformers' full-attention `q_proj` holds each
head's query then its output gate; ours are the fused QKV's queries and `attention.gate`."""

from __future__ import annotations

import torch

from hybrid.conversion.families.adapter import expect, get, refuse
from hybrid.model.config import ModelConfig

LINEAR, FULL = "linear_attention", "full_attention"  # transformers' layer_types
SHAPE_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads")  # the same names in transformers' configs and ours


def config_fields(hf, name: str) -> dict:
    """Our fields for a Gated DeltaNet model's HF config: the layer pattern from `layer_types`, the shapes."""
    kinds = list(getattr(hf, "layer_types", None) or [])
    if len(kinds) != hf.num_hidden_layers or set(kinds) - {LINEAR, FULL}:
        refuse(name, "layer_types", kinds, f"one of {LINEAR!r} / {FULL!r} per layer ({hf.num_hidden_layers}) is "
               f"expected")
    if getattr(hf, "attention_bias", False):
        refuse(name, "attention_bias", True, "the gated attention of this family has no biases here")
    fields = {field: int(getattr(hf, field)) for field in SHAPE_FIELDS}
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        refuse(name, "linear_num_value_heads", fields["linear_num_value_heads"],
               "it must be a multiple of linear_num_key_heads")
    return dict(fields, linear_attention_freq=[int(kind == LINEAR) for kind in kinds], attention_output_gate=True)


def hf_fields(c: ModelConfig) -> dict:
    """The HF config's fields of our Gated DeltaNet model."""
    kinds = [LINEAR if c.linear_attention(i) else FULL for i in range(c.num_layers)]
    return dict({field: getattr(c, field) for field in SHAPE_FIELDS}, layer_types=kinds)


def _shapes(c: ModelConfig) -> tuple:
    """(key heads, value heads per key head, key head size, value head size)."""
    nk = c.linear_num_key_heads
    return nk, c.linear_num_value_heads // nk, c.linear_key_head_dim, c.linear_value_head_dim


def gdn_to_canonical(c: ModelConfig, hf_state, i: int, out: dict, grouped: bool) -> None:
    """Layer `i`'s `linear_attn.*` -> our `attention.*` (in_proj and conv grouped per key head)."""
    nk, r, dk, dv = _shapes(c)
    h, p, ours = c.hidden_size, f"model.layers.{i}.linear_attn.", f"layers.{i}.attention."

    def read(name, shape):
        return expect(p + name, get(hf_state, p + name), shape)
    if grouped:
        qkvz = read("in_proj_qkvz.weight", (nk * (2 * dk + 2 * r * dv), h)).view(nk, -1, h)
        ba = read("in_proj_ba.weight", (nk * 2 * r, h)).view(nk, -1, h)
        parts = [qkvz, ba]
    else:
        qkv = read("in_proj_qkv.weight", (nk * (2 * dk + r * dv), h))
        q, k, v = qkv.split([nk * dk, nk * dk, nk * r * dv])
        parts = [q.view(nk, dk, h), k.view(nk, dk, h), v.view(nk, r * dv, h),
                 read("in_proj_z.weight", (nk * r * dv, h)).view(nk, -1, h),
                 read("in_proj_b.weight", (nk * r, h)).view(nk, r, h),
                 read("in_proj_a.weight", (nk * r, h)).view(nk, r, h)]
    out[ours + "in_proj.weight"] = torch.cat(parts, dim=1).reshape(-1, h)
    kernel = c.linear_conv_kernel_dim
    conv = read("conv1d.weight", (nk * (2 * dk + r * dv), 1, kernel)).squeeze(1)
    q, k, v = conv.split([nk * dk, nk * dk, nk * r * dv])
    out[ours + "conv_weight"] = torch.cat([q.view(nk, dk, kernel), k.view(nk, dk, kernel),
                                           v.view(nk, r * dv, kernel)], dim=1).reshape(-1, kernel)
    out[ours + "A_log"] = read("A_log", (nk * r,))
    out[ours + "dt_bias"] = read("dt_bias", (nk * r,))
    out[ours + "norm.weight"] = read("norm.weight", (dv,))
    out[ours + "out_proj.weight"] = read("out_proj.weight", (h, nk * r * dv))


def gdn_to_hf(c: ModelConfig, state: dict, i: int, out: dict, grouped: bool) -> None:
    """The inverse of gdn_to_canonical."""
    nk, r, dk, dv = _shapes(c)
    h, p, ours = c.hidden_size, f"model.layers.{i}.linear_attn.", f"layers.{i}.attention."
    q, k, v, z, b, a = state[ours + "in_proj.weight"].view(nk, -1, h).split([dk, dk, r * dv, r * dv, r, r], dim=1)
    if grouped:
        out[p + "in_proj_qkvz.weight"] = torch.cat([q, k, v, z], dim=1).reshape(-1, h)
        out[p + "in_proj_ba.weight"] = torch.cat([b, a], dim=1).reshape(-1, h)
    else:
        out[p + "in_proj_qkv.weight"] = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
        for name, t in (("z", z), ("b", b), ("a", a)):
            out[f"{p}in_proj_{name}.weight"] = t.reshape(-1, h).contiguous()
    kernel = c.linear_conv_kernel_dim
    cq, ck, cv = state[ours + "conv_weight"].view(nk, -1, kernel).split([dk, dk, r * dv], dim=1)
    out[p + "conv1d.weight"] = torch.cat([cq.reshape(-1, kernel), ck.reshape(-1, kernel),
                                          cv.reshape(-1, kernel)]).unsqueeze(1)
    for name in ("A_log", "dt_bias", "norm.weight", "out_proj.weight"):
        out[p + name] = state[ours + name]


def split_gated_queries(q_proj: torch.Tensor, heads: int, head_dim: int) -> tuple:
    """transformers' gated `q_proj` [heads * 2d, h] (per head its query, then its gate) -> (queries, gates),
    each [heads * d, h]."""
    per_head = q_proj.view(heads, 2, head_dim, -1)
    return per_head[:, 0].reshape(heads * head_dim, -1), per_head[:, 1].reshape(heads * head_dim, -1)


def join_gated_queries(q: torch.Tensor, gate: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of split_gated_queries."""
    return torch.stack([q.view(heads, head_dim, -1), gate.view(heads, head_dim, -1)], dim=1).reshape(
        heads * 2 * head_dim, -1)
