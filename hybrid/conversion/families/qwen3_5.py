"""Qwen3.5 (Qwen3_5ForCausalLM, its text model): Qwen3 with three of every four layers Gated DeltaNet
(`layer_types`), the others full attention with a per-head output gate; rope on part of each head; zero-centred
RMSNorms. The Gated DeltaNet tensors and the gate are mapped by families.linear_attention."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families import linear_attention as la
from hybrid.conversion.families.adapter import expect, get
from hybrid.conversion.families.options import partial_rotary_percent
from hybrid.conversion.families.qwen3 import Qwen3Adapter
from hybrid.model.qkv import fuse_qkv, split_qkv_flat

NORMS = {"model.layers.{}.input_layernorm.weight": "layers.{}.input_norm.weight",
         "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight"}


class Qwen3_5Adapter(Qwen3Adapter):
    family, hf_class, config_class = "qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig"
    options = ("Qwen3's with Gated DeltaNet layers by `layer_types` (--experimental-attention-variant gated_delta_net "
               "--linear-attention-freq, the linear_* shapes), gated full attention (--attention-output-gate), "
               "`partial_rotary_factor` (--rotary-percent), zero-centred RMSNorms (--apply-layernorm-1p)")
    refused = "`attention_bias`, rope scaling other than Llama's; the vision tower (text only)"
    windowed, partial_rotary, zero_centred_norms, gated_delta_net = False, True, True, True
    grouped_projections = False  # the Gated DeltaNet input projection as Qwen3.5 stores it (flat)

    @classmethod
    def config_from_hf(cls, hf):
        name = cls.hf_class.replace("ForCausalLM", "")
        return dataclasses.replace(super().config_from_hf(hf), rotary_percent=partial_rotary_percent(hf),
                                   **la.config_fields(hf, name))

    def family_fields(self):
        c = self.config
        return dict(super().family_fields(), **la.hf_fields(c), attention_bias=False,
                    rope_parameters=dict(rope_type="default", rope_theta=c.rotary_base,
                                         partial_rotary_factor=c.rotary_percent))

    def layer_to_canonical(self, hf_state, i, wanted=None):
        if not self.config.linear_attention(i):
            return super().layer_to_canonical(hf_state, i, wanted)
        out = {}
        la.gdn_to_canonical(self.config, hf_state, i, out, self.grouped_projections)
        self.mlp_to_canonical(hf_state, i, out, wanted)
        for hf_tmpl, ours in NORMS.items():
            out[ours.format(i)] = get(hf_state, hf_tmpl.format(i))
        return out

    def layer_to_hf(self, state, i, out):
        if not self.config.linear_attention(i):
            return super().layer_to_hf(state, i, out)
        la.gdn_to_hf(self.config, state, i, out, self.grouped_projections)
        self.mlp_to_hf(state, i, out)
        for hf_tmpl, ours in NORMS.items():
            out[hf_tmpl.format(i)] = state[ours.format(i)]

    def attention_to_canonical(self, hf_state, i, out):
        """q_proj (queries and gates per head), k_proj, v_proj -> the fused QKV and attention.gate."""
        c = self.config
        heads, groups, d, h = c.num_attention_heads, c.num_query_groups, c.head_dim, c.hidden_size
        p = f"model.layers.{i}.self_attn."
        q, gate = la.split_gated_queries(expect(p + "q_proj.weight", get(hf_state, p + "q_proj.weight"),
                                                (heads * 2 * d, h)), heads, d)
        k, v = (expect(f"{p}{x}_proj.weight", get(hf_state, f"{p}{x}_proj.weight"), (groups * d, h)) for x in "kv")
        out[f"layers.{i}.attention.qkv.weight"] = fuse_qkv(q, k, v, groups)
        out[f"layers.{i}.attention.gate.weight"] = gate

    def attention_to_hf(self, state, i, out):
        c = self.config
        q, k, v = split_qkv_flat(state[f"layers.{i}.attention.qkv.weight"],
                                 c.num_attention_heads // c.num_query_groups, c.head_dim)
        p = f"model.layers.{i}.self_attn."
        out[p + "q_proj.weight"] = la.join_gated_queries(q, state[f"layers.{i}.attention.gate.weight"],
                                                         c.num_attention_heads, c.head_dim)
        out[p + "k_proj.weight"], out[p + "v_proj.weight"] = k, v
