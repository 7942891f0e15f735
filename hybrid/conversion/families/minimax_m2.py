"""MiniMax-M2 (MiniMaxM2ForCausalLM; also M2.1 and M2.5): Llama-style attention with rope on part of each head and
Q/K RMSNorms across all heads (--qk-norm-across-heads), every layer a mixture of experts routed as DeepSeek's
(sigmoid scores, the score bias choosing, renormalised) without groups, scaling or shared experts, stored as
Mixtral's (block_sparse_moe, w1/w3/w2)."""

from __future__ import annotations

import dataclasses

from hybrid.conversion.families.adapter import refuse
from hybrid.conversion.families.llama import LlamaAdapter
from hybrid.conversion.families.moe import ExpertLayout
from hybrid.conversion.families.options import partial_rotary_percent

MINIMAX_EXPERTS = ExpertLayout(block="block_sparse_moe", expert_names=("w1", "w3", "w2"), sigmoid_routing=True,
                               score_bias="e_score_correction_bias")


class MiniMaxM2Adapter(LlamaAdapter):
    family, hf_class, config_class = "minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config"
    options = ("Llama's, rope on part of each head (`partial_rotary_factor` or `rotary_dim` = --rotary-percent), Q/K "
               "RMSNorms across all heads (--qk-layernorm --qk-norm-across-heads), every layer MoE: sigmoid top-k "
               "with the score bias (--moe-router-score-function sigmoid --moe-router-enable-expert-bias), "
               "renormalised")
    refused = "`router_jitter_noise` > 0, `num_experts_per_tok` 1 (its weight renormalised to 1), as Llama's"
    partial_rotary = True
    qk_norm = True
    qk_norm_across = True
    experts = MINIMAX_EXPERTS

    @classmethod
    def config_from_hf(cls, hf):
        return dataclasses.replace(super().config_from_hf(hf), qk_norm_across_heads=True,
                                   rotary_percent=partial_rotary_percent(hf))

    @classmethod
    def moe_config(cls, hf, config):
        if getattr(hf, "router_jitter_noise", 0.0):
            refuse("MiniMaxM2", "router_jitter_noise", hf.router_jitter_noise, "routing noise is not implemented")
        if int(hf.num_experts_per_tok) == 1:
            refuse("MiniMaxM2", "num_experts_per_tok", 1, "transformers renormalises the one weight to 1, the sigmoid "
                   "router here (as Megatron-LM's) renormalises top-k > 1 only")
        return dataclasses.replace(config, num_experts=int(hf.num_local_experts),
                                   moe_router_topk=int(hf.num_experts_per_tok),
                                   moe_ffn_hidden_size=hf.intermediate_size, moe_layer_freq=1,
                                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)

    def moe_wanted(self):
        c = self.config
        return {"--moe-layer-freq 1": all(c.mlp_type_of(i) == "moe" for i in range(c.num_layers)),
                "--moe-router-score-function sigmoid": c.moe_router_score_function == "sigmoid",
                "--moe-router-topk > 1": c.moe_router_topk > 1,
                "no --moe-router-num-groups, --moe-router-topk-scaling-factor":
                    not (c.moe_router_num_groups or c.moe_router_topk_scaling_factor),
                "--moe-ffn-hidden-size = --ffn-hidden-size": c.moe_ffn_hidden_size == c.ffn_hidden_size}

    def family_fields(self):
        c = self.config
        rope = {"rope_type": "default"} if not c.rope_scaling else dict(c.rope_scaling)
        return dict(num_local_experts=c.num_experts, num_experts_per_tok=c.moe_router_topk,
                    rope_parameters=dict(rope, rope_theta=c.rotary_base, partial_rotary_factor=c.rotary_percent))
