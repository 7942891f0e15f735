"""Mistral 4 (Mistral4ForCausalLM; Mistral Small 4): DeepSeek-V3's multi-head latent attention (its rope rows
interleaved, mla_rope) with Llama 4's query temperature past the original context (--llama-4-scaling-beta), and a
DeepSeek-style MoE (shared experts, the first layers dense) whose router is softmax, renormalised and scaled, with
no score bias, its experts stacked (moe.ExpertLayout.fused)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import refuse
from hybrid.conversion.families.deepseek_v3 import DeepseekV3Adapter
from hybrid.conversion.families.moe import ExpertLayout, first_dense
from hybrid.conversion.families.options import rope_of, rope_parameters
from hybrid.errors import ConfigError

MISTRAL4_EXPERTS = ExpertLayout(shared=True, shared_block="shared_experts", shared_gated=False, softmax_scaled=True,
                                fused=True)


class Mistral4Adapter(DeepseekV3Adapter):
    family, hf_class, config_class = "mistral4", "Mistral4ForCausalLM", "Mistral4Config"
    options = ("DeepSeek-V3's MLA and YaRN (`partial_rotary_factor` = its rope share of each head), Llama 4's query "
               "temperature (`llama_4_scaling_beta` = --llama-4-scaling-beta, over YaRN's original context = "
               "--llama-4-scaling-length); MoE: softmax top-k (`norm_topk_prob` renormalises: no "
               "--moe-router-pre-softmax), `routed_scaling_factor` (--moe-router-topk-scaling-factor), shared "
               "experts, the first layers dense")
    refused = ("`n_group` > `topk_group` (groups of softmax scores), `n_shared_experts` 0, rope other than YaRN, as "
               "DeepSeek-V3's")

    experts = MISTRAL4_EXPERTS
    stores_mtp = False
    query_temperature = True

    @classmethod
    def _rope_params(cls, hf) -> dict:
        params = dict(getattr(hf, "rope_parameters", None) or {})
        params.pop("max_position_embeddings", None)  # (transformers never reads it there)
        return params

    @classmethod
    def _rope(cls, hf):
        params = cls._rope_params(hf)
        params.pop("llama_4_scaling_beta", None)
        share = hf.qk_rope_head_dim / (hf.qk_nope_head_dim + hf.qk_rope_head_dim)
        if abs(float(params.get("partial_rotary_factor", share)) - share) > 1e-9:
            refuse("Mistral4", "partial_rotary_factor", params["partial_rotary_factor"],
                   f"MLA's rope covers qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim) = {share:.6g}")
        theta, scaling = rope_of(hf, params, partial=True)
        if not scaling or scaling["rope_type"] != "yarn":
            refuse("Mistral4", "rope_parameters.rope_type", (scaling or {}).get("rope_type", "default"),
                   "Mistral 4's query temperature reads YaRN's original_max_position_embeddings")
        return theta, scaling

    @classmethod
    def config_from_hf(cls, hf):
        config = super().config_from_hf(hf)
        beta = cls._rope_params(hf).get("llama_4_scaling_beta")
        if beta is None:
            refuse("Mistral4", "rope_parameters.llama_4_scaling_beta", None, "transformers' Mistral 4 multiplies its "
                   "queries by 1 + beta ln(1 + floor(position / original context)) and needs the beta")
        length = config.rope_scaling["original_max_position_embeddings"]
        return dataclasses.replace(config, llama_4_scaling_beta=float(beta) or None,
                                   llama_4_scaling_length=int(length) if float(beta) else None)

    @classmethod
    def moe_config(cls, hf, config):
        groups, chosen = int(hf.n_group or 1), int(hf.topk_group or 1)
        if chosen < groups:
            refuse("Mistral4", "n_group", groups, f"choosing topk_group {chosen} of the groups of softmax scores is "
                   f"not implemented (Mistral Small 4 has one group)")
        if not hf.n_shared_experts:
            refuse("Mistral4", "n_shared_experts", hf.n_shared_experts, "its MoE layers always hold shared experts")
        dense, scale = int(hf.first_k_dense_replace or 0), float(hf.routed_scaling_factor)
        return dataclasses.replace(
            config, num_experts=int(hf.n_routed_experts), moe_router_topk=int(hf.num_experts_per_tok),
            moe_ffn_hidden_size=int(hf.moe_intermediate_size),
            moe_layer_freq=1 if dense == 0 else [int(i >= dense) for i in range(hf.num_hidden_layers)],
            moe_router_pre_softmax=not hf.norm_topk_prob,  # (top-k of the logits, then softmax: renormalised)
            moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
            moe_shared_expert_intermediate_size=int(hf.n_shared_experts) * int(hf.moe_intermediate_size))

    def moe_wanted(self):
        c = self.config
        if not c.num_experts:
            return {}
        return {"dense layers first, then MoE layers only (--moe-layer-freq)": first_dense(c) is not None,
                "--moe-shared-expert-intermediate-size a multiple of --moe-ffn-hidden-size":
                    (c.moe_shared_expert_intermediate_size or 0) % c.moe_ffn_hidden_size == 0}

    def check_exportable(self):
        super().check_exportable()
        c = self.config
        scaling = c.rope_scaling or {}
        if scaling.get("rope_type") != "yarn":
            raise ConfigError(f"exporting to {self.hf_class} needs YaRN rope (MLA's default; not --rope-type rope).")
        if c.llama_4_scaling_length not in (None, scaling["original_max_position_embeddings"]):
            raise ConfigError(f"exporting to {self.hf_class} needs --llama-4-scaling-length = "
                              f"--yarn-original-max-position-embeddings ({scaling['original_max_position_embeddings']}"
                              f"): transformers reads one original context for both.")

    def family_fields(self):
        c = self.config
        rope = dict(rope_parameters(c), llama_4_scaling_beta=c.llama_4_scaling_beta or 0.0,
                    partial_rotary_factor=c.qk_pos_emb_head_dim / (c.qk_head_dim + c.qk_pos_emb_head_dim))
        return dict(n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                    moe_intermediate_size=c.moe_ffn_hidden_size,
                    n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
                    routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0, n_group=1, topk_group=1,
                    first_k_dense_replace=first_dense(c), norm_topk_prob=not c.moe_router_pre_softmax,
                    q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_head_dim,
                    qk_rope_head_dim=c.qk_pos_emb_head_dim, v_head_dim=c.v_head_dim, rope_interleave=True,
                    rope_parameters=rope)
